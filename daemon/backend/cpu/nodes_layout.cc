// Implementation of nodes_communicator.h: how each kind of op lays out across nodes, the
// bytes of an inline op in its records (pack, combine up the tree, unpack the decision) and the
// link collectives of a larger one.

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/link_collectives.h"
#include "daemon/backend/cpu/link_plan.h"
#include "daemon/backend/cpu/nodes_communicator.h"
#include "daemon/backend/cpu/record_links.h"

namespace gradsync::backend::cpu {

int64_t NodesCommunicator::SubtreeBytes(const core::Collective& op, int first, int end) const {
  const int64_t esize = DTypeSize(op.dtype);
  switch (op.kind) {
    case v1::ALL_REDUCE:
      return op.count * esize;
    case v1::REDUCE_SCATTER:
      return op.count * op.group_size * esize;
    case v1::BROADCAST: {
      const int root = node_of_group_rank_[op.root];
      return root >= first && root < end ? op.count * esize : 0;
    }
    case v1::ALL_GATHER: {
      int64_t members = 0;
      for (int node = first; node < end; ++node) members += members_on_node_[node];
      return members * op.count * esize;
    }
    case v1::BARRIER:
      return 0;
    default:  // an unknown kind travels inline with nothing: Pack fails it (INTERNAL)
      return 0;
  }
}

// Decided from what the fingerprint pins (kind, dtype, count, root) and the group's layout:
// nodes that agree on the op decide the same. The decision (every node's data, or their
// reduction) must fit in one record.
bool NodesCommunicator::TravelsInline(const core::Collective& op) const {
  if (op.kind == v1::BARRIER) return true;
  if (op.kind == v1::BROADCAST &&
      (op.root < 0 || op.root >= static_cast<int>(node_of_group_rank_.size()))) {
    return false;
  }
  return SubtreeBytes(op, 0, static_cast<int>(nodes_.size())) <= tuning_.inline_max_bytes;
}

absl::Status NodesCommunicator::Pack(const core::Collective& op, std::byte* payload) {
  const int64_t n = op.count;
  const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
  std::vector<Slice> inputs;
  for (const core::LocalMember& m : op.local) inputs.push_back({&m.input, 0});
  switch (op.kind) {
    case v1::BARRIER:
      return absl::OkStatus();
    case v1::ALL_REDUCE:
    case v1::REDUCE_SCATTER: {
      const int64_t total = op.kind == v1::ALL_REDUCE ? n : n * op.group_size;
      const core::View out_view = {{payload, total}};
      const Slice out{&out_view, 0};
      return Reduce(op.dtype, partial, 1, inputs, {&out, 1}, total);
    }
    case v1::BROADCAST: {
      const core::View out_view = {{payload, n}};
      const Slice out{&out_view, 0};
      for (const core::LocalMember& m : op.local) {
        if (m.group_rank == op.root) return Copy(op.dtype, {&m.input, 0}, {&out, 1}, n);
      }
      return absl::OkStatus();  // the root is on another node
    }
    case v1::ALL_GATHER: {
      const core::View out_view = {{payload, n * static_cast<int64_t>(op.local.size())}};
      int64_t at = 0;
      for (const Slice& src : inputs) {  // ascending group rank
        const Slice out{&out_view, at};
        GRADSYNC_RETURN_IF_ERROR(Copy(op.dtype, src, {&out, 1}, n));
        at += n;
      }
      return absl::OkStatus();
    }
    default:
      return absl::InternalError(absl::StrCat("op kind ", OpKindName(op.kind), " (",
                                              static_cast<int>(op.kind), ") has no inline form"));
  }
}

absl::Status NodesCommunicator::Combine(const core::Collective& op, absl::Span<const int> firsts,
                                        int end, absl::Span<const std::byte* const> payloads,
                                        std::byte* out) const {
  switch (op.kind) {
    case v1::BARRIER:
      return absl::OkStatus();
    case v1::ALL_REDUCE:
    case v1::REDUCE_SCATTER: {
      // The ranges' partial reductions in node order: the decision's sum is the one every node
      // takes (the same bits everywhere, whatever the tree's shape).
      const int64_t total = op.kind == v1::ALL_REDUCE ? op.count : op.count * op.group_size;
      std::vector<core::View> views;
      views.reserve(payloads.size());
      for (const std::byte* p : payloads) views.push_back({{const_cast<std::byte*>(p), total}});
      std::vector<Slice> srcs;
      for (const core::View& v : views) srcs.push_back({&v, 0});
      const core::View out_view = {{out, total}};
      const Slice to{&out_view, 0};
      const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
      return Reduce(op.dtype, partial, 1, srcs, {&to, 1}, total);
    }
    case v1::BROADCAST:
    case v1::ALL_GATHER: {
      // The ranges' parts one after another (a broadcast's: the root's alone, in one of them).
      size_t at = 0;
      for (size_t i = 0; i < payloads.size(); ++i) {
        const int last = i + 1 < firsts.size() ? firsts[i + 1] : end;
        const size_t bytes = static_cast<size_t>(SubtreeBytes(op, firsts[i], last));
        if (bytes > 0) std::memcpy(out + at, payloads[i], bytes);
        at += bytes;
      }
      return absl::OkStatus();
    }
    default:  // Pack refused it on every node that agreed on the op
      return absl::InternalError(absl::StrCat("op kind ", OpKindName(op.kind), " (",
                                              static_cast<int>(op.kind), ") has no inline form"));
  }
}

absl::Status NodesCommunicator::Unpack(const core::Collective& op, const std::byte* payload) {
  const int64_t n = op.count;
  const int64_t esize = DTypeSize(op.dtype);
  const int64_t total =
      SubtreeBytes(op, 0, static_cast<int>(nodes_.size())) / std::max<int64_t>(1, esize);
  // Read only: core::View names writable runs.
  const core::View decision = {{const_cast<std::byte*>(payload), total}};
  switch (op.kind) {
    case v1::BARRIER:
      return absl::OkStatus();
    case v1::ALL_REDUCE: {
      // Every node's sum (MEAN: divided here, once).
      const Slice src{&decision, 0};
      std::vector<Slice> dsts;
      for (const core::LocalMember& m : op.local) dsts.push_back({&m.input, 0});
      return Reduce(op.dtype, op.reduce_op, op.group_size, {&src, 1}, dsts, n);
    }
    case v1::REDUCE_SCATTER:
      for (const core::LocalMember& m : op.local) {
        const Slice src{&decision, m.group_rank * n};
        const Slice dst{&m.output, 0};
        GRADSYNC_RETURN_IF_ERROR(
            Reduce(op.dtype, op.reduce_op, op.group_size, {&src, 1}, {&dst, 1}, n));
      }
      return absl::OkStatus();
    case v1::BROADCAST: {
      const Slice src{&decision, 0};
      std::vector<Slice> dsts;
      for (const core::LocalMember& m : op.local) {
        if (m.group_rank != op.root) dsts.push_back({&m.input, 0});
      }
      return Copy(op.dtype, src, dsts, n);
    }
    case v1::ALL_GATHER: {
      // The nodes' parts in node order, each its members' inputs by ascending group rank.
      std::vector<int64_t> next(nodes_.size(), 0);  // elements before each node's next block
      for (size_t node = 1; node < nodes_.size(); ++node) {
        next[node] = next[node - 1] + members_on_node_[node - 1] * n;
      }
      for (int q = 0; q < op.group_size; ++q) {
        const int node = node_of_group_rank_[q];
        const Slice from{&decision, next[node]};
        next[node] += n;
        std::vector<Slice> dsts;
        for (const core::LocalMember& m : op.local) dsts.push_back({&m.output, q * n});
        GRADSYNC_RETURN_IF_ERROR(Copy(op.dtype, from, dsts, n));
      }
      return absl::OkStatus();
    }
    default:  // Pack refused it on every node that agreed on the op
      return absl::InternalError(absl::StrCat("op kind ", OpKindName(op.kind), " (",
                                              static_cast<int>(op.kind), ") has no inline form"));
  }
}

LinkOp NodesCommunicator::LinkOpOf(const core::Collective& op) const {
  LinkOp out;
  out.seq = op.seq;
  out.deadline = op.deadline;
  out.segment_bytes = static_cast<size_t>(tuning_.segment_bytes);
  out.window = tuning_.window_segments;
  return out;
}

absl::Status NodesCommunicator::AllreduceAcrossNodes(const core::Collective& op, int64_t n,
                                                     absl::Span<std::byte* const> buffers,
                                                     bool finish, std::byte* result) {
  RingSpec ring;
  ring.dtype = op.dtype;
  // Unfinished, MEAN sums: the caller divides once at the end, by the group size.
  ring.op = finish || op.reduce_op != v1::MEAN ? op.reduce_op : v1::SUM;
  ring.divisor = op.group_size;
  ring.count = n;
  return RingAllreduce(*links_, LinkOpOf(op), ring, buffers, result);
}

absl::Status NodesCommunicator::ReduceIntoScratch(const core::Collective& op, int64_t n) {
  const int64_t esize = DTypeSize(op.dtype);
  const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
  scratch_.resize(static_cast<size_t>(n * esize));
  const core::View scratch = {{scratch_.data(), n}};
  const Slice out{&scratch, 0};
  std::vector<Slice> locals;
  for (const core::LocalMember& m : op.local) locals.push_back({&m.input, 0});
  GRADSYNC_RETURN_IF_ERROR(Reduce(op.dtype, partial, 1, locals, {&out, 1}, n));
  std::byte* const buffer = scratch_.data();
  return AllreduceAcrossNodes(op, n, {&buffer, 1}, /*finish=*/false);
}

absl::Status NodesCommunicator::ScratchToMembers(const core::Collective& op, int64_t n,
                                                 bool finished) {
  const core::View scratch = {{scratch_.data(), n}};
  const int64_t bytes = n * DTypeSize(op.dtype) * static_cast<int64_t>(op.local.size());
  return SplitAcross(pool_, tuning_.min_bytes_per_part, bytes, n, [&](int64_t begin, int64_t k) {
    const Slice from{&scratch, begin};
    std::vector<Slice> locals;
    for (const core::LocalMember& m : op.local) locals.push_back({&m.input, begin});
    return finished ? Copy(op.dtype, from, locals, k)
                    : Reduce(op.dtype, op.reduce_op, op.group_size, {&from, 1}, locals, k);
  });
}

absl::Status NodesCommunicator::RunLarge(const core::Collective& op) {
  const int64_t esize = DTypeSize(op.dtype);
  const int64_t n = op.count;
  switch (op.kind) {
    case v1::ALL_REDUCE: {
      // Contiguous members (the usual case): the ring reduces them in its own passes and
      // writes each finished block (MEAN divided) to every member. In an elastic job, whose
      // members keep their buffers past a lost node (a ring cut off would leave them partial
      // sums), the ring only reads them: its sums and result go to scratch_, copied to the
      // members once it is done.
      std::vector<std::byte*> contiguous;
      for (const core::LocalMember& m : op.local) {
        if (m.input.size() == 1 && m.input[0].count == n) contiguous.push_back(m.input[0].data);
      }
      if (contiguous.size() == op.local.size()) {
        if (!spec_.elastic) return AllreduceAcrossNodes(op, n, contiguous, /*finish=*/true);
        scratch_.resize(static_cast<size_t>(n * esize));
        GRADSYNC_RETURN_IF_ERROR(
            AllreduceAcrossNodes(op, n, contiguous, /*finish=*/true, scratch_.data()));
        return ScratchToMembers(op, n, /*finished=*/true);
      }
      // Fused ops (members' segments): through one contiguous scratch buffer.
      GRADSYNC_RETURN_IF_ERROR(ReduceIntoScratch(op, n));
      return ScratchToMembers(op, n, /*finished=*/false);
    }
    case v1::BROADCAST: {
      scratch_.resize(static_cast<size_t>(n * esize));
      const core::View scratch = {{scratch_.data(), n}};
      const Slice buf{&scratch, 0};
      std::vector<Slice> locals;
      for (const core::LocalMember& m : op.local) {
        locals.push_back({&m.input, 0});
        if (m.group_rank == op.root) {
          GRADSYNC_RETURN_IF_ERROR(Copy(op.dtype, {&m.input, 0}, {&buf, 1}, n));
        }
      }
      GRADSYNC_RETURN_IF_ERROR(LinkBroadcast(*links_, LinkOpOf(op), node_of_group_rank_[op.root],
                                             absl::MakeSpan(scratch_.data(), scratch_.size())));
      return Copy(op.dtype, buf, locals, n);
    }
    case v1::REDUCE_SCATTER: {
      // The whole input reduced across nodes, then each local member takes its block.
      const int64_t total = n * op.group_size;
      GRADSYNC_RETURN_IF_ERROR(ReduceIntoScratch(op, total));
      const core::View scratch = {{scratch_.data(), total}};
      for (const core::LocalMember& m : op.local) {
        const Slice from{&scratch, m.group_rank * n};
        const Slice to{&m.output, 0};
        GRADSYNC_RETURN_IF_ERROR(
            Reduce(op.dtype, op.reduce_op, op.group_size, {&from, 1}, {&to, 1}, n));
      }
      return absl::OkStatus();
    }
    case v1::ALL_GATHER: {
      // Each node's part is its members' inputs (ascending group rank), the parts in node
      // order; every block is then copied to its place in every member's output.
      std::vector<size_t> part_bytes(nodes_.size(), 0);
      for (int node : node_of_group_rank_) part_bytes[node] += static_cast<size_t>(n * esize);
      std::vector<int64_t> next(nodes_.size(), 0);  // elements before each node's next block
      for (size_t i = 1; i < nodes_.size(); ++i) {
        next[i] = next[i - 1] + static_cast<int64_t>(part_bytes[i - 1]) / esize;
      }
      std::vector<int64_t> block_start(op.group_size);
      for (int q = 0; q < op.group_size; ++q) {
        block_start[q] = next[node_of_group_rank_[q]];
        next[node_of_group_rank_[q]] += n;
      }
      const int64_t total = n * op.group_size;
      scratch_.resize(static_cast<size_t>(total * esize));
      const core::View gathered = {{scratch_.data(), total}};
      for (const core::LocalMember& m : op.local) {
        const Slice to{&gathered, block_start[m.group_rank]};
        GRADSYNC_RETURN_IF_ERROR(Copy(op.dtype, {&m.input, 0}, {&to, 1}, n));
      }
      GRADSYNC_RETURN_IF_ERROR(LinkAllGather(*links_, LinkOpOf(op), part_bytes, scratch_.data()));
      for (int q = 0; q < op.group_size; ++q) {
        const Slice from{&gathered, block_start[q]};
        std::vector<Slice> dsts;
        for (const core::LocalMember& m : op.local) dsts.push_back({&m.output, q * n});
        GRADSYNC_RETURN_IF_ERROR(Copy(op.dtype, from, dsts, n));
      }
      return absl::OkStatus();
    }
    default:  // a barrier, like an unknown kind, is its records alone (TravelsInline)
      return absl::InternalError(absl::StrCat("op kind ", OpKindName(op.kind), " (",
                                              static_cast<int>(op.kind),
                                              ") is not an op that moves data"));
  }
}

}  // namespace gradsync::backend::cpu
