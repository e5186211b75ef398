// The C++ client against a real gradsyncd off the happy path: ops on no element, and a daemon
// stopped (SIGSTOP) and resumed under a session: every call ends with a status, none kills the
// process, an op's outcome never changes once reported. Both ways ops travel (the doorbell
// ring and the session stream).

#include <signal.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/gradsync_client.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

using client::Client;
using client::ClientOptions;
using client::Op;
using client::Segment;

class ClientTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    DaemonProcess::Options options;
    options.tcp = false;
    auto daemon = DaemonProcess::Start(dir_.path(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
  }

  // Rank `rank` of `world` in `job`; ops through the doorbell when the parameter says so.
  absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& job, int world, int rank,
                                                  absl::Duration rpc_timeout = absl::Seconds(10)) {
    ClientOptions options;
    options.doorbell = GetParam();
    options.rpc_timeout = rpc_timeout;
    return Client::Connect(daemon_->unix_target(), {job, world, rank, rank, world, ""}, options);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

// Stops the daemon (SIGSTOP) for its scope: it runs again (SIGCONT) whatever the test does.
class Stopped {
 public:
  explicit Stopped(pid_t pid) : pid_(pid) { ::kill(pid_, SIGSTOP); }
  ~Stopped() { Resume(); }
  void Resume() {
    if (pid_ > 0) ::kill(pid_, SIGCONT);
    pid_ = -1;
  }

 private:
  pid_t pid_;
};

TEST_P(ClientTest, OpsOnNoElementRunOnEveryRankWriteNothingAndKeepTheOrder) {
  constexpr int kWorld = 2;
  constexpr int kFloats = 16;
  std::vector<std::vector<uint64_t>> seqs(kWorld);
  std::vector<std::vector<float>> after(kWorld), last(kWorld);
  std::vector<std::string> errors(kWorld);
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r) {
    ranks.emplace_back([&, r] {
      auto c = Connect("empty", kWorld, r);
      if (!c.ok()) {
        errors[r] = c.status().ToString();
        return;
      }
      auto buf = (*c)->CreateBuffer(kFloats * sizeof(float), v1::FLOAT32);
      if (!buf.ok()) {
        errors[r] = buf.status().ToString();
        return;
      }
      float* data = reinterpret_cast<float*>((*buf)->data());
      for (int i = 0; i < kFloats; ++i) data[i] = static_cast<float>(100 * (r + 1) + i);
      const uint64_t id = (*buf)->id();
      const int64_t end = kFloats * sizeof(float);
      std::vector<Op> ops = {
          (*c)->AllReduceAsync(v1::FLOAT32, v1::SUM, {{id, 0, 0}}),
          (*c)->AllReduceAsync(v1::FLOAT32, v1::MAX, {}),               // no segment at all
          (*c)->AllReduceAsync(v1::FLOAT32, v1::MEAN, {{id, end, 0}}),  // at the buffer's end
          (*c)->BroadcastAsync(v1::FLOAT32, 1, {{id, 8, 0}}),
          (*c)->AllGatherAsync(v1::FLOAT32, {{id, 0, 0}}, {{id, 16, 0}}),
          (*c)->AllGatherAsync(v1::FLOAT32, {}, {}),
          (*c)->ReduceScatterAsync(v1::FLOAT32, v1::MIN, {{id, 4, 0}}, {{id, 32, 0}}),
          (*c)->ReduceScatterAsync(v1::FLOAT32, v1::SUM, {}, {}),
      };
      for (Op& op : ops) {
        if (absl::Status s = op.Wait(); !s.ok()) {
          errors[r] = absl::StrCat(errors[r], s.ToString(), "; ");
        }
        seqs[r].push_back(op.seq());
      }
      after[r].assign(data, data + kFloats);
      // An op with elements after them, on the same group.
      Op full = (*c)->AllReduceAsync(v1::FLOAT32, v1::SUM, {{id, 0, 4}});
      if (absl::Status s = full.Wait(); !s.ok()) errors[r] += s.ToString();
      seqs[r].push_back(full.seq());
      last[r].assign(data, data + 4);
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < kWorld; ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    EXPECT_EQ(errors[r], "");
    // Every op took the next sequence number of the group: the daemon ran each of them.
    ASSERT_EQ(seqs[r].size(), 9u);
    for (size_t k = 1; k < seqs[r].size(); ++k) EXPECT_EQ(seqs[r][k], seqs[r][0] + k);
    std::vector<float> untouched(kFloats);
    for (int i = 0; i < kFloats; ++i) untouched[i] = static_cast<float>(100 * (r + 1) + i);
    EXPECT_EQ(after[r], untouched);  // nothing written
    EXPECT_EQ(last[r], (std::vector<float>{300, 302, 304, 306}));
  }
}

TEST_P(ClientTest, NoElementOnOneRankAndSomeOnAnotherIsADesyncOnBoth) {
  std::vector<absl::Status> outcomes(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      auto c = Connect("uneven", 2, r);
      if (!c.ok()) {
        outcomes[r] = c.status();
        return;
      }
      auto buf = (*c)->CreateBuffer(64, v1::FLOAT32);
      if (!buf.ok()) {
        outcomes[r] = buf.status();
        return;
      }
      client::OpOptions options;
      options.timeout = absl::Seconds(20);
      outcomes[r] = (*c)->AllReduce(v1::FLOAT32, v1::SUM, {{(*buf)->id(), 0, r}}, options);
    });
  }
  for (auto& t : ranks) t.join();
  for (const absl::Status& s : outcomes) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "desync")) << s;
  }
}

TEST_P(ClientTest, StoppedDaemonFailsTheOpOnceForGoodAndTheClientClosesWithinItsRpcTimeout) {
  // Rank 0 of 2: rank 1 never comes, so no op can complete.
  auto c = Connect("frozen", 2, 0, absl::Seconds(2));
  ASSERT_TRUE(c.ok()) << c.status();
  auto buf = (*c)->CreateBuffer(64, v1::FLOAT32);
  ASSERT_TRUE(buf.ok()) << buf.status();
  const uint64_t id = (*buf)->id();
  client::OpOptions options;
  options.timeout = absl::Seconds(1);
  absl::Status first;
  Op op;
  {
    Stopped stopped(daemon_->pid());
    const absl::Time start = absl::Now();
    op = (*c)->AllReduceAsync(v1::FLOAT32, v1::SUM, {{id, 0, 4}}, options);
    first = op.Wait();  // the op's 1 s, then the client's margin
    const absl::Duration took = absl::Now() - start;
    EXPECT_GE(took, absl::Seconds(10));
    EXPECT_LT(took, absl::Seconds(20));
  }
  EXPECT_EQ(first.code(), absl::StatusCode::kDeadlineExceeded) << first;
  EXPECT_TRUE(absl::StrContains(first.message(), "no answer from gradsyncd")) << first;

  // Running again, the daemon answers the next op itself (and, late, the first one).
  absl::Status second = (*c)->AllReduce(v1::FLOAT32, v1::SUM, {{id, 0, 4}}, options);
  EXPECT_EQ(second.code(), absl::StatusCode::kDeadlineExceeded) << second;
  EXPECT_TRUE(absl::StrContains(second.message(), "rank(s) 1 never submitted it")) << second;
  absl::Status again;
  EXPECT_TRUE(op.WaitFor(absl::Milliseconds(100), &again));
  EXPECT_TRUE(op.Done());
  EXPECT_EQ(again, first);  // the outcome reported stays the outcome

  // Stopped again while the session ends: the client gives up after its RPC timeout (2 s),
  // cancels, and returns; the process lives on.
  op = Op();
  buf->reset();
  Stopped stopped(daemon_->pid());
  const absl::Time start = absl::Now();
  c->reset();
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  stopped.Resume();
  auto fresh = Connect("frozen-after", 1, 0);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  auto b = (*fresh)->CreateBuffer(16, v1::FLOAT32);
  ASSERT_TRUE(b.ok()) << b.status();
  reinterpret_cast<float*>((*b)->data())[0] = 2.5f;
  EXPECT_TRUE((*fresh)->AllReduce(v1::FLOAT32, v1::SUM, {{(*b)->id(), 0, 1}}).ok());
  EXPECT_EQ(reinterpret_cast<float*>((*b)->data())[0], 2.5f);
}

TEST_P(ClientTest, ConnectingToAStoppedDaemonFailsWithinItsRpcTimeout) {
  Stopped stopped(daemon_->pid());
  const absl::Time start = absl::Now();
  auto c = Connect("never", 1, 0, absl::Seconds(1));
  const absl::Duration took = absl::Now() - start;
  EXPECT_FALSE(c.ok());
  EXPECT_TRUE(c.status().code() == absl::StatusCode::kDeadlineExceeded ||
              c.status().code() == absl::StatusCode::kUnavailable)
      << c.status();
  EXPECT_LT(took, absl::Seconds(6));
  stopped.Resume();
  auto later = Connect("never", 1, 0);
  EXPECT_TRUE(later.ok()) << later.status();
}

INSTANTIATE_TEST_SUITE_P(Transports, ClientTest, ::testing::Values(true, false),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Doorbell") : std::string("Stream");
                         });

}  // namespace
}  // namespace gradsync::testing
