// NodesCommunicator across three in-process "nodes" (one thread and one communicator each, real
// TCP links on loopback, rendezvous over a MemoryStore): batches of queued ops, each
// keeping its own values and outcome, whichever way each node batches them.

#include "daemon/backend/cpu/nodes_communicator.h"

#include <atomic>
#include <csignal>
#include <cstring>
#include <functional>
#include <string_view>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "daemon/backend/cpu/record_links.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"

namespace gradsync::backend::cpu {
namespace {

constexpr int kNodes = 3;
// Group ranks 0,1 on node a, 2 on node b, 3 on node c.
const std::vector<std::string> kMemberNodes = {"127.0.0.1:1", "127.0.0.1:1", "127.0.0.1:2",
                                               "127.0.0.1:3"};
const std::vector<std::vector<int>> kLocal = {{0, 1}, {2}, {3}};

float Input(int rank, int64_t i) { return static_cast<float>((rank + 1) * (i % 5 + 1)); }

// One node's state: its communicator and its members' buffers, one per op.
struct Node {
  std::unique_ptr<NodesCommunicator> comm;
  std::vector<std::vector<std::vector<float>>> buffers;  // [op][local member]
  std::vector<core::Collective> ops;
  std::vector<absl::Status> out;
};

core::Collective AllReduce(uint64_t seq, int64_t count, v1::ReduceOp reduce, std::string name) {
  core::Collective op;
  op.kind = v1::ALL_REDUCE;
  op.reduce_op = reduce;
  op.dtype = v1::FLOAT32;
  op.count = count;
  op.group_size = 4;
  op.seq = seq;
  op.deadline = absl::Now() + absl::Seconds(30);
  op.label = absl::StrCat("all_reduce seq=", seq);
  op.fingerprint = absl::StrCat("all_reduce(", name, ", count=", count, ") seq=", seq);
  return op;
}

// Each case runs twice: the three nodes exchanging records all-to-all (the default for a group
// this small), and folding them up the tree (node 0 the root of 1 and 2).
class NodesCommunicatorTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override { tuning_.all_to_all_max_nodes = GetParam(); }

  // Every node builds the same ops (fingerprint_of may differ by node), then runs them with
  // run(node): its own way of handing them to the communicator.
  void RunOnEveryNode(const std::vector<int64_t>& counts,
                      const std::function<std::string(int node, int op)>& name_of,
                      const std::function<absl::Status(int node, int op)>& local_failure_of,
                      const std::function<void(int node, Node&)>& run,
                      const std::vector<int>& same_buffer_as = {}) {
    nodes_.resize(kNodes);
    std::vector<std::thread> threads;
    for (int node = 0; node < kNodes; ++node) {
      Node& n = nodes_[node];
      core::CommunicatorSpec spec;
      spec.job = "j";
      spec.group = "world";
      spec.members = {0, 1, 2, 3};
      spec.local_members = kLocal[node];
      spec.member_nodes = kMemberNodes;
      spec.node = kMemberNodes[kLocal[node][0]];
      spec.rendezvous = &store_;
      spec.run = "r1";
      n.comm = std::make_unique<NodesCommunicator>(spec, tuning_);
      n.buffers.resize(counts.size());
      for (size_t k = 0; k < counts.size(); ++k) {
        core::Collective op =
            AllReduce(k, counts[k], k % 2 ? v1::MAX : v1::SUM, name_of(node, static_cast<int>(k)));
        op.local_failure = local_failure_of(node, static_cast<int>(k));
        if (op.local_failure.ok() && k < same_buffer_as.size() && same_buffer_as[k] >= 0) {
          op.local = n.ops[same_buffer_as[k]].local;  // op k re-reduces that op's buffers
        } else if (op.local_failure.ok()) {
          for (int rank : kLocal[node]) {
            std::vector<float>& data = n.buffers[k].emplace_back(counts[k]);
            for (int64_t i = 0; i < counts[k]; ++i) data[i] = Input(rank, i);
          }
          for (size_t m = 0; m < kLocal[node].size(); ++m) {
            op.local.push_back({kLocal[node][m],
                                {{reinterpret_cast<std::byte*>(n.buffers[k][m].data()), counts[k]}},
                                {}});
          }
        }
        n.ops.push_back(std::move(op));
      }
      n.out.assign(counts.size(), absl::UnknownError("not run"));
    }
    for (int node = 0; node < kNodes; ++node) {
      threads.emplace_back([&, node] { run(node, nodes_[node]); });
    }
    for (std::thread& t : threads) t.join();
  }

  // Every element of op k's buffers on every node.
  void ExpectValues(size_t k, const std::function<float(int rank, int64_t i)>& want) {
    for (int node = 0; node < kNodes; ++node) {
      for (size_t m = 0; m < nodes_[node].buffers[k].size(); ++m) {
        const std::vector<float>& data = nodes_[node].buffers[k][m];
        for (size_t i = 0; i < data.size(); ++i) {
          ASSERT_EQ(data[i], want(kLocal[node][m], static_cast<int64_t>(i)))
              << "op " << k << " node " << node << " member " << m << " element " << i;
        }
      }
    }
  }

  store::MemoryStore store_;
  CpuTuning tuning_;
  std::vector<Node> nodes_;
};

float Sum(int64_t i) { return 10.0f * (i % 5 + 1); }  // over ranks 0..3 of Input
float Max(int64_t i) { return 4.0f * (i % 5 + 1); }

void RunAll(Node& n) {
  std::vector<const core::Collective*> ops;
  for (const core::Collective& op : n.ops) ops.push_back(&op);
  n.comm->RunBatch(ops, [&n](size_t i, absl::Status s) { n.out[i] = std::move(s); });
}

void RunOneByOne(Node& n) {
  for (size_t k = 0; k < n.ops.size(); ++k) n.out[k] = n.comm->Run(n.ops[k]);
}

void RunInTwoBatches(Node& n) {
  std::vector<const core::Collective*> ops;
  for (const core::Collective& op : n.ops) ops.push_back(&op);
  const size_t half = ops.size() / 2;
  n.comm->RunBatch(absl::MakeSpan(ops).subspan(0, half),
                   [&n](size_t i, absl::Status s) { n.out[i] = std::move(s); });
  n.comm->RunBatch(absl::MakeSpan(ops).subspan(half),
                   [&n, half](size_t i, absl::Status s) { n.out[half + i] = std::move(s); });
}

// Node 0 runs the ops in one batch, node 1 one by one, node 2 in two batches.
void RunThreeWays(int node, Node& n) {
  if (node == 0) RunAll(n);
  if (node == 1) RunOneByOne(n);
  if (node == 2) RunInTwoBatches(n);
}

INSTANTIATE_TEST_SUITE_P(AllToAllAndTree, NodesCommunicatorTest, ::testing::Values(4, 1),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param > 1 ? std::string("AllToAll") : std::string("Tree");
                         });

TEST_P(NodesCommunicatorTest, NodesBatchingDifferentlyGetEveryOpsValuesInlineAndByRing) {
  // Small ops travel inside their records; 100000 floats (over 256 KiB) take the ring.
  const std::vector<int64_t> counts = {1, 1000, 0, 100000, 7, 4096, 100000, 3};
  RunOnEveryNode(
      counts, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      RunThreeWays);
  for (int node = 0; node < kNodes; ++node) {
    for (size_t k = 0; k < counts.size(); ++k) {
      EXPECT_TRUE(nodes_[node].out[k].ok()) << node << " " << k << nodes_[node].out[k];
    }
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    ExpectValues(k, [&](int, int64_t i) { return k % 2 ? Max(i) : Sum(i); });
  }
}

TEST_P(NodesCommunicatorTest, SmallTuningStillGivesEveryOpsValuesInlineAndByRing) {
  // Tiny messages, segments and stages: ops over 1 KiB take the ring in 4 KiB segments one
  // ahead, a stream message holds a few records, a stage at most three ops.
  tuning_.inline_max_bytes = 1024;
  tuning_.segment_bytes = 4096;
  tuning_.window_segments = 1;
  tuning_.max_stage_ops = 3;
  tuning_.stream_message_bytes = 4096;
  tuning_.stream_flush_bytes = 2048;
  const std::vector<int64_t> counts = {1, 256, 257, 0, 5000, 7, 100000, 64, 3};
  RunOnEveryNode(
      counts, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      RunThreeWays);
  for (int node = 0; node < kNodes; ++node) {
    for (size_t k = 0; k < counts.size(); ++k) {
      EXPECT_TRUE(nodes_[node].out[k].ok()) << node << " " << k << nodes_[node].out[k];
    }
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    ExpectValues(k, [&](int, int64_t i) { return k % 2 ? Max(i) : Sum(i); });
  }
}

TEST_P(NodesCommunicatorTest, InvalidTuningFailsEveryOpAsInvalidArgumentAndWritesNothing) {
  tuning_.segment_bytes = 4000;  // not a multiple of 64
  RunOnEveryNode(
      {64, 100000}, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      RunThreeWays);
  for (int node = 0; node < kNodes; ++node) {
    for (size_t k = 0; k < 2; ++k) {
      const absl::Status& s = nodes_[node].out[k];
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
      EXPECT_TRUE(absl::StartsWith(s.message(), absl::StrCat("all_reduce seq=", k, ": ")) &&
                  absl::StrContains(s.message(), "--cpu_segment_bytes=4000"))
          << s;
    }
  }
  for (size_t k = 0; k < 2; ++k) {
    ExpectValues(k, [](int rank, int64_t i) { return Input(rank, i); });
  }
}

TEST_P(NodesCommunicatorTest, ManyOpsSpanningManyStreamMessagesKeepTheirValuesHoweverBatched) {
  // 150 ops of 40 KB (6 MB per node: many stream messages, more than the receives a node keeps
  // posted), with two ring ops among them; the nodes batch them three different ways.
  std::vector<int64_t> counts(150, 10000);
  counts[37] = 100000;
  counts[120] = 100000;
  RunOnEveryNode(
      counts, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      RunThreeWays);
  for (int node = 0; node < kNodes; ++node) {
    for (size_t k = 0; k < counts.size(); ++k) {
      EXPECT_TRUE(nodes_[node].out[k].ok()) << node << " " << k << nodes_[node].out[k];
      if (!nodes_[node].out[k].ok()) break;
    }
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    ExpectValues(k, [&](int, int64_t i) { return k % 2 ? Max(i) : Sum(i); });
  }
}

TEST_P(NodesCommunicatorTest, OpThatReadsAnEarlierOpsResultInTheSameBatchSeesIt) {
  // Ops 1 and 2 all-reduce op 0's buffers again (SUM, MAX, SUM): each must see the last result.
  RunOnEveryNode(
      {500, 500, 500}, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      [](int, Node& n) { RunAll(n); }, {-1, 0, 0});
  for (int node = 0; node < kNodes; ++node) {
    for (size_t k = 0; k < 3; ++k) EXPECT_TRUE(nodes_[node].out[k].ok()) << nodes_[node].out[k];
  }
  // SUM then MAX (all equal: unchanged) then SUM over 4 ranks.
  ExpectValues(0, [](int, int64_t i) { return 4.0f * Sum(i); });
}

TEST_P(NodesCommunicatorTest, DesyncedAndFailedOpsInABatchFailAloneAndWriteNothing) {
  // Op 2: node c names it differently (a desync across nodes). Op 4: it failed on node b before
  // it ran (a rank gone there). Op 5 is large. The rest succeed.
  const std::vector<int64_t> counts = {64, 64, 64, 64, 64, 100000, 64};
  RunOnEveryNode(
      counts, [](int node, int k) { return k == 2 && node == 2 ? "other" : "w"; },
      [](int node, int k) {
        return k == 4 && node == 1 ? absl::AbortedError("rank 2 left") : absl::OkStatus();
      },
      [](int node, Node& n) { node == 1 ? RunOneByOne(n) : RunAll(n); });
  for (int node = 0; node < kNodes; ++node) {
    const std::vector<absl::Status>& out = nodes_[node].out;
    for (size_t k = 0; k < counts.size(); ++k) {
      if (k == 2) {
        EXPECT_EQ(out[k].code(), absl::StatusCode::kFailedPrecondition) << out[k];
        EXPECT_TRUE(absl::StrContains(out[k].message(), "all_reduce(w, count=64) seq=2") &&
                    absl::StrContains(out[k].message(), "all_reduce(other, count=64) seq=2"))
            << out[k];
      } else if (k == 4) {
        EXPECT_EQ(out[k].code(), absl::StatusCode::kAborted) << out[k];
        EXPECT_TRUE(absl::StrContains(out[k].message(), "rank 2 left")) << out[k];
      } else {
        EXPECT_TRUE(out[k].ok()) << node << " " << k << " " << out[k];
      }
    }
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    if (k == 2 || k == 4) {
      ExpectValues(k, [](int rank, int64_t i) { return Input(rank, i); });
    } else {
      ExpectValues(k, [&](int, int64_t i) { return k % 2 ? Max(i) : Sum(i); });
    }
  }
}

TEST_P(NodesCommunicatorTest, RingOpWhoseDeadlinePassesBehindAnEarlierRingOpFailsAloneInABatch) {
  // Op 0 connects the nodes. Then nodes a and c batch ring op 1, ring op 2 (deadline 1 s away on
  // a and c) and small op 3; node b starts only once that deadline has passed, so op 2's
  // deadline passes while op 1 runs. Op 2 must fail by its deadline on every node without
  // breaking the group's link: op 3 succeeds.
  std::atomic<int> ready{0};
  std::atomic<int64_t> latest_deadline_ns{0};
  RunOnEveryNode(
      {64, 100000, 4000000, 64}, [](int, int) { return "w"; },
      [](int, int) { return absl::OkStatus(); },
      [&](int node, Node& n) {
        n.out[0] = n.comm->Run(n.ops[0]);
        if (node != 1) {
          n.ops[2].deadline = absl::Now() + absl::Seconds(1);
          int64_t ns = absl::ToUnixNanos(n.ops[2].deadline);
          int64_t seen = latest_deadline_ns.load();
          while (seen < ns && !latest_deadline_ns.compare_exchange_weak(seen, ns)) {
          }
          ++ready;
        } else {
          // Bounded: at most 60 s.
          for (int i = 0; i < 1200; ++i) {
            if (ready.load() == 2 && absl::Now() > absl::FromUnixNanos(latest_deadline_ns.load()) +
                                                       absl::Milliseconds(100)) {
              break;
            }
            absl::SleepFor(absl::Milliseconds(50));
          }
        }
        std::vector<const core::Collective*> ops = {&n.ops[1], &n.ops[2], &n.ops[3]};
        n.comm->RunBatch(ops, [&n](size_t i, absl::Status s) { n.out[1 + i] = std::move(s); });
      });
  for (int node = 0; node < kNodes; ++node) {
    const std::vector<absl::Status>& out = nodes_[node].out;
    EXPECT_TRUE(out[0].ok()) << node << " " << out[0];
    EXPECT_TRUE(out[1].ok()) << node << " " << out[1];
    EXPECT_EQ(out[2].code(), absl::StatusCode::kDeadlineExceeded) << node << " " << out[2];
    EXPECT_TRUE(out[3].ok()) << node << " " << out[3];
  }
  ExpectValues(1, [](int, int64_t i) { return Max(i); });
  ExpectValues(2, [](int rank, int64_t i) { return Input(rank, i); });
  ExpectValues(3, [](int, int64_t i) { return Max(i); });
}

TEST_P(NodesCommunicatorTest, PeerWhoseCommunicatorGoesMidBatchFailsTheRestWithoutHanging) {
  // Nodes a and b batch 120 ops of 40 KB (many stream messages each way); node c runs the first
  // 30 and then its communicator goes (its daemon died), with the peers' later messages still
  // on the wire towards it. a and b end every op without hanging: ops 30 on fail naming the
  // group's nodes; an op of the first 30 succeeds with the group's values or, when c's going
  // cut its records off the wire first, fails and writes nothing.
  ::signal(SIGPIPE, SIG_IGN);  // as gradsyncd does: a write to the gone peer fails, no signal
  std::vector<int64_t> counts(120, 10000);
  RunOnEveryNode(
      counts, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      [](int node, Node& n) {
        if (node != 2) return RunAll(n);
        std::vector<const core::Collective*> ops;
        for (size_t k = 0; k < 30; ++k) ops.push_back(&n.ops[k]);
        n.comm->RunBatch(ops, [&n](size_t i, absl::Status s) { n.out[i] = std::move(s); });
        n.comm.reset();
      });
  for (int node = 0; node < kNodes; ++node) {
    const std::vector<absl::Status>& out = nodes_[node].out;
    for (size_t k = 0; k < counts.size(); ++k) {
      if (node == 2 && k >= 30) break;
      EXPECT_NE(out[k].code(), absl::StatusCode::kUnknown) << node << " " << k << out[k];
      if (node == 2 || k >= 30) {
        EXPECT_EQ(out[k].ok(), k < 30) << node << " " << k << out[k];
      }
      for (size_t m = 0; m < nodes_[node].buffers[k].size(); ++m) {
        const std::vector<float>& data = nodes_[node].buffers[k][m];
        const int rank = kLocal[node][m];
        for (size_t i = 0; i < data.size(); ++i) {
          const float want = !out[k].ok() ? Input(rank, i) : k % 2 ? Max(i) : Sum(i);
          ASSERT_EQ(data[i], want) << node << " " << k << " " << m << " " << i << out[k];
        }
      }
    }
  }
  EXPECT_TRUE(absl::StrContains(nodes_[0].out[30].message(), "127.0.0.1:3")) << nodes_[0].out[30];
}

TEST_P(NodesCommunicatorTest, DesyncOfARingOpAgainstInlineOnesMidBatchFailsItAloneOnEveryNode) {
  // Op 2 is 64 floats (inline) on nodes a and b but 100000 (the ring) on node c: the nodes'
  // records differ in size and c's stage ends there. Op 2 fails as a desync naming both
  // fingerprints everywhere and writes nothing; the ops around it succeed.
  const std::vector<int64_t> counts = {64, 64, 64, 64, 100000, 64};
  RunOnEveryNode(
      counts, [](int, int) { return "w"; }, [](int, int) { return absl::OkStatus(); },
      [](int node, Node& n) {
        if (node == 2) {  // never runs: the verdicts differ first
          n.ops[2].count = 100000;
          n.ops[2].fingerprint = "all_reduce(w, count=100000) seq=2";
        }
        RunAll(n);
      });
  for (int node = 0; node < kNodes; ++node) {
    const std::vector<absl::Status>& out = nodes_[node].out;
    for (size_t k = 0; k < counts.size(); ++k) {
      if (k != 2) {
        EXPECT_TRUE(out[k].ok()) << node << " " << k << " " << out[k];
        continue;
      }
      EXPECT_EQ(out[k].code(), absl::StatusCode::kFailedPrecondition) << out[k];
      EXPECT_TRUE(absl::StrContains(out[k].message(), "count=64) seq=2") &&
                  absl::StrContains(out[k].message(), "count=100000) seq=2"))
          << out[k];
    }
  }
  for (size_t k = 0; k < counts.size(); ++k) {
    if (k == 2) {
      ExpectValues(k, [](int rank, int64_t i) { return Input(rank, i); });
    } else {
      ExpectValues(k, [&](int, int64_t i) { return k % 2 ? Max(i) : Sum(i); });
    }
  }
}

// FNV-1a of a fingerprint, as the records carry it (the wire format's).
uint64_t FingerprintHash(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

// A record of seq `seq` as node `node` of a group sends it up the tree on its own (the wire
// format's: seq, code 0, no payload, the fingerprint's hash and text, no failure, its own node
// first, no fingerprint that differs), at `at` (768 bytes).
constexpr size_t kRecord = 768;
void WriteRecord(std::byte* at, uint64_t seq, std::string_view fingerprint, int32_t node) {
  std::memset(at, 0, kRecord);
  const uint64_t hash = FingerprintHash(fingerprint);
  std::memcpy(at, &seq, sizeof(seq));
  std::memcpy(at + 16, &hash, sizeof(hash));
  std::memcpy(at + 24, fingerprint.data(), fingerprint.size());
  const int32_t nodes[3] = {-1, node, -1};  // failed, first, other
  std::memcpy(at + 504, nodes, sizeof(nodes));
}

// Two nodes, one member each (group ranks 0 and 1): node `me`'s spec, rendezvous in `store`.
core::CommunicatorSpec TwoNodeSpec(store::MemoryStore& store, int me) {
  core::CommunicatorSpec spec;
  spec.job = "j";
  spec.group = "world";
  spec.members = {0, 1};
  spec.local_members = {me};
  spec.member_nodes = {"127.0.0.1:1", "127.0.0.1:2"};
  spec.node = spec.member_nodes[me];
  spec.rendezvous = &store;
  spec.run = "r1";
  return spec;
}

// Node 1 of TwoNodeSpec's group as raw record links (a peer speaking the wire by hand).
absl::StatusOr<std::unique_ptr<RecordLinks>> RawPeerOfTwo(store::MemoryStore& store) {
  RecordLinks::Spec spec;
  spec.store = &store;
  spec.job = "j";
  spec.prefix = "records/r1/world/";
  spec.nodes = TwoNodeSpec(store, 1).member_nodes;
  spec.me = 1;
  spec.max_message_bytes = 2 << 20;
  return RecordLinks::Connect(spec, absl::Now() + absl::Seconds(20));
}

TEST(NodesCommunicatorPeerTest, ARecordAfterALargeOpsRecordFailsItAsOutOfStepAndWritesNothing) {
  // A peer (authenticated, but out of step or hostile) puts a record after a large op's in the
  // same message. The node fails the op at once, before the collective reads that stream on
  // (which would drop the message the left-over record sits in), and writes no buffer.
  ::signal(SIGPIPE, SIG_IGN);
  store::MemoryStore store;
  const std::vector<std::string> nodes = TwoNodeSpec(store, 0).member_nodes;
  NodesCommunicator comm(TwoNodeSpec(store, 0));
  constexpr int64_t kCount = 100000;  // 400 KB: past the inline limit, so a ring op
  std::vector<float> data(kCount, 1.0f);
  core::Collective op = AllReduce(0, kCount, v1::SUM, "w");
  op.group_size = 2;
  op.deadline = absl::Now() + absl::Seconds(20);
  op.local.push_back({0, {{reinterpret_cast<std::byte*>(data.data()), kCount}}, {}});
  absl::Status status;
  std::thread t([&] { status = comm.Run(op); });

  auto peer = RawPeerOfTwo(store);
  ASSERT_TRUE(peer.ok()) << peer.status();
  // One stream message: its header, then the records of seq 0 (agreeing) and seq 1.
  std::vector<std::byte> message(64 + 2 * kRecord);
  const uint64_t header[3] = {0x67737265636f7264, message.size(), 2};
  std::memcpy(message.data(), header, sizeof(header));
  for (uint64_t seq = 0; seq < 2; ++seq) {
    WriteRecord(message.data() + 64 + seq * kRecord, seq,
                seq == 0 ? op.fingerprint : "all_reduce(w, count=1) seq=1", 1);
  }
  ASSERT_TRUE((*peer)->Send(message, absl::Now() + absl::Seconds(20)).ok());
  t.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "out of step")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), nodes[1])) << status;
  for (int64_t i = 0; i < kCount; ++i) ASSERT_EQ(data[i], 1.0f) << i;
}

TEST(NodesCommunicatorPeerTest,
     AChildsFailureIsTheDecisionAndARecordNamingAnotherSubtreeIsRefused) {
  // Node 0, the root, and a raw child. The child's record of seq 0 says it failed: node 0 fails
  // the op with the child's reason, writes nothing, and passes that decision down. Its record of
  // seq 1 names node 0 (outside the child's subtree) as the failed node: a malformed record,
  // INTERNAL, and node 0 writes nothing.
  ::signal(SIGPIPE, SIG_IGN);
  store::MemoryStore store;
  CpuTuning tree;
  tree.all_to_all_max_nodes = 1;  // two nodes as a tree: node 0 sends the decision down
  NodesCommunicator comm(TwoNodeSpec(store, 0), tree);
  std::vector<std::vector<float>> data(2, std::vector<float>(16, 1.0f));
  std::vector<core::Collective> ops;
  for (uint64_t seq = 0; seq < 2; ++seq) {
    ops.push_back(AllReduce(seq, 16, v1::SUM, "w"));
    ops.back().group_size = 2;
    ops.back().local.push_back({0, {{reinterpret_cast<std::byte*>(data[seq].data()), 16}}, {}});
  }
  std::vector<absl::Status> status(2, absl::UnknownError("not run"));
  std::thread t([&] {
    for (size_t k = 0; k < 2; ++k) status[k] = comm.Run(ops[k]);
  });
  auto peer = RawPeerOfTwo(store);
  ASSERT_TRUE(peer.ok()) << peer.status();
  const auto send = [&](uint64_t seq, int32_t code, int32_t failed, std::string_view text) {
    std::vector<std::byte> message(64 + kRecord);
    const uint64_t header[3] = {0x67737265636f7264, message.size(), 1};
    std::memcpy(message.data(), header, sizeof(header));
    std::byte* const r = message.data() + 64;
    WriteRecord(r, seq, ops[seq].fingerprint, 1);
    std::memcpy(r + 8, &code, sizeof(code));
    std::memcpy(r + 264, text.data(), text.size());
    std::memcpy(r + 504, &failed, sizeof(failed));
    return (*peer)->Send(message, absl::Now() + absl::Seconds(20));
  };
  ASSERT_TRUE(send(0, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition), 1,
                   "its rank 1 was told no")
                  .ok());
  absl::StatusOr<absl::Span<const std::byte>> decision =
      (*peer)->Receive(0, absl::Now() + absl::Seconds(20));
  ASSERT_TRUE(decision.ok()) << decision.status();
  ASSERT_EQ(decision->size(), 64 + kRecord);
  int32_t code = 0, failed = -1;
  std::memcpy(&code, decision->data() + 64 + 8, sizeof(code));
  std::memcpy(&failed, decision->data() + 64 + 504, sizeof(failed));
  EXPECT_EQ(code, static_cast<int32_t>(absl::StatusCode::kFailedPrecondition));
  EXPECT_EQ(failed, 1);
  ASSERT_TRUE(send(1, static_cast<int32_t>(absl::StatusCode::kInternal), 0, "not mine").ok());
  t.join();
  EXPECT_EQ(status[0].code(), absl::StatusCode::kFailedPrecondition) << status[0];
  EXPECT_TRUE(
      absl::StrContains(status[0].message(), "failed on node 127.0.0.1:2: its rank 1 was told no"))
      << status[0];
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInternal) << status[1];
  EXPECT_TRUE(absl::StrContains(status[1].message(), "malformed record")) << status[1];
  for (const std::vector<float>& d : data) {
    for (float v : d) ASSERT_EQ(v, 1.0f);
  }
}

// Node 0 of a two-node group (one member: `data`) runs a ring all-reduce whose peer, a raw
// RecordLinks node, agrees to it, sends node 0 the whole of its block 1 (the ring's only
// reduce-scatter step: node 0 finishes block 1 with it), takes node 0's record and block 0,
// and leaves before the all-gather.
// Returns node 0's status.
absl::Status RingCutAfterItsFirstStep(bool elastic, std::vector<float>& data) {
  ::signal(SIGPIPE, SIG_IGN);
  store::MemoryStore store;
  core::CommunicatorSpec spec = TwoNodeSpec(store, 0);
  spec.elastic = elastic;
  CpuTuning tuning;
  tuning.inline_max_bytes = 4096;  // `data` takes the ring, its blocks fit the sockets' buffers
  NodesCommunicator comm(spec, tuning);
  const int64_t count = static_cast<int64_t>(data.size());
  core::Collective op = AllReduce(0, count, v1::SUM, "w");
  op.group_size = 2;
  op.deadline = absl::Now() + absl::Seconds(20);
  op.local.push_back({0, {{reinterpret_cast<std::byte*>(data.data()), count}}, {}});
  absl::Status status = absl::UnknownError("not run");
  std::thread t([&] { status = comm.Run(op); });

  auto peer = RawPeerOfTwo(store);
  EXPECT_TRUE(peer.ok()) << peer.status();
  if (peer.ok()) {
    // Its record of seq 0 (agreeing, no payload: a ring op) in one stream message.
    std::vector<std::byte> message(64 + kRecord);
    const uint64_t header[3] = {0x67737265636f7264, message.size(), 1};
    std::memcpy(message.data(), header, sizeof(header));
    WriteRecord(message.data() + 64, 0, op.fingerprint, 1);
    EXPECT_TRUE((*peer)->Send(message, absl::Now() + absl::Seconds(20)).ok());
    // Block 1 (elements [count/2, count)) as one ring segment of step 0, all 1.0.
    const size_t block = static_cast<size_t>(count - count / 2) * sizeof(float);
    std::vector<std::byte> segment(SegmentMessageBytes(block));
    const uint64_t seg_header[6] = {0x677373656730310a, 0, /*kind ring, step 0*/ 1, 0, block, 0};
    std::memcpy(segment.data(), seg_header, sizeof(seg_header));
    const std::vector<float> ones(count - count / 2, 1.0f);
    std::memcpy(segment.data() + 64, ones.data(), block);
    EXPECT_TRUE((*peer)->Send(segment, absl::Now() + absl::Seconds(20)).ok());
    // Node 0's record and its step-0 segment read before leaving (a peer gone before node 0
    // sent them would fail the ring at its first send, not mid-way).
    for (int message = 0; message < 2; ++message) {
      EXPECT_TRUE((*peer)->Receive(0, absl::Now() + absl::Seconds(20)).ok()) << message;
    }
    peer->reset();
  }
  t.join();
  return status;
}

TEST(NodesCommunicatorPeerTest, ARingCutOffMidWayWritesNoMemberBufferInAnElasticJob) {
  // An elastic job's survivors go on with their buffers: the lost peer's half-done ring must
  // leave them as they were.
  std::vector<float> data(8192, 2.0f);  // 32 KB: one segment per block
  const absl::Status status = RingCutAfterItsFirstStep(/*elastic=*/true, data);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "127.0.0.1:2")) << status;
  for (size_t i = 0; i < data.size(); ++i) ASSERT_EQ(data[i], 2.0f) << i;

  // The same cut in a job that is not elastic (which must form again after it) reduces in
  // the member's buffer: block 1 holds the finished sum. So the cut falls mid-ring.
  std::vector<float> direct(8192, 2.0f);
  EXPECT_EQ(RingCutAfterItsFirstStep(/*elastic=*/false, direct).code(),
            absl::StatusCode::kUnavailable);
  EXPECT_EQ(direct[0], 2.0f);
  EXPECT_EQ(direct[4096], 3.0f);
}

// Two nodes, one member each (group ranks 0 and 1): node `me`'s communicator.
std::unique_ptr<NodesCommunicator> TwoNodeCommunicator(store::MemoryStore& store, int me,
                                                       const CpuTuning& tuning) {
  return std::make_unique<NodesCommunicator>(TwoNodeSpec(store, me), tuning);
}

// An all-reduce of `data` (node `rank`'s member) in a two-node group.
core::Collective TwoNodeAllReduce(uint64_t seq, int rank, std::vector<float>& data,
                                  absl::Duration within) {
  core::Collective op = AllReduce(seq, static_cast<int64_t>(data.size()), v1::SUM, "w");
  op.group_size = 2;
  op.deadline = absl::Now() + within;
  op.local.push_back(
      {rank, {{reinterpret_cast<std::byte*>(data.data()), static_cast<int64_t>(data.size())}}, {}});
  return op;
}

TEST(NodesCommunicatorPeerTest, AnErrorNamesAFewOfAGroupsManyNodesAndCountsTheRest) {
  // A group of twelve nodes, one member each, whose peers never come: the op fails by its
  // deadline naming the first eight peers and counting the other three (a group of hundreds
  // of nodes must not make every error list them all).
  store::MemoryStore store;
  core::CommunicatorSpec spec = TwoNodeSpec(store, 0);
  spec.members.clear();
  spec.member_nodes.clear();
  for (int i = 0; i < 12; ++i) {
    spec.members.push_back(i);
    spec.member_nodes.push_back(absl::StrCat("127.0.0.1:", 100 + i));
  }
  spec.node = spec.member_nodes[0];
  CpuTuning tuning;
  tuning.peer_grace = absl::Milliseconds(200);
  NodesCommunicator a(spec, tuning);
  std::vector<float> data(64, 1.0f);
  core::Collective op = TwoNodeAllReduce(0, 0, data, absl::Milliseconds(300));
  op.group_size = 12;
  const absl::Status s = a.Run(op);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "node 127.0.0.1:101 (ranks 1); node 127.0.0.1:102"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "node 127.0.0.1:108 (ranks 8) and 3 more node(s)"))
      << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "127.0.0.1:109")) << s;
  for (float v : data) ASSERT_EQ(v, 1.0f);
}

// Eleven nodes (a tree three levels deep, not a power of two), one member each and a second
// (group rank 11) on node 4: every kind of op, inline and by the ring, reaches every member
// with the same values, and a failure or a desync deep in the tree fails the op on every node.
// Each case runs over the tree (the default at this size) and all-to-all.
class NodesCommunicatorTreeTest : public ::testing::TestWithParam<int> {
 protected:
  static constexpr int kN = 11;
  static constexpr int kRanks = 12;
  static int NodeOf(int rank) { return rank == 11 ? 4 : rank; }
  static std::string Address(int node) { return absl::StrCat("127.0.0.1:", 200 + node); }
  static float In(int rank, int64_t i) { return static_cast<float>((rank + 1) * (i % 7 + 1)); }

  // Runs `ops(node)`'s ops on every node, in one batch when `batch`, else one by one; returns
  // every node's statuses.
  struct Op {
    core::Collective op;
    std::vector<std::vector<float>> in, out;  // by local member
  };
  std::vector<std::vector<absl::Status>> RunEverywhere(
      const std::function<std::vector<Op>(int node)>& ops, bool batch) {
    std::vector<std::vector<absl::Status>> status(kN);
    made_.assign(kN, {});
    for (int node = 0; node < kN; ++node) made_[node] = ops(node);
    std::vector<std::thread> threads;
    for (int node = 0; node < kN; ++node) {
      threads.emplace_back([&, node] {
        std::vector<Op>& mine = made_[node];
        for (Op& o : mine) {  // buffers are in place now: point the members at them
          size_t m = 0;
          for (int rank = 0; rank < kRanks; ++rank) {
            if (NodeOf(rank) != node) continue;
            core::LocalMember member{rank, {}, {}};
            if (!o.op.local_failure.ok()) continue;
            member.input = {{reinterpret_cast<std::byte*>(o.in[m].data()),
                             static_cast<int64_t>(o.in[m].size())}};
            if (!o.out.empty()) {
              member.output = {{reinterpret_cast<std::byte*>(o.out[m].data()),
                                static_cast<int64_t>(o.out[m].size())}};
            }
            o.op.local.push_back(member);
            ++m;
          }
        }
        status[node].assign(mine.size(), absl::UnknownError("not run"));
        if (batch) {
          std::vector<const core::Collective*> list;
          for (const Op& o : mine) list.push_back(&o.op);
          comms_[node]->RunBatch(list, [&](size_t i, absl::Status s) { status[node][i] = s; });
        } else {
          for (size_t i = 0; i < mine.size(); ++i) status[node][i] = comms_[node]->Run(mine[i].op);
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return status;
  }

  void SetUp() override {
    CpuTuning tuning;
    tuning.inline_max_bytes = 4096;
    tuning.all_to_all_max_nodes = GetParam();
    tuning.segment_bytes = 4096;  // the ring's blocks and the broadcast run several segments
    tuning.peer_grace = absl::Seconds(5);
    for (int node = 0; node < kN; ++node) {
      core::CommunicatorSpec spec;
      spec.job = "j";
      spec.group = "world";
      for (int rank = 0; rank < kRanks; ++rank) {
        spec.members.push_back(rank);
        spec.member_nodes.push_back(Address(NodeOf(rank)));
        if (NodeOf(rank) == node) spec.local_members.push_back(rank);
      }
      spec.node = Address(node);
      spec.rendezvous = &store_;
      spec.run = "r1";
      comms_.push_back(std::make_unique<NodesCommunicator>(spec, tuning));
    }
  }

  // Op `seq` of `kind` on `node`: each local member's input filled by In (REDUCE_SCATTER's and
  // ALL_GATHER's outputs zeroed).
  static Op Make(int node, uint64_t seq, v1::OpKind kind, int64_t count,
                 v1::ReduceOp reduce = v1::SUM, int root = 0) {
    Op o;
    o.op.kind = kind;
    o.op.reduce_op = reduce;
    o.op.dtype = v1::FLOAT32;
    o.op.count = count;
    o.op.root = root;
    o.op.group_size = kRanks;
    o.op.seq = seq;
    o.op.deadline = absl::Now() + absl::Seconds(30);
    o.op.label = absl::StrCat(OpKindName(kind), " seq=", seq);
    o.op.fingerprint =
        absl::StrCat(OpKindName(kind), "(count=", count, ", root=", root, ") seq=", seq);
    const int64_t in = kind == v1::REDUCE_SCATTER ? count * kRanks : count;
    for (int rank = 0; rank < kRanks; ++rank) {
      if (NodeOf(rank) != node) continue;
      std::vector<float>& v = o.in.emplace_back(in);
      for (int64_t i = 0; i < in; ++i) v[i] = In(rank, i);
      if (kind == v1::ALL_GATHER) o.out.emplace_back(count * kRanks, 0.0f);
      if (kind == v1::REDUCE_SCATTER) o.out.emplace_back(count, 0.0f);
    }
    return o;
  }

  // The local members' ranks on `node`, ascending.
  static std::vector<int> Ranks(int node) {
    std::vector<int> out;
    for (int rank = 0; rank < kRanks; ++rank) {
      if (NodeOf(rank) == node) out.push_back(rank);
    }
    return out;
  }

  store::MemoryStore store_;
  std::vector<std::unique_ptr<NodesCommunicator>> comms_;
  std::vector<std::vector<Op>> made_;
};

INSTANTIATE_TEST_SUITE_P(TreeAndAllToAll, NodesCommunicatorTreeTest, ::testing::Values(4, 16),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return info.param < 11 ? std::string("Tree") : std::string("AllToAll");
                         });

TEST_P(NodesCommunicatorTreeTest, EveryKindInlineAndByTheRingGivesEveryMemberTheSameValues) {
  const auto ops = [](int node) {
    std::vector<Op> out;
    out.push_back(Make(node, 0, v1::ALL_REDUCE, 64));                         // inline
    out.push_back(Make(node, 1, v1::ALL_REDUCE, 20000, v1::MEAN));            // ring
    out.push_back(Make(node, 2, v1::BROADCAST, 100, v1::SUM, /*root=*/6));    // inline
    out.push_back(Make(node, 3, v1::BROADCAST, 3000, v1::SUM, /*root=*/11));  // chain
    out.push_back(Make(node, 4, v1::ALL_GATHER, 8));                          // inline
    out.push_back(Make(node, 5, v1::ALL_GATHER, 200));                        // ring
    out.push_back(Make(node, 6, v1::REDUCE_SCATTER, 4));                      // inline
    out.push_back(Make(node, 7, v1::REDUCE_SCATTER, 100, v1::MAX));           // ring
    out.push_back(Make(node, 8, v1::BARRIER, 0));
    return out;
  };
  for (bool batch : {false, true}) {
    const std::vector<std::vector<absl::Status>> status = RunEverywhere(
        [&](int node) {
          std::vector<Op> o = ops(node);
          if (batch) {  // the same ops again, further on in the group's sequence
            for (Op& x : o) {
              x.op.seq += 9;
              x.op.fingerprint += " again";
            }
          }
          return o;
        },
        batch);
    for (int node = 0; node < kN; ++node) {
      for (size_t k = 0; k < status[node].size(); ++k) {
        ASSERT_TRUE(status[node][k].ok())
            << "node " << node << " op " << k << ": " << status[node][k];
      }
      const std::vector<Op>& o = made_[node];
      const std::vector<int> ranks = Ranks(node);
      for (size_t m = 0; m < ranks.size(); ++m) {
        for (int64_t i = 0; i < 64; ++i) ASSERT_EQ(o[0].in[m][i], 78.0f * (i % 7 + 1)) << node;
        for (int64_t i = 0; i < 20000; ++i) ASSERT_EQ(o[1].in[m][i], 6.5f * (i % 7 + 1)) << node;
        for (int64_t i = 0; i < 100; ++i) ASSERT_EQ(o[2].in[m][i], In(6, i)) << node;
        for (int64_t i = 0; i < 3000; ++i) ASSERT_EQ(o[3].in[m][i], In(11, i)) << node;
        for (int q = 0; q < kRanks; ++q) {
          for (int64_t i = 0; i < 8; ++i) ASSERT_EQ(o[4].out[m][q * 8 + i], In(q, i)) << node;
          for (int64_t i = 0; i < 200; ++i) ASSERT_EQ(o[5].out[m][q * 200 + i], In(q, i)) << node;
        }
        const int64_t at4 = ranks[m] * 4, at100 = ranks[m] * 100;
        for (int64_t i = 0; i < 4; ++i) {
          ASSERT_EQ(o[6].out[m][i], 78.0f * ((at4 + i) % 7 + 1)) << node;
        }
        for (int64_t i = 0; i < 100; ++i) {
          ASSERT_EQ(o[7].out[m][i], 12.0f * ((at100 + i) % 7 + 1)) << node;
        }
      }
    }
  }
}

TEST_P(NodesCommunicatorTreeTest, AFailureOrADesyncDeepInTheTreeFailsTheOpOnEveryNodeAlone) {
  // In one batch: op 0 fails on node 9 (a leaf under 8), op 1's fingerprint differs on node 6
  // (a leaf under 4), op 2 is sound. Every node fails ops 0 and 1 the same way and writes
  // nothing, and op 2 still reduces.
  const std::vector<std::vector<absl::Status>> status = RunEverywhere(
      [](int node) {
        std::vector<Op> o;
        o.push_back(Make(node, 0, v1::ALL_REDUCE, 64));
        o.push_back(Make(node, 1, v1::ALL_REDUCE, 64));
        o.push_back(Make(node, 2, v1::ALL_REDUCE, 64));
        if (node == 9) {
          o[0].op.local_failure = absl::FailedPreconditionError("rank 9 was told no");
          o[0].in.clear();
        }
        if (node == 6) o[1].op.fingerprint = "all_reduce(count=65) seq=1";
        return o;
      },
      /*batch=*/true);
  for (int node = 0; node < kN; ++node) {
    const absl::Status& failed = status[node][0];
    EXPECT_EQ(failed.code(), absl::StatusCode::kFailedPrecondition) << node << ": " << failed;
    EXPECT_TRUE(absl::StrContains(failed.message(), "rank 9 was told no")) << failed;
    if (node != 9) {
      EXPECT_TRUE(absl::StrContains(failed.message(), "failed on node 127.0.0.1:209")) << failed;
    }
    const absl::Status& desync = status[node][1];
    EXPECT_EQ(desync.code(), absl::StatusCode::kFailedPrecondition) << node << ": " << desync;
    EXPECT_TRUE(absl::StrContains(desync.message(), "desync")) << desync;
    EXPECT_TRUE(absl::StrContains(desync.message(), "count=65")) << desync;
    EXPECT_TRUE(absl::StrContains(desync.message(), "count=64")) << desync;
    ASSERT_TRUE(status[node][2].ok()) << node << ": " << status[node][2];
    const std::vector<Op>& o = made_[node];
    for (size_t m = 0; m < Ranks(node).size(); ++m) {
      for (int64_t i = 0; i < 64; ++i) {
        if (node != 9) {
          ASSERT_EQ(o[0].in[m][i], In(Ranks(node)[m], i)) << node;
        }
        ASSERT_EQ(o[1].in[m][i], In(Ranks(node)[m], i)) << node;
        ASSERT_EQ(o[2].in[m][i], 78.0f * (i % 7 + 1)) << node;
      }
    }
  }
}

const absl::Status kLost =
    absl::UnavailableError("node 127.0.0.1:2 lost: no word from it for 1.5 s");

// The op's label, then the abort's message: what Abort makes every op of the group fail with.
void ExpectFailsWithTheAbort(const absl::Status& s, uint64_t seq, const absl::Status& abort) {
  EXPECT_EQ(s.code(), abort.code()) << s;
  EXPECT_EQ(s.message(), absl::StrCat("all_reduce seq=", seq, ": ", abort.message())) << s;
}

TEST(NodesCommunicatorAbortTest, AbortWakesAnOpWaitingForASilentPeerAndFailsLaterOpsTheSameWay) {
  // Both nodes run op 0 (the links connect); then node b goes silent (its thread blocks) while
  // node a waits in op 1 for b's record, with a deadline far off. Abort from a third thread
  // ends op 1 with the abort's status, not its deadline's, and writes nothing; ops 2 and 3 fail
  // the same way (the first abort's status stays), and so do small and large ones alike.
  ::signal(SIGPIPE, SIG_IGN);
  store::MemoryStore store;
  CpuTuning tuning;
  tuning.peer_grace = absl::Seconds(1);  // unaborted, op 1 would end DEADLINE_EXCEEDED in 21 s
  std::unique_ptr<NodesCommunicator> a = TwoNodeCommunicator(store, 0, tuning);
  std::unique_ptr<NodesCommunicator> b = TwoNodeCommunicator(store, 1, tuning);
  std::vector<std::vector<float>> data(4, std::vector<float>(64, 1.0f));
  data[3].assign(100000, 1.0f);  // a ring op
  std::vector<float> b_data(64, 2.0f);
  absl::Notification a_in_op1, release_b;
  std::vector<absl::Status> out(4, absl::UnknownError("not run"));
  absl::Status b_out;
  std::thread node_b([&] {
    core::Collective op = TwoNodeAllReduce(0, 1, b_data, absl::Seconds(20));
    b_out = b->Run(op);
    release_b.WaitForNotification();  // silent from here on
  });
  absl::Time op1_deadline, op1_ended;
  std::thread node_a([&] {
    core::Collective op0 = TwoNodeAllReduce(0, 0, data[0], absl::Seconds(20));
    out[0] = a->Run(op0);
    a_in_op1.Notify();
    core::Collective op1 = TwoNodeAllReduce(1, 0, data[1], absl::Seconds(20));
    op1_deadline = op1.deadline;
    out[1] = a->Run(op1);
    op1_ended = absl::Now();
  });
  a_in_op1.WaitForNotification();
  absl::SleepFor(absl::Milliseconds(300));  // op 1 is in its wait (were it not, it still fails)
  a->Abort(kLost);
  node_a.join();
  a->Abort(absl::AbortedError("a later abort"));  // ignored: the first status stays
  core::Collective op2 = TwoNodeAllReduce(2, 0, data[2], absl::Seconds(20));
  out[2] = a->Run(op2);
  core::Collective op3 = TwoNodeAllReduce(3, 0, data[3], absl::Seconds(20));
  out[3] = a->Run(op3);
  release_b.Notify();
  node_b.join();

  EXPECT_TRUE(b_out.ok()) << b_out;
  // Woken by the abort, not by its deadline (20 s away; its status alone cannot tell: an op
  // failing at its deadline after the abort reports the abort too).
  EXPECT_LT(op1_ended, op1_deadline);
  ASSERT_TRUE(out[0].ok()) << out[0];
  for (float v : data[0]) ASSERT_EQ(v, 3.0f);
  for (uint64_t seq = 1; seq < 4; ++seq) {
    ExpectFailsWithTheAbort(out[seq], seq, kLost);
    for (float v : data[seq]) ASSERT_EQ(v, 1.0f) << seq;
  }
}

TEST(NodesCommunicatorAbortTest, AbortBeforeTheFirstOpFailsEveryOpWithoutConnecting) {
  // No peer exists: an op that tried to connect would wait out its deadline.
  store::MemoryStore store;
  std::unique_ptr<NodesCommunicator> a = TwoNodeCommunicator(store, 0, CpuTuning{});
  a->Abort(kLost);
  std::vector<std::vector<float>> data(3, std::vector<float>(64, 1.0f));
  std::vector<core::Collective> ops;
  for (uint64_t seq = 0; seq < 3; ++seq) {
    ops.push_back(TwoNodeAllReduce(seq, 0, data[seq], absl::Minutes(5)));
  }
  ExpectFailsWithTheAbort(a->Run(ops[0]), 0, kLost);
  std::vector<absl::Status> out(2, absl::UnknownError("not run"));
  const core::Collective* const batch[] = {&ops[1], &ops[2]};
  a->RunBatch(batch, [&](size_t i, absl::Status s) { out[i] = std::move(s); });
  ExpectFailsWithTheAbort(out[0], 1, kLost);
  ExpectFailsWithTheAbort(out[1], 2, kLost);
  for (const std::vector<float>& d : data) {
    for (float v : d) ASSERT_EQ(v, 1.0f);
  }
  // A status to abort with that is OK would fail nothing: it counts as INTERNAL.
  std::unique_ptr<NodesCommunicator> c = TwoNodeCommunicator(store, 0, CpuTuning{});
  c->Abort(absl::OkStatus());
  const absl::Status s = c->Run(ops[0]);
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal) << s;
}

TEST(NodesCommunicatorAbortTest, AbortWakesAnOpConnectingToAPeerThatNeverComes) {
  store::MemoryStore store;
  std::unique_ptr<NodesCommunicator> a = TwoNodeCommunicator(store, 0, CpuTuning{});
  std::vector<float> data(64, 1.0f);
  core::Collective op = TwoNodeAllReduce(0, 0, data, absl::Seconds(20));
  absl::Status out = absl::UnknownError("not run");
  absl::Time ended;
  std::thread node_a([&] {
    out = a->Run(op);
    ended = absl::Now();
  });
  absl::SleepFor(absl::Milliseconds(300));  // connecting: node b never publishes its address
  a->Abort(kLost);
  node_a.join();
  EXPECT_LT(ended, op.deadline);  // woken by the abort, not by its deadline 20 s away
  ExpectFailsWithTheAbort(out, 0, kLost);
  for (float v : data) ASSERT_EQ(v, 1.0f);
}

}  // namespace
}  // namespace gradsync::backend::cpu
