#pragma once

// The GPU data plane's lifecycle on this node: the table of NCCL communicators it owns, the
// watchdog over idle ones, and what a job's end does to them (dropped, or kept for a restart).

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/backend/nccl/comms_table.h"
#include "daemon/core/backend.h"
#include "daemon/core/op_counters.h"
#include "daemon/gpu/gpu_api.h"

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
  /// NCCL's aborts run on a thread of their own (aborter.h); one still running this long is
  /// reported: an error line, the nccl_aborts_hung counter, and on_abort_hung.
  absl::Duration abort_hung_after = absl::Seconds(30);
  /// Told when an abort runs past abort_hung_after (the daemon's health goes NOT_SERVING), and
  /// when it returns at last; may be null.
  std::function<void(const absl::Status&)> on_abort_hung;
  std::function<void()> on_abort_returned;
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
/// Launched, not finished: an op is answered once the trainers' "ready" events have completed
/// (polled from the host: the daemon's streams never wait on another process), NCCL has
/// enqueued it on the daemon's streams and the trainers' "done" events are recorded after it;
/// the trainers' streams wait on those, their hosts do not. The group keeps the op (with its
/// buffers' mappings, an event marking its end on each stream, its deadline and its watch on
/// the other nodes) until the GPU has run it: looked at, without blocking, at the start of the
/// group's next op, and by the launch watcher thread meanwhile. At most kMaxLaunchedPerGroup
/// per group; the next op waits for the oldest.
///
/// Health: while an op launches and until it has finished, the daemon polls its streams and
/// ncclCommGetAsyncError. On an error or at the deadline it aborts every NCCL communicator of
/// the job on this node together (a communicator's local ranks must abort together); an op not
/// yet answered fails with the reason, one already answered fails the group's next op (ABORTED,
/// naming it and saying its results are not valid), and the op after that builds the group's
/// communicators again. ncclCommAbort blocks (seconds under load): every abort runs on the
/// aborter's thread (aborter.h), never on the peer watch's, gRPC's or an op's; the job's
/// communicators are all revoked (their kernels return) before the first is aborted, since an
/// abort frees device memory, which waits for the device. An abort waits (bounded by
/// NcclOptions::abort_drain) until the group's streams are idle before it releases the ops'
/// buffers, so no buffer is unmapped while its kernels may still touch it.
///
/// Groups spanning nodes tell each other through the job's store, so that no node waits out
/// its deadline for a peer that has already given up: a node that fails op `s` of a group (for
/// any reason, its own trainers' included) sets `nccl/<run>/<group>/fail/<s>`, and a node that
/// abandons communicators built at op `b` sets `nccl/<run>/<group>/broken/<b>` (`run`: the
/// CommunicatorSpec's token of this run of the job). An op that has run for 100 ms (launched
/// or not) watches both keys; when one appears it aborts the group's communicators here and
/// fails (a launched op: the group's next op) with the other node's reason. Such a failure
/// does not abort the job's other groups: the node that failed first has told them itself. A
/// slow op also publishes its fingerprint under `nccl/<run>/<group>/op/<seq>/<node>` and
/// compares the other nodes' with it: ranks on different nodes that submitted different ops
/// fail with "desync" naming both instead of hanging in NCCL (an op that completes removes its
/// fingerprint). A fused op (ALL_REDUCE, BROADCAST) in several segments publishes and compares
/// before its first NCCL call, so that one split differently on another node fails before it
/// could complete with garbage. What a failure
/// or an abort decides to tell the other nodes is written once the group's lock is released
/// (DeferredWrites); only the op's own rendezvous (the unique id, the watch above) reads and
/// writes the store while the op holds its group's lock.
///
/// The communicators themselves live in a CommsTable, one group's collectives in an
/// NcclCommunicator, the word between nodes in peer_signals.h. Thread-safe.
class NcclBackend final : public core::Backend {
 public:
  explicit NcclBackend(gpu::GpuApi* api, NcclOptions options = {});
  ~NcclBackend() override;

  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec& spec) override;

  /// Aborts every communicator of `job` on this node (see above).
  void AbortJob(const std::string& job, const absl::Status& reason);
  /// Drops the job's communicators (after aborting any still live), or keeps them for a restart
  /// (NcclOptions::keep_after_job). Blocks while an op of the job's groups runs here, and until
  /// its launched ops have finished or failed (each bounded by its deadline; one with none, by
  /// abort_drain).
  void JobEnded(const std::string& job) override;

  /// Stops the watchdog and launch watcher threads, then waits for the ops still launched (at
  /// most abort_drain) and aborts those left (idempotent; the destructor does it too). Call
  /// before the stores the communicators report to go away.
  void StopWatchdog();

  /// Waits until every NCCL abort asked for so far has returned, at most `within`; whether
  /// they have (for tests: aborts run on the aborter's thread).
  bool FlushAborts(absl::Duration within = absl::Seconds(10)) { return table_.FlushAborts(within); }
  /// NCCL aborts that ran past abort_hung_after so far.
  int hung_aborts() const { return table_.hung_aborts(); }
  /// NCCL communicators created so far (ncclCommInitRankConfig calls), for tests.
  int comm_inits() const { return table_.comm_inits(); }
  /// Ops launched and not yet settled (finished, failed or aborted) on every group, for tests.
  /// Blocks while an op runs.
  size_t LaunchedOps();

 private:
  // How long the launch watcher sleeps between looks for groups with launched ops while none
  // has any (it is woken as soon as one has).
  static constexpr absl::Duration kWatcherIdle = absl::Seconds(1);
  // How often the launch watcher looks at groups with launched ops.
  static constexpr absl::Duration kWatcherPace = absl::Milliseconds(1);

  // One look at every idle group's communicators (the watchdog's tick).
  void WatchIdle();
  // The launch watcher's loop: looks at the launched ops of every group that has some.
  void WatchLaunched();
  // Waits for the launched ops of `job` (empty: every job) to finish, at most `bound` (each
  // also by its deadline); aborts the groups whose ops are left.
  void SettleLaunched(const std::string& job, absl::Duration bound);

  gpu::GpuApi* const api_;
  const NcclOptions options_;
  CommsTable table_;
  absl::Notification stop_;
  std::thread watchdog_;  // last: they start once everything above exists
  std::thread launch_watcher_;
};

}  // namespace gradsync::backend::nccl
