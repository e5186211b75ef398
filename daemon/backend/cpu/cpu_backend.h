#pragma once

#include "common/worker_pool.h"
#include "daemon/core/backend.h"

namespace gradsync::backend::cpu {

/// The CPU data plane: collectives over the local members' shared-memory buffers, computed by
/// the daemon (each element read once from every member and written once to every member),
/// split over the worker pool for large ops. Groups that span nodes need peer daemons (Gloo),
/// which this backend does not have yet: creating such a communicator is FAILED_PRECONDITION.
class CpuBackend final : public core::Backend {
 public:
  /// `pool` must outlive the backend and its communicators.
  explicit CpuBackend(WorkerPool* pool) : pool_(pool) {}
  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec& spec) override;

 private:
  WorkerPool* const pool_;
};

}  // namespace gradsync::backend::cpu
