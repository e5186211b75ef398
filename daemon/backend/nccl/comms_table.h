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
#include "daemon/backend/nccl/aborter.h"
#include "daemon/backend/nccl/peer_signals.h"
#include "daemon/core/op_counters.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::backend::nccl {

struct LaunchedOp;  // launched_ops.h

/// At most this many NCCL bootstrap roots left behind by builds that failed on this node. Each
/// ncclGetUniqueId starts a detached thread with a listening socket that ends only once every
/// rank has checked in: nothing stops it (NVIDIA/nccl src/bootstrap.cc, bootstrapRoot). Past
/// this many the node makes no more ids (its groups' rank 0 cannot build) until it restarts.
inline constexpr int kMaxLeftBootstrapRoots = 32;

/// The NCCL state of one (job, group) on this node. Its `mu` is held while an op of the group
/// runs, and by whoever else looks at its communicators or launched ops (the watchdog, the
/// launch watcher, a job-wide abort, job end); the lock order is a group's `mu`, then
/// CommsTable's locks.
struct GroupComms : std::enable_shared_from_this<GroupComms> {
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
  // Communicators installed so far (InstallLocked); a job-wide abort revokes the generation it
  // found, and a group whose current generation is revoked settles no launched op as finished:
  // a revoked kernel returns early, and the events after it fire.
  std::atomic<uint64_t> generation{0};
  std::atomic<uint64_t> revoked_generation{0};
  mutable absl::Mutex reason_mu ABSL_ACQUIRED_AFTER(mu);
  absl::Status abort_reason ABSL_GUARDED_BY(reason_mu);
  // What the aborter found after the group's ops were answered (streams abandoned busy): said
  // by the group's next op that reports their failure.
  std::string abort_note ABSL_GUARDED_BY(reason_mu);

  /// The reason of the last job-wide abort.
  absl::Status AbortReason() const {
    absl::MutexLock lock(&reason_mu);
    return abort_reason;
  }
  /// The aborter's note since the last call, cleared.
  std::string TakeAbortNote() {
    absl::MutexLock lock(&reason_mu);
    return std::exchange(abort_note, std::string());
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

/// The launch locks of some devices, held (taken in ascending device order) while this lives.
class DeviceLaunches {
 public:
  explicit DeviceLaunches(std::vector<absl::Mutex*> locks) : locks_(std::move(locks)) {
    for (absl::Mutex* m : locks_) m->Lock();
  }
  ~DeviceLaunches() {
    for (auto it = locks_.rbegin(); it != locks_.rend(); ++it) (*it)->Unlock();
  }
  DeviceLaunches(const DeviceLaunches&) = delete;
  DeviceLaunches& operator=(const DeviceLaunches&) = delete;

 private:
  const std::vector<absl::Mutex*> locks_;
};

/// Every group's NCCL state on this node, and what may be done to one whose lock is held.
/// Store writes those steps decide (telling the other nodes) go to the caller's DeferredWrites,
/// made once the caller holds no group lock. NCCL's aborts run on the table's Aborter: the
/// caller hands the group's communicators, streams and unfinished ops over and goes on.
/// Thread-safe.
class CommsTable {
 public:
  /// `counters` may be null; `api` and `counters` must outlive this.
  CommsTable(gpu::GpuApi* api, absl::Duration abort_drain, core::OpCounters* counters,
             Aborter::Options aborter = {})
      : api_(api), abort_drain_(abort_drain), counters_(counters), aborter_(std::move(aborter)) {}

  gpu::GpuApi* api() const { return api_; }

  /// The group's state, made empty if it has none. Lock it, then check `erased`: one dropped
  /// meanwhile is no longer in the table (look it up again).
  std::shared_ptr<GroupComms> Get(const std::string& job, const std::string& group);
  /// The groups of `job` (empty: of every job), as they are now.
  std::vector<std::shared_ptr<GroupComms>> OfJob(const std::string& job);
  /// Empties the table, returning what it held (the backend's end).
  std::vector<std::shared_ptr<GroupComms>> TakeAll();

  /// Takes `c`'s communicators, streams and unfinished launched ops out of the group and hands
  /// them to the aborter, which revokes the communicators not revoked yet, aborts them, waits
  /// (at most abort_drain) until the streams are idle, then releases the ops (their buffers'
  /// mappings last). Returns at once, making no NCCL call: the group is empty, and its next op
  /// builds afresh. A group spanning nodes tells the other nodes (`broken` key, through
  /// `later`) with `why`. Answered ops not finished are remembered as failed for the group's
  /// next op; so is an abandoned drain (GroupComms::abort_note).
  void AbortLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  /// AbortLocked as `c`'s share of a job-wide abort (AbortJob): the aborter revokes the job's
  /// other groups' communicators too (those not revoked yet, as they were now) before it aborts
  /// these, whichever of the job's aborts it runs first.
  void AbortWithJobLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  /// AbortLocked, then takes it out of the table.
  void DropLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) ABSL_LOCKS_EXCLUDED(mu_);
  /// `c` failed: on another node's word (`peer_word`) only `c` is aborted (that node told the
  /// job's other groups itself); otherwise the whole job's communicators here are, `c`'s
  /// among them (AbortJob, AbortWithJobLocked).
  void AbortOnFailureLocked(GroupComms& c, const absl::Status& why, bool peer_word,
                            DeferredWrites& later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  /// Communicators built but never installed in a group (an op that failed first): aborted on
  /// the aborter.
  void AbortUnused(std::vector<gpu::Comm> comms, absl::string_view why);

  /// Aborts every communicator of `job` on this node. Makes no NCCL call and takes no group's
  /// lock: it counts an abort on the job's groups (an op preparing or polling fails at once
  /// with `reason`) and asks the aborter, which first revokes every communicator of the job, so
  /// that all their kernels return before any abort frees memory (freeing waits for the
  /// device), then asks each group to abort (abort_requested) and aborts the idle ones; a group
  /// running an op, or looked at by a watcher, aborts when it next looks.
  void AbortJob(const std::string& job, const absl::Status& reason);
  /// Waits until every abort asked for so far has run, at most `within` (tests, the end).
  bool FlushAborts(absl::Duration within) { return aborter_.Flush(within); }
  /// Runs the aborts queued, then stops the aborter's thread (the backend's end).
  void StopAborter() { aborter_.Stop(); }
  /// Aborts that ran past the aborter's hung_after so far.
  int hung_aborts() const { return aborter_.hung(); }
  /// Drops the communicators kept after their job ended (idle ones only) for which `which`
  /// (job, devices, kept until) says so, logging `why`.
  void DropKept(
      absl::string_view why,
      absl::FunctionRef<bool(const std::string&, const std::vector<int>&, absl::Time)> which,
      DeferredWrites& later);
  /// Drops communicators kept after their job ended that use any of `devices`, but those of
  /// `job` (kept for it).
  void DropKeptOn(const std::vector<int>& devices, const std::string& job, DeferredWrites& later);

  /// Holds the launch locks of `devices` (one thread launches on a device at a time: NCCL is
  /// not thread-safe across communicators of one device, and the GPU runs launches in the
  /// order they come under NCCL_LAUNCH_ORDER_IMPLICIT). After any group's lock.
  DeviceLaunches LaunchOn(std::vector<int> devices) ABSL_LOCKS_EXCLUDED(mu_);

  /// The communicators of `c` now become live (revocable); a new generation.
  void InstallLocked(GroupComms& c, std::vector<gpu::Comm> comms)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

  /// OK while fewer than kMaxLeftBootstrapRoots roots were left behind; else FAILED_PRECONDITION
  /// saying so and what to do.
  absl::Status MayMakeRoot() const;
  /// The build of a group whose id this node made failed: its bootstrap root is left behind.
  void RootLeft(const std::string& job, const std::string& group);
  int roots_left() const { return roots_left_.load(); }

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
  // Groups (as they were then: their generation) whose communicators an abort revokes.
  using Revoked = std::vector<std::pair<std::shared_ptr<GroupComms>, uint64_t>>;
  struct AbortTask;
  void AbortLocked(GroupComms& c, const absl::Status& why, bool job_wide, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // On the aborter: revokes, aborts, drains and releases what `task` holds.
  void RunAbort(AbortTask& task);
  // On the aborter: a job-wide abort (see AbortJob); `generations`: what each group had.
  void AbortJobNow(const std::string& job, const absl::Status& reason, const Revoked& found);
  // Revokes the communicators not revoked yet of `groups` that are of the generation given.
  // On the aborter's thread only, as every abort: none of them is aborted meanwhile.
  void Revoke(const Revoked& groups) ABSL_LOCKS_EXCLUDED(live_mu_);
  // ncclCommRevoke on `comm`, logging a failure (UNIMPLEMENTED, an NCCL without it, is silent:
  // the abort that follows stops the kernels then).
  void RevokeOne(gpu::Comm comm, const std::string& job, const std::string& group);
  // Waits until `streams` have no work left, at most abort_drain_: OK, or which were abandoned
  // still busy. Destroys them either way (a busy one is freed by CUDA once its work is done).
  absl::Status Drain(const std::string& job, const std::string& group,
                     const std::map<int, gpu::Stream>& streams);

  gpu::GpuApi* const api_;
  const absl::Duration abort_drain_;
  core::OpCounters* const counters_;
  std::atomic<int> comm_inits_{0};
  std::atomic<int> roots_left_{0};
  absl::Mutex mu_;  // after any group's mu (never held while taking one)
  std::map<std::pair<std::string, std::string>, std::shared_ptr<GroupComms>> comms_
      ABSL_GUARDED_BY(mu_);
  std::map<int, std::unique_ptr<absl::Mutex>> launch_locks_ ABSL_GUARDED_BY(mu_);  // by device
  absl::Mutex watch_mu_;  // after any group's mu (never held while taking one)
  std::map<const GroupComms*, std::shared_ptr<GroupComms>> launched_groups_
      ABSL_GUARDED_BY(watch_mu_);
  bool woken_ ABSL_GUARDED_BY(watch_mu_) = false;
  // Every installed communicator not yet revoked or aborted, with its group and generation:
  // revoked without the group's lock (an op may hold it, polling them).
  struct Live {
    const GroupComms* group;
    uint64_t generation;
  };
  absl::Mutex live_mu_;  // after any group's mu (never held while taking one)
  std::map<gpu::Comm, Live> live_ ABSL_GUARDED_BY(live_mu_);
  Aborter aborter_;  // last: its thread runs tasks that use the state above
};

}  // namespace gradsync::backend::nccl
