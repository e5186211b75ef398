// Implementation of record_links.h: connecting a group's links (publish, take over what an
// earlier epoch kept, dial the earlier nodes, accept the later ones: link_handshake.h), message
// framing, and the send pump that reads while a peer's socket is full.

#include "daemon/backend/cpu/record_links.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <new>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/random_hex.h"
#include "common/unique_fd.h"
#include "daemon/backend/cpu/link_handshake.h"
#include "daemon/backend/cpu/socket.h"

namespace gradsync::backend::cpu {
namespace {

using link::kKeyBytes;
using link::kMarkBytes;

// A first dial of each earlier node gives up after this (a second try runs to the deadline).
constexpr absl::Duration kFirstDial = absl::Seconds(2);
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
  bool linked = true;         // in Spec::peers (or every node when that is empty)
};

struct RecordLinks::Resuming {
  int node;
  unsigned char send[kMarkBytes];
  unsigned char expect[kMarkBytes];
  size_t sent = 0;
  bool found = false;
};

RecordLinks::RecordLinks(Spec spec) : spec_(std::move(spec)), peers_(spec_.nodes.size()) {
  if (spec_.peers.empty()) return;
  for (Peer& p : peers_) p.linked = false;
  for (int i : spec_.peers) {
    if (i >= 0 && i < nodes() && i != spec_.me) peers_[i].linked = true;
  }
  for (Peer& p : peers_) {
    if (!p.linked) p.error = absl::FailedPreconditionError("no link to that node (link plan)");
  }
}

absl::Status RecordLinks::ConnectError(int node) const {
  if (!Linked(node)) return absl::FailedPreconditionError("no link to that node (link plan)");
  const Peer& p = peers_[node];
  return p.fd.get() >= 0 || p.error.ok() ? absl::OkStatus() : p.error;
}

bool RecordLinks::Linked(int node) const {
  return node >= 0 && node < nodes() && node != spec_.me && peers_[node].linked;
}

int RecordLinks::PollFd(int node) const { return Linked(node) ? peers_[node].fd.get() : -1; }

RecordLinks::~RecordLinks() {
  // Unread bytes at close(2) make the kernel reset the connection, which can drop what we
  // sent last before the peer reads it: take them first, so the close is an orderly one.
  for (Peer& p : peers_) {
    if (p.fd.get() >= 0) sock::Discard(p.fd.get());
  }
}

std::string RecordLinks::Name(int node) const { return absl::StrCat("node ", spec_.nodes[node]); }

absl::Status RecordLinks::Fail(int node, absl::Status status) {
  Peer& p = peers_[node];
  if (p.error.ok()) {
    p.error = absl::Status(status.code(),
                           absl::StrCat("record link to ", Name(node), ": ", status.message()));
    status.ForEachPayload([&p](absl::string_view type, const absl::Cord& payload) {
      p.error.SetPayload(type, payload);  // what the socket layer said (sock::ErrnoOf)
    });
  }
  return p.error;
}

// The later nodes' connections, accepted on a thread of its own (Start), collected by Finish;
// destroyed without Finish, it stops that thread first.
class RecordLinks::Accepting {
 public:
  Accepting(RecordLinks& links, int listener, const std::string& key, absl::Time deadline)
      : links_(links), listener_(listener), key_(key), deadline_(deadline) {}
  ~Accepting() {
    if (thread_.joinable()) {
      sock::Signal(stop_.get());
      thread_.join();
    }
  }

  void Start() {
    if (started_) return;
    started_ = true;
    const Spec& s = links_.spec_;
    wanted_.assign(s.nodes.size(), false);
    bool any = false;
    for (int j = s.me + 1; j < links_.nodes(); ++j) {
      wanted_[j] = links_.Linked(j) && !links_.peers_[j].adopted;
      any = any || wanted_[j];
    }
    if (!any) return;
    stop_ = UniqueFd(sock::NewCancelFd());
    if (stop_.get() < 0) {
      accepted_ =
          absl::InternalError(absl::StrCat("record links: eventfd: ", std::strerror(errno)));
      return;
    }
    thread_ = std::thread([this, &s] {
      accepted_ = link::AcceptPeers(listener_, key_, s.me, s.nodes, wanted_, deadline_, s.cancel_fd,
                                    stop_.get(), s.partial);
    });
  }

  // Waits for the accepting to end; the links accepted into place (Spec::partial: a node that
  // did not connect has its link failed, naming it).
  absl::Status Finish() {
    if (thread_.joinable()) thread_.join();
    if (!accepted_.ok()) return accepted_.status();
    for (int j = 0; j < links_.nodes(); ++j) {
      if (j >= static_cast<int>(wanted_.size()) || !wanted_[j]) continue;
      if ((*accepted_)[j].fd.get() < 0) {
        links_.Fail(j, absl::DeadlineExceededError("it did not connect by the deadline"))
            .IgnoreError();
        continue;
      }
      links_.peers_[j].fd = std::move((*accepted_)[j].fd);
      links_.peers_[j].id = std::move((*accepted_)[j].id);
    }
    return absl::OkStatus();
  }

 private:
  RecordLinks& links_;
  const int listener_;
  const std::string& key_;
  const absl::Time deadline_;
  bool started_ = false;
  std::vector<bool> wanted_;
  UniqueFd stop_;
  std::thread thread_;
  absl::StatusOr<std::vector<link::Link>> accepted_ = std::vector<link::Link>();
};

absl::StatusOr<std::unique_ptr<RecordLinks>> RecordLinks::Connect(Spec spec, absl::Time deadline) {
  const int n = static_cast<int>(spec.nodes.size());
  const int me = spec.me;
  if (spec.store == nullptr || me < 0 || me >= n) {
    return absl::InvalidArgumentError("record links: no store, or this node is not in the group");
  }
  std::unique_ptr<RecordLinks> links(new RecordLinks(std::move(spec)));
  const Spec& s = links->spec_;
  const std::string host = sock::HostOf(s.nodes[me]);
  absl::StatusOr<sock::Listening> listener = sock::Listen(host);
  if (!listener.ok()) return listener.status();
  absl::StatusOr<std::string> key = RandomHex(kKeyBytes);
  if (!key.ok()) return key.status();
  // The connections an earlier epoch kept to this group's nodes, their ids published with the
  // address.
  std::map<int, std::vector<LinkPark::Link>> kept;
  std::string kept_ids;
  if (s.park != nullptr) {
    std::vector<std::string> peers;
    for (int i = 0; i < n; ++i) {
      if (links->Linked(i)) peers.push_back(s.nodes[i]);
    }
    for (auto& [node, links_to] : s.park->Take(s.home, peers)) {
      for (const LinkPark::Link& link : links_to) {
        absl::StrAppend(&kept_ids, kept_ids.empty() ? " " : ",", link.id);
      }
      const auto at = std::find(s.nodes.begin(), s.nodes.end(), node) - s.nodes.begin();
      kept.emplace(static_cast<int>(at), std::move(links_to));
    }
  }
  if (absl::Status st = s.store->Set(s.job, absl::StrCat(s.prefix, me),
                                     absl::StrCat(host, " ", listener->port, " ", *key, kept_ids));
      !st.ok()) {
    return st;
  }
  // Accepting runs on a thread of its own while this one reads the addresses and dials every
  // earlier node: a node's accepting never waits for its own dialing, so no chain of nodes
  // waits on each other. It starts at once unless connections were kept (which later nodes
  // connect afresh is known once the addresses are read).
  Accepting accepting(*links, listener->fd.get(), *key, deadline);
  if (kept.empty()) accepting.Start();
  // The addresses of every earlier node, and of every later one this node kept a connection to.
  std::vector<int> published;
  for (int i = 0; i < n; ++i) {
    if (links->Linked(i) && (i < me || kept.count(i) > 0)) published.push_back(i);
  }
  // Partial: the addresses there by a first, short wait; DialEarlier waits for the others.
  absl::StatusOr<std::vector<std::vector<std::string>>> addresses = links->ReadAddresses(
      published, s.partial ? std::min(deadline, absl::Now() + kFirstDial) : deadline);
  if (!addresses.ok()) return addresses.status();
  if (absl::Status st = links->TakeOver(kept, *addresses, *key, deadline); !st.ok()) return st;
  accepting.Start();  // no-op when started
  if (absl::Status st = links->DialEarlier(*std::move(addresses), host, deadline); !st.ok()) {
    return st;
  }
  if (absl::Status st = accepting.Finish(); !st.ok()) return st;
  return links;
}

absl::Status RecordLinks::DialEarlier(std::vector<std::vector<std::string>> addresses,
                                      const std::string& host, absl::Time deadline) {
  // Proving we hold each one's key and checking that it does. A first try of each by a short
  // deadline, then the ones that failed until the whole deadline: a peer that is gone (or slow
  // to come) does not hold up the others.
  for (int pass = 0; pass < 2; ++pass) {
    if (pass == 1 && spec_.partial) {
      // The addresses that had not come by the first wait, waited for to the deadline.
      std::vector<int> missing;
      for (int i = 0; i < spec_.me; ++i) {
        if (Linked(i) && !peers_[i].adopted && addresses[i].empty()) missing.push_back(i);
      }
      absl::StatusOr<std::vector<std::vector<std::string>>> more = ReadAddresses(missing, deadline);
      if (!more.ok()) return more.status();
      for (int i : missing) {
        addresses[i] = std::move((*more)[i]);
        if (addresses[i].empty()) {
          Fail(i, absl::DeadlineExceededError("its address never came by the deadline"))
              .IgnoreError();
        }
      }
    }
    std::vector<int> todo;
    for (int i = 0; i < spec_.me; ++i) {
      if (Linked(i) && !peers_[i].adopted && (pass == 0 || peers_[i].fd.get() < 0)) {
        todo.push_back(i);
      }
    }
    for (int i : todo) {
      if (!peers_[i].error.ok() || addresses[i].empty()) continue;  // no address (yet)
      const std::vector<std::string>& parts = addresses[i];
      const absl::Time until = pass == 0 ? std::min(deadline, absl::Now() + kFirstDial) : deadline;
      absl::StatusOr<link::Link> made =
          link::Dial(parts[0], parts[1], parts[2], spec_.me, i, until, spec_.cancel_fd, host);
      if (made.ok()) {
        peers_[i].fd = std::move(made->fd);
        peers_[i].id = std::move(made->id);
      } else if (made.status().code() == absl::StatusCode::kCancelled) {
        return made.status();
      } else if (pass == 1 || absl::Now() >= deadline) {
        if (!spec_.partial) return Fail(i, made.status());
        Fail(i, made.status()).IgnoreError();
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::vector<std::string>>> RecordLinks::ReadAddresses(
    const std::vector<int>& published, absl::Time deadline) {
  const Spec& s = spec_;
  std::vector<std::vector<std::string>> parts_of(s.nodes.size());
  if (published.empty()) return parts_of;
  // In one wait: a node's store calls do not grow with the number of nodes (one wait on etcd
  // is one read and one watch, however many keys).
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
  if (!values.ok() && s.partial && values.status().code() == absl::StatusCode::kDeadlineExceeded) {
    // Those that came; each one missing is left empty (the caller waits again, or gives up).
    values = std::vector<std::string>(keys.size());
    for (size_t k = 0; k < keys.size(); ++k) {
      absl::StatusOr<std::string> one = s.store->Get(s.job, keys[k], absl::InfinitePast());
      if (one.ok()) (*values)[k] = *std::move(one);
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
                        absl::StrCat("record link to ", Name(published[missing]),
                                     ": its address never came: ", values.status().message()));
  }
  // "host port key [id,id...]" of each.
  for (size_t k = 0; k < published.size(); ++k) {
    const int i = published[k];
    if ((*values)[k].empty()) continue;  // not yet (Spec::partial)
    parts_of[i] = absl::StrSplit((*values)[k], ' ');
    if ((parts_of[i].size() != 3 && parts_of[i].size() != 4) ||
        parts_of[i][2].size() != 2 * kKeyBytes) {
      return absl::InternalError(
          absl::StrCat("record link to ", Name(i), ": malformed address ", (*values)[k]));
    }
  }
  return parts_of;
}

absl::Status RecordLinks::TakeOver(std::map<int, std::vector<LinkPark::Link>>& kept,
                                   const std::vector<std::vector<std::string>>& parts_of,
                                   const std::string& key, absl::Time deadline) {
  // For each peer, the connection of least id that both ends kept and published (each end sees
  // the same two lists); resumed both ways. The others go back to the park, for the epoch's
  // other groups.
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
      if (absl::Status st = link::ResumeMark(key, spec_.me, i, best->id, r.send); !st.ok()) {
        return st;
      }
      if (absl::Status st = link::ResumeMark(parts[2], i, spec_.me, best->id, r.expect); !st.ok()) {
        return st;
      }
      Peer& p = peers_[i];
      p.fd = std::move(best->fd);
      p.id = best->id;
      p.adopted = true;
      resuming.push_back(r);
    }
    for (LinkPark::Link& link : links_to) {
      if (link.fd.get() >= 0) spec_.park->Put(spec_.home, spec_.nodes[i], std::move(link));
    }
  }
  kept.clear();
  return Resume(resuming, deadline);
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

void RecordLinks::Drop(int node, absl::Status status) {
  Peer& p = peers_[node];
  Fail(node, std::move(status)).IgnoreError();
  sock::Shutdown(p.fd.get(), SHUT_RDWR);  // the peer sees its end at once
}

void RecordLinks::CloseWrite(int node) {
  peers_[node].write_closed = true;
  sock::Shutdown(peers_[node].fd.get(), SHUT_WR);
}

bool RecordLinks::PeerClosed(int node) const { return peers_[node].closed; }

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
  if ((to != kEveryPeer && !Linked(to)) || parts.size() > kMaxParts) {
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
    if (i == spec_.me || !peers_[i].linked || (to != kEveryPeer && i != to)) continue;
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
      if (i == spec_.me || !peers_[i].linked) continue;
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
