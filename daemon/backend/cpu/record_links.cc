// Implementation of record_links.h: the connections (listen, publish, connect with the key,
// accept), message framing, and the send pump that reads while a peer's socket is full.

#include "daemon/backend/cpu/record_links.h"

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/random_hex.h"
#include "common/unique_fd.h"

namespace gradsync::backend::cpu {
namespace {

constexpr uint64_t kHelloMagic = 0x67736c696e6b3031;  // "gslink01"
constexpr size_t kKeyBytes = 16;
// A connection to our port that sends no hello gets this long (or up to the deadline).
constexpr absl::Duration kHelloWait = absl::Seconds(5);
// Connections whose hello is awaited at once; more are closed at once.
constexpr size_t kMaxPendingHellos = 64;
// Reads take at least this much room, so a stream of small messages costs one recv each
// batch of them, not one per message.
constexpr size_t kReadChunk = 256 << 10;
// A drained receive buffer above this is given back (below, it is kept for the next stage).
constexpr size_t kKeepBufferBytes = size_t{64} << 20;
// Most bytes a peer may have sent ahead of what we took (a stage's records are far less).
constexpr size_t kMaxBufferedBytes = size_t{256} << 20;
// A frame: its length (8 bytes, then zeros to kAlign) and the message. kAlign bytes, so messages
// whose size is a multiple of kAlign keep their bytes kAlign-aligned in the buffers.
constexpr size_t kFrameHeader = RecordLinks::kAlign;

struct Hello {
  uint64_t magic;
  uint32_t from;
  uint32_t to;
  char key[2 * kKeyBytes];
};
static_assert(sizeof(Hello) == 48);

// Compares the key without an early exit on the first differing byte.
bool SameKey(const char* got, const std::string& key) {
  unsigned char diff = 0;
  for (size_t i = 0; i < 2 * kKeyBytes; ++i) {
    diff |= static_cast<unsigned char>(got[i] ^ key[i]);
  }
  return diff == 0;
}

std::string Errno(const char* what) { return absl::StrCat(what, ": ", std::strerror(errno)); }

// Time left until `deadline`, for ppoll (never negative).
timespec Left(absl::Time deadline) {
  const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
  return absl::ToTimespec(std::min(left, absl::Hours(24)));
}

// Waits for `events` on fd until `deadline`. Returns false on timeout.
absl::StatusOr<bool> WaitFor(int fd, short events, absl::Time deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const timespec t = Left(deadline);
    const int rv = ::ppoll(&p, 1, &t, nullptr);
    if (rv > 0) return true;
    if (rv == 0) return false;
    if (errno != EINTR) return absl::UnavailableError(Errno("poll"));
  }
}

// A link's send buffer, where the system allows it (net.core.wmem_max). The kernel's own
// sizing grows the buffer from 16 KiB as the connection's window grows; two nodes sending each
// other a stage of records at once then waited on each other's reads, for 30-50 ms in about one
// batch of ten (README, "Our own collectives over the record links"). Where wmem_max is lower,
// setting it would cap the buffer below what the kernel's own sizing reaches: left alone.
constexpr int kSendBufferBytes = 4 << 20;

bool MaySetSendBuffer() {
  static const bool may = [] {
    std::FILE* f = std::fopen("/proc/sys/net/core/wmem_max", "r");
    long max = 0;
    if (f != nullptr) {
      if (std::fscanf(f, "%ld", &max) != 1) max = 0;
      std::fclose(f);
    }
    return max >= kSendBufferBytes;
  }();
  return may;
}

void SetLinkOptions(int fd) {
  int on = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof(on));
  if (MaySetSendBuffer()) {
    int bytes = kSendBufferBytes;
    ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &bytes, sizeof(bytes));
  }
}

// "host:port" or "[v6]:port" -> host.
std::string HostOf(const std::string& node) {
  std::string host = node.substr(0, node.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return host;
}

absl::StatusOr<addrinfo*> Resolve(const std::string& host, const std::string& port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* out = nullptr;
  if (const int rv = ::getaddrinfo(host.c_str(), port.c_str(), &hints, &out); rv != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host, ": ", ::gai_strerror(rv)));
  }
  return out;
}

// Sends all of `bytes` on a fresh connection (a hello: it fits the socket's buffer).
absl::Status SendAll(int fd, const void* bytes, size_t n, absl::Time deadline) {
  const char* p = static_cast<const char*>(bytes);
  while (n > 0) {
    const ssize_t rv = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (rv > 0) {
      p += rv;
      n -= static_cast<size_t>(rv);
      continue;
    }
    if (rv < 0 && errno == EINTR) continue;
    if (rv < 0 && errno != EAGAIN) return absl::UnavailableError(Errno("send"));
    absl::StatusOr<bool> ready = WaitFor(fd, POLLOUT, deadline);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("send timed out");
  }
  return absl::OkStatus();
}

// Receive buffers, 64-byte aligned (see kFrameHeader).
struct AlignedDelete {
  void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{64}); }
};
using Buffer = std::unique_ptr<std::byte[], AlignedDelete>;
Buffer NewBuffer(size_t bytes) {  // not zeroed
  return Buffer(static_cast<std::byte*>(::operator new[](bytes, std::align_val_t{64})));
}

}  // namespace

struct RecordLinks::Peer {
  UniqueFd fd;
  Buffer rx;  // received bytes: [head, tail) not yet taken
  size_t capacity = 0;
  size_t head = 0;
  size_t tail = 0;
  size_t returned = 0;  // the frame last returned by Receive, dropped at the next Receive
  Buffer held;          // an earlier rx that still holds that frame
  bool closed = false;  // the peer closed its end (what it sent before is still read)
  absl::Status error;   // once set, every call that needs this peer fails with it
};

RecordLinks::RecordLinks(Spec spec) : spec_(std::move(spec)), peers_(spec_.nodes.size()) {}

RecordLinks::~RecordLinks() {
  for (Peer& p : peers_) {
    if (p.fd.get() < 0) continue;
    // Unread bytes at close(2) make the kernel reset the connection, which can drop what we
    // sent last before the peer reads it: take them first, so the close is an orderly one.
    char sink[4096];
    for (int i = 0; i < 1024 && ::recv(p.fd.get(), sink, sizeof(sink), MSG_DONTWAIT) > 0; ++i) {
    }
  }
}

std::string RecordLinks::Name(int node) const { return absl::StrCat("node ", spec_.nodes[node]); }

absl::Status RecordLinks::Fail(int node, absl::Status status) {
  Peer& p = peers_[node];
  if (p.error.ok()) {
    p.error = absl::Status(status.code(),
                           absl::StrCat("record link to ", Name(node), ": ", status.message()));
  }
  return p.error;
}

absl::StatusOr<std::unique_ptr<RecordLinks>> RecordLinks::Connect(Spec spec, absl::Time deadline) {
  const int n = static_cast<int>(spec.nodes.size());
  const int me = spec.me;
  if (spec.store == nullptr || me < 0 || me >= n) {
    return absl::InvalidArgumentError("record links: no store, or this node is not in the group");
  }
  std::unique_ptr<RecordLinks> links(new RecordLinks(std::move(spec)));
  const Spec& s = links->spec_;
  const std::string host = HostOf(s.nodes[me]);

  // Listen on an ephemeral port of this node's address.
  absl::StatusOr<addrinfo*> local = Resolve(host, "0");
  if (!local.ok()) return local.status();
  const UniqueFd listener(
      ::socket((*local)->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  absl::Status listened = absl::OkStatus();
  if (listener.get() < 0) {
    listened = absl::UnavailableError(Errno("socket"));
  } else if (::bind(listener.get(), (*local)->ai_addr, (*local)->ai_addrlen) != 0) {
    listened = absl::UnavailableError(Errno(absl::StrCat("bind ", host).c_str()));
  } else if (::listen(listener.get(), 128) != 0) {
    listened = absl::UnavailableError(Errno("listen"));
  }
  ::freeaddrinfo(*local);
  if (!listened.ok()) return listened;
  sockaddr_storage addr{};
  socklen_t addr_len = sizeof(addr);
  if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0) {
    return absl::UnavailableError(Errno("getsockname"));
  }
  const int port =
      ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  absl::StatusOr<std::string> key = RandomHex(kKeyBytes);
  if (!key.ok()) return key.status();
  if (absl::Status st =
          s.store->Set(s.job, absl::StrCat(s.prefix, me), absl::StrCat(host, " ", port, " ", *key));
      !st.ok()) {
    return st;
  }

  // Connect to every earlier node, presenting its key.
  for (int i = 0; i < me; ++i) {
    absl::StatusOr<std::vector<std::string>> values =
        s.store->WaitBlocking(s.job, {absl::StrCat(s.prefix, i)}, deadline);
    if (!values.ok()) {
      return absl::Status(values.status().code(),
                          absl::StrCat("record link to ", links->Name(i),
                                       ": its address never came: ", values.status().message()));
    }
    const std::vector<std::string> parts = absl::StrSplit(values->front(), ' ');
    if (parts.size() != 3 || parts[2].size() != 2 * kKeyBytes) {
      return absl::InternalError(
          absl::StrCat("record link to ", links->Name(i), ": malformed address ", values->front()));
    }
    absl::StatusOr<addrinfo*> remote = Resolve(parts[0], parts[1]);
    if (!remote.ok()) return remote.status();
    links->peers_[i].fd =
        UniqueFd(::socket((*remote)->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
    const int fd = links->peers_[i].fd.get();
    int rv = fd < 0 ? -1 : ::connect(fd, (*remote)->ai_addr, (*remote)->ai_addrlen);
    const int connect_errno = errno;
    ::freeaddrinfo(*remote);
    if (fd < 0 || (rv != 0 && connect_errno != EINPROGRESS)) {
      errno = connect_errno;
      return links->Fail(i, absl::UnavailableError(Errno("connect")));
    }
    if (rv != 0) {
      absl::StatusOr<bool> ready = WaitFor(fd, POLLOUT, deadline);
      if (!ready.ok()) return links->Fail(i, ready.status());
      if (!*ready) return links->Fail(i, absl::DeadlineExceededError("connect timed out"));
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) {
        errno = err;
        return links->Fail(i, absl::UnavailableError(Errno("connect")));
      }
    }
    SetLinkOptions(fd);
    Hello hello{kHelloMagic, static_cast<uint32_t>(me), static_cast<uint32_t>(i), {}};
    std::memcpy(hello.key, parts[2].data(), sizeof(hello.key));
    if (absl::Status st = SendAll(fd, &hello, sizeof(hello), deadline); !st.ok()) {
      return links->Fail(i, st);
    }
  }

  // Accept every later node. Hellos are read side by side, each by its own short deadline, so a
  // connection that sends nothing (or not the key) delays no one; it is closed and does not
  // count.
  struct Pending {
    UniqueFd fd;
    absl::Time until;
    Hello hello;
    size_t got;
  };
  std::vector<Pending> pending;  // closed when this returns
  int missing = n - me - 1;
  while (missing > 0) {
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      std::string who;
      for (int j = me + 1; j < n; ++j) {
        if (links->peers_[j].fd.get() < 0)
          absl::StrAppend(&who, who.empty() ? "" : ", ", s.nodes[j]);
      }
      return absl::DeadlineExceededError(
          absl::StrCat("record links: node(s) ", who, " did not connect by the deadline"));
    }
    absl::Time wake = deadline;
    std::vector<pollfd> fds = {{listener.get(), POLLIN, 0}};
    for (const Pending& c : pending) {
      fds.push_back({c.fd.get(), POLLIN, 0});
      wake = std::min(wake, c.until);
    }
    const timespec t = Left(wake);
    if (::ppoll(fds.data(), fds.size(), &t, nullptr) < 0 && errno != EINTR) {
      return absl::UnavailableError(Errno("poll"));
    }
    // Hellos first (their indices match fds[1...]), then new connections.
    std::vector<Pending> still;
    for (size_t k = 0; k < pending.size(); ++k) {
      Pending& c = pending[k];
      bool drop = absl::Now() >= c.until || (fds[k + 1].revents & (POLLERR | POLLNVAL)) != 0;
      if (!drop && (fds[k + 1].revents & (POLLIN | POLLHUP)) != 0) {
        const ssize_t rv = ::recv(c.fd.get(), reinterpret_cast<char*>(&c.hello) + c.got,
                                  sizeof(c.hello) - c.got, MSG_DONTWAIT);
        if (rv > 0) c.got += static_cast<size_t>(rv);
        drop = rv == 0 || (rv < 0 && errno != EAGAIN && errno != EINTR);
      }
      if (!drop && c.got == sizeof(c.hello)) {
        const int from = static_cast<int>(c.hello.from);
        if (c.hello.magic == kHelloMagic && static_cast<int>(c.hello.to) == me && from > me &&
            from < n && links->peers_[from].fd.get() < 0 && SameKey(c.hello.key, *key)) {
          SetLinkOptions(c.fd.get());
          links->peers_[from].fd = std::move(c.fd);
          --missing;
          continue;
        }
        drop = true;  // not our peer
      }
      if (!drop) still.push_back(std::move(c));  // a dropped one closes here
    }
    pending = std::move(still);
    if ((fds[0].revents & POLLIN) != 0) {
      UniqueFd fd(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
      if (fd.get() >= 0) {
        // Past kMaxPendingHellos (a flood) a new connection closes at once: strangers cannot
        // pile up.
        if (pending.size() < kMaxPendingHellos) {
          pending.push_back(
              {std::move(fd), std::min(deadline, absl::Now() + kHelloWait), Hello{}, 0});
        }
      } else if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED && errno != EPROTO) {
        return absl::UnavailableError(Errno("accept"));
      }
    }
  }
  return links;
}

size_t RecordLinks::BufferedFrom(int node) const {
  const Peer& p = peers_[node];
  return p.tail - p.head - p.returned;
}

absl::Status RecordLinks::ReadAvailable(int node) {
  Peer& p = peers_[node];
  if (!p.error.ok()) return p.error;
  while (!p.closed) {
    if (p.capacity - p.tail < kReadChunk) {
      // Room at the end. The message Receive returned last stays where it is (the caller reads
      // it until its next Receive). Bytes still to be taken move to the front when the space
      // before them is at least as large (each byte moves O(1) times), else to a buffer twice
      // as large; a buffer that holds the returned message is kept until the next Receive.
      // Buffers are reused across stages: fresh memory costs page faults, freed memory TLB
      // shootdowns, both dear here.
      const size_t keep = p.head + p.returned;
      const size_t live = p.tail - keep;
      if (live > kMaxBufferedBytes) {
        return Fail(node, absl::ResourceExhaustedError(
                              absl::StrCat("the peer sent more than ", kMaxBufferedBytes,
                                           " bytes ahead of what this node took")));
      }
      if (p.returned == 0 && p.head >= live && p.capacity - live >= kReadChunk) {
        std::memmove(p.rx.get(), p.rx.get() + p.head, live);
      } else {
        // Pinned by the returned message with little after it: a buffer of the same size will
        // do; else twice the size.
        const size_t size = p.returned > 0 && p.capacity >= 2 * live + kReadChunk
                                ? p.capacity
                                : std::max(2 * p.capacity, live + kReadChunk);
        Buffer fresh = NewBuffer(size);
        if (live > 0) std::memcpy(fresh.get(), p.rx.get() + keep, live);
        if (p.returned > 0) p.held = std::move(p.rx);
        p.rx = std::move(fresh);
        p.capacity = size;
      }
      p.head = 0;
      p.returned = 0;
      p.tail = live;
    }
    const size_t room = p.capacity - p.tail;
    const ssize_t rv = ::recv(p.fd.get(), p.rx.get() + p.tail, room, MSG_DONTWAIT);
    if (rv > 0) {
      p.tail += static_cast<size_t>(rv);
      if (static_cast<size_t>(rv) < room) return absl::OkStatus();  // drained
      continue;
    }
    if (rv == 0) {
      p.closed = true;
      return absl::OkStatus();
    }
    if (errno == EINTR) continue;
    if (errno == EAGAIN) return absl::OkStatus();
    return Fail(node, absl::UnavailableError(Errno("recv")));
  }
  return absl::OkStatus();
}

absl::Status RecordLinks::Send(absl::Span<const std::byte> message, absl::Time deadline) {
  const absl::Span<const std::byte> parts[] = {message};
  return SendTo(kEveryPeer, parts, deadline);
}

absl::Status RecordLinks::SendTo(int to, absl::Span<const absl::Span<const std::byte>> parts,
                                 absl::Time deadline) {
  if ((to != kEveryPeer && (to < 0 || to >= nodes() || to == spec_.me)) ||
      parts.size() > kMaxParts) {
    return absl::InvalidArgumentError(
        absl::StrCat("record links: no peer ", to, ", or more than ", kMaxParts, " parts"));
  }
  const int n = static_cast<int>(peers_.size());
  size_t length = 0;
  for (const absl::Span<const std::byte>& part : parts) length += part.size();
  uint64_t frame[kFrameHeader / sizeof(uint64_t)] = {length};
  // The frame header, then the parts, as one sequence of iovecs.
  iovec whole[1 + kMaxParts];
  whole[0] = {frame, kFrameHeader};
  size_t count = 1;
  for (const absl::Span<const std::byte>& part : parts) {
    if (!part.empty()) whole[count++] = {const_cast<std::byte*>(part.data()), part.size()};
  }
  const size_t total = kFrameHeader + length;
  std::vector<size_t> sent(n, total);  // bytes of the frame each peer took
  for (int i = 0; i < n; ++i) {
    if (i == spec_.me || (to != kEveryPeer && i != to)) continue;
    if (!peers_[i].error.ok()) return peers_[i].error;
    sent[i] = 0;
  }
  // Writes what `i`'s socket takes now. OK when it is full.
  auto push = [&](int i) -> absl::Status {
    while (sent[i] < total) {
      iovec iov[1 + kMaxParts];
      int used = 0;
      size_t skip = sent[i];
      for (size_t k = 0; k < count; ++k) {
        if (skip >= whole[k].iov_len) {
          skip -= whole[k].iov_len;
          continue;
        }
        iov[used++] = {static_cast<char*>(whole[k].iov_base) + skip, whole[k].iov_len - skip};
        skip = 0;
      }
      msghdr msg{};
      msg.msg_iov = iov;
      msg.msg_iovlen = used;
      const ssize_t rv = ::sendmsg(peers_[i].fd.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (rv > 0) {
        sent[i] += static_cast<size_t>(rv);
        continue;
      }
      if (rv < 0 && errno == EINTR) continue;
      if (rv < 0 && errno == EAGAIN) return absl::OkStatus();
      return Fail(i, absl::UnavailableError(Errno("send")));
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < n; ++i) {
    if (sent[i] < total) {
      if (absl::Status st = push(i); !st.ok()) return st;
    }
  }
  std::vector<pollfd> fds;
  std::vector<int> node_of;
  for (;;) {
    fds.clear();
    node_of.clear();
    bool waiting = false;
    for (int i = 0; i < n; ++i) {
      if (i == spec_.me) continue;
      const short events =
          static_cast<short>((peers_[i].closed ? 0 : POLLIN) | (sent[i] < total ? POLLOUT : 0));
      waiting = waiting || sent[i] < total;
      if (events != 0) {
        fds.push_back({peers_[i].fd.get(), events, 0});
        node_of.push_back(i);
      }
    }
    if (!waiting) return absl::OkStatus();
    if (absl::Now() >= deadline) {
      for (int i = 0; i < n; ++i) {
        if (i != spec_.me && sent[i] < total) {
          return absl::DeadlineExceededError(
              absl::StrCat("record link to ", Name(i),
                           ": the peer took no more of our records by the deadline (", sent[i],
                           " of ", total, " bytes of a message)"));
        }
      }
    }
    const timespec t = Left(deadline);
    const int rv = ::ppoll(fds.data(), fds.size(), &t, nullptr);
    if (rv < 0 && errno == EINTR) continue;
    if (rv < 0) return absl::UnavailableError(Errno("poll"));
    for (size_t k = 0; k < fds.size(); ++k) {
      const int i = node_of[k];
      if ((fds[k].revents & POLLNVAL) != 0) {
        return Fail(i, absl::InternalError("the socket is not open"));
      }
      if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !peers_[i].closed) {
        if (absl::Status st = ReadAvailable(i); !st.ok()) return st;
      }
      if ((fds[k].revents & (POLLOUT | POLLERR | POLLHUP)) != 0 && sent[i] < total) {
        if (absl::Status st = push(i); !st.ok()) return st;
      }
    }
  }
}

absl::StatusOr<absl::Span<const std::byte>> RecordLinks::Receive(int node, absl::Time deadline) {
  Peer& p = peers_[node];
  p.held.reset();
  p.head += p.returned;
  p.returned = 0;
  if (p.head == p.tail) {
    p.head = p.tail = 0;
    if (p.capacity > kKeepBufferBytes) {
      p.rx.reset();
      p.capacity = 0;
    }
  }
  for (;;) {
    const size_t have = p.tail - p.head;
    if (have >= kFrameHeader) {
      uint64_t length = 0;
      std::memcpy(&length, p.rx.get() + p.head, sizeof(length));
      if (length > spec_.max_message_bytes) {
        return Fail(node, absl::UnavailableError(absl::StrCat("malformed stream: a message of ",
                                                              length, " bytes (at most ",
                                                              spec_.max_message_bytes, ")")));
      }
      if (have >= kFrameHeader + length) {
        p.returned = kFrameHeader + length;
        return absl::Span<const std::byte>(p.rx.get() + p.head + kFrameHeader, length);
      }
    }
    if (!p.error.ok()) return p.error;
    if (p.closed) {
      return Fail(node,
                  absl::UnavailableError(absl::StrCat(
                      "the peer closed its end", have > 0 ? " in the middle of a message" : "")));
    }
    absl::StatusOr<bool> ready = WaitFor(p.fd.get(), POLLIN, deadline);
    if (!ready.ok()) return Fail(node, ready.status());
    if (!*ready) {
      return absl::DeadlineExceededError(
          absl::StrCat("record link to ", Name(node), ": no record by the deadline"));
    }
    if (absl::Status st = ReadAvailable(node); !st.ok()) return st;
  }
}

}  // namespace gradsync::backend::cpu
