#pragma once

// The daemon's listening unix sockets (the trainers' gRPC socket and its fd channel), made one
// way.

#include <sys/types.h>

#include <string>

#include "absl/status/statusor.h"

namespace gradsync {

struct UnixListener {
  int fd = -1;      // listening, non-blocking, close-on-exec; the caller closes it
  ino_t inode = 0;  // of the socket file: the caller removes the path only while still its
};

/// Binds and listens on the unix socket at `path`, which must not exist (the caller removed a
/// stale one), with file mode `mode`: the umask keeps the file from ever being wider while it
/// is made. InvalidArgument for a path too long for a socket; Unavailable when it cannot be
/// bound or listened on. Changes the process's umask for the bind (start-up only).
absl::StatusOr<UnixListener> ListenUnix(const std::string& path, mode_t mode);

}  // namespace gradsync
