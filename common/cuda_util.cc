// Implementation of cuda_util.h: the mapping of cudaError_t to Status codes, sticky-error
// detection, and the allocation range looked up through the driver's entry point.

#include "common/cuda_util.h"

#include <cuda_runtime_api.h>

#include <mutex>

#include "absl/strings/str_cat.h"

namespace gradsync::cuda {
namespace {

absl::StatusCode CodeOf(cudaError_t e) {
  switch (e) {
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInitializationError:
    case cudaErrorNotPermitted:
    case cudaErrorNotSupported:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCallRequiresNewerDriver:
    case cudaErrorDevicesUnavailable:
      return absl::StatusCode::kFailedPrecondition;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorAlreadyMapped:
      return absl::StatusCode::kAlreadyExists;
    default:
      return absl::StatusCode::kInternal;
  }
}

// cuMemGetAddressRange (v2 ABI) from the driver.
using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

GetAddressRange AddressRangeFn() {
  static GetAddressRange fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetAddressRange{nullptr};
    }
    return reinterpret_cast<GetAddressRange>(p);
  }();
  return fn;
}

}  // namespace

bool IsSticky(int error) {
  switch (static_cast<cudaError_t>(error)) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

absl::Status FromCuda(int error, absl::string_view call, int device) {
  const auto e = static_cast<cudaError_t>(error);
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear a non-sticky error so later calls do not report it again
  return absl::Status(
      CodeOf(e), absl::StrCat(call, device >= 0 ? absl::StrCat(" (device ", device, ")") : "", ": ",
                              cudaGetErrorString(e), " (", cudaGetErrorName(e), ")"));
}

absl::StatusOr<std::pair<uintptr_t, size_t>> AllocationRange(const void* ptr) {
  GetAddressRange fn = AddressRangeFn();
  if (fn == nullptr) {
    return absl::FailedPreconditionError("the CUDA driver offers no cuMemGetAddressRange");
  }
  unsigned long long base = 0;
  size_t size = 0;
  if (const int rc = fn(&base, &size, reinterpret_cast<unsigned long long>(ptr)); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuMemGetAddressRange: CUresult ", rc, " (not device memory?)"));
  }
  return std::make_pair(static_cast<uintptr_t>(base), size);
}

}  // namespace gradsync::cuda
