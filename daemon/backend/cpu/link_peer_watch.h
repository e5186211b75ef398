#pragma once

// LinkPeerWatch: the liveness of a job's daemons over links of its own, O(log N) of them per
// node, with heartbeats to a constant number of ring neighbours, sent and checked on one thread
// that nothing else runs on, and losses passed on over the links.

#include <poll.h>

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
#include "common/unique_fd.h"
#include "daemon/core/peer_watch.h"

namespace gradsync::backend::cpu {

/// Each job spanning nodes gets its own record links (record_links.h: the same authenticated
/// handshake, under the store prefix "watch/<run>/"), connected in the background by a thread
/// of the job's, then served by the watch's one thread, which sleeps in one poll over every
/// link of every job and wakes for what comes in, for the next heartbeat due, and every 50 ms.
///
/// Not a mesh: a node links only to those `ring` places from it each way around the job's ring
/// of nodes and to those 2, 4, 8, ... places away (link_plan.h: at most 2 * (ring + log2 N)
/// links), and exchanges heartbeats only with its ring neighbours (2 * ring of them, whatever the
/// job's size; `ring` 0: every peer, the mesh). A watched peer from which nothing came for
/// `timeout` ("no word for 1.5 s": frozen, or the network between is cut; the kernel of a
/// frozen daemon still ACKs TCP, so TCP keepalive could not tell) is suspected, and the
/// suspicion passed on; it is lost once two of its watchers suspect it within two timeouts (one,
/// when only one watches it): a link that drops packets delays one watcher's heartbeats by
/// TCP's retransmissions, never two at once (tools/sim/watch_sim.py). A linked peer is lost at
/// once when it never connected (unreachable) or its connection is closed or reset (its
/// daemon died). The node that finds a loss tells every node it links to, and each tells its own
/// links the first time it hears (at most about log2 N hops, each one message on an open link), so
/// every node of the job learns of every loss and why ("..., seen by node h:p"). A node that hears
/// that it is itself lost (it was frozen, or cut off, and its peers went on) counts every peer lost
/// ("expelled") and passes nothing on; a node reported lost is told so before its links are
/// dropped, and what a node lost reports is not believed. A peer whose job ended there says
/// goodbye first and is "left", not lost, and that is passed on the same way. The thread does
/// nothing else, so no op, however busy, delays it; a trainer's pause (GC, a long step) does not
/// count, since only daemons send heartbeats.
class LinkPeerWatch final : public core::PeerWatch {
 public:
  struct Options {
    absl::Duration timeout = absl::Milliseconds(1500);
    absl::Duration interval = absl::Milliseconds(250);
    absl::Duration connect_timeout = absl::Seconds(60);  // for every peer to connect
    int ring = 2;  // ring neighbours watched each way; 0: every peer (a mesh)
  };
  explicit LinkPeerWatch(Options options);
  /// Stops the thread and drops every watch (no callback runs after).
  ~LinkPeerWatch() override;

  void Watch(const std::string& job, const std::string& run, std::vector<std::string> nodes, int me,
             gradsync::Store* store, LostCallback on_lost) override;
  void Unwatch(const std::string& job) override;
  std::vector<core::PeerState> Peers(const std::string& job) const override;

  std::map<std::string, int64_t> LossCounts() const override;
  Totals GetTotals() const override;

 private:
  struct Entry;
  struct Notice;
  using Lost = std::vector<std::pair<LostCallback, std::pair<std::string, absl::Status>>>;
  void Run();
  // Goodbyes on the jobs that ended here, and reads of those lingering.
  void SayGoodbyes(std::vector<std::shared_ptr<Entry>>& leaving, absl::Time now);
  // One pass over `entry`: read, check ages, send. Appends the losses to report.
  void Serve(Entry& entry, Lost& lost);
  // Reads what linked peer `i` sent: heartbeats, a goodbye, notices (into `notices`). Not OK:
  // its link failed; `bye`: it said goodbye.
  absl::Status ReadFrom(Entry& e, int i, bool& heard, bool& bye, std::vector<Notice>& notices);
  // Marks node `i` of `e` lost or left (`loss`), seen here or told by `origin`; reports it
  // and passes it on. No-op when it was already.
  void Lose(Entry& e, int i, core::LossCause loss, const std::string& why, int origin, Lost& lost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Node `origin` (this one, or one that told) found its ring neighbour `i` silent: passed on
  // once; `i` is lost once the suspicions of it within two timeouts reach its quorum.
  void Suspect(Entry& e, int i, int origin, const std::string& why, Lost& lost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What node `from` told: a loss to believe and pass on, a suspicion, or this node's own
  // expulsion.
  void Heed(Entry& e, int from, const Notice& notice, Lost& lost)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `notice` to every linked peer still open but `except` (and the node it is about).
  void Spread(Entry& e, const Notice& notice, int except) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The poll set of every job's open links, with the job and peer of each; false when
  // something is already buffered.
  bool PollSet(const std::vector<std::shared_ptr<Entry>>& entries, std::vector<pollfd>& fds,
               std::vector<std::pair<Entry*, int>>& owners);

  const Options options_;
  UniqueFd wake_;  // an eventfd: Unwatch, a link formed, the end
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Entry>> jobs_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Entry>> leaving_ ABSL_GUARDED_BY(mu_);  // to say goodbye on
  // Links that said goodbye, read until their time is up, then closed (the thread's own).
  std::vector<std::pair<absl::Time, std::shared_ptr<Entry>>> closing_;
  std::map<std::string, int64_t> losses_ ABSL_GUARDED_BY(mu_);
  Totals totals_ ABSL_GUARDED_BY(mu_);  // the messages (links are counted when asked)
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the state above exists
};

}  // namespace gradsync::backend::cpu
