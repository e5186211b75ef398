#include "daemon/ipc/cuda_importer.h"

#include <unistd.h>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
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
    for (gpu::Event e : {ready_, done_}) {
      if (absl::Status s = owner_->api_->DestroyEvent(key_.first, e); !s.ok()) {
        Log()->warn("cuda event not destroyed buffer={} error={}", describe_, s.ToString());
      }
    }
    owner_->Release(key_);
  }
  std::byte* data() const override { return data_; }
  int64_t size() const override { return size_; }
  std::string Describe() const override { return describe_; }
  int device() const override { return key_.first; }
  void* ready_event() const override { return ready_; }
  void* done_event() const override { return done_; }

 private:
  CudaImporter* const owner_;
  const Key key_;
  std::byte* const data_;
  const int64_t size_;
  const gpu::Event ready_;
  const gpu::Event done_;
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
  absl::StatusOr<int> devices = api_->DeviceCount();
  if (!devices.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("this daemon cannot map CUDA buffers: ", devices.status().message()));
  }
  if (c.device() < 0 || c.device() >= *devices) {
    return absl::InvalidArgumentError(absl::StrCat("cuda.device ", c.device(),
                                                   " does not exist here: this daemon sees ",
                                                   *devices, " device(s)"));
  }
  Key key{c.device(), c.mem_handle()};
  absl::StatusOr<Allocation> alloc = Acquire(key);
  if (!alloc.ok()) return alloc.status();
  if (c.offset() > alloc->bytes || request.bytes() > alloc->bytes - c.offset()) {
    Release(key);
    return absl::InvalidArgumentError(absl::StrCat(
        "cuda buffer [", c.offset(), ", ", c.offset() + request.bytes(),
        ") lies beyond its allocation of ", alloc->bytes, " bytes on device ", c.device()));
  }
  absl::StatusOr<gpu::Event> ready = api_->OpenEventHandle(c.device(), c.ready_event());
  if (!ready.ok()) {
    Release(key);
    return ready.status();
  }
  absl::StatusOr<gpu::Event> done = api_->OpenEventHandle(c.device(), c.done_event());
  if (!done.ok()) {
    (void)api_->DestroyEvent(c.device(), *ready);
    Release(key);
    return done.status();
  }
  std::string describe = absl::StrCat("cuda:dev", c.device(), " alloc=", ShortHex(c.mem_handle()),
                                      " offset=", c.offset(), " bytes=", request.bytes());
  return std::make_unique<Mapping>(this, std::move(key),
                                   static_cast<std::byte*>(alloc->base) + c.offset(),
                                   request.bytes(), *ready, *done, std::move(describe));
}

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> DispatchImporter::Import(
    const v1::RegisterBufferRequest& request) {
  if (request.has_cuda()) {
    if (!request.shm_name().empty()) {
      return absl::InvalidArgumentError("a buffer is shared memory (shm_name) or CUDA, not both");
    }
    return cuda_->Import(request);
  }
  return shm_->Import(request);
}

}  // namespace gradsync::ipc
