// Collectives end to end: a real gradsyncd and 2 or 4 real trainer processes
// (collective_worker) over shared memory. Each worker checks every value it gets against its
// own independent computation; these tests check that every worker passed, and the daemon's
// side effects (health, released mappings, a fresh session of the same job).

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/gradsync_client.h"
#include "client/store_client.h"
#include "common/doorbell.h"
#include "gradsync/v1/gradsync.grpc.pb.h"
#include "gradsync/v1/store.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/daemon_process.h"

namespace gradsync::testing {
namespace {

class CollectiveTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DaemonProcess::Options options;
    options.tcp = false;
    auto daemon = DaemonProcess::Start(dir_.path(), options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
  }

  // Starts one worker per rank (ranks listed in `scenarios`, by rank) and returns their exit
  // codes; each worker's stdout is kept in out_[rank].
  std::vector<int> Run(const std::string& job, const std::vector<std::string>& scenarios,
                       const std::vector<std::string>& args = {},
                       absl::Duration timeout = absl::Seconds(150)) {
    const int world = static_cast<int>(scenarios.size());
    std::vector<pid_t> pids;
    out_.assign(world, "");
    for (int r = 0; r < world; ++r) {
      std::vector<std::string> argv = {HelperBinary("collective_worker"),
                                       daemon_->unix_target(),
                                       job,
                                       std::to_string(world),
                                       std::to_string(r),
                                       scenarios[r]};
      argv.insert(argv.end(), args.begin(), args.end());
      auto pid = Spawn(argv, {}, OutPath(r));
      EXPECT_TRUE(pid.ok()) << pid.status();
      pids.push_back(pid.ok() ? *pid : -1);
    }
    const std::vector<int> codes = WaitAll(pids, timeout);
    for (int r = 0; r < world; ++r) out_[r] = ReadFile(OutPath(r));
    return codes;
  }

  std::vector<int> RunAll(const std::string& job, const std::string& scenario, int world,
                          const std::vector<std::string>& args = {}) {
    return Run(job, std::vector<std::string>(world, scenario), args);
  }

  std::string OutPath(int rank) const { return absl::StrCat(dir_.path(), "/out.", rank); }

  void ExpectAllPassed(const std::vector<int>& codes, const std::string& needle) {
    for (size_t r = 0; r < codes.size(); ++r) {
      EXPECT_EQ(codes[r], 0) << "rank " << r << " output: " << out_[r];
      EXPECT_TRUE(absl::StrContains(out_[r], needle)) << "rank " << r << ": " << out_[r];
    }
  }

  bool Serving() {
    auto channel = grpc::CreateChannel(daemon_->unix_target(), grpc::InsecureChannelCredentials());
    client::StoreClient store(channel);
    return store.Set("health-probe", "k", "v").ok();
  }

  // Shared-memory mappings the daemon holds right now.
  int DaemonShmMappings() {
    std::ifstream maps(absl::StrCat("/proc/", daemon_->pid(), "/maps"));
    int n = 0;
    for (std::string line; std::getline(maps, line);)
      n += absl::StrContains(line, "/memfd:gradsync-");  // buffers and doorbells
    return n;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<std::string> out_;
};

TEST_F(CollectiveTest, EveryOpDtypeAndSizeTwoRanks) {
  ExpectAllPassed(RunAll("m2", "matrix", 2), "matrix cases=");
}

TEST_F(CollectiveTest, EveryOpDtypeAndSizeFourRanks) {
  ExpectAllPassed(RunAll("m4", "matrix", 4), "matrix cases=");
}

TEST_F(CollectiveTest, SixtyFourMiBEveryOpAndDtypeTwoRanks) {
  ExpectAllPassed(RunAll("l2", "matrix", 2, {"bytes=67108864"}), "matrix cases=48");
}

TEST_F(CollectiveTest, SixtyFourMiBFourRanks) {
  ExpectAllPassed(RunAll("l4", "matrix", 4, {"bytes=67108864", "dtypes=float32,bfloat16"}),
                  "matrix cases=16");
}

TEST_F(CollectiveTest, HundredTwentyEightAsyncOpsInFlight) {
  ExpectAllPassed(RunAll("a2", "async", 2), "async done=128");
  ExpectAllPassed(RunAll("a4", "async", 4), "async done=128");
}

TEST_F(CollectiveTest, FusedPackIsOneOpWhateverTheLayout) {
  ExpectAllPassed(RunAll("f2", "fused", 2), "wrong=0");
  ExpectAllPassed(RunAll("f4", "fused", 4), "wrong=0");
}

TEST_F(CollectiveTest, GroupsAreIndependent) {
  ExpectAllPassed(RunAll("g4", "groups", 4), "groups ok");
}

TEST_F(CollectiveTest, FingerprintMismatchFailsEveryRankNamingBoth) {
  ExpectAllPassed(RunAll("d2", "desync", 2), "desync ok");
  ExpectAllPassed(RunAll("d4", "desync", 4), "desync ok");
}

TEST_F(CollectiveTest, DeadlineNamesTheRankThatNeverCame) {
  ExpectAllPassed(RunAll("t3", "deadline", 3), "deadline ok");
}

TEST_F(CollectiveTest, BadInputGetsClearErrorsAndChangesNothing) {
  ExpectAllPassed(RunAll("b2", "badinput", 2), "badinput cases=");
}

// The same guarantees when ops travel on the gRPC stream instead of the doorbell.
TEST_F(CollectiveTest, OpsOverTheGrpcStreamToo) {
  ExpectAllPassed(RunAll("s2", "matrix", 2, {"doorbell=0", "counts=0,7,4099"}), "matrix cases=");
  ExpectAllPassed(RunAll("s4", "async", 4, {"doorbell=0"}), "async done=128");
  ExpectAllPassed(RunAll("s3", "deadline", 3, {"doorbell=0"}), "deadline ok");
  ExpectAllPassed(RunAll("sb", "badinput", 2, {"doorbell=0"}), "badinput cases=");
  ExpectAllPassed(RunAll("sd", "desync", 2, {"doorbell=0"}), "desync ok");
}

TEST_F(CollectiveTest, TrainerWrittenInCAgainstTheCAbi) {
  std::vector<pid_t> pids;
  for (int r = 0; r < 2; ++r) {
    auto pid =
        Spawn({HelperBinary("c_api_worker"), daemon_->unix_target(), "c2", "2", std::to_string(r)},
              {}, OutPath(r));
    ASSERT_TRUE(pid.ok()) << pid.status();
    pids.push_back(*pid);
  }
  for (int r = 0; r < 2; ++r) {
    auto code = WaitExit(pids[r], absl::Seconds(60));
    ASSERT_TRUE(code.ok()) << code.status();
    EXPECT_EQ(*code, 0) << ReadFile(OutPath(r));
    EXPECT_TRUE(absl::StrContains(ReadFile(OutPath(r)), "c api ok"));
  }
}

TEST_F(CollectiveTest, KilledTrainerFailsOthersReleasesMappingsAndJobRestarts) {
  const std::vector<int> codes = Run("k4", {"survivor", "survivor", "survivor", "victim"});
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(codes[r], 0) << "rank " << r << ": " << out_[r];
    EXPECT_TRUE(absl::StrContains(out_[r], "survivor ok")) << out_[r];
  }
  EXPECT_EQ(codes[3], 128 + SIGKILL);
  EXPECT_TRUE(Serving());
  // Every session of the job has ended: the daemon holds none of their shared memory.
  EXPECT_EQ(DaemonShmMappings(), 0);
  // The same job id starts afresh with new sessions.
  ExpectAllPassed(RunAll("k4", "matrix", 4, {"counts=0,5,1001"}), "matrix cases=");
  EXPECT_EQ(DaemonShmMappings(), 0);
}

// A trainer that scribbles over its doorbell ring loses its session (the stream ends with
// INVALID_ARGUMENT); the daemon stays healthy and other jobs go on.
TEST_F(CollectiveTest, CorruptDoorbellEndsThatSessionOnly) {
  const int fd = ::memfd_create("doorbell", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, doorbell::RegionBytes()), 0);
  ASSERT_EQ(::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK), 0);
  void* p = ::mmap(nullptr, doorbell::RegionBytes(), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ASSERT_NE(p, MAP_FAILED);
  auto* base = static_cast<std::byte*>(p);
  doorbell::Doorbell ring(base);
  ring.Initialize();
  auto token = ShareFd(daemon_->socket_path(), fd);
  ::close(fd);
  ASSERT_TRUE(token.ok()) << token.status();
  RawSession raw;
  ASSERT_TRUE(raw.Start(daemon_->unix_target(), "bad", *token));
  auto& stream = raw.stream;
  v1::TrainerEvent event;
  ASSERT_TRUE(stream->Read(&event));
  EXPECT_EQ(event.code(), 0) << event.message();

  // A record whose length runs past the ring.
  const uint64_t huge = uint64_t{1} << 40;
  std::memcpy(base + doorbell::kHeaderBytes, &huge, 8);
  reinterpret_cast<doorbell::Header*>(base)->request_head.store(64);
  ring.Push("");                       // wakes the daemon's doorbell thread
  EXPECT_FALSE(stream->Read(&event));  // the daemon ends the session
  stream->WritesDone();
  const grpc::Status end = stream->Finish();
  EXPECT_EQ(end.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << end.error_message();
  ::munmap(p, doorbell::RegionBytes());

  EXPECT_TRUE(Serving());
  ExpectAllPassed(RunAll("after", "desync", 2), "desync ok");
}

TEST_F(CollectiveTest, DaemonRestartIsUnavailableAndTrainersCanRegisterAgain) {
  for (bool doorbell : {true, false}) {
    client::ClientOptions options;
    options.doorbell = doorbell;
    client::Placement one{"r1", 1, 0, 0, 1, ""};
    auto c = client::Client::Connect(daemon_->unix_target(), one, options);
    ASSERT_TRUE(c.ok()) << c.status();
    auto buffer = (*c)->CreateBuffer(64, v1::FLOAT32);
    ASSERT_TRUE(buffer.ok()) << buffer.status();
    EXPECT_TRUE((*c)->AllReduce(v1::FLOAT32, v1::SUM, {{(*buffer)->id(), 0, 16}}).ok());
    auto code = daemon_->Stop(SIGKILL);
    ASSERT_TRUE(code.ok());
    const absl::Time start = absl::Now();
    absl::Status s = (*c)->AllReduce(v1::FLOAT32, v1::SUM, {{(*buffer)->id(), 0, 16}});
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
    DaemonProcess::Options daemon_options;
    daemon_options.tcp = false;
    auto daemon = DaemonProcess::Start(dir_.path(), daemon_options);
    ASSERT_TRUE(daemon.ok()) << daemon.status();
    daemon_ = *std::move(daemon);
    auto again = client::Client::Connect(daemon_->unix_target(), one, options);
    ASSERT_TRUE(again.ok()) << again.status();
    auto b2 = (*again)->CreateBuffer(64, v1::FLOAT32);
    ASSERT_TRUE(b2.ok()) << b2.status();
    EXPECT_TRUE((*again)->AllReduce(v1::FLOAT32, v1::MEAN, {{(*b2)->id(), 0, 16}}).ok());
  }
}

}  // namespace
}  // namespace gradsync::testing
