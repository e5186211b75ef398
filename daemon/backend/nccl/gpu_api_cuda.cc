// GpuApi over the CUDA runtime (libcudart only: the driver library is reached, where needed,
// through cudaGetDriverEntryPointByVersion, so the daemon starts on machines without one).
// The one place where CUDA's error codes become absl::Status.
#include <cuda_runtime_api.h>

#include <cstring>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "daemon/backend/nccl/gpu_api.h"

namespace gradsync::gpu {
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

// "cudaIpcOpenMemHandle (device 0): invalid resource handle (cudaErrorInvalidResourceHandle)"
absl::Status FromCuda(cudaError_t e, absl::string_view call, int device) {
  if (e == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();  // clear the sticky non-fatal error so later calls do not report it
  return absl::Status(CodeOf(e), absl::StrCat(call, device >= 0 ? " (device " : "",
                                              device >= 0 ? absl::StrCat(device, ")") : "", ": ",
                                              cudaGetErrorString(e), " (", cudaGetErrorName(e),
                                              ")"));
}

template <typename Handle>
Handle HandleFrom(absl::string_view bytes) {
  Handle h;
  static_assert(sizeof(Handle) == kIpcHandleBytes);
  std::memcpy(&h, bytes.data(), sizeof(h));
  return h;
}

// cuMemGetAddressRange from the driver, without linking it.
using GetAddressRange = int (*)(unsigned long long* base, size_t* size, unsigned long long ptr);

class CudaGpuApi final : public GpuApi {
 public:
  absl::StatusOr<int> DeviceCount() override {
    int n = 0;
    if (absl::Status s = FromCuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount", -1); !s.ok()) {
      return absl::FailedPreconditionError(s.message());
    }
    return n;
  }

  absl::StatusOr<void*> OpenMemHandle(int device, absl::string_view handle) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    void* base = nullptr;
    absl::Status s = FromCuda(cudaIpcOpenMemHandle(&base, HandleFrom<cudaIpcMemHandle_t>(handle),
                                                   cudaIpcMemLazyEnablePeerAccess),
                              "cudaIpcOpenMemHandle", device);
    if (!s.ok()) return s;
    return base;
  }

  absl::Status CloseMemHandle(int device, void* base) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return FromCuda(cudaIpcCloseMemHandle(base), "cudaIpcCloseMemHandle", device);
  }

  absl::StatusOr<int64_t> AllocationBytes(int device, void* base) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    GetAddressRange range = AddressRange();
    if (range == nullptr) {
      return absl::FailedPreconditionError("the CUDA driver has no cuMemGetAddressRange");
    }
    unsigned long long start = 0;
    size_t size = 0;
    const int rc = range(&start, &size, reinterpret_cast<unsigned long long>(base));
    if (rc != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuMemGetAddressRange (device ", device, ") failed: CUresult ", rc));
    }
    // The handle was taken at the allocation's base; anything else is a client bug.
    if (start != reinterpret_cast<unsigned long long>(base)) {
      return absl::InvalidArgumentError(
          "the CUDA IPC handle was not taken at its allocation's base address");
    }
    return static_cast<int64_t>(size);
  }

  absl::StatusOr<Event> OpenEventHandle(int device, absl::string_view handle) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    cudaEvent_t event = nullptr;
    absl::Status s =
        FromCuda(cudaIpcOpenEventHandle(&event, HandleFrom<cudaIpcEventHandle_t>(handle)),
                 "cudaIpcOpenEventHandle", device);
    if (!s.ok()) return s;
    return static_cast<Event>(event);
  }

  absl::Status DestroyEvent(int device, Event event) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return FromCuda(cudaEventDestroy(static_cast<cudaEvent_t>(event)), "cudaEventDestroy", device);
  }

 private:
  static absl::Status Use(int device) {
    return FromCuda(cudaSetDevice(device), "cudaSetDevice", device);
  }

  GetAddressRange AddressRange() {
    std::call_once(range_once_, [this] {
      void* fn = nullptr;
      cudaDriverEntryPointQueryResult found{};
      if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                           cudaEnableDefault, &found) == cudaSuccess &&
          found == cudaDriverEntryPointSuccess) {
        range_ = reinterpret_cast<GetAddressRange>(fn);
      }
    });
    return range_;
  }

  std::once_flag range_once_;
  GetAddressRange range_ = nullptr;
};

}  // namespace

std::unique_ptr<GpuApi> NewGpuApi() { return std::make_unique<CudaGpuApi>(); }

}  // namespace gradsync::gpu
