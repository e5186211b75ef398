#pragma once

// The all-reduce of larger ops between a group's nodes: a pipelined ring over the group's record
// links, fused with the reduction of the node's own members.

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::backend::cpu {

class RecordLinks;

struct RingSpec {
  uint64_t seq = 0;  // the op's: every message carries it, and a message of another is refused
  DType dtype = v1::FLOAT32;
  v1::ReduceOp op = v1::SUM;  // MEAN sums, and divides once by `divisor` when a block is done
  int64_t divisor = 1;
  int64_t count = 0;  // elements of every buffer
  absl::Time deadline = absl::InfiniteFuture();
  size_t segment_bytes = 1 << 20;  // the unit of the pipeline: one message each
};

/// Reduces `buffers` (this node's members: `count` elements each) with every other node's, and
/// leaves the result in every buffer. Ring all-reduce across the links' nodes (reduce-scatter,
/// then all-gather; each node sends 2·(N−1)/N of the data once), segment by segment: a node
/// sends at most two segments ahead of what it received, so memory and the peer's buffering
/// stay bounded whatever the size. The node's own members are reduced in the same passes as
/// the network's data (no separate local pass, no copy of the result between members): the
/// first block a node sends is the sum of its members' (written into buffers[0]), each block it
/// receives in the scatter is added to its members' values in one pass, the block it completes
/// is written to every member at once, and each block received in the all-gather is copied
/// from the link into every member.
///
/// Each block is reduced on one node and sent to the others, so every node ends with the same
/// bits. On failure (a link lost, a peer out of step, the deadline passed) the buffers hold
/// partial results and the links' state is undefined: the caller fails the group.
/// Every node of the links must call it for the same op with the same spec (count, dtype, op).
absl::Status RingAllreduce(RecordLinks& links, const RingSpec& spec,
                           absl::Span<std::byte* const> buffers);

}  // namespace gradsync::backend::cpu
