// A trainer (or any local client) cannot hurt the node (docs/architecture.md section 6): each
// request that used to stop the daemon, reach what the caller does not own, or grow the daemon
// without bound is refused with a status naming the limit, and the daemon stays SERVING with
// everything else as it was. Real daemon processes, real clients.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/gradsync_client.h"
#include "client/store_client.h"
#include "common/grpc_status.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "gradsync/v1/store.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/sample_plan.h"

namespace gradsync::testing {
namespace {

class UntrustedClientTest : public ::testing::Test {
 protected:
  void Start(std::vector<std::string> flags = {}) {
    DaemonProcess::Options options;
    options.flags = std::move(flags);
    options.stderr_path = log_path();
    auto d = DaemonProcess::Start(dir_.path(), options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    store_ = std::make_unique<client::StoreClient>(client::Connect(daemon_->unix_target()));
  }

  std::string log_path() const { return dir_.path() + "/gradsyncd.log"; }

  void ExpectServing() {
    auto stub = grpc::health::v1::Health::NewStub(client::Connect(daemon_->unix_target()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    grpc::health::v1::HealthCheckResponse resp;
    grpc::Status s = stub->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
  }

  absl::StatusOr<std::unique_ptr<client::Client>> Trainer(const std::string& job, int world,
                                                          int rank, bool doorbell = false) {
    client::ClientOptions options;
    options.doorbell = doorbell;
    options.rpc_timeout = absl::Seconds(5);
    return client::Client::Connect(daemon_->unix_target(), {job, world, rank, rank, world, ""},
                                   options);
  }

  absl::StatusOr<v1::WaitResponse> RawWait(const std::string& job, int copies,
                                           const std::string& key, absl::Duration deadline) {
    auto stub = v1::Store::NewStub(client::Connect(daemon_->unix_target()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    v1::WaitRequest req;
    req.set_job(job);
    for (int i = 0; i < copies; ++i) req.add_keys(key);
    v1::WaitResponse resp;
    if (absl::Status s = FromGrpcStatus(stub->Wait(&ctx, req, &resp)); !s.ok()) return s;
    return resp;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::StoreClient> store_;
};

// Finding 2: one Wait naming a 1 MiB key 2,100 times once made a 2.2 GB reply (the daemon
// aborted); 17 copies was refused only by gRPC, naming nothing.
TEST_F(UntrustedClientTest, WaitWhoseReplyWouldPassTheMessageLimitIsRefusedNamingTheFlag) {
  Start();
  const std::string mib(1 << 20, 'x');
  ASSERT_TRUE(store_->Set("j", "big", mib).ok());
  ASSERT_TRUE(store_->Set("j", "small", "s").ok());
  for (int copies : {17, 2100}) {
    auto reply = RawWait("j", copies, "big", absl::Seconds(5));
    EXPECT_EQ(reply.status().code(), absl::StatusCode::kResourceExhausted) << copies;
    EXPECT_TRUE(absl::StrContains(reply.status().message(), "--max_message_bytes"))
        << reply.status();
  }
  // Within the limit a key named twice comes back twice, in request order.
  auto values = store_->WaitBlocking("j", {"big", "small", "big"}, absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(values.ok()) << values.status();
  EXPECT_EQ(*values, (std::vector<std::string>{mib, "s", mib}));
  auto still = store_->Get("j", "big", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(still.ok());
  EXPECT_EQ(*still, mib);
  ExpectServing();
}

// Finding 3 (with the right token, even): trainer sessions are the unix socket's alone.
TEST_F(UntrustedClientTest, TrainerSessionOverTcpIsRefusedEvenWithTheClusterToken) {
  Start();
  client::ClientOptions options;
  options.doorbell = false;
  options.token = daemon_->token();
  options.rpc_timeout = absl::Seconds(5);
  auto refused = client::Client::Connect(daemon_->tcp_target(), {"t", 1, 0, 0, 1, ""}, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "unix socket only"))
      << refused.status();
  // The store over TCP, with the token, is what TCP is for.
  client::StoreClient tcp(client::Connect(daemon_->tcp_target(), options), options);
  EXPECT_TRUE(tcp.Set("t", "k", "v").ok());
  auto trainer = Trainer("t", 1, 0);  // no session was left behind on rank 0
  ASSERT_TRUE(trainer.ok()) << trainer.status();
  EXPECT_TRUE((*trainer)->Barrier().ok());
  ExpectServing();
}

// Finding 6: node-wide caps on sessions.
TEST_F(UntrustedClientTest, SessionsPastMaxSessionsAreRefusedUntilOneEnds) {
  Start({"--max_sessions=2"});
  auto a = Trainer("a", 3, 0);
  auto b = Trainer("b", 1, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  auto c = Trainer("a", 3, 1);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kResourceExhausted) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "--max_sessions")) << c.status();
  EXPECT_TRUE((*b)->Barrier().ok());  // the sessions held keep working
  b->reset();
  absl::StatusOr<std::unique_ptr<client::Client>> again;
  for (int i = 0; i < 100; ++i) {  // the daemon sees b's stream end shortly after
    again = Trainer("a", 3, 1);
    if (again.ok()) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  EXPECT_TRUE(again.ok()) << again.status();
  ExpectServing();
}

// Finding 6: node-wide caps on buffers, mappings and mapped bytes.
TEST_F(UntrustedClientTest, BuffersPastTheNodeLimitsAreRefusedNamingTheFlag) {
  Start({"--max_buffers=3", "--max_mapped_bytes=1048576", "--max_mappings=1000"});
  auto a = Trainer("a", 1, 0);
  auto b = Trainer("b", 1, 0);
  ASSERT_TRUE(a.ok() && b.ok());
  auto too_big = (*a)->CreateBuffer(2 << 20);
  EXPECT_EQ(too_big.status().code(), absl::StatusCode::kResourceExhausted) << too_big.status();
  EXPECT_TRUE(absl::StrContains(too_big.status().message(), "--max_mapped_bytes"))
      << too_big.status();
  std::vector<std::unique_ptr<client::SharedBuffer>> held;
  for (int i = 0; i < 3; ++i) {
    auto buffer = (i == 2 ? *b : *a)->CreateBuffer(4096, v1::FLOAT32);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    held.push_back(*std::move(buffer));
  }
  auto fourth = (*b)->CreateBuffer(4096);
  EXPECT_EQ(fourth.status().code(), absl::StatusCode::kResourceExhausted) << fourth.status();
  EXPECT_TRUE(absl::StrContains(fourth.status().message(), "--max_buffers")) << fourth.status();
  // What a holds still works and is its own.
  reinterpret_cast<float*>(held[0]->data())[0] = 5;
  ASSERT_TRUE((*a)->AllReduce(v1::FLOAT32, v1::SUM, {held[0]->Whole(4)}).ok());
  EXPECT_EQ(reinterpret_cast<float*>(held[0]->data())[0], 5);
  ASSERT_TRUE((*a)->DestroyBuffer(std::move(held[0])).ok());
  auto after = (*b)->CreateBuffer(4096);
  EXPECT_TRUE(after.ok()) << after.status();
  ExpectServing();
}

TEST_F(UntrustedClientTest, MappingsPastMaxMappingsAreRefusedNamingTheFlag) {
  Start({"--max_mappings=2"});
  auto a = Trainer("a", 1, 0);
  ASSERT_TRUE(a.ok());
  auto one = (*a)->CreateBuffer(4096);
  auto two = (*a)->CreateBuffer(4096);
  ASSERT_TRUE(one.ok() && two.ok());
  auto three = (*a)->CreateBuffer(4096);
  EXPECT_EQ(three.status().code(), absl::StatusCode::kResourceExhausted) << three.status();
  EXPECT_TRUE(absl::StrContains(three.status().message(), "--max_mappings")) << three.status();
  // A doorbell is a mapping too: a session that wants one is refused, and says why.
  auto rung = Trainer("b", 1, 0, /*doorbell=*/true);
  EXPECT_EQ(rung.status().code(), absl::StatusCode::kResourceExhausted) << rung.status();
  ExpectServing();
}

// Finding 6: ops in flight are capped per session on both transports (the gRPC stream had no
// cap: 100,000 parked ops grew the daemon by 110 MB).
class OpsInFlightTest : public UntrustedClientTest,
                        public ::testing::WithParamInterface<bool /*doorbell*/> {};

TEST_P(OpsInFlightTest, OpsPastTheSessionLimitFailAtOnceAndTheSessionGoesOn) {
  Start({"--max_ops_in_flight_per_session=8"});
  auto r0 = Trainer("j", 2, 0, GetParam());
  auto r1 = Trainer("j", 2, 1, GetParam());
  ASSERT_TRUE(r0.ok() && r1.ok());
  client::OpOptions slow;
  slow.timeout = absl::Seconds(60);
  std::vector<client::Op> parked;
  for (int i = 0; i < 8; ++i) parked.push_back((*r0)->BarrierAsync(slow));
  absl::Status refused = (*r0)->BarrierAsync(slow).Wait();
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_TRUE(absl::StrContains(refused.message(), "--max_ops_in_flight_per_session")) << refused;
  // The refused op took no sequence number: rank 1's eight barriers match rank 0's eight.
  for (int i = 0; i < 8; ++i) EXPECT_TRUE((*r1)->Barrier(slow).ok()) << i;
  for (client::Op& op : parked) EXPECT_TRUE(op.Wait().ok());
  client::Op next0 = (*r0)->BarrierAsync(slow);
  EXPECT_TRUE((*r1)->Barrier(slow).ok());
  EXPECT_TRUE(next0.Wait().ok());
  ExpectServing();
}

INSTANTIATE_TEST_SUITE_P(Transports, OpsInFlightTest, ::testing::Values(false, true),
                         [](const auto& info) { return info.param ? "Doorbell" : "Stream"; });

// Finding 7: one rule for job ids, on sessions as in the store; a refused id cannot forge a
// line of the daemon's log.
TEST_F(UntrustedClientTest, JobIdsTheStoreRefusesAreRefusedEverywhereAndCannotForgeLogLines) {
  Start();
  const std::string forged = "x\n2026-01-01T00:00:00.000000Z I core: FORGED session opened";
  for (const std::string& job : {std::string("a/b"), std::string(".."), std::string("a\0b", 3),
                                 forged, std::string(129, 'a')}) {
    auto session = Trainer(job, 1, 0);
    EXPECT_EQ(session.status().code(), absl::StatusCode::kInvalidArgument)
        << absl::CEscape(job) << ": " << session.status();
    EXPECT_EQ(store_->Set(job, "k", "v").code(), absl::StatusCode::kInvalidArgument)
        << absl::CEscape(job);
    auto inspect = v1::Inspect::NewStub(client::Connect(daemon_->unix_target()));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListSessionsRequest req;
    req.set_job(job);
    v1::ListSessionsResponse resp;
    EXPECT_EQ(FromGrpcStatus(inspect->ListSessions(&ctx, req, &resp)).code(),
              absl::StatusCode::kInvalidArgument);
  }
  ExpectServing();
  const std::string log = ReadFile(log_path());
  EXPECT_TRUE(absl::StrContains(log, "x\\n2026-01-01")) << log;  // logged, escaped
  for (absl::string_view line : absl::StrSplit(log, '\n')) {
    EXPECT_FALSE(absl::StartsWith(line, "2026-01-01T00:00:00.000000Z")) << line;
  }
}

// Finding 8: a wait that times out on 10,000 keys names a few and counts the rest, so the
// status fits in gRPC's trailers and reaches the caller.
TEST_F(UntrustedClientTest, TimeoutOnTenThousandKeysNamesAFewAndCountsTheRest) {
  Start();
  std::vector<std::string> keys;
  for (int i = 0; i < 10000; ++i) keys.push_back(absl::StrCat("missing-key-number-", i));
  const absl::Status s = store_->Wait("j", keys, absl::Now() + absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s.message().substr(0, 300);
  EXPECT_TRUE(absl::StrContains(s.message(), "missing-key-number-0, missing-key-number-1"))
      << s.message().substr(0, 300);
  EXPECT_TRUE(absl::StrContains(s.message(), "and 9992 more")) << s.message().substr(0, 300);
  EXPECT_LT(s.message().size(), 1000u);
  ExpectServing();
}

// Finding 9: reserved keys change only through typed calls.
TEST_F(UntrustedClientTest, GenericCallsCannotChangeReservedKeys) {
  Start();
  auto plan = SamplePlan();
  ASSERT_TRUE(plan.ok());
  ASSERT_TRUE(store_->SetPackList("j", "world", *plan).ok());
  const std::string key = "_gradsync/packlist/world";
  auto deleted = store_->Delete("j", key);
  EXPECT_EQ(deleted.status().code(), absl::StatusCode::kPermissionDenied) << deleted.status();
  EXPECT_TRUE(absl::StrContains(deleted.status().message(), "typed calls")) << deleted.status();
  EXPECT_EQ(store_->Set("j", key, "forged").code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(store_->Add("j", key, 1).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(store_->CompareSet("j", key, std::nullopt, "x").status().code(),
            absl::StatusCode::kPermissionDenied);
  // The plan is there, unchanged, at once.
  auto got = store_->GetPackList("j", "world", absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->SerializeAsString(), plan->SerializeAsString());
  ExpectServing();
}

}  // namespace
}  // namespace gradsync::testing
