// Implementation of cpu_backend.h: the single-node communicator, which runs collectives over
// members' shared memory split across the worker pool, and the choice of communicator.

#include "daemon/backend/cpu/cpu_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/nodes_communicator.h"

namespace gradsync::backend::cpu {
namespace {

// Below this many bytes per part an op is not worth splitting across threads.
constexpr int64_t kMinBytesPerPart = 256 << 10;

class LocalCommunicator final : public core::Communicator {
 public:
  explicit LocalCommunicator(WorkerPool* pool) : pool_(pool) {}

  absl::Status Run(const core::Collective& op) override {
    if (static_cast<int>(op.local.size()) != op.group_size) {
      return absl::InternalError(absl::StrCat(op.label, ": ", op.local.size(), " local members of ",
                                              op.group_size, " (not a single-node group)"));
    }
    const int64_t esize = DTypeSize(op.dtype);
    switch (op.kind) {
      case v1::BARRIER:
        return absl::OkStatus();
      case v1::ALL_REDUCE: {
        std::vector<Slice> all;
        for (const core::LocalMember& m : op.local) all.push_back({&m.input, 0});
        Split(op, op.count * esize, all, all, op.count);
        return absl::OkStatus();
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
        if (root == nullptr) return absl::InternalError(absl::StrCat(op.label, ": no root"));
        const Slice src{&root->input, 0};
        Split(op, op.count * esize, {&src, 1}, dsts, op.count);
        return absl::OkStatus();
      }
      case v1::ALL_GATHER:
        for (const core::LocalMember& from : op.local) {
          const Slice src{&from.input, 0};
          std::vector<Slice> dsts;
          for (const core::LocalMember& m : op.local) {
            dsts.push_back({&m.output, from.group_rank * op.count});
          }
          Split(op, op.count * esize * op.group_size, {&src, 1}, dsts, op.count);
        }
        return absl::OkStatus();
      case v1::REDUCE_SCATTER:
        for (const core::LocalMember& to : op.local) {
          std::vector<Slice> srcs;
          for (const core::LocalMember& m : op.local) {
            srcs.push_back({&m.input, to.group_rank * op.count});
          }
          const Slice dst{&to.output, 0};
          Split(op, op.count * esize * op.group_size, srcs, {&dst, 1}, op.count);
        }
        return absl::OkStatus();
      default:
        return absl::InvalidArgumentError(absl::StrCat(op.label, ": unknown op kind ", op.kind));
    }
  }

 private:
  // Runs one Reduce over n elements, split into parts of whole elements across the pool when
  // the traffic (`bytes` per member) makes it worth a thread hand-off.
  void Split(const core::Collective& op, int64_t bytes, absl::Span<const Slice> srcs,
             absl::Span<const Slice> dsts, int64_t n) {
    // Large ops run on a pool worker, which takes a part itself: one part per worker keeps
    // every core busy without a straggler part (3 parts on 2 cores take 2/3 of the time, not 1/2).
    const int parts = static_cast<int>(
        std::clamp<int64_t>(bytes / kMinBytesPerPart, 1, std::max(1, pool_->size())));
    if (parts == 1) {
      Reduce(op.dtype, op.reduce_op, op.group_size, srcs, dsts, n);
      return;
    }
    pool_->ParallelFor(parts, [&](int part) {
      const int64_t begin = n * part / parts;
      const int64_t end = n * (part + 1) / parts;
      std::vector<Slice> s(srcs.begin(), srcs.end());
      std::vector<Slice> d(dsts.begin(), dsts.end());
      for (Slice& x : s) x.offset += begin;
      for (Slice& x : d) x.offset += begin;
      Reduce(op.dtype, op.reduce_op, op.group_size, s, d, end - begin);
    });
  }

  WorkerPool* const pool_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<core::Communicator>> CpuBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  if (!spec.member_nodes.empty() && spec.local_members != spec.members) {
    if (spec.rendezvous == nullptr || spec.node.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("group ", spec.group, " of job ", spec.job,
                       " spans nodes but this "
                       "daemon has no job store or TCP address to reach its peers"));
    }
    return std::make_shared<NodesCommunicator>(spec);
  }
  if (spec.local_members != spec.members) {
    return absl::FailedPreconditionError(absl::StrCat(
        "group ", spec.group, " of job ", spec.job, " has members [",
        absl::StrJoin(spec.members, ","), "] but only [", absl::StrJoin(spec.local_members, ","),
        "] are on this node; groups spanning nodes need peer daemons, which this daemon has not "
        "got configured"));
  }
  return std::make_shared<LocalCommunicator>(pool_);
}

}  // namespace gradsync::backend::cpu
