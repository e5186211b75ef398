// Implementation of link_peer_watch.h.

#include "daemon/backend/cpu/link_peer_watch.h"

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/logging.h"
#include "common/store_keys.h"
#include "common/unique_fd.h"
#include "daemon/backend/cpu/record_links.h"
#include "daemon/backend/cpu/socket.h"

namespace gradsync::backend::cpu {
namespace {

auto Log() { return logging::Logger("watch"); }

constexpr char kBeat[8] = {'g', 's', 'b', 'e', 'a', 't', '0', '1'};
constexpr char kBye[8] = {'g', 's', 'b', 'y', 'e', '0', '0', '1'};
// The longest the thread sleeps between passes (it also wakes for each heartbeat due).
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

// Fields below `nodes` are guarded by the watch's mu_; `links` is used by the watch's thread
// only, once `connected` was seen under mu_ (the connecting thread sets it before).
struct LinkPeerWatch::Entry {
  std::string job;
  int me = -1;
  std::vector<std::string> nodes;
  LostCallback on_lost;
  UniqueFd cancel;
  std::thread connecting;

  std::vector<State> state;
  std::vector<absl::Time> heard;
  std::vector<core::LossCause> loss;
  std::vector<std::string> cause;
  bool connected = false;
  absl::Time connected_at;
  bool connect_failed = false;
  absl::Status connect_error;
  std::unique_ptr<RecordLinks> links;
  absl::Time last_sent = absl::InfinitePast();
};

LinkPeerWatch::LinkPeerWatch(Options options) : options_(options) {
  thread_ = std::thread([this] { Run(); });
}

LinkPeerWatch::~LinkPeerWatch() {
  std::map<std::string, std::shared_ptr<Entry>> jobs;
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    jobs.swap(jobs_);
  }
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
  const size_t n = entry->nodes.size();
  entry->state.assign(n, State::kConnecting);
  entry->heard.assign(n, absl::InfinitePast());
  entry->loss.assign(n, core::LossCause::kNone);
  entry->cause.assign(n, "");
  RecordLinks::Spec spec;
  spec.store = store;
  spec.job = job;
  spec.prefix = absl::StrCat(kPeerWatchKeyPrefix, run, "/");
  spec.nodes = entry->nodes;
  spec.me = me;
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
    absl::MutexLock lock(&mu_);
    if (links.ok()) {
      // Peers stay "connecting" until their first word: one whose own links are still forming
      // (waiting for a later node) sends nothing yet, and is not silent for it.
      e->links = *std::move(links);
      e->connected = true;
      e->connected_at = absl::Now();
    } else if (links.status().code() != absl::StatusCode::kCancelled) {
      e->connect_failed = true;
      e->connect_error = links.status();
    }
  });
  Log()->debug("watching job={} peers={}", job, n - 1);
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
  absl::MutexLock lock(&mu_);
  if (entry->connected && !stop_) leaving_.push_back(std::move(entry));  // the thread says bye
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

void LinkPeerWatch::Run() {
  for (;;) {
    std::vector<std::shared_ptr<Entry>> entries, leaving;
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stop_), kTick);
      if (stop_) return;
      for (auto& [job, entry] : jobs_) entries.push_back(entry);
      leaving.swap(leaving_);
    }
    const absl::Time now = absl::Now();
    for (auto& entry : leaving) {  // goodbyes, then the end of our side of each link
      const absl::Span<const std::byte> bye[] = {Bytes(kBye)};
      for (int i = 0; i < entry->links->nodes(); ++i) {
        if (i == entry->me) continue;
        entry->links->SendTo(i, bye, now + kSendWait).IgnoreError();
        entry->links->CloseWrite(i);
      }
      closing_.push_back({now + kLinger, std::move(entry)});
    }
    leaving.clear();
    // Closed once the peers had time to read the goodbye: a close with their heartbeats unread
    // would reset the connection, which can drop the goodbye before they read it.
    for (auto it = closing_.begin(); it != closing_.end();) {
      for (int i = 0; i < it->second->links->nodes(); ++i) {
        if (i == it->second->me) continue;
        for (int k = 0;
             k < kMaxReadsPerPass && it->second->links->Receive(i, absl::InfinitePast()).ok();
             ++k) {
        }
      }
      it = now >= it->first ? closing_.erase(it) : std::next(it);
    }
    std::vector<std::pair<LostCallback, std::pair<std::string, absl::Status>>> lost;
    for (auto& entry : entries) Serve(*entry, lost);
    for (auto& [callback, what] : lost) callback(what.first, what.second);
  }
}

void LinkPeerWatch::Serve(
    Entry& e, std::vector<std::pair<LostCallback, std::pair<std::string, absl::Status>>>& lost) {
  const absl::Time now = absl::Now();
  // Marks peer i lost (or left) with `why`; the callback runs after the pass.
  auto lose = [&](int i, core::LossCause loss, const std::string& why)
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
                    const bool left = loss == core::LossCause::kLeft;
                    e.state[i] = left ? State::kLeft : State::kLost;
                    e.loss[i] = loss;
                    e.cause[i] = why;
                    if (!left) ++losses_[core::LossCauseName(loss)];
                    lost.push_back({e.on_lost,
                                    {e.nodes[i], absl::Status(left ? absl::StatusCode::kCancelled
                                                                   : absl::StatusCode::kUnavailable,
                                                              why)}});
                    if (left) {
                      Log()->info("peer left job={} node={}", e.job, e.nodes[i]);
                    } else {
                      Log()->warn("peer lost job={} node={} cause={}", e.job, e.nodes[i], why);
                    }
                  };
  {
    absl::MutexLock lock(&mu_);
    if (e.connect_failed) {
      e.connect_failed = false;  // reported once
      for (size_t i = 0; i < e.nodes.size(); ++i) {
        if (static_cast<int>(i) != e.me && e.state[i] == State::kConnecting) {
          lose(static_cast<int>(i), core::LossCause::kUnreachable,
               absl::StrCat("lost: unreachable: ", e.connect_error.message()));
        }
      }
      return;
    }
    if (!e.connected) return;
  }
  RecordLinks& links = *e.links;
  const bool send = now - e.last_sent >= options_.interval;
  if (send) e.last_sent = now;
  for (int i = 0; i < links.nodes(); ++i) {
    if (i == e.me) continue;
    {
      absl::MutexLock lock(&mu_);
      if (e.state[i] != State::kAlive && e.state[i] != State::kConnecting) continue;
    }
    absl::Status failed;
    bool bye = false;
    bool heard = false;
    for (int k = 0; k < kMaxReadsPerPass; ++k) {
      absl::StatusOr<absl::Span<const std::byte>> m = links.Receive(i, absl::InfinitePast());
      if (!m.ok()) {
        if (m.status().code() != absl::StatusCode::kDeadlineExceeded) failed = m.status();
        break;
      }
      heard = true;
      if (m->size() == sizeof(kBye) && std::memcmp(m->data(), kBye, sizeof(kBye)) == 0) {
        bye = true;
        break;
      }
    }
    if (failed.ok() && !bye && send) {
      const absl::Span<const std::byte> beat[] = {Bytes(kBeat)};
      if (absl::Status s = links.SendTo(i, beat, absl::Now() + kSendWait);
          !s.ok() && s.code() != absl::StatusCode::kDeadlineExceeded) {
        failed = s;
      }
    }
    absl::MutexLock lock(&mu_);
    if (heard) {
      e.heard[i] = absl::Now();
      e.state[i] = State::kAlive;
    }
    if (bye) {
      lose(i, core::LossCause::kLeft, "left the job (its trainers there ended)");
      links.Drop(i, absl::UnavailableError("left"));
    } else if (!failed.ok()) {
      const core::LossCause cause = CauseOf(links, i, failed);
      lose(
          i, cause,
          cause == core::LossCause::kClosed ? "lost: the connection was closed (its daemon is gone)"
          : cause == core::LossCause::kReset ? "lost: the connection was reset (its daemon is gone)"
                                             : absl::StrCat("lost: ", failed.message()));
      links.Drop(i, failed);
    } else if (e.state[i] == State::kConnecting) {
      if (absl::Now() - e.connected_at > options_.connect_timeout) {
        lose(i, core::LossCause::kUnreachable,
             absl::StrFormat("lost: unreachable: no word in %.0f s since its link formed",
                             absl::ToDoubleSeconds(absl::Now() - e.connected_at)));
        links.Drop(i, absl::UnavailableError("never heard"));
      }
    } else if (absl::Now() - e.heard[i] > options_.timeout) {
      lose(i, core::LossCause::kSilent,
           absl::StrFormat("lost: no word for %.1f s (frozen, or the network between is cut)",
                           absl::ToDoubleSeconds(absl::Now() - e.heard[i])));
      links.Drop(i, absl::UnavailableError("silent"));
    }
  }
}

}  // namespace gradsync::backend::cpu
