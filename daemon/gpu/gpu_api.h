#pragma once

// The thin seam between the GPU data plane and CUDA (and, with the NCCL backend, NCCL): every
// call the daemon makes goes through GpuApi, so the logic above it (handle cache, refusals,
// stream and event order, abort and rebuild) is unit-tested on machines without a GPU against a
// fake. The real implementation (gpu_api_cuda.cc, built when CUDA is found) turns every CUDA
// and NCCL result into absl::Status with the call's context (CUDA's through
// common/cuda_util.h, the conversion the client shares).

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::gpu {

inline constexpr size_t kIpcHandleBytes = 64;      // cudaIpcMemHandle_t, cudaIpcEventHandle_t
inline constexpr size_t kNcclUniqueIdBytes = 128;  // ncclUniqueId
inline constexpr size_t kUuidBytes = 16;           // cudaUUID_t

/// An event opened from another process's interprocess event handle (cudaEvent_t).
using Event = void*;
using Stream = void*;  // cudaStream_t
using Comm = void*;    // ncclComm_t

/// One NCCL collective on one communicator (in place for ALL_REDUCE and BROADCAST).
struct NcclCall {
  v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
  v1::ReduceOp reduce_op = v1::REDUCE_OP_UNSPECIFIED;  // MEAN is ncclAvg
  DType dtype = v1::DTYPE_UNSPECIFIED;
  const void* send = nullptr;
  void* recv = nullptr;
  int64_t count = 0;  // elements per rank: of send (ALL_GATHER) or recv (REDUCE_SCATTER)
  int root = 0;       // BROADCAST
  int device = -1;    // the communicator's device: made current for the call, whatever was
  Comm comm = nullptr;
  Stream stream = nullptr;
};

class GpuApi {
 public:
  virtual ~GpuApi() = default;
  /// Devices this process can use. FAILED_PRECONDITION when CUDA cannot run at all (no
  /// device, no driver, built without CUDA), with the reason.
  virtual absl::StatusOr<int> DeviceCount() = 0;
  /// Whether this process's contexts on `device` are MPS clients (cudaDevAttrMpsEnabled;
  /// daemon/gpu/mps.h says why that attribute).
  virtual absl::StatusOr<bool> MpsEnabled(int device) = 0;
  /// The device's UUID (cudaDeviceProp.uuid, kUuidBytes), the same in every process whatever
  /// ordinal CUDA_VISIBLE_DEVICES gives it there.
  virtual absl::StatusOr<std::string> DeviceUuid(int device) = 0;
  /// cudaIpcOpenMemHandle on `device`: the base of the other process's allocation, mapped here.
  /// ALREADY_EXISTS (cudaErrorAlreadyMapped) while an allocation of the same process that
  /// overlaps it (an earlier one at the same address, freed there since) is still mapped here.
  virtual absl::StatusOr<void*> OpenMemHandle(int device, absl::string_view handle) = 0;
  virtual absl::Status CloseMemHandle(int device, void* base) = 0;
  /// Size of the allocation that starts at `base` (the driver's address range of it).
  virtual absl::StatusOr<int64_t> AllocationBytes(int device, void* base) = 0;
  /// cudaIpcOpenEventHandle on `device`.
  virtual absl::StatusOr<Event> OpenEventHandle(int device, absl::string_view handle) = 0;
  virtual absl::Status DestroyEvent(int device, Event event) = 0;

  // ---- streams and events ----
  virtual absl::StatusOr<Stream> CreateStream(int device) = 0;
  virtual absl::Status DestroyStream(int device, Stream stream) = 0;
  /// The stream's later work waits for `event` (cudaStreamWaitEvent).
  virtual absl::Status StreamWaitEvent(int device, Stream stream, Event event) = 0;
  /// Records `event` after the stream's work so far (cudaEventRecord).
  virtual absl::Status RecordEvent(int device, Event event, Stream stream) = 0;
  /// True once all the stream's work has finished (cudaStreamQuery); an error if it failed.
  virtual absl::StatusOr<bool> StreamDone(int device, Stream stream) = 0;
  /// A daemon-owned event on `device` (cudaEventCreateWithFlags, timing disabled), to mark a
  /// position on a stream with RecordEvent; DestroyEvent releases it.
  virtual absl::StatusOr<Event> CreateEvent(int device) = 0;
  /// True once the work before the event's last record has finished (cudaEventQuery); an error
  /// if it failed.
  virtual absl::StatusOr<bool> EventDone(int device, Event event) = 0;

  // ---- NCCL (non-blocking communicators) ----
  virtual absl::StatusOr<std::string> NcclUniqueId() = 0;
  /// ncclCommInitRankConfig with blocking=0 on `device`: returns at once; the communicator is
  /// usable once NcclCommReady says so.
  virtual absl::StatusOr<Comm> NcclCommInitRank(int device, int nranks, absl::string_view id,
                                                int rank) = 0;
  /// ncclCommGetAsyncError: true when ready, false while still in progress, an error status
  /// when the communicator failed (then abort it).
  virtual absl::StatusOr<bool> NcclCommReady(Comm comm) = 0;
  /// ncclCommAbort: stops the communicator's kernels and frees its resources. Blocks, even on
  /// a non-blocking communicator (it waits for NCCL's internal streams and proxy threads, and
  /// freeing device memory waits for the device): call it on the backend's aborter thread only
  /// (backend/nccl/aborter.h).
  virtual absl::Status NcclCommAbort(Comm comm) = 0;
  /// ncclCommRevoke (NCCL >= 2.28): sets the communicator's abort flag, so that its kernels
  /// on the device return, and frees nothing; the communicator reports "in progress" until it
  /// is quiescent. UNIMPLEMENTED where the linked NCCL lacks it.
  virtual absl::Status NcclCommRevoke(Comm comm) = 0;
  virtual absl::Status NcclGroupStart() = 0;
  /// May leave the group's work in progress (non-blocking communicators): poll NcclCommReady.
  virtual absl::Status NcclGroupEnd() = 0;
  virtual absl::Status NcclCollective(const NcclCall& call) = 0;
};

/// Why NCCL would not run as the daemon needs it with this environment: NCCL_COMM_BLOCKING
/// (given as `comm_blocking`, null when unset) overrides the config's blocking = 0, and a
/// blocking initialisation would hold a group's lock for as long as a peer takes to join, out
/// of reach of the op's deadline. FAILED_PRECONDITION naming the variable; OK when unset or 0.
inline absl::Status CheckNcclEnvironment(const char* comm_blocking) {
  if (comm_blocking == nullptr || absl::string_view(comm_blocking) == "0") {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(
      absl::StrCat("NCCL_COMM_BLOCKING=", comm_blocking,
                   " in gradsyncd's environment would make NCCL's initialisation blocking (it "
                   "overrides the communicator's config): unset it, gradsyncd polls non-blocking "
                   "communicators under each op's deadline"));
}

/// Sets NCCL's variables the daemon relies on, unless the operator set them (call before any
/// thread starts: setenv is not thread-safe). NCCL_LAUNCH_ORDER_IMPLICIT=1 (NCCL >= 2.26): each
/// GPU runs the ops of its communicators in the order the host launched them, so that the
/// daemon, which launches a GPU's ops in its trainers' program order (core/submit_order.h), has
/// them run in one order on every node ("Using multiple NCCL communicators concurrently" in
/// NCCL's documentation).
inline void SetNcclDefaults() { ::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/0); }

/// Told, once, of the first CUDA error that leaves this process's CUDA context unusable (see
/// cuda::IsSticky): from then on every GPU call fails until the daemon restarts.
using BrokenHandler = std::function<void(const absl::Status&)>;

/// The real CUDA runtime when the daemon was built with CUDA; otherwise an API whose every call
/// is FAILED_PRECONDITION "built without CUDA".
std::unique_ptr<GpuApi> NewGpuApi(BrokenHandler on_broken = nullptr);

}  // namespace gradsync::gpu
