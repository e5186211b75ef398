#pragma once

// The thin seam between the GPU data plane and CUDA (and, with the NCCL backend, NCCL): every
// call the daemon makes goes through GpuApi, so the logic above it (handle cache, refusals,
// stream and event order, abort and rebuild) is unit-tested on machines without a GPU against a
// fake. The real implementation (gpu_api_cuda.cc, built when CUDA is found) is the one place
// where CUDA's error codes become absl::Status, with the call's context in the message.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsync::gpu {

inline constexpr size_t kIpcHandleBytes = 64;  // cudaIpcMemHandle_t, cudaIpcEventHandle_t

/// An event opened from another process's interprocess event handle (cudaEvent_t).
using Event = void*;

class GpuApi {
 public:
  virtual ~GpuApi() = default;
  /// Devices this process can use. FAILED_PRECONDITION when CUDA cannot run at all (no
  /// device, no driver, built without CUDA), with the reason.
  virtual absl::StatusOr<int> DeviceCount() = 0;
  /// cudaIpcOpenMemHandle on `device`: the base of the other process's allocation, mapped here.
  virtual absl::StatusOr<void*> OpenMemHandle(int device, absl::string_view handle) = 0;
  virtual absl::Status CloseMemHandle(int device, void* base) = 0;
  /// Size of the allocation that starts at `base` (the driver's address range of it).
  virtual absl::StatusOr<int64_t> AllocationBytes(int device, void* base) = 0;
  /// cudaIpcOpenEventHandle on `device`.
  virtual absl::StatusOr<Event> OpenEventHandle(int device, absl::string_view handle) = 0;
  virtual absl::Status DestroyEvent(int device, Event event) = 0;
};

/// The real CUDA runtime when the daemon was built with CUDA; otherwise an API whose every call
/// is FAILED_PRECONDITION "built without CUDA".
std::unique_ptr<GpuApi> NewGpuApi();

}  // namespace gradsync::gpu
