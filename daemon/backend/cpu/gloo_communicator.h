#pragma once

#include <memory>
#include <vector>

#include "absl/types/span.h"
#include "common/worker_pool.h"
#include "daemon/core/backend.h"

namespace gloo {
class Context;
}

namespace gradsync::backend::cpu {

/// Collectives of a group whose members sit on several nodes, hierarchically: the local
/// members' buffers are reduced inside the daemon into one scratch buffer, one Gloo collective
/// runs among the group's nodes (one Gloo rank per node), and the result is written back to
/// every local member. MEAN divides by the group size, not the node count.
///
/// The Gloo context is connected at the first op (rendezvous through the job's store), bounded
/// by that op's deadline. Gloo's exceptions stop here: a lost peer is UNAVAILABLE naming the op,
/// and the group's later ops fail the same way (the job must be formed again).
/// ReduceScatter reduces the whole input across nodes and hands each member its block;
/// AllGather uses Gloo's allgatherv over the nodes' parts.
class GlooCommunicator final : public core::Communicator {
 public:
  GlooCommunicator(core::CommunicatorSpec spec, WorkerPool* pool);
  ~GlooCommunicator() override;
  absl::Status Run(const core::Collective& op) override;

 private:
  absl::Status Connect(absl::Time deadline);
  absl::Status RunLocked(const core::Collective& op);
  absl::Status Agree(const core::Collective& op);
  // One Gloo all-reduce of n elements across the nodes, our kernel as its reduce function
  // (MEAN as SUM: the caller divides). Gloo first reduces `buffers` into buffers[0], segment by
  // segment, and leaves the result in every one of them. Throws (Gloo).
  void AllreduceAcrossNodes(const core::Collective& op, int64_t n,
                            absl::Span<std::byte* const> buffers);
  // Reduces the local members' inputs [0, n) into scratch_, then all-reduces it.
  void ReduceIntoScratch(const core::Collective& op, int64_t n);
  std::string PeersWithRanks() const;  // "node h:p (ranks 2,3); node ..."

  const core::CommunicatorSpec spec_;
  WorkerPool* const pool_;
  std::vector<std::string> nodes_;  // the group's nodes, sorted: Gloo rank = index
  std::vector<int> node_of_group_rank_;
  int my_node_ = -1;
  std::shared_ptr<::gloo::Context> context_;
  std::vector<std::byte> scratch_;
  absl::Status broken_;  // once a cross-node op failed, every later op fails with it
};

}  // namespace gradsync::backend::cpu
