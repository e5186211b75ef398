#pragma once

// The NCCL state of every (job, group) on this node: one group's communicators, streams and
// launched ops (GroupComms), the one way to hold a group's lock (LockedComms), and the table of
// them with what may be done to a group whose lock is held: abort, drain, drop, keep; and which
// groups have launched ops to watch.

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"
#include "daemon/backend/nccl/peer_signals.h"
#include "daemon/core/op_counters.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::backend::nccl {

struct LaunchedOp;  // launched_ops.h

/// The NCCL state of one (job, group) on this node. Its `mu` is held while an op of the group
/// runs, and by whoever else looks at its communicators or launched ops (the watchdog, the
/// launch watcher, a job-wide abort, job end); the lock order is a group's `mu`, then
/// CommsTable's locks.
struct GroupComms {
  GroupComms(std::string job, std::string group) : job(std::move(job)), group(std::move(group)) {}

  const std::string job, group;
  absl::Mutex mu;
  std::vector<gpu::Comm> comms ABSL_GUARDED_BY(mu);  // per local member, ascending group rank
  std::vector<int> devices ABSL_GUARDED_BY(mu);      // the device of each
  std::vector<int> ranks ABSL_GUARDED_BY(mu);        // and its group rank (NCCL rank)
  int group_size ABSL_GUARDED_BY(mu) = 0;
  std::map<int, gpu::Stream> streams ABSL_GUARDED_BY(mu);  // the daemon's stream per device
  // Groups spanning nodes: the op the communicators were built at, and where and as whom to
  // say they were abandoned (null store: nobody to tell).
  uint64_t built_at ABSL_GUARDED_BY(mu) = 0;
  gradsync::Store* store ABSL_GUARDED_BY(mu) = nullptr;
  std::string node ABSL_GUARDED_BY(mu);
  std::string run ABSL_GUARDED_BY(mu);
  // The op whose id key this node (the group's rank 0) made last; deleted at the next build.
  std::optional<uint64_t> id_built_at ABSL_GUARDED_BY(mu);
  // After its job ended: kept for a restart until then (InfinitePast: in use, not kept).
  absl::Time kept_until ABSL_GUARDED_BY(mu) = absl::InfinitePast();
  bool erased ABSL_GUARDED_BY(mu) = false;   // no longer in the table: look it up again
  bool aborted ABSL_GUARDED_BY(mu) = false;  // since the last build (the next is a rebuild)
  // Ops answered once launched whose streams may still run them, oldest first (at most
  // kMaxLaunchedPerGroup); all on the current communicators: an abort settles them all.
  std::deque<std::shared_ptr<LaunchedOp>> launched ABSL_GUARDED_BY(mu);
  // Not OK: a launched op failed, or was aborted, before it finished; the group's next op fails
  // with it (launched_ops.h).
  absl::Status launch_failure ABSL_GUARDED_BY(mu);
  // A job-wide abort that found the group running an op: the op aborts when it next looks.
  std::atomic<bool> abort_requested{false};
  // Job-wide aborts so far: an op preparing without the lock (NcclCommunicator::Prepare) fails
  // when one comes meanwhile.
  std::atomic<uint64_t> aborts{0};
  mutable absl::Mutex reason_mu ABSL_ACQUIRED_AFTER(mu);
  absl::Status abort_reason ABSL_GUARDED_BY(reason_mu);

  /// The reason of the last job-wide abort.
  absl::Status AbortReason() const {
    absl::MutexLock lock(&reason_mu);
    return abort_reason;
  }
};

/// A group's lock, held for as long as this lives: the one way a GroupComms is locked.
class ABSL_SCOPED_LOCKABLE LockedComms {
 public:
  struct Adopt {};
  /// Blocks until the group is free (an op of it returns).
  explicit LockedComms(GroupComms* c) ABSL_EXCLUSIVE_LOCK_FUNCTION(c->mu) : c_(c) { c_->mu.Lock(); }
  /// Takes over the lock the caller holds (after a TryLock that succeeded).
  LockedComms(GroupComms* c, Adopt) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c->mu) : c_(c) {}
  ~LockedComms() ABSL_UNLOCK_FUNCTION() { c_->mu.Unlock(); }
  LockedComms(const LockedComms&) = delete;
  LockedComms& operator=(const LockedComms&) = delete;

 private:
  GroupComms* const c_;
};

/// Every group's NCCL state on this node, and what may be done to one whose lock is held.
/// Store writes those steps decide (telling the other nodes) go to the caller's DeferredWrites,
/// made once the caller holds no group lock. Thread-safe.
class CommsTable {
 public:
  /// `counters` may be null; `api` and `counters` must outlive this.
  CommsTable(gpu::GpuApi* api, absl::Duration abort_drain, core::OpCounters* counters)
      : api_(api), abort_drain_(abort_drain), counters_(counters) {}

  gpu::GpuApi* api() const { return api_; }

  /// The group's state, made empty if it has none. Lock it, then check `erased`: one dropped
  /// meanwhile is no longer in the table (look it up again).
  std::shared_ptr<GroupComms> Get(const std::string& job, const std::string& group);
  /// The groups of `job` (empty: of every job), as they are now.
  std::vector<std::shared_ptr<GroupComms>> OfJob(const std::string& job);
  /// Empties the table, returning what it held (the backend's end).
  std::vector<std::shared_ptr<GroupComms>> TakeAll();

  /// Aborts `c`'s communicators; they are rebuilt at the next op. A group spanning nodes tells
  /// the other nodes (`broken` key, through `later`) with `why`. Returns once the group's
  /// streams are idle: OK, or (after abort_drain) why they were abandoned still busy. Launched
  /// ops not finished before the abort are released once drained, and remembered as failed
  /// for the group's next op.
  absl::Status AbortLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  /// AbortLocked, destroys its streams and takes it out of the table.
  void DropLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) ABSL_LOCKS_EXCLUDED(mu_);
  void DestroyStreamsLocked(GroupComms& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

  /// Aborts every communicator of `job` on this node: idle groups now, a group running an op
  /// (possibly the caller's own, whose lock the caller may hold) when the op next looks.
  void AbortJob(const std::string& job, const absl::Status& reason, DeferredWrites& later);
  /// Drops the communicators kept after their job ended (idle ones only) for which `which`
  /// (job, devices, kept until) says so, logging `why`.
  void DropKept(
      absl::string_view why,
      absl::FunctionRef<bool(const std::string&, const std::vector<int>&, absl::Time)> which,
      DeferredWrites& later);
  /// Drops communicators kept after their job ended that use any of `devices`, but those of
  /// `job` (kept for it).
  void DropKeptOn(const std::vector<int>& devices, const std::string& job, DeferredWrites& later);

  /// A communicator was created (ncclCommInitRankConfig).
  void CountInit() { comm_inits_.fetch_add(1); }
  int comm_inits() const { return comm_inits_.load(); }
  /// A group's communicators were built again after an abort.
  void CountRebuild() {
    if (counters_ != nullptr) counters_->nccl_rebuilds.fetch_add(1);
  }
  /// An op answered once launched failed before it finished.
  void CountLaunchFailure() {
    if (counters_ != nullptr) counters_->nccl_launched_failures.fetch_add(1);
  }

  /// `c` has launched ops (call with its lock held): the launch watcher looks at it until
  /// ForgetLaunched.
  void NoteLaunched(std::shared_ptr<GroupComms> c) ABSL_LOCKS_EXCLUDED(watch_mu_);
  /// `c` has no launched ops left (call with its lock held).
  void ForgetLaunched(const GroupComms* c) ABSL_LOCKS_EXCLUDED(watch_mu_);
  /// The groups noted as having launched ops; waits up to `wait` while there are none (returns
  /// at once after WakeWatcher).
  std::vector<std::shared_ptr<GroupComms>> LaunchedGroups(absl::Duration wait)
      ABSL_LOCKS_EXCLUDED(watch_mu_);
  /// Ends LaunchedGroups' waits, now and from now on (the backend's end).
  void WakeWatcher() ABSL_LOCKS_EXCLUDED(watch_mu_);

 private:
  // Waits until `c`'s streams have no work left, at most abort_drain_; then abandons them.
  absl::Status DrainLocked(GroupComms& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

  gpu::GpuApi* const api_;
  const absl::Duration abort_drain_;
  core::OpCounters* const counters_;
  std::atomic<int> comm_inits_{0};
  absl::Mutex mu_;  // after any group's mu (never held while taking one)
  std::map<std::pair<std::string, std::string>, std::shared_ptr<GroupComms>> comms_
      ABSL_GUARDED_BY(mu_);
  absl::Mutex watch_mu_;  // after any group's mu (never held while taking one)
  std::map<const GroupComms*, std::shared_ptr<GroupComms>> launched_groups_
      ABSL_GUARDED_BY(watch_mu_);
  bool woken_ ABSL_GUARDED_BY(watch_mu_) = false;
};

}  // namespace gradsync::backend::nccl
