#pragma once

// The daemon's listening sockets, accepted by the daemon itself and handed to gRPC: so that a
// unix-socket call knows the uid of the process that made it (SO_PEERCRED, which gRPC does not
// tell), and so that no one source (a user, a remote host) can hold every descriptor.

#include <sys/types.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
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

/// The credentials of the unix-socket connections handed to gRPC, by descriptor. gRPC names
/// such a connection's calls "fd:<n>" (ServerContext::peer), and keeps the descriptor open
/// while any call on it lives (the transport holds the endpoint until its last stream is
/// done), so a call's descriptor is its connection's. Each entry also keeps the socket's inode:
/// a descriptor closed and reused for another object does not match. Thread-safe.
class LocalPeers {
 public:
  void Add(int fd, LocalPeer peer);
  /// The peer of a call whose ServerContext::peer() is `grpc_peer`; nullopt for any other peer
  /// (TCP) or a connection that is gone.
  std::optional<LocalPeer> Find(absl::string_view grpc_peer) const;

 private:
  mutable absl::Mutex mu_;
  // At most one entry per descriptor number: bounded by the process's descriptors.
  absl::flat_hash_map<int, std::pair<ino_t, LocalPeer>> by_fd_ ABSL_GUARDED_BY(mu_);
};

/// How many connections a listener keeps open: in all, and per source (a uid, a remote
/// address). A privileged source counts only against the total.
struct ListenerLimits {
  size_t max_connections = 4096;
  size_t max_per_source = 512;
};

/// One listening socket whose connections the daemon accepts and hands to gRPC. One thread
/// accepts. A connection past the limits is closed at once (its client sees it closed), the
/// first of a run of them logged. When accepting fails for want of descriptors or memory
/// (EMFILE, ENFILE, ENOBUFS, ENOMEM) it tells `on_trouble` the error once, sheds the connection
/// waiting (with a descriptor kept spare for that), backs off 100 ms, and tells it OK once a
/// connection is accepted again.
class Listener {
 public:
  /// A new connection's source: `key` groups its connections for the limits, `label` names it
  /// in logs.
  struct Source {
    std::string key;
    std::string label;
    bool privileged = false;
  };
  /// The source of the connection at `fd`; an error closes it.
  using Classify = std::function<absl::StatusOr<Source>(int fd)>;
  /// Takes the connection at `fd` (admitted) into gRPC, which owns it from then on.
  using Hand = std::function<void(int fd, const Source& source)>;
  using Trouble = std::function<void(const absl::Status&)>;

  /// The trainers' unix socket at `path` (which must not exist: the caller removed a stale one),
  /// file mode `mode`; each connection's credentials go to `peers` before gRPC has it.
  static absl::StatusOr<std::unique_ptr<Listener>> Unix(const std::string& path, mode_t mode,
                                                        LocalPeers* peers, ListenerLimits limits,
                                                        Trouble on_trouble);
  /// TCP on `address`:`port` (0: a free port, see port()).
  static absl::StatusOr<std::unique_ptr<Listener>> Tcp(const std::string& address, int port,
                                                       ListenerLimits limits, Trouble on_trouble);
  ~Listener();  // Stop()

  /// Starts accepting, handing connections to `hand` (which must stay valid until Stop()).
  void Serve(Hand hand);
  /// Stops accepting and closes the listening socket (connections handed over stay gRPC's).
  /// Idempotent; returns once the accepting thread has ended.
  void Stop();

  int fd() const { return fd_; }
  /// The listening socket's inode (the daemon removes a unix path at exit only if still its).
  ino_t inode() const { return inode_; }
  int port() const { return port_; }

 private:
  Listener(int fd, std::string name, ListenerLimits limits, Classify classify, Trouble trouble);
  void Loop();
  // Whether a connection of `source` may be kept (closed ones are forgotten first).
  bool Admit(const Source& source);

  const int fd_;
  const std::string name_;  // "unix socket", "tcp" (logs)
  const ListenerLimits limits_;
  const Classify classify_;
  const Trouble on_trouble_;
  int wake_fd_ = -1;   // an eventfd: written to stop the loop
  int spare_fd_ = -1;  // /dev/null, closed to accept (and shed) one connection when out
  ino_t inode_ = 0;
  int port_ = -1;
  Hand hand_;
  // The connections handed over, for the limits: the accepting thread's alone.
  absl::flat_hash_map<int, std::pair<ino_t, std::string>> open_;
  size_t refused_ = 0;  // connections over a limit since the last one admitted
  std::thread thread_;
  std::atomic<bool> stopped_{false};
};

}  // namespace gradsync::rpc
