// Implementation of socket.h.

#include "daemon/backend/cpu/socket.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"

namespace gradsync::backend::cpu::sock {
namespace {

timespec Left(absl::Time deadline) {
  const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
  return absl::ToTimespec(std::min(left, absl::Hours(24)));
}

}  // namespace

absl::Status Error(const std::string& what, int err) {
  return absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
}

absl::StatusOr<int> Poll(absl::Span<pollfd> fds, absl::Time deadline, int cancel_fd) {
  // The cancel fd goes last, in a copy only when there is one (the common case polls in place).
  std::vector<pollfd> with_cancel;
  pollfd* polled = fds.data();
  size_t count = fds.size();
  if (cancel_fd >= 0) {
    with_cancel.assign(fds.begin(), fds.end());
    with_cancel.push_back({cancel_fd, POLLIN, 0});
    polled = with_cancel.data();
    count = with_cancel.size();
  }
  for (;;) {
    const timespec t = Left(deadline);
    const int rv = ::ppoll(polled, count, &t, nullptr);
    if (rv < 0 && errno == EINTR) continue;
    if (rv < 0) return Error("poll", errno);
    if (cancel_fd >= 0) {
      if ((with_cancel.back().revents & POLLIN) != 0) {
        return absl::CancelledError("cancelled");
      }
      for (size_t i = 0; i < fds.size(); ++i) fds[i].revents = with_cancel[i].revents;
    }
    int ready = 0;
    for (const pollfd& p : fds) ready += p.revents != 0 ? 1 : 0;
    return ready;
  }
}

absl::StatusOr<bool> WaitFor(int fd, short events, absl::Time deadline, int cancel_fd) {
  pollfd p{fd, events, 0};
  absl::StatusOr<int> ready = Poll(absl::MakeSpan(&p, 1), deadline, cancel_fd);
  if (!ready.ok()) return ready.status();
  return *ready > 0;
}

absl::StatusOr<Io> Recv(int fd, void* buffer, size_t size, bool peek) {
  for (;;) {
    const ssize_t rv = ::recv(fd, buffer, size, MSG_DONTWAIT | (peek ? MSG_PEEK : 0));
    if (rv > 0) return Io{static_cast<size_t>(rv), false, false};
    if (rv == 0) return Io{0, false, size > 0};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Io{0, true, false};
    return Error("recv", errno);
  }
}

absl::StatusOr<Io> Send(int fd, const iovec* iov, size_t iov_count) {
  msghdr msg{};
  msg.msg_iov = const_cast<iovec*>(iov);
  msg.msg_iovlen = iov_count;
  for (;;) {
    const ssize_t rv = ::sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (rv >= 0) return Io{static_cast<size_t>(rv), false, false};
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return Io{0, true, false};
    return Error("send", errno);
  }
}

absl::Status SendAll(int fd, const void* bytes, size_t n, absl::Time deadline, int cancel_fd) {
  const char* p = static_cast<const char*>(bytes);
  while (n > 0) {
    iovec iov{const_cast<char*>(p), n};
    absl::StatusOr<Io> io = Send(fd, &iov, 1);
    if (!io.ok()) return io.status();
    p += io->bytes;
    n -= io->bytes;
    if (n == 0) break;
    if (io->bytes > 0) continue;
    absl::StatusOr<bool> ready = WaitFor(fd, POLLOUT, deadline, cancel_fd);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("send timed out");
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* bytes, size_t n, absl::Time deadline, int cancel_fd) {
  char* p = static_cast<char*>(bytes);
  while (n > 0) {
    absl::StatusOr<Io> io = Recv(fd, p, n);
    if (!io.ok()) return io.status();
    if (io->closed) return absl::UnavailableError("the peer closed the connection");
    p += io->bytes;
    n -= io->bytes;
    if (n == 0) break;
    if (io->bytes > 0) continue;
    absl::StatusOr<bool> ready = WaitFor(fd, POLLIN, deadline, cancel_fd);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("receive timed out");
  }
  return absl::OkStatus();
}

absl::Status SetInt(int fd, int level, int name, int value, const char* what) {
  if (::setsockopt(fd, level, name, &value, sizeof(value)) != 0) {
    return Error(absl::StrCat("setsockopt ", what), errno);
  }
  return absl::OkStatus();
}

absl::Status ConnectOutcome(int fd) {
  int err = 0;
  socklen_t len = sizeof(err);
  if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
    return Error("getsockopt SO_ERROR", errno);
  }
  if (err != 0) return Error("connect", err);
  return absl::OkStatus();
}

int NewCancelFd() { return ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); }

void Signal(int cancel_fd) {
  const uint64_t one = 1;
  // EAGAIN (the counter is saturated) leaves it readable, which is all a signal needs.
  for (;;) {
    if (::write(cancel_fd, &one, sizeof(one)) >= 0 || errno != EINTR) return;
  }
}

}  // namespace gradsync::backend::cpu::sock
