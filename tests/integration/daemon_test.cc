// Integration tests: the real gradsyncd binary, real client processes, unix socket and TCP.

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/store_client.h"
#include "common/grpc_status.h"
#include "common/pack_list.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"
#include "tests/integration/sample_plan.h"

namespace gradsync::testing {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

absl::StatusOr<HealthCheckResponse::ServingStatus> Health(const std::string& target,
                                                          const std::string& service) {
  auto stub = grpc::health::v1::Health::NewStub(client::Connect(target));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  HealthCheckRequest req;
  req.set_service(service);
  HealthCheckResponse resp;
  if (absl::Status s = FromGrpcStatus(stub->Check(&ctx, req, &resp)); !s.ok()) return s;
  return resp.status();
}

class DaemonTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // A long grace, so that the drain tests can tell "ended at once" from "waited it out".
    DaemonProcess::Options options;
    options.flags = {"--drain_grace=30s"};
    auto d = DaemonProcess::Start(dir_.path(), options);
    ASSERT_TRUE(d.ok()) << d.status();
    daemon_ = *std::move(d);
    store_ = std::make_unique<client::StoreClient>(client::Connect(daemon_->unix_target()));
  }

  // A store client over TCP, carrying the daemon's cluster token as another daemon would.
  client::StoreClient TcpStore() {
    client::ClientOptions options;
    options.token = daemon_->token();
    return client::StoreClient(client::Connect(daemon_->tcp_target(), options), options);
  }

  void ExpectServing() {
    auto status = Health(daemon_->unix_target(), "");
    ASSERT_TRUE(status.ok()) << status.status();
    EXPECT_EQ(*status, HealthCheckResponse::SERVING);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::unique_ptr<client::StoreClient> store_;
};

TEST_F(DaemonTest, HealthServingOverUnixSocketAndTcp) {
  for (const std::string& target : {daemon_->unix_target(), daemon_->tcp_target()}) {
    for (const std::string service : {"", "gradsync.v1.Store", "gradsync.v1.Inspect"}) {
      auto status = Health(target, service);
      ASSERT_TRUE(status.ok()) << target << " " << service << ": " << status.status();
      EXPECT_EQ(*status, HealthCheckResponse::SERVING) << target << " " << service;
    }
    EXPECT_EQ(Health(target, "no.such.Service").status().code(), absl::StatusCode::kNotFound);
  }
}

TEST_F(DaemonTest, SocketHasMode0660AndTcpIsLoopbackOnly) {
  struct stat st {};
  ASSERT_EQ(::stat(daemon_->socket_path().c_str(), &st), 0);
  EXPECT_TRUE(S_ISSOCK(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0660);
  const std::string status = daemon_->Notifications().back();
  EXPECT_TRUE(absl::StrContains(status, "tcp=127.0.0.1:")) << status;
}

TEST_F(DaemonTest, SigtermDrainsExitsZeroAndKeepsWhatItShould) {
  const std::string sibling = dir_.path() + "/keep-me";
  std::ofstream(sibling) << "operator data";
  // An open session and a wait in flight do not hold the drain for its grace (10 s): the wait
  // fails promptly with UNAVAILABLE, not at its deadline.
  ASSERT_TRUE(store_->Set("j", "open", "a session").ok());
  absl::Notification finished;
  absl::Status wait_status;
  store_->WaitAsync("j", {"never"}, absl::Now() + absl::Seconds(60),
                    [&](absl::StatusOr<std::vector<std::string>> r) {
                      wait_status = r.status();
                      finished.Notify();
                    });
  absl::SleepFor(absl::Milliseconds(100));  // let the wait reach the daemon
  const absl::Time start = absl::Now();
  auto code = daemon_->Stop(SIGTERM);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
  ASSERT_TRUE(finished.WaitForNotificationWithTimeout(absl::Seconds(10)));
  EXPECT_EQ(wait_status.code(), absl::StatusCode::kUnavailable) << wait_status;
  // gRPC's graceful GOAWAY waits up to ~5 s for idle clients to answer its ping; the grace
  // (30 s) is not waited out.
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
  EXPECT_TRUE(daemon_->WaitForNotification("STOPPING=1", absl::Seconds(1)));
  EXPECT_EQ(ReadFile(sibling), "operator data");
  EXPECT_TRUE(std::filesystem::is_directory(dir_.path()));
  EXPECT_FALSE(std::filesystem::exists(daemon_->socket_path()));  // its own socket only
}

TEST_F(DaemonTest, SigintAlsoExitsZero) {
  auto code = daemon_->Stop(SIGINT);
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 0);
}

TEST_F(DaemonTest, SecondDaemonOnTheSameSocketRefusesAndFirstKeepsServing) {
  auto pid = Spawn(
      {DaemonBinary(), "--socket=" + daemon_->socket_path(), "--port=-1", "--log_sink=stderr"});
  ASSERT_TRUE(pid.ok());
  auto code = WaitExit(*pid, absl::Seconds(10));
  ASSERT_TRUE(code.ok()) << code.status();
  EXPECT_EQ(*code, 1);
  ExpectServing();
}

TEST_F(DaemonTest, SixteenClientProcessesTimesThousandAddsGiveTheExactTotal) {
  std::vector<pid_t> pids;
  for (int i = 0; i < 16; ++i) {
    auto pid = Spawn(
        {HelperBinary("store_worker"), daemon_->unix_target(), "count", "add", "counter", "1000"});
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
  }
  for (pid_t pid : pids) {
    auto code = WaitExit(pid, absl::Seconds(120));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
  }
  auto total = store_->Get("count", "counter", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(total.ok()) << total.status();
  EXPECT_EQ(*total, "16000");
}

TEST_F(DaemonTest, GetOfMissingKeyFailsFastNamesTheKeyAndTheClientKeepsWorking) {
  const absl::Time start = absl::Now();
  auto value = store_->Get("j", "not/there", start + absl::Milliseconds(200));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(value.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(value.status().message(), "not/there")) << value.status();
  EXPECT_FALSE(absl::StrContains(value.status().message(), "client deadline")) << value.status();
  EXPECT_LT(took, absl::Seconds(2));
  ASSERT_TRUE(store_->Set("j", "there", "v").ok());
  auto got = store_->Get("j", "there", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(*got, "v");
}

TEST_F(DaemonTest, StoreOperationsOverTcpMatchTheUnixSocket) {
  client::StoreClient tcp = TcpStore();
  ASSERT_TRUE(tcp.Set("j", "k", "from-tcp").ok());
  auto got = store_->Get("j", "k", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, "from-tcp");
  auto cas = tcp.CompareSet("j", "k", std::string("from-tcp"), "swapped");
  ASSERT_TRUE(cas.ok());
  EXPECT_TRUE(cas->swapped);
  EXPECT_EQ(cas->value, "swapped");
  auto miss = tcp.CompareSet("j", "k", std::string("stale"), "nope");
  ASSERT_TRUE(miss.ok());
  EXPECT_FALSE(miss->swapped);
  EXPECT_EQ(miss->value, "swapped");
  auto keys = tcp.List("j", "");
  ASSERT_TRUE(keys.ok());
  EXPECT_EQ(*keys, std::vector<std::string>{"k"});
  auto deleted = tcp.Delete("j", "k");
  ASSERT_TRUE(deleted.ok());
  EXPECT_TRUE(*deleted);
  auto waited = store_->Wait("j", {"k"}, absl::Now() + absl::Milliseconds(100));
  EXPECT_EQ(waited.code(), absl::StatusCode::kDeadlineExceeded);
}

TEST_F(DaemonTest, WaitReturnsOnceEveryKeyIsSetByAnotherProcess) {
  absl::Notification done;
  absl::StatusOr<std::vector<std::string>> result;
  store_->WaitAsync("w", {"a", "b"}, absl::Now() + absl::Seconds(30),
                    [&](absl::StatusOr<std::vector<std::string>> r) {
                      result = std::move(r);
                      done.Notify();
                    });
  client::StoreClient other = TcpStore();
  ASSERT_TRUE(other.Set("w", "b", "B").ok());
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_FALSE(done.HasBeenNotified());
  ASSERT_TRUE(other.Set("w", "a", "A").ok());
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
  ASSERT_TRUE(result.ok()) << result.status();
  EXPECT_EQ(*result, (std::vector<std::string>{"A", "B"}));
}

TEST_F(DaemonTest, PackListSetByOneProcessIsFetchedByThreeOthersAndInspectable) {
  auto expected = SamplePlan();
  ASSERT_TRUE(expected.ok());
  std::string expected_text;
  google::protobuf::TextFormat::PrintToString(*expected, &expected_text);
  // The three readers start first and wait for rank 0.
  std::vector<pid_t> readers;
  for (int i = 0; i < 3; ++i) {
    auto pid = Spawn({HelperBinary("store_worker"), daemon_->unix_target(), "job1", "getpacklist",
                      "0,1,2,3", "20000"},
                     {}, absl::StrCat(dir_.path(), "/reader", i));
    ASSERT_TRUE(pid.ok());
    readers.push_back(*pid);
  }
  absl::SleepFor(absl::Milliseconds(200));
  auto writer =
      Spawn({HelperBinary("store_worker"), daemon_->tcp_target(), "job1", "setpacklist", "0,1,2,3"},
            {"GRADSYNC_TOKEN_FILE=" + daemon_->token_file()});
  ASSERT_TRUE(writer.ok());
  auto wcode = WaitExit(*writer, absl::Seconds(20));
  ASSERT_TRUE(wcode.ok());
  EXPECT_EQ(*wcode, 0);
  for (int i = 0; i < 3; ++i) {
    auto code = WaitExit(readers[i], absl::Seconds(30));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0);
    EXPECT_EQ(ReadFile(absl::StrCat(dir_.path(), "/reader", i)), expected_text);
  }
  EXPECT_GT(expected->packs_size(), 2);

  // What grpcurl shows: Inspect/GetPackList as proto3 JSON.
  auto inspect = v1::Inspect::NewStub(client::Connect(daemon_->unix_target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::InspectPackListRequest req;
  req.set_job("job1");
  req.set_group("0,1,2,3");
  v1::InspectPackListResponse resp;
  ASSERT_TRUE(inspect->GetPackList(&ctx, req, &resp).ok());
  std::string got_text;
  google::protobuf::TextFormat::PrintToString(resp.pack_list(), &got_text);
  EXPECT_EQ(got_text, expected_text);
  int64_t total = 0;
  for (const auto& p : expected->packs()) total += p.bytes();
  EXPECT_EQ(resp.total_bytes(), total);
  std::string json;
  ASSERT_TRUE(google::protobuf::util::MessageToJsonString(resp, &json).ok());
  EXPECT_TRUE(absl::StrContains(json, "\"group\":\"0,1,2,3\"")) << json;
  EXPECT_TRUE(absl::StrContains(json, "\"dtype\":\"FLOAT32\"")) << json;

  // gradsyncctl prints the same plan as a table.
  const std::string out = dir_.path() + "/ctl";
  auto ctl = Spawn({HelperBinary("../client/gradsyncctl"), "--socket=" + daemon_->socket_path(),
                    "--job=job1", "packlist", "show", "0,1,2,3"},
                   {}, out);
  ASSERT_TRUE(ctl.ok());
  auto ccode = WaitExit(*ctl, absl::Seconds(10));
  ASSERT_TRUE(ccode.ok());
  EXPECT_EQ(*ccode, 0);
  const std::string table = ReadFile(out);
  EXPECT_TRUE(absl::StrContains(table, absl::StrCat("packs=", expected->packs_size()))) << table;
  const v1::Pack& first = expected->packs(0);
  EXPECT_TRUE(absl::StrContains(table, absl::StrCat("float32         1"))) << table;
  EXPECT_TRUE(absl::StrContains(table, absl::StrCat(first.indices(0)))) << table;
}

// ---- bad input: a clear status, nothing changed, the daemon keeps serving ----

TEST_F(DaemonTest, OversizedValuesAreRefusedWithTheLimitNamed) {
  const std::string big(2 << 20, 'x');  // over --store_max_value_bytes (1 MiB)
  absl::Status s = store_->Set("j", "big", big);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(s.message(), "store_max_value_bytes")) << s;
  const std::string huge(20 << 20, 'x');  // over the 16 MiB message limit
  EXPECT_EQ(store_->Set("j", "huge", huge).code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(store_->List("j", "").status().code(), absl::StatusCode::kNotFound);  // nothing stored
  ExpectServing();
}

TEST_F(DaemonTest, EmptyKeyAndBadJobAreInvalidArgumentAndReservedKeysPermissionDenied) {
  EXPECT_EQ(store_->Set("j", "", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Set("", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->Set("bad job!", "k", "v").code(), absl::StatusCode::kInvalidArgument);
  absl::Status reserved = store_->Set("j", "_gradsync/packlist/0,1", "forged");
  EXPECT_EQ(reserved.code(), absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE(absl::StrContains(reserved.message(), "SetPackList")) << reserved;
  EXPECT_EQ(store_->Add("j", "_gradsync/x", 1).status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(store_->Get("j", "", absl::Now() + absl::Seconds(1)).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(store_->List("j", "").status().code(), absl::StatusCode::kNotFound);
  ExpectServing();
}

TEST_F(DaemonTest, UnknownJobIsNotFoundForReadsAndInspection) {
  EXPECT_EQ(store_->List("nobody", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(store_->Delete("nobody", "k").status().code(), absl::StatusCode::kNotFound);
  auto inspect = v1::Inspect::NewStub(client::Connect(daemon_->unix_target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  v1::InspectPackListRequest req;
  req.set_job("nobody");
  req.set_group("0,1");
  v1::InspectPackListResponse resp;
  grpc::Status s = inspect->GetPackList(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(absl::StrContains(s.error_message(), "job=nobody")) << s.error_message();
}

TEST_F(DaemonTest, WaitingCallWithoutADeadlineIsInvalidArgument) {
  auto stub = v1::Store::NewStub(client::Connect(daemon_->unix_target()));
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;  // no deadline
    grpc::Status s;
    if (i == 0) {
      v1::GetRequest req;
      req.set_job("j");
      req.set_key("k");
      v1::GetResponse resp;
      s = stub->Get(&ctx, req, &resp);
    } else {
      v1::GetPackListRequest req;
      req.set_job("j");
      req.set_group("0,1");
      v1::GetPackListResponse resp;
      s = stub->GetPackList(&ctx, req, &resp);
    }
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(s.error_message(), "deadline")) << s.error_message();
  }
}

TEST_F(DaemonTest, JoinsWithoutRoomForTheirWaitOrWithBadRanksAreRefusedAndTakeNoTicket) {
  auto stub = v1::Store::NewStub(client::Connect(daemon_->unix_target()));
  struct Case {
    int ranks;
    int64_t wait_ms;
    absl::Duration deadline;  // zero: none
    const char* says;
  };
  for (const Case& c :
       {Case{1, 1000, absl::ZeroDuration(), "deadline"}, Case{1, 0, absl::Seconds(20), "wait_ms=0"},
        Case{1, -5, absl::Seconds(20), "wait_ms=-5"}, Case{1, 5000, absl::Seconds(6), "past it"},
        Case{0, 100, absl::Seconds(20), "ranks=0"},
        Case{1025, 100, absl::Seconds(20), "ranks=1025"}}) {
    grpc::ClientContext ctx;
    if (c.deadline > absl::ZeroDuration()) {
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + c.deadline));
    }
    v1::JoinRequest req;
    req.set_job("joiners");
    req.set_ranks(c.ranks);
    req.set_wait_ms(c.wait_ms);
    v1::JoinResponse resp;
    const grpc::Status s = stub->Join(&ctx, req, &resp);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.says;
    EXPECT_TRUE(absl::StrContains(s.error_message(), c.says)) << s.error_message();
  }
  // None took a ticket: the job's home holds no key.
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::ListRequest list;
  list.set_job("joiners");
  v1::ListResponse keys;
  const grpc::Status s = stub->List(&ctx, list, &keys);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
}

TEST_F(DaemonTest, BadPackListsAndGroupKeysAreRefusedAndNothingIsStored) {
  auto plan = SamplePlan();
  ASSERT_TRUE(plan.ok());
  v1::PackList wrong_bytes = *plan;
  wrong_bytes.mutable_packs(0)->set_bytes(1);
  absl::Status s = store_->SetPackList("j", "0,1", wrong_bytes);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "add up to")) << s;
  v1::PackList repeated = *plan;
  repeated.mutable_packs(1)->set_indices(0, plan->packs(0).indices(0));
  EXPECT_EQ(store_->SetPackList("j", "0,1", repeated).code(), absl::StatusCode::kInvalidArgument);
  for (const std::string group : {"", "1,0", "0,,1", "a,b", "-1"}) {
    EXPECT_EQ(store_->SetPackList("j", group, *plan).code(), absl::StatusCode::kInvalidArgument)
        << "group '" << group << "'";
  }
  EXPECT_EQ(store_->List("j", "").status().code(), absl::StatusCode::kNotFound);
  ASSERT_TRUE(store_->SetPackList("j", "world", *plan).ok());
  auto back = store_->GetPackList("j", "world", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->SerializeAsString(), plan->SerializeAsString());
}

TEST_F(DaemonTest, GarbageBytesOnTheSocketLeaveTheDaemonServing) {
  for (int round = 0; round < 3; ++round) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, daemon_->socket_path().c_str(), sizeof(addr.sun_path) - 1);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    std::string garbage(4096, '\0');
    for (size_t i = 0; i < garbage.size(); ++i)
      garbage[i] = static_cast<char>((i * 131 + round) & 0xff);
    if (round == 1)
      garbage = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + garbage;  // valid preface, junk frames
    (void)!::write(fd, garbage.data(), garbage.size());
    ::close(fd);
  }
  ExpectServing();
  ASSERT_TRUE(store_->Set("j", "after", "ok").ok());
}

TEST(DaemonFlagsTest, BadFlagsExitTwoWithAMessage) {
  TempDir dir;
  for (const std::string flag :
       {"--port=70000", "--socket=relative.sock", "--socket_mode=999", "--log_level=loud",
        "--store_max_value_bytes=999999999", "--nccl_keep=-1s", "--cpu_all_to_all_max_nodes=0"}) {
    const std::string err = dir.path() + "/err";
    auto pid = Spawn({DaemonBinary(), "--socket=" + dir.path() + "/s.sock", flag}, {}, err);
    ASSERT_TRUE(pid.ok());
    auto code = WaitExit(*pid, absl::Seconds(10));
    ASSERT_TRUE(code.ok()) << flag;
    EXPECT_EQ(*code, 2) << flag;
  }
}

TEST(DaemonFlagsTest, VersionNamesTheBuild) {
  TempDir dir;
  const std::string out = dir.path() + "/out";
  auto pid = Spawn({DaemonBinary(), "--version"}, {}, out);
  ASSERT_TRUE(pid.ok());
  auto code = WaitExit(*pid, absl::Seconds(10));
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE(absl::StartsWith(ReadFile(out), "gradsync 0.")) << ReadFile(out);
}

TEST(DaemonLifecycleTest, NotifiesSystemdAndPingsTheWatchdog) {
  TempDir dir;
  DaemonProcess::Options options;
  options.watchdog = absl::Milliseconds(200);  // pings every 100 ms
  auto d = DaemonProcess::Start(dir.path(), options);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string ready = (*d)->Notifications().front();
  EXPECT_TRUE(absl::StrContains(ready, "READY=1")) << ready;
  EXPECT_TRUE(absl::StrContains(ready, "STATUS=serving unix=")) << ready;
  EXPECT_TRUE((*d)->WaitForNotification("WATCHDOG=1", absl::Seconds(5)));
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_GE((*d)->CountNotifications("WATCHDOG=1"), 3);
  auto code = (*d)->Stop(SIGTERM);
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  EXPECT_TRUE((*d)->WaitForNotification("STOPPING=1", absl::Seconds(1)));
  EXPECT_EQ((*d)->CountNotifications("STATUS=draining"), 1);
}

TEST(DaemonLifecycleTest, NoTcpListenerWhenPortIsMinusOne) {
  TempDir dir;
  DaemonProcess::Options options;
  options.tcp = false;
  auto d = DaemonProcess::Start(dir.path(), options);
  ASSERT_TRUE(d.ok()) << d.status();
  const std::string ready = (*d)->Notifications().front();
  EXPECT_FALSE(absl::StrContains(ready, "tcp=")) << ready;
  auto status = Health((*d)->unix_target(), "");
  ASSERT_TRUE(status.ok());
  EXPECT_EQ(*status, HealthCheckResponse::SERVING);
}

}  // namespace
}  // namespace gradsync::testing

namespace gradsync::testing {
namespace {

TEST(DaemonRestartTest, ClientSeesUnavailableThenWorksWithTheRestartedDaemon) {
  TempDir dir;
  auto first = DaemonProcess::Start(dir.path());
  ASSERT_TRUE(first.ok()) << first.status();
  client::ClientOptions options;
  options.rpc_timeout = absl::Seconds(3);
  client::StoreClient store(client::Connect((*first)->unix_target()), options);
  ASSERT_TRUE(store.Set("j", "k", "1").ok());  // opens the session
  auto killed = (*first)->Stop(SIGKILL);
  ASSERT_TRUE(killed.ok());
  const absl::Time start = absl::Now();
  absl::Status down = store.Set("j", "k", "2");
  EXPECT_EQ(down.code(), absl::StatusCode::kUnavailable) << down;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  first->reset();

  auto second = DaemonProcess::Start(dir.path());  // same socket path: the stale file is replaced
  ASSERT_TRUE(second.ok()) << second.status();
  absl::Status up;
  for (int i = 0; i < 50; ++i) {  // reconnection backoff is gRPC's; bounded here
    up = store.Set("j", "k", "3");
    if (up.ok()) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_TRUE(up.ok()) << up;
  auto value = store.Get("j", "k", absl::Now() + absl::Seconds(5));
  ASSERT_TRUE(value.ok()) << value.status();
  EXPECT_EQ(*value, "3");
}

TEST(DaemonRestartTest, ConcurrentCallersShareOneClientCorrectly) {
  TempDir dir;
  auto d = DaemonProcess::Start(dir.path());
  ASSERT_TRUE(d.ok()) << d.status();
  client::StoreClient store(client::Connect((*d)->unix_target()));
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        if (!store.Add("j", "n", 1).ok()) ++failures;
        auto v = store.Get("j", absl::StrCat("own/", t), absl::Now() + absl::Seconds(5));
        if (i > 0 && (!v.ok() || *v != absl::StrCat(i - 1))) ++failures;
        if (!store.Set("j", absl::StrCat("own/", t), absl::StrCat(i)).ok()) ++failures;
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(*store.Get("j", "n", absl::Now() + absl::Seconds(5)), "1600");
}

}  // namespace
}  // namespace gradsync::testing

namespace gradsync::testing {
namespace {

TEST(DaemonDrainTest, HealthWatchersSeeNotServingWhenTheDaemonDrains) {
  TempDir dir;
  DaemonProcess::Options options;
  options.flags = {"--drain_grace=30s"};
  auto d = DaemonProcess::Start(dir.path(), options);
  ASSERT_TRUE(d.ok()) << d.status();
  auto stub = grpc::health::v1::Health::NewStub(client::Connect((*d)->unix_target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
  HealthCheckRequest req;
  req.set_service("gradsync.v1.Store");
  auto watch = stub->Watch(&ctx, req);
  HealthCheckResponse resp;
  ASSERT_TRUE(watch->Read(&resp));
  EXPECT_EQ(resp.status(), HealthCheckResponse::SERVING);
  ::kill((*d)->pid(), SIGTERM);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(watch->Read(&resp));
  EXPECT_EQ(resp.status(), HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(watch->Read(&resp));  // then the daemon ends the stream
  EXPECT_TRUE(watch->Finish().ok());
  auto code = (*d)->Stop(SIGTERM);  // already signalled; waits for the exit
  ASSERT_TRUE(code.ok());
  EXPECT_EQ(*code, 0);
  // An open Watch does not hold the drain for its grace period (30 s); gRPC's graceful GOAWAY
  // may take up to ~5 s when the client is idle.
  EXPECT_LT(absl::Now() - start, absl::Seconds(8));
}

}  // namespace
}  // namespace gradsync::testing
