// GPU data plane on a real GPU: CUDA IPC buffers and events between trainer processes and a real
// gradsyncd, NCCL collectives through the daemon with values that a daemon doing nothing fails,
// a trainer killed while mapped, abort at the deadline, communicators kept across a trainer's
// restart. Label `gpu`; every test skips (never passes) where no CUDA device can be used.
//
// Nothing here may hang a GPU run: daemons run with a short --op_timeout, every worker op has its
// own deadline, and workers are killed at kWorkerWait. tests/gpu/run.sh also runs each test
// under its own `timeout`.
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

// A worker's whole run (connect, register, 8 ops of a few ms each; NCCL's first initialisation
// in the daemon) is seconds; past this it is killed and the test fails.
constexpr absl::Duration kWorkerWait = absl::Seconds(45);
// Each op's own deadline, and the daemons' default for any op that names none.
const std::string kOpTimeout = "op_timeout_ms=20000";
const std::string kDaemonOpTimeout = "--op_timeout=30s";

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
      GTEST_SKIP() << "no usable CUDA device here ("
                   << (e != cudaSuccess ? cudaGetErrorString(e) : "0 devices")
                   << "): the GPU tests run on a GPU machine (tests/gpu/run.sh)";
    }
  }
  std::unique_ptr<DaemonProcess> StartDaemon(DaemonProcess::Options options = {}) {
    dirs_.push_back(std::make_unique<TempDir>());
    options.flags.push_back(kDaemonOpTimeout);
    auto d = DaemonProcess::Start(dirs_.back()->path(), options);
    EXPECT_TRUE(d.ok()) << d.status();
    return d.ok() ? *std::move(d) : nullptr;
  }
  // Runs gpu_worker processes; returns each one's exit code and output.
  std::vector<std::pair<int, std::string>> Workers(
      const std::vector<std::vector<std::string>>& args) {
    std::vector<pid_t> pids;
    std::vector<std::string> outs;
    for (size_t i = 0; i < args.size(); ++i) {
      outs.push_back(absl::StrCat(dirs_[0]->path(), "/worker.", i, ".", ++runs_));
      std::vector<std::string> argv = {HelperBinary("gpu_worker")};
      argv.insert(argv.end(), args[i].begin(), args[i].end());
      argv.push_back(kOpTimeout);
      auto pid = Spawn(argv, {}, outs.back());
      EXPECT_TRUE(pid.ok());
      pids.push_back(pid.ok() ? *pid : -1);
    }
    std::vector<int> codes = WaitAll(pids, kWorkerWait);
    std::vector<std::pair<int, std::string>> out;
    for (size_t i = 0; i < pids.size(); ++i) out.emplace_back(codes[i], ReadFile(outs[i]));
    return out;
  }
  std::vector<std::unique_ptr<TempDir>> dirs_;
  int runs_ = 0;
};

// The out-of-place ops land in outputs holding a sentinel, their inputs written by a late
// kernel right before Ready(stream): values right only if the daemon waited for "ready", wrote
// the output, and recorded "done" before the trainer's check kernel ran.
TEST_F(GpuTest, OneRankNcclOpsThroughTheDaemonWriteTheirOutputsInStreamOrder) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  for (const auto& [code, out] : Workers({{d->unix_target(), "g1", "1", "0", "ops"}})) {
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "ok value_checks=4 in_place=4")) << out;
  }
}

// A fused all-reduce of 3 segments in two buffers (one allocation) runs as one NCCL group:
// values in every segment, nothing written outside them, three times in stream order.
TEST_F(GpuTest, AFusedAllReduceOfThreeSegmentsRunsThroughTheDaemon) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  for (const auto& [code, out] : Workers({{d->unix_target(), "gf", "1", "0", "fused"}})) {
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "ok fused segments=3 checks=18")) << out;
  }
}

// The same with two ranks on two GPUs of one daemon (the sums show the data moved); it needs
// two devices.
TEST_F(GpuTest, AFusedAllReduceOfTwoRanksOnTwoGpusSumsEverySegment) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n < 2) {
    GTEST_SKIP() << "needs two CUDA devices (NCCL puts one rank of a communicator per GPU); " << n
                 << " here";
  }
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  for (const auto& [code, out] :
       Workers({{d->unix_target(), "gf2", "2", "0", "fused", "device=0"},
                {d->unix_target(), "gf2", "2", "1", "fused", "device=1"}})) {
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "ok fused segments=3 checks=18 world=2")) << out;
  }
}

TEST_F(GpuTest, TwoTrainerProcessesShareTheGpuAndTheDaemon) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  // Two one-rank jobs at once (NCCL allows one rank per GPU in a communicator): the daemon maps
  // both processes' allocations, each holding two registered buffers.
  for (const auto& [code, out] : Workers({{d->unix_target(), "ga", "1", "0", "ops"},
                                          {d->unix_target(), "gb", "1", "0", "ops"}})) {
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "ok value_checks=4 in_place=4")) << out;
  }
}

TEST_F(GpuTest, ATrainerKilledWhileItsBufferIsMappedLeavesTheDaemonHealthy) {
  auto d = StartDaemon();
  ASSERT_NE(d, nullptr);
  const std::string out = absl::StrCat(dirs_[0]->path(), "/hold.out");
  auto pid = Spawn({HelperBinary("gpu_worker"), d->unix_target(), "gk", "1", "0", "hold"}, {}, out);
  ASSERT_TRUE(pid.ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (!absl::StrContains(ReadFile(out), "mapped") && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(absl::StrContains(ReadFile(out), "mapped")) << ReadFile(out);
  ::kill(*pid, SIGKILL);
  int status = 0;
  ::waitpid(*pid, &status, 0);
  // The daemon unmapped it with the session and serves the next job.
  for (const auto& [code, o] : Workers({{d->unix_target(), "gk2", "1", "0", "ops"}})) {
    EXPECT_EQ(code, 0) << o;
    EXPECT_TRUE(absl::StrContains(o, "ok value_checks=4")) << o;
  }
}

TEST_F(GpuTest, ARestartedTrainerReusesTheDaemonsCommunicators) {
  // The daemon's log goes to a file, where the test counts NCCL initialisations.
  TempDir logs;
  const std::string log = logs.path() + "/gradsyncd.log";
  DaemonProcess::Options options;
  options.wrapper = {"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>>" + log};
  auto d = StartDaemon(options);
  ASSERT_NE(d, nullptr);
  for (int run = 0; run < 2; ++run) {  // the same job twice: the trainer exited in between
    for (const auto& [code, out] : Workers({{d->unix_target(), "gr", "1", "0", "ops"}})) {
      EXPECT_EQ(code, 0) << out;
      EXPECT_TRUE(absl::StrContains(out, "ok value_checks=4")) << out;
    }
  }
  const std::string text = ReadFile(log);
  int inits = 0;
  for (size_t at = 0; (at = text.find("nccl communicators ready job=gr", at)) != std::string::npos;
       ++at) {
    ++inits;
  }
  EXPECT_EQ(inits, 1) << text;
  EXPECT_TRUE(absl::StrContains(text, "kept from the job's last run reused job=gr")) << text;
}

TEST_F(GpuTest, APeerThatNeverJoinsAbortsAtTheDeadlineAndTheDaemonGoesOn) {
  // Two daemons, a 2-rank job that forms (rank 1 registers on the second daemon) but rank 1
  // never submits: rank 0's NCCL communicator cannot finish forming, so its op fails at the
  // deadline and the communicators are aborted; then the daemon serves the next job.
  auto d0 = StartDaemon();
  auto d1 = StartDaemon();
  ASSERT_NE(d0, nullptr);
  ASSERT_NE(d1, nullptr);
  const std::string root = "root=" + d0->tcp_target();
  const std::string hold_out = absl::StrCat(dirs_[1]->path(), "/hold.out");
  auto holder = Spawn({HelperBinary("gpu_worker"), d1->unix_target(), "gx", "2", "1", "hold",
                       "local_world_size=1", root},
                      {}, hold_out);
  ASSERT_TRUE(holder.ok());
  auto res = Workers(
      {{d0->unix_target(), "gx", "2", "0", "once", "local_world_size=1", root, "timeout_ms=5000"}});
  ::kill(*holder, SIGKILL);
  ::waitpid(*holder, nullptr, 0);
  ASSERT_EQ(res[0].first, 0) << res[0].second;
  EXPECT_TRUE(absl::StrContains(res[0].second, "status DEADLINE_EXCEEDED")) << res[0].second;
  EXPECT_TRUE(absl::StrContains(res[0].second, "NCCL")) << res[0].second;
  // The abort left no kernel touching an unmapped buffer: the daemon still serves, values right.
  for (const auto& [code, out] : Workers({{d0->unix_target(), "gy", "1", "0", "ops"}})) {
    EXPECT_EQ(code, 0) << out;
    EXPECT_TRUE(absl::StrContains(out, "ok value_checks=4")) << out;
  }
}

}  // namespace
}  // namespace gradsync::testing
