#pragma once

// CUDA runtime helpers shared by the client (exporting device buffers) and the daemon (mapping
// them); built only with CUDA (GRADSYNC_WITH_CUDA). Links libcudart only: the driver's
// functions are reached through cudaGetDriverEntryPointByVersion, so nothing needs libcuda at
// link or load time.

#include <cstddef>
#include <cstdint>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsync::cuda {

/// The one conversion of a cudaError_t into a Status: "cudaIpcOpenMemHandle (device 0): invalid
/// resource handle (cudaErrorInvalidResourceHandle)". No device, no driver and the like are
/// FAILED_PRECONDITION; bad handles and pointers INVALID_ARGUMENT; out of memory
/// RESOURCE_EXHAUSTED; anything else INTERNAL. Clears CUDA's last error.
absl::Status FromCuda(int error, absl::string_view call, int device = -1);

/// Whether `error` leaves the process's CUDA context corrupt (an illegal address or
/// instruction, a failed launch, a device-side assert...): every later CUDA call of the
/// process fails the same way, and only a new process can use the GPU again.
bool IsSticky(int error);

/// The allocation `ptr` lies in: its base address and size (cuMemGetAddressRange).
absl::StatusOr<std::pair<uintptr_t, size_t>> AllocationRange(const void* ptr);

}  // namespace gradsync::cuda
