// The core's seam to a data plane: the Collective it hands over (a matched op and its
// buffers), and the Backend/Communicator interfaces the CPU and NCCL planes implement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "common/store.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/core/submit_order.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core {

class MappedBuffer;

/// A contiguous run of elements inside a mapped buffer.
struct Run {
  std::byte* data;
  int64_t count;
  /// The buffer it lies in (its device and events, on GPU nodes); null in unit-test views.
  const MappedBuffer* buffer = nullptr;
};

/// One logical array of elements spread over runs, in order (a fused op's segments).
using View = std::vector<Run>;

/// One local member of a collective: its group rank and its buffers for this op.
struct LocalMember {
  int group_rank;
  View input;
  View output;  // ALL_GATHER and REDUCE_SCATTER only
  /// A device op's place in its trainer's submission order (submit_order.h): the data plane
  /// launches it only once AwaitTurn says so. Empty for host ops.
  std::optional<Turn> turn = std::nullopt;
};

/// Where an op's bytes live: host memory (the CPU backend, TCP across nodes) or GPU memory
/// (NCCL).
enum class Plane { kHost = 0, kDevice = 1 };

/// A matched collective, ready to run: every local member of the group submitted it with the
/// same fingerprint, and every buffer it names is mapped (and stays so while it runs: see
/// keep_alive).
struct Collective {
  v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
  v1::ReduceOp reduce_op = v1::REDUCE_OP_UNSPECIFIED;
  DType dtype = v1::DTYPE_UNSPECIFIED;
  /// Elements per member: of `input` (ALL_REDUCE, BROADCAST, ALL_GATHER) or of `output`
  /// (REDUCE_SCATTER).
  int64_t count = 0;
  int root = 0;  // BROADCAST: group rank of the source
  int group_size = 0;
  std::vector<LocalMember> local;  // ascending group rank
  absl::Time deadline = absl::InfiniteFuture();
  uint64_t seq = 0;   // the op's sequence number in its group (the same on every node)
  std::string label;  // "all_reduce job=j group=0,1 seq=17" for errors and logs
  /// What every member agreed on ("all_reduce(sum, float32, count=16, name='w')" and seq):
  /// communicators spanning nodes compare it across nodes before moving data.
  std::string fingerprint;
  /// Not OK: the op already failed on this node (desync, deadline, a rank gone; `local` is
  /// empty). A communicator spanning nodes still takes part in the op's cross-node exchange,
  /// so the other nodes fail it at once with this reason instead of waiting out their deadline.
  absl::Status local_failure;
  /// The data plane the op runs on, decided once when the engine resolves it: where its
  /// buffers live; for an op that failed here before any member named a buffer, the plane of
  /// the group's last op (so the failure reaches the plane the other nodes run the op on).
  Plane plane = Plane::kHost;
  /// The mappings of the buffers `local` names (null when it names none). Held by the engine
  /// until Run returns; a communicator whose op goes on after Run returned (a device op, once
  /// launched) keeps a copy until the op has finished on the device or was aborted and its
  /// streams drained, so that a trainer deregistering a buffer, ending its session or its job
  /// never unmaps memory a kernel still uses.
  std::shared_ptr<const void> keep_alive;
  /// The trainers' records of a device op until it has settled (submit_order.h): a data plane
  /// that keeps the op after Run returned (a launched device op) keeps these with it, and calls
  /// Fail on each when the op fails on the device after its answer.
  std::vector<std::shared_ptr<Settlements::Op>> settlements;
};

/// The job's store key holding the token of its current run (CommunicatorSpec::run).
inline constexpr char kRunKey[] = "daemon/run";
/// The node (daemon TCP address) of rank `r` of a job spanning nodes, set by the rank's daemon.
inline constexpr absl::string_view kRankKeyPrefix = "daemon/rank/";
inline std::string RankKey(int r) { return absl::StrCat(kRankKeyPrefix, r); }
// Every key above is the daemons' own (common/store_keys.h: kDaemonKeyPrefix), as are the
// elastic protocol's (membership.h).

/// What a communicator is built for: one group of one job, and which of its members are local.
struct CommunicatorSpec {
  std::string job;
  std::string group;
  std::vector<int> members;        // global ranks, ascending
  std::vector<int> local_members;  // the subset attached to this daemon, ascending
  // Jobs spanning nodes only: the node (daemon TCP address) of each member, this daemon's own,
  // and the job's store through which the daemons of the group rendezvous.
  std::vector<std::string> member_nodes;
  std::string node;
  gradsync::Store* rendezvous = nullptr;
  // A token every node of this run of the job shares (made at formation and kept in the job's
  // store under kRunKey), so that keys a backend writes in one run are never read in a later
  // run of a job with the same id.
  std::string run;
  // The job is elastic: its members' buffers outlive an op that fails because a node was lost
  // (the survivors go on with them), so such an op must leave them untouched even when it is
  // cut off mid-way; a communicator may pay a copy of the op's data for that.
  bool elastic = false;
  // An elastic job's group spanning nodes: the job's id (its epoch 0's) and this epoch. A
  // communicator may keep its connections past the group's end for the next epoch's groups on
  // this node, which take over those whose peer kept them too (the pairs of nodes the change
  // left alone). Empty otherwise.
  std::string elastic_home;
  int epoch = 0;
};

/// Runs collectives for one group. Calls for one group never overlap (the core runs a group's
/// ops one at a time, in sequence order); different groups' communicators run concurrently.
class Communicator {
 public:
  virtual ~Communicator() = default;
  /// Runs `op`. Host ops run to completion: on OK every local member's buffers hold the result.
  /// Device ops are stream ordered: on OK the op is launched (queued on the daemon's streams
  /// after the trainers' "ready" events, with their "done" events recorded after it), and the
  /// trainers' streams that wait on "done" see the result; it may still be running on the
  /// device. A device op that fails after it was launched fails the group's next op (ABORTED,
  /// naming it). Every wait inside ends by `op.deadline` (DEADLINE_EXCEEDED naming who is
  /// missing); a peer lost mid-op is UNAVAILABLE or ABORTED.
  virtual absl::Status Run(const Collective& op) = 0;
  /// Runs consecutive ops of the group, in sequence order, and calls finished(i, status) once
  /// for each, in order, as soon as its outcome is known, with what Run(*ops[i]) would have
  /// returned: each op keeps its own outcome and deadline, and a failed op writes no member
  /// buffer. `finished` runs on the calling thread and must not call back into this. A
  /// communicator spanning nodes overlaps their exchanges; the default runs them one by one.
  virtual void RunBatch(absl::Span<const Collective* const> ops,
                        absl::FunctionRef<void(size_t, absl::Status)> finished) {
    for (size_t i = 0; i < ops.size(); ++i) finished(i, Run(*ops[i]));
  }
  /// A node of the group was lost (the job's peer watch said so, naming it and the cause in
  /// `status`, UNAVAILABLE): the op running now and every later one fail with `status` as soon
  /// as possible, instead of waiting out their deadlines; in an elastic job (spec.elastic) they
  /// write no member buffer, even cut off mid-way. Thread-safe:
  /// called from another thread than Run's, with no engine lock held; returns without waiting
  /// for the running op. Idempotent (the first status stays). Default: nothing (the op ends by
  /// its deadline).
  virtual void Abort(const absl::Status& status) {}
};

/// A data plane (CPU shared memory + TCP between daemons, or NCCL). Thread-safe.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(
      const CommunicatorSpec& spec) = 0;
  /// The job's trainers on this node have all left: state the backend keeps per job (beyond the
  /// communicators the engine drops) is released or kept for a restart, and the job's other
  /// nodes may be told through its store, which is still there during the call (the caller
  /// deletes the job's namespace afterwards). May block until an op of the job still running on
  /// this node has returned, or a device op launched has finished or been aborted (bounded by
  /// its deadline): the engine calls it on a thread of its own (Engine's on_job_end), never a
  /// gRPC thread. Default: nothing to do.
  virtual void JobEnded(const std::string& job) {}
};

}  // namespace gradsync::core
