// The link plan (link_plan.h): symmetric, O(log N) links per node, every node within about
// log2 N hops of every other; a group's binomial tree; and record links connected over a plan
// (Spec::peers): only the planned pairs connect, and sends to "every peer" reach those alone.

#include "daemon/backend/cpu/link_plan.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/backend/cpu/record_links.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"
#include "tests/unit/record_links_testing.h"

namespace gradsync::backend::cpu {
namespace {

// Hops from node 0 to the farthest node over the plan (every node's LinkedNodes), -1 when one
// cannot be reached.
int Diameter(int n, int ring) {
  int worst = 0;
  for (int from = 0; from < n; ++from) {
    std::vector<int> hops(n, -1);
    std::deque<int> queue = {from};
    hops[from] = 0;
    while (!queue.empty()) {
      const int at = queue.front();
      queue.pop_front();
      for (int next : LinkedNodes(n, at, ring)) {
        if (hops[next] < 0) {
          hops[next] = hops[at] + 1;
          queue.push_back(next);
        }
      }
    }
    for (int h : hops) {
      if (h < 0) return -1;
      worst = std::max(worst, h);
    }
  }
  return worst;
}

TEST(LinkPlanTest, SymmetricLogarithmicAndEveryNodeWithinLog2NHops) {
  for (int ring : {1, 2, 3}) {
    for (int n : {2, 3, 5, 6, 7, 12, 13, 31, 64, 100, 257}) {
      const int log2n = static_cast<int>(std::ceil(std::log2(n)));
      for (int i = 0; i < n; ++i) {
        const std::vector<int> linked = LinkedNodes(n, i, ring);
        ASSERT_TRUE(std::is_sorted(linked.begin(), linked.end()));
        EXPECT_LE(static_cast<int>(linked.size()), std::min(n - 1, 2 * (ring + log2n)))
            << "n=" << n << " i=" << i;
        for (int j : linked) {
          ASSERT_NE(j, i);
          const std::vector<int> back = LinkedNodes(n, j, ring);
          EXPECT_TRUE(std::binary_search(back.begin(), back.end(), i))
              << "n=" << n << ": " << i << " links to " << j << " but not back";
        }
        const std::vector<int> neighbours = RingNeighbours(n, i, ring);
        EXPECT_EQ(static_cast<int>(neighbours.size()), std::min(n - 1, 2 * ring)) << n;
        EXPECT_TRUE(
            std::includes(linked.begin(), linked.end(), neighbours.begin(), neighbours.end()));
      }
      if (n <= 100) {
        EXPECT_LE(Diameter(n, ring), log2n) << "n=" << n << " ring=" << ring;
        EXPECT_GE(Diameter(n, ring), 1);
      }
    }
  }
  // 256 nodes, two neighbours each way: 15 links (128 places away is one node both ways) and 4
  // heartbeat partners, not 255 of each.
  EXPECT_EQ(LinkedNodes(256, 7, 2).size(), 15u);
  EXPECT_EQ(RingNeighbours(256, 7, 2), (std::vector<int>{5, 6, 8, 9}));
  EXPECT_EQ(RingNeighbours(256, 0, 1), (std::vector<int>{1, 255}));
}

TEST(LinkPlanTest, RingZeroAndSmallJobsAreTheMeshAndBadInputIsEmpty) {
  EXPECT_EQ(LinkedNodes(6, 2, 0), (std::vector<int>{0, 1, 3, 4, 5}));
  EXPECT_EQ(RingNeighbours(6, 2, 0), (std::vector<int>{0, 1, 3, 4, 5}));
  EXPECT_EQ(LinkedNodes(5, 4, 2), (std::vector<int>{0, 1, 2, 3}));  // 2 each way reaches all
  EXPECT_EQ(RingNeighbours(5, 4, 2), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(LinkedNodes(1, 0, 2).empty());
  EXPECT_TRUE(LinkedNodes(8, 8, 2).empty());
  EXPECT_TRUE(LinkedNodes(8, -1, 2).empty());
}

TEST(LinkPlanTest, TheGroupTreeCoversEveryNodeOnceInNodeOrderWithinLog2NLevels) {
  for (int n : {1, 2, 3, 5, 8, 13, 64, 100, 256, 257, 1000}) {
    const int log2n = n < 2 ? 0 : static_cast<int>(std::ceil(std::log2(n)));
    std::vector<int> parents(n, 0);
    for (int i = 0; i < n; ++i) {
      // A subtree is its node, then its children's subtrees one after another.
      int next = i + 1;
      for (int child : TreeChildren(n, i)) {
        EXPECT_EQ(child, next) << "n=" << n << " i=" << i;
        EXPECT_EQ(TreeParent(child), i);
        ++parents[child];
        next = SubtreeEnd(n, child);
      }
      EXPECT_EQ(next, SubtreeEnd(n, i)) << "n=" << n << " i=" << i;
      EXPECT_LE(static_cast<int>(TreeChildren(n, i).size()), log2n);
      int depth = 0;
      for (int at = i; at != 0; at = TreeParent(at)) ++depth;
      EXPECT_LE(depth, log2n) << "n=" << n << " i=" << i;
      // The group's links: ring neighbours and tree partners, symmetric and few.
      const std::vector<int> linked = GroupLinks(n, i);
      ASSERT_TRUE(std::is_sorted(linked.begin(), linked.end()));
      EXPECT_LE(static_cast<int>(linked.size()), std::min(n - 1, 3 + log2n)) << n << " " << i;
      for (int j : linked) {
        const std::vector<int> back = GroupLinks(n, j);
        EXPECT_TRUE(std::binary_search(back.begin(), back.end(), i)) << n << ": " << i << "," << j;
      }
      if (n > 1) {
        EXPECT_TRUE(std::binary_search(linked.begin(), linked.end(), (i + 1) % n));
        EXPECT_TRUE(std::binary_search(linked.begin(), linked.end(), (i + n - 1) % n));
      }
    }
    EXPECT_EQ(TreeParent(0), -1);
    EXPECT_EQ(SubtreeEnd(n, 0), n);
    for (int i = 1; i < n; ++i) EXPECT_EQ(parents[i], 1) << "n=" << n << " i=" << i;
  }
  EXPECT_EQ(TreeChildren(13, 0), (std::vector<int>{1, 2, 4, 8}));
  EXPECT_EQ(TreeChildren(13, 8), (std::vector<int>{9, 10, 12}));
  EXPECT_EQ(TreeChildren(13, 12), (std::vector<int>{}));
  EXPECT_EQ(GroupLinks(256, 0), (std::vector<int>{1, 2, 4, 8, 16, 32, 64, 128, 255}));
  EXPECT_EQ(GroupLinks(256, 7), (std::vector<int>{6, 8}));
  EXPECT_TRUE(GroupLinks(1, 0).empty());
  EXPECT_TRUE(TreeChildren(8, 8).empty());
}

TEST(RecordLinksPlanTest, OnlyThePlannedPairsConnectAndEveryPeerMeansThoseAlone) {
  constexpr int kN = 9;
  constexpr int kRing = 1;  // node 0 links to 1, 8 (ring), 2, 7, 4, 5 (fingers); not 3 or 6
  store::MemoryStore store;
  std::vector<std::string> nodes;
  for (int i = 0; i < kN; ++i) nodes.push_back(absl::StrCat("127.0.0.1:", i + 1));
  std::vector<std::unique_ptr<RecordLinks>> links(kN);
  std::vector<absl::Status> status(kN);
  std::vector<std::thread> threads;
  for (int i = 0; i < kN; ++i) {
    threads.emplace_back([&, i] {
      auto made = RecordLinks::Connect(SpecOf(&store, nodes, i, LinkedNodes(kN, i, kRing), "p/"),
                                       absl::Now() + absl::Seconds(30));
      status[i] = made.status();
      if (made.ok()) links[i] = *std::move(made);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int i = 0; i < kN; ++i) ASSERT_TRUE(status[i].ok()) << i << ": " << status[i];
  EXPECT_EQ(LinkedNodes(kN, 0, kRing), (std::vector<int>{1, 2, 4, 5, 7, 8}));
  for (int i = 0; i < kN; ++i) {
    const std::vector<int> plan = LinkedNodes(kN, i, kRing);
    for (int j = 0; j < kN; ++j) {
      const bool planned = std::binary_search(plan.begin(), plan.end(), j);
      EXPECT_EQ(links[i]->Linked(j), planned) << i << "->" << j;
      EXPECT_EQ(links[i]->PollFd(j) >= 0, planned) << i << "->" << j;
    }
  }
  // Node 0 sends to every peer: its planned peers get it; node 3 (unplanned) has no link to
  // take it from, and asking fails at once, as does sending to it.
  const std::byte word[8] = {std::byte{7}};
  ASSERT_TRUE(links[0]->Send(word, absl::Now() + absl::Seconds(10)).ok());
  for (int j : LinkedNodes(kN, 0, kRing)) {
    auto got = links[j]->Receive(0, absl::Now() + absl::Seconds(10));
    ASSERT_TRUE(got.ok()) << j << ": " << got.status();
    EXPECT_EQ(got->size(), 8u);
    EXPECT_EQ((*got)[0], std::byte{7});
  }
  auto none = links[3]->Receive(0, absl::Now() + absl::Seconds(10));
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition) << none.status();
  const absl::Span<const std::byte> parts[] = {word};
  EXPECT_EQ(links[0]->SendTo(3, parts, absl::Now()).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace gradsync::backend::cpu
