#pragma once

// Collectives of a group that spans nodes: reduced inside each daemon, exchanged between nodes
// over the group's own authenticated TCP links (record_links.h), one link per pair of nodes.

#include <chrono>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "daemon/backend/cpu/link_collectives.h"
#include "daemon/core/backend.h"

namespace gradsync::backend::cpu {

class RecordLinks;

/// Collectives of a group whose members sit on several nodes, hierarchically: the local
/// members' buffers are reduced inside the daemon, exchanged among the group's nodes (one
/// stream each way per pair of nodes), and the result is written back to every local member.
/// MEAN divides by the group size, not the node count.
///
/// Every op starts with one record from each node to every other: the node's verdict (its
/// status and the op's fingerprint) and, for ops that move at most kInlineMaxBytes, the node's
/// whole contribution. Such an op is done in that one exchange (each node combines the
/// contributions in node order, so all get the same bits); a larger one then runs a link
/// collective on the same streams (link_collectives.h: a ring all-reduce for all-reduce and
/// reduce-scatter, a broadcast, an all-gather). An op that failed on one node, or that nodes
/// disagree on, fails on all of them the same way and writes no member buffer.
///
/// Records travel on one stream per ordered pair of nodes, in sequence order, over the group's
/// own TCP connections (record_links.h: written and read by this thread, no transport thread
/// in between): RunBatch packs the records of a run of queued ops into few messages (each up
/// to kStreamMessageBytes), so a batch costs a few messages per peer, not one per op.
/// A stage's records are all packed before its first op waits for its peers' (packing ahead
/// by a bounded window measured slower here), and each op is reported as soon as it finishes,
/// keeping its own outcome, deadline and desync check. Nodes
/// need not batch the same way: a reader takes records one by one, whatever message they came
/// in; a record of another seq than the one due means the nodes are out of step, and fails the
/// link.
///
/// Not thread-safe: the engine never overlaps a group's calls (core::Communicator), and all
/// state here is the group's. The links are connected at the first op (rendezvous through the
/// job's store), bounded by that op's deadline. A lost peer is UNAVAILABLE naming the op, and
/// the group's later ops fail the same way (the job must be formed again). ReduceScatter reduces
/// the whole input across nodes and hands each member its block; AllGather gathers the nodes'
/// parts.
class NodesCommunicator final : public core::Communicator {
 public:
  explicit NodesCommunicator(core::CommunicatorSpec spec);
  ~NodesCommunicator() override;
  absl::Status Run(const core::Collective& op) override;
  void RunBatch(absl::Span<const core::Collective* const> ops,
                absl::FunctionRef<void(size_t, absl::Status)> finished) override;

 private:
  struct Exchange;
  struct Outbox;
  struct PeerStream;

  absl::Status Connect(absl::Time deadline);
  // The status of an op reached after the group's link failed.
  absl::Status BrokenStatus(const core::Collective& op) const;
  // Records that `op` failed on the link (`error`): the group stays failed. Returns the op's
  // status (DEADLINE_EXCEEDED naming the peers once its deadline passed).
  absl::Status FailLink(const core::Collective& op, absl::Status error);
  // One past the last of ops[begin...] that may have their records in flight together: an op
  // that reads what an earlier one of the run writes waits for it, and an op that runs a link
  // collective is the last of its stage.
  size_t StageEnd(absl::Span<const core::Collective* const> ops, size_t begin) const;
  // Runs ops whose records may all be in flight at once, ops[i] being the batch's op first + i.
  // Never throws: a failed link fails its ops through `finished`.
  void RunStage(absl::Span<const core::Collective* const> ops, size_t first,
                absl::FunctionRef<void(size_t, absl::Status)> finished);
  // Appends this node's record of `op` (verdict and inline contribution) to `outbox`, sending
  // its message to every peer when full. Throws (a failed link).
  void Post(const core::Collective& op, Exchange& ex, Outbox& outbox);
  // Sends the outbox's open message (if any) to every peer; returns once the kernel holds it.
  // Throws (a failed link).
  void Flush(Outbox& outbox);
  // The next record on `node`'s stream, which must be op `seq`'s: waits for its message up to
  // `timeout`. The record stays valid until the next call for that node. Throws (a failed
  // link, or a stream out of step).
  const std::byte* NextRecord(int node, uint64_t seq, std::chrono::milliseconds timeout);
  // Waits for the peers' records of the op, decides its verdict and completes it. Throws (a failed
  // link).
  absl::Status Finish(const core::Collective& op, Exchange& ex);
  // Bytes node `node` contributes to `op` when it travels inline.
  int64_t InlineBytes(const core::Collective& op, int node) const;
  bool TravelsInline(const core::Collective& op) const;
  // This node's contribution to an inline op, into `payload`.
  void Pack(const core::Collective& op, std::byte* payload);
  // Every node's contribution (node order) into the local members' buffers.
  void Unpack(const core::Collective& op, absl::Span<const std::byte* const> payloads);
  // An op past its verdict that runs a link collective (not inline). Throws (a failed link).
  absl::Status RunLarge(const core::Collective& op);
  LinkOp LinkOpOf(const core::Collective& op) const;
  // Throws a failed link's status (RunStage fails the group with it).
  static void ThrowIfFailed(const absl::Status& status);
  // All-reduces n elements of `buffers` (the local members') across the nodes, over the record
  // links (ring_allreduce.h), leaving the result in every one of them: the op's reduction when
  // `finish`, else MEAN as SUM (the caller divides). Throws (a failed link).
  void AllreduceAcrossNodes(const core::Collective& op, int64_t n,
                            absl::Span<std::byte* const> buffers, bool finish);
  // Reduces the local members' inputs [0, n) into scratch_, then all-reduces it.
  void ReduceIntoScratch(const core::Collective& op, int64_t n);
  std::string PeersWithRanks() const;  // "node h:p (ranks 2,3); node ..."
  // A message buffer (kStreamMessageBytes) for sending, reused across stages.
  std::unique_ptr<std::byte[]> TakeSendMemory();

  const core::CommunicatorSpec spec_;
  std::vector<std::string> nodes_;  // the group's nodes, sorted (link index)
  std::vector<int> node_of_group_rank_;
  std::vector<int> members_on_node_;  // by node index
  int my_node_ = -1;
  std::unique_ptr<RecordLinks> links_;  // the record streams, connected at the first op
  std::vector<PeerStream> streams_;     // by node (unused at my_node_): into links_' messages
  std::vector<std::unique_ptr<std::byte[]>> free_send_memory_;
  std::vector<std::byte> scratch_;
  absl::Status broken_;  // once a cross-node op failed, every later op fails with it
};

}  // namespace gradsync::backend::cpu
