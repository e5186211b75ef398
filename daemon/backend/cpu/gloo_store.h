#pragma once

// Gloo's rendezvous store on top of the job's gradsync Store, so daemons' Gloo contexts
// rendezvous through it.

#include <chrono>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "common/store.h"
#include "gloo/rendezvous/store.h"

namespace gradsync::backend::cpu {

/// Gloo's rendezvous store over gradsync's Store (the job's store: the daemon's own MemoryStore
/// on the root node, a StoreClient elsewhere), so Gloo contexts between daemons rendezvous
/// through the job's store: no file store, no extra server. Keys live in `job` under `prefix`.
///
/// Gloo's interface reports failure by exception; this adapter throws gloo::IoException (with
/// the store's message) and the code that drives Gloo catches it at its edge and turns it into
/// an absl::Status. Every wait is bounded: by the caller's timeout, else `default_timeout`.
class GlooStore final : public ::gloo::rendezvous::Store {
 public:
  GlooStore(gradsync::Store* store, std::string job, std::string prefix,
            absl::Duration default_timeout);

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  std::string Key(const std::string& key) const { return prefix_ + key; }

  gradsync::Store* const store_;
  const std::string job_;
  const std::string prefix_;
  const absl::Duration default_timeout_;
};

}  // namespace gradsync::backend::cpu
