// Implementation of cpu_backend.h: the tuning's checks, the single-node communicator, which runs
// collectives over members' shared memory split across the worker pool, and the choice of
// communicator.

#include "daemon/backend/cpu/cpu_backend.h"

#include <algorithm>
#include <functional>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/nodes_communicator.h"
#include "daemon/backend/cpu/record_links.h"

namespace gradsync::backend::cpu {
namespace {

auto Log() { return logging::Logger("cpu"); }

// The longest message tuning may ask the links for (segments, stream messages).
constexpr int64_t kMaxMessageBytes = int64_t{256} << 20;

// `slices` moved `by` elements on.
std::vector<Slice> Shifted(absl::Span<const Slice> slices, int64_t by) {
  std::vector<Slice> out(slices.begin(), slices.end());
  for (Slice& s : out) s.offset += by;
  return out;
}

class LocalCommunicator final : public core::Communicator {
 public:
  LocalCommunicator(WorkerPool* pool, int64_t min_bytes_per_part)
      : pool_(pool), min_bytes_per_part_(min_bytes_per_part) {}

  absl::Status Run(const core::Collective& op) override {
    if (static_cast<int>(op.local.size()) != op.group_size) {
      return absl::InternalError(absl::StrCat(op.label, ": ", op.local.size(), " local members of ",
                                              op.group_size, " (not a single-node group)"));
    }
    absl::Status status = RunKind(op);
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat(op.label, ": ", status.message()));
  }

 private:
  absl::Status RunKind(const core::Collective& op) {
    const int64_t esize = DTypeSize(op.dtype);
    switch (op.kind) {
      case v1::BARRIER:
        return absl::OkStatus();
      case v1::ALL_REDUCE: {
        std::vector<Slice> all;
        for (const core::LocalMember& m : op.local) all.push_back({&m.input, 0});
        return Split(op.count * esize, op.count, [&](int64_t begin, int64_t n) {
          const std::vector<Slice> part = Shifted(all, begin);
          return Reduce(op.dtype, op.reduce_op, op.group_size, part, part, n);
        });
      }
      case v1::BROADCAST: {
        std::vector<Slice> dsts;
        const core::LocalMember* root = nullptr;
        for (const core::LocalMember& m : op.local) {
          if (m.group_rank == op.root) {
            root = &m;
          } else {
            dsts.push_back({&m.input, 0});
          }
        }
        if (root == nullptr) return absl::InternalError("no root");
        return Split(op.count * esize, op.count, [&](int64_t begin, int64_t n) {
          return Copy(op.dtype, {&root->input, begin}, Shifted(dsts, begin), n);
        });
      }
      case v1::ALL_GATHER:
        for (const core::LocalMember& from : op.local) {
          std::vector<Slice> dsts;
          for (const core::LocalMember& m : op.local) {
            dsts.push_back({&m.output, from.group_rank * op.count});
          }
          absl::Status s =
              Split(op.count * esize * op.group_size, op.count, [&](int64_t begin, int64_t n) {
                return Copy(op.dtype, {&from.input, begin}, Shifted(dsts, begin), n);
              });
          if (!s.ok()) return s;
        }
        return absl::OkStatus();
      case v1::REDUCE_SCATTER:
        for (const core::LocalMember& to : op.local) {
          std::vector<Slice> srcs;
          for (const core::LocalMember& m : op.local) {
            srcs.push_back({&m.input, to.group_rank * op.count});
          }
          const Slice dst{&to.output, 0};
          absl::Status s =
              Split(op.count * esize * op.group_size, op.count, [&](int64_t begin, int64_t n) {
                const Slice part{dst.view, begin};
                return Reduce(op.dtype, op.reduce_op, op.group_size, Shifted(srcs, begin),
                              {&part, 1}, n);
              });
          if (!s.ok()) return s;
        }
        return absl::OkStatus();
      default:  // the engine resolved the op: a kind it let through that this plane lacks
        return absl::InternalError(absl::StrCat("unknown op kind ", OpKindName(op.kind), " (",
                                                static_cast<int>(op.kind), ")"));
    }
  }

  // SplitAcross this daemon's pool (`bytes` per member).
  absl::Status Split(int64_t bytes, int64_t count,
                     const std::function<absl::Status(int64_t begin, int64_t n)>& kernel) {
    return SplitAcross(pool_, min_bytes_per_part_, bytes, count, kernel);
  }

  WorkerPool* const pool_;
  const int64_t min_bytes_per_part_;
};

}  // namespace

absl::Status SplitAcross(WorkerPool* pool, int64_t min_bytes_per_part, int64_t bytes, int64_t count,
                         const std::function<absl::Status(int64_t begin, int64_t n)>& kernel) {
  // Large ops run on a pool worker, which takes a part itself: one part per worker keeps
  // every core busy without a straggler part (3 parts on 2 cores take 2/3 of the time, not 1/2).
  const int parts = pool == nullptr
                        ? 1
                        : static_cast<int>(std::clamp<int64_t>(bytes / min_bytes_per_part, 1,
                                                               std::max(1, pool->size())));
  if (parts == 1) return kernel(0, count);
  std::vector<absl::Status> status(parts);
  pool->ParallelFor(parts, [&](int part) {
    const int64_t begin = count * part / parts;
    const int64_t end = count * (part + 1) / parts;
    status[part] = kernel(begin, end - begin);
  });
  for (absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status ValidateCpuTuning(const CpuTuning& t) {
  auto invalid = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (t.segment_bytes < 4096 || t.segment_bytes > kMaxMessageBytes || t.segment_bytes % 64 != 0) {
    return invalid("--cpu_segment_bytes=", t.segment_bytes, " must be a multiple of 64 in [4096, ",
                   kMaxMessageBytes, "]");
  }
  if (t.window_segments < 1 || t.window_segments > 1024) {
    return invalid("--cpu_window_segments=", t.window_segments, " must be in [1, 1024]");
  }
  if (t.max_stage_ops < 1 || t.max_stage_ops > 65536) {
    return invalid("--cpu_max_stage_ops=", t.max_stage_ops, " must be in [1, 65536]");
  }
  if (t.stream_message_bytes < 4096 || t.stream_message_bytes > kMaxMessageBytes) {
    return invalid("--cpu_stream_message_bytes=", t.stream_message_bytes, " must be in [4096, ",
                   kMaxMessageBytes, "]");
  }
  if (t.stream_flush_bytes < 1 || t.stream_flush_bytes > t.stream_message_bytes) {
    return invalid("--cpu_stream_flush_bytes=", t.stream_flush_bytes,
                   " must be in [1, --cpu_stream_message_bytes=", t.stream_message_bytes, "]");
  }
  if (t.inline_max_bytes < 0 || NodesCommunicator::MinStreamMessageBytes(t.inline_max_bytes) >
                                    static_cast<size_t>(t.stream_message_bytes)) {
    return invalid(
        "--cpu_inline_max_bytes=", t.inline_max_bytes,
        " must not be negative, and an inline op's record (",
        NodesCommunicator::MinStreamMessageBytes(std::max<int64_t>(0, t.inline_max_bytes)),
        " bytes with its message's header) must fit --cpu_stream_message_bytes=",
        t.stream_message_bytes);
  }
  if (t.all_to_all_max_nodes < 1 || t.all_to_all_max_nodes > 1024) {
    return invalid("--cpu_all_to_all_max_nodes=", t.all_to_all_max_nodes, " must be in [1, 1024]");
  }
  if (t.peer_grace <= absl::ZeroDuration()) {
    return invalid("--cpu_peer_grace=", absl::FormatDuration(t.peer_grace), " must be positive");
  }
  if (t.min_bytes_per_part < 1) {
    return invalid("--cpu_min_bytes_per_part=", t.min_bytes_per_part, " must be positive");
  }
  return absl::OkStatus();
}

CpuBackend::CpuBackend(WorkerPool* pool, const CpuTuning& tuning)
    : pool_(pool), tuning_(tuning), park_(std::make_shared<LinkPark>()) {
  Log()->info(
      "cpu data plane tuning inline_max_bytes={} all_to_all_max_nodes={} segment_bytes={} "
      "window_segments={} max_stage_ops={} stream_message_bytes={} stream_flush_bytes={} "
      "peer_grace={} min_bytes_per_part={}",
      tuning_.inline_max_bytes, tuning_.all_to_all_max_nodes, tuning_.segment_bytes,
      tuning_.window_segments, tuning_.max_stage_ops, tuning_.stream_message_bytes,
      tuning_.stream_flush_bytes, absl::FormatDuration(tuning_.peer_grace),
      tuning_.min_bytes_per_part);
}

absl::StatusOr<std::shared_ptr<core::Communicator>> CpuBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  if (!spec.member_nodes.empty() && spec.local_members != spec.members) {
    if (spec.rendezvous == nullptr || spec.node.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", spec.group, " of job ", spec.job,
                       " spans nodes but this "
                       "daemon has no job store or TCP address to reach its peers"));
    }
    return std::make_shared<NodesCommunicator>(spec, tuning_, pool_, park_);
  }
  if (spec.local_members != spec.members) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec.group, " of job ", spec.job, " has members [",
        absl::StrJoin(spec.members, ","), "] but only [", absl::StrJoin(spec.local_members, ","),
        "] are on this node; groups spanning nodes need peer daemons, which this daemon has not "
        "got configured"));
  }
  return std::make_shared<LocalCommunicator>(pool_, tuning_.min_bytes_per_part);
}

}  // namespace gradsync::backend::cpu
