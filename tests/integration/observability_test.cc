// Observability with real processes: two daemons on loopback, four trainers (two per node).
// A trainer frozen with SIGSTOP is named (rank and node) by Inspect/ListOps asked of the other
// node and by the stall warning; GetHistory lists the run's ops in order with their outcomes;
// /metrics parses as Prometheus text and its counters follow the ops.

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

// GET http://127.0.0.1:port/metrics; the body, "" on failure.
std::string ScrapeMetrics(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  timeval tv{5, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return "";
  }
  const std::string req = "GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n";
  (void)::write(fd, req.data(), req.size());
  std::string resp;
  char buf[8192];
  for (ssize_t n; (n = ::read(fd, buf, sizeof(buf))) > 0;) resp.append(buf, n);
  ::close(fd);
  const size_t body = resp.find("\r\n\r\n");
  if (!absl::StartsWith(resp, "HTTP/1.") || !absl::StrContains(resp.substr(0, 16), "200") ||
      body == std::string::npos) {
    return "";
  }
  return resp.substr(body + 4);
}

// Parses Prometheus text exposition (version 0.0.4) strictly enough to catch malformed output:
// every sample line is `name{labels} value`, every family has # HELP and # TYPE before its
// samples. Returns "name{labels}" -> value; fails the test on a bad line.
std::map<std::string, double> ParsePrometheusText(const std::string& text) {
  static const std::regex kSample(
      R"(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="[^"]*"(,[a-zA-Z_][a-zA-Z0-9_]*="[^"]*")*)?\})? (\S+)( -?[0-9]+)?$)");
  static const std::regex kType(
      R"(^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$)");
  std::map<std::string, double> out;
  std::map<std::string, std::string> types;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const std::string l(line);
    std::smatch m;
    if (absl::StartsWith(l, "# HELP ")) continue;
    if (absl::StartsWith(l, "# TYPE ")) {
      EXPECT_TRUE(std::regex_match(l, m, kType)) << "bad TYPE line: " << l;
      if (m.size() > 2) types[m[1]] = m[2];
      continue;
    }
    if (!std::regex_match(l, m, kSample)) {
      ADD_FAILURE() << "bad sample line: " << l;
      continue;
    }
    const std::string name = m[1];
    std::string family = name;
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      if (absl::EndsWith(name, suffix) && !types.count(name)) {
        family = name.substr(0, name.size() - std::strlen(suffix));
      }
    }
    EXPECT_TRUE(types.count(family)) << "sample before its # TYPE: " << l;
    double value = 0;
    const std::string v = m[5];
    EXPECT_TRUE(v == "+Inf" || v == "-Inf" || v == "NaN" || absl::SimpleAtod(v, &value)) << l;
    out[absl::StrCat(name, m[2].str())] = value;
  }
  return out;
}

class ObservabilityTest : public ::testing::Test {
 protected:
  void StartDaemons(int n, const std::vector<std::vector<std::string>>& flags) {
    for (int i = 0; i < n; ++i) {
      dirs_.push_back(std::make_unique<TempDir>());
      DaemonProcess::Options options;
      options.flags = flags[i];
      options.stderr_path = dirs_.back()->path() + "/daemon.log";
      auto daemon = DaemonProcess::Start(dirs_.back()->path(), options);
      ASSERT_TRUE(daemon.ok()) << daemon.status();
      daemons_.push_back(*std::move(daemon));
    }
  }
  std::string Log(int i) { return ReadFile(dirs_[i]->path() + "/daemon.log"); }

  std::unique_ptr<v1::Inspect::Stub> Inspect(int i) {
    return v1::Inspect::NewStub(
        grpc::CreateChannel(daemons_[i]->unix_target(), grpc::InsecureChannelCredentials()));
  }

  std::vector<std::unique_ptr<TempDir>> dirs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
};

TEST_F(ObservabilityTest, FrozenTrainerIsNamedByListOpsOnTheOtherNodeByStallWarningAndHistory) {
  const int metrics_port = FreeLoopbackPort();
  ASSERT_GT(metrics_port, 0);
  StartDaemons(
      2, {{"--stall_warn=2s", absl::StrCat("--metrics_port=", metrics_port)}, {"--stall_warn=2s"}});
  const std::string node1 = daemons_[1]->tcp_target();

  // Before any op: the metrics parse, and no op is counted.
  const std::string before_text = ScrapeMetrics(metrics_port);
  ASSERT_FALSE(before_text.empty());
  std::map<std::string, double> before = ParsePrometheusText(before_text);
  EXPECT_EQ(before["gradsync_sessions"], 0);
  const std::string ok_ops = R"(gradsync_ops_total{kind="all_reduce",outcome="OK",plane="host"})";
  EXPECT_EQ(before[ok_ops], 0);

  const std::string hold = dirs_[0]->path() + "/release";
  const int kOps = 20, kFreezeAt = 10;
  const std::vector<int> node_of = {0, 0, 1, 1};
  std::vector<pid_t> pids;
  for (int r = 0; r < 4; ++r) {
    auto pid = Spawn({HelperBinary("collective_worker"), daemons_[node_of[r]]->unix_target(), "obs",
                      "4", std::to_string(r), "steps", "local_world_size=2",
                      "root=" + daemons_[0]->tcp_target(), absl::StrCat("ops=", kOps), "freeze=3",
                      absl::StrCat("freeze_at=", kFreezeAt), "hold=" + hold},
                     {}, absl::StrCat(dirs_[0]->path(), "/out.", r));
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
  }

  // Node 0 (which holds ranks 0 and 1) names rank 3 on node 1 while op 10 waits.
  v1::ListOpsResponse ops;
  const v1::PendingOp* stuck = nullptr;
  auto inspect0 = Inspect(0);
  for (int i = 0; i < 300 && stuck == nullptr; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::ListOpsRequest req;
    req.set_job("obs");
    ops.Clear();
    if (!inspect0->ListOps(&ctx, req, &ops).ok()) continue;
    for (const v1::PendingOp& op : ops.ops()) {
      if (op.seq() == kFreezeAt && op.arrived_ranks_size() == 3) stuck = &op;
    }
  }
  ASSERT_NE(stuck, nullptr) << ops.DebugString();
  EXPECT_EQ(stuck->group(), "world");
  EXPECT_EQ(stuck->plane(), "host");
  EXPECT_TRUE(absl::StrContains(stuck->fingerprint(), "all_reduce(sum, float32, count=16"))
      << stuck->fingerprint();
  EXPECT_EQ(std::vector<int>(stuck->arrived_ranks().begin(), stuck->arrived_ranks().end()),
            (std::vector<int>{0, 1, 2}));
  ASSERT_EQ(stuck->missing_ranks_size(), 1) << ops.DebugString();
  EXPECT_EQ(stuck->missing_ranks(0).rank(), 3);
  EXPECT_EQ(stuck->missing_ranks(0).node(), node1);
  EXPECT_EQ(stuck->missing_ranks(0).waiting_for(), v1::TRAINER);
  // Node 0's daemon runs it and waits on the network; node 1's waits for its trainer.
  std::map<std::string, v1::WaitingFor> waits;
  for (const v1::NodeOpState& n : stuck->nodes()) waits[n.node()] = n.waiting_for();
  EXPECT_EQ(waits[daemons_[0]->tcp_target()], v1::NETWORK) << ops.DebugString();
  EXPECT_EQ(waits[node1], v1::TRAINER) << ops.DebugString();
  ASSERT_EQ(ops.nodes_size(), 2);
  EXPECT_TRUE(ops.nodes(0).answered() && ops.nodes(1).answered()) << ops.DebugString();

  // gradsyncctl shows the same as a table.
  const std::string ctl_out = dirs_[0]->path() + "/ctl";
  auto ctl = Spawn({HelperBinary("../client/gradsyncctl"), "--socket=" + daemons_[0]->socket_path(),
                    "ops", "obs"},
                   {}, ctl_out);
  ASSERT_TRUE(ctl.ok());
  auto ctl_code = WaitExit(*ctl, absl::Seconds(10));
  ASSERT_TRUE(ctl_code.ok());
  EXPECT_EQ(*ctl_code, 0);
  const std::string table = ReadFile(ctl_out);
  EXPECT_TRUE(absl::StrContains(table, absl::StrCat("3 @", node1, ": trainer"))) << table;

  // The stall warning: node 1 names its frozen rank, node 0 the ranks it waits on.
  const std::string named = absl::StrCat("rank(s) 3 (node ", node1, ") have not submitted it");
  const std::string waits_on_network = "waiting on the network for rank(s) 2 (node";
  for (int i = 0; i < 100 && !(absl::StrContains(Log(1), named) &&
                               absl::StrContains(Log(0), waits_on_network));
       ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(absl::StrContains(Log(1), named)) << Log(1);
  EXPECT_TRUE(
      absl::StrContains(Log(1), absl::StrCat("op stalled job=obs group=world seq=", kFreezeAt)))
      << Log(1);
  EXPECT_TRUE(absl::StrContains(Log(0), waits_on_network)) << Log(0);

  ASSERT_EQ(::kill(pids[3], SIGCONT), 0);
  // Everyone finishes its ops (and then holds on, so the job and its history live on).
  for (int r = 0; r < 4; ++r) {
    const std::string out = absl::StrCat(dirs_[0]->path(), "/out.", r);
    for (int i = 0; i < 300 && !absl::StrContains(ReadFile(out), "steps ok"); ++i) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_TRUE(absl::StrContains(ReadFile(out), "steps ok ops=20 wrong=0")) << ReadFile(out);
  }

  // History on node 0: the 20 ops in order, all OK, times consistent; op 10 waited for rank 3.
  for (int d = 0; d < 2; ++d) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::GetHistoryRequest req;
    req.set_job("obs");
    req.set_group("world");
    v1::GetHistoryResponse history;
    ASSERT_TRUE(Inspect(d)->GetHistory(&ctx, req, &history).ok());
    ASSERT_EQ(history.ops_size(), kOps) << history.DebugString();
    EXPECT_EQ(history.dropped(), 0u);
    for (int k = 0; k < kOps; ++k) {
      const v1::HistoryEntry& e = history.ops(k);
      EXPECT_EQ(e.seq(), static_cast<uint64_t>(k));
      EXPECT_EQ(e.outcome(), "OK") << e.DebugString();
      EXPECT_EQ(e.bytes(), 64);
      EXPECT_EQ(e.plane(), "host");
      EXPECT_TRUE(absl::StrContains(e.fingerprint(), "name='step'")) << e.fingerprint();
      EXPECT_LE(e.queued_unix_us(), e.started_unix_us());
      EXPECT_LE(e.started_unix_us(), e.finished_unix_us());
      if (k > 0) {
        EXPECT_GE(e.finished_unix_us(), history.ops(k - 1).finished_unix_us());
      }
    }
    // The frozen op took at least the 2 s the stall warning waited for.
    EXPECT_GE(history.ops(kFreezeAt).finished_unix_us() - history.ops(kFreezeAt).queued_unix_us(),
              2000000);
  }

  // The counters moved with the ops: 20 all-reduces on node 0, each counted once.
  const std::string after_text = ScrapeMetrics(metrics_port);
  ASSERT_FALSE(after_text.empty());
  std::map<std::string, double> after = ParsePrometheusText(after_text);
  EXPECT_EQ(after[ok_ops], kOps) << after_text;
  EXPECT_EQ(after[R"(gradsync_op_bytes_total{kind="all_reduce",plane="host"})"], kOps * 64)
      << after_text;
  EXPECT_EQ(after[R"(gradsync_op_latency_seconds_count{plane="host"})"], kOps) << after_text;
  EXPECT_EQ(after[R"(gradsync_op_latency_seconds_bucket{plane="host",le="+Inf"})"], kOps)
      << after_text;
  EXPECT_GE(after["gradsync_op_latency_seconds_sum{plane=\"host\"}"], 2.0) << after_text;
  EXPECT_EQ(after["gradsync_sessions"], 2);
  EXPECT_EQ(after["gradsync_jobs"], 1);
  EXPECT_EQ(after["gradsync_pending_ops"], 0);
  EXPECT_GE(after["gradsync_stall_warnings_total"], 1);
  EXPECT_GT(after["gradsync_store_calls_total"], before["gradsync_store_calls_total"]);
  EXPECT_GT(after["gradsync_mapped_bytes"], 0);

  std::ofstream(hold).put('x');
  const std::vector<int> codes = WaitAll(pids, absl::Seconds(60));
  for (int r = 0; r < 4; ++r) EXPECT_EQ(codes[r], 0) << "rank " << r;
}

}  // namespace
}  // namespace gradsync::testing
