// Implementation of cuda_importer.h: maps trainers' CUDA buffers from IPC handles, one mapping
// per allocation shared by its buffers, and DispatchImporter's choice of shared memory or CUDA.

#include "daemon/ipc/cuda_importer.h"

#include <unistd.h>

#include <atomic>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace gradsync::ipc {
namespace {

auto Log() { return logging::Logger("ipc"); }

std::string ShortHex(const std::string& handle) {
  return absl::BytesToHexString(handle.substr(0, 8));
}

absl::Status CheckHandle(absl::string_view what, const std::string& bytes) {
  if (bytes.size() != gpu::kIpcHandleBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda.", what, " has ", bytes.size(),
                                                   " bytes; a CUDA IPC handle has ",
                                                   gpu::kIpcHandleBytes));
  }
  return absl::OkStatus();
}

// "GPU-8a4b1c2d-...": a device UUID as nvidia-smi prints it.
std::string FormatUuid(const std::string& uuid) {
  const std::string hex = absl::BytesToHexString(uuid);
  return absl::StrCat("GPU-", hex.substr(0, 8), "-", hex.substr(8, 4), "-", hex.substr(12, 4), "-",
                      hex.substr(16, 4), "-", hex.substr(20));
}

}  // namespace

// One registered buffer: a window of a shared allocation mapping, plus its two events.
class CudaImporter::Mapping final : public core::MappedBuffer {
 public:
  Mapping(CudaImporter* owner, Key key, std::byte* data, int64_t size, gpu::Event ready,
          gpu::Event done, std::string describe)
      : owner_(owner),
        key_(std::move(key)),
        data_(data),
        size_(size),
        ready_(ready),
        done_(done),
        describe_(std::move(describe)) {}
  ~Mapping() override {
    ReleaseEvents();
    owner_->Release(key_);
  }
  std::byte* data() const override { return data_; }
  int64_t size() const override { return size_; }
  std::string Describe() const override { return describe_; }
  int device() const override { return key_.first; }
  void* ready_event() const override { return ready_.load(); }
  void* done_event() const override { return done_.load(); }
  void ReleaseEvents() override {
    for (std::atomic<gpu::Event>* held : {&ready_, &done_}) {
      const gpu::Event e = held->exchange(nullptr);
      if (e == nullptr) continue;
      // A record still pending on a stream completes first (cudaEventDestroy releases the
      // event once the device is done with it).
      if (absl::Status s = owner_->api_->DestroyEvent(key_.first, e); !s.ok()) {
        Log()->warn("cuda event not destroyed buffer={} error={}", describe_, s.ToString());
      }
    }
  }

 private:
  CudaImporter* const owner_;
  const Key key_;
  std::byte* const data_;
  const int64_t size_;
  std::atomic<gpu::Event> ready_;
  std::atomic<gpu::Event> done_;
  const std::string describe_;
};

CudaImporter::~CudaImporter() {
  absl::MutexLock lock(&mu_);
  for (const auto& [key, alloc] : open_) {
    Log()->warn("cuda allocation still mapped at shutdown device={} handle={} refs={}", key.first,
                ShortHex(key.second), alloc.refs);
    (void)api_->CloseMemHandle(key.first, alloc.base);
  }
}

int CudaImporter::open_allocations() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(open_.size());
}

absl::StatusOr<CudaImporter::Allocation> CudaImporter::Acquire(const Key& key) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(key);
  if (it != open_.end()) {
    ++it->second.refs;
    return it->second;
  }
  absl::StatusOr<void*> base = api_->OpenMemHandle(key.first, key.second);
  // An earlier allocation of the trainer at this address is still mapped for a launched op:
  // retried each time a mapping on the device closes, up to settle_timeout_.
  const absl::Time give_up = absl::Now() + settle_timeout_;
  int retries = 0;
  while (absl::IsAlreadyExists(base.status())) {
    // A map's nodes stay put: the condition reads the device's count, under mu_, by address.
    const uint64_t* count = &closed_[key.first];
    const uint64_t seen = *count;
    auto closed = [count, seen] { return *count != seen; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&closed), give_up)) {
      return absl::Status(
          base.status().code(),
          absl::StrCat(base.status().message(),
                       "; an earlier allocation of the trainer's at "
                       "this address was still mapped for a launched op after ",
                       absl::FormatDuration(settle_timeout_), " (", retries, " retries)"));
    }
    if (auto it = open_.find(key); it != open_.end()) {  // mapped meanwhile by another caller
      ++it->second.refs;
      return it->second;
    }
    ++retries;
    base = api_->OpenMemHandle(key.first, key.second);
  }
  if (retries > 0 && base.ok()) {
    Log()->debug(
        "cuda allocation mapped once an earlier one at its address closed device={} "
        "handle={} retries={}",
        key.first, ShortHex(key.second), retries);
  }
  if (!base.ok()) return base.status();
  absl::StatusOr<int64_t> bytes = api_->AllocationBytes(key.first, *base);
  if (!bytes.ok()) {
    (void)api_->CloseMemHandle(key.first, *base);
    return bytes.status();
  }
  Allocation alloc{*base, *bytes, 1};
  open_.emplace(key, alloc);
  Log()->debug("cuda allocation mapped device={} handle={} bytes={}", key.first,
               ShortHex(key.second), *bytes);
  return alloc;
}

void CudaImporter::Release(const Key& key) {
  absl::MutexLock lock(&mu_);
  auto it = open_.find(key);
  if (it == open_.end() || --it->second.refs > 0) return;
  if (absl::Status s = api_->CloseMemHandle(key.first, it->second.base); !s.ok()) {
    Log()->warn("cuda allocation not unmapped device={} handle={} error={}", key.first,
                ShortHex(key.second), s.ToString());
  }
  Log()->debug("cuda allocation unmapped device={} handle={}", key.first, ShortHex(key.second));
  open_.erase(it);
  ++closed_[key.first];
}

absl::StatusOr<int> CudaImporter::DaemonDevice(const v1::CudaIpcBuffer& c) {
  absl::StatusOr<int> devices = api_->DeviceCount();
  if (!devices.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this daemon cannot map CUDA buffers: ", devices.status().message()));
  }
  if (c.device_uuid().empty()) {  // the trainer's ordinal is the daemon's
    if (c.device() < 0 || c.device() >= *devices) {
      return absl::InvalidArgumentError(absl::StrCat("cuda.device ", c.device(),
                                                     " does not exist here: this daemon sees ",
                                                     *devices, " device(s)"));
    }
    return c.device();
  }
  if (c.device_uuid().size() != gpu::kUuidBytes) {
    return absl::InvalidArgumentError(absl::StrCat("cuda.device_uuid has ", c.device_uuid().size(),
                                                   " bytes; a CUDA device UUID has ",
                                                   gpu::kUuidBytes));
  }
  for (int d = 0; d < *devices; ++d) {
    absl::StatusOr<std::string> uuid = DeviceUuid(d);
    if (!uuid.ok()) {
      Log()->warn("device uuid not readable device={} error={}", d, uuid.status().ToString());
      continue;
    }
    if (*uuid == c.device_uuid()) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("the trainer's device ", c.device(), " (", FormatUuid(c.device_uuid()),
                   ") is not among the ", *devices,
                   " device(s) this daemon sees: give the daemon every GPU its trainers use "
                   "(CUDA_VISIBLE_DEVICES)"));
}

absl::StatusOr<std::string> CudaImporter::DeviceUuid(int device) {
  absl::MutexLock lock(&mu_);
  auto it = uuids_.find(device);
  if (it != uuids_.end()) return it->second;
  absl::StatusOr<std::string> uuid = api_->DeviceUuid(device);
  if (uuid.ok()) uuids_[device] = *uuid;
  return uuid;
}

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> CudaImporter::Import(
    const v1::RegisterBufferRequest& request) {
  const v1::CudaIpcBuffer& c = request.cuda();
  if (absl::Status s = CheckHandle("mem_handle", c.mem_handle()); !s.ok()) return s;
  if (absl::Status s = CheckHandle("ready_event", c.ready_event()); !s.ok()) return s;
  if (absl::Status s = CheckHandle("done_event", c.done_event()); !s.ok()) return s;
  if (c.pid() == ::getpid()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the CUDA IPC handle comes from the daemon's own process (pid ", c.pid(),
                     "): CUDA cannot open a handle in the process that exported it"));
  }
  if (c.offset() < 0 || request.bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cuda buffer offset ", c.offset(), " and bytes ",
                                                   request.bytes(), " must not be negative"));
  }
  if (cuda_answered_) {
    if (absl::Status s = cuda_answered_(); !s.ok()) return s;
  }
  absl::StatusOr<int> device = DaemonDevice(c);
  if (!device.ok()) return device.status();
  Key key{*device, c.mem_handle()};
  absl::StatusOr<Allocation> alloc = Acquire(key);
  if (!alloc.ok()) return alloc.status();
  if (c.offset() > alloc->bytes || request.bytes() > alloc->bytes - c.offset()) {
    Release(key);
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda buffer [", c.offset(), ", ", c.offset() + request.bytes(),
        ") lies beyond its allocation of ", alloc->bytes, " bytes on device ", *device));
  }
  absl::StatusOr<gpu::Event> ready = api_->OpenEventHandle(*device, c.ready_event());
  if (!ready.ok()) {
    Release(key);
    return ready.status();
  }
  absl::StatusOr<gpu::Event> done = api_->OpenEventHandle(*device, c.done_event());
  if (!done.ok()) {
    (void)api_->DestroyEvent(*device, *ready);
    Release(key);
    return done.status();
  }
  std::string describe = absl::StrCat("cuda:dev", *device, " alloc=", ShortHex(c.mem_handle()),
                                      " offset=", c.offset(), " bytes=", request.bytes());
  return std::make_unique<Mapping>(this, std::move(key),
                                   static_cast<std::byte*>(alloc->base) + c.offset(),
                                   request.bytes(), *ready, *done, std::move(describe));
}

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> DispatchImporter::Import(
    const v1::RegisterBufferRequest& request) {
  if (request.has_cuda()) {
    if (!request.shm_name().empty() || !request.fd_token().empty()) {
      return absl::InvalidArgumentError("a buffer is shared memory (fd_token) or CUDA, not both");
    }
    return cuda_->Import(request);
  }
  return shm_->Import(request);
}

}  // namespace gradsync::ipc
