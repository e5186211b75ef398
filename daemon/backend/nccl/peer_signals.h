#pragma once

// Cross-node failure signalling for NCCL groups spanning nodes, through the job's store: the
// keys a group's nodes write and watch, the write that is dropped once the run of the job is
// over, the writes a group's lock defers until it is released, and the watch an op keeps on
// the other nodes' word while it runs. The protocol is described on NcclBackend.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"
#include "daemon/core/backend.h"

namespace gradsync::backend::nccl {

/// "nccl/<run>/<group>/fail/<seq>": a node failed op `seq` of the group (the value says why).
std::string FailKey(const core::CommunicatorSpec& spec, uint64_t seq);
/// "nccl/<run>/<group>/broken/<b>": a node abandoned the communicators built at op `b`.
std::string BrokenKey(const std::string& run, const std::string& group, uint64_t built_at);
/// "nccl/<run>/<group>/<b>/id": the NCCL unique id of the communicators op `b` builds.
std::string IdKey(const core::CommunicatorSpec& spec, uint64_t built_at);

/// Writes `key` for the other nodes of run `run` of `job`, unless that run is over at the root
/// (its keys deleted, or a new run begun): a late write would only bring the job's namespace
/// back in the root's store, with nobody to read it. Logs what it could not write; returns
/// whether it wrote. Synchronous: never call it with a group's lock held (see DeferredWrites).
bool WriteWhileRunLasts(gradsync::Store* store, const std::string& job, const std::string& run,
                        const std::string& key, std::string value);

/// Store writes decided while a group's lock is held, made when this object goes (or at
/// Flush): declared before the lock, it outlives it, so that no remote call waits under a
/// group's lock. The same holds for the release of launched ops settled under the lock (their
/// watch may write, their buffers' mappings close: Defer). Not thread-safe: one per thread of
/// work.
class DeferredWrites {
 public:
  DeferredWrites() = default;
  DeferredWrites(const DeferredWrites&) = delete;
  DeferredWrites& operator=(const DeferredWrites&) = delete;
  ~DeferredWrites() { Flush(); }

  /// WriteWhileRunLasts, later.
  void WriteWhileRunLasts(gradsync::Store* store, std::string job, std::string run, std::string key,
                          std::string value);
  /// Store::Delete, later (its result ignored: the key is of no more use).
  void Delete(gradsync::Store* store, std::string job, std::string key);
  /// Runs `fn` later, in order with the writes (it may write to the store or release
  /// resources; it must not take a group's lock).
  void Defer(std::function<void()> fn) { writes_.push_back(std::move(fn)); }
  /// Makes the writes so far, in the order they were asked for.
  void Flush();

 private:
  std::vector<std::function<void()>> writes_;
};

/// One key of the job's store, waited for in the background from construction until it comes,
/// the deadline passes or this object goes (the wait is cancelled). Thread-safe.
class BackgroundKeyWait {
 public:
  BackgroundKeyWait(gradsync::Store* store, const std::string& job, std::string key,
                    absl::Time deadline);
  ~BackgroundKeyWait();
  BackgroundKeyWait(const BackgroundKeyWait&) = delete;
  BackgroundKeyWait& operator=(const BackgroundKeyWait&) = delete;

  /// The value, once the key exists.
  std::optional<std::string> value() const;

 private:
  struct State {
    absl::Mutex mu;
    bool finished ABSL_GUARDED_BY(mu) = false;
    std::optional<std::string> value ABSL_GUARDED_BY(mu);
  };
  gradsync::Store* const store_;
  const std::shared_ptr<State> state_;  // shared with the callback, which may outlive this
  gradsync::Store::WaitId id_ = 0;
};

/// What the other nodes of a group spanning nodes say about the op this node runs: `fail/<seq>`
/// for the op itself, `broken/<b>` for the communicators it runs on (built at op `b`, from the
/// time it knows them), and a fingerprint under `op/<seq>/` that differs from this node's
/// (the nodes' ranks submitted different ops: NCCL would hang on them, or mix them). The store
/// is watched only once the op has run for kWatchAfter, so that an op that completes quickly
/// costs the store nothing. Check() makes no store call of its own: the words and the other
/// nodes' fingerprints are waited for in the background, and this node's fingerprint is written
/// by a helper thread (joined by Finished() or the destructor), so that a group's lock held
/// around it never waits for a store round trip. One per op, used by one thread at a time (the
/// op's, then whoever holds its group's lock); not thread-safe.
class PeerFailureWatch {
 public:
  /// An op that has run this long starts watching the store for other nodes' word on it: long
  /// enough that healthy ops seldom do (each look costs the job's root store a few calls), short
  /// against the deadline the other nodes would otherwise wait out.
  static constexpr absl::Duration kWatchAfter = absl::Milliseconds(100);

  /// `store` null: a group on one node, nothing to watch. `spec` and `op` must outlive this.
  /// `fingerprint`: the op as this node runs it, which the nodes compare (the engine's
  /// fingerprint, and what the communicator adds to it: its segmentation of the data).
  PeerFailureWatch(gradsync::Store* store, const core::CommunicatorSpec& spec,
                   const core::Collective& op, std::string fingerprint)
      : store_(store), spec_(spec), op_(op), fingerprint_(std::move(fingerprint)) {}
  ~PeerFailureWatch();
  PeerFailureWatch(const PeerFailureWatch&) = delete;
  PeerFailureWatch& operator=(const PeerFailureWatch&) = delete;

  /// The op runs on communicators built at op `built_at` (its own seq when it built them; none
  /// while it is building them).
  void RunsOn(std::optional<uint64_t> built_at) { built_at_ = built_at; }
  /// While set, Check (and the waits that call it) first asks `interrupt`: not OK ends them with
  /// that status (the group's job-wide abort, while the op prepares without its group's lock).
  void InterruptWith(std::function<absl::Status()> interrupt) { interrupt_ = std::move(interrupt); }
  /// What the interrupt says now (OK when none is set); no store call.
  absl::Status Interrupted() const { return interrupt_ ? interrupt_() : absl::OkStatus(); }

  /// OK, or the reason another node's word gives: ABORTED (it failed the op or abandoned the
  /// communicators) or FAILED_PRECONDITION (desync). Past kWatchAfter it starts the background
  /// waits (and the publishing of this node's fingerprint, once); it never waits on the store.
  absl::Status Check();
  /// Before the op's first NCCL call: publishes this node's fingerprint at once and waits, until
  /// the op's deadline, for those of `other_nodes` (the group's other nodes), comparing each as
  /// it comes: OK when all match; FAILED_PRECONDITION "desync across nodes" naming both on a
  /// mismatch; another node's word (as Check); DEADLINE_EXCEEDED naming the nodes that never
  /// published. For ops whose calls depend on more than the engine's fingerprint (a fused op's
  /// segmentation), which may otherwise complete, mismatched, before kWatchAfter.
  absl::Status CompareBeforeLaunch(const std::vector<std::string>& other_nodes);
  /// Whether the op failed because of another node's word (then that node has told the job's
  /// other groups itself).
  bool failed_on_peer_word() const { return peer_broke_comms_ || peer_failed_op_ || desync_; }
  /// Whether the other nodes know already, or find out by themselves, that this op failed.
  bool peers_know() const { return peer_failed_op_ || desync_; }

  /// The op is over (call it with no group lock held: it may write to the store). A fingerprint
  /// published for an op that completed is of no more use; after a failure it stays, for the
  /// nodes still comparing (failures are few).
  void Finished(const absl::Status& result);

 private:
  std::string FingerprintKey(absl::string_view node) const;
  // The desync error for node `node`'s fingerprint `theirs`.
  absl::Status Desync(absl::string_view node, absl::string_view theirs) const;
  // Waits in the background for the fingerprints of `nodes` (once per node).
  void WatchFingerprints(const std::vector<std::string>& nodes);
  // The fingerprints arrived so far, against this node's: a desync, or OK.
  absl::Status CompareArrived();
  // Writes this node's fingerprint on a helper thread (once).
  void PublishInBackground();
  // Waits for that helper (outside any group's lock: Finished, the destructor).
  void JoinPublisher();

  gradsync::Store* const store_;
  const core::CommunicatorSpec& spec_;
  const core::Collective& op_;
  const std::string fingerprint_;
  std::optional<uint64_t> built_at_;
  std::function<absl::Status()> interrupt_;
  const absl::Time start_ = absl::Now();
  std::optional<BackgroundKeyWait> fail_, broken_;
  std::map<std::string, std::unique_ptr<BackgroundKeyWait>> theirs_;  // by node
  std::set<std::string> compared_;  // nodes whose fingerprint matched
  bool publishing_ = false;         // this node's fingerprint is (being) written
  // 0: not (yet) written; 1: written; 2: not written (the run is over at the root).
  std::shared_ptr<std::atomic<int>> published_ = std::make_shared<std::atomic<int>>(0);
  std::thread publisher_;
  bool peer_broke_comms_ = false, peer_failed_op_ = false, desync_ = false;
};

}  // namespace gradsync::backend::nccl
