// Implementation of record_links.h: the connections (listen, publish, connect with the key,
// accept), message framing, and the send pump that reads while a peer's socket is full.

#include "daemon/backend/cpu/record_links.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <new>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/random_hex.h"
#include "common/unique_fd.h"
#include "daemon/backend/cpu/socket.h"

namespace gradsync::backend::cpu {
namespace {

// Handshake (the connector is the later node): Hello, then the listener's Challenge, then the
// connector's Proof, then the listener's Accept (without it the connector tries again). Each side
// proves it holds the listener's key (published in the job's store, which only holders of the
// cluster token can read) by an HMAC-SHA256 over both nonces; the key never travels, and a fresh
// nonce on each side makes a recorded handshake worthless.
constexpr uint64_t kHelloMagic = 0x67736c696e6b3032;      // "gslink02"
constexpr uint64_t kChallengeMagic = 0x67736368616c3032;  // "gschal02"
// The listener's last word: the proof checked, the link is its peer's (a connector that does
// not get it, because the listener dropped the handshake first, tries again).
constexpr uint64_t kAcceptMagic = 0x6773616370743032;  // "gsacpt02"
constexpr size_t kKeyBytes = 16;
constexpr size_t kNonceBytes = 16;
constexpr size_t kMacBytes = 32;  // HMAC-SHA256
// A connection to our port gets this long to complete its handshake (or up to the deadline).
constexpr absl::Duration kHandshakeWait = absl::Seconds(2);
// Handshakes in progress at once (the oldest is dropped for a new one), and from one source
// address: strangers cannot hold the slots a peer needs.
constexpr size_t kMaxPendingHandshakes = 64;
constexpr size_t kMaxPendingPerSource = 8;
// A connector whose handshake failed (dropped, refused) tries again after this, to its deadline.
constexpr absl::Duration kRetryPause = absl::Milliseconds(50);
// Store waits for a peer's address are sliced so that a cancel is seen.
constexpr absl::Duration kStoreSlice = absl::Milliseconds(200);
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
// A frame header whose length is this is a node's last word on a stream it parks (Park).
constexpr uint64_t kEndMark = ~uint64_t{0};

struct Hello {
  uint64_t magic;
  uint32_t from;
  uint32_t to;
  unsigned char nonce[kNonceBytes];
};
static_assert(sizeof(Hello) == 32);
struct Challenge {
  uint64_t magic;
  unsigned char nonce[kNonceBytes];
  unsigned char mac[kMacBytes];
};
static_assert(sizeof(Challenge) == 56);
struct Proof {
  unsigned char mac[kMacBytes];
};

enum class Role : unsigned char { kListener = 'L', kConnector = 'C' };

absl::Status Hmac(const std::string& key, const unsigned char* data, size_t size,
                  unsigned char* out) {
  size_t len = 0;
  if (::EVP_Q_mac(nullptr, "HMAC", nullptr, "SHA256", nullptr, key.data(), key.size(), data, size,
                  out, kMacBytes, &len) == nullptr ||
      len != kMacBytes) {
    return absl::InternalError("HMAC-SHA256 failed (OpenSSL)");
  }
  return absl::OkStatus();
}

// HMAC-SHA256 under `key` of (role, from, to, the connector's nonce, the listener's nonce).
absl::Status Mac(const std::string& key, Role role, const Hello& hello,
                 const unsigned char* listener_nonce, unsigned char* out) {
  unsigned char data[1 + 8 + 2 * kNonceBytes];
  data[0] = static_cast<unsigned char>(role);
  std::memcpy(data + 1, &hello.from, 4);
  std::memcpy(data + 5, &hello.to, 4);
  std::memcpy(data + 9, hello.nonce, kNonceBytes);
  std::memcpy(data + 9 + kNonceBytes, listener_nonce, kNonceBytes);
  return Hmac(key, data, sizeof(data), out);
}

// A connection's id, the same at both ends: half of each side's handshake nonce, in hex.
std::string LinkId(const Hello& hello, const unsigned char* listener_nonce) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id;
  for (const unsigned char* half : {hello.nonce, listener_nonce}) {
    for (size_t i = 0; i < kNonceBytes / 2; ++i) {
      id.push_back(kHex[half[i] >> 4]);
      id.push_back(kHex[half[i] & 15]);
    }
  }
  return id;
}

// The mark a node sends on a connection taken over, after whatever its earlier epoch sent:
// kResumeMagic, zeros, then an HMAC under the sender's key of this epoch (fresh, so no earlier
// byte of the stream can equal it) over (from, to, the connection's id).
constexpr uint64_t kResumeMagic = 0x67737265736d3031;  // "gsresm01"
constexpr size_t kMarkBytes = 64;
absl::Status ResumeMark(const std::string& sender_key, int from, int to, const std::string& id,
                        unsigned char* out) {
  std::string data = absl::StrCat("R ", from, " ", to, " ", id);
  std::memset(out, 0, kMarkBytes);
  std::memcpy(out, &kResumeMagic, sizeof(kResumeMagic));
  return Hmac(sender_key, reinterpret_cast<const unsigned char*>(data.data()), data.size(),
              out + kMarkBytes - kMacBytes);
}

absl::Status Nonce(unsigned char* out) {
  if (::RAND_bytes(out, kNonceBytes) != 1) {
    return absl::InternalError("no random bytes (OpenSSL RAND_bytes)");
  }
  return absl::OkStatus();
}

// A link's send buffer, where the system allows it (net.core.wmem_max). The kernel's own
// sizing grows the buffer from 16 KiB as the connection's window grows; two nodes sending each
// other a stage of records at once then waited on each other's reads, for 30-50 ms in about one
// batch of ten (bench/results/2026-12-04-send-buffer.md). Where wmem_max is lower, setting it would
// cap the buffer below what the kernel's own sizing reaches: left alone.
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

absl::Status SetLinkOptions(int fd) {
  if (absl::Status s = sock::SetInt(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY"); !s.ok()) {
    return s;
  }
  if (MaySetSendBuffer())
    return sock::SetInt(fd, SOL_SOCKET, SO_SNDBUF, kSendBufferBytes, "SO_SNDBUF");
  return absl::OkStatus();
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

// The address part of a peer's socket address (per-source limits).
std::string SourceOf(const sockaddr_storage& addr) {
  char text[INET6_ADDRSTRLEN] = "?";
  if (addr.ss_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&addr)->sin_addr, text,
                sizeof(text));
  } else if (addr.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&addr)->sin6_addr, text,
                sizeof(text));
  }
  return text;
}

// One handshake with the listener at `host port` holding `key`, as node `me` to node `to`:
// the connected socket, or why not.
absl::StatusOr<UniqueFd> Handshake(const std::string& host, const std::string& port,
                                   const std::string& key, int me, int to, absl::Time deadline,
                                   int cancel_fd, std::string* id) {
  absl::StatusOr<addrinfo*> remote = Resolve(host, port);
  if (!remote.ok()) return remote.status();
  UniqueFd fd(::socket((*remote)->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  int connect_errno = 0;
  int rv = -1;
  if (fd.get() >= 0) {
    do {
      rv = ::connect(fd.get(), (*remote)->ai_addr, (*remote)->ai_addrlen);
    } while (rv != 0 && errno == EINTR);
    connect_errno = errno;
  } else {
    connect_errno = errno;
  }
  ::freeaddrinfo(*remote);
  if (fd.get() < 0) return sock::Error("socket", connect_errno);
  if (rv != 0 && connect_errno != EINPROGRESS) return sock::Error("connect", connect_errno);
  if (rv != 0) {
    absl::StatusOr<bool> ready = sock::WaitFor(fd.get(), POLLOUT, deadline, cancel_fd);
    if (!ready.ok()) return ready.status();
    if (!*ready) return absl::DeadlineExceededError("connect timed out");
    if (absl::Status s = sock::ConnectOutcome(fd.get()); !s.ok()) return s;
  }
  if (absl::Status s = SetLinkOptions(fd.get()); !s.ok()) return s;
  Hello hello{kHelloMagic, static_cast<uint32_t>(me), static_cast<uint32_t>(to), {}};
  if (absl::Status s = Nonce(hello.nonce); !s.ok()) return s;
  const absl::Time until = std::min(deadline, absl::Now() + kHandshakeWait);
  if (absl::Status s = sock::SendAll(fd.get(), &hello, sizeof(hello), until, cancel_fd); !s.ok()) {
    return s;
  }
  Challenge challenge{};
  if (absl::Status s = sock::RecvAll(fd.get(), &challenge, sizeof(challenge), until, cancel_fd);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("no challenge: ", s.message()));
  }
  unsigned char expected[kMacBytes];
  if (absl::Status s = Mac(key, Role::kListener, hello, challenge.nonce, expected); !s.ok()) {
    return s;
  }
  if (challenge.magic != kChallengeMagic ||
      ::CRYPTO_memcmp(expected, challenge.mac, kMacBytes) != 0) {
    return absl::UnauthenticatedError(
        "the listener could not prove it holds the key published in the job's store");
  }
  Proof proof{};
  if (absl::Status s = Mac(key, Role::kConnector, hello, challenge.nonce, proof.mac); !s.ok()) {
    return s;
  }
  if (absl::Status s = sock::SendAll(fd.get(), &proof, sizeof(proof), until, cancel_fd); !s.ok()) {
    return s;
  }
  uint64_t accepted = 0;
  if (absl::Status s = sock::RecvAll(fd.get(), &accepted, sizeof(accepted), until, cancel_fd);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("not accepted: ", s.message()));
  }
  if (accepted != kAcceptMagic) return absl::UnavailableError("not accepted: a malformed answer");
  *id = LinkId(hello, challenge.nonce);
  return fd;
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
  // Bytes past head + returned (a frame boundary) that are whole frames already looked at for
  // the end mark (Walk).
  size_t walked = 0;
  Buffer held;                // an earlier rx that still holds that frame
  bool closed = false;        // the peer closed its end (what it sent before is still read)
  absl::Status error;         // once set, every call that needs this peer fails with it
  std::string id;             // the connection's (LinkId), the same at both ends
  bool adopted = false;       // taken over from an earlier epoch
  bool cut = false;           // a message of ours went out in part: the stream cannot go on
  bool ended = false;         // the peer parked the connection (its end mark came in)
  bool write_closed = false;  // CloseWrite
};

struct RecordLinks::Resuming {
  int node;
  unsigned char send[kMarkBytes];
  unsigned char expect[kMarkBytes];
  size_t sent = 0;
  bool found = false;
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
    listened = sock::Error("socket", errno);
  } else if (::bind(listener.get(), (*local)->ai_addr, (*local)->ai_addrlen) != 0) {
    listened = sock::Error(absl::StrCat("bind ", host), errno);
  } else if (::listen(listener.get(), 128) != 0) {
    listened = sock::Error("listen", errno);
  }
  ::freeaddrinfo(*local);
  if (!listened.ok()) return listened;
  sockaddr_storage addr{};
  socklen_t addr_len = sizeof(addr);
  if (::getsockname(listener.get(), reinterpret_cast<sockaddr*>(&addr), &addr_len) != 0) {
    return sock::Error("getsockname", errno);
  }
  const int port =
      ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                       : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  absl::StatusOr<std::string> key = RandomHex(kKeyBytes);
  if (!key.ok()) return key.status();
  // The connections an earlier epoch kept to this group's nodes, their ids published with the
  // address.
  std::map<int, std::vector<LinkPark::Link>> kept;
  std::string kept_ids;
  if (s.park != nullptr) {
    std::vector<std::string> peers = s.nodes;
    peers.erase(peers.begin() + me);
    for (auto& [node, links_to] : s.park->Take(s.home, peers)) {
      for (const LinkPark::Link& link : links_to) {
        absl::StrAppend(&kept_ids, kept_ids.empty() ? " " : ",", link.id);
      }
      const auto at = std::find(s.nodes.begin(), s.nodes.end(), node) - s.nodes.begin();
      kept.emplace(static_cast<int>(at), std::move(links_to));
    }
  }
  if (absl::Status st = s.store->Set(s.job, absl::StrCat(s.prefix, me),
                                     absl::StrCat(host, " ", port, " ", *key, kept_ids));
      !st.ok()) {
    return st;
  }

  // The addresses of every earlier node, and of every later one this node kept a connection
  // to, in one wait: a node's store calls do not grow with the number of nodes (one wait on
  // etcd is one read and one watch, however many keys).
  std::vector<int> published;  // the nodes read, by index in `addresses`
  for (int i = 0; i < n; ++i) {
    if (i < me || (i > me && kept.count(i) > 0)) published.push_back(i);
  }
  std::vector<std::string> addresses(n);
  if (!published.empty()) {
    std::vector<std::string> keys;
    for (int i : published) keys.push_back(absl::StrCat(s.prefix, i));
    absl::StatusOr<std::vector<std::string>> values;
    for (;;) {  // sliced, so that a cancel is seen
      if (absl::StatusOr<bool> cancelled = sock::WaitFor(s.cancel_fd, POLLIN, absl::Now());
          !cancelled.ok() || *cancelled) {
        return absl::CancelledError("record links: cancelled while waiting for the addresses");
      }
      values = s.store->WaitBlocking(s.job, keys, std::min(deadline, absl::Now() + kStoreSlice));
      if (values.ok() || values.status().code() != absl::StatusCode::kDeadlineExceeded ||
          absl::Now() >= deadline) {
        break;
      }
    }
    if (!values.ok()) {
      // Name the first node whose address is missing (a look at each, on this failure only).
      size_t missing = 0;
      while (missing + 1 < keys.size() &&
             s.store->Get(s.job, keys[missing], absl::InfinitePast()).ok()) {
        ++missing;
      }
      return absl::Status(values.status().code(),
                          absl::StrCat("record link to ", links->Name(published[missing]),
                                       ": its address never came: ", values.status().message()));
    }
    for (size_t k = 0; k < published.size(); ++k) addresses[published[k]] = (*values)[k];
  }
  // "host port key [id,id...]" of node i.
  std::vector<std::vector<std::string>> parts_of(n);
  for (int i : published) {
    parts_of[i] = absl::StrSplit(addresses[i], ' ');
    if ((parts_of[i].size() != 3 && parts_of[i].size() != 4) ||
        parts_of[i][2].size() != 2 * kKeyBytes) {
      return absl::InternalError(
          absl::StrCat("record link to ", links->Name(i), ": malformed address ", addresses[i]));
    }
  }

  // Take over, for each peer, the connection of least id that both ends kept and published
  // (each end sees the same two lists); resume both ways. The others go back to the park, for
  // the epoch's other groups.
  std::vector<Resuming> resuming;
  for (auto& [i, links_to] : kept) {
    const std::vector<std::string>& parts = parts_of[i];
    const std::vector<std::string> ids =
        parts.size() == 4 ? absl::StrSplit(parts[3], ',') : std::vector<std::string>();
    LinkPark::Link* best = nullptr;
    for (LinkPark::Link& link : links_to) {
      if (std::find(ids.begin(), ids.end(), link.id) != ids.end() &&
          (best == nullptr || link.id < best->id)) {
        best = &link;
      }
    }
    if (best != nullptr) {
      Resuming r{};
      r.node = i;
      if (absl::Status st = ResumeMark(*key, me, i, best->id, r.send); !st.ok()) return st;
      if (absl::Status st = ResumeMark(parts[2], i, me, best->id, r.expect); !st.ok()) return st;
      Peer& p = links->peers_[i];
      p.fd = std::move(best->fd);
      p.id = best->id;
      p.adopted = true;
      resuming.push_back(r);
    }
    for (LinkPark::Link& link : links_to) {
      if (link.fd.get() >= 0) s.park->Put(s.home, s.nodes[i], std::move(link));
    }
  }
  kept.clear();
  if (absl::Status st = links->Resume(resuming, deadline); !st.ok()) return st;

  // Connect to every earlier node, proving we hold its key and checking that it does.
  for (int i = 0; i < me; ++i) {
    if (links->peers_[i].adopted) continue;
    const std::vector<std::string>& parts = parts_of[i];
    // A handshake can fail for reasons that pass (our connection dropped among a stranger's
    // flood, a stranger on a reused port): tried again until the deadline, the last reason kept.
    absl::Status last;
    for (int attempt = 0;; ++attempt) {
      absl::StatusOr<UniqueFd> fd = Handshake(parts[0], parts[1], parts[2], me, i, deadline,
                                              s.cancel_fd, &links->peers_[i].id);
      if (fd.ok()) {
        links->peers_[i].fd = *std::move(fd);
        break;
      }
      last = fd.status();
      if (last.code() == absl::StatusCode::kCancelled ||
          last.code() == absl::StatusCode::kInternal || absl::Now() + kRetryPause >= deadline) {
        const absl::StatusCode code = last.code() == absl::StatusCode::kUnauthenticated ||
                                              last.code() == absl::StatusCode::kUnavailable
                                          ? absl::StatusCode::kUnavailable
                                          : last.code();
        return links->Fail(i, absl::Status(code, absl::StrCat("after ", attempt + 1,
                                                              " attempt(s): ", last.message())));
      }
      // A pause (poll ignores a cancel fd of -1), or a cancel.
      absl::StatusOr<bool> cancelled =
          sock::WaitFor(s.cancel_fd, POLLIN, absl::Now() + kRetryPause);
      if (!cancelled.ok() || *cancelled) return links->Fail(i, absl::CancelledError("cancelled"));
    }
  }

  // Accept every later node. Handshakes run side by side, each by its own short deadline, so a
  // connection that sends nothing (or not the proof) delays no one; it is closed and does not
  // count. Past kMaxPendingPerSource from one address, or kMaxPendingHandshakes in all, the
  // oldest is dropped for the newcomer.
  struct Pending {
    UniqueFd fd;
    absl::Time until;
    std::string source;
    bool challenged = false;  // the hello came and the challenge went: awaiting the proof
    Hello hello{};
    unsigned char nonce[kNonceBytes] = {};
    unsigned char buf[sizeof(Hello)] = {};
    size_t got = 0;
  };
  std::vector<Pending> pending;  // oldest first; closed when this returns
  std::map<std::string, size_t> per_source;
  auto drop_source = [&](const std::string& source) {
    if (auto it = per_source.find(source); it != per_source.end() && --it->second == 0) {
      per_source.erase(it);
    }
  };
  int missing = 0;
  for (int j = me + 1; j < n; ++j) missing += links->peers_[j].adopted ? 0 : 1;
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
    absl::StatusOr<int> polled = sock::Poll(absl::MakeSpan(fds), wake, s.cancel_fd);
    if (!polled.ok()) {
      return absl::Status(polled.status().code(),
                          absl::StrCat("record links: accepting: ", polled.status().message()));
    }
    // Handshakes first (their indices match fds[1...]), then new connections.
    std::vector<Pending> still;
    for (size_t k = 0; k < pending.size(); ++k) {
      Pending& c = pending[k];
      bool drop = absl::Now() >= c.until || (fds[k + 1].revents & (POLLERR | POLLNVAL)) != 0;
      const size_t want = c.challenged ? sizeof(Proof) : sizeof(Hello);
      if (!drop && (fds[k + 1].revents & (POLLIN | POLLHUP)) != 0) {
        absl::StatusOr<sock::Io> io = sock::Recv(c.fd.get(), c.buf + c.got, want - c.got);
        drop = !io.ok() || io->closed;
        if (io.ok()) c.got += io->bytes;
      }
      if (!drop && c.got == want && !c.challenged) {
        std::memcpy(&c.hello, c.buf, sizeof(Hello));
        const int from = static_cast<int>(c.hello.from);
        drop = c.hello.magic != kHelloMagic || static_cast<int>(c.hello.to) != me || from <= me ||
               from >= n || links->peers_[from].fd.get() >= 0;
        Challenge challenge{kChallengeMagic, {}, {}};
        if (!drop) {
          drop = !Nonce(c.nonce).ok() ||
                 !Mac(*key, Role::kListener, c.hello, c.nonce, challenge.mac).ok();
        }
        if (!drop) {
          std::memcpy(challenge.nonce, c.nonce, kNonceBytes);
          // 56 bytes into a fresh connection's empty send buffer: never waits.
          drop = !sock::SendAll(c.fd.get(), &challenge, sizeof(challenge), absl::Now()).ok();
        }
        c.challenged = true;
        c.got = 0;
      } else if (!drop && c.got == want && c.challenged) {
        unsigned char expected[kMacBytes];
        const int from = static_cast<int>(c.hello.from);
        if (Mac(*key, Role::kConnector, c.hello, c.nonce, expected).ok() &&
            ::CRYPTO_memcmp(expected, c.buf, kMacBytes) == 0 && links->peers_[from].fd.get() < 0 &&
            // 8 bytes into a send buffer that has held 56: never waits.
            sock::SendAll(c.fd.get(), &kAcceptMagic, sizeof(kAcceptMagic), absl::Now()).ok()) {
          if (absl::Status st = SetLinkOptions(c.fd.get()); !st.ok()) {
            return links->Fail(from, st);
          }
          links->peers_[from].fd = std::move(c.fd);
          links->peers_[from].id = LinkId(c.hello, c.nonce);
          drop_source(c.source);
          --missing;
          continue;
        }
        drop = true;  // not our peer
      }
      if (drop) {
        drop_source(c.source);
      } else {
        still.push_back(std::move(c));
      }
    }
    pending = std::move(still);
    if ((fds[0].revents & POLLIN) != 0) {
      sockaddr_storage from{};
      socklen_t from_len = sizeof(from);
      UniqueFd fd;
      for (;;) {
        fd = UniqueFd(::accept4(listener.get(), reinterpret_cast<sockaddr*>(&from), &from_len,
                                SOCK_CLOEXEC | SOCK_NONBLOCK));
        if (fd.get() >= 0 || errno != EINTR) break;
      }
      if (fd.get() >= 0) {
        std::string source = SourceOf(from);
        // Room for the newcomer: the oldest handshake of its source past that source's share,
        // else the oldest of all past the total (a peer's handshake is one round trip, so only
        // a stranger's slot is taken for long).
        auto oldest = pending.end();
        if (per_source[source] >= kMaxPendingPerSource) {
          oldest = std::find_if(pending.begin(), pending.end(),
                                [&](const Pending& c) { return c.source == source; });
        } else if (pending.size() >= kMaxPendingHandshakes) {
          oldest = pending.begin();
        }
        if (oldest != pending.end()) {
          drop_source(oldest->source);
          pending.erase(oldest);
        }
        ++per_source[source];
        Pending c;
        c.fd = std::move(fd);
        c.until = std::min(deadline, absl::Now() + kHandshakeWait);
        c.source = std::move(source);
        pending.push_back(std::move(c));
      } else if (errno != EAGAIN && errno != ECONNABORTED && errno != EPROTO && errno != EMFILE &&
                 errno != ENFILE && errno != ENOBUFS && errno != ENOMEM) {
        return sock::Error("accept", errno);
      }
    }
  }
  return links;
}

absl::Status RecordLinks::EndedError() {
  return absl::UnavailableError(
      "the peer ended the group's stream (it left the group, or its membership changed)");
}

absl::Status RecordLinks::Resume(std::vector<Resuming>& resuming, absl::Time deadline) {
  std::vector<std::byte> chunk;
  std::vector<std::string> tails(resuming.size());  // the last bytes read, a mark's start
  std::vector<pollfd> fds;
  std::vector<size_t> which;
  for (;;) {
    fds.clear();
    which.clear();
    for (size_t k = 0; k < resuming.size(); ++k) {
      const Resuming& r = resuming[k];
      const short events =
          static_cast<short>((r.found ? 0 : POLLIN) | (r.sent < kMarkBytes ? POLLOUT : 0));
      if (events == 0) continue;
      fds.push_back({peers_[r.node].fd.get(), events, 0});
      which.push_back(k);
    }
    if (fds.empty()) return absl::OkStatus();
    absl::StatusOr<int> polled = sock::Poll(absl::MakeSpan(fds), deadline, spec_.cancel_fd);
    if (!polled.ok()) {
      return absl::Status(polled.status().code(),
                          absl::StrCat("record links: resuming: ", polled.status().message()));
    }
    if (*polled == 0) {
      return Fail(resuming[which[0]].node,
                  absl::DeadlineExceededError(
                      "the connection kept from the epoch before brought no resume mark by the "
                      "deadline"));
    }
    for (size_t f = 0; f < fds.size(); ++f) {
      Resuming& r = resuming[which[f]];
      const int fd = fds[f].fd;
      if ((fds[f].revents & POLLNVAL) != 0) {
        return Fail(r.node, absl::InternalError("the socket is not open"));
      }
      if ((fds[f].revents & (POLLOUT | POLLERR | POLLHUP)) != 0 && r.sent < kMarkBytes) {
        const iovec iov{r.send + r.sent, kMarkBytes - r.sent};
        absl::StatusOr<sock::Io> io = sock::Send(fd, &iov, 1);
        if (!io.ok()) return Fail(r.node, io.status());
        r.sent += io->bytes;
      }
      if ((fds[f].revents & (POLLIN | POLLERR | POLLHUP)) == 0 || r.found) continue;
      // Look at what came (left in the socket), after the tail of what was read before: read
      // through the mark if it is there (what follows is this epoch's), else all of it.
      chunk.resize(kReadChunk);
      absl::StatusOr<sock::Io> io = sock::Recv(fd, chunk.data(), chunk.size(), /*peek=*/true);
      if (!io.ok()) return Fail(r.node, io.status());
      if (io->closed) {
        return Fail(r.node, absl::UnavailableError("the peer closed the connection kept from the "
                                                   "epoch before"));
      }
      if (io->would_block) continue;
      std::string& tail = tails[which[f]];
      std::string seen = tail;
      seen.append(reinterpret_cast<const char*>(chunk.data()), io->bytes);
      const size_t at =
          seen.find(std::string_view(reinterpret_cast<const char*>(r.expect), kMarkBytes));
      size_t take = io->bytes;
      if (at != std::string::npos) {
        take = at + kMarkBytes - tail.size();
        r.found = true;
      } else {
        tail = seen.substr(seen.size() - std::min(seen.size(), kMarkBytes - 1));
      }
      for (size_t done = 0; done < take;) {  // bytes the peek saw: there to be read
        absl::StatusOr<sock::Io> got = sock::Recv(fd, chunk.data(), take - done);
        if (!got.ok()) return Fail(r.node, got.status());
        if (got->closed || got->would_block) {
          return Fail(r.node, absl::InternalError("bytes seen on the socket could not be read"));
        }
        done += got->bytes;
      }
    }
  }
}

void RecordLinks::Park() {
  if (spec_.park == nullptr) return;
  const uint64_t end[kFrameHeader / sizeof(uint64_t)] = {kEndMark};
  for (int i = 0; i < nodes(); ++i) {
    Peer& p = peers_[i];
    if (i == spec_.me || p.fd.get() < 0 || p.closed || p.cut || p.write_closed ||
        (!p.error.ok() && !p.ended)) {
      continue;
    }
    const iovec iov{const_cast<uint64_t*>(end), kFrameHeader};
    absl::StatusOr<sock::Io> io = sock::Send(p.fd.get(), &iov, 1);
    if (!io.ok() || io->bytes != kFrameHeader) continue;  // closed with the rest
    spec_.park->Put(spec_.home, spec_.nodes[i], {std::move(p.fd), p.id, spec_.epoch, {}});
  }
}

int RecordLinks::adopted() const {
  return static_cast<int>(
      std::count_if(peers_.begin(), peers_.end(), [](const Peer& p) { return p.adopted; }));
}

bool RecordLinks::Adopted(int node) const { return peers_[node].adopted; }

void LinkPark::SweepLocked(absl::Time now) {
  for (auto home = links_.begin(); home != links_.end();) {
    for (auto it = home->second.begin(); it != home->second.end();) {
      std::vector<Link>& kept = it->second;
      kept.erase(
          std::remove_if(kept.begin(), kept.end(), [now](const Link& l) { return l.until <= now; }),
          kept.end());
      it = kept.empty() ? home->second.erase(it) : std::next(it);
    }
    home = home->second.empty() ? links_.erase(home) : std::next(home);
  }
}

LinkPark::LinkPark(absl::Duration keep) : keep_(keep) {
  thread_ = std::thread([this] { Sweep(); });
}

LinkPark::~LinkPark() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    changed_.Signal();
  }
  thread_.join();
}

void LinkPark::Sweep() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    absl::Time next = absl::InfiniteFuture();
    for (const auto& [home, links] : links_) {
      for (const auto& [node, kept] : links) {
        for (const Link& link : kept) next = std::min(next, link.until);
      }
    }
    changed_.WaitWithDeadline(&mu_, next);
    SweepLocked(absl::Now());
  }
}

void LinkPark::Put(const std::string& home, const std::string& node, Link link) {
  const absl::Time now = absl::Now();
  link.until = now + keep_;
  absl::MutexLock lock(&mu_);
  std::vector<Link>& kept = links_[home][node];
  if (!kept.empty() && kept.front().epoch > link.epoch) return;  // `link` closes
  if (!kept.empty() && kept.front().epoch < link.epoch) kept.clear();
  if (kept.size() >= kMaxPerPeer) kept.erase(kept.begin());
  kept.push_back(std::move(link));
  changed_.Signal();
}

std::map<std::string, std::vector<LinkPark::Link>> LinkPark::Take(
    const std::string& home, const std::vector<std::string>& nodes) {
  absl::MutexLock lock(&mu_);
  SweepLocked(absl::Now());
  std::map<std::string, std::vector<Link>> out;
  auto it = links_.find(home);
  if (it == links_.end()) return out;
  for (const std::string& node : nodes) {
    if (auto kept = it->second.find(node); kept != it->second.end()) {
      out[node] = std::move(kept->second);
      it->second.erase(kept);
    }
  }
  if (it->second.empty()) links_.erase(it);
  return out;
}

size_t LinkPark::size() const {
  absl::MutexLock lock(&mu_);
  size_t n = 0;
  for (const auto& [home, links] : links_) {
    for (const auto& [node, kept] : links) n += kept.size();
  }
  return n;
}

void RecordLinks::Drop(int node, absl::Status status) {
  Peer& p = peers_[node];
  Fail(node, std::move(status)).IgnoreError();
  if (p.fd.get() >= 0) ::shutdown(p.fd.get(), SHUT_RDWR);  // the peer sees its end at once
}

void RecordLinks::CloseWrite(int node) {
  peers_[node].write_closed = true;
  if (peers_[node].fd.get() >= 0) ::shutdown(peers_[node].fd.get(), SHUT_WR);
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
    absl::StatusOr<sock::Io> io = sock::Recv(p.fd.get(), p.rx.get() + p.tail, room);
    if (!io.ok()) return Fail(node, io.status());
    if (io->closed) {
      p.closed = true;
      break;
    }
    if (io->would_block) break;
    p.tail += io->bytes;
    if (io->bytes < room) break;  // drained
  }
  Walk(p);
  return absl::OkStatus();
}

void RecordLinks::Walk(Peer& p) const {
  size_t at = p.head + p.returned + p.walked;
  while (!p.ended && p.tail - at >= kFrameHeader) {
    uint64_t length = 0;
    std::memcpy(&length, p.rx.get() + at, sizeof(length));
    if (length == kEndMark) {
      p.ended = true;
    } else if (length > spec_.max_message_bytes || p.tail - at - kFrameHeader < length) {
      return;  // malformed (Receive says so), or not all here
    } else {
      at += kFrameHeader + length;
      p.walked += kFrameHeader + length;
    }
  }
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
    // A peer that ended its stream reads no more: a send to it would wait to the deadline.
    if (peers_[i].ended) return Fail(i, EndedError());
    sent[i] = 0;
  }
  // However this returns, a peer that took part of the frame has a stream cut in half.
  absl::Cleanup mark_cut = [&] {
    for (int i = 0; i < n; ++i) peers_[i].cut = peers_[i].cut || (sent[i] > 0 && sent[i] < total);
  };
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
      absl::StatusOr<sock::Io> io = sock::Send(peers_[i].fd.get(), iov, used);
      if (!io.ok()) return Fail(i, io.status());
      if (io->would_block) return absl::OkStatus();
      sent[i] += io->bytes;
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
    if (absl::StatusOr<int> polled = sock::Poll(absl::MakeSpan(fds), deadline, spec_.cancel_fd);
        !polled.ok()) {
      return absl::Status(polled.status().code(),
                          absl::StrCat("record links: sending: ", polled.status().message()));
    }
    for (size_t k = 0; k < fds.size(); ++k) {
      const int i = node_of[k];
      if ((fds[k].revents & POLLNVAL) != 0) {
        return Fail(i, absl::InternalError("the socket is not open"));
      }
      if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR)) != 0 && !peers_[i].closed) {
        if (absl::Status st = ReadAvailable(i); !st.ok()) return st;
        // Its end mark came while this waited to send it more (only then: a peer that took
        // its part, or is not sent to, may have ended its stream without harm to this send).
        if (peers_[i].ended && sent[i] < total) return Fail(i, EndedError());
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
      if (length == kEndMark) {
        p.ended = true;
        return Fail(node, EndedError());
      }
      if (length > spec_.max_message_bytes) {
        return Fail(node, absl::UnavailableError(absl::StrCat("malformed stream: a message of ",
                                                              length, " bytes (at most ",
                                                              spec_.max_message_bytes, ")")));
      }
      if (have >= kFrameHeader + length) {
        p.returned = kFrameHeader + length;
        p.walked -= std::min(p.walked, p.returned);
        return absl::Span<const std::byte>(p.rx.get() + p.head + kFrameHeader, length);
      }
    }
    if (!p.error.ok()) return p.error;
    if (p.closed) {
      return Fail(node,
                  absl::UnavailableError(absl::StrCat(
                      "the peer closed its end", have > 0 ? " in the middle of a message" : "")));
    }
    absl::StatusOr<bool> ready = sock::WaitFor(p.fd.get(), POLLIN, deadline, spec_.cancel_fd);
    if (!ready.ok() && ready.status().code() == absl::StatusCode::kCancelled) {
      return absl::CancelledError(absl::StrCat("record link to ", Name(node), ": cancelled"));
    }
    if (!ready.ok()) return Fail(node, ready.status());
    if (!*ready) {
      return absl::DeadlineExceededError(
          absl::StrCat("record link to ", Name(node), ": no record by the deadline"));
    }
    if (absl::Status st = ReadAvailable(node); !st.ok()) return st;
  }
}

}  // namespace gradsync::backend::cpu
