#pragma once

// Collectives of a group that spans nodes: reduced inside each daemon, exchanged between nodes
// over the group's own authenticated TCP links (record_links.h): each node links only to its two
// ring neighbours and its binomial tree's parent and children (link_plan.h's GroupLinks), or, in
// a group of a few nodes, to every other.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"
#include "daemon/backend/cpu/cpu_backend.h"
#include "daemon/backend/cpu/link_collectives.h"
#include "daemon/core/backend.h"

namespace gradsync::backend::cpu {

class LinkPark;
class RecordLinks;

/// Collectives of a group whose members sit on several nodes, hierarchically: the local
/// members' buffers are reduced inside the daemon, exchanged among the group's nodes, and the
/// result is written back to every local member. MEAN divides by the group size, not the node
/// count.
///
/// Every op starts with its verdict, agreed over a binomial tree of the group's nodes (node 0 the
/// root; link_plan.h): each node folds its children's records into its own (the first failure, a
/// node's own before a deadline's; the first fingerprint that differs) and sends the result to its
/// parent; the root's record is the op's decision, which every node passes on down as it came. An
/// op whose decision (every node's data, or their reduction) is at most inline_max_bytes travels
/// inside those records: partial reductions on the way up (each node reduces its own and its
/// children's in node order), the whole result on the way down, so every node takes the root's
/// bits. 2·ceil(log2 N) hops, and each node sends one record up and one down per child. A group
/// of at most tuning.all_to_all_max_nodes nodes skips the tree: each node sends its own record to
/// every other and folds all of them in node order (one hop; every node decides alike). A larger
/// op then runs a link collective over the ring neighbours (link_collectives.h: a ring
/// all-reduce for all-reduce and reduce-scatter, a chain broadcast, a ring all-gather). An op that
/// failed on one node, or that nodes disagree on, fails on all of them the same way and writes no
/// member buffer.
///
/// Records travel on the group's own TCP connections in sequence order (record_links.h: written
/// and read by this thread, no transport thread in between): RunBatch packs the records of a
/// run of queued ops into few messages (each up to stream_message_bytes), so a batch costs a few
/// messages per link, not one per op. A stage's own verdicts are all taken before its first op
/// waits for its children, and each op is reported as soon as its decision came, keeping its
/// own outcome, deadline and desync check. Nodes need not batch the same way: a reader takes
/// records one by one, whatever message they came in; a record of another seq than the one due,
/// or naming nodes outside the sender's subtree, means the nodes are out of step, and fails the
/// link.
///
/// Errors keep their code end to end: a link lost is UNAVAILABLE, a peer that did not reach the
/// op by its deadline (plus tuning.peer_grace) DEADLINE_EXCEEDED naming it, a peer out of step
/// or a malformed stream INTERNAL; each names the op, and the group's later ops fail with it
/// (the job must be formed again). Every wait of an op, for however many peers, ends by one
/// absolute time. ReduceScatter reduces the whole input across nodes and hands each member its
/// block; AllGather gathers the nodes' parts.
///
/// Run and RunBatch are not thread-safe: the engine never overlaps a group's calls
/// (core::Communicator), and all state but `aborted_` is the group's thread's. The links are
/// connected at the first op (rendezvous through the job's store), bounded by that op's
/// deadline. Abort may come from any thread.
class NodesCommunicator final : public core::Communicator {
 public:
  /// `tuning` must be valid (ValidateCpuTuning); if not, every op fails INVALID_ARGUMENT.
  /// `pool` (optional; it must outlive this) takes part in copying an elastic job's results
  /// out to its members. `park` (optional): where a group with spec.elastic_home takes its
  /// links over from the epoch before and leaves them at its end (RecordLinks::Spec::park).
  explicit NodesCommunicator(core::CommunicatorSpec spec, const CpuTuning& tuning = {},
                             WorkerPool* pool = nullptr, std::shared_ptr<LinkPark> park = nullptr);
  ~NodesCommunicator() override;
  absl::Status Run(const core::Collective& op) override;
  void RunBatch(absl::Span<const core::Collective* const> ops,
                absl::FunctionRef<void(size_t, absl::Status)> finished) override;
  /// Thread-safe; returns at once. The first status stays (an OK one counts as INTERNAL). The
  /// op running fails with it (its code, its message after the op's label) as soon as the wait
  /// it is in wakes (the record links' cancel fd), and so does every later op, before it writes
  /// anything. The links are closed, or, in an elastic job, parked for its next epoch after an
  /// end mark (RecordLinks::Park): either way the peers see this node gone. A ring all-reduce cut
  /// off mid-way leaves partial sums in its members' buffers, as a link lost there does, unless the
  /// job is elastic (spec.elastic: the ring then keeps its sums in scratch_, copied out on
  /// success).
  void Abort(const absl::Status& status) override;

  /// The smallest stream message that holds an op travelling inline with `inline_bytes` of
  /// this node's data (its record and the message's header).
  static size_t MinStreamMessageBytes(int64_t inline_bytes);

 private:
  struct Exchange;
  struct Outbox;
  struct PeerStream;
  struct RecordHeader;

  // Why `op` cannot start: this communicator was aborted, could not be made, or its link failed
  // earlier. OK when it can.
  absl::Status Unrunnable(const core::Collective& op) const;
  absl::Status Aborted() const ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Connect(absl::Time deadline);
  // Closes the links, leaving the sound ones to the next epoch where the group keeps them.
  void ReleaseLinks();
  // The status of an op reached after the group's link failed.
  absl::Status BrokenStatus(const core::Collective& op) const;
  // Records that `op` failed on the link (`error`, as the links or a collective returned it):
  // the group stays failed. Returns the op's status: the abort's once aborted (the links'
  // CANCELLED is what woke it), else `error`'s code after the op's label, naming the peers
  // (DEADLINE_EXCEEDED: the op did not complete by its deadline, waiting for them).
  absl::Status FailLink(const core::Collective& op, const absl::Status& error);
  // One past the last of ops[begin...] that may have their records in flight together: an op
  // that reads what an earlier one of the run writes waits for it, and an op that runs a link
  // collective is the last of its stage.
  size_t StageEnd(absl::Span<const core::Collective* const> ops, size_t begin) const;
  // Runs ops whose records may all be in flight at once, ops[i] being the batch's op first + i;
  // a failed link fails its ops through `finished`.
  void RunStage(absl::Span<const core::Collective* const> ops, size_t first,
                absl::FunctionRef<void(size_t, absl::Status)> finished);
  // This node's own verdict of `op` (before any wait of its stage).
  void Judge(const core::Collective& op, Exchange& ex) const;
  // Room for a record of `bytes` in the outbox's open message (sending the full one first).
  // Not OK: the link failed.
  absl::StatusOr<std::byte*> Reserve(Outbox& outbox, size_t bytes);
  // Counts `record` (written where Reserve said) in its message, sending it once it holds
  // stream_flush_bytes. Not OK: the link failed.
  absl::Status Commit(Outbox& outbox, const std::byte* record);
  // This node's own record of `op` (its verdict and inline contribution) into `record`. A
  // contribution it cannot pack fails the op by its verdict (ex.local).
  void Own(const core::Collective& op, Exchange& ex, std::byte* record);
  // Folds `next` (the record of the nodes that follow `into`'s) into `into`.
  void Fold(RecordHeader& into, const RecordHeader& next) const;
  // Folds `record`, of nodes [first, end), into `folded`, first checking its payload's size
  // where it agrees (a wrong one is that node's INTERNAL failure).
  void FoldIn(const core::Collective& op, RecordHeader& folded, const std::byte* record, int first,
              int end) const;
  // records[0]'s header with every later record folded in; records[i] covers the nodes
  // [firsts[i], firsts[i + 1]), the last one up to `end`.
  RecordHeader FoldAll(const core::Collective& op, absl::Span<const std::byte* const> records,
                       absl::Span<const int> firsts, int end) const;
  // Whether a folded record carries the op's data: every node agreed and the op travels inline.
  bool Carries(const core::Collective& op, const RecordHeader& folded) const;
  // Writes `folded` to `record`, with the records' payloads combined after it when it carries
  // them (room for SubtreeBytes(op, firsts[0], end)); a combination that fails is this node's
  // failure in `folded` and is returned (labeled), OK otherwise.
  absl::Status CombineInto(const core::Collective& op, RecordHeader& folded,
                           absl::Span<const std::byte* const> records, absl::Span<const int> firsts,
                           int end, std::byte* record) const;
  // A small group's decision (all_to_all_): every node's record, folded in node order, with the
  // combined payload, in ex.own. Not OK: the link failed.
  absl::StatusOr<const std::byte*> Decide(const core::Collective& op, Exchange& ex,
                                          absl::Time wait_until);
  // Appends this node's subtree's record of `op` to `outbox` (its own, folded with its
  // children's, which it waits for), sending each full message up the tree (the root: down).
  // Not OK: the link failed.
  absl::Status Post(const core::Collective& op, Exchange& ex, Outbox& outbox);
  // Sends the outbox's open message (if any) to the parent (the root: to every child); returns
  // once the kernel holds it. Not OK: the link failed.
  absl::Status Flush(Outbox& outbox);
  // The next record on `node`'s stream, which must be op `seq`'s: waits for its message until
  // `deadline` (a message from the parent goes on to every child as it came). The record stays
  // valid until the next call for that node. Not OK: the link failed, or the stream is
  // malformed or out of step (INTERNAL).
  absl::StatusOr<const std::byte*> NextRecord(int node, uint64_t seq, absl::Time deadline);
  // Waits for the op's decision (the root: its own record), decides its verdict and completes
  // it, leaving the op's own outcome in ex.result. Not OK: the link failed (the stage ends there).
  absl::Status Finish(const core::Collective& op, Exchange& ex);
  // The op's outcome from its decision (this node's own failure, a peer's, a desync), before any
  // data moves.
  absl::Status Verdict(const core::Collective& op, const Exchange& ex,
                       const RecordHeader& decision) const;
  // Inline bytes of `op` in a record of nodes [first, end): their parts, or the reduction.
  int64_t SubtreeBytes(const core::Collective& op, int first, int end) const;
  bool TravelsInline(const core::Collective& op) const;
  // This node's contribution to an inline op, into `payload`.
  absl::Status Pack(const core::Collective& op, std::byte* payload);
  // The payloads of consecutive node ranges (payloads[i] covers nodes [firsts[i], firsts[i + 1]),
  // the last one up to `end`) into the whole range's, `out`: reduced in that order, or laid end
  // to end.
  absl::Status Combine(const core::Collective& op, absl::Span<const int> firsts, int end,
                       absl::Span<const std::byte* const> payloads, std::byte* out) const;
  // The decision's payload (every node's parts, or their reduction) into the local members.
  absl::Status Unpack(const core::Collective& op, const std::byte* payload);
  // An op past its verdict that runs a link collective (not inline). Not OK: the group's link
  // failed (the peers are in the collective: any failure here leaves the streams out of step).
  absl::Status RunLarge(const core::Collective& op);
  LinkOp LinkOpOf(const core::Collective& op) const;
  // All-reduces n elements of `buffers` (the local members') across the nodes, over the record
  // links (link_collectives.h), leaving the result in every one of them (or, given `result`,
  // there alone, the buffers only read): the op's reduction when `finish`, else MEAN as SUM
  // (the caller divides).
  absl::Status AllreduceAcrossNodes(const core::Collective& op, int64_t n,
                                    absl::Span<std::byte* const> buffers, bool finish,
                                    std::byte* result = nullptr);
  // Reduces the local members' inputs [0, n) into scratch_, then all-reduces it.
  absl::Status ReduceIntoScratch(const core::Collective& op, int64_t n);
  // scratch_[0, n) into every local member's input, split across the pool: as it is when
  // `finished` (the ring's result), else through the op's reduction of one source (MEAN
  // divides the ring's sums by the group size).
  absl::Status ScratchToMembers(const core::Collective& op, int64_t n, bool finished);
  std::string PeersWithRanks() const;  // "node h:p (ranks 2,3); node ..."
  // A message buffer (tuning_.stream_message_bytes) for sending, reused across stages.
  std::unique_ptr<std::byte[]> TakeSendMemory();

  const core::CommunicatorSpec spec_;
  const CpuTuning tuning_;
  WorkerPool* const pool_;
  const std::shared_ptr<LinkPark> park_;
  std::vector<std::string> nodes_;  // the group's nodes, sorted (link index)
  std::vector<int> node_of_group_rank_;
  std::vector<int> members_on_node_;  // by node index
  int my_node_ = -1;
  // A group of at most tuning.all_to_all_max_nodes nodes: every node sends its record to every
  // other and folds them all; no tree (parent_ -1, no children_).
  bool all_to_all_ = false;
  int parent_ = -1;            // in the group's tree (link_plan.h); -1: this node is the root
  std::vector<int> children_;  // ascending
  // Not OK: the communicator could not be made (invalid tuning, no eventfd); every op fails.
  absl::Status setup_;
  // An eventfd, the record links' cancel fd: Abort makes it readable for good.
  UniqueFd cancel_fd_;
  std::unique_ptr<RecordLinks> links_;  // the record streams, connected at the first op
  std::vector<PeerStream> streams_;     // by node (the tree's): into links_' messages
  std::vector<std::unique_ptr<std::byte[]>> free_send_memory_;
  std::vector<std::byte> scratch_;
  absl::Status broken_;  // once a cross-node op failed, every later op fails with it

  mutable absl::Mutex mu_;
  // Set once by Abort; every op from then fails. mu_ is a leaf: nothing is called under it.
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace gradsync::backend::cpu
