#pragma once

// The data plane of each op: routes a group's ops to the CPU or the GPU backend by the plane
// the engine chose for the op.

#include <memory>
#include <string>

#include "daemon/core/backend.h"

namespace gradsync::backend::nccl {

/// Routes each op of a group to the data plane the engine chose for it (Collective::plane):
/// host to `cpu`, device to `gpu`. Each plane's communicator for a group is made at its first
/// op there. Job end reaches both. Thread-safe.
class DispatchBackend final : public core::Backend {
 public:
  /// Both must outlive this.
  DispatchBackend(core::Backend* cpu, core::Backend* gpu) : cpu_(cpu), gpu_(gpu) {}
  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec& spec) override;
  /// The GPU plane first: it may tell the job's other nodes that its communicators are gone.
  void JobEnded(const std::string& job) override;

 private:
  core::Backend* const cpu_;
  core::Backend* const gpu_;
};

}  // namespace gradsync::backend::nccl
