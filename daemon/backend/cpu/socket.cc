// Implementation of socket.h.

#include "daemon/backend/cpu/socket.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace gradsync::backend::cpu::sock {
namespace {

// The type URL of the errno an Error carries.
constexpr char kErrnoPayload[] = "type.gradsync.dev/errno";

timespec Left(absl::Time deadline) {
  const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
  return absl::ToTimespec(std::min(left, absl::Hours(24)));
}

// getaddrinfo(3) of a numeric service, freed when it goes.
struct AddrInfoFree {
  void operator()(addrinfo* a) const { ::freeaddrinfo(a); }
};
using AddrInfo = std::unique_ptr<addrinfo, AddrInfoFree>;

absl::StatusOr<AddrInfo> Resolve(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* out = nullptr;
  if (const int rv = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &out); rv != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", ::gai_strerror(rv)));
  }
  return AddrInfo(out);
}

// The address part of a peer's socket address.
std::string SourceOf(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, text,
                sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr, text,
                sizeof(text));
  }
  return text;
}

}  // namespace

absl::Status Error(const std::string& what, int err) {
  absl::Status status = absl::UnavailableError(absl::StrCat(what, ": ", std::strerror(err)));
  status.SetPayload(kErrnoPayload, absl::Cord(absl::StrCat(err)));
  return status;
}

int ErrnoOf(const absl::Status& status) {
  const auto payload = status.GetPayload(kErrnoPayload);  // absl::optional<absl::Cord>
  int err = 0;
  if (!payload.has_value() || !absl::SimpleAtoi(std::string(*payload), &err)) return 0;
  return err;
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

namespace {

bool IsLoopback(const std::string& host) { return host == "::1" || absl::StartsWith(host, "127."); }

}  // namespace

std::string HostOf(const std::string& node) {
  std::string host = node.substr(0, node.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

absl::StatusOr<Listening> Listen(const std::string& host, int backlog) {
  absl::StatusOr<AddrInfo> local = Resolve(host, "0");
  if (!local.ok()) return local.status();
  Listening out;
  out.fd = UniqueFd(::socket((*local)->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (out.fd.get() < 0) return Error("socket", errno);
  if (::bind(out.fd.get(), (*local)->ai_addr, (*local)->ai_addrlen) != 0) {
    return Error(absl::StrCat("bind ", host), errno);
  }
  if (::listen(out.fd.get(), backlog) != 0) return Error("listen", errno);
  sockaddr_storage addr{};
  socklen_t addr_len = sizeof(addr);
  if (::getsockname(out.fd.get(), reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0) {
    return Error("getsockname", errno);
  }
  out.port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return out;
}

absl::StatusOr<UniqueFd> Connect(const std::string& host, const std::string& port,
                                 absl::Time deadline, int cancel_fd, const std::string& source) {
  absl::StatusOr<AddrInfo> remote = Resolve(host, port);
  if (!remote.ok()) return remote.status();
  UniqueFd fd(::socket((*remote)->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0) return Error("socket", errno);
  if (IsLoopback(host) && IsLoopback(source) && source != host) {
    absl::StatusOr<AddrInfo> local = Resolve(source, "0");
    if (!local.ok()) return local.status();
    if ((*local)->ai_family == (*remote)->ai_family &&
        ::bind(fd.get(), (*local)->ai_addr, (*local)->ai_addrlen) != 0) {
      return Error(absl::StrCat("bind ", source), errno);
    }
  }
  int rv = -1;
  do {
    rv = ::connect(fd.get(), (*remote)->ai_addr, (*remote)->ai_addrlen);
  } while (rv != 0 && errno == EINTR);
  if (rv == 0) return fd;
  if (errno != EINPROGRESS) return Error("connect", errno);
  absl::StatusOr<bool> ready = WaitFor(fd.get(), POLLOUT, deadline, cancel_fd);
  if (!ready.ok()) return ready.status();
  if (!*ready) return absl::DeadlineExceededError("connect timed out");
  if (absl::Status s = ConnectOutcome(fd.get()); !s.ok()) return s;
  return fd;
}

absl::StatusOr<Accepted> Accept(int listener) {
  Accepted out;
  sockaddr_storage from{};
  socklen_t from_len = sizeof(from);
  for (;;) {
    out.fd = UniqueFd(::accept4(listener, reinterpret_cast<sockaddr*>(&from), &from_len,
                                SOCK_CLOEXEC | SOCK_NONBLOCK));
    if (out.fd.get() >= 0) {
      out.source = SourceOf(from);
      return out;
    }
    if (errno != EINTR) break;
  }
  switch (errno) {
    case EAGAIN:
    case ECONNABORTED:
    case EPROTO:
    case EMFILE:
    case ENFILE:
    case ENOBUFS:
    case ENOMEM:
      return out;
    default:
      return Error("accept", errno);
  }
}

void Shutdown(int fd, int how) {
  if (fd >= 0) ::shutdown(fd, how);
}

void Discard(int fd, size_t max_bytes) {
  char sink[4096];
  for (size_t read = 0; read < max_bytes;) {
    const ssize_t rv = ::recv(fd, sink, sizeof(sink), MSG_DONTWAIT);
    if (rv < 0 && errno == EINTR) continue;
    if (rv <= 0) return;
    read += static_cast<size_t>(rv);
  }
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
