// Implementation of fd_channel.h: the unix socket that takes trainers' descriptors by
// SCM_RIGHTS and hands out one-time tokens for them, with its limits and token expiry.

#include "daemon/ipc/fd_channel.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/random_hex.h"
#include "common/unix_socket.h"

namespace gradsync::ipc {
namespace {

auto Log() { return logging::Logger("fd_channel"); }

void Reply(int fd, int code, const std::string& payload) {
  std::string msg;
  msg.push_back(static_cast<char>(code));
  const size_t n = std::min<size_t>(payload.size(), 255);
  msg.push_back(static_cast<char>(n));
  msg.append(payload, 0, n);
  // A client that does not read its replies only hurts itself: never block on it.
  (void)::send(fd, msg.data(), msg.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
}

}  // namespace

absl::StatusOr<std::unique_ptr<FdChannel>> FdChannel::Listen(const std::string& path, mode_t mode,
                                                             FdChannelLimits limits) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    ::unlink(path.c_str());  // stale: the caller made sure no daemon serves the gRPC socket
  }
  absl::StatusOr<UnixListener> listening = ListenUnix(path, mode);
  if (!listening.ok()) return listening.status();
  std::unique_ptr<FdChannel> channel(new FdChannel(path, listening->fd, listening->inode, limits));
  if (::pipe2(channel->wake_, O_CLOEXEC | O_NONBLOCK) != 0) {
    return absl::InternalError(absl::StrCat("pipe2: ", std::strerror(errno)));
  }
  channel->thread_ = std::thread([c = channel.get()] { c->Loop(); });
  Log()->info("fd channel listening path={}", path);
  return channel;
}

FdChannel::FdChannel(std::string path, int listen_fd, ino_t inode, FdChannelLimits limits)
    : path_(std::move(path)), listen_fd_(listen_fd), inode_(inode), limits_(limits) {}

FdChannel::~FdChannel() {
  if (thread_.joinable()) {
    const char c = 0;
    (void)::write(wake_[1], &c, 1);
    thread_.join();
  }
  for (int fd : wake_) {
    if (fd >= 0) ::close(fd);
  }
  struct stat st {};
  if (::stat(path_.c_str(), &st) == 0 && st.st_ino == inode_) ::unlink(path_.c_str());
  ::close(listen_fd_);
}

int FdChannel::pending() {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(pending_.size());
}

absl::StatusOr<UniqueFd> FdChannel::Redeem(const std::string& token) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(token);
  if (it == pending_.end() || it->second.expires <= absl::Now()) {
    if (it != pending_.end()) {
      if (--pending_by_uid_[it->second.uid] == 0) pending_by_uid_.erase(it->second.uid);
      pending_.erase(it);
    }
    return absl::NotFoundError(
        "no descriptor under this fd_token: unknown, already used, or older than the token "
        "lifetime (send the memfd over the fd channel, then register at once)");
  }
  UniqueFd fd = std::move(it->second.fd);
  if (--pending_by_uid_[it->second.uid] == 0) pending_by_uid_.erase(it->second.uid);
  pending_.erase(it);
  return fd;
}

void FdChannel::Expire(absl::Time now) {
  absl::MutexLock lock(&mu_);
  absl::erase_if(pending_, [&](const auto& kv) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (kv.second.expires > now) return false;
    if (--pending_by_uid_[kv.second.uid] == 0) pending_by_uid_.erase(kv.second.uid);
    return true;
  });
}

bool FdChannel::Serve(int fd, uid_t uid) {
  char byte = 0;
  iovec iov{&byte, 1};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * 4)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EINTR)) return true;
  // Every descriptor that came along is ours to close, whatever else is wrong.
  std::vector<UniqueFd> fds;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int received = -1;
      std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      fds.emplace_back(received);
    }
  }
  if (n <= 0) return false;  // closed or broken
  if (byte == kRequestFd && fds.empty() && (msg.msg_flags & MSG_CTRUNC) != 0) {
    // A descriptor was sent and the kernel could not give it to us: we are out of descriptors.
    Log()->error(
        "fd channel: a descriptor from uid={} was dropped: the daemon is out of file "
        "descriptors",
        uid);
    Reply(fd, static_cast<int>(absl::StatusCode::kResourceExhausted),
          "the daemon could not take the descriptor: it is out of file descriptors (its "
          "LimitNOFILE); try again later");
    return true;
  }
  if (byte != kRequestFd || fds.size() != 1 || (msg.msg_flags & MSG_CTRUNC) != 0) {
    fds.clear();  // closed before the answer goes out: the sender may count on it
    Reply(fd, static_cast<int>(absl::StatusCode::kInvalidArgument),
          "send one byte 'F' with exactly one descriptor");
    return true;
  }
  absl::StatusOr<std::string> token = RandomHex(kTokenHexChars / 2);
  if (!token.ok()) {
    Reply(fd, static_cast<int>(token.status().code()), std::string(token.status().message()));
    return true;
  }
  {
    absl::MutexLock lock(&mu_);
    if (static_cast<int>(pending_.size()) >= limits_.max_pending) {
      Reply(fd, static_cast<int>(absl::StatusCode::kResourceExhausted),
            absl::StrCat(limits_.max_pending,
                         " descriptors already wait to be registered on this node"));
      return true;
    }
    int& mine = pending_by_uid_[uid];
    if (mine >= limits_.max_pending_per_uid) {
      Reply(fd, static_cast<int>(absl::StatusCode::kResourceExhausted),
            absl::StrCat("this user has ", mine,
                         " descriptors waiting to be registered, the most one user may"));
      return true;
    }
    ++mine;
    pending_[*token] = Pending{std::move(fds[0]), absl::Now() + limits_.token_lifetime, uid};
  }
  Reply(fd, 0, *token);
  return true;
}

void FdChannel::Loop() {
  std::vector<pollfd> polled;
  std::vector<std::pair<int, uid_t>> clients;  // connection, its peer's uid (SO_PEERCRED)
  for (;;) {
    polled.clear();
    polled.push_back({wake_[0], POLLIN, 0});
    polled.push_back({listen_fd_, POLLIN, 0});
    for (const auto& [c, uid] : clients) polled.push_back({c, POLLIN, 0});
    const int ready = ::poll(polled.data(), polled.size(), 1000);
    Expire(absl::Now());
    if (ready < 0) {
      if (errno == EINTR) continue;
      // EINVAL when the descriptor limit was lowered under what it polls: the channel stays,
      // unless it is being stopped (the wake pipe is non-blocking).
      Log()->error("fd channel poll failed error={}", std::strerror(errno));
      if (char c = 0; ::read(wake_[0], &c, 1) == 1) break;
      ::usleep(100 * 1000);
      continue;
    }
    if (polled[0].revents != 0) break;
    std::vector<std::pair<int, uid_t>> keep;
    for (size_t i = 2; i < polled.size(); ++i) {
      const auto [c, uid] = clients[i - 2];
      bool open = true;
      if ((polled[i].revents & POLLIN) != 0) {
        open = Serve(c, uid);
      } else if ((polled[i].revents & (POLLHUP | POLLERR | POLLNVAL)) != 0) {
        open = false;
      }
      if (open) {
        keep.emplace_back(c, uid);
      } else {
        ::close(c);
      }
    }
    clients.swap(keep);
    if ((polled[1].revents & POLLIN) != 0) {
      for (int k = 0; k < 64; ++k) {  // bounded per round: poll the others too
        const int c = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (c < 0 && (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)) {
          ::usleep(10 * 1000);  // out of descriptors: the listener stays readable; do not spin
        }
        if (c < 0) break;
        if (static_cast<int>(clients.size()) >= limits_.max_connections) {
          Reply(c, static_cast<int>(absl::StatusCode::kResourceExhausted),
                "too many fd channel connections on this node");
          ::close(c);
          continue;
        }
        ucred cred{};
        socklen_t len = sizeof(cred);
        if (::getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
          ::close(c);
          continue;
        }
        clients.emplace_back(c, cred.uid);
      }
    }
  }
  for (const auto& [c, uid] : clients) ::close(c);
  absl::MutexLock lock(&mu_);
  pending_.clear();
  pending_by_uid_.clear();
}

}  // namespace gradsync::ipc
