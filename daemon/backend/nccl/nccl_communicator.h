#pragma once

// One group's NCCL collectives on this node: builds the group's communicators (the unique id
// through the job's store), launches an op on them under the op's deadline and the other nodes'
// word, hands it to the group's launched ops (launched_ops.h) once NCCL has enqueued it, and
// aborts and drains the communicators when it fails.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/backend/nccl/comms_table.h"
#include "daemon/backend/nccl/launched_ops.h"
#include "daemon/backend/nccl/peer_signals.h"
#include "daemon/core/backend.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::backend::nccl {

/// The engine's handle on one group's NCCL collectives; the NCCL state itself lives in the
/// CommsTable (GroupComms), so that it outlives this object. Runs one op at a time (the
/// Communicator contract); the group's lock is held while it runs, and no store call that the
/// op's failure decides (telling the other nodes) is made before it is released.
class NcclCommunicator final : public core::Communicator {
 public:
  /// `table` must outlive this.
  NcclCommunicator(CommsTable* table, core::CommunicatorSpec spec)
      : table_(table),
        api_(table->api()),
        spec_(std::make_shared<const core::CommunicatorSpec>(std::move(spec))) {}

  /// Returns once the op is launched: the trainers' "ready" events have completed (polled from
  /// the host), every device op its trainers submitted before has been launched (LocalMember's
  /// turn), NCCL has enqueued the op on the daemon's streams, and their "done" events are
  /// recorded after it (or once it failed). The group keeps watching it until its streams have
  /// run it (launched_ops.h), with its buffers' mappings (op.keep_alive) and its trainers'
  /// records (op.settlements). First looks at the group's earlier launched ops: if one failed,
  /// this op fails (ABORTED, naming it) without running; with kMaxLaunchedPerGroup of them
  /// unfinished, waits (under op.deadline) for the oldest.
  absl::Status Run(const core::Collective& op) override;
  /// A node of the job was lost (the peer watch): every communicator of the job on this node is
  /// revoked, then aborted, on the aborter's thread (CommsTable::AbortJob; this makes no NCCL
  /// call and returns at once: the peer watch's heartbeats go on), so no device op waits for the
  /// lost node until its deadline. Later ops never reach it (the engine fails them).
  void Abort(const absl::Status& status) override;

 private:
  // A local member's buffers for one op, checked: runs on one device, each with elements.
  struct Member {
    int group_rank = 0;
    int device = -1;
    core::View in;
    core::View out;  // ALL_GATHER, REDUCE_SCATTER
  };
  // One NCCL call of the op on every local member, `count` elements from each one's `send` into
  // its `recv` (per member, in the order of `members`): every local rank makes the same calls,
  // with the same counts, in the same order.
  struct Call {
    int64_t count = 0;
    std::vector<std::pair<const void*, void*>> send_recv;
  };
  // The op as this node launches it: its members and their calls, in order, in one NCCL group.
  struct Plan {
    std::vector<Member> members;
    std::vector<Call> calls;
  };
  static absl::StatusOr<std::vector<Member>> Members(const core::Collective& op);
  // The op's calls. ALL_REDUCE and BROADCAST are elementwise, so a fused op (members' data in
  // several segments) runs segment by segment: every local rank must have the same
  // segmentation (else a desync naming both); adjacent segments merge into one call where they
  // are contiguous on every rank, but only in a group within this node: across nodes each node
  // would decide alone, and the calls would no longer pair up, so there every segment is its
  // own call (the segmentation decides them all, and the nodes compare it with the rest of the
  // fingerprint, NodeFingerprint, through the job's store before the op's first NCCL call:
  // PeerFailureWatch::CompareBeforeLaunch; an op in one segment on some node is compared by the
  // watch after PeerFailureWatch::kWatchAfter). ALL_GATHER and REDUCE_SCATTER take one contiguous
  // range per rank and side (adjacent segments merged), or fail with INVALID_ARGUMENT: their output
  // is laid out rank by rank over the whole array, which one NCCL call per segment cannot write.
  absl::StatusOr<Plan> MakePlan(const core::Collective& op) const;
  // The op's fingerprint as this node publishes it to the others (PeerFailureWatch): the
  // engine's, with this node's segmentation of the data of a segmented kind.
  static std::string NodeFingerprint(const core::Collective& op);

  bool Spanning() const {
    return spec_->rendezvous != nullptr && spec_->local_members.size() != spec_->members.size();
  }
  // Whether group rank 0 is on this node (it makes the unique id).
  bool RootHere() const {
    return !spec_->local_members.empty() && spec_->local_members.front() == spec_->members.front();
  }
  // "node 10.0.0.2:7451 (ranks 2,3)": this node, in what it tells the others.
  std::string NodeAndRanks() const;
  // The group's other nodes, each once.
  std::vector<std::string> OtherNodes() const;

  // What an op does before it takes its group's lock: every wait on the store or on other
  // nodes (a fused op's comparison across nodes, the NCCL id, the communicators' non-blocking
  // initialisation) happens here, so that the lock is held only to launch, and a job-wide
  // abort, the launch watcher or the job's end never wait behind a store round trip.
  struct Prepared {
    absl::StatusOr<Plan> plan = absl::UnknownError("not planned");
    std::vector<int> devices, ranks;  // of the plan's members
    absl::Status status;              // not OK: the op fails with it
    std::vector<gpu::Comm> comms;     // built for this op (empty: the group's serve)
    uint64_t aborts_seen = 0;         // GroupComms::aborts when it began
  };
  Prepared Prepare(GroupComms& c, const core::Collective& op, LaunchedOp& launched,
                   DeferredWrites& later) ABSL_LOCKS_EXCLUDED(c.mu);
  // Polls the trainers' "ready" events of the plan's buffers until all are done (OK), another
  // node's word or a job-wide abort ends the wait (that), or the op's deadline passes
  // (DEADLINE_EXCEEDED naming the rank and buffer). No group lock held.
  absl::Status AwaitTrainers(const core::Collective& op, const Plan& plan, PeerFailureWatch& peers);
  // Whether the op needs communicators other than the group's (none yet, or another layout).
  static bool NeedsBuildLocked(const GroupComms& c, const Prepared& p, int group_size)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // The op on the group whose lock is held, from a job-wide abort requested while it was idle
  // and the group's earlier launched ops to the op's launch.
  absl::Status RunOnGroupLocked(GroupComms& c, const core::Collective& op,
                                const std::shared_ptr<LaunchedOp>& launched, Prepared& prepared,
                                DeferredWrites& later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // Installs the prepared communicators (when built) and launches the op; on OK
  // `launched.finished` marks its end.
  absl::Status RunLocked(GroupComms& c, const core::Collective& op,
                         const std::shared_ptr<LaunchedOp>& launched, Prepared& prepared,
                         DeferredWrites& later) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // The unique id of the communicators op `op` builds: made here when the group's rank 0 is
  // local (and published for the other nodes), otherwise fetched from the job's store, where
  // that rank's node put it.
  absl::StatusOr<std::string> UniqueId(const core::Collective& op, const std::string& key,
                                       PeerFailureWatch& peers);
  // Creates communicators for the op's members on this node, one per local member, through
  // one ncclGroupStart/End, and waits for their initialisation. No group lock held.
  absl::Status Build(const core::Collective& op, const Prepared& p, PeerFailureWatch& peers,
                     DeferredWrites& later, std::vector<gpu::Comm>* comms);
  // The group takes the communicators `p` built.
  void InstallLocked(GroupComms& c, const core::Collective& op, Prepared& p, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // The plan's calls: for each call, on every local rank, in one ncclGroupStart/End.
  absl::Status LaunchLocked(GroupComms& c, const core::Collective& op, const Plan& plan)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);
  // Polls `comms` until all are ready (OK), one reports an error (that error), another node
  // gives up on the op (its word; with `read_store` false only the watch's interrupt, no store
  // call: a group's lock is held), or `deadline` passes (DEADLINE_EXCEEDED with `late`).
  // Non-blocking communicators leave ncclInProgress after initialising and after each
  // ncclGroupEnd.
  absl::Status PollReady(const std::vector<gpu::Comm>& comms, absl::Time deadline,
                         PeerFailureWatch& peers, absl::string_view late, bool read_store = true);
  // Aborts the group's communicators on this node, and the job's others with them unless the
  // op failed on another node's word (that node has told the other groups itself).
  absl::Status FailLocked(GroupComms& c, const core::Collective& op, const absl::Status& why,
                          const PeerFailureWatch& peers, DeferredWrites& later)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu);

  CommsTable* const table_;
  gpu::GpuApi* const api_;
  // Shared with the group's launched ops, which outlive this object.
  const std::shared_ptr<const core::CommunicatorSpec> spec_;
};

}  // namespace gradsync::backend::nccl
