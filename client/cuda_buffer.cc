// Client::RegisterCudaBuffer and CudaBuffer: exporting device memory to the daemon; and
// CudaAllocationOf, what a cache of such registrations keys on.
#include <unistd.h>

#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/gradsync_client.h"

#if GRADSYNC_WITH_CUDA
#include <cuda.h>  // the driver's types only: its functions come through the runtime
#include <cuda_runtime_api.h>

#include "common/cuda_util.h"
#endif

namespace gradsync::client {

#if GRADSYNC_WITH_CUDA

namespace {

absl::Status Cuda(cudaError_t e, absl::string_view call, int device) {
  return cuda::FromCuda(static_cast<int>(e), call, device);
}

// Makes `device` current for a scope and restores the caller's device after: a trainer's
// current device is its own (PyTorch keeps state on it).
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
    status_ = Cuda(cudaSetDevice(device), "cudaSetDevice", device);
  }
  ~DeviceScope() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  const absl::Status& status() const { return status_; }

 private:
  int previous_ = -1;
  absl::Status status_;
};

// The device's UUID (cudaDeviceProp.uuid), read once per device: the properties are slow.
absl::StatusOr<std::string> DeviceUuid(int device) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* uuids = new std::map<int, std::string>();
  absl::MutexLock lock(&mu);
  if (auto it = uuids->find(device); it != uuids->end()) return it->second;
  cudaDeviceProp prop{};
  if (absl::Status s =
          Cuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", device);
      !s.ok()) {
    return s;
  }
  return (*uuids)[device] = std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
}

// An interprocess event (no timing) and its handle.
absl::StatusOr<std::string> NewEvent(int device, void** event) {
  cudaEvent_t e = nullptr;
  if (absl::Status s =
          Cuda(cudaEventCreateWithFlags(&e, cudaEventInterprocess | cudaEventDisableTiming),
               "cudaEventCreateWithFlags", device);
      !s.ok()) {
    return s;
  }
  *event = e;
  cudaIpcEventHandle_t h;
  if (absl::Status s = Cuda(cudaIpcGetEventHandle(&h, e), "cudaIpcGetEventHandle", device);
      !s.ok()) {
    return s;
  }
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// cuPointerGetAttributes from the driver, through the runtime (nothing links libcuda).
using GetPointerAttributes = CUresult (*)(unsigned int n, CUpointer_attribute* attributes,
                                          void** data, CUdeviceptr ptr);

GetPointerAttributes PointerAttributesFn() {
  static GetPointerAttributes fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuPointerGetAttributes", &p, 12000, cudaEnableDefault,
                                         &found) != cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return GetPointerAttributes{nullptr};
    }
    return reinterpret_cast<GetPointerAttributes>(p);
  }();
  return fn;
}

}  // namespace

absl::StatusOr<CudaAllocation> CudaAllocationOf(const void* ptr) {
  GetPointerAttributes fn = PointerAttributesFn();
  if (fn == nullptr) {
    return absl::FailedPreconditionError(
        "CudaAllocationOf: the CUDA driver offers no cuPointerGetAttributes (no driver here?)");
  }
  unsigned long long id = 0;
  int device = -1;
  int ipc_capable = 0;  // a CUDA bool: written as one byte or as an int, zeroed either way
  CUpointer_attribute attributes[] = {CU_POINTER_ATTRIBUTE_BUFFER_ID,
                                      CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
                                      CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE};
  void* data[] = {&id, &device, &ipc_capable};
  // Unlike cuPointerGetAttribute, a pointer CUDA does not know is no error: every value stays 0.
  if (const CUresult rc = fn(3, attributes, data, reinterpret_cast<CUdeviceptr>(ptr));
      rc != CUDA_SUCCESS) {
    return absl::InvalidArgumentError(
        absl::StrCat("cuPointerGetAttributes: CUresult ", static_cast<int>(rc)));
  }
  CudaAllocation out;
  if (id == 0) return out;  // not CUDA memory, or freed
  out.id = id;
  out.device = device;
  out.ipc_capable = ipc_capable != 0;
  // The range as RegisterCudaBuffer and the daemon's importer see it (cuMemGetAddressRange),
  // so that a registration of [base, base + bytes) is never refused as too long.
  absl::StatusOr<std::pair<uintptr_t, size_t>> range = cuda::AllocationRange(ptr);
  if (!range.ok()) return range.status();
  out.base = range->first;
  out.bytes = static_cast<int64_t>(range->second);
  return out;
}

CudaBuffer::~CudaBuffer() {
  if (device_ < 0) return;
  DeviceScope scope(device_);
  for (void* e : {ready_, done_}) {
    if (e != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(e));
  }
}

absl::Status CudaBuffer::Ready(void* stream) {
  DeviceScope scope(device_);
  if (!scope.status().ok()) return scope.status();
  return Cuda(cudaEventRecord(static_cast<cudaEvent_t>(ready_), static_cast<cudaStream_t>(stream)),
              "cudaEventRecord", device_);
}

absl::Status CudaBuffer::WaitDone(void* stream) {
  DeviceScope scope(device_);
  if (!scope.status().ok()) return scope.status();
  return Cuda(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(done_), 0),
      "cudaStreamWaitEvent", device_);
}

absl::StatusOr<std::unique_ptr<CudaBuffer>> Client::RegisterCudaBuffer(void* device_ptr,
                                                                       int64_t bytes, DType dtype) {
  if (device_ptr == nullptr || bytes < 0) {
    return absl::InvalidArgumentError("RegisterCudaBuffer: null pointer or negative size");
  }
  cudaPointerAttributes attr{};
  if (absl::Status s =
          Cuda(cudaPointerGetAttributes(&attr, device_ptr), "cudaPointerGetAttributes", -1);
      !s.ok()) {
    return s;
  }
  if (attr.type != cudaMemoryTypeDevice) {
    return absl::InvalidArgumentError("RegisterCudaBuffer: not device memory (cudaMalloc'd)");
  }
  auto buffer = std::unique_ptr<CudaBuffer>(new CudaBuffer());
  buffer->device_ = attr.device;
  buffer->data_ = device_ptr;
  buffer->size_ = bytes;
  DeviceScope scope(attr.device);
  if (!scope.status().ok()) return scope.status();
  // The handle of the allocation's base, and the buffer's offset in it (PyTorch's way).
  absl::StatusOr<std::pair<uintptr_t, size_t>> range = cuda::AllocationRange(device_ptr);
  if (!range.ok()) return range.status();
  cudaIpcMemHandle_t mem;
  if (absl::Status s = Cuda(cudaIpcGetMemHandle(&mem, reinterpret_cast<void*>(range->first)),
                            "cudaIpcGetMemHandle", attr.device);
      !s.ok()) {
    return s;
  }
  v1::RegisterBufferRequest req;
  req.set_bytes(bytes);
  req.set_dtype(dtype);
  v1::CudaIpcBuffer* c = req.mutable_cuda();
  c->set_mem_handle(std::string(reinterpret_cast<const char*>(&mem), sizeof(mem)));
  c->set_offset(static_cast<int64_t>(reinterpret_cast<uintptr_t>(device_ptr) - range->first));
  c->set_device(attr.device);
  c->set_pid(::getpid());
  // The UUID names the device whatever ordinal the daemon's CUDA_VISIBLE_DEVICES gives it.
  absl::StatusOr<std::string> uuid = DeviceUuid(attr.device);
  if (!uuid.ok()) return uuid.status();
  c->set_device_uuid(*uuid);
  absl::StatusOr<std::string> ready = NewEvent(attr.device, &buffer->ready_);
  if (!ready.ok()) return ready.status();
  c->set_ready_event(*ready);
  absl::StatusOr<std::string> done = NewEvent(attr.device, &buffer->done_);
  if (!done.ok()) return done.status();
  c->set_done_event(*done);
  absl::StatusOr<uint64_t> id = RegisterBuffer(req);
  if (!id.ok()) return id.status();
  buffer->id_ = *id;
  return buffer;
}

#else  // without CUDA

CudaBuffer::~CudaBuffer() = default;
absl::Status CudaBuffer::Ready(void*) {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::Status CudaBuffer::WaitDone(void*) {
  return absl::FailedPreconditionError("built without CUDA");
}
absl::StatusOr<CudaAllocation> CudaAllocationOf(const void*) {
  return absl::FailedPreconditionError("gradsync was built without CUDA (GRADSYNC_WITH_CUDA)");
}
absl::StatusOr<std::unique_ptr<CudaBuffer>> Client::RegisterCudaBuffer(void*, int64_t, DType) {
  return absl::FailedPreconditionError("gradsync was built without CUDA (GRADSYNC_WITH_CUDA)");
}

#endif

absl::Status Client::DestroyCudaBuffer(std::unique_ptr<CudaBuffer> buffer) {
  if (!buffer) return absl::OkStatus();
  // The daemon answers once it no longer uses the events (every op that named the buffer has
  // settled on the device): only then are they destroyed. Without that answer they are left
  // to the process's end, since destroying an event under the daemon's pending record of it
  // is undefined (cudaIpcOpenEventHandle).
  absl::Status s = DeregisterBuffer(buffer->id());
  if (!s.ok()) (void)buffer.release();
  return s;
}

}  // namespace gradsync::client
