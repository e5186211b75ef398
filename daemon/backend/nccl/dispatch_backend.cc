// Routes a group's ops to the CPU or the GPU backend (see dispatch_backend.h).

#include "daemon/backend/nccl/dispatch_backend.h"

#include <utility>

#include "absl/synchronization/mutex.h"

namespace gradsync::backend::nccl {
namespace {

class DispatchCommunicator final : public core::Communicator {
 public:
  DispatchCommunicator(core::CommunicatorSpec spec, core::Backend* cpu, core::Backend* gpu)
      : spec_(std::move(spec)), cpu_backend_(cpu), gpu_backend_(gpu) {}

  // Forwarded to the planes' communicators made so far, and to those made later.
  void Abort(const absl::Status& status) override {
    std::shared_ptr<core::Communicator> cpu, gpu;
    {
      absl::MutexLock lock(&mu_);
      if (aborted_.ok()) aborted_ = status;
      cpu = cpu_;
      gpu = gpu_;
    }
    if (cpu) cpu->Abort(status);
    if (gpu) gpu->Abort(status);
  }

  absl::Status Run(const core::Collective& op) override {
    absl::StatusOr<core::Communicator*> target = Target(op.plane);
    if (!target.ok()) return target.status();
    return (*target)->Run(op);
  }

  // Each run of consecutive ops on one plane goes to that plane's communicator as one batch
  // (the CPU plane overlaps a batch's exchanges across nodes).
  void RunBatch(absl::Span<const core::Collective* const> ops,
                absl::FunctionRef<void(size_t, absl::Status)> finished) override {
    size_t begin = 0;
    while (begin < ops.size()) {
      const core::Plane plane = ops[begin]->plane;
      size_t end = begin + 1;
      while (end < ops.size() && ops[end]->plane == plane) ++end;
      absl::StatusOr<core::Communicator*> target = Target(plane);
      if (target.ok()) {
        (*target)->RunBatch(ops.subspan(begin, end - begin),
                            [&](size_t i, absl::Status s) { finished(begin + i, std::move(s)); });
      } else {
        for (size_t i = begin; i < end; ++i) finished(i, target.status());
      }
      begin = end;
    }
  }

 private:
  // The plane's communicator for the group, made at its first op there. The engine chose the
  // plane (for a failed op: the one the group's other nodes run it on).
  absl::StatusOr<core::Communicator*> Target(core::Plane plane) {
    const bool device = plane == core::Plane::kDevice;
    {
      absl::MutexLock lock(&mu_);
      if (const std::shared_ptr<core::Communicator>& made = device ? gpu_ : cpu_) {
        return made.get();
      }
    }
    // Made outside the lock (it may take long); only this thread makes them.
    absl::StatusOr<std::shared_ptr<core::Communicator>> made =
        (device ? gpu_backend_ : cpu_backend_)->CreateCommunicator(spec_);
    if (!made.ok()) return made.status();
    absl::Status aborted;
    {
      absl::MutexLock lock(&mu_);
      (device ? gpu_ : cpu_) = *made;
      aborted = aborted_;
    }
    if (!aborted.ok()) (*made)->Abort(aborted);
    return made->get();
  }

  const core::CommunicatorSpec spec_;
  core::Backend* const cpu_backend_;
  core::Backend* const gpu_backend_;
  // A group's ops run one at a time (Communicator contract), so only the running op's thread
  // makes these; the lock is for Abort, which comes from another thread.
  absl::Mutex mu_;
  std::shared_ptr<core::Communicator> cpu_ ABSL_GUARDED_BY(mu_), gpu_ ABSL_GUARDED_BY(mu_);
  absl::Status aborted_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::shared_ptr<core::Communicator>> DispatchBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  return std::make_shared<DispatchCommunicator>(spec, cpu_, gpu_);
}

void DispatchBackend::JobEnded(const std::string& job) {
  gpu_->JobEnded(job);
  cpu_->JobEnded(job);
}

}  // namespace gradsync::backend::nccl
