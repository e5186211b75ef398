#pragma once

// The core's seam to the liveness of the other daemons of a job spanning nodes
// (docs/architecture.md section 4, Faults): implemented over links of its own
// (backend/cpu/link_peer_watch.h), faked in tests.

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/store.h"

namespace gradsync::core {

/// Why a peer was lost (or that it left), decided where the watch saw it happen.
enum class LossCause {
  kNone,
  kSilent,       // no word within the timeout: frozen, or the network between is cut
  kClosed,       // its end of the link closed: its daemon is gone
  kReset,        // the connection was reset: its daemon is gone
  kUnreachable,  // never reached, or no word since its link formed
  kError,        // any other failure of the link
  kLeft,         // it left the job on purpose (not a loss)
  kExpelled,     // this node's peers declared it lost (it was frozen or cut off): all are lost
};

/// The metrics' name: "silent", "closed", "reset", "unreachable", "error", "left", "expelled"
/// ("" for kNone).
inline const char* LossCauseName(LossCause cause) {
  switch (cause) {
    case LossCause::kNone:
      return "";
    case LossCause::kSilent:
      return "silent";
    case LossCause::kClosed:
      return "closed";
    case LossCause::kReset:
      return "reset";
    case LossCause::kUnreachable:
      return "unreachable";
    case LossCause::kError:
      return "error";
    case LossCause::kLeft:
      return "left";
    case LossCause::kExpelled:
      return "expelled";
  }
  return "invalid";
}

/// A peer daemon of a job as this node sees it.
struct PeerState {
  enum class State { kConnecting, kAlive, kLost, kLeft };
  std::string node;  // "host:port"
  State state = State::kConnecting;
  absl::Duration last_heard = absl::InfiniteDuration();  // since its last word (never: infinite)
  LossCause loss = LossCause::kNone;                     // kLost, kLeft: why
  std::string cause;                                     // kLost, kLeft: why, in words
};

/// Watches the other daemons of each job spanning nodes, independently of ops: a peer that is
/// gone, frozen or unreachable is declared lost within the watch's timeout, whether or not an
/// op is pending. Thread-safe.
class PeerWatch {
 public:
  /// `node` lost: `cause` is UNAVAILABLE with a message saying why ("lost: no word for 1.5 s",
  /// "lost: the connection was closed ...", ...); or `node` left the job on purpose (its
  /// trainers there ended): CANCELLED "left the job ...", and everything it sent before stays
  /// readable on the job's links (ops it took part in can still complete). Runs on the watch's
  /// thread with none of its locks held, once per peer and job; it may take the engine's locks but
  /// must not call back into the watch.
  using LostCallback = std::function<void(const std::string& node, const absl::Status& cause)>;

  virtual ~PeerWatch() = default;
  /// Starts watching the other members of `nodes` (this node is nodes[me]) for `job`'s run
  /// `run`, rendezvousing through the job's `store` (which must outlive the watch of the job).
  /// Returns at once; connecting happens in the background, bounded by the watch's own
  /// deadline (a peer that never connects is lost as unreachable). A second Watch of a job
  /// replaces the first.
  virtual void Watch(const std::string& job, const std::string& run, std::vector<std::string> nodes,
                     int me, gradsync::Store* store, LostCallback on_lost) = 0;
  /// Stops watching `job` (its peers are told it left on purpose). No callback for it runs
  /// after this returns.
  virtual void Unwatch(const std::string& job) = 0;
  /// The job's peers (empty when not watched).
  virtual std::vector<PeerState> Peers(const std::string& job) const = 0;
  /// Peers lost since start, by LossCauseName (never "left"); "expelled" counts the times this
  /// node was declared lost by its peers.
  virtual std::map<std::string, int64_t> LossCounts() const = 0;

  /// What watching costs this daemon, over every job: links open now, and messages sent since
  /// start (heartbeats; notices of a peer lost or left, passed on).
  struct Totals {
    int64_t links = 0;
    int64_t heartbeats_sent = 0;
    int64_t notices_sent = 0;
  };
  virtual Totals GetTotals() const { return {}; }
};

/// "connecting", "alive", "lost", "left".
inline const char* PeerStateName(PeerState::State state) {
  switch (state) {
    case PeerState::State::kConnecting:
      return "connecting";
    case PeerState::State::kAlive:
      return "alive";
    case PeerState::State::kLost:
      return "lost";
    case PeerState::State::kLeft:
      return "left";
  }
  return "invalid";
}

}  // namespace gradsync::core
