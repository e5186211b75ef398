// The GPU plane against what real NCCL and CUDA do when things go wrong (fake_gpu.h models each
// point and cites NCCL's source): ncclCommAbort blocks for seconds and stops only its own
// communicator, freeing device memory waits for the device, a stream that waits on the event of a
// process that died never runs again, CUDA's initialisation may not answer, and every
// ncclGetUniqueId leaves a bootstrap root behind until all ranks have checked in.

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "daemon/backend/cpu/link_peer_watch.h"
#include "daemon/backend/nccl/nccl_backend.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_gpu.h"
#include "tests/unit/nccl_testing.h"
#include "tests/unit/record_links_testing.h"

namespace gradsync::backend::nccl {
namespace {

// What one daemon's peer watch reported lost, and on which thread.
struct Lost {
  absl::Mutex mu;
  std::vector<std::string> nodes ABSL_GUARDED_BY(mu);
  std::thread::id thread ABSL_GUARDED_BY(mu);

  void Add(const std::string& node) {
    absl::MutexLock lock(&mu);
    nodes.push_back(node);
    thread = std::this_thread::get_id();
  }
  std::vector<std::string> Await(size_t n, absl::Duration within) {
    absl::MutexLock lock(&mu);
    auto enough = [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return nodes.size() >= n; };
    mu.AwaitWithTimeout(absl::Condition(&enough), within);
    return nodes;
  }
};

TEST_F(NcclBackendTest, ANodeWhoseAbortTakesFiveSecondsKeepsItsHeartbeatsAndIsLostByNobody) {
  // Three daemons' peer watches over loopback, with the daemon's defaults (a heartbeat every
  // 250 ms, a peer silent for 1.5 s is lost). Node A's NCCL abort takes 5 s.
  gpu_.abort_blocks = absl::Seconds(5);
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  store::MemoryStore store;
  cpu::LinkPeerWatch::Options options;
  options.connect_timeout = absl::Seconds(20);
  std::vector<std::unique_ptr<Lost>> lost;  // outlive the watches, whose threads call them
  std::vector<std::unique_ptr<cpu::LinkPeerWatch>> watches;
  for (int i = 0; i < 3; ++i) {
    lost.push_back(std::make_unique<Lost>());
    watches.push_back(std::make_unique<cpu::LinkPeerWatch>(options));
  }
  for (int i = 0; i < 3; ++i) {
    Lost* mine = lost[i].get();
    watches[i]->Watch("j", "run1", cpu::kNodes, i, &store,
                      [this, mine, i](const std::string& node, const absl::Status& cause) {
                        // Node A does what the engine does for a lost node: Communicator::Abort
                        // (asked before the loss is noted, which the test waits for).
                        if (i == 0) backend_.AbortJob("j", cause);
                        mine->Add(node);
                      });
  }
  for (int i = 0; i < 3; ++i) {
    bool alive = false;
    for (int look = 0; look < 400 && !alive; ++look) {
      alive = true;
      for (const core::PeerState& p : watches[i]->Peers("j")) {
        alive = alive && p.state == core::PeerState::State::kAlive;
      }
      if (!alive) absl::SleepFor(absl::Milliseconds(50));
    }
    ASSERT_TRUE(alive) << "node " << i;
  }
  watches[2].reset();  // node C's daemon goes
  ASSERT_EQ(lost[0]->Await(1, absl::Seconds(10)), std::vector<std::string>{cpu::kNodes[2]});
  ASSERT_EQ(lost[1]->Await(1, absl::Seconds(10)), std::vector<std::string>{cpu::kNodes[2]});
  // A's abort runs for 5 s meanwhile; past it, and past B's 1.5 s timeout, nobody lost A or B.
  ASSERT_TRUE(backend_.FlushAborts(absl::Seconds(20)));
  absl::SleepFor(absl::Milliseconds(500));
  EXPECT_EQ(gpu_.AbortsDone(), 2);
  EXPECT_EQ(lost[0]->Await(2, absl::ZeroDuration()), std::vector<std::string>{cpu::kNodes[2]});
  EXPECT_EQ(lost[1]->Await(2, absl::ZeroDuration()), std::vector<std::string>{cpu::kNodes[2]})
      << "node B declared node A lost while A's NCCL abort ran";
  for (int i = 0; i < 2; ++i) {
    for (const core::PeerState& p : watches[i]->Peers("j")) {
      if (p.node != cpu::kNodes[2]) {
        EXPECT_EQ(p.state, core::PeerState::State::kAlive) << p.node;
      }
    }
  }
  // The abort ran on the aborter's thread, not on the peer watch's.
  absl::MutexLock lock(&lost[0]->mu);
  EXPECT_EQ(gpu_.AbortThreads().count(lost[0]->thread), 0u);
}

TEST_F(NcclBackendTest, AnAbortPastItsBoundIsReportedAndSaidAgainWhenItReturns) {
  FakeGpu gpu;
  gpu.abort_blocks = absl::Seconds(1);
  core::OpCounters counters;
  absl::Mutex mu;
  std::vector<std::string> said;
  NcclOptions options;
  options.counters = &counters;
  options.abort_hung_after = absl::Milliseconds(200);
  options.on_abort_hung = [&](const absl::Status& why) {
    absl::MutexLock lock(&mu);
    said.push_back(absl::StrCat(absl::StatusCodeToString(why.code()), ": ", why.message()));
  };
  options.on_abort_returned = [&] {
    absl::MutexLock lock(&mu);
    said.push_back("returned");
  };
  NcclBackend backend(&gpu, options);
  ASSERT_TRUE((*backend.CreateCommunicator(Spec({0}, 1, "0")))->Run(AllReduce({{0, 0}}, 1)).ok());
  backend.AbortJob("j", absl::UnavailableError("node b:7451 (ranks 1) lost"));
  ASSERT_TRUE(backend.FlushAborts(absl::Seconds(10)));
  absl::MutexLock lock(&mu);
  ASSERT_EQ(said.size(), 2u);
  EXPECT_TRUE(absl::StartsWith(said[0],
                               "DEADLINE_EXCEEDED: the abort of the NCCL communicators "
                               "of job=j group=0 has not returned after"))
      << said[0];
  EXPECT_TRUE(absl::StrContains(said[0], "the GPU plane of this node cannot recover")) << said[0];
  EXPECT_EQ(said[1], "returned");
  EXPECT_EQ(counters.nccl_aborts_hung.load(), 1u);
  EXPECT_EQ(backend.hung_aborts(), 1);
}

// Two groups of job j on the same two devices, each with an op whose kernels spin on a peer.
class TwoGroupsTest : public NcclBackendTest {
 protected:
  void SetUp() override {
    world_ = Make(Spec({0, 1}, 2));
    pair_ = Make(Spec({0, 1}, 2, "0,1"));
    ASSERT_TRUE(world_->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
    ASSERT_TRUE(pair_->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
    ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
    gpu_.streams_hang = true;
    gpu_.free_wait_limit = absl::Seconds(2);
    ASSERT_TRUE(world_->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1, absl::Seconds(30))).ok());
    ASSERT_TRUE(pair_->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1, absl::Seconds(30))).ok());
  }
  // Every communicator was revoked before the first abort, and no abort's free waited for a
  // kernel of another communicator.
  void ExpectRevokedFirst() {
    ASSERT_TRUE(backend_.FlushAborts(absl::Seconds(30)));
    EXPECT_EQ(gpu_.FreesBlocked(), 0) << "an abort freed memory while another group's kernel of "
                                         "the job still ran on its device";
    EXPECT_EQ(gpu_.AbortsDone(), 4);
    EXPECT_EQ(Count("revoke"), 4);
    size_t first_abort = gpu_.log.size(), last_revoke = 0;
    for (size_t i = 0; i < gpu_.log.size(); ++i) {
      if (absl::StartsWith(gpu_.log[i], "abort ")) first_abort = std::min(first_abort, i);
      if (absl::StartsWith(gpu_.log[i], "revoke ")) last_revoke = i;
    }
    EXPECT_LT(last_revoke, first_abort);
    EXPECT_FALSE(gpu_.StreamsBusy());
    EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
    gpu_.streams_hang = false;
    for (auto* comm : {&world_, &pair_}) {
      absl::Status s = (*comm)->Run(AllReduce({{0, 0}, {1, 1}}, 2, 2));
      EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "seq=1 failed after it was launched")) << s;
    }
  }
  std::shared_ptr<core::Communicator> world_, pair_;
};

TEST_F(TwoGroupsTest, ALostNodeRevokesEveryCommunicatorOfTheJobBeforeAnyAbortFreesMemory) {
  backend_.AbortJob("j", absl::UnavailableError("node b:7451 (ranks 2) lost"));
  ExpectRevokedFirst();
}

TEST_F(TwoGroupsTest, AnAsyncErrorInOneGroupRevokesTheOthersBeforeItsAbortFreesMemory) {
  gpu_.SetAsyncError(absl::UnavailableError("ncclAllReduce: remote process exited"));
  ASSERT_TRUE(Eventually([&] { return gpu_.Aborts() == 4; }));  // by the launch watcher
  gpu_.SetAsyncError(absl::OkStatus());
  ExpectRevokedFirst();
}

TEST_F(NcclBackendTest, ATrainerThatDiedWithItsReadyRecordQueuedFailsItsOpAndBlocksNoAbort) {
  auto comm = Make(Spec({0, 1}, 2));
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  // Rank 1's trainer was SIGKILLed after queueing the record of its "ready" event.
  gpu_.ExporterDied(FakeGpu::Handle(1000 + 10 * 1 + 1));
  absl::Status s = comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1, absl::Milliseconds(300)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1's trainer never said its buffer")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "nothing was launched")) << s;
  EXPECT_EQ(Count("coll"), 2);   // the first op's only
  EXPECT_EQ(Count("wait "), 0);  // no stream of the daemon's waits on another process
  // The job's communicators are then aborted (its trainer is gone): nothing of theirs waits on
  // the dead process's event.
  gpu_.dead_wait_limit = absl::Seconds(2);
  backend_.AbortJob("j", absl::UnavailableError("rank 1's session ended"));
  ASSERT_TRUE(backend_.FlushAborts(absl::Seconds(20)));
  EXPECT_EQ(gpu_.AbortsDone(), 2);
  EXPECT_EQ(gpu_.AbortsBlocked(), 0);
}

TEST_F(NcclBackendTest, BootstrapRootsLeftByFailedBuildsAreBoundedAndThenTheNodeSaysSo) {
  gpu_.never_ready = true;  // the other ranks never check in
  auto comm = Make(Spec({0, 1}, 2));
  for (int i = 0; i < kMaxLeftBootstrapRoots; ++i) {
    absl::Status s = comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, i, absl::Milliseconds(10)));
    ASSERT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  }
  EXPECT_EQ(gpu_.RootsOpen(), kMaxLeftBootstrapRoots);  // NCCL's threads, waiting on
  absl::Status s = comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 99, absl::Milliseconds(10)));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "this node makes no more NCCL ids: 32 failed builds"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "restart gradsyncd")) << s;
  EXPECT_EQ(gpu_.RootsOpen(), kMaxLeftBootstrapRoots);  // no 33rd thread
  gpu_.never_ready = false;
  // A build that completes leaves nothing behind: its root ended once every rank came.
  FakeGpu gpu;
  NcclBackend backend(&gpu);
  ASSERT_TRUE(
      (*backend.CreateCommunicator(Spec({0, 1}, 2)))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  EXPECT_EQ(gpu.RootsOpen(), 0);
}

TEST_F(NcclBackendTest, ALaunchedOpThatFailsOnTheGpuAfterItsAnswerIsReportedToItsTrainersSettle) {
  auto comm = Make(Spec({0, 1}, 2));
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  // The trainer's record of its op, as the engine makes it at submission and answers it.
  auto trainer = std::make_shared<core::Settlements>();
  auto with_record = [&](core::Collective op) {
    auto record = std::make_shared<core::Settlements::Op>(trainer);
    record->Answered(absl::OkStatus());
    op.settlements.push_back(std::move(record));
    return op;
  };
  auto settle = [&] {
    absl::Notification done;
    absl::Status got;
    trainer->Await([&](absl::Status s) {
      got = std::move(s);
      done.Notify();
    });
    EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10)));
    return got;
  };
  // An op that finishes settles OK.
  ASSERT_TRUE(comm->Run(with_record(AllReduce({{0, 0}, {1, 1}}, 2, 1))).ok());
  EXPECT_TRUE(settle().ok());
  // One that fails on the GPU after its answer: its trainer's settle says so, naming it.
  gpu_.streams_hang = true;
  ASSERT_TRUE(comm->Run(with_record(AllReduce({{0, 0}, {1, 1}}, 2, 2))).ok());
  gpu_.SetAsyncError(absl::UnavailableError("ncclAllReduce: remote process exited"));
  const absl::Status s = settle();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(),
                                "all_reduce job=j group=world seq=2 failed on the GPU after it was "
                                "answered OK, so its results are not valid"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "remote process exited")) << s;
  gpu_.SetAsyncError(absl::OkStatus());
  gpu_.streams_hang = false;
}

}  // namespace
}  // namespace gradsync::backend::nccl
