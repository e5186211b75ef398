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
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
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

/// The TCP connections that made an authenticated call (the token or the client credential),
/// by remote address and port (TcpPeerKey): PeerAuth marks them, the TCP listener cuts the
/// others at their deadline and forgets closed ones. Thread-safe; bounded by the connections.
class TcpPeers {
 public:
  /// Marks the connection of a call whose ServerContext::peer() is `grpc_peer`.
  void MarkAuthenticated(absl::string_view grpc_peer);
  bool Authenticated(const std::string& key) const;
  void Forget(const std::string& key);

 private:
  mutable absl::Mutex mu_;
  absl::flat_hash_set<std::string> authenticated_ ABSL_GUARDED_BY(mu_);
};

/// "address|port" of a gRPC peer string ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000", brackets
/// percent-encoded or not); empty for any other.
std::string TcpPeerKey(absl::string_view grpc_peer);

/// How many connections a listener keeps open: in all, and per source (a uid, a remote
/// address). A privileged source counts only against the total. With `tcp_peers`, a connection
/// that has made no authenticated call `first_call_deadline` after it was accepted is cut.
struct ListenerLimits {
  size_t max_connections = 4096;
  size_t max_per_source = 512;
  TcpPeers* tcp_peers = nullptr;
  absl::Duration first_call_deadline = absl::Seconds(10);
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
    std::string connection;  // TCP: the connection's TcpPeerKey
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

  /// OK when the listener can be stopped (its wake-up descriptor was made); the factories check.
  absl::Status Ready() const;
  /// Starts accepting, handing connections to `hand` (which must stay valid until Stop()).
  void Serve(Hand hand);
  /// Stops accepting and closes the listening socket (connections handed over stay gRPC's).
  /// Idempotent; returns once the accepting thread has ended.
  void Stop();

  int fd() const { return fd_; }
  /// The unix socket file's inode (the daemon removes the path at exit only if still its).
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
  // Cuts the connections past their first-call deadline and forgets closed ones.
  void Sweep();
  // The connections handed over, for the limits and deadlines: the accepting thread's alone.
  struct Open {
    ino_t inode;
    Source source;
    absl::Time accepted;
    bool cut = false;
  };
  absl::flat_hash_map<int, Open> open_;
  size_t refused_ = 0;  // connections over a limit since the last one admitted
  std::thread thread_;
  std::atomic<bool> stopped_{false};
};

}  // namespace gradsync::rpc
