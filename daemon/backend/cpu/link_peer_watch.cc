// Implementation of link_peer_watch.h.

#include "daemon/backend/cpu/link_peer_watch.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/store_keys.h"
#include "common/unique_fd.h"
#include "daemon/backend/cpu/link_plan.h"
#include "daemon/backend/cpu/record_links.h"
#include "daemon/backend/cpu/socket.h"

namespace gradsync::backend::cpu {
namespace {

auto Log() { return logging::Logger("watch"); }

constexpr char kBeat[8] = {'g', 's', 'b', 'e', 'a', 't', '0', '1'};
constexpr char kBye[8] = {'g', 's', 'b', 'y', 'e', '0', '0', '1'};
constexpr char kNote[8] = {'g', 's', 'n', 'o', 't', 'e', '0', '1'};
// A notice's text, at most (a link's message is at most 4096 bytes).
constexpr size_t kMaxNoticeText = 1024;
// The longest the thread sleeps between passes (it also wakes for what comes in and for each
// heartbeat due).
constexpr absl::Duration kTick = absl::Milliseconds(50);
// A heartbeat or goodbye that the peer's socket cannot take within this is left (a peer that
// reads nothing is found silent anyway).
constexpr absl::Duration kSendWait = absl::Milliseconds(10);
// How long a link whose job ended here stays open (read, not written) after the goodbye.
constexpr absl::Duration kLinger = absl::Milliseconds(500);
// Messages read from one peer in one pass, at most.
constexpr int kMaxReadsPerPass = 64;

using State = core::PeerState::State;

absl::Span<const std::byte> Bytes(const char (&message)[8]) {
  return absl::MakeConstSpan(reinterpret_cast<const std::byte*>(message), sizeof(message));
}

// Why the link to `node` failed with `failed`, from what the link saw: the peer's orderly close,
// or the error the socket layer met (its errno).
core::LossCause CauseOf(const RecordLinks& links, int node, const absl::Status& failed) {
  if (links.PeerClosed(node)) return core::LossCause::kClosed;
  switch (sock::ErrnoOf(failed)) {
    case ECONNRESET:
    case EPIPE:
      return core::LossCause::kReset;
    case ECONNREFUSED:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ETIMEDOUT:
      return core::LossCause::kUnreachable;
    default:
      return core::LossCause::kError;
  }
}

}  // namespace

// A loss, leave or suspicion passed from node to node: its head on the wire, then its text.
// Its kinds: `node` was lost (`origin` saw it first); `node` left on purpose; `origin`, a ring
// neighbour of `node`, hears nothing from it.
constexpr int32_t kLostNotice = 0;
constexpr int32_t kLeftNotice = 1;
constexpr int32_t kSuspectNotice = 2;
struct LinkPeerWatch::Notice {
  struct Head {
    char magic[8];
    int32_t kind;    // kLostNotice, kLeftNotice, kSuspectNotice
    int32_t node;    // the node it is about, an index into the job's nodes
    int32_t origin;  // the node that saw it first
    int32_t cause;   // core::LossCause
  };
  Head head{};
  std::string text;  // as the origin wrote it ("lost: no word for 1.6 s ...")

  Notice() = default;
  Notice(int32_t kind, int node, int origin, core::LossCause cause, const std::string& why)
      : head{{}, kind, node, origin, static_cast<int32_t>(cause)},
        text(why.substr(0, kMaxNoticeText)) {
    std::memcpy(head.magic, kNote, sizeof(kNote));
  }
  // The message: the head, then the text.
  std::array<absl::Span<const std::byte>, 2> Parts() const {
    return {absl::MakeConstSpan(reinterpret_cast<const std::byte*>(&head), sizeof(head)),
            absl::MakeConstSpan(reinterpret_cast<const std::byte*>(text.data()), text.size())};
  }
};

// Fields below `nodes` are guarded by the watch's mu_; `links` and `readable` are used by the
// watch's thread only, once `connected` was seen under mu_ (the connecting thread sets it before).
struct LinkPeerWatch::Entry {
  std::string job;
  int me = -1;
  std::vector<std::string> nodes;
  LostCallback on_lost;
  UniqueFd cancel;
  std::thread connecting;
  std::vector<int> linked;    // link_plan.h's LinkedNodes
  std::vector<bool> watched;  // by node: a ring neighbour, its heartbeats checked

  std::vector<State> state;
  std::vector<absl::Time> heard;
  std::vector<core::LossCause> loss;
  std::vector<std::string> cause;
  bool connected = false;
  absl::Time connected_at;
  bool connect_failed = false;
  absl::Status connect_error;
  bool expelled = false;  // the peers declared this node lost
  // By node: the ring neighbours of it that found it silent, and when this node heard so.
  std::vector<std::map<int, absl::Time>> suspects;
  int quorum = 1;  // suspicions of a node that make it lost (2; 1 when only one watches it)
  std::vector<std::pair<int, std::string>> unconnected;  // linked nodes whose link did not form
  std::unique_ptr<RecordLinks> links;
  std::vector<bool> readable;  // by node: the last poll saw bytes (or none was done yet)
  absl::Time last_sent = absl::InfinitePast();

  bool Open(int i) const { return state[i] == State::kAlive || state[i] == State::kConnecting; }
};

LinkPeerWatch::LinkPeerWatch(Options options) : options_(options), wake_(sock::NewCancelFd()) {
  thread_ = std::thread([this] { Run(); });
}

LinkPeerWatch::~LinkPeerWatch() {
  std::map<std::string, std::shared_ptr<Entry>> jobs;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    jobs.swap(jobs_);
  }
  sock::Signal(wake_.get());
  thread_.join();
  for (auto& [job, entry] : jobs) {
    sock::Signal(entry->cancel.get());
    if (entry->connecting.joinable()) entry->connecting.join();
  }
}

void LinkPeerWatch::Watch(const std::string& job, const std::string& run,
                          std::vector<std::string> nodes, int me, gradsync::Store* store,
                          LostCallback on_lost) {
  Unwatch(job);
  auto entry = std::make_shared<Entry>();
  entry->job = job;
  entry->me = me;
  entry->nodes = std::move(nodes);
  entry->on_lost = std::move(on_lost);
  entry->cancel = UniqueFd(sock::NewCancelFd());
  const int n = static_cast<int>(entry->nodes.size());
  entry->linked = LinkedNodes(n, me, options_.ring);
  entry->watched.assign(n, false);
  for (int i : RingNeighbours(n, me, options_.ring)) entry->watched[i] = true;
  entry->state.assign(n, State::kConnecting);
  entry->heard.assign(n, absl::InfinitePast());
  entry->loss.assign(n, core::LossCause::kNone);
  entry->cause.assign(n, "");
  entry->readable.assign(n, true);
  entry->suspects.assign(n, {});
  // Every node has as many watchers as ring neighbours (the ring relation is symmetric).
  entry->quorum = std::min<int>(2, static_cast<int>(RingNeighbours(n, me, options_.ring).size()));
  RecordLinks::Spec spec;
  spec.store = store;
  spec.job = job;
  spec.prefix = absl::StrCat(kPeerWatchKeyPrefix, run, "/");
  spec.nodes = entry->nodes;
  spec.me = me;
  spec.peers = entry->linked;
  spec.partial = true;  // a node gone before its link formed is lost alone, and passed on
  spec.max_message_bytes = 4096;
  spec.cancel_fd = entry->cancel.get();
  const absl::Time deadline = absl::Now() + options_.connect_timeout;
  {
    absl::MutexLock lock(&mu_);
    if (stop_) return;
    jobs_[job] = entry;
  }
  Entry* e = entry.get();
  entry->connecting = std::thread([this, e, spec = std::move(spec), deadline]() mutable {
    absl::StatusOr<std::unique_ptr<RecordLinks>> links =
        RecordLinks::Connect(std::move(spec), deadline);
    {
      absl::MutexLock lock(&mu_);
      if (links.ok()) {
        // Ring neighbours stay "connecting" until their first word: one whose own links are
        // still forming sends nothing yet, and is not silent for it. The others are alive
        // until a loss is seen or told.
        e->links = *std::move(links);
        for (int i : e->linked) {
          if (absl::Status s = e->links->ConnectError(i); !s.ok()) {
            e->unconnected.push_back({i, absl::StrCat("lost: unreachable: ", s.message())});
          }
        }
        e->connected = true;
        e->connected_at = absl::Now();
        for (size_t i = 0; i < e->nodes.size(); ++i) {
          if (static_cast<int>(i) != e->me && !e->watched[i]) e->state[i] = State::kAlive;
        }
      } else if (links.status().code() != absl::StatusCode::kCancelled) {
        e->connect_failed = true;
        e->connect_error = links.status();
      }
    }
    sock::Signal(wake_.get());
  });
  Log()->debug("watching job={} peers={} links={}", job, n - 1, entry->linked.size());
}

void LinkPeerWatch::Unwatch(const std::string& job) {
  std::shared_ptr<Entry> entry;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job);
    if (it == jobs_.end()) return;
    entry = std::move(it->second);
    jobs_.erase(it);
  }
  sock::Signal(entry->cancel.get());
  if (entry->connecting.joinable()) entry->connecting.join();
  {
    absl::MutexLock lock(&mu_);
    if (entry->connected && !stop_) leaving_.push_back(std::move(entry));  // the thread says bye
  }
  sock::Signal(wake_.get());
}

std::vector<core::PeerState> LinkPeerWatch::Peers(const std::string& job) const {
  std::vector<core::PeerState> out;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  if (it == jobs_.end()) return out;
  const Entry& e = *it->second;
  for (size_t i = 0; i < e.nodes.size(); ++i) {
    if (static_cast<int>(i) == e.me) continue;
    core::PeerState p;
    p.node = e.nodes[i];
    p.state = e.state[i];
    p.last_heard = e.heard[i] == absl::InfinitePast() ? absl::InfiniteDuration() : now - e.heard[i];
    p.loss = e.loss[i];
    p.cause = e.cause[i];
    out.push_back(std::move(p));
  }
  return out;
}

std::map<std::string, int64_t> LinkPeerWatch::LossCounts() const {
  absl::MutexLock lock(&mu_);
  return losses_;
}

core::PeerWatch::Totals LinkPeerWatch::GetTotals() const {
  absl::MutexLock lock(&mu_);
  Totals out = totals_;
  for (const auto& [job, e] : jobs_) {
    if (!e->connected || e->expelled) continue;
    for (int i : e->linked) out.links += e->Open(i) ? 1 : 0;
  }
  return out;
}

void LinkPeerWatch::Run() {
  std::vector<pollfd> fds;
  std::vector<std::pair<Entry*, int>> owners;  // of fds[k]: the job and the peer
  for (;;) {
    std::vector<std::shared_ptr<Entry>> entries, leaving;
    absl::Time wake_at = absl::Now() + kTick;
    {
      absl::MutexLock lock(&mu_);
      if (stop_) return;
      for (auto& [job, entry] : jobs_) {
        entries.push_back(entry);
        if (entry->connected) wake_at = std::min(wake_at, entry->last_sent + options_.interval);
      }
      leaving.swap(leaving_);
    }
    SayGoodbyes(leaving, absl::Now());
    Lost lost;
    for (auto& entry : entries) Serve(*entry, lost);
    for (auto& [callback, what] : lost) callback(what.first, what.second);
    // Sleep until a link has something, the next heartbeat is due, or the tick.
    fds.assign(1, {wake_.get(), POLLIN, 0});
    owners.assign(1, {nullptr, -1});
    if (!PollSet(entries, fds, owners)) wake_at = absl::Now();
    (void)sock::Poll(absl::MakeSpan(fds), wake_at);
    if ((fds[0].revents & POLLIN) != 0) {
      uint64_t drained = 0;
      (void)!::read(wake_.get(), &drained, sizeof(drained));
    }
    for (size_t k = 1; k < fds.size(); ++k) {
      if ((fds[k].revents & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) != 0) {
        owners[k].first->readable[owners[k].second] = true;
      }
    }
  }
}

bool LinkPeerWatch::PollSet(const std::vector<std::shared_ptr<Entry>>& entries,
                            std::vector<pollfd>& fds, std::vector<std::pair<Entry*, int>>& owners) {
  bool sleep = true;
  for (const auto& entry : entries) {
    Entry& e = *entry;
    {
      absl::MutexLock lock(&mu_);
      if (!e.connected || e.expelled) continue;
    }
    for (int i : e.linked) {
      absl::MutexLock lock(&mu_);
      if (!e.Open(i)) continue;
      if (e.links->BufferedFrom(i) > 0) {
        e.readable[i] = true;
        sleep = false;
      }
      fds.push_back({e.links->PollFd(i), POLLIN, 0});
      owners.push_back({&e, i});
    }
  }
  return sleep;
}

void LinkPeerWatch::SayGoodbyes(std::vector<std::shared_ptr<Entry>>& leaving, absl::Time now) {
  for (auto& entry : leaving) {  // goodbyes, then the end of our side of each link
    const absl::Span<const std::byte> bye[] = {Bytes(kBye)};
    for (int i : entry->linked) {
      entry->links->SendTo(i, bye, now + kSendWait).IgnoreError();
      entry->links->CloseWrite(i);
    }
    closing_.push_back({now + kLinger, std::move(entry)});
  }
  leaving.clear();
  // Closed once the peers had time to read the goodbye: a close with their heartbeats unread
  // would reset the connection, which can drop the goodbye before they read it.
  for (auto it = closing_.begin(); it != closing_.end();) {
    for (int i : it->second->linked) {
      for (int k = 0;
           k < kMaxReadsPerPass && it->second->links->Receive(i, absl::InfinitePast()).ok(); ++k) {
      }
    }
    it = now >= it->first ? closing_.erase(it) : std::next(it);
  }
}

absl::Status LinkPeerWatch::ReadFrom(Entry& e, int i, bool& heard, bool& bye,
                                     std::vector<Notice>& notices) {
  if (!e.readable[i]) return absl::OkStatus();
  e.readable[i] = false;
  for (int k = 0; k < kMaxReadsPerPass; ++k) {
    absl::StatusOr<absl::Span<const std::byte>> m = e.links->Receive(i, absl::InfinitePast());
    if (!m.ok()) {
      if (m.status().code() == absl::StatusCode::kDeadlineExceeded) return absl::OkStatus();
      return m.status();
    }
    heard = true;
    if (m->size() == sizeof(kBye) && std::memcmp(m->data(), kBye, sizeof(kBye)) == 0) {
      bye = true;
      return absl::OkStatus();
    }
    if (m->size() >= sizeof(Notice::Head) && std::memcmp(m->data(), kNote, sizeof(kNote)) == 0) {
      Notice& n = notices.emplace_back();
      std::memcpy(&n.head, m->data(), sizeof(n.head));
      n.text.assign(reinterpret_cast<const char*>(m->data()) + sizeof(n.head),
                    std::min(m->size() - sizeof(n.head), kMaxNoticeText));
    }
  }
  e.readable[i] = true;  // more may wait: read again next pass
  return absl::OkStatus();
}

void LinkPeerWatch::Serve(Entry& e, Lost& lost) {
  {
    absl::MutexLock lock(&mu_);
    if (e.connect_failed) {
      e.connect_failed = false;  // reported once
      for (size_t i = 0; i < e.nodes.size(); ++i) {
        if (static_cast<int>(i) != e.me && e.state[i] == State::kConnecting) {
          Lose(e, static_cast<int>(i), core::LossCause::kUnreachable,
               absl::StrCat("lost: unreachable: ", e.connect_error.message()), e.me, lost);
        }
      }
      return;
    }
    if (!e.connected || e.expelled) return;
    for (const auto& [i, why] : e.unconnected) {
      Lose(e, i, core::LossCause::kUnreachable, why, e.me, lost);
    }
    e.unconnected.clear();
  }
  RecordLinks& links = *e.links;
  const absl::Time now = absl::Now();
  const bool send = now - e.last_sent >= options_.interval;
  if (send) e.last_sent = now;
  for (int i : e.linked) {
    {
      absl::MutexLock lock(&mu_);
      if (e.expelled) return;
      if (!e.Open(i)) continue;
    }
    bool heard = false, bye = false;
    std::vector<Notice> notices;
    absl::Status failed = ReadFrom(e, i, heard, bye, notices);
    if (failed.ok() && !bye && send && e.watched[i]) {
      const absl::Span<const std::byte> beat[] = {Bytes(kBeat)};
      absl::Status s = links.SendTo(i, beat, absl::Now() + kSendWait);
      if (!s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) failed = s;
      absl::MutexLock lock(&mu_);
      ++totals_.heartbeats_sent;
    }
    absl::MutexLock lock(&mu_);
    if (heard) {
      e.heard[i] = absl::Now();
      e.state[i] = State::kAlive;
    }
    for (const Notice& notice : notices) Heed(e, i, notice, lost);
    if (e.expelled) return;
    if (!e.Open(i)) continue;  // a notice said it is gone
    if (bye) {
      Lose(e, i, core::LossCause::kLeft, "left the job (its trainers there ended)", e.me, lost);
    } else if (!failed.ok()) {
      const core::LossCause cause = CauseOf(links, i, failed);
      Lose(
          e, i, cause,
          cause == core::LossCause::kClosed ? "lost: the connection was closed (its daemon is gone)"
          : cause == core::LossCause::kReset ? "lost: the connection was reset (its daemon is gone)"
                                             : absl::StrCat("lost: ", failed.message()),
          e.me, lost);
    } else if (!e.watched[i]) {
      continue;
    } else if (e.state[i] == State::kConnecting) {
      if (absl::Now() - e.connected_at > options_.connect_timeout) {
        Lose(e, i, core::LossCause::kUnreachable,
             absl::StrFormat("lost: unreachable: no word in %.0f s since its link formed",
                             absl::ToDoubleSeconds(absl::Now() - e.connected_at)),
             e.me, lost);
      }
    } else if (absl::Now() - e.heard[i] > options_.timeout) {
      Suspect(e, i, e.me,
              absl::StrFormat("lost: no word for %.1f s (frozen, or the network between is cut)",
                              absl::ToDoubleSeconds(absl::Now() - e.heard[i])),
              lost);
    }
  }
}

void LinkPeerWatch::Lose(Entry& e, int i, core::LossCause loss, const std::string& why, int origin,
                         Lost& lost) {
  if (!e.Open(i)) return;
  e.suspects[i].clear();
  const bool left = loss == core::LossCause::kLeft;
  const std::string said =
      origin == e.me || left ? why : absl::StrCat(why, ", seen by node ", e.nodes[origin]);
  e.state[i] = left ? State::kLeft : State::kLost;
  e.loss[i] = loss;
  e.cause[i] = said;
  if (!left) ++losses_[core::LossCauseName(loss)];
  lost.push_back(
      {e.on_lost,
       {e.nodes[i],
        absl::Status(left ? absl::StatusCode::kCancelled : absl::StatusCode::kUnavailable, said)}});
  if (left) {
    Log()->info("peer left job={} node={}", e.job, e.nodes[i]);
  } else {
    Log()->warn("peer lost job={} node={} cause={}", e.job, e.nodes[i], said);
  }
  if (!e.connected) return;  // no links to pass it on
  const Notice notice(left ? kLeftNotice : kLostNotice, i, origin, loss, why);
  Spread(e, notice, origin);
  if (!e.links->Linked(i)) return;
  // Told first (it may be alive, frozen or cut off a while: it then knows the others went on
  // without it), then dropped: it sees its end at once.
  if (!left) e.links->SendTo(i, notice.Parts(), absl::Now() + kSendWait).IgnoreError();
  e.links->Drop(i, absl::UnavailableError(left ? "left" : "lost"));
}

void LinkPeerWatch::Spread(Entry& e, const Notice& notice, int except) {
  const auto parts = notice.Parts();
  for (int j : e.linked) {
    if (j == except || j == notice.head.node || !e.Open(j)) continue;
    // A peer whose socket cannot take it now is behind: it hears of the loss from its other
    // links (each node has several), or finds it itself.
    if (e.links->SendTo(j, parts, absl::Now() + kSendWait).ok()) ++totals_.notices_sent;
  }
}

void LinkPeerWatch::Suspect(Entry& e, int i, int origin, const std::string& why, Lost& lost) {
  if (!e.Open(i)) return;
  const absl::Time now = absl::Now();
  std::map<int, absl::Time>& by = e.suspects[i];
  // A suspicion lasts two timeouts (its watcher renews it while it hears nothing): a frozen
  // node's watchers all time out within a heartbeat of each other.
  for (auto it = by.begin(); it != by.end();) {
    it = now - it->second > 2 * options_.timeout ? by.erase(it) : std::next(it);
  }
  if (by.count(origin) > 0) return;  // heard, and passed on, already
  by[origin] = now;
  if (static_cast<int>(by.size()) >= e.quorum) {
    // Found silent by as many of its watchers as it takes: lost (a link that drops a few
    // packets in a row delays one watcher's heartbeats, never two watchers' at once).
    const int first = by.count(e.me) > 0 ? e.me : origin;
    Lose(e, i, core::LossCause::kSilent, why, first, lost);
    return;
  }
  Log()->info("peer suspected job={} node={} by={}: {}", e.job, e.nodes[i], e.nodes[origin], why);
  Spread(e, Notice(kSuspectNotice, i, origin, core::LossCause::kSilent, why), origin);
}

void LinkPeerWatch::Heed(Entry& e, int from, const Notice& notice, Lost& lost) {
  const int n = static_cast<int>(e.nodes.size());
  const int about = notice.head.node, origin = notice.head.origin;
  if (about < 0 || about >= n || origin < 0 || origin >= n || origin == about ||
      notice.head.cause <= static_cast<int32_t>(core::LossCause::kNone) ||
      notice.head.cause > static_cast<int32_t>(core::LossCause::kExpelled)) {
    return;  // not a notice these links carry
  }
  // What a node this one holds lost or left says is not believed: a node cut off finds every
  // peer gone.
  if (origin != e.me && !e.Open(origin)) return;
  if (notice.head.kind == kSuspectNotice) {
    if (about != e.me) Suspect(e, about, origin, notice.text, lost);
    return;
  }
  if (about != e.me) {
    Lose(e, about, static_cast<core::LossCause>(notice.head.cause), notice.text, origin, lost);
    return;
  }
  if (notice.head.kind != kLostNotice) return;
  // This node was declared lost: the job went on without it. Every peer is lost to it, and it
  // passes nothing on (its word is not believed).
  e.expelled = true;
  ++losses_[core::LossCauseName(core::LossCause::kExpelled)];
  const std::string why =
      absl::StrCat("lost: this node was declared lost by node ", e.nodes[origin], " (", notice.text,
                   "; told by node ", e.nodes[from], ")");
  Log()->warn("job={} {}", e.job, why);
  for (int i = 0; i < n; ++i) {
    if (i == e.me || !e.Open(i)) continue;
    e.state[i] = State::kLost;
    e.loss[i] = core::LossCause::kExpelled;
    e.cause[i] = why;
    lost.push_back({e.on_lost, {e.nodes[i], absl::UnavailableError(why)}});
    if (e.links->Linked(i)) e.links->Drop(i, absl::UnavailableError("expelled"));
  }
}

}  // namespace gradsync::backend::cpu
