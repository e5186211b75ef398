// Implementation of listener.h: the accept loop with its limits, the unix socket with its
// callers' credentials, and the TCP socket.

#include "daemon/rpc/listener.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/unix_socket.h"

namespace gradsync::rpc {
namespace {

auto Log() { return logging::Logger("rpc"); }

constexpr absl::string_view kFdPeerPrefix = "fd:";

// The inode of the socket at `fd`, or 0 when `fd` is not an open socket.
ino_t SocketInode(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISSOCK(st.st_mode)) return 0;
  return st.st_ino;
}

bool OutOfResources(int err) {
  return err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM;
}

std::string Errno(absl::string_view what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

}  // namespace

void LocalPeers::Add(int fd, LocalPeer peer) {
  const ino_t inode = SocketInode(fd);
  absl::MutexLock lock(&mu_);
  by_fd_[fd] = {inode, peer};
}

std::optional<LocalPeer> LocalPeers::Find(absl::string_view grpc_peer) const {
  int fd = -1;
  if (!absl::ConsumePrefix(&grpc_peer, kFdPeerPrefix) || !absl::SimpleAtoi(grpc_peer, &fd)) {
    return std::nullopt;
  }
  const ino_t inode = SocketInode(fd);
  absl::MutexLock lock(&mu_);
  auto it = by_fd_.find(fd);
  if (it == by_fd_.end() || inode == 0 || it->second.first != inode) return std::nullopt;
  return it->second.second;
}

void TcpPeers::MarkAuthenticated(absl::string_view grpc_peer) {
  std::string key = TcpPeerKey(grpc_peer);
  if (key.empty()) return;
  absl::MutexLock lock(&mu_);
  authenticated_.insert(std::move(key));
}

bool TcpPeers::Authenticated(const std::string& key) const {
  absl::MutexLock lock(&mu_);
  return authenticated_.contains(key);
}

void TcpPeers::Forget(const std::string& key) {
  absl::MutexLock lock(&mu_);
  authenticated_.erase(key);
}

std::string TcpPeerKey(absl::string_view peer) {
  if (!absl::ConsumePrefix(&peer, "ipv4:") && !absl::ConsumePrefix(&peer, "ipv6:")) return "";
  const size_t colon = peer.rfind(':');
  if (colon == absl::string_view::npos) return "";
  std::string host(peer.substr(0, colon));
  host = absl::StrReplaceAll(host, {{"%5B", ""}, {"%5D", ""}, {"%25", "%"}, {"[", ""}, {"]", ""}});
  return absl::StrCat(host, "|", peer.substr(colon + 1));
}

Listener::Listener(int fd, std::string name, ListenerLimits limits, Classify classify,
                   Trouble trouble)
    : fd_(fd),
      name_(std::move(name)),
      limits_(limits),
      classify_(std::move(classify)),
      on_trouble_(std::move(trouble)) {
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Unix(const std::string& path, mode_t mode,
                                                         LocalPeers* peers, ListenerLimits limits,
                                                         Trouble on_trouble) {
  absl::StatusOr<UnixListener> listening = ListenUnix(path, mode);
  if (!listening.ok()) return listening.status();
  const uint32_t operator_uid = static_cast<uint32_t>(::geteuid());
  auto classify = [peers, operator_uid](int conn) -> absl::StatusOr<Source> {
    ucred cred{};
    socklen_t len = sizeof(cred);
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      return absl::InternalError(Errno("SO_PEERCRED"));
    }
    peers->Add(conn, {cred.uid, cred.gid, cred.pid});  // before gRPC can run a call of it
    return Source{absl::StrCat("uid ", cred.uid), absl::StrCat("uid=", cred.uid, " pid=", cred.pid),
                  cred.uid == 0 || cred.uid == operator_uid, ""};
  };
  auto listener = std::unique_ptr<Listener>(new Listener(
      listening->fd, "unix socket", limits, std::move(classify), std::move(on_trouble)));
  GRADSYNC_RETURN_IF_ERROR(listener->Ready());
  listener->inode_ = listening->inode;
  return listener;
}

absl::StatusOr<std::unique_ptr<Listener>> Listener::Tcp(const std::string& address, int port,
                                                        ListenerLimits limits, Trouble on_trouble) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(address.c_str(), service.c_str(), &hints, &found); rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot resolve --bind_address ", address, ": ", ::gai_strerror(rc)));
  }
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) {
      why = Errno("socket");
      continue;
    }
    const int one = 1;
    (void)::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
      why = Errno("bind");
      ::close(fd);
      continue;
    }
    ::freeaddrinfo(found);
    auto classify = [](int conn) -> absl::StatusOr<Source> {
      sockaddr_storage peer{};
      socklen_t n = sizeof(peer);
      if (::getpeername(conn, reinterpret_cast<sockaddr*>(&peer), &n) != 0) {
        return absl::InternalError(Errno("getpeername"));
      }
      char host[NI_MAXHOST] = "";
      char port[NI_MAXSERV] = "";
      if (::getnameinfo(reinterpret_cast<sockaddr*>(&peer), n, host, sizeof(host), port,
                        sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV) != 0) {
        return absl::InternalError("getnameinfo failed");
      }
      absl::string_view address = host;
      // gRPC names a v4-mapped peer of a dual-stack listener by its IPv4 address.
      if (absl::StartsWith(address, "::ffff:") && absl::StrContains(address, '.')) {
        address.remove_prefix(7);
      }
      return Source{std::string(address), std::string(address), false,
                    absl::StrCat(address, "|", port)};
    };
    auto listener = std::unique_ptr<Listener>(
        new Listener(fd, "tcp", limits, std::move(classify), std::move(on_trouble)));
    GRADSYNC_RETURN_IF_ERROR(listener->Ready());
    listener->port_ =
        ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                          : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    return listener;
  }
  ::freeaddrinfo(found);
  return absl::UnavailableError(absl::StrCat("cannot listen on ", address, ":", port, ": ", why));
}

Listener::~Listener() {
  Stop();
  ::close(fd_);
  if (wake_fd_ >= 0) ::close(wake_fd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
}

void Listener::Sweep() {
  const absl::Time now = absl::Now();
  for (auto it = open_.begin(); it != open_.end();) {
    auto next = std::next(it);
    Open& c = it->second;
    if (SocketInode(it->first) != c.inode) {  // gRPC closed it
      if (limits_.tcp_peers != nullptr) limits_.tcp_peers->Forget(c.source.connection);
      open_.erase(it);
    } else if (limits_.tcp_peers != nullptr && !c.cut &&
               now - c.accepted > limits_.first_call_deadline &&
               !limits_.tcp_peers->Authenticated(c.source.connection)) {
      // Still the socket it was (inode checked just above): cut it; gRPC sees the end and
      // closes it, and the next sweep forgets it.
      ::shutdown(it->first, SHUT_RDWR);
      c.cut = true;
      Log()->info("{}: connection of {} cut: no authenticated call within {}", name_,
                  c.source.label, absl::FormatDuration(limits_.first_call_deadline));
    }
    it = next;
  }
}

bool Listener::Admit(const Source& source) {
  Sweep();
  size_t mine = 0;
  for (const auto& [fd, c] : open_) mine += c.source.key == source.key ? 1 : 0;
  if (open_.size() < limits_.max_connections &&
      (source.privileged || mine < limits_.max_per_source)) {
    refused_ = 0;
    return true;
  }
  if (refused_++ == 0) {
    Log()->warn(
        "{}: connection of {} refused: {} open ({} of that source); the limits are {} "
        "and {} per source",
        name_, source.label, open_.size(), mine, limits_.max_connections, limits_.max_per_source);
  }
  return false;
}

absl::Status Listener::Ready() const {
  if (wake_fd_ < 0) return absl::ResourceExhaustedError(Errno("eventfd"));
  return absl::OkStatus();
}

void Listener::Serve(Hand hand) {
  hand_ = std::move(hand);
  thread_ = std::thread([this] { Loop(); });
}

void Listener::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

void Listener::Loop() {
  bool troubled = false;
  while (!stopped_.load()) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    // With first-call deadlines, a look at the open connections twice a second.
    const int timeout_ms = limits_.tcp_peers != nullptr ? 500 : -1;
    const int ready = ::poll(fds, 2, timeout_ms);
    if (ready < 0 && errno != EINTR) {  // EINVAL when the descriptor limit was lowered under 2
      Log()->error("{}: poll failed: {}", name_, std::strerror(errno));
      ::usleep(100 * 1000);
      continue;
    }
    if (stopped_.load() || (fds[1].revents & POLLIN) != 0) return;
    if (ready <= 0) {
      Sweep();
      continue;
    }
    for (;;) {  // every connection waiting
      const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (conn < 0) {
        if (errno == EINTR) continue;
        if (OutOfResources(errno)) {
          const absl::Status why = absl::ResourceExhaustedError(absl::StrCat(
              "the daemon cannot accept connections on its ", name_,
              name_ == "unix socket" ? " (trainers)" : "", ": ", std::strerror(errno)));
          if (!troubled) {
            Log()->error("{}", why.ToString());
            if (on_trouble_) on_trouble_(why);
            troubled = true;
          }
          if (spare_fd_ >= 0) {  // shed the connection waiting: its client sees it closed
            ::close(spare_fd_);
            const int shed = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (shed >= 0) ::close(shed);
          }
          spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);  // again, or at last
          ::usleep(100 * 1000);
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
          Log()->warn("{}: accept failed: {}", name_, std::strerror(errno));
        }
        break;
      }
      if (troubled) {
        Log()->info("{}: accepting connections again", name_);
        if (on_trouble_) on_trouble_(absl::OkStatus());
        troubled = false;
      }
      absl::StatusOr<Source> source = classify_(conn);
      if (!source.ok()) {
        Log()->warn("{}: {}", name_, source.status().ToString());
        ::close(conn);
        continue;
      }
      if (!Admit(*source)) {
        ::close(conn);
        continue;
      }
      open_[conn] = Open{SocketInode(conn), *source, absl::Now()};
      hand_(conn, *source);  // gRPC owns `conn` now
    }
  }
}

}  // namespace gradsync::rpc
