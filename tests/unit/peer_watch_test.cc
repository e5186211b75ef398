// LinkPeerWatch between in-process "nodes" (real TCP on loopback, rendezvous over a
// MemoryStore): peers come alive, a peer gone is lost as closed, a silent one as silent within
// the timeout, one that ends its job is "left" and not counted as a loss, and Unwatch stops the
// callbacks.

#include <cerrno>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "daemon/backend/cpu/link_peer_watch.h"
#include "daemon/backend/cpu/record_links.h"
#include "daemon/backend/cpu/socket.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"
#include "tests/unit/record_links_testing.h"

namespace gradsync::backend::cpu {
namespace {

using State = core::PeerState::State;

LinkPeerWatch::Options Fast() {
  LinkPeerWatch::Options o;
  o.timeout = absl::Milliseconds(600);
  o.interval = absl::Milliseconds(100);
  o.connect_timeout = absl::Seconds(20);
  return o;
}

// What the callbacks of one node's watch reported.
struct Losses {
  absl::Mutex mu;
  std::vector<std::pair<std::string, absl::Status>> seen ABSL_GUARDED_BY(mu);

  core::PeerWatch::LostCallback Callback() {
    return [this](const std::string& node, const absl::Status& cause) {
      absl::MutexLock lock(&mu);
      seen.push_back({node, cause});
    };
  }
  // Waits (bounded) until `n` reports came; returns them.
  std::vector<std::pair<std::string, absl::Status>> Await(size_t n, absl::Duration within) {
    absl::MutexLock lock(&mu);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return seen.size() >= n; };
    mu.AwaitWithTimeout(absl::Condition(&enough), within);
    return seen;
  }
};

// Waits (bounded) until every peer of `job` on `watch` is in `state`.
bool AwaitState(const LinkPeerWatch& watch, const std::string& job, State state, size_t peers) {
  for (int i = 0; i < 400; ++i) {
    const std::vector<core::PeerState> got = watch.Peers(job);
    bool all = got.size() == peers;
    for (const core::PeerState& p : got) all = all && p.state == state;
    if (all) return true;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

TEST(PeerWatchTest, PeersComeAliveAndAPeerWhoseDaemonIsGoneIsLostAsClosed) {
  store::MemoryStore store;
  std::vector<std::unique_ptr<Losses>> losses;  // outlive the watches, whose threads call them
  std::vector<std::unique_ptr<LinkPeerWatch>> watches;
  for (int i = 0; i < 3; ++i) {
    watches.push_back(std::make_unique<LinkPeerWatch>(Fast()));
    losses.push_back(std::make_unique<Losses>());
  }
  for (int i = 0; i < 3; ++i) {
    watches[i]->Watch("j", "run1", kNodes, i, &store, losses[i]->Callback());
  }
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(AwaitState(*watches[i], "j", State::kAlive, 2)) << i;
  for (const core::PeerState& p : watches[0]->Peers("j")) {
    EXPECT_NE(p.last_heard, absl::InfiniteDuration()) << p.node << " was never heard";
  }
  watches[2].reset();  // node 2's daemon goes: its connections close
  for (int i = 0; i < 2; ++i) {
    auto seen = losses[i]->Await(1, absl::Seconds(20));
    ASSERT_EQ(seen.size(), 1u) << "node " << i;
    EXPECT_EQ(seen[0].first, kNodes[2]);
    EXPECT_EQ(seen[0].second.code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: the connection was"))
        << seen[0].second;
    EXPECT_EQ(watches[i]->LossCounts().count("closed") + watches[i]->LossCounts().count("reset"),
              1u);
  }
  // The survivors still hear each other.
  absl::SleepFor(absl::Milliseconds(800));
  for (int i = 0; i < 2; ++i) {
    for (const core::PeerState& p : watches[i]->Peers("j")) {
      EXPECT_EQ(p.state, p.node == kNodes[2] ? State::kLost : State::kAlive) << p.node;
      if (p.node == kNodes[2]) {
        EXPECT_TRUE(p.loss == core::LossCause::kClosed || p.loss == core::LossCause::kReset)
            << core::LossCauseName(p.loss);
      } else {
        EXPECT_EQ(p.loss, core::LossCause::kNone) << core::LossCauseName(p.loss);
      }
    }
  }
}

TEST(PeerWatchTest, APeerThatConnectedAndThenSaysNothingIsLostAsSilentWithinTheTimeout) {
  store::MemoryStore store;
  Losses losses;  // outlives the watch, whose thread calls it
  LinkPeerWatch watch(Fast());
  watch.Watch("j", "run1", {kNodes[0], kNodes[1]}, 0, &store, losses.Callback());
  // Node 1 is links of the watch's kind that say one word and then nothing: a daemon frozen.
  auto silent = RecordLinks::Connect(SpecOf(&store, 1, 2, "watch/run1/", 4096),
                                     absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(silent.ok()) << silent.status();
  const std::byte word[8] = {};
  ASSERT_TRUE((*silent)->Send(word, absl::Now() + absl::Seconds(20)).ok());
  auto seen = losses.Await(1, absl::Seconds(20));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].first, kNodes[1]);
  EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: no word for")) << seen[0].second;
  EXPECT_EQ(watch.LossCounts().at("silent"), 1);
  const std::vector<core::PeerState> peers = watch.Peers("j");
  ASSERT_EQ(peers.size(), 1u);
  EXPECT_EQ(peers[0].state, State::kLost);
  EXPECT_EQ(peers[0].loss, core::LossCause::kSilent);
  EXPECT_GE(peers[0].last_heard, absl::Milliseconds(600));
}

TEST(PeerWatchTest, APeerWhoseLinkFormedButThatNeverSpeaksIsConnectingThenUnreachable) {
  // A peer whose own links are still forming (it waits for a later node) sends nothing yet: it
  // is not silent for that, but one that never speaks is lost by the connect timeout.
  store::MemoryStore store;
  LinkPeerWatch::Options o = Fast();
  o.connect_timeout = absl::Seconds(4);
  Losses losses;  // outlives the watch, whose thread calls it
  LinkPeerWatch watch(o);
  watch.Watch("j", "run1", {kNodes[0], kNodes[1]}, 0, &store, losses.Callback());
  auto mute = RecordLinks::Connect(SpecOf(&store, 1, 2, "watch/run1/", 4096),
                                   absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(mute.ok()) << mute.status();
  absl::SleepFor(absl::Milliseconds(1000));  // past the 600 ms timeout: still not lost
  ASSERT_EQ(watch.Peers("j").size(), 1u);
  EXPECT_EQ(watch.Peers("j")[0].state, State::kConnecting);
  EXPECT_TRUE(losses.Await(0, absl::ZeroDuration()).empty());
  auto seen = losses.Await(1, absl::Seconds(20));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: unreachable: no word in"))
      << seen[0].second;
  EXPECT_EQ(watch.LossCounts().at("unreachable"), 1);
}

TEST(PeerWatchTest, APeerThatEndsItsJobIsLeftNotLostAndUnwatchStopsTheCallbacks) {
  store::MemoryStore store;
  // The goodbye does not depend on the timeout; a long one keeps a thread stalled under a
  // loaded sanitizer run from being read as "silent" before the goodbye arrives.
  LinkPeerWatch::Options o = Fast();
  o.timeout = absl::Seconds(10);
  LinkPeerWatch zero(o), one(o);
  Losses zero_losses, one_losses;
  zero.Watch("j", "run1", {kNodes[0], kNodes[1]}, 0, &store, zero_losses.Callback());
  one.Watch("j", "run1", {kNodes[0], kNodes[1]}, 1, &store, one_losses.Callback());
  ASSERT_TRUE(AwaitState(zero, "j", State::kAlive, 1));
  ASSERT_TRUE(AwaitState(one, "j", State::kAlive, 1));
  one.Unwatch("j");
  EXPECT_TRUE(one.Peers("j").empty());
  auto seen = zero_losses.Await(1, absl::Seconds(20));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "left the job")) << seen[0].second;
  EXPECT_TRUE(zero.LossCounts().empty());
  ASSERT_TRUE(AwaitState(zero, "j", State::kLeft, 1));
  EXPECT_EQ(zero.Peers("j")[0].loss, core::LossCause::kLeft);
  absl::SleepFor(absl::Milliseconds(800));
  EXPECT_TRUE(one_losses.Await(0, absl::ZeroDuration()).empty()) << "a callback after Unwatch";
}

TEST(PeerWatchTest, APeerThatNeverConnectsIsLostAsUnreachable) {
  store::MemoryStore store;
  LinkPeerWatch::Options o = Fast();
  o.connect_timeout = absl::Milliseconds(500);
  Losses losses;  // outlives the watch, whose thread calls it
  LinkPeerWatch watch(o);
  watch.Watch("j", "run1", {kNodes[0], kNodes[1]}, 0, &store, losses.Callback());
  auto seen = losses.Await(1, absl::Seconds(20));
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].first, kNodes[1]);
  EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: unreachable")) << seen[0].second;
  EXPECT_EQ(watch.LossCounts().at("unreachable"), 1);
  ASSERT_EQ(watch.Peers("j").size(), 1u);
  EXPECT_EQ(watch.Peers("j")[0].loss, core::LossCause::kUnreachable);
}

// The cause comes from what the socket layer met, never from a message's words.
TEST(PeerWatchTest, ALinkFailuresErrnoTravelsWithItsStatusAndWordsAloneCarryNone) {
  const absl::Status reset = sock::Error("recv", ECONNRESET);
  EXPECT_EQ(sock::ErrnoOf(reset), ECONNRESET);
  EXPECT_EQ(sock::ErrnoOf(absl::UnavailableError("recv: Connection reset by peer")), 0);
  EXPECT_EQ(sock::ErrnoOf(absl::OkStatus()), 0);
}

}  // namespace
}  // namespace gradsync::backend::cpu
