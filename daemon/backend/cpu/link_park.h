#pragma once

// Connections an elastic job's groups keep between epochs (record_links.h takes them over).

#include <cstddef>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace gradsync::backend::cpu {

/// Connections an elastic job's groups leave on this daemon at their epoch's end
/// (RecordLinks::Park), for the next epoch's groups to take over where the peer kept the same
/// connection (RecordLinks::Connect): a membership change re-links only the pairs of nodes it
/// changed. Per (job, peer node): the latest epoch's, at most kMaxPerPeer (the oldest go); each
/// is closed `keep` after it was parked unless taken (by a thread of its own: a job's last
/// epoch parks too). Thread-safe.
class LinkPark {
 public:
  struct Link {
    UniqueFd fd;
    std::string id;  // the connection's id, the same at both ends (its handshake's nonces)
    int epoch = 0;   // of the group that parked it
    absl::Time until;
  };
  /// Starts the thread that closes links past their time.
  explicit LinkPark(absl::Duration keep = absl::Seconds(20));
  ~LinkPark();  // closes every link kept
  LinkPark(const LinkPark&) = delete;
  LinkPark& operator=(const LinkPark&) = delete;
  static constexpr size_t kMaxPerPeer = 64;
  /// Keeps `link` to `node` for job `home`; those of earlier epochs to `node` are closed (and
  /// `link` is, when a later epoch's are there).
  void Put(const std::string& home, const std::string& node, Link link);
  /// Takes every link kept for `home` to one of `nodes`, by node.
  std::map<std::string, std::vector<Link>> Take(const std::string& home,
                                                const std::vector<std::string>& nodes);
  size_t size() const;  // links kept now

 private:
  void SweepLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Sweep() ABSL_LOCKS_EXCLUDED(mu_);  // the thread: closes each link at its time
  const absl::Duration keep_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<std::string, std::map<std::string, std::vector<Link>>> links_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the state above exists
};

}  // namespace gradsync::backend::cpu
