#pragma once

// The trainers' unix socket, accepted by the daemon itself so that every call on it knows the
// uid of the process that made it (SO_PEERCRED), which gRPC does not tell.

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::rpc {

/// Who is at the other end of a unix-socket connection, as the kernel said when it connected.
struct LocalPeer {
  uint32_t uid = 0;
  uint32_t gid = 0;
  int32_t pid = 0;
};

/// The credentials of the connections LocalListener handed to gRPC, by descriptor. gRPC names
/// such a connection's calls "fd:<n>" (ServerContext::peer), and keeps the descriptor open
/// while any call on it lives (the transport holds the endpoint until its last stream is
/// done), so a call's descriptor is its connection's. Each entry also keeps the socket's inode:
/// a descriptor closed and reused for another object does not match. Thread-safe.
class LocalPeers {
 public:
  void Add(int fd, LocalPeer peer);
  /// Open connections of `uid`, and in all (entries of closed ones are dropped first).
  std::pair<size_t, size_t> Count(uint32_t uid);
  /// The peer of a call whose ServerContext::peer() is `grpc_peer`; nullopt for any other peer
  /// (TCP) or a connection that is gone.
  std::optional<LocalPeer> Find(absl::string_view grpc_peer) const;

 private:
  mutable absl::Mutex mu_;
  // At most one entry per descriptor number: bounded by the process's descriptors.
  absl::flat_hash_map<int, std::pair<ino_t, LocalPeer>> by_fd_ ABSL_GUARDED_BY(mu_);
};

/// Listens on the trainers' unix socket and hands each connection to a gRPC server (as
/// grpc::AddInsecureChannelFromFd), after recording its peer in a LocalPeers. One thread
/// accepts. When accepting fails for want of descriptors or memory (EMFILE, ENFILE, ENOBUFS,
/// ENOMEM) it tells `on_trouble` the error once, sheds the waiting connection (a descriptor kept
/// spare for it: the client sees it closed rather than waiting), backs off 100 ms, and tells it
/// OK once a connection is accepted again: the daemon's health follows. A connection past
/// `limits` (per uid, in all; root and the daemon's uid only in all) is closed at once.
struct LocalLimits {
  size_t max_connections = 4096;
  size_t max_connections_per_user = 512;
};
class LocalListener {
 public:
  using Trouble = std::function<void(const absl::Status&)>;

  /// Binds `path` (which must not exist: the caller removed a stale one) with file mode `mode`.
  static absl::StatusOr<std::unique_ptr<LocalListener>> Listen(const std::string& path, mode_t mode,
                                                               LocalPeers* peers,
                                                               Trouble on_trouble,
                                                               LocalLimits limits = {});
  ~LocalListener();  // Stop()

  /// Starts accepting into `server`, which must outlive Stop().
  void Serve(grpc::Server* server);
  /// Stops accepting and closes the listening socket (connections handed over stay gRPC's).
  /// Idempotent; returns once the accepting thread has ended.
  void Stop();

  /// The listening socket's inode (the daemon removes the path at exit only if it is still its).
  ino_t inode() const { return inode_; }

 private:
  LocalListener(int fd, int wake_fd, ino_t inode, LocalPeers* peers, Trouble on_trouble,
                LocalLimits limits)
      : fd_(fd),
        wake_fd_(wake_fd),
        inode_(inode),
        peers_(peers),
        on_trouble_(std::move(on_trouble)),
        limits_(limits) {}
  void Loop(grpc::Server* server);
  // Whether a connection of `peer` may be kept; logs the first refusal of a run of them.
  bool Admit(const LocalPeer& peer);

  const int fd_;
  const int wake_fd_;  // an eventfd: written to stop the loop
  const ino_t inode_;
  LocalPeers* const peers_;
  const Trouble on_trouble_;
  const LocalLimits limits_;
  const uint32_t operator_uid_ = static_cast<uint32_t>(::geteuid());
  int spare_fd_ = -1;   // /dev/null, closed to accept (and shed) one connection when out
  size_t refused_ = 0;  // connections over a limit, since the last one admitted
  std::thread thread_;
  std::atomic<bool> stopped_{false};
};

}  // namespace gradsync::rpc
