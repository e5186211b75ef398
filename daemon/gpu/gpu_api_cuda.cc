// GpuApi over the CUDA runtime (libcudart only: the driver library is reached, where needed,
// through cudaGetDriverEntryPointByVersion, so the daemon starts on machines without one).
// NCCL results become absl::Status here (CUDA errors in common/cuda_util.cc), with context.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/cuda_util.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::gpu {
namespace {

absl::StatusCode CodeOf(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::StatusCode::kInvalidArgument;
    case ncclSystemError:
    case ncclRemoteError:
      return absl::StatusCode::kUnavailable;  // a peer or the network went away
    case ncclUnhandledCudaError:
    case ncclInternalError:
    default:
      return absl::StatusCode::kInternal;
  }
}

// "ncclAllReduce: remote process exited or there was a network error (ncclRemoteError): <last>"
absl::Status FromNccl(ncclResult_t r, absl::string_view call, ncclComm_t comm = nullptr) {
  if (r == ncclSuccess || r == ncclInProgress) return absl::OkStatus();
  const char* last = ncclGetLastError(comm);
  return absl::Status(
      CodeOf(r), absl::StrCat(call, ": ", ncclGetErrorString(r),
                              last != nullptr && *last ? ": " : "", last != nullptr ? last : ""));
}

absl::StatusOr<ncclDataType_t> NcclType(DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return ncclFloat32;
    case v1::FLOAT64:
      return ncclFloat64;
    case v1::FLOAT16:
      return ncclFloat16;
    case v1::BFLOAT16:
      return ncclBfloat16;
    case v1::INT32:
      return ncclInt32;
    case v1::INT64:
      return ncclInt64;
    case v1::UINT8:
      return ncclUint8;
    case v1::INT8:
      return ncclInt8;
    default:
      return absl::InvalidArgumentError(absl::StrCat("no NCCL type for dtype ", dtype));
  }
}

absl::StatusOr<ncclRedOp_t> NcclOp(v1::ReduceOp op) {
  switch (op) {
    case v1::SUM:
      return ncclSum;
    case v1::MEAN:
      return ncclAvg;
    case v1::MIN:
      return ncclMin;
    case v1::MAX:
      return ncclMax;
    default:
      return absl::InvalidArgumentError(absl::StrCat("no NCCL reduction for op ", op));
  }
}

template <typename Handle>
Handle HandleFrom(absl::string_view bytes) {
  Handle h;
  static_assert(sizeof(Handle) == kIpcHandleBytes);
  std::memcpy(&h, bytes.data(), sizeof(h));
  return h;
}

class CudaGpuApi final : public GpuApi {
 public:
  explicit CudaGpuApi(BrokenHandler on_broken) : on_broken_(std::move(on_broken)) {}

  absl::StatusOr<int> DeviceCount() override {
    int n = 0;
    if (absl::Status s = FromCuda(cudaGetDeviceCount(&n), "cudaGetDeviceCount", -1); !s.ok()) {
      return absl::FailedPreconditionError(s.message());
    }
    return n;
  }

  absl::StatusOr<bool> MpsEnabled(int device) override {
    int on = 0;
    if (absl::Status s = FromCuda(cudaDeviceGetAttribute(&on, cudaDevAttrMpsEnabled, device),
                                  "cudaDeviceGetAttribute(cudaDevAttrMpsEnabled)", device);
        !s.ok()) {
      return s;
    }
    return on != 0;
  }

  absl::StatusOr<std::string> DeviceUuid(int device) override {
    cudaDeviceProp prop{};
    if (absl::Status s =
            FromCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties", device);
        !s.ok()) {
      return s;
    }
    static_assert(sizeof(prop.uuid.bytes) == kUuidBytes);
    return std::string(prop.uuid.bytes, sizeof(prop.uuid.bytes));
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
    absl::StatusOr<std::pair<uintptr_t, size_t>> range = cuda::AllocationRange(base);
    if (!range.ok()) return range.status();
    // The mapping starts at the allocation's base, or inside the block the driver carved it
    // from (IPC shares whole blocks): the bytes from `base` to the end of that range.
    const auto at = reinterpret_cast<uintptr_t>(base);
    if (at < range->first || at >= range->first + range->second) {
      return absl::InternalError("the mapped CUDA IPC pointer lies outside its address range");
    }
    return static_cast<int64_t>(range->first + range->second - at);
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

  absl::StatusOr<Stream> CreateStream(int device) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    cudaStream_t stream = nullptr;
    absl::Status s = FromCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking),
                              "cudaStreamCreateWithFlags", device);
    if (!s.ok()) return s;
    return static_cast<Stream>(stream);
  }

  absl::Status DestroyStream(int device, Stream stream) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return FromCuda(cudaStreamDestroy(static_cast<cudaStream_t>(stream)), "cudaStreamDestroy",
                    device);
  }

  absl::Status StreamWaitEvent(int device, Stream stream, Event event) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return FromCuda(
        cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0),
        "cudaStreamWaitEvent", device);
  }

  absl::Status RecordEvent(int device, Event event, Stream stream) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return FromCuda(
        cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)),
        "cudaEventRecord", device);
  }

  absl::StatusOr<bool> StreamDone(int device, Stream stream) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return Reached(cudaStreamQuery(static_cast<cudaStream_t>(stream)), "cudaStreamQuery", device);
  }

  absl::StatusOr<Event> CreateEvent(int device) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    cudaEvent_t event = nullptr;
    absl::Status s = FromCuda(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                              "cudaEventCreateWithFlags", device);
    if (!s.ok()) return s;
    return static_cast<Event>(event);
  }

  absl::StatusOr<bool> EventDone(int device, Event event) override {
    if (absl::Status s = Use(device); !s.ok()) return s;
    return Reached(cudaEventQuery(static_cast<cudaEvent_t>(event)), "cudaEventQuery", device);
  }

  absl::StatusOr<std::string> NcclUniqueId() override {
    ncclUniqueId id;
    if (absl::Status s = FromNccl(ncclGetUniqueId(&id), "ncclGetUniqueId"); !s.ok()) return s;
    static_assert(sizeof(id) == kNcclUniqueIdBytes);
    return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
  }

  absl::StatusOr<Comm> NcclCommInitRank(int device, int nranks, absl::string_view id,
                                        int rank) override {
    if (id.size() != kNcclUniqueIdBytes) {
      return absl::InvalidArgumentError(absl::StrCat("NCCL unique id of ", id.size(), " bytes"));
    }
    if (absl::Status s = CheckNcclEnvironment(std::getenv("NCCL_COMM_BLOCKING")); !s.ok()) {
      return s;
    }
    if (absl::Status s = Use(device); !s.ok()) return s;
    ncclUniqueId uid;
    std::memcpy(&uid, id.data(), sizeof(uid));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;  // returns at once; the daemon polls, bounded by the op's deadline
    ncclComm_t comm = nullptr;
    absl::Status s = FromNccl(ncclCommInitRankConfig(&comm, nranks, uid, rank, &config),
                              absl::StrCat("ncclCommInitRankConfig (device ", device, ", rank ",
                                           rank, " of ", nranks, ")"));
    if (!s.ok()) return s;
    return static_cast<Comm>(comm);
  }

  absl::StatusOr<bool> NcclCommReady(Comm comm) override {
    ncclResult_t async = ncclSuccess;
    auto c = static_cast<ncclComm_t>(comm);
    if (absl::Status s = FromNccl(ncclCommGetAsyncError(c, &async), "ncclCommGetAsyncError", c);
        !s.ok()) {
      return s;
    }
    if (async == ncclInProgress) return false;
    if (absl::Status s = FromNccl(async, "NCCL communicator", c); !s.ok()) return s;
    return true;
  }

  absl::Status NcclCommAbort(Comm comm) override {
    return FromNccl(ncclCommAbort(static_cast<ncclComm_t>(comm)), "ncclCommAbort");
  }

  absl::Status NcclCommRevoke(Comm comm) override {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
    auto c = static_cast<ncclComm_t>(comm);
    return FromNccl(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT), "ncclCommRevoke", c);
#else
    (void)comm;
    return absl::UnimplementedError("ncclCommRevoke needs NCCL 2.28 or later");
#endif
  }

  absl::Status NcclGroupStart() override { return FromNccl(ncclGroupStart(), "ncclGroupStart"); }
  absl::Status NcclGroupEnd() override { return FromNccl(ncclGroupEnd(), "ncclGroupEnd"); }

  absl::Status NcclCollective(const NcclCall& call) override {
    absl::StatusOr<ncclDataType_t> type = NcclType(call.dtype);
    if (!type.ok()) return type.status();
    // NCCL launches on the current device: never the one an earlier call happened to leave.
    if (absl::Status s = Use(call.device); !s.ok()) return s;
    auto comm = static_cast<ncclComm_t>(call.comm);
    auto stream = static_cast<cudaStream_t>(call.stream);
    const auto n = static_cast<size_t>(call.count);
    switch (call.kind) {
      case v1::ALL_REDUCE: {
        absl::StatusOr<ncclRedOp_t> op = NcclOp(call.reduce_op);
        if (!op.ok()) return op.status();
        return FromNccl(ncclAllReduce(call.send, call.recv, n, *type, *op, comm, stream),
                        "ncclAllReduce", comm);
      }
      case v1::BROADCAST:
        return FromNccl(ncclBroadcast(call.send, call.recv, n, *type, call.root, comm, stream),
                        "ncclBroadcast", comm);
      case v1::ALL_GATHER:
        return FromNccl(ncclAllGather(call.send, call.recv, n, *type, comm, stream),
                        "ncclAllGather", comm);
      case v1::REDUCE_SCATTER: {
        absl::StatusOr<ncclRedOp_t> op = NcclOp(call.reduce_op);
        if (!op.ok()) return op.status();
        return FromNccl(ncclReduceScatter(call.send, call.recv, n, *type, *op, comm, stream),
                        "ncclReduceScatter", comm);
      }
      default:
        return absl::InvalidArgumentError(absl::StrCat("no NCCL collective for kind ", call.kind));
    }
  }

 private:
  // Every CUDA result of this API passes here: the first sticky error is reported, once.
  // What a cudaStreamQuery/cudaEventQuery said: false while the work is not done (that
  // "error" cleared), true once it is, or the error.
  absl::StatusOr<bool> Reached(cudaError_t e, absl::string_view call, int device) {
    if (e == cudaErrorNotReady) {
      cudaGetLastError();
      return false;
    }
    if (absl::Status s = FromCuda(e, call, device); !s.ok()) return s;
    return true;
  }

  absl::Status FromCuda(cudaError_t e, absl::string_view call, int device) {
    absl::Status s = cuda::FromCuda(static_cast<int>(e), call, device);
    if (cuda::IsSticky(static_cast<int>(e)) && !broken_.exchange(true) && on_broken_) {
      on_broken_(s);
    }
    return s;
  }
  absl::Status Use(int device) { return FromCuda(cudaSetDevice(device), "cudaSetDevice", device); }

  const BrokenHandler on_broken_;
  std::atomic<bool> broken_{false};
};

}  // namespace

std::unique_ptr<GpuApi> NewGpuApi(BrokenHandler on_broken) {
  return std::make_unique<CudaGpuApi>(std::move(on_broken));
}

}  // namespace gradsync::gpu
