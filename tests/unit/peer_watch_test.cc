// LinkPeerWatch between in-process "nodes" (real TCP on loopback, rendezvous over a
// MemoryStore): peers come alive, a peer gone is lost as closed, a silent one as silent within
// the timeout, one that ends its job is "left" and not counted as a loss, and Unwatch stops the
// callbacks.

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/backend/cpu/link_peer_watch.h"
#include "daemon/backend/cpu/link_plan.h"
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

// Beyond five nodes a watch is not a mesh (link_plan.h): these jobs have more nodes than two
// ring neighbours each way reach.
std::vector<std::string> ManyNodes(int n) {
  std::vector<std::string> out;
  for (int i = 0; i < n; ++i) out.push_back(absl::StrCat("127.0.0.1:", 100 + i));
  return out;
}

// `n` watches of one job on `ring`, node `skip` (if any) left to the test.
struct Job {
  store::MemoryStore store;
  std::vector<std::string> nodes;
  std::vector<std::unique_ptr<Losses>> losses;  // outlive the watches, whose threads call them
  std::vector<std::unique_ptr<LinkPeerWatch>> watches;

  Job(int n, LinkPeerWatch::Options o, int skip = -1) : nodes(ManyNodes(n)) {
    for (int i = 0; i < n; ++i) {
      losses.push_back(std::make_unique<Losses>());
      watches.push_back(i == skip ? nullptr : std::make_unique<LinkPeerWatch>(o));
    }
    for (int i = 0; i < n; ++i) {
      if (watches[i]) watches[i]->Watch("j", "run1", nodes, i, &store, losses[i]->Callback());
    }
  }

  // Node `me` (one left to the test) as links of the watch's kind over its plan on `ring`: the
  // test speaks for it by hand.
  absl::StatusOr<std::unique_ptr<RecordLinks>> LinksOf(int me, int ring) {
    return RecordLinks::Connect(
        SpecOf(&store, nodes, me, LinkedNodes(static_cast<int>(nodes.size()), me, ring),
               "watch/run1/", 4096),
        absl::Now() + absl::Seconds(20));
  }
};

TEST(PeerWatchPlanTest, ADaemonGoneIsReportedOnceToEverySurvivorOverLogNLinksEach) {
  constexpr int kN = 10;
  LinkPeerWatch::Options o = Fast();
  o.ring = 1;  // node i links to i+-1, i+-2, i+-4, i+-8: 6 of its 9 peers; heartbeats to 2
  Job job(kN, o);
  for (int i = 0; i < kN; ++i) {
    ASSERT_TRUE(AwaitState(*job.watches[i], "j", State::kAlive, kN - 1)) << i;
    EXPECT_EQ(job.watches[i]->GetTotals().links, 6) << i;
  }
  absl::SleepFor(absl::Milliseconds(500));
  const int64_t beats = job.watches[0]->GetTotals().heartbeats_sent;
  EXPECT_GT(beats, 0);
  constexpr int kGone = 5;
  job.watches[kGone].reset();  // its connections close: its linked peers see it at once
  for (int i = 0; i < kN; ++i) {
    if (i == kGone) continue;
    auto seen = job.losses[i]->Await(1, absl::Seconds(20));
    ASSERT_EQ(seen.size(), 1u) << "node " << i;
    EXPECT_EQ(seen[0].first, job.nodes[kGone]);
    EXPECT_EQ(seen[0].second.code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: the connection was"))
        << i << ": " << seen[0].second;
    const std::vector<int> linked = LinkedNodes(kN, i, 1);
    if (!std::binary_search(linked.begin(), linked.end(), kGone)) {
      // Not linked to it: told by one that is.
      EXPECT_TRUE(absl::StrContains(seen[0].second.message(), ", seen by node 127.0.0.1:"))
          << i << ": " << seen[0].second;
    }
  }
  // Reported once each, and the survivors still hear each other.
  absl::SleepFor(absl::Milliseconds(800));
  for (int i = 0; i < kN; ++i) {
    if (i == kGone) continue;
    EXPECT_EQ(job.losses[i]->Await(0, absl::ZeroDuration()).size(), 1u) << i;
    for (const core::PeerState& p : job.watches[i]->Peers("j")) {
      EXPECT_EQ(p.state, p.node == job.nodes[kGone] ? State::kLost : State::kAlive)
          << i << " sees " << p.node;
    }
  }
  EXPECT_GT(job.watches[0]->GetTotals().notices_sent, 0);
}

TEST(PeerWatchPlanTest, ANodeGoneBeforeItsLinksFormedIsLostAloneOnEverySurvivor) {
  // Node 3 registered (it is in the job's node list) and died before its watch connected:
  // the nodes linked to it (2, 4 ring; 1, 5, 7 fingers) find it unreachable by the connect
  // timeout, the rest (0, 6) are told, and no survivor loses anyone else.
  constexpr int kN = 8, kGone = 3;
  LinkPeerWatch::Options o = Fast();
  o.ring = 1;
  o.connect_timeout = absl::Seconds(3);
  Job job(kN, o, kGone);
  for (int i = 0; i < kN; ++i) {
    if (i == kGone) continue;
    auto seen = job.losses[i]->Await(1, absl::Seconds(30));
    ASSERT_EQ(seen.size(), 1u) << "node " << i;
    EXPECT_EQ(seen[0].first, job.nodes[kGone]) << i;
    EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: unreachable"))
        << i << ": " << seen[0].second;
    if (i == 0 || i == 6) {
      EXPECT_TRUE(absl::StrContains(seen[0].second.message(), ", seen by node"))
          << i << ": " << seen[0].second;
    }
  }
  for (int i = 0; i < kN; ++i) {
    if (i == kGone) continue;
    for (int k = 0; k < 100; ++k) {  // the ring neighbours' first words, bounded
      bool settled = true;
      for (const core::PeerState& p : job.watches[i]->Peers("j")) {
        settled = settled &&
                  (p.node == job.nodes[kGone] ? p.state == State::kLost : p.state == State::kAlive);
      }
      if (settled) break;
      absl::SleepFor(absl::Milliseconds(50));
    }
    for (const core::PeerState& p : job.watches[i]->Peers("j")) {
      EXPECT_EQ(p.state, p.node == job.nodes[kGone] ? State::kLost : State::kAlive)
          << i << " sees " << p.node << ": " << p.cause;
    }
    EXPECT_EQ(job.losses[i]->Await(0, absl::ZeroDuration()).size(), 1u) << i;
  }
}

TEST(PeerWatchPlanTest, OneWatcherHearingNothingIsASuspicionTwoAreALoss) {
  // Node 7 (the test's links) keeps talking to its ring neighbour 0 and says nothing to 6 (a
  // link dropping packets): 6 suspects it, and no one loses it. Then it falls silent to 0 too:
  // two watchers, and every node loses it.
  constexpr int kN = 8, kQuiet = 7;
  LinkPeerWatch::Options o = Fast();
  o.ring = 1;
  Job job(kN, o, kQuiet);
  auto quiet = job.LinksOf(kQuiet, 1);
  ASSERT_TRUE(quiet.ok()) << quiet.status();
  const std::byte word[8] = {};
  ASSERT_TRUE((*quiet)->Send(word, absl::Now() + absl::Seconds(20)).ok());
  const absl::Span<const std::byte> beat[] = {word};
  const absl::Time talk_until = absl::Now() + absl::Seconds(2);  // past the 600 ms timeout
  for (int k = 0; k < 100 && absl::Now() < talk_until; ++k) {
    ASSERT_TRUE((*quiet)->SendTo(0, beat, absl::Now() + absl::Seconds(5)).ok());
    absl::SleepFor(absl::Milliseconds(50));
  }
  for (int i = 0; i < kQuiet; ++i) {
    EXPECT_TRUE(job.losses[i]->Await(0, absl::ZeroDuration()).empty()) << "node " << i;
  }
  for (int i = 0; i < kQuiet; ++i) {
    auto seen = job.losses[i]->Await(1, absl::Seconds(20));
    ASSERT_EQ(seen.size(), 1u) << "node " << i;
    EXPECT_EQ(seen[0].first, job.nodes[kQuiet]);
    EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: no word for"))
        << i << ": " << seen[0].second;
  }
}

// The wire form of a notice (link_peer_watch.cc): "gsnote01", then int32 kind (0: lost),
// node, origin, cause (core::LossCause), then the text.
std::string NoticeBytes(int node, int origin, core::LossCause cause, const std::string& text) {
  std::string out("gsnote01", 8);
  for (int32_t v : {0, node, origin, static_cast<int32_t>(cause)}) {
    out.append(reinterpret_cast<const char*>(&v), sizeof(v));
  }
  return out + text;
}

TEST(PeerWatchPlanTest, AFrozenNodeIsFoundByItsRingNeighboursEveryOtherIsToldAndSoIsIt) {
  constexpr int kN = 8, kFrozen = 7;
  LinkPeerWatch::Options o = Fast();
  o.ring = 1;  // node 7's ring neighbours: 6 and 0
  Job job(kN, o, kFrozen);
  // Node 7: links of the watch's kind over its plan that say one word each and then nothing
  // (a daemon frozen).
  auto frozen = job.LinksOf(kFrozen, 1);
  ASSERT_TRUE(frozen.ok()) << frozen.status();
  const std::byte word[8] = {};
  ASSERT_TRUE((*frozen)->Send(word, absl::Now() + absl::Seconds(20)).ok());
  for (int i = 0; i < kFrozen; ++i) {
    auto seen = job.losses[i]->Await(1, absl::Seconds(20));
    ASSERT_EQ(seen.size(), 1u) << "node " << i;
    EXPECT_EQ(seen[0].first, job.nodes[kFrozen]);
    EXPECT_TRUE(absl::StrContains(seen[0].second.message(), "lost: no word for"))
        << i << ": " << seen[0].second;
    // Its ring neighbours (0, 6) find it themselves, or hear it from the other one first; the
    // rest are told.
    if (i != 0 && i != 6) {
      EXPECT_TRUE(absl::StrContains(seen[0].second.message(), ", seen by node"))
          << i << ": " << seen[0].second;
    }
    EXPECT_EQ(job.watches[i]->LossCounts().at("silent"), 1) << i;
  }
  // A neighbour told node 7 before it dropped the link: a notice about node 7 itself.
  bool told = false;
  for (int from : {0, 6}) {
    for (int k = 0; k < 64 && !told; ++k) {
      auto m = (*frozen)->Receive(from, absl::Now() + absl::Seconds(5));
      if (!m.ok()) break;
      int32_t about = -1;
      if (m->size() >= 24 && std::memcmp(m->data(), "gsnote01", 8) == 0) {
        std::memcpy(&about, m->data() + 12, sizeof(about));
        told = about == kFrozen;
      }
    }
  }
  EXPECT_TRUE(told) << "no ring neighbour told the frozen node it was declared lost";
}

TEST(PeerWatchPlanTest, ANodeToldItIsLostCountsEveryPeerLostAndTheOthersGoOn) {
  constexpr int kN = 6, kTeller = 5, kTold = 4;
  LinkPeerWatch::Options o = Fast();
  o.ring = 1;
  o.timeout = absl::Seconds(30);  // no one falls silent here: node 5 is the test's
  Job job(kN, o, kTeller);
  auto teller = job.LinksOf(kTeller, 1);  // linked to 0, 1, 3, 4
  ASSERT_TRUE(teller.ok()) << teller.status();
  const std::byte word[8] = {};
  ASSERT_TRUE((*teller)->Send(word, absl::Now() + absl::Seconds(20)).ok());
  for (int i = 0; i < kTeller; ++i) ASSERT_TRUE(AwaitState(*job.watches[i], "j", State::kAlive, 5));
  const std::string notice = NoticeBytes(kTold, kTeller, core::LossCause::kSilent,
                                         "lost: no word for 9.9 s (frozen, or the network ...)");
  const absl::Span<const std::byte> parts[] = {
      absl::MakeConstSpan(reinterpret_cast<const std::byte*>(notice.data()), notice.size())};
  ASSERT_TRUE((*teller)->SendTo(kTold, parts, absl::Now() + absl::Seconds(5)).ok());
  // Node 4 counts every peer lost, as expelled, once.
  auto seen = job.losses[kTold]->Await(kN - 1, absl::Seconds(20));
  ASSERT_EQ(seen.size(), static_cast<size_t>(kN - 1));
  for (const auto& [node, cause] : seen) {
    EXPECT_TRUE(absl::StrContains(cause.message(),
                                  "this node was declared lost by node " + job.nodes[kTeller]))
        << cause;
  }
  EXPECT_EQ(job.watches[kTold]->LossCounts().at("expelled"), 1);
  for (const core::PeerState& p : job.watches[kTold]->Peers("j")) {
    EXPECT_EQ(p.loss, core::LossCause::kExpelled) << p.node;
  }
  // The others lose node 4 (it dropped its links) and no one else: its word was not passed on.
  for (int i = 0; i < kTold; ++i) {
    auto lost = job.losses[i]->Await(1, absl::Seconds(20));
    ASSERT_EQ(lost.size(), 1u) << i;
    EXPECT_EQ(lost[0].first, job.nodes[kTold]) << i;
  }
  absl::SleepFor(absl::Milliseconds(500));
  for (int i = 0; i < kTold; ++i) {
    EXPECT_EQ(job.losses[i]->Await(0, absl::ZeroDuration()).size(), 1u) << i;
    EXPECT_EQ(job.watches[i]->LossCounts().count("expelled"), 0u) << i;
  }
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
