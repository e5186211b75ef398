#include "daemon/ipc/shm_importer.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace gradsync::ipc {
namespace {

constexpr size_t kMaxNameLength = 200;

class ShmMapping final : public core::MappedBuffer {
 public:
  ShmMapping(std::string name, std::byte* data, int64_t size)
      : name_(std::move(name)), data_(data), size_(size) {}
  ~ShmMapping() override {
    if (size_ > 0) ::munmap(data_, static_cast<size_t>(size_));
  }
  std::byte* data() const override { return data_; }
  int64_t size() const override { return size_; }
  std::string Describe() const override { return absl::StrCat("shm:", name_, " bytes=", size_); }

 private:
  const std::string name_;
  std::byte* const data_;
  const int64_t size_;
};

absl::Status CheckName(const std::string& name) {
  if (name.size() < 2 || name.size() > kMaxNameLength || name[0] != '/' ||
      name.find('/', 1) != std::string::npos || name.find('\0') != std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shm_name '", name,
                     "' is not a POSIX shared-memory name: one leading '/', no other '/', at most ",
                     kMaxNameLength, " characters"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ShmImporter::Import(
    const v1::RegisterBufferRequest& request) {
  const std::string& name = request.shm_name();
  if (absl::Status s = CheckName(name); !s.ok()) return s;
  if (request.bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("buffer bytes ", request.bytes(), " < 0"));
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat("no shared-memory object ", name));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("cannot open shared memory ", name, ": ", std::strerror(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot stat shared memory ", name, ": ", std::strerror(err)));
  }
  if (st.st_size < request.bytes()) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("shared memory ", name, " has ", st.st_size,
                                                      " bytes, fewer than the ", request.bytes(),
                                                      " registered"));
  }
  std::byte* data = nullptr;
  if (request.bytes() > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(request.bytes()), PROT_READ | PROT_WRITE,
                     MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      return absl::ResourceExhaustedError(absl::StrCat("cannot map ", request.bytes(), " bytes of ",
                                                       name, ": ", std::strerror(err)));
    }
    data = static_cast<std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the object alive
  return std::make_unique<ShmMapping>(name, data, request.bytes());
}

}  // namespace gradsync::ipc
