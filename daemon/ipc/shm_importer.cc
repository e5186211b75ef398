// Implementation of shm_importer.h: redeems a memfd token, checks its seals and size, maps it,
// and counts the mapping against the limits.

#include "daemon/ipc/shm_importer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace gradsync::ipc {
namespace {

class ShmMapping final : public core::MappedBuffer {
 public:
  using Object = std::pair<uint64_t, uint64_t>;  // (st_dev, st_ino)
  // `usage` already counts this mapping (its bytes when size > 0, its object always); the
  // destructor gives it back.
  ShmMapping(std::string name, std::byte* data, int64_t size,
             std::shared_ptr<ShmImporter::Usage> usage, Object object, bool doorbell)
      : name_(std::move(name)),
        data_(data),
        size_(size),
        usage_(std::move(usage)),
        object_(object),
        doorbell_(doorbell) {}
  ~ShmMapping() override {
    if (size_ > 0) {
      ::munmap(data_, static_cast<size_t>(size_));
      usage_->mappings.fetch_sub(1);
      usage_->bytes.fetch_sub(size_);
    }
    absl::MutexLock lock(&usage_->mu);
    auto it = usage_->objects.find(object_);
    if (it == usage_->objects.end()) return;
    (doorbell_ ? it->second.second : it->second.first) -= 1;
    if (it->second.first == 0 && it->second.second == 0) usage_->objects.erase(it);
  }
  std::byte* data() const override { return data_; }
  int64_t size() const override { return size_; }
  std::string Describe() const override { return absl::StrCat("shm:", name_, " bytes=", size_); }

 private:
  const std::string name_;
  std::byte* const data_;
  const int64_t size_;
  const std::shared_ptr<ShmImporter::Usage> usage_;
  const Object object_;
  const bool doorbell_;
};

MappingLimits Resolved(MappingLimits limits) {
  if (limits.max_mapped_bytes == 0) {
    limits.max_mapped_bytes = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) *
                              static_cast<int64_t>(::sysconf(_SC_PAGESIZE));
  }
  return limits;
}

}  // namespace

ShmImporter::ShmImporter(MappingLimits limits)
    : limits_(Resolved(limits)), usage_(std::make_shared<Usage>()) {}

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ShmImporter::Import(
    const v1::RegisterBufferRequest& request) {
  return ImportFd(request, /*doorbell=*/false);
}

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ShmImporter::ImportDoorbell(
    const std::string& fd_token, int64_t bytes) {
  v1::RegisterBufferRequest request;
  request.set_fd_token(fd_token);
  request.set_bytes(bytes);
  return ImportFd(request, /*doorbell=*/true);
}

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ShmImporter::ImportFd(
    const v1::RegisterBufferRequest& request, bool doorbell) {
  if (!request.shm_name().empty()) {
    return absl::InvalidArgumentError(
        "shared memory is never registered by name (shm_name): hand it over the daemon's fd "
        "channel as a memfd sealed with F_SEAL_SHRINK and register its fd_token");
  }
  if (request.bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("buffer bytes ", request.bytes(), " < 0"));
  }
  FdChannel* channel = channel_.load();
  if (channel == nullptr) {
    return absl::FailedPreconditionError(
        "this daemon has no fd channel (it serves no unix socket): trainer sessions are local");
  }
  GRADSYNC_ASSIGN_OR_RETURN(UniqueFd owned, channel->Redeem(request.fd_token()));
  const int fd = owned.get();
  const std::string name = absl::StrCat("memfd@", request.fd_token().substr(0, 8));
  // Only memory that can never shrink under our mapping: a shrunk object faults (SIGBUS) the
  // daemon on its next access. Seals exist only on memfds (and other shmem files).
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the descriptor is not a memfd (it cannot be sealed: ", std::strerror(errno), ")"));
  }
  if ((seals & F_SEAL_SHRINK) == 0) {
    return absl::InvalidArgumentError(
        "the memfd is not sealed against shrinking (fcntl F_ADD_SEALS F_SEAL_SHRINK)");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError("the descriptor is not a regular memfd");
  }
  if (st.st_size < request.bytes()) {
    return absl::FailedPreconditionError(absl::StrCat("shared memory ", name, " has ", st.st_size,
                                                      " bytes, fewer than the ", request.bytes(),
                                                      " registered"));
  }
  // One memory object is a doorbell or data, never both, and a doorbell belongs to one session.
  const ShmMapping::Object object{static_cast<uint64_t>(st.st_dev),
                                  static_cast<uint64_t>(st.st_ino)};
  {
    absl::MutexLock lock(&usage_->mu);
    auto& [as_data, as_doorbell] = usage_->objects[object];
    if (as_doorbell > 0 || (doorbell && as_data > 0)) {
      if (as_data == 0 && as_doorbell == 0) usage_->objects.erase(object);
      return absl::InvalidArgumentError(
          doorbell ? "this memory is already mapped as a data buffer; a doorbell needs its own"
                   : "this memory is a session's doorbell; it cannot also be a data buffer");
    }
    (doorbell ? as_doorbell : as_data) += 1;
  }
  // Until the mapping owns it, the object's count is ours to give back.
  struct ObjectClaim {
    ShmImporter::Usage* usage;
    ShmMapping::Object object;
    bool doorbell;
    bool released = false;
    ~ObjectClaim() {
      if (released) return;
      absl::MutexLock lock(&usage->mu);
      auto it = usage->objects.find(object);
      if (it == usage->objects.end()) return;
      (doorbell ? it->second.second : it->second.first) -= 1;
      if (it->second.first == 0 && it->second.second == 0) usage->objects.erase(it);
    }
  } claim{usage_.get(), object, doorbell};
  std::byte* data = nullptr;
  if (request.bytes() > 0) {
    // Taken before mapping, given back if the mapping is refused or fails.
    auto give_back = [&] {
      usage_->mappings.fetch_sub(1);
      usage_->bytes.fetch_sub(request.bytes());
    };
    const int64_t mappings = usage_->mappings.fetch_add(1);
    const int64_t bytes = usage_->bytes.fetch_add(request.bytes());
    if (mappings >= limits_.max_mappings) {
      give_back();
      return absl::ResourceExhaustedError(
          absl::StrCat("the daemon maps ", mappings,
                       " trainer regions, the limit (--max_mappings); ", name, " refused"));
    }
    if (request.bytes() > limits_.max_mapped_bytes - bytes) {
      give_back();
      return absl::ResourceExhaustedError(
          absl::StrCat("mapping ", request.bytes(), " bytes of ", name,
                       " would take the daemon past ", limits_.max_mapped_bytes,
                       " bytes mapped (--max_mapped_bytes; ", bytes, " are mapped now)"));
    }
    void* p = ::mmap(nullptr, static_cast<size_t>(request.bytes()), PROT_READ | PROT_WRITE,
                     MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      give_back();
      return absl::ResourceExhaustedError(absl::StrCat("cannot map ", request.bytes(), " bytes of ",
                                                       name, ": ", std::strerror(err)));
    }
    data = static_cast<std::byte*>(p);
  }
  // `owned` closes the descriptor: the mapping keeps the memory.
  claim.released = true;
  return std::make_unique<ShmMapping>(name, data, request.bytes(), usage_, object, doorbell);
}

}  // namespace gradsync::ipc
