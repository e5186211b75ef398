// Jobs spanning daemons: 2 and 3 real gradsyncd processes on loopback (own ports and sockets),
// each with real trainer processes; the daemons form the job through the root daemon's store
// and carry the bytes between them with Gloo.

#include <signal.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class MultiNodeTest : public ::testing::Test {
 protected:
  void StartDaemons(int n) {
    for (int i = 0; i < n; ++i) {
      dirs_.push_back(std::make_unique<TempDir>());
      auto daemon = DaemonProcess::Start(dirs_.back()->path());
      ASSERT_TRUE(daemon.ok()) << daemon.status();
      daemons_.push_back(*std::move(daemon));
    }
  }

  // One worker per rank; rank r attaches to daemon node_of[r]. Returns exit codes.
  std::vector<int> Run(const std::string& job, const std::vector<int>& node_of,
                       const std::string& scenario, const std::vector<std::string>& args) {
    const int world = static_cast<int>(node_of.size());
    std::vector<pid_t> pids;
    out_.assign(world, "");
    for (int r = 0; r < world; ++r) {
      int local_world = 0;
      for (int n : node_of) local_world += n == node_of[r];
      std::vector<std::string> argv = {
          HelperBinary("collective_worker"), daemons_[node_of[r]]->unix_target(), job,
          std::to_string(world), std::to_string(r), scenario,
          "local_world_size=" + std::to_string(local_world),
          "root=" + daemons_[node_of[0]]->tcp_target()};
      argv.insert(argv.end(), args.begin(), args.end());
      auto pid = Spawn(argv, {}, absl::StrCat(dirs_[0]->path(), "/out.", r));
      EXPECT_TRUE(pid.ok()) << pid.status();
      pids.push_back(pid.ok() ? *pid : -1);
    }
    std::vector<int> codes;
    const absl::Time deadline = absl::Now() + absl::Seconds(150);
    for (int r = 0; r < world; ++r) {
      auto code = WaitExit(pids[r], std::max(deadline - absl::Now(), absl::Seconds(1)));
      if (!code.ok()) {
        ::kill(pids[r], SIGKILL);
        code = WaitExit(pids[r], absl::Seconds(10));
        ADD_FAILURE() << "rank " << r << " did not finish in time";
      }
      codes.push_back(code.ok() ? *code : -1);
      out_[r] = ReadAll(absl::StrCat(dirs_[0]->path(), "/out.", r));
    }
    return codes;
  }

  void ExpectAllPassed(const std::vector<int>& codes, const std::string& needle) {
    for (size_t r = 0; r < codes.size(); ++r) {
      EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << out_[r];
      EXPECT_TRUE(absl::StrContains(out_[r], needle)) << "rank " << r << ": " << out_[r];
    }
  }

  std::vector<std::unique_ptr<TempDir>> dirs_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::string> out_;
};

// Ranks laid out in blocks (0,1 | 2,3): all-reduce (every op and dtype), broadcast, barrier.
TEST_F(MultiNodeTest, TwoDaemonsTwoRanksEach) {
  StartDaemons(2);
  ExpectAllPassed(Run("mn2", {0, 0, 1, 1}, "matrix", {"ops=reduce", "counts=0,1,7,1023,65537"}),
                  "matrix cases=");
}

TEST_F(MultiNodeTest, ThreeDaemonsUnevenRanksAndFusedPacks) {
  StartDaemons(3);
  ExpectAllPassed(Run("mn3", {0, 0, 1, 2}, "matrix", {"ops=reduce", "counts=3,4099"}),
                  "matrix cases=");
  ExpectAllPassed(Run("mn3f", {0, 0, 1, 2}, "fused", {}), "wrong=0");
}

}  // namespace
}  // namespace gradsync::testing
