#pragma once

// The collectives of larger ops between a group's nodes, over the group's record links: a
// pipelined ring all-reduce fused with the reduction of the node's own members, a pipelined
// chain broadcast and a ring all-gather. Each talks only to the node's two ring neighbours
// (link_plan.h's GroupLinks). (Small ops never come here: they travel inside their records.)

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::backend::cpu {

class RecordLinks;

/// What every collective here is told: which op (every message carries its seq, and a message
/// of another op, kind, step or segment is refused: the nodes are out of step), by when (every
/// wait inside ends by that one absolute time, however many peers it waits for), and the
/// pipeline's shape: its unit (one message per segment; every node of the op must use the same)
/// and how many segments a node sends ahead of the ones it received (its own choice).
struct LinkOp {
  uint64_t seq = 0;
  absl::Time deadline = absl::InfiniteFuture();
  size_t segment_bytes = 1 << 20;
  int64_t window = 2;  // at least 1
};

/// The longest message a collective sends with segments of `segment_bytes` (the links'
/// max_message_bytes must allow it).
size_t SegmentMessageBytes(size_t segment_bytes);

struct RingSpec {
  DType dtype = v1::FLOAT32;
  v1::ReduceOp op = v1::SUM;  // MEAN sums, and divides once by `divisor` when a block is done
  int64_t divisor = 1;
  int64_t count = 0;  // elements of every buffer
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
/// With `result` (count elements, overlapping no buffer), the buffers are only read: the
/// running sums and the result go there instead (a ring cut off leaves the buffers as they
/// were; the caller copies the result out).
///
/// Each block is reduced on one node and sent to the others, so every node ends with the same
/// bits. On failure the buffers (or `result`) hold partial results and the links' state is
/// undefined: the caller fails the group. The status keeps the links' code (UNAVAILABLE a link
/// lost, DEADLINE_EXCEEDED the deadline passed, CANCELLED the links' cancel fd); a peer out of step
/// is INTERNAL, and so is a spec the kernels cannot reduce (an op that is not a reduction). Every
/// node of the links must call it for the same op with the same spec.
absl::Status RingAllreduce(RecordLinks& links, const LinkOp& op, const RingSpec& spec,
                           absl::Span<std::byte* const> buffers, std::byte* result = nullptr);

/// `buffer` of node `root` into `buffer` of every other node, along the ring from the root (a
/// pipelined chain: each node passes every segment on to the next as soon as it came; each link
/// carries the buffer once, and the last node has it (N - 1) + segments later). Failures as
/// RingAllreduce's.
absl::Status LinkBroadcast(RecordLinks& links, const LinkOp& op, int root,
                           absl::Span<std::byte> buffer);

/// Every node's part into every node's `output`: the parts lie in node order, part_bytes[i]
/// bytes for node i, and this node's is in place already. A ring: in N - 1 steps each node passes
/// the part it took last (its own first) to the next node, at most a window of segments ahead of
/// what it takes from the previous one (op.window); each part crosses each link once. Failures as
/// RingAllreduce's.
absl::Status LinkAllGather(RecordLinks& links, const LinkOp& op,
                           absl::Span<const size_t> part_bytes, std::byte* output);

}  // namespace gradsync::backend::cpu
