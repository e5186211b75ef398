#include "daemon/backend/cpu/gloo_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/backend/cpu/gloo_store.h"
#include "daemon/backend/cpu/kernels.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/rendezvous/context.h"
#include "gloo/transport/tcp/device.h"

namespace gradsync::backend::cpu {
namespace {

// How long past an op's deadline a node waits for its peers' verdicts (and connections).
constexpr absl::Duration kGrace = absl::Seconds(10);
// Largest all-reduce Gloo's bcube runs (more than two nodes); larger ones take the ring.
constexpr int64_t kBcubeMaxBytes = 256 << 10;
// Gloo's ring keeps two segments in flight per peer; its default (1 MiB) leaves loopback and
// fast links idle between segments. Measured on loopback (README): 4 MiB was best.
constexpr size_t kSegmentBytes = 4 << 20;

std::chrono::milliseconds Left(absl::Time deadline) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
}

// Element type Gloo is told about: only the size matters, our function does the arithmetic.
template <typename F>
void WithElementType(int64_t esize, F&& f) {
  switch (esize) {
    case 1:
      return f(uint8_t{});
    case 2:
      return f(uint16_t{});
    case 4:
      return f(uint32_t{});
    default:
      return f(uint64_t{});
  }
}

}  // namespace

GlooCommunicator::GlooCommunicator(core::CommunicatorSpec spec, WorkerPool* pool)
    : spec_(std::move(spec)), pool_(pool) {
  nodes_ = spec_.member_nodes;
  std::sort(nodes_.begin(), nodes_.end());
  nodes_.erase(std::unique(nodes_.begin(), nodes_.end()), nodes_.end());
  for (const std::string& n : spec_.member_nodes) {
    node_of_group_rank_.push_back(
        static_cast<int>(std::lower_bound(nodes_.begin(), nodes_.end(), n) - nodes_.begin()));
  }
  my_node_ =
      static_cast<int>(std::lower_bound(nodes_.begin(), nodes_.end(), spec_.node) - nodes_.begin());
}

GlooCommunicator::~GlooCommunicator() = default;

std::string GlooCommunicator::PeersWithRanks() const {
  std::string out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (static_cast<int>(i) == my_node_) continue;
    absl::StrAppend(&out, out.empty() ? "node " : "; node ", nodes_[i], " (ranks ");
    bool first = true;
    for (size_t m = 0; m < spec_.members.size(); ++m) {
      if (node_of_group_rank_[m] != static_cast<int>(i)) continue;
      absl::StrAppend(&out, first ? "" : ",", spec_.members[m]);
      first = false;
    }
    absl::StrAppend(&out, ")");
  }
  return out;
}

absl::Status GlooCommunicator::Connect(absl::Time deadline) {
  if (context_) return absl::OkStatus();
  const std::string what = absl::StrCat("gloo connect job=", spec_.job, " group=", spec_.group,
                                        " nodes=", nodes_.size());
  try {
    ::gloo::transport::tcp::attr attr;
    attr.hostname = spec_.node.substr(0, spec_.node.rfind(':'));  // "host:port" -> host
    auto device = ::gloo::transport::tcp::CreateDevice(attr);
    auto context =
        std::make_shared<::gloo::rendezvous::Context>(my_node_, static_cast<int>(nodes_.size()));
    context->setTimeout(Left(deadline));
    // Under the run's token: a late key of an earlier run of this job id is never read.
    GlooStore store(
        spec_.rendezvous, spec_.job,
        absl::StrCat("gloo/", spec_.run, spec_.run.empty() ? "" : "/", spec_.group, "/"),
        deadline - absl::Now());
    context->connectFullMesh(store, device);
    context_ = std::move(context);
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat(what, ": ", e.what()));
  }
}

absl::Status GlooCommunicator::Run(const core::Collective& op) {
  if (!broken_.ok()) {
    return absl::Status(broken_.code(), absl::StrCat(op.label, ": the group's link to its other ",
                                                     "nodes failed earlier: ", broken_.message()));
  }
  // Connecting is a rendezvous with every node of the group, which each starts at its first op
  // of the group: allow the peers kGrace past this op's deadline (the op still fails if late).
  absl::Status status = Connect(std::max(op.deadline, absl::Now() + kGrace));
  if (status.ok()) {
    try {
      return RunLocked(op);
    } catch (const std::exception& e) {
      context_.reset();
      status = absl::UnavailableError(absl::StrCat(op.label, " across ", nodes_.size(),
                                                   " nodes failed (peers: ", PeersWithRanks(),
                                                   "): ", e.what()));
    }
  }
  // A peer daemon died, or did not reach the op by its deadline. The nodes may now disagree
  // on where the group's sequence stands, so the group stays failed (its ranks form the job
  // again) rather than reconnecting to stale rendezvous keys.
  if (absl::Now() >= op.deadline) {
    status = absl::DeadlineExceededError(
        absl::StrCat(op.label, " did not complete by its deadline: ", "it waited for ",
                     PeersWithRanks(), " (", status.message(), ")"));
  }
  broken_ = status;
  return status;
}

// Every node's view of the op, exchanged before any data moves: an op that failed on one node
// (or that nodes disagree on) fails on all of them at once, the same way, and no node is left
// inside a collective its peers will never enter.
struct Verdict {
  int32_t code;
  char fingerprint[244];
  char message[256];
};
static_assert(sizeof(Verdict) == 504);

absl::Status GlooCommunicator::Agree(const core::Collective& op) {
  absl::Status local = op.local_failure;
  if (local.ok() && absl::Now() > op.deadline) {
    local = absl::DeadlineExceededError(absl::StrCat(
        op.label, " did not complete by its deadline: it waited for ", PeersWithRanks()));
  }
  Verdict mine{};
  mine.code = static_cast<int32_t>(local.code());
  std::snprintf(mine.fingerprint, sizeof(mine.fingerprint), "%s", op.fingerprint.c_str());
  std::snprintf(mine.message, sizeof(mine.message), "%s", std::string(local.message()).c_str());
  std::vector<Verdict> all(nodes_.size());
  ::gloo::AllgatherOptions opts(context_);
  // Peers whose op failed at their own deadline (a rank missing there) come a moment later.
  opts.setTimeout(std::max(Left(op.deadline), absl::ToChronoMilliseconds(kGrace)));
  opts.setInput(reinterpret_cast<uint8_t*>(&mine), sizeof(Verdict));
  opts.setOutput(reinterpret_cast<uint8_t*>(all.data()), sizeof(Verdict) * all.size());
  ::gloo::allgather(opts);
  if (!op.local_failure.ok()) return op.local_failure;
  // A peer's own failure says more than our "we waited for the peers".
  for (size_t i = 0; i < all.size(); ++i) {
    if (static_cast<int>(i) != my_node_ && all[i].code != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(all[i].code),
          absl::StrCat(op.label, " failed on node ", nodes_[i], ": ", all[i].message));
    }
  }
  if (!local.ok()) return local;
  for (size_t i = 0; i < all.size(); ++i) {
    if (std::strncmp(all[i].fingerprint, mine.fingerprint, sizeof(mine.fingerprint)) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("desync across nodes in ", op.label, ": node ", spec_.node, " has ",
                       mine.fingerprint, " but node ", nodes_[i], " has ", all[i].fingerprint));
    }
  }
  return absl::OkStatus();
}

// Gloo's algorithm for an all-reduce of `bytes` among `nodes` daemons: bcube (log-depth
// exchanges) while latency dominates and there are more than two nodes; the ring (bandwidth
// optimal, its segments pipelined) otherwise. With two nodes both are one exchange each way.
namespace {
::gloo::AllreduceOptions::Algorithm AllreduceAlgorithm(size_t nodes, int64_t bytes) {
  return nodes > 2 && bytes <= kBcubeMaxBytes ? ::gloo::AllreduceOptions::Algorithm::BCUBE
                                              : ::gloo::AllreduceOptions::Algorithm::RING;
}
}  // namespace

void GlooCommunicator::AllreduceAcrossNodes(const core::Collective& op, int64_t n,
                                            absl::Span<std::byte* const> buffers) {
  if (n == 0) return;
  const int64_t esize = DTypeSize(op.dtype);
  // MEAN sums everywhere; the caller divides once at the end, by the group size.
  const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
  ::gloo::AllreduceOptions opts(context_);
  opts.setTimeout(Left(op.deadline));
  opts.setAlgorithm(AllreduceAlgorithm(nodes_.size(), n * esize));
  opts.setMaxSegmentSize(kSegmentBytes);
  WithElementType(esize, [&](auto t) {
    using T = decltype(t);
    std::vector<T*> ptrs;
    for (std::byte* b : buffers) ptrs.push_back(reinterpret_cast<T*>(b));
    opts.setOutputs(ptrs, static_cast<size_t>(n));
  });
  const DType dtype = op.dtype;
  opts.setReduceFunction([dtype, partial](void* c, const void* a, const void* b, size_t count) {
    const core::View va = {
        {static_cast<std::byte*>(const_cast<void*>(a)), static_cast<int64_t>(count)}};
    const core::View vb = {
        {static_cast<std::byte*>(const_cast<void*>(b)), static_cast<int64_t>(count)}};
    const core::View vc = {{static_cast<std::byte*>(c), static_cast<int64_t>(count)}};
    const Slice srcs[] = {{&va, 0}, {&vb, 0}};
    const Slice dst{&vc, 0};
    Reduce(dtype, partial, 1, srcs, {&dst, 1}, static_cast<int64_t>(count));
  });
  ::gloo::allreduce(opts);
}

void GlooCommunicator::ReduceIntoScratch(const core::Collective& op, int64_t n) {
  const int64_t esize = DTypeSize(op.dtype);
  const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
  scratch_.resize(static_cast<size_t>(n * esize));
  const core::View scratch = {{scratch_.data(), n}};
  const Slice out{&scratch, 0};
  std::vector<Slice> locals;
  for (const core::LocalMember& m : op.local) locals.push_back({&m.input, 0});
  Reduce(op.dtype, partial, 1, locals, {&out, 1}, n);
  std::byte* const buffer = scratch_.data();
  AllreduceAcrossNodes(op, n, {&buffer, 1});
}

absl::Status GlooCommunicator::RunLocked(const core::Collective& op) {
  if (absl::Status s = Agree(op); !s.ok()) return s;
  const int64_t esize = DTypeSize(op.dtype);
  const int64_t n = op.count;
  switch (op.kind) {
    case v1::BARRIER: {
      ::gloo::BarrierOptions opts(context_);
      opts.setTimeout(Left(op.deadline));
      ::gloo::barrier(opts);
      return absl::OkStatus();
    }
    case v1::ALL_REDUCE: {
      // Contiguous members (the usual case): Gloo reduces them into the first member's
      // buffer segment by segment as the ring sends, and copies each reduced segment to the
      // others as it arrives, so the local passes overlap the network.
      std::vector<std::byte*> contiguous;
      for (const core::LocalMember& m : op.local) {
        if (m.input.size() == 1 && m.input[0].count == n) contiguous.push_back(m.input[0].data);
      }
      if (contiguous.size() == op.local.size()) {
        AllreduceAcrossNodes(op, n, contiguous);
        if (op.reduce_op == v1::MEAN) {
          for (const core::LocalMember& m : op.local) {
            const Slice s{&m.input, 0};
            Reduce(op.dtype, v1::MEAN, op.group_size, {&s, 1}, {&s, 1}, n);
          }
        }
        return absl::OkStatus();
      }
      // Fused ops (members' segments): through one contiguous scratch buffer.
      ReduceIntoScratch(op, n);
      const core::View scratch = {{scratch_.data(), n}};
      const Slice from{&scratch, 0};
      std::vector<Slice> locals;
      for (const core::LocalMember& m : op.local) locals.push_back({&m.input, 0});
      Reduce(op.dtype, op.reduce_op, op.group_size, {&from, 1}, locals, n);
      return absl::OkStatus();
    }
    case v1::BROADCAST: {
      scratch_.resize(static_cast<size_t>(n * esize));
      const core::View scratch = {{scratch_.data(), n}};
      const Slice buf{&scratch, 0};
      const int root_node = node_of_group_rank_[op.root];
      std::vector<Slice> locals;
      for (const core::LocalMember& m : op.local) {
        locals.push_back({&m.input, 0});
        if (m.group_rank == op.root) {
          const Slice src{&m.input, 0};
          Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&src, 1}, {&buf, 1}, n);
        }
      }
      if (n > 0) {
        ::gloo::BroadcastOptions opts(context_);
        opts.setTimeout(Left(op.deadline));
        opts.setRoot(root_node);
        WithElementType(esize, [&](auto t) {
          using T = decltype(t);
          opts.setOutput(reinterpret_cast<T*>(scratch_.data()), static_cast<size_t>(n));
        });
        ::gloo::broadcast(opts);
      }
      Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&buf, 1}, locals, n);
      return absl::OkStatus();
    }
    case v1::REDUCE_SCATTER: {
      // The whole input reduced across nodes, then each local member takes its block.
      const int64_t total = n * op.group_size;
      ReduceIntoScratch(op, total);
      const core::View scratch = {{scratch_.data(), total}};
      for (const core::LocalMember& m : op.local) {
        const Slice from{&scratch, m.group_rank * n};
        const Slice to{&m.output, 0};
        Reduce(op.dtype, op.reduce_op, op.group_size, {&from, 1}, {&to, 1}, n);
      }
      return absl::OkStatus();
    }
    case v1::ALL_GATHER: {
      // Each node contributes its members' inputs (ascending group rank); Gloo's allgatherv
      // lays the nodes' parts out in node order; every block is then copied to its place.
      std::vector<size_t> per_node(nodes_.size(), 0);
      for (int node : node_of_group_rank_) per_node[node] += static_cast<size_t>(n);
      std::vector<int64_t> next(nodes_.size(), 0);
      for (size_t i = 1; i < nodes_.size(); ++i) {
        next[i] = next[i - 1] + static_cast<int64_t>(per_node[i - 1]);
      }
      std::vector<int64_t> block_start(op.group_size);
      for (int q = 0; q < op.group_size; ++q) {
        block_start[q] = next[node_of_group_rank_[q]];
        next[node_of_group_rank_[q]] += n;
      }
      const int64_t total = n * op.group_size;
      const int64_t mine = static_cast<int64_t>(per_node[my_node_]);
      std::vector<std::byte> input(static_cast<size_t>(mine * esize));
      scratch_.resize(static_cast<size_t>(total * esize));
      const core::View in_view = {{input.data(), mine}};
      int64_t at = 0;
      for (const core::LocalMember& m : op.local) {  // ascending group rank
        const Slice from{&m.input, 0};
        const Slice to{&in_view, at};
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&from, 1}, {&to, 1}, n);
        at += n;
      }
      if (total > 0) {
        ::gloo::AllgathervOptions opts(context_);
        opts.setTimeout(Left(op.deadline));
        WithElementType(esize, [&](auto t) {
          using T = decltype(t);
          opts.setInput(reinterpret_cast<T*>(input.data()), static_cast<size_t>(mine));
          opts.setOutput(reinterpret_cast<T*>(scratch_.data()), per_node);
        });
        ::gloo::allgatherv(opts);
      }
      const core::View gathered = {{scratch_.data(), total}};
      for (int q = 0; q < op.group_size; ++q) {
        const Slice from{&gathered, block_start[q]};
        std::vector<Slice> dsts;
        for (const core::LocalMember& m : op.local) dsts.push_back({&m.output, q * n});
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&from, 1}, dsts, n);
      }
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(op.label, ": unknown op kind"));
  }
}

}  // namespace gradsync::backend::cpu
