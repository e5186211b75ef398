#pragma once

// The one small socket layer of the links between daemons (record_links.cc, link_handshake.cc,
// link_peer_watch.cc):
// each function wraps one system call, checks its result, and retries EINTR here and nowhere
// else. Waits take an absolute deadline and an optional cancel fd (an eventfd: when it is
// readable the wait returns CANCELLED at once).

#include <poll.h>
#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/unique_fd.h"

namespace gradsync::backend::cpu::sock {

/// UNAVAILABLE "<what>: <strerror(err)>", carrying `err` (ErrnoOf).
absl::Status Error(const std::string& what, int err);
/// The errno a status made by Error carries (kept by a status rebuilt with its payloads); 0 for
/// any other.
int ErrnoOf(const absl::Status& status);

/// ppoll(2) over `fds` until one is ready or `deadline`; with cancel_fd >= 0 that fd is polled
/// too and its readiness returns CANCELLED. Returns how many of `fds` are ready (0: the
/// deadline passed). EINTR is retried with the time left.
absl::StatusOr<int> Poll(absl::Span<pollfd> fds, absl::Time deadline, int cancel_fd = -1);

/// Waits for `events` on `fd`: true when ready, false when the deadline passed.
absl::StatusOr<bool> WaitFor(int fd, short events, absl::Time deadline, int cancel_fd = -1);

/// What a non-blocking read or write did.
struct Io {
  size_t bytes = 0;          // moved
  bool would_block = false;  // nothing now (EAGAIN)
  bool closed = false;       // reads: the peer closed its end (and sent nothing more)
};

/// recv(2) without waiting (with `peek`, MSG_PEEK: the bytes stay to be read). Errors
/// (ECONNRESET, ...) are UNAVAILABLE naming them.
absl::StatusOr<Io> Recv(int fd, void* buffer, size_t size, bool peek = false);
/// sendmsg(2) without waiting, never raising SIGPIPE.
absl::StatusOr<Io> Send(int fd, const iovec* iov, size_t iov_count);
/// Sends all of `bytes` (small: a handshake message) by `deadline`.
absl::Status SendAll(int fd, const void* bytes, size_t n, absl::Time deadline, int cancel_fd = -1);
/// Receives exactly `n` bytes by `deadline`; UNAVAILABLE when the peer closes first.
absl::Status RecvAll(int fd, void* bytes, size_t n, absl::Time deadline, int cancel_fd = -1);

/// setsockopt(2) of an int option, checked.
absl::Status SetInt(int fd, int level, int name, int value, const char* what);
/// The outcome of a non-blocking connect once the socket is writable (SO_ERROR), checked.
absl::Status ConnectOutcome(int fd);

/// "host:port" or "[v6]:port" -> host.
std::string HostOf(const std::string& node);

/// A TCP socket listening (non-blocking, close-on-exec) on an ephemeral port of `host`.
struct Listening {
  UniqueFd fd;
  int port = 0;
};
absl::StatusOr<Listening> Listen(const std::string& host, int backlog = 128);

/// A TCP connection to `host`:`port` (numeric), non-blocking, connected by `deadline`
/// (DEADLINE_EXCEEDED "connect timed out"; CANCELLED when cancel_fd fires). `source`: when it
/// and `host` are both loopback addresses (127.0.0.0/8, ::1), the connection comes from
/// `source` (daemons on distinct 127.0.0.x of one machine look like distinct hosts to each
/// other's per-source limits); elsewhere the system picks, as its routes say.
absl::StatusOr<UniqueFd> Connect(const std::string& host, const std::string& port,
                                 absl::Time deadline, int cancel_fd = -1,
                                 const std::string& source = "");

/// accept4(2) without waiting (non-blocking, close-on-exec): the connection and its source
/// address; `fd` empty when none waits or the kernel dropped it (ECONNABORTED, EPROTO) or the
/// system is out of descriptors or memory (the caller goes on and tries again later).
struct Accepted {
  UniqueFd fd;
  std::string source;  // the peer's address, without the port
};
absl::StatusOr<Accepted> Accept(int listener);

/// shutdown(2) of `fd` (SHUT_WR, SHUT_RDWR); errors are of no use to a caller ending a link.
void Shutdown(int fd, int how);
/// Reads and discards what `fd` holds now (up to `max_bytes`), without waiting: unread bytes
/// at close(2) make the kernel reset the connection, which can drop what was sent last.
void Discard(int fd, size_t max_bytes = size_t{4} << 20);

/// Makes a readable eventfd for cancelling waits (non-blocking, close-on-exec); -1 and errno
/// when the system refuses. Signal(fd) makes it readable for good.
int NewCancelFd();
void Signal(int cancel_fd);

}  // namespace gradsync::backend::cpu::sock
