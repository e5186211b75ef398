// Implementation of unix_socket.h.

#include "common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace gradsync {

absl::StatusOr<UnixListener> ListenUnix(const std::string& path, mode_t mode) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' is too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  const mode_t old_umask = ::umask(0777 & ~mode);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_umask);
  struct stat st {};
  if (bound != 0 || ::chmod(path.c_str(), mode) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      ::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::UnavailableError(
        absl::StrCat("cannot listen on ", path, ": ", std::strerror(err)));
  }
  return UnixListener{fd, st.st_ino};
}

}  // namespace gradsync
