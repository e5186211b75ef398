#pragma once

// LinkPeerWatch: the liveness of a job's daemons over links of its own, one per pair of nodes,
// with heartbeats sent and checked on one thread that nothing else runs on.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/peer_watch.h"

namespace gradsync::backend::cpu {

/// Each job spanning nodes gets its own record links (record_links.h: the same authenticated
/// handshake, under the store prefix "watch/<run>/"), connected in the background by a thread
/// of the job's, then served by the watch's one thread: every `interval` it sends each peer a
/// heartbeat and reads what the peers sent. A peer is lost when nothing came from it for
/// `timeout` ("no word for 1.5 s": frozen, or the network between is cut; the kernel of a
/// frozen daemon still ACKs TCP, so TCP keepalive could not tell), when its connection is
/// closed or reset (its daemon died), or when it never connected (unreachable). A peer whose
/// job ended there says goodbye first and is "left", not lost. The thread does nothing else,
/// so no op, however busy, delays it; a trainer's pause (GC, a long step) does not count,
/// since only daemons send heartbeats.
class LinkPeerWatch final : public core::PeerWatch {
 public:
  struct Options {
    absl::Duration timeout = absl::Milliseconds(1500);
    absl::Duration interval = absl::Milliseconds(250);
    absl::Duration connect_timeout = absl::Seconds(60);  // for every peer to connect
  };
  explicit LinkPeerWatch(Options options);
  /// Stops the thread and drops every watch (no callback runs after).
  ~LinkPeerWatch() override;

  void Watch(const std::string& job, const std::string& run, std::vector<std::string> nodes, int me,
             gradsync::Store* store, LostCallback on_lost) override;
  void Unwatch(const std::string& job) override;
  std::vector<core::PeerState> Peers(const std::string& job) const override;

  std::map<std::string, int64_t> LossCounts() const override;

 private:
  struct Entry;
  void Run();
  // One pass over `entry`: read, check ages, send. Appends the losses to report.
  void Serve(Entry& entry,
             std::vector<std::pair<LostCallback, std::pair<std::string, absl::Status>>>& lost);

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Entry>> leaving_ ABSL_GUARDED_BY(mu_);  // to say goodbye on
  // Links that said goodbye, read until their time is up, then closed (the thread's own).
  std::vector<std::pair<absl::Time, std::shared_ptr<Entry>>> closing_;
  std::map<std::string, int64_t> losses_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the state above exists
};

}  // namespace gradsync::backend::cpu
