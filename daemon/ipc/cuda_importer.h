#pragma once

// The daemon's side of trainers' CUDA buffers: maps them from their IPC handles, one mapping
// per allocation; and the importer that sends each registration to shared memory or CUDA.

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::ipc {

/// Maps trainers' CUDA device buffers from their IPC handles (RegisterBufferRequest.cuda).
///
/// Each allocation is opened once per (device, handle) and the mapping shared by every buffer
/// that lies in it (PyTorch hands out blocks of one caching-allocator segment); the mapping is
/// closed when the last of them is dropped (deregistration, session end). CUDA would allow more:
/// a second cudaIpcOpenMemHandle of the same handle in the same context returns the same
/// pointer and counts a reference, each open needing its own close; one open and a count of our
/// own keep that bookkeeping in one place. Refused with a clear status, changing nothing:
/// a malformed handle or event (INVALID_ARGUMENT), a handle from the daemon's own process
/// (INVALID_ARGUMENT: CUDA cannot open those), a device this daemon does not have
/// (INVALID_ARGUMENT; the device is found by its UUID when the trainer sends one, so the two
/// processes may number the GPUs differently), a buffer beyond its allocation (INVALID_ARGUMENT),
/// no usable GPU at all (FAILED_PRECONDITION, with CUDA's reason). Thread-safe.
///
/// A trainer may free an allocation and get a new one at the same address (torch's
/// empty_cache, an out-of-memory retry) while a launched op still holds the old mapping here
/// (a launched op keeps its buffers mapped until its streams have run it): CUDA then refuses
/// the new handle (cudaErrorAlreadyMapped). Import waits for the next mapping this importer
/// closes on that device and tries again, until `settle_timeout` has passed since the first
/// refusal (then the refusal, saying what it waited for). Such an op settles within
/// milliseconds on a GPU; the wait blocks only the registering caller, with no lock of the
/// importer held.
class CudaImporter final : public core::BufferImporter {
 public:
  static constexpr absl::Duration kSettleTimeout = absl::Seconds(10);
  explicit CudaImporter(gpu::GpuApi* api, absl::Duration settle_timeout = kSettleTimeout)
      : api_(api), settle_timeout_(settle_timeout) {}
  ~CudaImporter() override;

  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> Import(
      const v1::RegisterBufferRequest& request) override;
  /// Until `answered` says OK, Import refuses with its status before any CUDA call: CUDA's
  /// initialisation may not have answered (gpu::MpsFacts::cuda_answered). Call before serving.
  void SetCudaAnswered(std::function<absl::Status()> answered) {
    cuda_answered_ = std::move(answered);
  }

  /// Allocations mapped now (for tests and inspection).
  int open_allocations() const;

 private:
  struct Allocation {
    void* base = nullptr;
    int64_t bytes = 0;
    int refs = 0;
  };
  using Key = std::pair<int, std::string>;  // (device, mem handle)
  class Mapping;

  // The daemon's ordinal of the buffer's device: the one with its UUID, or (no UUID sent) the
  // trainer's ordinal.
  absl::StatusOr<int> DaemonDevice(const v1::CudaIpcBuffer& c);
  absl::StatusOr<std::string> DeviceUuid(int device);  // cached: a device keeps its UUID
  // Takes a reference on the (device, handle) mapping, opening it if needed.
  absl::StatusOr<Allocation> Acquire(const Key& key);
  void Release(const Key& key);

  gpu::GpuApi* const api_;
  const absl::Duration settle_timeout_;
  std::function<absl::Status()> cuda_answered_;
  mutable absl::Mutex mu_;
  std::map<Key, Allocation> open_ ABSL_GUARDED_BY(mu_);
  // Mappings closed so far, per device: what an open refused as already mapped waits for.
  std::map<int, uint64_t> closed_ ABSL_GUARDED_BY(mu_);
  std::map<int, std::string> uuids_ ABSL_GUARDED_BY(mu_);
};

/// Sends each registration to the importer of its kind: shared memory or CUDA.
class DispatchImporter final : public core::BufferImporter {
 public:
  DispatchImporter(core::BufferImporter* shm, core::BufferImporter* cuda)
      : shm_(shm), cuda_(cuda) {}
  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> Import(
      const v1::RegisterBufferRequest& request) override;
  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ImportDoorbell(const std::string& fd_token,
                                                                     int64_t bytes) override {
    return shm_->ImportDoorbell(fd_token, bytes);
  }

 private:
  core::BufferImporter* const shm_;
  core::BufferImporter* const cuda_;
};

}  // namespace gradsync::ipc
