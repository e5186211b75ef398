// Who may connect where: the cluster token on the TCP listener (calls without it, or with a
// wrong one, are UNAUTHENTICATED and change nothing; the unix socket, health and the right token
// pass), TCP never without a token, and trainer sessions on the unix socket only.

#include <sys/stat.h>

#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "client/gradsync_client.h"
#include "client/store_client.h"
#include "common/grpc_status.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

std::string WriteToken(const std::string& dir, const std::string& name, const std::string& text,
                       mode_t mode) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  ::chmod(path.c_str(), mode);
  return path;
}

class AuthTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcess::Options options;
    options.flags = {"--token_file=" + WriteToken(dir_.path(), "token", "s3cret\n", 0600)};
    auto daemon = DaemonProcess::Start(dir_.path(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
  }

  client::StoreClient Store(const std::string& target, const std::string& token) {
    client::ClientOptions options;
    options.token = token;
    options.rpc_timeout = absl::Seconds(5);
    return client::StoreClient(client::Connect(target, options), options);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(AuthTest, TcpCallsWithoutTheRightTokenAreRefusedAndChangeNothing) {
  for (const std::string token : {"", "wrong", "s3cre", "s3cret!"}) {
    client::StoreClient store = Store(daemon_->tcp_target(), token);
    absl::Status s = store.Set("j", "k", "v");
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << "token '" << token << "': " << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "cluster token")) << s;
    EXPECT_EQ(store.Add("j", "n", 1).status().code(), absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(store.Get("j", "k", absl::Now() + absl::Seconds(2)).status().code(),
              absl::StatusCode::kUnauthenticated);
    EXPECT_EQ(store.List("j", "").status().code(), absl::StatusCode::kUnauthenticated);
  }
  // Nothing was written: the unix socket (trusted) sees an empty job.
  client::StoreClient local = Store(daemon_->unix_target(), "");
  EXPECT_EQ(local.List("j", "").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(AuthTest, RightTokenUnixSocketAndHealthPass) {
  client::StoreClient remote = Store(daemon_->tcp_target(), "s3cret");
  ASSERT_TRUE(remote.Set("j", "k", "v").ok());
  auto n = remote.Add("j", "n", 5);
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, 5);
  client::StoreClient local = Store(daemon_->unix_target(), "");
  auto v = local.Get("j", "k", absl::Now() + absl::Seconds(2));
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(*v, "v");
  // Health stays open over TCP (monitoring needs no secret; it reveals no job data).
  auto channel = client::Connect(daemon_->tcp_target());
  auto health = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST_F(AuthTest, InspectOverTcpNeedsTheTokenAndTrainerSessionsTheUnixSocket) {
  auto inspect = v1::Inspect::NewStub(client::Connect(daemon_->tcp_target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ListJobsResponse jobs;
  EXPECT_EQ(FromGrpcStatus(inspect->ListJobs(&ctx, v1::ListJobsRequest(), &jobs)).code(),
            absl::StatusCode::kUnauthenticated);

  client::Placement one{"a", 1, 0, 0, 1, ""};
  client::ClientOptions options;
  options.doorbell = false;
  // Over TCP a trainer session is refused, with the cluster token or without: it would map the
  // caller's memory, which only a process on this node may hand over (through the socket,
  // whose mode and group say who).
  for (const std::string token : {"", "s3cret"}) {
    options.token = token;
    auto refused = client::Client::Connect(daemon_->tcp_target(), one, options);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kPermissionDenied) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "unix socket only"))
        << refused.status();
  }
  // Nothing was registered: no session exists, so the same rank can register right away.
  auto sessions = v1::Inspect::NewStub(client::Connect(daemon_->unix_target()));
  grpc::ClientContext ctx2;
  ctx2.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::ListSessionsResponse listed;
  ASSERT_TRUE(sessions->ListSessions(&ctx2, v1::ListSessionsRequest(), &listed).ok());
  EXPECT_EQ(listed.sessions_size(), 0);
  options.token = "";
  auto accepted = client::Client::Connect(daemon_->unix_target(), one, options);
  ASSERT_TRUE(accepted.ok()) << accepted.status();
  EXPECT_TRUE((*accepted)->Barrier().ok());
}

TEST(AuthFlagsTest, DaemonRefusesATokenFileOthersCanReadOrAnEmptyOne) {
  TempDir dir;
  for (const auto& [name, text, mode] :
       {std::tuple<std::string, std::string, mode_t>{"open", "tok", 0644},
        {"empty", "\n", 0600},
        {"missing", "", 0}}) {
    std::string path = dir.path() + "/" + name;
    if (mode != 0) path = WriteToken(dir.path(), name, text, mode);
    const std::string err = dir.path() + "/err-" + name;
    auto pid = Spawn(
        {DaemonBinary(), "--socket=" + dir.path() + "/s.sock", "--port=0", "--token_file=" + path},
        {}, err);
    ASSERT_TRUE(pid.ok());
    auto code = WaitExit(*pid, absl::Seconds(10));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 2) << name;
  }
}

TEST(AuthFlagsTest, DaemonRefusesToListenOnTcpWithoutATokenFile) {
  TempDir dir;
  const std::string err = dir.path() + "/err";
  auto pid =
      Spawn({"/bin/sh", "-c", DaemonBinary() + " --socket=" + dir.path() + "/s.sock --port=0 2>&1"},
            {}, err);
  ASSERT_TRUE(pid.ok());
  auto code = WaitExit(*pid, absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 2);
  EXPECT_TRUE(absl::StrContains(ReadFile(err), "set --token_file")) << ReadFile(err);
  // The unix socket alone needs no token (TCP is off by default).
  DaemonProcess::Options options;
  options.tcp = false;
  auto daemon = DaemonProcess::Start(dir.path(), options);
  ASSERT_TRUE(daemon.ok()) << daemon.status();
  EXPECT_EQ((*daemon)->tcp_port(), -1);
}

}  // namespace
}  // namespace gradsync::testing
