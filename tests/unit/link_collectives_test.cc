// The link collectives between in-process "nodes" (one thread each, RecordLinks over loopback
// TCP): the ring all-reduce's exact results on every node and member for every dtype, reduction,
// count and segment size; broadcast and all-gather byte for byte with uneven parts; refused
// out-of-step messages, deadlines and a peer gone.

#include "daemon/backend/cpu/link_collectives.h"

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/backend/cpu/kernels.h"
#include "tests/unit/record_links_testing.h"

namespace gradsync::backend::cpu {
namespace {

// Small integers: every sum is exact in every dtype below, so each node's result can be compared
// bit for bit with one computed here.
int Input(int node, int member, int64_t i) {
  return static_cast<int>((node * 7 + member * 3 + i) % 11) - 5;
}

template <typename T>
T FromInt(DType dtype, int v) {
  if constexpr (std::is_same_v<T, uint16_t>) {
    return dtype == v1::FLOAT16 ? FloatToHalf(static_cast<float>(v))
                                : FloatToBFloat16(static_cast<float>(v));
  } else {
    return static_cast<T>(v);
  }
}

struct Case {
  DType dtype;
  v1::ReduceOp op;
};

// Runs one ring over `nodes` nodes (members[node] members each) and checks every buffer.
// `separate`: each node's result goes to a buffer of its own, its members only read.
template <typename T>
void ExpectRing(std::vector<std::unique_ptr<RecordLinks>>& links, const std::vector<int>& members,
                Case c, int64_t count, size_t segment_bytes, uint64_t seq, int64_t window = 2,
                bool separate = false) {
  const int nodes = static_cast<int>(links.size());
  int total_members = 0;
  for (int node = 0; node < nodes; ++node) total_members += members[node];
  // What every element must be, computed as the kernels would (one final rounding).
  std::vector<T> want(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    double acc = c.op == v1::MIN ? 1e9 : c.op == v1::MAX ? -1e9 : 0;
    for (int node = 0; node < nodes; ++node) {
      for (int m = 0; m < members[node]; ++m) {
        const int v = Input(node, m, i);
        acc = c.op == v1::MIN   ? std::min<double>(acc, v)
              : c.op == v1::MAX ? std::max<double>(acc, v)
                                : acc + v;
      }
    }
    if (c.op == v1::MEAN) {
      const T sum = FromInt<T>(c.dtype, static_cast<int>(acc));
      const core::View in = {{reinterpret_cast<std::byte*>(const_cast<T*>(&sum)), 1}};
      const core::View out = {{reinterpret_cast<std::byte*>(&want[i]), 1}};
      const Slice src{&in, 0}, dst{&out, 0};
      EXPECT_TRUE(Reduce(c.dtype, v1::MEAN, total_members, {&src, 1}, {&dst, 1}, 1).ok());
    } else {
      want[i] = FromInt<T>(c.dtype, static_cast<int>(acc));
    }
  }
  std::vector<std::vector<std::vector<T>>> data(nodes);
  std::vector<std::vector<T>> results(nodes, std::vector<T>(static_cast<size_t>(count)));
  std::vector<absl::Status> status(nodes);
  RunOnEach(nodes, [&](int node) {
    std::vector<std::byte*> buffers;
    for (int m = 0; m < members[node]; ++m) {
      std::vector<T>& b = data[node].emplace_back(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) b[i] = FromInt<T>(c.dtype, Input(node, m, i));
      buffers.push_back(reinterpret_cast<std::byte*>(b.data()));
    }
    LinkOp op;
    op.seq = seq;
    op.deadline = absl::Now() + absl::Seconds(60);
    op.segment_bytes = segment_bytes;
    op.window = window;
    RingSpec spec;
    spec.dtype = c.dtype;
    spec.op = c.op;
    spec.divisor = total_members;
    spec.count = count;
    status[node] =
        RingAllreduce(*links[node], op, spec, buffers,
                      separate ? reinterpret_cast<std::byte*>(results[node].data()) : nullptr);
  });
  for (int node = 0; node < nodes; ++node) {
    ASSERT_TRUE(status[node].ok()) << "node " << node << ": " << status[node];
    if (count == 0) continue;
    for (int m = 0; m < members[node]; ++m) {
      std::vector<T> input(static_cast<size_t>(count));
      for (int64_t i = 0; i < count; ++i) input[i] = FromInt<T>(c.dtype, Input(node, m, i));
      ASSERT_EQ(
          std::memcmp(data[node][m].data(), (separate ? input : want).data(), count * sizeof(T)), 0)
          << "dtype " << c.dtype << " op " << c.op << " count " << count << " segment "
          << segment_bytes << " node " << node << " member " << m << " separate " << separate;
    }
    if (separate) {
      ASSERT_EQ(std::memcmp(results[node].data(), want.data(), count * sizeof(T)), 0)
          << "dtype " << c.dtype << " op " << c.op << " count " << count << " segment "
          << segment_bytes << " node " << node << "'s result";
    }
    for (int from = 0; from < nodes; ++from) {
      if (from != node) {
        EXPECT_EQ(links[node]->BufferedFrom(from), 0u);
      }
    }
  }
}

TEST(RingAllreduceTest, EveryMemberOfEveryNodeGetsTheExactResultForEveryShape) {
  // Counts below the node count (empty chunks), uneven chunks, segments of one element to
  // whole chunks; nodes with one, two and three members.
  for (int nodes : {1, 2, 3}) {
    store::MemoryStore store;
    auto links = ConnectAll(&store, nodes, 2 << 20);
    ASSERT_EQ(links.size(), static_cast<size_t>(nodes));
    const std::vector<int> members = nodes == 1   ? std::vector<int>{3}
                                     : nodes == 2 ? std::vector<int>{2, 1}
                                                  : std::vector<int>{2, 1, 3};
    uint64_t seq = 0;
    for (int64_t count : {0, 1, 2, 5, 4099}) {
      for (size_t segment : {size_t{8}, size_t{256}, size_t{1} << 20}) {
        ExpectRing<float>(links, members, {v1::FLOAT32, v1::SUM}, count, segment, ++seq);
        ExpectRing<float>(links, members, {v1::FLOAT32, v1::MEAN}, count, segment, ++seq);
        ExpectRing<double>(links, members, {v1::FLOAT64, v1::MEAN}, count, segment, ++seq);
        ExpectRing<int32_t>(links, members, {v1::INT32, v1::MAX}, count, segment, ++seq);
        ExpectRing<int64_t>(links, members, {v1::INT64, v1::MIN}, count, segment, ++seq);
        ExpectRing<int8_t>(links, members, {v1::INT8, v1::SUM}, count, segment, ++seq);
        ExpectRing<uint16_t>(links, members, {v1::FLOAT16, v1::SUM}, count, segment, ++seq);
        ExpectRing<uint16_t>(links, members, {v1::BFLOAT16, v1::MEAN}, count, segment, ++seq);
        // The result in a buffer of its own, the members only read (elastic jobs).
        ExpectRing<float>(links, members, {v1::FLOAT32, v1::MEAN}, count, segment, ++seq, 2,
                          /*separate=*/true);
        ExpectRing<int32_t>(links, members, {v1::INT32, v1::MAX}, count, segment, ++seq, 2,
                            /*separate=*/true);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

TEST(RingAllreduceTest, LargeBuffersFlowThroughBoundedSegments) {
  // 24 MiB per member: far more than the sockets hold, in 1 MiB segments.
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  ExpectRing<float>(links, {2, 2}, {v1::FLOAT32, v1::MEAN}, int64_t{6} << 20, 1 << 20, 1);
}

TEST(RingAllreduceTest, EveryWindowGivesTheExactResult) {
  // One segment ahead (send, then wait for each) to more than a chunk holds.
  store::MemoryStore store;
  auto links = ConnectAll(&store, 3, 2 << 20);
  ASSERT_EQ(links.size(), 3u);
  uint64_t seq = 0;
  for (int64_t window : {1, 3, 1000}) {
    ExpectRing<float>(links, {2, 1, 3}, {v1::FLOAT32, v1::SUM}, 40000, 4096, ++seq, window);
    ExpectRing<int64_t>(links, {2, 1, 3}, {v1::INT64, v1::MAX}, 4099, 64, ++seq, window);
    if (::testing::Test::HasFatalFailure()) return;
  }
}

TEST(RingAllreduceTest, AnOpThatIsNotAReductionFailsInternalOnEveryNode) {
  // The kernels refuse it before they write (here at the first block a node reduces): every
  // node fails alike, its buffer unchanged.
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  std::vector<absl::Status> status(2);
  std::vector<std::vector<float>> data(2, std::vector<float>(1000, 1.0f));
  RunOnEach(2, [&](int node) {
    std::byte* buffer = reinterpret_cast<std::byte*>(data[node].data());
    LinkOp op;
    op.seq = 1;
    op.deadline = absl::Now() + absl::Seconds(30);
    RingSpec spec;
    spec.op = v1::REDUCE_OP_UNSPECIFIED;
    spec.count = 1000;
    status[node] = RingAllreduce(*links[node], op, spec, {&buffer, 1});
  });
  for (int node = 0; node < 2; ++node) {
    EXPECT_EQ(status[node].code(), absl::StatusCode::kInternal) << status[node];
    EXPECT_TRUE(absl::StrContains(status[node].message(), "reduce op none (0)")) << status[node];
    for (float v : data[node]) ASSERT_EQ(v, 1.0f);
  }
}

TEST(LinkCollectivesTest, AWindowBelowOneIsRefused) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  std::vector<float> data(16, 1.0f);
  std::byte* buffer = reinterpret_cast<std::byte*>(data.data());
  LinkOp op;
  op.seq = 1;
  op.deadline = absl::Now() + absl::Seconds(30);
  op.window = 0;
  RingSpec spec;
  spec.count = 16;
  const absl::Status ring = RingAllreduce(*links[0], op, spec, {&buffer, 1});
  EXPECT_EQ(ring.code(), absl::StatusCode::kInvalidArgument) << ring;
  const std::vector<size_t> parts = {32, 32};
  const absl::Status gather = LinkAllGather(*links[0], op, parts, buffer);
  EXPECT_EQ(gather.code(), absl::StatusCode::kInvalidArgument) << gather;
  for (float v : data) EXPECT_EQ(v, 1.0f);
}

absl::Status RunAlone(RecordLinks& links, uint64_t seq, int64_t count, absl::Duration within,
                      std::vector<float>& data) {
  data.assign(static_cast<size_t>(count), 1.0f);
  std::byte* buffer = reinterpret_cast<std::byte*>(data.data());
  LinkOp op;
  op.seq = seq;
  op.deadline = absl::Now() + within;
  op.segment_bytes = 4096;
  RingSpec spec;
  spec.count = count;
  return RingAllreduce(links, op, spec, {&buffer, 1});
}

TEST(RingAllreduceTest, NodesOnDifferentOpsRefuseEachOthersSegmentsAsOutOfStep) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  std::vector<absl::Status> status(2);
  std::vector<std::vector<float>> data(2);
  RunOnEach(2, [&](int node) {
    status[node] = RunAlone(*links[node], /*seq=*/10 + node, 100000, absl::Seconds(30), data[node]);
  });
  for (int node = 0; node < 2; ++node) {
    EXPECT_EQ(status[node].code(), absl::StatusCode::kInternal) << status[node];
    EXPECT_TRUE(absl::StrContains(status[node].message(), "out of step")) << status[node];
    EXPECT_TRUE(absl::StrContains(status[node].message(), kNodes[1 - node])) << status[node];
  }
}

TEST(RingAllreduceTest, APeerThatNeverJoinsFailsTheRingByItsDeadlineNamingIt) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  std::vector<float> data;
  const absl::Status s = RunAlone(*links[0], 1, 1000, absl::Milliseconds(300), data);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), kNodes[1])) << s;
}

TEST(RingAllreduceTest, APeerGoneMidRingFailsItAsUnavailable) {
  // Node 1 takes node 0's first segment of the ring, then leaves; node 0 has a minute left but
  // must not wait it out.
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  absl::Status zero;
  std::vector<float> data;
  std::thread t([&] { zero = RunAlone(*links[0], 1, 1 << 20, absl::Seconds(60), data); });
  const absl::StatusOr<absl::Span<const std::byte>> first =
      links[1]->Receive(0, absl::Now() + absl::Seconds(60));
  EXPECT_TRUE(first.ok()) << first.status();
  links[1].reset();
  t.join();
  EXPECT_EQ(zero.code(), absl::StatusCode::kUnavailable) << zero;
  EXPECT_TRUE(absl::StrContains(zero.message(), kNodes[1])) << zero;
}

std::vector<std::byte> Bytes(int node, size_t n) {
  std::vector<std::byte> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = static_cast<std::byte>((node * 37 + i * 11 + i / 4096) % 253);
  return out;
}

TEST(LinkBroadcastTest, EveryNodeGetsTheRootsBytesFromEveryRoot) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 3, 2 << 20);
  ASSERT_EQ(links.size(), 3u);
  uint64_t seq = 0;
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{4097}, size_t{5} << 20}) {
    for (size_t segment : {size_t{1000}, size_t{1} << 20}) {
      if (bytes > (1 << 20) && segment < 4096) continue;  // thousands of messages: slow, no news
      for (int root = 0; root < 3; ++root) {
        ++seq;
        std::vector<std::vector<std::byte>> data(3);
        std::vector<absl::Status> status(3);
        RunOnEach(3, [&](int node) {
          data[node] = node == root ? Bytes(root, bytes) : std::vector<std::byte>(bytes);
          LinkOp op;
          op.seq = seq;
          op.deadline = absl::Now() + absl::Seconds(60);
          op.segment_bytes = segment;
          status[node] = LinkBroadcast(*links[node], op, root, absl::MakeSpan(data[node]));
        });
        const std::vector<std::byte> want = Bytes(root, bytes);
        for (int node = 0; node < 3; ++node) {
          ASSERT_TRUE(status[node].ok()) << node << ": " << status[node];
          ASSERT_TRUE(data[node] == want) << "root " << root << " node " << node << " bytes "
                                          << bytes << " segment " << segment;
        }
      }
    }
  }
}

TEST(LinkAllGatherTest, EveryNodeGetsEveryPartInNodeOrderWhateverTheirSizes) {
  // Parts of different sizes (one empty, one of many segments): the slowest peer paces the
  // others, and nobody waits for segments a peer does not have.
  store::MemoryStore store;
  auto links = ConnectAll(&store, 3, 2 << 20);
  ASSERT_EQ(links.size(), 3u);
  const std::vector<std::vector<size_t>> shapes = {
      {0, 0, 0}, {1, 0, 3}, {4096, 100000, 7}, {size_t{3} << 20, 5000, 0}};
  uint64_t seq = 0;
  for (const std::vector<size_t>& parts : shapes) {
    for (size_t segment : {size_t{512}, size_t{1} << 20}) {
      ++seq;
      size_t total = 0;
      for (size_t p : parts) total += p;
      std::vector<std::byte> want;
      for (int node = 0; node < 3; ++node) {
        const std::vector<std::byte> b = Bytes(node, parts[node]);
        want.insert(want.end(), b.begin(), b.end());
      }
      std::vector<std::vector<std::byte>> out(3);
      std::vector<absl::Status> status(3);
      RunOnEach(3, [&](int node) {
        out[node].assign(total, std::byte{0xee});
        size_t at = 0;
        for (int i = 0; i < node; ++i) at += parts[i];
        const std::vector<std::byte> mine = Bytes(node, parts[node]);
        std::copy(mine.begin(), mine.end(), out[node].begin() + static_cast<ptrdiff_t>(at));
        LinkOp op;
        op.seq = seq;
        op.deadline = absl::Now() + absl::Seconds(60);
        op.segment_bytes = segment;
        status[node] = LinkAllGather(*links[node], op, parts, out[node].data());
      });
      for (int node = 0; node < 3; ++node) {
        ASSERT_TRUE(status[node].ok()) << node << ": " << status[node];
        ASSERT_TRUE(out[node] == want) << "node " << node << " shape " << parts[0] << ","
                                       << parts[1] << "," << parts[2] << " segment " << segment;
        for (int from = 0; from < 3; ++from) {
          if (from != node) {
            EXPECT_EQ(links[node]->BufferedFrom(from), 0u);
          }
        }
      }
    }
  }
}

TEST(LinkBroadcastTest, ARootThatNeverSendsFailsTheOthersByTheDeadlineNamingIt) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  std::vector<std::byte> data(100);
  LinkOp op;
  op.seq = 1;
  op.deadline = absl::Now() + absl::Milliseconds(300);
  const absl::Status s = LinkBroadcast(*links[1], op, /*root=*/0, absl::MakeSpan(data));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), kNodes[0])) << s;
}

TEST(LinkAllGatherTest, ABroadcastWhereAnAllGatherWasDueIsOutOfStep) {
  store::MemoryStore store;
  auto links = ConnectAll(&store, 2, 2 << 20);
  ASSERT_EQ(links.size(), 2u);
  std::vector<absl::Status> status(2);
  RunOnEach(2, [&](int node) {
    std::vector<std::byte> data(1000);
    LinkOp op;
    op.seq = 5;
    op.deadline = absl::Now() + absl::Seconds(30);
    if (node == 0) {
      status[0] = LinkBroadcast(*links[0], op, 0, absl::MakeSpan(data));
    } else {
      const std::vector<size_t> parts = {500, 500};
      status[1] = LinkAllGather(*links[1], op, parts, data.data());
    }
  });
  EXPECT_TRUE(status[0].ok()) << status[0];  // the root sent and is done
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInternal) << status[1];
  EXPECT_TRUE(absl::StrContains(status[1].message(), "out of step")) << status[1];
}

}  // namespace
}  // namespace gradsync::backend::cpu
