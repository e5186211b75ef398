// Daemons whose jobs' stores live in etcd (--store=etcd): real gradsyncd processes on loopback
// and a real etcd (one member, or three) started by the test. A job across three daemons forms
// with no root daemon, its pack plans and keys are seen through every daemon (Inspect
// included), and its keys are gone from etcd once it ended; an etcd member killed mid-job goes
// unnoticed by the trainers; with etcd unreachable, jobs that need the store fail quickly
// naming it and the daemon keeps serving the others. Skipped where etcd-server is missing.

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/store_client.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/etcd_cluster.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

class EtcdJobTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = EtcdCluster::Unavailable(); !why.empty()) GTEST_SKIP() << why;
  }

  void StartEtcd(int members) {
    auto cluster = EtcdCluster::Start(members);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    etcd_ = *std::move(cluster);
  }

  // n daemons on `endpoints` (default: the test's cluster); daemon i lists the members from
  // member i on, so the daemons talk to different members.
  void StartDaemons(int n, std::vector<std::string> flags = {},
                    std::vector<std::string> endpoints = {}) {
    if (endpoints.empty()) endpoints = etcd_->endpoints();
    const std::string prefix = absl::StrCat("/gradsync-it/", ::getpid(), "/");
    for (int i = 0; i < n; ++i) {
      std::vector<std::string> mine = endpoints;
      std::rotate(mine.begin(), mine.begin() + i % mine.size(), mine.end());
      dirs_.push_back(std::make_unique<TempDir>());
      DaemonProcess::Options options;
      options.flags = {"--store=etcd", "--etcd_endpoints=" + absl::StrJoin(mine, ","),
                       "--etcd_prefix=" + prefix};
      options.flags.insert(options.flags.end(), flags.begin(), flags.end());
      auto daemon = DaemonProcess::Start(dirs_.back()->path(), options);
      ASSERT_TRUE(daemon.ok()) << daemon.status();
      daemons_.push_back(*std::move(daemon));
    }
  }

  // One collective_worker per rank on daemon node_of[r]; no root address: on etcd a job needs
  // none.
  std::vector<pid_t> Start(const std::string& job, const std::vector<int>& node_of,
                           const std::vector<std::string>& scenarios,
                           const std::vector<std::string>& args = {}) {
    const int world = static_cast<int>(node_of.size());
    std::vector<pid_t> pids;
    for (int r = 0; r < world; ++r) {
      int local_world = 0;
      for (int n : node_of) local_world += n == node_of[r];
      std::vector<std::string> argv = {HelperBinary("collective_worker"),
                                       daemons_[node_of[r]]->unix_target(),
                                       job,
                                       std::to_string(world),
                                       std::to_string(r),
                                       scenarios[r],
                                       "local_world_size=" + std::to_string(local_world)};
      argv.insert(argv.end(), args.begin(), args.end());
      auto pid = Spawn(argv, {}, OutPath(r));
      EXPECT_TRUE(pid.ok()) << pid.status();
      pids.push_back(pid.ok() ? *pid : -1);
    }
    return pids;
  }

  std::string OutPath(int rank) const { return absl::StrCat(dirs_[0]->path(), "/out.", rank); }

  std::vector<int> Wait(const std::vector<pid_t>& pids) {
    const std::vector<int> codes = WaitAll(pids, absl::Seconds(120));
    out_.assign(pids.size(), "");
    for (size_t r = 0; r < pids.size(); ++r) out_[r] = ReadFile(OutPath(static_cast<int>(r)));
    return codes;
  }

  std::vector<int> Run(const std::string& job, const std::vector<int>& node_of,
                       const std::string& scenario, const std::vector<std::string>& args = {}) {
    return Wait(Start(job, node_of, std::vector<std::string>(node_of.size(), scenario), args));
  }

  void ExpectAllPassed(const std::vector<int>& codes, const std::string& needle) {
    for (size_t r = 0; r < codes.size(); ++r) {
      EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << out_[r];
      EXPECT_TRUE(absl::StrContains(out_[r], needle)) << "rank " << r << ": " << out_[r];
    }
  }

  std::unique_ptr<v1::Inspect::Stub> Inspect(int daemon) {
    return v1::Inspect::NewStub(client::Connect(daemons_[daemon]->unix_target()));
  }

  // What daemon `d` warns operators of (Inspect/ListSessions).
  std::vector<std::string> Warnings(int d) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::ListSessionsResponse resp;
    grpc::Status s = Inspect(d)->ListSessions(&ctx, v1::ListSessionsRequest(), &resp);
    EXPECT_TRUE(s.ok()) << s.error_message();
    return {resp.warnings().begin(), resp.warnings().end()};
  }

  // The jobs daemon `d` sees in the store (Inspect/ListJobs), or the call's error.
  absl::StatusOr<std::vector<std::string>> Jobs(int d) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::ListJobsResponse resp;
    grpc::Status s = Inspect(d)->ListJobs(&ctx, v1::ListJobsRequest(), &resp);
    if (!s.ok())
      return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
    std::vector<std::string> jobs;
    for (const auto& j : resp.jobs()) jobs.push_back(j.job());
    return jobs;
  }

  // Waits (bounded) until daemon `d` sees no job in the store.
  void ExpectNoJobsLeft(int d, absl::Duration within) {
    absl::StatusOr<std::vector<std::string>> jobs;
    for (const absl::Time until = absl::Now() + within; absl::Now() < until;) {
      jobs = Jobs(d);
      if (jobs.ok() && jobs->empty()) return;
      absl::SleepFor(absl::Milliseconds(100));
    }
    ADD_FAILURE() << "jobs still in etcd after " << within << ": "
                  << (jobs.ok() ? absl::StrJoin(*jobs, ",") : jobs.status().ToString());
  }

  // Runs store_worker against daemon `d`; its exit code, its stdout in `*out`, stderr in `*err`.
  int StoreWorker(int d, const std::vector<std::string>& args, std::string* out, std::string* err) {
    std::vector<std::string> argv = {HelperBinary("store_worker"), daemons_[d]->unix_target()};
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string out_path = dirs_[d]->path() + "/store.out";
    const std::string err_path = dirs_[d]->path() + "/store.err";
    auto pid = Spawn(argv, {}, out_path, err_path);
    if (!pid.ok()) return -1;
    auto code = WaitExit(*pid, absl::Seconds(60));
    *out = ReadFile(out_path);
    *err = ReadFile(err_path);
    return code.ok() ? *code : -1;
  }

  std::unique_ptr<EtcdCluster> etcd_;
  std::vector<std::unique_ptr<TempDir>> dirs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::string> out_;
};

// A job across three daemons on one etcd member: it forms with no root daemon and every op
// crosses nodes; a pack plan stored through one daemon is fetched through another and shown by
// a third's Inspect; while a job runs every daemon's Inspect sees its formation keys; and once
// its trainers are gone (killed) no key of it is left in etcd.
TEST_F(EtcdJobTest, AJobAcrossThreeDaemonsFormsWithNoRootAndLeavesNoKeys) {
  StartEtcd(1);
  StartDaemons(3, {"--etcd_lease_ttl=2s"});
  ExpectAllPassed(Run("e3", {0, 0, 1, 2}, "matrix", {"counts=3,4099,70001"}), "matrix cases=");
  ExpectAllPassed(Run("e3f", {0, 0, 1, 2}, "fused"), "wrong=0");
  // The same job id again, at once: a new run, whatever the last one left.
  ExpectAllPassed(Run("e3", {0, 0, 1, 2}, "matrix", {"counts=3,70001"}), "matrix cases=");
  ExpectAllPassed(Run("e3", {0, 0, 1, 2}, "matrix", {"counts=3,70001"}), "matrix cases=");

  std::string out, err;
  ASSERT_EQ(StoreWorker(0, {"plans", "setpacklist", "0,1"}, &out, &err), 0) << err;
  ASSERT_EQ(StoreWorker(2, {"plans", "getpacklist", "0,1", "5000"}, &out, &err), 0) << err;
  EXPECT_TRUE(absl::StrContains(out, "packs")) << out;
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    v1::InspectPackListRequest req;
    req.set_job("plans");
    req.set_group("0,1");
    v1::InspectPackListResponse resp;
    grpc::Status s = Inspect(1)->GetPackList(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_GT(resp.pack_list().packs_size(), 0);
  }

  // Ranks idle after a barrier; meanwhile daemon 2 lists the keys the others published.
  const std::vector<pid_t> pids = Start("live", {0, 0, 1, 2}, std::vector<std::string>(4, "idle"));
  for (const absl::Time until = absl::Now() + absl::Seconds(60); absl::Now() < until;) {
    int idle = 0;
    for (int r = 0; r < 4; ++r) idle += absl::StrContains(ReadFile(OutPath(r)), "idle ok");
    if (idle == 4) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  v1::ListKeysRequest req;
  req.set_job("live");
  req.set_prefix("daemon/rank/");
  v1::ListKeysResponse keys;
  grpc::Status listed = Inspect(2)->ListKeys(&ctx, req, &keys);
  ASSERT_TRUE(listed.ok()) << listed.error_message();
  std::vector<std::string> names;
  for (const auto& k : keys.keys()) names.push_back(k.key());
  EXPECT_EQ(names, (std::vector<std::string>{"daemon/rank/0", "daemon/rank/1", "daemon/rank/2",
                                             "daemon/rank/3"}));
  for (pid_t pid : pids) ::kill(pid, SIGKILL);
  WaitAll(pids, absl::Seconds(20));
  // The "plans" job's keys were written through daemon 0 for a job no trainer registered, so
  // daemon 0 holds it while it lives. Killed, it leaves them to its lease's expiry (2 s).
  ASSERT_TRUE(daemons_[0]->Stop(SIGKILL).ok());
  ExpectNoJobsLeft(1, absl::Seconds(15));
}

// Three etcd members; one is killed while a job across three daemons forms and runs (daemon 0
// talks to it): the trainers notice nothing, and a new job forms through the survivors.
TEST_F(EtcdJobTest, AnEtcdMemberKilledMidJobIsNotNoticedByTheTrainers) {
  StartEtcd(3);
  StartDaemons(3, {"--etcd_lease_ttl=2s"});
  const std::vector<pid_t> pids = Start("mk", {0, 0, 1, 2}, std::vector<std::string>(4, "matrix"),
                                        {"counts=3,4099,70001,1000003"});
  absl::SleepFor(absl::Milliseconds(300));
  etcd_->Kill(0);
  ExpectAllPassed(Wait(pids), "matrix cases=");
  ExpectAllPassed(Run("mk2", {0, 1, 2, 2}, "queued"), "queued ok=68 of 69");
  ExpectNoJobsLeft(0, absl::Seconds(15));
}

// No etcd answers (nothing listens at the endpoint): the daemons start and stay SERVING; a job
// spanning them fails its first op UNAVAILABLE naming etcd, quickly; a trainer's store call
// fails the same way; a job within one daemon runs as usual.
TEST_F(EtcdJobTest, UnreachableEtcdFailsWhatNeedsItNamingItAndTheDaemonServesTheRest) {
  StartDaemons(2, {"--etcd_timeout=1s"}, {"127.0.0.1:1"});
  ExpectAllPassed(Run("down", {0, 0, 1, 1}, "storedown", {"needle=etcd 127.0.0.1:1"}),
                  "storedown ok");
  std::string out, err;
  EXPECT_EQ(StoreWorker(0, {"kv", "add", "k", "1"}, &out, &err), 1) << out;
  EXPECT_TRUE(absl::StrContains(err, "UNAVAILABLE")) << err;
  EXPECT_TRUE(absl::StrContains(err, "etcd 127.0.0.1:1")) << err;
  ExpectAllPassed(Run("local", {0, 0}, "desync"), "desync ok");
  auto health = grpc::health::v1::Health::NewStub(client::Connect(daemons_[0]->unix_target()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  grpc::health::v1::HealthCheckResponse resp;
  ASSERT_TRUE(health->Check(&ctx, grpc::health::v1::HealthCheckRequest(), &resp).ok());
  EXPECT_EQ(resp.status(), grpc::health::v1::HealthCheckResponse::SERVING);
}

// Runs `script` with /bin/sh in `dir`, its output to `dir`/`log`; the exit code (-1 on timeout).
int Shell(const std::string& dir, const std::string& script, const std::string& log) {
  const std::string out = dir + "/" + log;
  auto pid = Spawn({"/bin/sh", "-c", absl::StrCat("cd '", dir, "' && ", script)}, {}, out, out);
  if (!pid.ok()) return -1;
  return WaitAll({*pid}, absl::Seconds(60))[0];
}

// etcd as a production cluster runs it: TLS with client certificates, and etcd's own users.
// Daemons with the CA, a certificate and the user's password carry a job across them; a wrong
// password, or no client certificate, fail the store's calls naming etcd and the cause.
TEST_F(EtcdJobTest, TlsAndEtcdUsersCarryAJobAndAWrongPasswordOrNoCertificateIsNamed) {
  TempDir pki;
  const std::string p = pki.path() + "/";
  if (Shell(pki.path(), "command -v openssl && command -v etcdctl", "which.log") != 0) {
    GTEST_SKIP() << "openssl (test certificates) or etcdctl (etcd-client) is not installed";
  }
  ASSERT_EQ(
      Shell(pki.path(), "bash " GRADSYNC_SOURCE_DIR "/tests/make_test_certs.sh", "openssl.log"), 0)
      << ReadFile(p + "openssl.log");
  auto cluster = EtcdCluster::Start(
      1, absl::Seconds(30), EtcdCluster::Tls{p + "node0.pem", p + "node0.key", p + "ca.pem"});
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  etcd_ = *std::move(cluster);
  const std::string ctl =
      absl::StrCat("ETCDCTL_API=3 etcdctl --endpoints=https://", etcd_->endpoint(0),
                   " --cacert=", p, "ca.pem --cert=", p, "tool.pem --key=", p, "tool.key ");
  ASSERT_EQ(Shell(pki.path(), ctl + "user add root:s3cret && " + ctl + "auth enable", "ctl.log"), 0)
      << ReadFile(p + "ctl.log");
  for (const auto& [name, password] : {std::pair{"good", "s3cret"}, std::pair{"bad", "wrong"}}) {
    std::ofstream(p + name) << password << "\n";
    ::chmod((p + name).c_str(), 0600);
  }
  const std::vector<std::string> tls = {"--etcd_ca=" + p + "ca.pem",
                                        "--etcd_cert=" + p + "node1.pem",
                                        "--etcd_key=" + p + "node1.key", "--etcd_timeout=2s"};
  std::vector<std::string> good = tls;
  good.insert(good.end(), {"--etcd_user=root", "--etcd_password_file=" + p + "good"});
  StartDaemons(2, good);
  ExpectAllPassed(Run("tls", {0, 0, 1, 1}, "matrix", {"counts=7,4099"}), "matrix cases=");
  EXPECT_TRUE(Warnings(0).empty());  // TLS and etcd's users: nothing to warn of

  std::vector<std::string> bad = tls;
  bad.insert(bad.end(), {"--etcd_user=root", "--etcd_password_file=" + p + "bad"});
  StartDaemons(1, bad);  // daemon 2
  std::string out, err;
  EXPECT_EQ(StoreWorker(2, {"kv", "add", "k", "1"}, &out, &err), 1) << out;
  EXPECT_TRUE(absl::StrContains(err, "etcd " + etcd_->endpoint(0))) << err;
  EXPECT_TRUE(absl::StrContains(err, "authenticating as user 'root'")) << err;

  StartDaemons(1, {"--etcd_ca=" + p + "ca.pem", "--etcd_user=root",
                   "--etcd_password_file=" + p + "good", "--etcd_timeout=1s"});  // daemon 3
  EXPECT_EQ(StoreWorker(3, {"kv", "add", "k", "1"}, &out, &err), 1) << out;
  EXPECT_TRUE(absl::StrContains(err, "UNAVAILABLE")) << err;
  EXPECT_TRUE(absl::StrContains(err, "etcd " + etcd_->endpoint(0))) << err;
}

// An etcd reached without TLS or without etcd's users lets whoever reaches it rewrite every job's
// store: the daemon says so at start, and to an operator's `gradsyncctl health`.
TEST_F(EtcdJobTest, AnEtcdWithoutTlsOrUsersIsAWarningOperatorsSee) {
  StartEtcd(1);
  StartDaemons(1);
  const std::vector<std::string> warnings = Warnings(0);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_TRUE(absl::StrContains(warnings[0],
                                "without TLS (--etcd_ca) and without "
                                "authentication (--etcd_user)"))
      << warnings[0];
}

}  // namespace
}  // namespace gradsync::testing
