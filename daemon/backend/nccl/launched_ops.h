#pragma once

// Device ops answered once launched and watched until the GPU has finished them: what a group
// keeps of each such op (LaunchedOp), and the looks at a group's launched ops that settle the
// finished ones and catch the failure of one that has not finished (an async NCCL error, a
// job-wide abort, another node's word, its deadline): the group's communicators are then
// aborted and drained, and the failure is remembered for the group's next op.

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/backend/nccl/comms_table.h"
#include "daemon/backend/nccl/peer_signals.h"
#include "daemon/core/backend.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::backend::nccl {

/// At most this many ops of one group launched and not known finished: the group's next op
/// waits (under its own deadline) for the oldest to finish. Bounds what a group holds (events,
/// buffer mappings, watches) while its GPU falls behind its trainers.
inline constexpr size_t kMaxLaunchedPerGroup = 64;

/// One device op of a group from its Run on: launched on the group's streams (or about to be),
/// and owned by the group (GroupComms::launched, under its lock) from its launch until it is
/// settled: finished on the device, or failed or aborted with its streams drained. Then it is
/// released once no group lock is held (DeferredWrites): its watch on the other nodes ends and
/// its buffers' mappings are let go. Used under its group's lock only.
struct LaunchedOp {
  /// `store`: the job's store when the group spans nodes (null: nothing to watch).
  LaunchedOp(std::shared_ptr<const core::CommunicatorSpec> spec, const core::Collective& op,
             gradsync::Store* store, std::string fingerprint);

  const std::shared_ptr<const core::CommunicatorSpec> spec;
  const core::Collective op;  // the engine's, without its members; it holds their mappings
  PeerFailureWatch peers;     // the other nodes' word on it, and the fingerprint check
  /// Per device of the op: an event of the daemon's recorded after the op on that device's
  /// stream. The op has finished once every one is done.
  std::vector<std::pair<int, gpu::Event>> finished;
  /// In its group's list (GroupComms::launched): from the moment its kernels may be queued;
  /// an abort then takes it, with its buffers, until the streams are drained.
  bool in_group = false;
  /// Answered OK to the trainers; until then its Run owns the outcome (its watch's end too).
  std::atomic<bool> answered{false};
};

/// One look at `c`'s launched ops, without blocking: those finished (oldest first) are settled
/// and released; when one that has not finished failed (its event or a communicator reports
/// an error, the job's communicators were aborted, another node's word, its deadline passed),
/// the group is aborted and drained as FailLaunchedLocked says. Only the oldest op watches the
/// other nodes' word (the others finish after it on the same streams).
void LookAtLaunchedLocked(CommsTable& table, GroupComms& c, DeferredWrites& later)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

/// Looks (pacing with Backoff) until at most `keep` launched ops are left: OK, also when a
/// failure settled them all (then `c.launch_failure` says so); DEADLINE_EXCEEDED when
/// `deadline` passes first.
absl::Status AwaitLaunchedLocked(CommsTable& table, GroupComms& c, size_t keep, absl::Time deadline,
                                 DeferredWrites& later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

/// Launched op `failed` of `c` failed with `why` before it finished: remembers it for the
/// group's next op (c.launch_failure, ABORTED naming it), aborts and drains the group's
/// communicators (every launched op goes with them), the job's others on this node unless the
/// failure is another node's word, and tells the other nodes (`fail/<seq>`) unless they know.
void FailLaunchedLocked(CommsTable& table, GroupComms& c, const std::shared_ptr<LaunchedOp>& failed,
                        const absl::Status& why, DeferredWrites& later)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

/// For CommsTable::AbortLocked, before it aborts `c`'s communicators: settles the launched ops
/// that have finished, and returns the others (remembering, unless a failure is already, that
/// they were aborted with `why`). Release them with ReleaseAborted once the streams are
/// drained.
std::vector<std::shared_ptr<LaunchedOp>> TakeUnfinishedLocked(gpu::GpuApi* api, GroupComms& c,
                                                              const absl::Status& why,
                                                              DeferredWrites& later)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
/// Releases aborted ops once their streams are drained (their events now; their watches and
/// buffers through `later`). Needs no group lock: the ops are out of their group.
void ReleaseAborted(gpu::GpuApi* api, std::vector<std::shared_ptr<LaunchedOp>> ops,
                    const absl::Status& why, DeferredWrites& later);

/// The failure remembered on `c` for its next op, now reported by op `op`: ABORTED naming the
/// failed op, or OK when there is none. Forgotten once taken.
absl::Status TakeLaunchFailureLocked(GroupComms& c, const core::Collective& op)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

}  // namespace gradsync::backend::nccl
