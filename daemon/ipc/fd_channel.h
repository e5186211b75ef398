#pragma once

// The fd channel: how a trainer hands the daemon the memory it shares, as a file descriptor,
// never by a name another process could guess, watch or squat. gRPC cannot carry descriptors,
// so a small unix socket beside the gRPC one (`<socket>.fd`, same mode) takes them with
// SCM_RIGHTS: the trainer sends one descriptor per message and gets back a one-time token
// (128 random bits, hex), which it names in the gRPC registration (RegisterBufferRequest.fd_token,
// RegisterRequest.doorbell_fd_token). A token is redeemed at most once, by whoever names it
// first, within kTokenLifetime; only the sender ever learns it. PipeWire and systemd-journald
// take client memory the same way.
//
// Wire (one request, one reply, repeated on a connection):
//   request: 1 byte (kRequestFd) with exactly one descriptor in SCM_RIGHTS
//   reply:   1 byte status (0 ok, else a gRPC code), 1 byte length n, n bytes (the token, or
//            the reason)

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace gradsync::ipc {

using gradsync::UniqueFd;

struct FdChannelLimits {
  /// Connections open at once; more are closed at once.
  int max_connections = 1024;
  /// Descriptors received and not yet redeemed, node-wide (RESOURCE_EXHAUSTED beyond).
  int max_pending = 4096;
  /// The same, per sending user (SO_PEERCRED): one user cannot take every slot of the node.
  int max_pending_per_uid = 1024;
  /// How long a token may wait to be redeemed.
  absl::Duration token_lifetime = absl::Seconds(60);
};

class FdChannel {
 public:
  static constexpr char kRequestFd = 'F';
  static constexpr int kTokenHexChars = 32;

  /// Listens on `path` (created with `mode`; an existing socket there is replaced: the caller
  /// checked no daemon serves it) and serves on a thread of its own.
  static absl::StatusOr<std::unique_ptr<FdChannel>> Listen(const std::string& path, mode_t mode,
                                                           FdChannelLimits limits = {});
  /// Stops the thread, closes every connection and every descriptor not redeemed, and removes
  /// the socket file if it is still ours.
  ~FdChannel();

  /// Takes the descriptor sent under `token`. NOT_FOUND (naming no descriptor) when the token
  /// is unknown, used or expired. Thread-safe; never blocks on a client.
  absl::StatusOr<UniqueFd> Redeem(const std::string& token);

  const std::string& path() const { return path_; }
  /// Descriptors waiting to be redeemed.
  int pending();

 private:
  struct Pending {
    UniqueFd fd;
    absl::Time expires;
    uid_t uid;
  };
  FdChannel(std::string path, int listen_fd, ino_t inode, FdChannelLimits limits);
  void Loop();
  // Reads one request from `fd` (a client of user `uid`) and answers it; false when the
  // connection is to be closed.
  bool Serve(int fd, uid_t uid);
  void Expire(absl::Time now);

  const std::string path_;
  const int listen_fd_;
  const ino_t inode_;
  const FdChannelLimits limits_;
  int wake_[2] = {-1, -1};  // a pipe: the destructor writes to stop Loop
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, Pending> pending_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uid_t, int> pending_by_uid_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace gradsync::ipc
