#pragma once

// The CPU data plane: creates each group's communicator, local for a single-node group and
// over TCP links between the daemons for a group that spans nodes.

#include "common/worker_pool.h"
#include "daemon/core/backend.h"

namespace gradsync::backend::cpu {

/// The CPU data plane: collectives over the local members' shared-memory buffers, computed by
/// the daemon (each element read once from every member and written once to every member),
/// split over the worker pool for large ops. A group that spans nodes gets a NodesCommunicator
/// (its members' bytes cross to the peer daemons over TCP) when the spec names the job's store
/// and this daemon's TCP address; without them, or for a group with members elsewhere in a job
/// that does not span nodes, creating the communicator is FAILED_PRECONDITION.
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
