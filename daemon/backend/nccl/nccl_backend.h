#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/backend/nccl/gpu_api.h"
#include "daemon/core/backend.h"
#include "daemon/core/op_counters.h"

namespace gradsync::backend::nccl {

struct NcclOptions {
  /// > 0: a watchdog thread looks at idle communicators this often (an op looks at its own while
  /// it runs). A group whose communicators report an error has them aborted on this node, and
  /// the other nodes are told (`broken`); the next op rebuilds them.
  absl::Duration watch_every = absl::ZeroDuration();
  /// > 0: when a job ends, the communicators of its groups that lie on this node alone are kept
  /// this long for a job with the same id and rank layout (trainers restarted), which then skips
  /// NCCL's initialisation. Groups spanning nodes are dropped at once: every node rebuilds them.
  /// Kept communicators past their time go at the watchdog's next look.
  absl::Duration keep_after_job = absl::ZeroDuration();
  /// After aborting a group's communicators, how long to wait for the group's streams to go
  /// idle. ncclCommAbort on a non-blocking communicator may return while NCCL's aborted kernels
  /// still run on them, and the op's buffers (CUDA IPC mappings) are released when the op
  /// returns: unmapping under a live kernel is a sticky illegal-address error for the whole
  /// daemon. Past this bound the streams are abandoned (logged, named in the op's error, and
  /// replaced at the next op).
  absl::Duration abort_drain = absl::Seconds(10);
  /// Aborts and rebuilds are counted here (nccl_aborts, nccl_rebuilds); may be null. Must
  /// outlive the backend.
  core::OpCounters* counters = nullptr;
};

/// The GPU data plane: collectives on trainers' CUDA buffers with NCCL communicators the daemon
/// owns. One NCCL communicator per local member of a group (NCCL rank = group rank), all of a
/// node's members driven inside one ncclGroupStart/End. The unique id travels through the job's
/// store under a key named by the op that builds the communicator, so every node agrees on it.
/// Communicators are created non-blocking and polled, bounded by the op's deadline.
///
/// Communicators are kept per (job, group) by the backend, not by the engine's Communicator
/// objects. When the job ends (JobEnded), those of groups on this node alone may be kept for a
/// restart of the job with the same rank layout (NcclOptions::keep_after_job).
///
/// Health: while an op runs, the daemon polls its streams and ncclCommGetAsyncError. On an
/// error or at the deadline it aborts every NCCL communicator of the job on this node together
/// (a communicator's local ranks must abort together), fails the op with the reason, and the
/// next op of each aborted group builds its communicators again. Every abort waits (bounded by
/// NcclOptions::abort_drain) until the group's streams are idle, so an op never returns, and
/// its buffers are never unmapped, while its kernels may still touch them.
///
/// Groups spanning nodes tell each other through the job's store, so that no node waits out
/// its deadline for a peer that has already given up: a node that fails op `s` of a group (for
/// any reason, its own trainers' included) sets `nccl/<run>/<group>/fail/<s>`, and a node that
/// abandons communicators built at op `b` sets `nccl/<run>/<group>/broken/<b>` (`run`: the
/// CommunicatorSpec's token of this run of the job). An op that has run for 100 ms watches both
/// keys; when one appears it aborts the group's communicators here and fails with the other
/// node's reason. Such a failure does not abort
/// the job's other groups: the node that failed first has told them itself. A slow op also
/// publishes its fingerprint under `nccl/<run>/<group>/op/<seq>/<node>` and compares the other
/// nodes' with it: ranks on different nodes that submitted different ops fail with "desync"
/// instead of hanging in NCCL (an op that completes removes its fingerprint). Thread-safe.
class NcclBackend final : public core::Backend {
 public:
  explicit NcclBackend(gpu::GpuApi* api, NcclOptions options = {});
  ~NcclBackend() override;

  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec& spec) override;

  /// Aborts every communicator of `job` on this node (see above).
  void AbortJob(const std::string& job, const absl::Status& reason);
  /// Drops the job's communicators (after aborting any still live), or keeps them for a restart
  /// (NcclOptions::keep_after_job).
  void JobEnded(const std::string& job);

  /// Stops the watchdog thread (idempotent; the destructor does it too). Call before the
  /// stores the communicators report to go away.
  void StopWatchdog();

  /// NCCL communicators created so far (ncclCommInitRankConfig calls), for tests.
  int comm_inits() const { return comm_inits_.load(); }

 private:
  friend class NcclCommunicator;
  /// The NCCL state of one (job, group) on this node.
  struct Comms {
    std::string job, group;                            // set once, before it is shared
    absl::Mutex mu;                                    // held while an op of the group runs
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
    bool erased ABSL_GUARDED_BY(mu) = false;   // no longer in comms_: look it up again
    bool aborted ABSL_GUARDED_BY(mu) = false;  // since the last build (the next is a rebuild)
    std::atomic<bool> abort_requested{false};
    absl::Mutex reason_mu;
    absl::Status abort_reason ABSL_GUARDED_BY(reason_mu);
  };
  std::shared_ptr<Comms> CommsFor(const std::string& job, const std::string& group);
  // The group's Comms with its mu held (the caller unlocks it).
  std::shared_ptr<Comms> LockedCommsFor(const std::string& job, const std::string& group);
  // The Comms of `job` (empty: of every job), as they are now.
  std::vector<std::shared_ptr<Comms>> Listed(const std::string& job);
  // Aborts `c`'s communicators (telling the other nodes `why`), destroys its streams and takes
  // it out of comms_ (its mu held; mu_ is taken inside, the one lock order).
  void DropLocked(Comms& c, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // Aborts `c`'s communicators (its mu held); they are rebuilt at the next op. A group spanning
  // nodes tells the other nodes (`broken` key) with `why`. Returns once the group's streams are
  // idle: OK, or (after NcclOptions::abort_drain) why they were abandoned still busy.
  absl::Status AbortLocked(Comms& c, const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // Waits until `c`'s streams have no work left, at most abort_drain; then abandons them.
  absl::Status DrainLocked(Comms& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  void DestroyStreamsLocked(Comms& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // One look at every idle group's communicators (the watchdog's tick).
  void WatchIdle();
  // Drops communicators kept after their job ended that use any of `devices`, but those of
  // `job` (kept for it).
  void DropKeptOn(const std::vector<int>& devices, const std::string& job);
  // Drops the kept communicators `which` selects (idle ones only), logging `why`.
  void DropKept(absl::string_view why, const std::function<bool(const Comms&)>& which);

  gpu::GpuApi* const api_;
  const NcclOptions options_;
  std::atomic<int> comm_inits_{0};
  absl::Mutex mu_;
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Comms>> comms_ ABSL_GUARDED_BY(mu_);
  absl::Notification stop_;
  std::thread watchdog_;  // last: starts once everything above exists
};

/// Routes each op of a group to the data plane its buffers live on: host memory to `cpu`,
/// device memory to `gpu`. Ops without buffers (barrier, empty ops) go to `cpu`. An op mixing
/// both is INVALID_ARGUMENT.
class DispatchBackend final : public core::Backend {
 public:
  DispatchBackend(core::Backend* cpu, core::Backend* gpu) : cpu_(cpu), gpu_(gpu) {}
  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec& spec) override;

 private:
  core::Backend* const cpu_;
  core::Backend* const gpu_;
};

}  // namespace gradsync::backend::nccl
