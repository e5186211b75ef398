// NodesCommunicator across three in-process "nodes" (one thread and one communicator each, real
// TCP links on loopback, rendezvous over a MemoryStore): batches of queued ops, each
// keeping its own values and outcome, whichever way each node batches them.

#include "daemon/backend/cpu/nodes_communicator.h"

#include <atomic>
#include <csignal>
#include <cstring>
#include <functional>
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

class NodesCommunicatorTest : public ::testing::Test {
 protected:
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

TEST_F(NodesCommunicatorTest, NodesBatchingDifferentlyGetEveryOpsValuesInlineAndByRing) {
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

TEST_F(NodesCommunicatorTest, SmallTuningStillGivesEveryOpsValuesInlineAndByRing) {
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

TEST_F(NodesCommunicatorTest, InvalidTuningFailsEveryOpAsInvalidArgumentAndWritesNothing) {
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

TEST_F(NodesCommunicatorTest, ManyOpsSpanningManyStreamMessagesKeepTheirValuesHoweverBatched) {
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

TEST_F(NodesCommunicatorTest, OpThatReadsAnEarlierOpsResultInTheSameBatchSeesIt) {
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

TEST_F(NodesCommunicatorTest, DesyncedAndFailedOpsInABatchFailAloneAndWriteNothing) {
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

TEST_F(NodesCommunicatorTest, RingOpWhoseDeadlinePassesBehindAnEarlierRingOpFailsAloneInABatch) {
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

TEST_F(NodesCommunicatorTest, PeerWhoseCommunicatorGoesMidBatchFailsTheRestWithoutHanging) {
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

TEST_F(NodesCommunicatorTest, DesyncOfARingOpAgainstInlineOnesMidBatchFailsItAloneOnEveryNode) {
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
  constexpr size_t kRecord = 512;
  std::vector<std::byte> message(64 + 2 * kRecord);
  const uint64_t header[3] = {0x67737265636f7264, message.size(), 2};
  std::memcpy(message.data(), header, sizeof(header));
  for (uint64_t seq = 0; seq < 2; ++seq) {
    std::byte* const r = message.data() + 64 + seq * kRecord;
    const std::string fp = seq == 0 ? op.fingerprint : "all_reduce(w, count=1) seq=1";
    const uint64_t hash = FingerprintHash(fp);
    std::memcpy(r, &seq, sizeof(seq));  // then code 0, payload 0
    std::memcpy(r + 16, &hash, sizeof(hash));
    std::memcpy(r + 24, fp.data(), fp.size());
  }
  ASSERT_TRUE((*peer)->Send(message, absl::Now() + absl::Seconds(20)).ok());
  t.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), "out of step")) << status;
  EXPECT_TRUE(absl::StrContains(status.message(), nodes[1])) << status;
  for (int64_t i = 0; i < kCount; ++i) ASSERT_EQ(data[i], 1.0f) << i;
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
    constexpr size_t kRecord = 512;
    std::vector<std::byte> message(64 + kRecord);
    const uint64_t header[3] = {0x67737265636f7264, message.size(), 1};
    std::memcpy(message.data(), header, sizeof(header));
    const uint64_t hash = FingerprintHash(op.fingerprint);
    std::memcpy(message.data() + 64 + 16, &hash, sizeof(hash));
    std::memcpy(message.data() + 64 + 24, op.fingerprint.data(), op.fingerprint.size());
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
