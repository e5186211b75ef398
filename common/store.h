#pragma once

// The Store interface: the job's rendezvous key-value store, namespaced per job, with every
// wait bounded by a deadline.

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gradsync {

/// Result of CompareSet: whether the value was replaced, and the value after the call.
struct CompareSetResult {
  bool swapped = false;
  std::string value;
};

/// The job's rendezvous key-value store (docs/architecture.md section 5).
///
/// Every key lives in a job namespace: the same key in two jobs is two entries. All methods are
/// thread-safe. Nothing waits without a deadline: the waiting calls fail with DeadlineExceeded,
/// naming the keys still missing, when `deadline` passes. Implementations: MemoryStore (held by
/// the job's root daemon) and StoreClient (any daemon or trainer, over gRPC).
class Store {
 public:
  using WaitId = uint64_t;
  /// Receives the values of the waited-for keys, in request order, or the error.
  using WaitCallback = std::function<void(absl::StatusOr<std::vector<std::string>>)>;

  virtual ~Store() = default;

  /// Creates or replaces `key`.
  virtual absl::Status Set(absl::string_view job, absl::string_view key, std::string value) = 0;

  /// Calls `done` exactly once: with the values once every key exists, DeadlineExceeded naming
  /// the missing keys at `deadline`, Cancelled after CancelWait, or Unavailable when the store
  /// shuts down. `done` may run inline (keys already present) or on a store thread, never with
  /// a store lock held. The returned id is valid until `done` has run.
  virtual WaitId WaitAsync(absl::string_view job, std::vector<std::string> keys,
                           absl::Time deadline, WaitCallback done) = 0;

  /// Makes a pending wait finish with Cancelled; a no-op once it has finished.
  virtual void CancelWait(WaitId id) = 0;

  /// Adds `delta` to the decimal int64 counter at `key` (absent = 0); returns the new value.
  /// FailedPrecondition if the value is not a decimal int64; OutOfRange on overflow.
  virtual absl::StatusOr<int64_t> Add(absl::string_view job, absl::string_view key,
                                      int64_t delta) = 0;

  /// Replaces the value with `desired` if it equals `expected` (nullopt: the key must be
  /// absent). Returns whether it did and the value after the call.
  virtual absl::StatusOr<CompareSetResult> CompareSet(absl::string_view job, absl::string_view key,
                                                      std::optional<std::string> expected,
                                                      std::string desired) = 0;

  /// Removes `key`; returns whether it existed. NotFound if the job has no keys at all.
  virtual absl::StatusOr<bool> Delete(absl::string_view job, absl::string_view key) = 0;

  /// Keys of `job` starting with `prefix`, sorted. NotFound if the job has no keys at all.
  virtual absl::StatusOr<std::vector<std::string>> List(absl::string_view job,
                                                        absl::string_view prefix) = 0;

  /// Blocks until every key exists or `deadline` passes; returns their values in order.
  /// The default runs WaitAsync and blocks on its callback; a remote store answers inline.
  virtual absl::StatusOr<std::vector<std::string>> WaitBlocking(absl::string_view job,
                                                                std::vector<std::string> keys,
                                                                absl::Time deadline);

  /// Blocks until `key` exists or `deadline` passes; returns its value.
  absl::StatusOr<std::string> Get(absl::string_view job, absl::string_view key,
                                  absl::Time deadline);

  /// Blocks until every key exists or `deadline` passes.
  absl::Status Wait(absl::string_view job, std::vector<std::string> keys, absl::Time deadline);
};

}  // namespace gradsync
