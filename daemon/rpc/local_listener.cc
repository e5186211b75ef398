// Implementation of local_listener.h: the accept loop of the trainers' unix socket and the
// credentials of its connections.

#include "daemon/rpc/local_listener.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "common/logging.h"
#include "grpcpp/server_posix.h"

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

}  // namespace

void LocalPeers::Add(int fd, LocalPeer peer) {
  const ino_t inode = SocketInode(fd);
  absl::MutexLock lock(&mu_);
  by_fd_[fd] = {inode, peer};
}

std::pair<size_t, size_t> LocalPeers::Count(uint32_t uid) {
  absl::MutexLock lock(&mu_);
  size_t mine = 0;
  for (auto it = by_fd_.begin(); it != by_fd_.end();) {
    auto next = std::next(it);
    if (SocketInode(it->first) != it->second.first) {
      by_fd_.erase(it);
    } else if (it->second.second.uid == uid) {
      ++mine;
    }
    it = next;
  }
  return {mine, by_fd_.size()};
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

absl::StatusOr<std::unique_ptr<LocalListener>> LocalListener::Listen(const std::string& path,
                                                                     mode_t mode, LocalPeers* peers,
                                                                     Trouble on_trouble,
                                                                     LocalLimits limits) {
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path '", path, "' is too long"));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return absl::InternalError(absl::StrCat("socket: ", std::strerror(errno)));
  // The umask keeps the socket from ever being wider than `mode`, which is set right after.
  const mode_t old_umask = ::umask(0777 & ~mode);
  const int bound = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_umask);
  struct stat st {};
  if (bound != 0 || ::chmod(path.c_str(), mode) != 0 || ::listen(fd, SOMAXCONN) != 0 ||
      ::stat(path.c_str(), &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot listen on ", path, ": ", why));
  }
  const int wake = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    return absl::InternalError(absl::StrCat("eventfd: ", why));
  }
  auto listener = std::unique_ptr<LocalListener>(
      new LocalListener(fd, wake, st.st_ino, peers, std::move(on_trouble), limits));
  listener->spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  return listener;
}

LocalListener::~LocalListener() {
  Stop();
  ::close(fd_);
  ::close(wake_fd_);
  if (spare_fd_ >= 0) ::close(spare_fd_);
}

bool LocalListener::Admit(const LocalPeer& peer) {
  const auto [mine, all] = peers_->Count(peer.uid);
  const bool privileged = peer.uid == 0 || peer.uid == operator_uid_;
  if (all < limits_.max_connections && (privileged || mine < limits_.max_connections_per_user)) {
    refused_ = 0;
    return true;
  }
  if (refused_++ == 0) {
    Log()->warn(
        "unix socket: connection of uid={} pid={} refused: {} open ({} of that user); "
        "the limits are {} and {} per user",
        peer.uid, peer.pid, all, mine, limits_.max_connections, limits_.max_connections_per_user);
  }
  return false;
}

void LocalListener::Serve(grpc::Server* server) {
  thread_ = std::thread([this, server] { Loop(server); });
}

void LocalListener::Stop() {
  if (stopped_.exchange(true)) return;
  const uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof(one));
  if (thread_.joinable()) thread_.join();
}

void LocalListener::Loop(grpc::Server* server) {
  bool troubled = false;
  while (!stopped_.load()) {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0 && errno != EINTR) {
      Log()->error("unix socket: poll failed: {}", std::strerror(errno));
      return;
    }
    if (stopped_.load() || (fds[1].revents & POLLIN) != 0) return;
    for (;;) {  // every connection waiting
      const int conn = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (conn < 0) {
        if (errno == EINTR) continue;
        if (OutOfResources(errno)) {
          const absl::Status why = absl::ResourceExhaustedError(absl::StrCat(
              "the daemon cannot accept trainers on its unix socket: ", std::strerror(errno)));
          if (!troubled) {
            Log()->error("{}", why.ToString());
            on_trouble_(why);
            troubled = true;
          }
          if (spare_fd_ >= 0) {  // shed the connection waiting: its client sees it closed
            ::close(spare_fd_);
            const int shed = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
            if (shed >= 0) ::close(shed);
            spare_fd_ = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
          }
          ::usleep(100 * 1000);
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNABORTED) {
          Log()->warn("unix socket: accept failed: {}", std::strerror(errno));
        }
        break;
      }
      ucred cred{};
      socklen_t len = sizeof(cred);
      if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
        Log()->warn("unix socket: SO_PEERCRED failed: {}", std::strerror(errno));
        ::close(conn);
        continue;
      }
      if (troubled) {
        Log()->info("unix socket: accepting trainers again");
        on_trouble_(absl::OkStatus());
        troubled = false;
      }
      const LocalPeer peer{cred.uid, cred.gid, cred.pid};
      if (!Admit(peer)) {
        ::close(conn);
        continue;
      }
      peers_->Add(conn, peer);
      grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns `conn` now
    }
  }
}

}  // namespace gradsync::rpc
