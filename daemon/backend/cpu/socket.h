#pragma once

// The one small socket layer of the links between daemons (record_links.cc, peer_watch.cc):
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

namespace gradsync::backend::cpu::sock {

/// UNAVAILABLE "<what>: <strerror(err)>".
absl::Status Error(const std::string& what, int err);

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

/// Makes a readable eventfd for cancelling waits (non-blocking, close-on-exec); -1 and errno
/// when the system refuses. Signal(fd) makes it readable for good.
int NewCancelFd();
void Signal(int cancel_fd);

}  // namespace gradsync::backend::cpu::sock
