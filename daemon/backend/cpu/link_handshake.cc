// Implementation of link_handshake.h.

#include "daemon/backend/cpu/link_handshake.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/bounded_text.h"
#include "daemon/backend/cpu/socket.h"

namespace gradsync::backend::cpu::link {
namespace {

constexpr uint64_t kHelloMagic = 0x67736c696e6b3032;      // "gslink02"
constexpr uint64_t kChallengeMagic = 0x67736368616c3032;  // "gschal02"
// The listener's last word: the proof checked, the link is its peer's (a connector that does
// not get it, because the listener dropped the handshake first, tries again).
constexpr uint64_t kAcceptMagic = 0x6773616370743032;  // "gsacpt02"
constexpr uint64_t kResumeMagic = 0x67737265736d3031;  // "gsresm01"
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

// One handshake with the listener at `host port` holding `key`, as node `me` to node `to`.
absl::StatusOr<Link> HandshakeOnce(const std::string& host, const std::string& port,
                                   const std::string& key, int me, int to, absl::Time deadline,
                                   int cancel_fd, const std::string& source) {
  absl::StatusOr<UniqueFd> fd = sock::Connect(host, port, deadline, cancel_fd, source);
  if (!fd.ok()) return fd.status();
  if (absl::Status s = SetLinkOptions(fd->get()); !s.ok()) return s;
  Hello hello{kHelloMagic, static_cast<uint32_t>(me), static_cast<uint32_t>(to), {}};
  if (absl::Status s = Nonce(hello.nonce); !s.ok()) return s;
  const absl::Time until = std::min(deadline, absl::Now() + kHandshakeWait);
  if (absl::Status s = sock::SendAll(fd->get(), &hello, sizeof(hello), until, cancel_fd); !s.ok()) {
    return s;
  }
  Challenge challenge{};
  if (absl::Status s = sock::RecvAll(fd->get(), &challenge, sizeof(challenge), until, cancel_fd);
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
  if (absl::Status s = sock::SendAll(fd->get(), &proof, sizeof(proof), until, cancel_fd); !s.ok()) {
    return s;
  }
  uint64_t accepted = 0;
  if (absl::Status s = sock::RecvAll(fd->get(), &accepted, sizeof(accepted), until, cancel_fd);
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat("not accepted: ", s.message()));
  }
  if (accepted != kAcceptMagic) return absl::UnavailableError("not accepted: a malformed answer");
  return Link{*std::move(fd), LinkId(hello, challenge.nonce)};
}

// The listener's side: handshakes in progress, side by side, each by its own short deadline,
// so a connection that sends nothing (or not the proof) delays no one; it is closed and does
// not count.
class Acceptor {
 public:
  Acceptor(int listener, const std::string& key, int me, const std::vector<std::string>& nodes,
           std::vector<bool> wanted)
      : listener_(listener),
        key_(key),
        me_(me),
        nodes_(nodes),
        wanted_(std::move(wanted)),
        links_(nodes.size()) {
    for (bool w : wanted_) missing_ += w ? 1 : 0;
  }

  absl::StatusOr<std::vector<Link>> Run(absl::Time deadline, int cancel_fd, int stop_fd,
                                        bool partial) {
    while (missing_ > 0) {
      if (absl::Now() >= deadline) {
        if (partial) break;
        return Late();
      }
      absl::Time wake = deadline;
      // The listener, the handshakes (fds[1...]), then the stop fd (ignored by poll when -1).
      std::vector<pollfd> fds = {{listener_, POLLIN, 0}};
      for (const Pending& c : pending_) {
        fds.push_back({c.fd.get(), POLLIN, 0});
        wake = std::min(wake, c.until);
      }
      fds.push_back({stop_fd, POLLIN, 0});
      absl::StatusOr<int> polled = sock::Poll(absl::MakeSpan(fds), wake, cancel_fd);
      if (!polled.ok()) {
        return absl::Status(polled.status().code(),
                            absl::StrCat("record links: accepting: ", polled.status().message()));
      }
      if ((fds.back().revents & POLLIN) != 0) {
        return absl::CancelledError("record links: accepting: stopped");
      }
      // Handshakes first (their indices match fds[1...]), then new connections.
      std::vector<Pending> still;
      for (size_t k = 0; k < pending_.size(); ++k) {
        absl::StatusOr<bool> keep = Step(pending_[k], fds[k + 1].revents);
        if (!keep.ok()) return keep.status();
        if (*keep) {
          still.push_back(std::move(pending_[k]));
        }
      }
      pending_ = std::move(still);
      if ((fds[0].revents & POLLIN) != 0) {
        if (absl::Status s = Admit(deadline); !s.ok()) return s;
      }
    }
    return std::move(links_);
  }

 private:
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

  absl::Status Late() const {
    std::vector<std::string> who;
    for (size_t j = 0; j < nodes_.size(); ++j) {
      if (wanted_[j] && links_[j].fd.get() < 0) who.push_back(nodes_[j]);
    }
    return absl::DeadlineExceededError(absl::StrCat("record links: node(s) ", JoinBounded(who),
                                                    " did not connect by the deadline"));
  }

  bool Waiting(int from) const {
    return from > me_ && from < static_cast<int>(nodes_.size()) && wanted_[from] &&
           links_[from].fd.get() < 0;
  }

  void DropSource(const std::string& source) {
    if (auto it = per_source_.find(source); it != per_source_.end() && --it->second == 0) {
      per_source_.erase(it);
    }
  }

  // Reads what `c` sent and answers it: false when the handshake ends here (the link made,
  // or dropped), an error only when the link made cannot be set up.
  absl::StatusOr<bool> Step(Pending& c, short revents) {
    bool drop = absl::Now() >= c.until || (revents & (POLLERR | POLLNVAL)) != 0;
    const size_t want = c.challenged ? sizeof(Proof) : sizeof(Hello);
    if (!drop && (revents & (POLLIN | POLLHUP)) != 0) {
      absl::StatusOr<sock::Io> io = sock::Recv(c.fd.get(), c.buf + c.got, want - c.got);
      drop = !io.ok() || io->closed;
      if (io.ok()) c.got += io->bytes;
    }
    if (!drop && c.got == want && !c.challenged) {
      drop = !Answer(c);
    } else if (!drop && c.got == want && c.challenged) {
      unsigned char expected[kMacBytes];
      const int from = static_cast<int>(c.hello.from);
      if (Mac(key_, Role::kConnector, c.hello, c.nonce, expected).ok() &&
          ::CRYPTO_memcmp(expected, c.buf, kMacBytes) == 0 && Waiting(from) &&
          // 8 bytes into a send buffer that has held 56: never waits.
          sock::SendAll(c.fd.get(), &kAcceptMagic, sizeof(kAcceptMagic), absl::Now()).ok()) {
        if (absl::Status st = SetLinkOptions(c.fd.get()); !st.ok()) {
          return absl::Status(
              st.code(), absl::StrCat("record link to node ", nodes_[from], ": ", st.message()));
        }
        links_[from] = Link{std::move(c.fd), LinkId(c.hello, c.nonce)};
        --missing_;
      }
      drop = true;  // made, or not our peer
    }
    if (drop) DropSource(c.source);
    return !drop;
  }

  // The hello came: false when it is not from a node awaited, else the challenge sent.
  bool Answer(Pending& c) {
    std::memcpy(&c.hello, c.buf, sizeof(Hello));
    c.challenged = true;
    c.got = 0;
    if (c.hello.magic != kHelloMagic || static_cast<int>(c.hello.to) != me_ ||
        !Waiting(static_cast<int>(c.hello.from))) {
      return false;
    }
    Challenge challenge{kChallengeMagic, {}, {}};
    if (!Nonce(c.nonce).ok() || !Mac(key_, Role::kListener, c.hello, c.nonce, challenge.mac).ok()) {
      return false;
    }
    std::memcpy(challenge.nonce, c.nonce, kNonceBytes);
    // 56 bytes into a fresh connection's empty send buffer: never waits.
    return sock::SendAll(c.fd.get(), &challenge, sizeof(challenge), absl::Now()).ok();
  }

  // A new connection. Room for it: the oldest handshake of its source past that source's
  // share, else the oldest of all past the total (a peer's handshake is one round trip, so only
  // a stranger's slot is taken for long).
  absl::Status Admit(absl::Time deadline) {
    absl::StatusOr<sock::Accepted> accepted = sock::Accept(listener_);
    if (!accepted.ok()) return accepted.status();
    if (accepted->fd.get() < 0) return absl::OkStatus();
    const std::string& source = accepted->source;
    auto oldest = pending_.end();
    if (per_source_[source] >= kMaxPendingPerSource) {
      oldest = std::find_if(pending_.begin(), pending_.end(),
                            [&](const Pending& c) { return c.source == source; });
    } else if (pending_.size() >= kMaxPendingHandshakes) {
      oldest = pending_.begin();
    }
    if (oldest != pending_.end()) {
      DropSource(oldest->source);
      pending_.erase(oldest);
    }
    ++per_source_[source];
    Pending c;
    c.fd = std::move(accepted->fd);
    c.until = std::min(deadline, absl::Now() + kHandshakeWait);
    c.source = std::move(accepted->source);
    pending_.push_back(std::move(c));
    return absl::OkStatus();
  }

  const int listener_;
  const std::string& key_;
  const int me_;
  const std::vector<std::string>& nodes_;
  const std::vector<bool> wanted_;
  std::vector<Link> links_;
  int missing_ = 0;
  std::vector<Pending> pending_;  // oldest first
  std::map<std::string, size_t> per_source_;
};

}  // namespace

absl::Status SetLinkOptions(int fd) {
  if (absl::Status s = sock::SetInt(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY"); !s.ok()) {
    return s;
  }
  if (MaySetSendBuffer()) {
    return sock::SetInt(fd, SOL_SOCKET, SO_SNDBUF, kSendBufferBytes, "SO_SNDBUF");
  }
  return absl::OkStatus();
}

absl::StatusOr<Link> Dial(const std::string& host, const std::string& port, const std::string& key,
                          int me, int to, absl::Time deadline, int cancel_fd,
                          const std::string& source) {
  absl::Status last;
  for (int attempt = 0;; ++attempt) {
    absl::StatusOr<Link> link = HandshakeOnce(host, port, key, me, to, deadline, cancel_fd, source);
    if (link.ok()) return link;
    last = link.status();
    if (last.code() == absl::StatusCode::kCancelled || last.code() == absl::StatusCode::kInternal ||
        absl::Now() + kRetryPause >= deadline) {
      const absl::StatusCode code = last.code() == absl::StatusCode::kUnauthenticated ||
                                            last.code() == absl::StatusCode::kUnavailable
                                        ? absl::StatusCode::kUnavailable
                                        : last.code();
      return absl::Status(code,
                          absl::StrCat("after ", attempt + 1, " attempt(s): ", last.message()));
    }
    // A pause (poll ignores a cancel fd of -1), or a cancel.
    absl::StatusOr<bool> cancelled = sock::WaitFor(cancel_fd, POLLIN, absl::Now() + kRetryPause);
    if (!cancelled.ok() || *cancelled) return absl::CancelledError("cancelled");
  }
}

absl::StatusOr<std::vector<Link>> AcceptPeers(int listener, const std::string& key, int me,
                                              const std::vector<std::string>& nodes,
                                              std::vector<bool> wanted, absl::Time deadline,
                                              int cancel_fd, int stop_fd, bool partial) {
  return Acceptor(listener, key, me, nodes, std::move(wanted))
      .Run(deadline, cancel_fd, stop_fd, partial);
}

absl::Status ResumeMark(const std::string& sender_key, int from, int to, const std::string& id,
                        unsigned char* out) {
  std::string data = absl::StrCat("R ", from, " ", to, " ", id);
  std::memset(out, 0, kMarkBytes);
  std::memcpy(out, &kResumeMagic, sizeof(kResumeMagic));
  return Hmac(sender_key, reinterpret_cast<const unsigned char*>(data.data()), data.size(),
              out + kMarkBytes - kMacBytes);
}

}  // namespace gradsync::backend::cpu::link
