// The NCCL backend's logic against a fake GpuApi: stream and event order, ops answered once
// launched and watched until their streams finish them (failures after the answer fail the
// group's next op; at most kMaxLaunchedPerGroup per group), communicators kept across
// Communicator objects, rebuild on a layout change, abort on errors and deadlines (and no buffer
// released while a kernel may still run), the unique id through the job's store, and the
// host/device dispatch.
#include "daemon/backend/nccl/nccl_backend.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/logging.h"
#include "daemon/backend/nccl/dispatch_backend.h"
#include "daemon/backend/nccl/launched_ops.h"
#include "daemon/core/engine.h"
#include "daemon/ipc/cuda_importer.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"
#include "spdlog/sinks/ringbuffer_sink.h"
#include "tests/unit/fake_gpu.h"
#include "tests/unit/nccl_testing.h"

namespace gradsync::backend::nccl {
namespace {

TEST_F(NcclBackendTest, WaitsForTheTrainersThenRunsLocalRanksInOneGroupThenRecordsDone) {
  auto comm = Make(Spec({0, 1}, 2));
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  // Communicators: one per local rank, in one NCCL group; then the op.
  const std::vector<std::string> want = {"group_start",
                                         "init h1 d0 rank 0/2",
                                         "init h2 d1 rank 1/2",
                                         "group_end",
                                         "query h1001",
                                         "query h1011",  // the trainers' "ready", on the host
                                         "stream d0 h3",
                                         "stream d1 h4",
                                         "group_start",
                                         "coll1 h1 h3 n=16 inplace",
                                         "coll1 h2 h4 n=16 inplace",
                                         "group_end",
                                         "record h1002 h3",
                                         "record h1012 h4",  // then "done" for the trainers
                                         "record h5 h3",
                                         "record h6 h4"};  // and the daemon's end marks
  EXPECT_EQ(gpu_.log, want);
  EXPECT_EQ(gpu_.ids[0], gpu_.ids[1]);  // one unique id, made here (rank 0 is local)
}

TEST_F(NcclBackendTest, CommunicatorsOutliveTheEnginesCommunicatorObject) {
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  EXPECT_EQ(backend_.comm_inits(), 2);
  // A trainer restarted: the engine makes a new Communicator for the same job and group.
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1)).ok());
  EXPECT_EQ(backend_.comm_inits(), 2);
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.aborts, 0);
  // The restarted trainer came back on another device: rebuilt.
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 0}}, 2, 2)).ok());
  EXPECT_EQ(backend_.comm_inits(), 4);
  ASSERT_TRUE(backend_.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu_.aborts, 2);
}

TEST_F(NcclBackendTest, DoneIsRecordedOnlyOnceNcclHasEnqueuedTheOp) {
  gpu_.launch_polls = 2;  // non-blocking communicators: ncclGroupEnd returned in progress
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  const auto at = [&](const std::string& prefix) {
    return std::find_if(gpu_.log.begin(), gpu_.log.end(),
                        [&](auto& l) { return absl::StartsWith(l, prefix); }) -
           gpu_.log.begin();
  };
  const auto last_in_progress =
      gpu_.log.rend() -
      std::find_if(gpu_.log.rbegin(), gpu_.log.rend(),
                   [](auto& l) { return absl::StartsWith(l, "inprogress"); }) -
      1;
  EXPECT_GT(at("inprogress"), at("coll"));
  EXPECT_LT(last_in_progress, at("record"));
}

TEST_F(NcclBackendTest, OtherLocalRanksOnTheSameDevicesGetTheirOwnCommunicators) {
  store::MemoryStore store;
  ASSERT_TRUE(Make(Spec({0, 1}, 4, "world", &store))->Run(AllReduce({{0, 0}, {1, 1}}, 4)).ok());
  // Same job, group, size and devices, but ranks 2 and 3 are the local ones now: the
  // communicators of ranks 0 and 1 are not reused; new ones wait for rank 0's id for this op.
  absl::Status s = Make(Spec({2, 3}, 4, "world", &store))
                       ->Run(AllReduce({{2, 0}, {3, 1}}, 4, 1, absl::Milliseconds(50)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  ASSERT_TRUE(backend_.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu_.aborts, 2);
  EXPECT_EQ(Count("coll"), 2);  // op 0's only
}

TEST_F(NcclBackendTest, AnOpIsAnsweredOnceLaunchedAndSettledWhenItsStreamsFinishIt) {
  auto comm = Make(Spec({0, 1}, 2));
  gpu_.streams_hang = true;  // the kernels take long
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  EXPECT_TRUE(gpu_.StreamsBusy());         // answered while the GPU still runs it
  EXPECT_EQ(Count("record h1002 h3"), 1);  // "done" for the trainers' streams, before the answer
  EXPECT_EQ(Count("record h1012 h4"), 1);
  EXPECT_EQ(backend_.LaunchedOps(), 1u);
  gpu_.streams_hang = false;  // the GPU finishes it: settled with no further op
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.EventsOpen(), 0);  // the daemon's end marks are released
  EXPECT_EQ(gpu_.Aborts(), 0);
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1)).ok());
  EXPECT_EQ(backend_.comm_inits(), 2);
}

TEST_F(NcclBackendTest, AnAsyncErrorAfterTheAnswerAbortsTheJobsCommunicatorsAndFailsTheNextOp) {
  FakeGpu gpu;
  core::OpCounters counters;
  NcclOptions options;
  options.counters = &counters;
  NcclBackend backend(&gpu, options);
  auto world = *backend.CreateCommunicator(Spec({0, 1}, 2));
  auto pair = *backend.CreateCommunicator(Spec({0, 1}, 2, "0,1"));
  ASSERT_TRUE(world->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(pair->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(Eventually([&] { return backend.LaunchedOps() == 0; }));
  gpu.streams_hang = true;
  ASSERT_TRUE(world->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1)).ok());  // launched, answered
  gpu.SetAsyncError(absl::UnavailableError("ncclAllReduce: remote process exited"));
  // No further op: the launch watcher sees it and aborts both groups' communicators on this
  // node together, their streams drained.
  ASSERT_TRUE(Eventually([&] { return gpu.Aborts() == 4; }));
  EXPECT_TRUE(Eventually([&] { return backend.LaunchedOps() == 0; }));
  EXPECT_FALSE(gpu.StreamsBusy());
  EXPECT_EQ(counters.nccl_launched_failures.load(), 1u);
  gpu.streams_hang = false;
  gpu.SetAsyncError(absl::OkStatus());
  // The group's next op fails, naming the op whose results are not valid.
  absl::Status s = world->Run(AllReduce({{0, 0}, {1, 1}}, 2, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "all_reduce job=j group=world seq=2: not run")) << s;
  EXPECT_TRUE(
      absl::StrContains(s.message(),
                        "all_reduce job=j group=world seq=1 failed after it was launched (and "
                        "answered OK), so its results are not valid"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "remote process exited")) << s;
  EXPECT_EQ(backend.comm_inits(), 4);  // not rebuilt by the failed op
  // The op after rebuilds; the pair group (idle when aborted) just rebuilds at its next op.
  ASSERT_TRUE(world->Run(AllReduce({{0, 0}, {1, 1}}, 2, 3)).ok());
  ASSERT_TRUE(pair->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1)).ok());
  EXPECT_EQ(backend.comm_inits(), 8);
  EXPECT_EQ(counters.nccl_rebuilds.load(), 2u);
}

TEST_F(NcclBackendTest, ALaunchedOpUnfinishedAtItsDeadlineIsAbortedAndFailsTheNextOp) {
  auto comm = Make(Spec({0, 1}, 2));
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  gpu_.streams_hang = true;  // a peer never enters it
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1, absl::Milliseconds(200))).ok());
  ASSERT_TRUE(Eventually([&] { return gpu_.Aborts() == 2; }));  // by the watcher
  EXPECT_FALSE(gpu_.StreamsBusy());
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  gpu_.streams_hang = false;
  absl::Status s = comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "seq=1 failed after it was launched")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "did not finish on the GPU by its deadline")) << s;
  ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 3)).ok());
  EXPECT_EQ(backend_.comm_inits(), 4);  // rebuilt
}

TEST_F(NcclBackendTest, AtMostAFixedNumberOfOpsPerGroupAreLaunchedTheNextWaitsForTheOldest) {
  auto comm = Make(Spec({0, 1}, 2));
  gpu_.streams_hang = true;  // the GPU is behind
  constexpr uint64_t kMax = kMaxLaunchedPerGroup;
  for (uint64_t seq = 0; seq < kMax; ++seq) {
    ASSERT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, seq, absl::Seconds(20))).ok()) << seq;
  }
  EXPECT_EQ(backend_.LaunchedOps(), kMax);
  // One more waits, under its own deadline, for the oldest to finish.
  absl::Status s = comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, kMax, absl::Milliseconds(100)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "not launched by its deadline, 64 earlier ops")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "the oldest: all_reduce job=j group=world seq=0)"))
      << s;                                              // which op the GPU is stuck on
  EXPECT_EQ(Count("coll"), static_cast<int>(2 * kMax));  // it never reached NCCL
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 0);  // the earlier ones run on
  // The GPU catches up while the next op waits: it launches.
  std::thread finish([&] {
    absl::SleepFor(absl::Milliseconds(50));
    gpu_.streams_hang = false;
  });
  EXPECT_TRUE(comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, kMax + 1, absl::Seconds(20))).ok());
  finish.join();
  EXPECT_EQ(Count("coll"), static_cast<int>(2 * (kMax + 1)));
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.EventsOpen(), 0);
}

// A trainer's buffer as the daemon maps it: the real CUDA importer over the fake, so that
// releasing the op's buffer closes its IPC mapping (CloseMemHandle) as it does in gradsyncd.
std::unique_ptr<core::MappedBuffer> ImportedBuffer(FakeGpu& gpu, ipc::CudaImporter& importer) {
  const std::string handle(gpu::kIpcHandleBytes, 'm');
  gpu.exported[handle] = 1 << 20;
  v1::RegisterBufferRequest r;
  r.set_bytes(4096);
  v1::CudaIpcBuffer* c = r.mutable_cuda();
  c->set_mem_handle(handle);
  c->set_device(0);
  c->set_ready_event(std::string(gpu::kIpcHandleBytes, 'r'));
  c->set_done_event(std::string(gpu::kIpcHandleBytes, 'd'));
  c->set_pid(::getpid() + 1);  // another process
  auto b = importer.Import(r);
  EXPECT_TRUE(b.ok()) << b.status();
  return b.ok() ? *std::move(b) : nullptr;
}

core::Collective OneRankOp(const core::MappedBuffer& b, absl::Duration timeout) {
  core::Collective op;
  op.kind = v1::ALL_REDUCE;
  op.reduce_op = v1::SUM;
  op.dtype = v1::FLOAT32;
  op.count = 16;
  op.group_size = 1;
  op.deadline = absl::Now() + timeout;
  op.label = "all_reduce job=j group=0 seq=0";
  op.local.push_back({0, {{b.data(), 16, &b}}, {}});
  return op;
}

TEST_F(NcclBackendTest, ABufferItsTrainerLetGoWhileItsOpRunsIsUnmappedOnlyOnceTheStreamIsDone) {
  ipc::CudaImporter importer(&gpu_);
  std::shared_ptr<core::MappedBuffer> buffer = ImportedBuffer(gpu_, importer);
  ASSERT_NE(buffer, nullptr);
  gpu_.streams_hang = true;  // the kernel runs long
  core::Collective op = OneRankOp(*buffer, absl::Seconds(20));
  op.keep_alive = buffer;  // as the engine's pins
  ASSERT_TRUE(Make(Spec({0}, 1, "0"))->Run(op).ok());
  op.keep_alive.reset();        // the engine answered and let go of the op
  buffer.reset();               // the trainer deregistered the buffer (or its session ended)
  EXPECT_EQ(gpu_.Closes(), 0);  // the launched op keeps the mapping
  EXPECT_EQ(backend_.LaunchedOps(), 1u);
  gpu_.streams_hang = false;  // the kernel finishes
  ASSERT_TRUE(Eventually([&] { return gpu_.Closes() == 1; }));
  EXPECT_EQ(gpu_.closes_while_busy, 0);
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 0);
}

// torch's allocator frees a block's allocation and hands the same address out again (between a
// benchmark's sizes, empty_cache, an out-of-memory retry): each round registers the new
// allocation (a new IPC handle at the same address), runs an op on it, and lets it go at once,
// while the op still runs on the stream. CUDA refuses the new handle as long as the old
// mapping is open; the importer maps it once the launched op settled and its mapping closed.
TEST_F(NcclBackendTest, AThousandReallocationsAtOneAddressEachRegisterAndRunOnceTheLastSettled) {
  ipc::CudaImporter importer(&gpu_, absl::Seconds(5));
  gpu_.op_time = absl::Microseconds(300);  // each op runs a while after its answer
  auto comm = Make(Spec({0}, 1, "0"));
  constexpr int kRounds = 1000;
  const absl::Time give_up = absl::Now() + absl::Seconds(60);
  int rounds = 0;
  for (; rounds < kRounds && absl::Now() < give_up; ++rounds) {
    std::string handle(gpu::kIpcHandleBytes, 'm');
    std::memcpy(handle.data(), &rounds, sizeof(rounds));  // each allocation its own handle
    gpu_.exported[handle] = 1 << 20;
    gpu_.exported_at[handle] = {::getpid() + 1, 0x20000000};  // always the same address
    v1::RegisterBufferRequest r;
    r.set_bytes(4096);
    v1::CudaIpcBuffer* c = r.mutable_cuda();
    c->set_mem_handle(handle);
    c->set_device(0);
    c->set_ready_event(std::string(gpu::kIpcHandleBytes, 'r'));
    c->set_done_event(std::string(gpu::kIpcHandleBytes, 'd'));
    c->set_pid(::getpid() + 1);
    absl::StatusOr<std::unique_ptr<core::MappedBuffer>> b = importer.Import(r);
    ASSERT_TRUE(b.ok()) << "round " << rounds << ": " << b.status();
    std::shared_ptr<core::MappedBuffer> buffer = *std::move(b);
    core::Collective op = OneRankOp(*buffer, absl::Seconds(5));
    op.seq = rounds;
    op.keep_alive = buffer;
    ASSERT_TRUE(comm->Run(op).ok()) << "round " << rounds;
    // Answered, deregistered, freed: only the launched op holds the mapping now.
  }
  EXPECT_EQ(rounds, kRounds);
  EXPECT_GT(gpu_.AlreadyMappedRefusals(), 0);  // the case the test is about did happen
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  EXPECT_EQ(importer.open_allocations(), 0);
  EXPECT_EQ(gpu_.Closes(), kRounds);
  EXPECT_EQ(gpu_.closes_while_busy, 0);
  EXPECT_EQ(gpu_.DestroyedEventUses(), 0);
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.EventsOpen(), 0);
}

TEST_F(NcclBackendTest, EachNcclCallNamesItsCommunicatorsDeviceToMakeCurrent) {
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 1}, {1, 0}}, 2)).ok());
  EXPECT_EQ(gpu_.call_devices, (std::vector<int>{1, 0}));
}

TEST(NcclEnvironmentTest, ABlockingCommunicatorEnvironmentIsRefusedNamingTheVariable) {
  EXPECT_TRUE(gpu::CheckNcclEnvironment(nullptr).ok());
  EXPECT_TRUE(gpu::CheckNcclEnvironment("0").ok());
  absl::Status s = gpu::CheckNcclEnvironment("1");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("NCCL_COMM_BLOCKING=1"), std::string::npos) << s;
}

// Two groups' ops over one allocation, each through a registration of its own (what the
// Python package leases per op): each buffer's "done" marks its own op's end, whatever the
// other group launched since. (Through one shared registration the later op's record would
// replace the earlier's: the trainer would wait for the wrong group's stream.)
TEST_F(NcclBackendTest, TwoGroupsOpsOnOneAllocationEachMarkTheirOwnEndThroughTheirOwnDone) {
  ipc::CudaImporter importer(&gpu_);
  const std::string handle(gpu::kIpcHandleBytes, 'a');
  gpu_.exported[handle] = 1 << 20;
  auto registration = [&] {
    v1::RegisterBufferRequest r;
    r.set_bytes(4096);
    v1::CudaIpcBuffer* c = r.mutable_cuda();
    c->set_mem_handle(handle);
    c->set_device(0);
    c->set_ready_event(std::string(gpu::kIpcHandleBytes, 'r'));
    c->set_done_event(std::string(gpu::kIpcHandleBytes, 'd'));
    c->set_pid(::getpid() + 1);
    auto b = importer.Import(r);
    EXPECT_TRUE(b.ok()) << b.status();
    return std::shared_ptr<core::MappedBuffer>(*std::move(b));
  };
  std::shared_ptr<core::MappedBuffer> a = registration(), b = registration();
  EXPECT_EQ(importer.open_allocations(), 1);  // one mapping, two registrations
  gpu_.op_time = absl::Milliseconds(100);
  core::Collective op_a = OneRankOp(*a, absl::Seconds(5));
  op_a.keep_alive = a;
  core::Collective op_b = OneRankOp(*b, absl::Seconds(5));
  op_b.label = "all_reduce job=j group=1 seq=0";
  op_b.keep_alive = b;
  ASSERT_TRUE(Make(Spec({0}, 1, "0"))->Run(op_a).ok());
  ASSERT_TRUE(Make(Spec({0}, 1, "1"))->Run(op_b).ok());
  ASSERT_EQ(gpu_.calls.size(), 2u);
  EXPECT_NE(gpu_.calls[0].stream, gpu_.calls[1].stream);  // the groups' own streams
  EXPECT_EQ(gpu_.recorded_for(a->done_event()), 0);
  EXPECT_EQ(gpu_.recorded_for(b->done_event()), 1);
  op_a.keep_alive.reset();
  op_b.keep_alive.reset();
  a.reset();
  b.reset();
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  EXPECT_EQ(importer.open_allocations(), 0);
}

TEST_F(NcclBackendTest, AfterAnAbortTheBufferIsReleasedOnlyOnceTheStreamIsIdle) {
  ipc::CudaImporter importer(&gpu_);
  std::shared_ptr<core::MappedBuffer> buffer = ImportedBuffer(gpu_, importer);
  ASSERT_NE(buffer, nullptr);
  gpu_.streams_hang = true;    // NCCL's kernel waits for a peer that never comes
  gpu_.busy_after_abort = 20;  // and still runs a while after ncclCommAbort has returned
  core::Collective op = OneRankOp(*buffer, absl::Milliseconds(100));
  op.keep_alive = buffer;
  auto comm = Make(Spec({0}, 1, "0"));
  ASSERT_TRUE(comm->Run(op).ok());
  op.keep_alive.reset();
  buffer.reset();  // only the launched op holds the mapping now
  // At its deadline the watcher aborts it, drains the stream, then lets the mapping go.
  ASSERT_TRUE(Eventually([&] { return gpu_.Closes() == 1; }));
  EXPECT_FALSE(gpu_.StreamsBusy());
  EXPECT_EQ(gpu_.closes_while_busy, 0);
  const auto at = [&](const std::string& prefix, bool last) {
    std::vector<size_t> found;
    for (size_t i = 0; i < gpu_.log.size(); ++i) {
      if (absl::StartsWith(gpu_.log[i], prefix)) found.push_back(i);
    }
    return found.empty() ? std::string::npos : (last ? found.back() : found.front());
  };
  EXPECT_EQ(Count("busy"), 20);  // the stream was asked until it said idle
  EXPECT_LT(at("abort", false), at("busy", false));
  EXPECT_LT(at("busy", true), at("close", false));
  std::unique_ptr<core::MappedBuffer> again = ImportedBuffer(gpu_, importer);
  absl::Status s = comm->Run(OneRankOp(*again, absl::Seconds(5)));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "did not finish on the GPU by its deadline")) << s;
  EXPECT_FALSE(absl::StrContains(s.message(), "abandoned")) << s;
}

TEST_F(NcclBackendTest, StreamsStillBusyAfterTheBoundedWaitAreAbandonedAndSaidSo) {
  FakeGpu gpu;
  NcclOptions options;
  options.abort_drain = absl::Milliseconds(100);
  NcclBackend backend(&gpu, options);
  ipc::CudaImporter importer(&gpu);
  std::unique_ptr<core::MappedBuffer> buffer = ImportedBuffer(gpu, importer);
  ASSERT_NE(buffer, nullptr);
  auto sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(16);
  std::shared_ptr<spdlog::logger> log = logging::Logger("nccl");
  log->sinks().push_back(sink);
  gpu.streams_hang = true;
  gpu.kernels_survive_abort = true;  // the aborted kernel never ends
  auto comm = *backend.CreateCommunicator(Spec({0}, 1, "0"));
  ASSERT_TRUE(comm->Run(OneRankOp(*buffer, absl::Milliseconds(100))).ok());
  // Bounded: the deadline, then abort_drain; then the streams are abandoned (destroyed), not
  // queued behind at the next op.
  ASSERT_TRUE(Eventually([&] { return gpu.Aborts() == 1 && gpu.StreamsOpen() == 0; }));
  ASSERT_TRUE(Eventually([&] { return backend.LaunchedOps() == 0; }));
  ASSERT_TRUE(backend.FlushAborts());
  log->sinks().pop_back();
  bool logged = false;
  for (const std::string& line : sink->last_formatted()) {
    logged = logged || absl::StrContains(line, "nccl streams still busy after abort, abandoned");
  }
  EXPECT_TRUE(logged);
  gpu.streams_hang = false;
  gpu.kernels_survive_abort = false;
  absl::Status s = comm->Run(OneRankOp(*buffer, absl::Seconds(5)));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "did not finish on the GPU by its deadline")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "still busy 100ms after ncclCommAbort")) << s;
  ASSERT_TRUE(comm->Run(OneRankOp(*buffer, absl::Seconds(5))).ok());
  EXPECT_EQ(std::count_if(gpu.log.begin(), gpu.log.end(),
                          [](auto& l) { return absl::StartsWith(l, "stream d0"); }),
            2);  // a fresh stream
}

TEST_F(NcclBackendTest, CommunicatorsThatNeverInitialiseFailAtTheDeadline) {
  gpu_.never_ready = true;
  auto comm = Make(Spec({0, 1}, 2));
  absl::Status s = comm->Run(AllReduce({{0, 0}, {1, 1}}, 2, 0, absl::Milliseconds(100)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "not ready by the deadline")) << s;
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.aborts, 2);
  EXPECT_EQ(Count("coll"), 0);
}

TEST_F(NcclBackendTest, SlowInitialisationIsPolledUntilReady) {
  gpu_.init_polls = 5;
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  EXPECT_EQ(Count("coll"), 2);
}

TEST_F(NcclBackendTest, TheUniqueIdTravelsThroughTheJobsStoreBetweenNodes) {
  store::MemoryStore store;
  FakeGpu gpu_b;
  NcclBackend node_b(&gpu_b);
  auto a = Make(Spec({0}, 2, "world", &store));  // this node: rank 0
  auto b = *node_b.CreateCommunicator(Spec({1}, 2, "world", &store));
  absl::Status sb;
  std::thread t([&] { sb = b->Run(AllReduce({{1, 0}}, 2, 7)); });
  absl::SleepFor(absl::Milliseconds(50));  // node B waits for the id
  absl::Status sa = a->Run(AllReduce({{0, 0}}, 2, 7));
  t.join();
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sb.ok()) << sb;
  ASSERT_EQ(gpu_.ids.size(), 1u);
  ASSERT_EQ(gpu_b.ids.size(), 1u);
  EXPECT_EQ(gpu_.ids[0], gpu_b.ids[0]);
  EXPECT_EQ(gpu_b.log[1], "init h1 d0 rank 1/2");
}

TEST_F(NcclBackendTest, AMissingRootNodeIsNamedAtTheDeadline) {
  store::MemoryStore store;
  auto b = Make(Spec({1}, 2, "world", &store));
  absl::Status s = b->Run(AllReduce({{1, 0}}, 2, 0, absl::Milliseconds(100)));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "never came from the node of rank 0")) << s;
}

TEST_F(NcclBackendTest, RefusesMixedDeviceOps) {
  auto comm = Make(Spec({0, 1}, 2));
  core::Collective host = AllReduce({{0, 0}, {1, 1}}, 2);
  host.local[1].input[0].buffer = nullptr;
  EXPECT_EQ(comm->Run(host).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(backend_.comm_inits(), 0);
}

TEST_F(NcclBackendTest, AFusedAllReduceRunsAsOneGroupOfCallsPerSegmentOnEveryLocalRank) {
  auto comm = Make(Spec({0, 1}, 2));
  // Each rank: segments of 4 and 12 floats in buffer x (a gap between them) and 8 in buffer y.
  const DeviceBuffer& x0 = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& y0 = BufferAt(0x9100'0000, 0, 1010);
  const DeviceBuffer& x1 = BufferAt(0x9200'0000, 1, 1020);
  const DeviceBuffer& y1 = BufferAt(0x9300'0000, 1, 1030);
  core::Collective op = Fused({{0, {Seg(x0, 0, 4), Seg(x0, 8, 12), Seg(y0, 0, 8)}},
                               {1, {Seg(x1, 100, 4), Seg(x1, 200, 12), Seg(y1, 40, 8)}}},
                              2);
  ASSERT_TRUE(comm->Run(op).ok());
  const std::vector<std::string> want = {
      "group_start", "init h1 d0 rank 0/2", "init h2 d1 rank 1/2", "group_end",
      // Each buffer's "ready" once, on the host.
      "query h1001", "query h1011", "query h1021", "query h1031", "stream d0 h3", "stream d1 h4",
      // One group: segment by segment, every local rank's call.
      "group_start", "coll1 h1 h3 n=4 inplace", "coll1 h2 h4 n=4 inplace",
      "coll1 h1 h3 n=12 inplace", "coll1 h2 h4 n=12 inplace", "coll1 h1 h3 n=8 inplace",
      "coll1 h2 h4 n=8 inplace", "group_end",
      // Each written buffer's "done" once.
      "record h1002 h3", "record h1012 h3", "record h1022 h4", "record h1032 h4",
      // The daemon's mark of the op's end on each stream.
      "record h5 h3", "record h6 h4"};
  EXPECT_EQ(gpu_.log, want);
  ASSERT_EQ(gpu_.calls.size(), 6u);
  const std::vector<std::byte*> at = {x0.data(),       x1.data() + 400, x0.data() + 32,
                                      x1.data() + 800, y0.data(),       y1.data() + 160};
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(gpu_.calls[i].send, at[i]) << i;
    EXPECT_EQ(gpu_.calls[i].recv, at[i]) << i;
    EXPECT_EQ(gpu_.calls[i].reduce_op, v1::SUM);
    EXPECT_EQ(gpu_.calls[i].dtype, v1::FLOAT32);
  }
}

TEST_F(NcclBackendTest, SegmentsContiguousOnEveryLocalRankMergeIntoOneCall) {
  auto comm = Make(Spec({0, 1}, 2));
  const DeviceBuffer& x0 = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& x1 = BufferAt(0x9200'0000, 1, 1020);
  const DeviceBuffer& y1 = BufferAt(0x9300'0000, 1, 1030);
  // [4, 12, 8]: 4 and 12 follow each other on both ranks; 12 and 8 only on rank 0.
  ASSERT_TRUE(comm->Run(Fused({{0, {Seg(x0, 0, 4), Seg(x0, 4, 12), Seg(x0, 16, 8)}},
                               {1, {Seg(x1, 10, 4), Seg(x1, 14, 12), Seg(y1, 0, 8)}}},
                              2))
                  .ok());
  ASSERT_EQ(gpu_.calls.size(), 4u);
  EXPECT_EQ(gpu_.calls[0].count, 16);
  EXPECT_EQ(gpu_.calls[0].send, x0.data());
  EXPECT_EQ(gpu_.calls[1].count, 16);
  EXPECT_EQ(gpu_.calls[1].send, x1.data() + 40);
  EXPECT_EQ(gpu_.calls[2].count, 8);
  EXPECT_EQ(gpu_.calls[2].send, x0.data() + 64);
  EXPECT_EQ(gpu_.calls[3].count, 8);
  EXPECT_EQ(gpu_.calls[3].send, y1.data());
  // Contiguous on both: one call each, as an op on one segment.
  gpu_.calls.clear();
  ASSERT_TRUE(comm->Run(Fused({{0, {Seg(x0, 0, 4), Seg(x0, 4, 12), Seg(x0, 16, 8)}},
                               {1, {Seg(x1, 0, 4), Seg(x1, 4, 12), Seg(x1, 16, 8)}}},
                              2, 1))
                  .ok());
  ASSERT_EQ(gpu_.calls.size(), 2u);
  EXPECT_EQ(gpu_.calls[0].count, 24);
  EXPECT_EQ(gpu_.calls[1].count, 24);
}

TEST_F(NcclBackendTest, LocalRanksWithDifferentSegmentationsAreADesyncAndNcclIsNeverCalled) {
  auto comm = Make(Spec({0, 1}, 2));
  const DeviceBuffer& x0 = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& x1 = BufferAt(0x9200'0000, 1, 1020);
  absl::Status s =
      comm->Run(Fused({{0, {Seg(x0, 0, 4), Seg(x0, 4, 12)}}, {1, {Seg(x1, 0, 16)}}}, 2));
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_TRUE(absl::StrContains(
      s.message(),
      "desync in all_reduce job=j group=world seq=0: rank 0 has segments [4,12] but rank 1 has "
      "[16]"))
      << s;
  EXPECT_TRUE(gpu_.log.empty()) << absl::StrJoin(gpu_.log, "; ");  // not even communicators
  EXPECT_EQ(backend_.comm_inits(), 0);
}

TEST_F(NcclBackendTest, AFusedBroadcastRunsSegmentBySegmentFromTheRoot) {
  auto comm = Make(Spec({0, 1}, 2));
  const DeviceBuffer& x0 = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& x1 = BufferAt(0x9200'0000, 1, 1020);
  core::Collective op =
      Fused({{0, {Seg(x0, 0, 4), Seg(x0, 8, 4)}}, {1, {Seg(x1, 0, 4), Seg(x1, 8, 4)}}}, 2);
  op.kind = v1::BROADCAST;
  op.root = 1;
  ASSERT_TRUE(comm->Run(op).ok());
  ASSERT_EQ(gpu_.calls.size(), 4u);
  for (const gpu::NcclCall& call : gpu_.calls) {
    EXPECT_EQ(call.kind, v1::BROADCAST);
    EXPECT_EQ(call.root, 1);
    EXPECT_EQ(call.count, 4);
  }
  EXPECT_EQ(gpu_.calls[3].send, x1.data() + 32);
}

TEST_F(NcclBackendTest, AllGatherTakesOneRangePerSideAdjacentSegmentsMerged) {
  auto comm = Make(Spec({0, 1}, 2));
  const DeviceBuffer& x0 = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& x1 = BufferAt(0x9200'0000, 1, 1020);
  auto gather = [&](core::View in0, core::View in1) {
    core::Collective op;
    op.kind = v1::ALL_GATHER;
    op.dtype = v1::FLOAT32;
    op.count = 8;
    op.group_size = 2;
    op.deadline = absl::Now() + absl::Seconds(5);
    op.label = "all_gather job=j group=world seq=0";
    op.local.push_back({0, std::move(in0), {Seg(x0, 100, 16)}});
    op.local.push_back({1, std::move(in1), {Seg(x1, 100, 16)}});
    return op;
  };
  // Rank 1's input in two separate ranges: refused before NCCL, saying why.
  absl::Status s = comm->Run(gather({Seg(x0, 0, 8)}, {Seg(x1, 0, 4), Seg(x1, 8, 4)}));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1's input is in 2")) << s;
  EXPECT_TRUE(gpu_.calls.empty());
  // Adjacent: one call per rank over the whole range.
  ASSERT_TRUE(comm->Run(gather({Seg(x0, 0, 8)}, {Seg(x1, 0, 4), Seg(x1, 4, 4)})).ok());
  ASSERT_EQ(gpu_.calls.size(), 2u);
  EXPECT_EQ(gpu_.calls[1].count, 8);
  EXPECT_EQ(gpu_.calls[1].send, x1.data());
  EXPECT_EQ(gpu_.calls[1].recv, x1.data() + 400);
}

TEST_F(NcclBackendTest, JobEndDropsItsCommunicatorsAndStreams) {
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.streams_open, 2);
  backend_.JobEnded("j");
  ASSERT_TRUE(backend_.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu_.aborts, 2);
  EXPECT_EQ(gpu_.streams_open, 0);
  ASSERT_TRUE(Make(Spec({0, 1}, 2))->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  EXPECT_EQ(backend_.comm_inits(), 4);  // a new job with the same id starts afresh
}

TEST_F(NcclBackendTest, JobEndWaitsForTheJobsLaunchedOpsToFinishThenDropsTheCommunicators) {
  FakeGpu gpu;
  core::OpCounters counters;
  NcclOptions options;
  options.counters = &counters;
  NcclBackend backend(&gpu, options);
  gpu.streams_hang = true;
  ASSERT_TRUE((*backend.CreateCommunicator(Spec({0, 1}, 2)))
                  ->Run(AllReduce({{0, 0}, {1, 1}}, 2, 0, absl::Seconds(20)))
                  .ok());
  std::thread finish([&] {
    absl::SleepFor(absl::Milliseconds(100));
    gpu.streams_hang = false;  // the GPU finishes the job's last op
  });
  backend.JobEnded("j");
  finish.join();
  EXPECT_EQ(backend.LaunchedOps(), 0u);
  EXPECT_EQ(counters.nccl_launched_failures.load(), 0u);  // it finished: not aborted under it
  ASSERT_TRUE(backend.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 2);  // then dropped
  EXPECT_EQ(gpu.StreamsOpen(), 0);
  EXPECT_EQ(gpu.EventsOpen(), 0);
}

TEST_F(NcclBackendTest, JobEndAbortsALaunchedOpThatHangsPastItsDeadline) {
  FakeGpu gpu;
  core::OpCounters counters;
  NcclOptions options;
  options.counters = &counters;
  NcclBackend backend(&gpu, options);
  ipc::CudaImporter importer(&gpu);
  std::shared_ptr<core::MappedBuffer> buffer = ImportedBuffer(gpu, importer);
  ASSERT_NE(buffer, nullptr);
  gpu.streams_hang = true;  // never finishes
  core::Collective op = OneRankOp(*buffer, absl::Milliseconds(200));
  op.keep_alive = buffer;
  ASSERT_TRUE((*backend.CreateCommunicator(Spec({0}, 1, "0")))->Run(op).ok());
  op.keep_alive.reset();
  buffer.reset();
  backend.JobEnded("j");  // bounded by the op's deadline
  EXPECT_EQ(backend.LaunchedOps(), 0u);
  EXPECT_EQ(counters.nccl_launched_failures.load(), 1u);
  ASSERT_TRUE(backend.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu.Aborts(), 1);
  EXPECT_EQ(gpu.Closes(), 1);  // the mapping went after the drain
  EXPECT_EQ(gpu.closes_while_busy, 0);
  ASSERT_TRUE(backend.FlushAborts());
  EXPECT_EQ(gpu.StreamsOpen(), 0);
}

TEST_F(NcclBackendTest, JobEndDoesNotWaitForeverForALaunchedOpWithNoDeadline) {
  FakeGpu gpu;
  NcclOptions options;
  options.abort_drain = absl::Milliseconds(100);
  NcclBackend backend(&gpu, options);
  gpu.streams_hang = true;  // never finishes
  core::Collective op = AllReduce({{0, 0}, {1, 1}}, 2);
  op.deadline = absl::InfiniteFuture();  // a Collective's default: nothing ends its watch
  ASSERT_TRUE((*backend.CreateCommunicator(Spec({0, 1}, 2)))->Run(op).ok());
  absl::Notification ended;
  std::thread end([&] {
    backend.JobEnded("j");
    ended.Notify();
  });
  const bool returned = ended.WaitForNotificationWithTimeout(absl::Seconds(10));
  gpu.streams_hang = false;  // lets a JobEnded that waits for the GPU return too
  end.join();
  EXPECT_TRUE(returned) << "JobEnded waited for a launched op with no deadline";
  EXPECT_EQ(backend.LaunchedOps(), 0u);
  ASSERT_TRUE(backend.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 2);
  EXPECT_EQ(gpu.StreamsOpen(), 0);
  EXPECT_EQ(gpu.EventsOpen(), 0);
}

TEST_F(NcclBackendTest, TheWatchdogAbortsFailedIdleCommunicatorsAndTellsTheOtherNodes) {
  store::MemoryStore store;
  FakeGpu gpu;
  NcclOptions options;
  options.watch_every = absl::Milliseconds(5);
  NcclBackend watched(&gpu, options);
  core::CommunicatorSpec world = Spec({0}, 2, "world", &store);  // rank 1 is on another node
  world.node = "a:7451";
  auto spanning = *watched.CreateCommunicator(world);
  auto local = *watched.CreateCommunicator(Spec({0, 1}, 2, "0,1"));
  ASSERT_TRUE(spanning->Run(AllReduce({{0, 0}}, 2)).ok());
  ASSERT_TRUE(local->Run(AllReduce({{0, 0}, {1, 1}}, 2)).ok());
  ASSERT_TRUE(Eventually([&] { return watched.LaunchedOps() == 0; }));  // idle now
  absl::SleepFor(absl::Milliseconds(30));
  ASSERT_TRUE(watched.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 0);  // healthy idle communicators stay
  gpu.SetAsyncError(absl::UnavailableError("remote process exited"));
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while (gpu.Aborts() < 3 && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(watched.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 3);  // both groups of the job, together
  auto told = store.Get("j", "nccl/world/broken/0", absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(told.ok()) << told.status();
  EXPECT_TRUE(absl::StrContains(*told, "node a:7451 (ranks 0)")) << *told;
  EXPECT_TRUE(absl::StrContains(*told, "idle NCCL communicators of job=j")) << *told;
  EXPECT_TRUE(absl::StrContains(*told, "remote process exited")) << *told;
  gpu.SetAsyncError(absl::OkStatus());
  ASSERT_TRUE(local->Run(AllReduce({{0, 0}, {1, 1}}, 2, 1)).ok());
  EXPECT_EQ(watched.comm_inits(), 5);  // rebuilt
}

TEST_F(NcclBackendTest, ARestartedJobReusesCommunicatorsKeptOnItsNode) {
  FakeGpu gpu;
  store::MemoryStore store;
  NcclOptions options;
  options.watch_every = absl::Milliseconds(5);
  options.keep_after_job = absl::Milliseconds(300);
  NcclBackend keeping(&gpu, options);
  core::CommunicatorSpec spanning = Spec({0}, 2, "world", &store);  // rank 1: another node
  spanning.node = "a:7451";
  ASSERT_TRUE((*keeping.CreateCommunicator(Spec({0, 1}, 2, "0,1")))
                  ->Run(AllReduce({{0, 0}, {1, 1}}, 2))
                  .ok());
  ASSERT_TRUE((*keeping.CreateCommunicator(spanning))->Run(AllReduce({{0, 0}}, 2)).ok());
  EXPECT_EQ(keeping.comm_inits(), 3);
  keeping.JobEnded("j");               // the trainers exited
  ASSERT_TRUE(keeping.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu.Aborts(), 1);          // the group spanning nodes: every node rebuilds it
  // The trainers start again: same job id, same ranks on the same devices.
  ASSERT_TRUE((*keeping.CreateCommunicator(Spec({0, 1}, 2, "0,1")))
                  ->Run(AllReduce({{0, 0}, {1, 1}}, 2))
                  .ok());
  ASSERT_TRUE((*keeping.CreateCommunicator(spanning))->Run(AllReduce({{0, 0}}, 2)).ok());
  EXPECT_EQ(keeping.comm_inits(), 4);  // only the spanning group's communicator is new
  // Ended again; another job builds on device 1: the kept ones make way for it at once.
  keeping.JobEnded("j");
  ASSERT_TRUE(keeping.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu.Aborts(), 2);
  core::CommunicatorSpec other = Spec({0}, 1, "0");
  other.job = "k";
  ASSERT_TRUE((*keeping.CreateCommunicator(other))->Run(AllReduce({{0, 1}}, 1)).ok());
  ASSERT_TRUE(keeping.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 4);
  keeping.JobEnded("k");
  // Nobody comes back: kept communicators go when their time is up (aborted, then their
  // streams closed: both are awaited).
  const absl::Time give_up = absl::Now() + absl::Seconds(5);
  while ((gpu.Aborts() < 5 || gpu.StreamsOpen() != 0) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(keeping.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 5);
  EXPECT_EQ(gpu.StreamsOpen(), 0);
  ASSERT_TRUE((*keeping.CreateCommunicator(Spec({0, 1}, 2, "0,1")))
                  ->Run(AllReduce({{0, 0}, {1, 1}}, 2))
                  .ok());
  EXPECT_EQ(keeping.comm_inits(), 7);
}

// Two nodes, one rank each, sharing the job's store: this test's backend is node A (rank 0),
// `b` node B (rank 1). Both build their communicators at op 0.
// A store whose synchronous calls wait at a gate once it is closed (its background waits do
// not): what a group's lock must never be held across.
class GatedStore final : public gradsync::Store {
 public:
  explicit GatedStore(gradsync::Store* inner) : inner_(inner) {}
  void Close() {
    absl::MutexLock lock(&mu_);
    open_ = false;
  }
  void Open() {
    absl::MutexLock lock(&mu_);
    open_ = true;
  }
  absl::Status Set(absl::string_view job, absl::string_view key, std::string value) override {
    Pass();
    return inner_->Set(job, key, std::move(value));
  }
  WaitId WaitAsync(absl::string_view job, std::vector<std::string> keys, absl::Time deadline,
                   WaitCallback done) override {
    return inner_->WaitAsync(job, std::move(keys), deadline, std::move(done));
  }
  void CancelWait(WaitId id) override { inner_->CancelWait(id); }
  absl::StatusOr<int64_t> Add(absl::string_view job, absl::string_view key,
                              int64_t delta) override {
    Pass();
    return inner_->Add(job, key, delta);
  }
  absl::StatusOr<CompareSetResult> CompareSet(absl::string_view job, absl::string_view key,
                                              std::optional<std::string> expected,
                                              std::string desired) override {
    Pass();
    return inner_->CompareSet(job, key, std::move(expected), std::move(desired));
  }
  absl::StatusOr<bool> Delete(absl::string_view job, absl::string_view key) override {
    Pass();
    return inner_->Delete(job, key);
  }
  absl::StatusOr<std::vector<std::string>> List(absl::string_view job,
                                                absl::string_view prefix) override {
    Pass();
    return inner_->List(job, prefix);
  }

 private:
  void Pass() {
    absl::MutexLock lock(&mu_);
    mu_.AwaitWithTimeout(absl::Condition(&open_), absl::Seconds(30));  // bounded
  }
  gradsync::Store* const inner_;
  absl::Mutex mu_;
  bool open_ ABSL_GUARDED_BY(mu_) = true;
};

class TwoNodesTest : public NcclBackendTest {
 protected:
  void SetUp() override {
    ASSERT_TRUE(store_.Set("j", core::kRunKey, "r2").ok());  // as the job's formation left it
    a_ = Make(NodeSpec({0}, "a:7451"));
    b_ = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451"));
    ASSERT_TRUE(RunBoth(0).first.ok());
  }
  // Node A's launched ops are settled while the store their watches read is still there.
  void TearDown() override { backend_.StopWatchdog(); }
  core::CommunicatorSpec NodeSpec(std::vector<int> local, const std::string& node,
                                  const std::string& group = "world") {
    core::CommunicatorSpec spec = Spec(std::move(local), 2, group, &store_);
    spec.node = node;
    spec.member_nodes = {"a:7451", "b:7451"};
    spec.run = "r2";
    return spec;
  }
  // Op `seq` on both nodes at once; A's with `a_failure` as its local failure.
  std::pair<absl::Status, absl::Status> RunBoth(uint64_t seq, absl::Status a_failure = {}) {
    core::Collective on_a = Op(0, seq);
    if (!a_failure.ok()) {
      on_a.local.clear();
      on_a.local_failure = a_failure;
    }
    return RunBoth(on_a, Op(1, seq));
  }
  // Op `seq` on both nodes, whose streams take `slow` (long enough to look at the store).
  std::pair<absl::Status, absl::Status> RunBothSlowly(uint64_t seq, absl::Duration slow) {
    gpu_.streams_hang = true;
    gpu_b_.streams_hang = true;
    std::thread finish([&] {
      absl::SleepFor(slow);
      gpu_.streams_hang = false;
      gpu_b_.streams_hang = false;
    });
    auto result = RunBoth(seq);
    finish.join();
    return result;
  }
  std::pair<absl::Status, absl::Status> RunBoth(const core::Collective& on_a,
                                                const core::Collective& on_b) {
    absl::Status sb;
    std::thread t([&] { sb = b_->Run(on_b); });
    absl::Status sa = a_->Run(on_a);
    t.join();
    return {sa, sb};
  }
  // Rank `rank`'s all-reduce `seq` (on its node's device 0), with a deadline 20 s away.
  core::Collective Op(int rank, uint64_t seq) {
    core::Collective op = AllReduce({{rank, 0}}, 2, seq, absl::Seconds(20));
    op.fingerprint = absl::StrCat("all_reduce(mean, float32, count=16) seq=", seq);
    return op;
  }

  store::MemoryStore store_;
  // A test's gated view of store_: gone after node B's backend and after TearDown stopped node
  // A's watchdog, so no settling op's watch (its publisher thread) outlives it.
  std::unique_ptr<GatedStore> gated_;
  FakeGpu gpu_b_;
  NcclBackend b_backend_{&gpu_b_};
  std::shared_ptr<core::Communicator> a_, b_;
};

TEST_F(TwoNodesTest, FastOpsLeaveTheStoreAlone) {
  for (uint64_t seq = 1; seq < 5; ++seq) ASSERT_TRUE(RunBoth(seq).second.ok());
  EXPECT_EQ(*store_.List("j", "nccl/"), std::vector<std::string>{"nccl/r2/world/0/id"});
}

TEST_F(TwoNodesTest, OnlyTheOldestLaunchedOpOfAGroupWatchesTheStore) {
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  gpu_.streams_hang = true;  // the GPUs are behind: every op stays launched
  gpu_b_.streams_hang = true;
  constexpr uint64_t kOps = 8;
  for (uint64_t seq = 1; seq <= kOps; ++seq) {
    auto [sa, sb] = RunBoth(seq);
    ASSERT_TRUE(sa.ok()) << sa;
    ASSERT_TRUE(sb.ok()) << sb;
  }
  const std::string ops = "nccl/r2/world/op/";
  // Past PeerFailureWatch::kWatchAfter the watchers publish the fingerprint of what they watch.
  ASSERT_TRUE(Eventually([&] {
    absl::StatusOr<std::vector<std::string>> keys = store_.List("j", ops + "1/");
    return keys.ok() && keys->size() == 2;
  }));
  absl::SleepFor(3 * PeerFailureWatch::kWatchAfter);  // every op is past it now
  EXPECT_EQ(*store_.List("j", ops),
            (std::vector<std::string>{ops + "1/a:7451", ops + "1/b:7451"}));  // one watch each
  gpu_.streams_hang = false;
  gpu_b_.streams_hang = false;
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  ASSERT_TRUE(backend_.FlushAborts());
  ASSERT_TRUE(b_backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 0);
  EXPECT_EQ(gpu_b_.Aborts(), 0);
}

TEST_F(TwoNodesTest, KeysOfAnEarlierRunOfTheJobAreNotHeard) {
  // Written late by a node of the job's last run, after the root had deleted that run's keys.
  ASSERT_TRUE(store_.Set("j", "nccl/r1/world/fail/1", "node b:7451 (ranks 1): old news").ok());
  ASSERT_TRUE(store_.Set("j", "nccl/r1/world/broken/0", "node b:7451 (ranks 1): old news").ok());
  auto [sa, sb] = RunBothSlowly(1, absl::Milliseconds(300));  // both nodes look at the store
  EXPECT_TRUE(sa.ok()) << sa;
  EXPECT_TRUE(sb.ok()) << sb;
  EXPECT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  ASSERT_TRUE(backend_.FlushAborts());
  ASSERT_TRUE(b_backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 0);
  EXPECT_EQ(gpu_b_.Aborts(), 0);
}

TEST_F(TwoNodesTest, ANodeThatFailsAnOpItselfTellsTheOthersWhoseLaunchedOpThenFails) {
  ASSERT_TRUE(Eventually([&] { return b_backend_.LaunchedOps() == 0; }));
  gpu_b_.streams_hang = true;  // B's ranks wait in NCCL for A's, which never come
  auto [sa, sb] = RunBoth(1, absl::FailedPreconditionError("desync: rank 0 submitted broadcast"));
  EXPECT_EQ(sa.code(), absl::StatusCode::kFailedPrecondition) << sa;
  EXPECT_TRUE(sb.ok()) << sb;  // launched: answered before A's word could come
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 1);  // A skipped op 1: its communicator is out of step
  // B's watcher hears A's word with no further op (not at B's deadline of 20 s).
  ASSERT_TRUE(Eventually([&] { return gpu_b_.Aborts() == 1; }));
  gpu_b_.streams_hang = false;
  absl::Status b2 = b_->Run(Op(1, 2));
  EXPECT_EQ(b2.code(), absl::StatusCode::kAborted) << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(),
                                "all_reduce job=j group=world seq=1 failed after "
                                "it was launched"))
      << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(), "node a:7451 (ranks 0)")) << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(), "desync: rank 0 submitted broadcast")) << b2;
  // Both build again at the next op, with one id.
  auto [a3, b3] = RunBoth(3);
  ASSERT_TRUE(a3.ok()) << a3;
  ASSERT_TRUE(b3.ok()) << b3;
  EXPECT_EQ(gpu_b_.ids.back(), gpu_.ids.back());
  EXPECT_EQ(backend_.comm_inits(), 2);
  EXPECT_EQ(b_backend_.comm_inits(), 2);
  // The id of the communicators built at op 0 went with the rebuild.
  auto keys = *store_.List("j", "nccl/r2/world/");
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "nccl/r2/world/0/id"), 0);
  EXPECT_EQ(std::count(keys.begin(), keys.end(), "nccl/r2/world/3/id"), 1);
}

TEST_F(TwoNodesTest, AFailureOnTheFirstOpReachesANodeWaitingForTheId) {
  auto late = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "other"));
  auto early = Make(NodeSpec({0}, "a:7451", "other"));
  absl::Status sb;
  std::thread t([&] { sb = late->Run(AllReduce({{1, 0}}, 2, 0, absl::Seconds(20))); });
  core::Collective failed = AllReduce({}, 2, 0);
  failed.local_failure = absl::DeadlineExceededError("rank 0 never submitted");
  EXPECT_EQ(early->Run(failed).code(), absl::StatusCode::kDeadlineExceeded);
  t.join();
  EXPECT_EQ(sb.code(), absl::StatusCode::kAborted) << sb;
  EXPECT_TRUE(absl::StrContains(sb.message(), "rank 0 never submitted")) << sb;
}

TEST_F(TwoNodesTest, AJobWideAbortEndsAnOpWaitingForItsIdAtOnce) {
  // B's first op on a new group waits for the NCCL id from node A (the group's rank 0), which
  // never comes: the peer watch finds A lost and aborts the job's communicators on B. The
  // waiting op fails with that reason, not at its deadline (it waits without the group's
  // lock, and the abort ends the wait).
  auto late = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "other"));
  absl::Status sb;
  absl::Notification returned;
  std::thread t([&] {
    sb = late->Run(AllReduce({{1, 0}}, 2, 0, absl::Seconds(20)));
    returned.Notify();
  });
  const absl::Status lost = absl::UnavailableError("node a:7451 (ranks 0) lost: no word for 1.5 s");
  // Until the op has begun (its group exists), an abort finds nothing: told again, bounded.
  for (int i = 0; i < 200 && !returned.WaitForNotificationWithTimeout(absl::Milliseconds(50));
       ++i) {
    late->Abort(lost);
  }
  t.join();
  EXPECT_EQ(sb.code(), absl::StatusCode::kUnavailable) << sb;
  EXPECT_TRUE(absl::StrContains(sb.message(), "node a:7451 (ranks 0) lost: no word for 1.5 s"))
      << sb;
}

TEST_F(TwoNodesTest, TheJobsEndDoesNotWaitBehindAnOpWaitingForItsId) {
  // No group lock is held across a store round trip: while B's op waits for its NCCL id, the
  // job's end on B (which takes every group's lock) returns at once.
  auto late = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "other"));
  absl::Status sb;
  std::atomic<bool> returned{false};
  std::thread t([&] {
    sb = late->Run(AllReduce({{1, 0}}, 2, 0, absl::Seconds(3)));
    returned = true;
  });
  absl::SleepFor(absl::Milliseconds(300));  // the op is waiting for the id by then
  b_backend_.JobEnded("j");
  EXPECT_FALSE(returned.load()) << "the job's end waited for the op: " << sb;
  t.join();
  EXPECT_EQ(sb.code(), absl::StatusCode::kDeadlineExceeded) << sb;
  EXPECT_TRUE(absl::StrContains(sb.message(), "never came from the node of rank 0")) << sb;
}

TEST_F(TwoNodesTest, ALaunchedOpsWatchMakesNoStoreCallUnderItsGroupsLock) {
  gated_ = std::make_unique<GatedStore>(&store_);
  GatedStore& gated = *gated_;
  core::CommunicatorSpec spec_a = NodeSpec({0}, "a:7451", "gated"),
                         spec_b = NodeSpec({1}, "b:7451", "gated");
  spec_a.rendezvous = spec_b.rendezvous = &gated;
  auto a = Make(spec_a);
  auto b = *b_backend_.CreateCommunicator(spec_b);
  auto run_both = [&](uint64_t seq) {
    absl::Status sb;
    std::thread t([&] { sb = b->Run(Op(1, seq)); });
    absl::Status sa = a->Run(Op(0, seq));
    t.join();
    return std::pair{sa, sb};
  };
  auto [a0, b0] = run_both(0);  // builds the communicators (the id through the store)
  ASSERT_TRUE(a0.ok()) << a0;
  ASSERT_TRUE(b0.ok()) << b0;
  gpu_.streams_hang = true;  // launched and answered, then still on the GPU
  gpu_b_.streams_hang = true;
  auto [a1, b1] = run_both(1);
  ASSERT_TRUE(a1.ok()) << a1;
  ASSERT_TRUE(b1.ok()) << b1;
  gated.Close();
  // Past PeerFailureWatch::kWatchAfter the launch watcher watches the op under the group's
  // lock: publishing its fingerprint and comparing the other node's would be store calls.
  absl::SleepFor(absl::Milliseconds(400));
  std::atomic<bool> looked{false};
  std::thread look([&] {
    (void)backend_.LaunchedOps();  // takes every group's lock
    looked = true;
  });
  for (int i = 0; i < 250 && !looked; ++i) absl::SleepFor(absl::Milliseconds(20));  // <= 5 s
  EXPECT_TRUE(looked.load()) << "a group's lock was held across a store call";
  gated.Open();
  look.join();
  gpu_.streams_hang = false;
  gpu_b_.streams_hang = false;
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
}

TEST_F(TwoNodesTest, ALostNodeAbortsTheJobsCommunicatorsThroughTheGroupsAbort) {
  auto b_pair = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "pair"));
  auto a_pair = Make(NodeSpec({0}, "a:7451", "pair"));
  absl::Status pair_b;
  std::thread t([&] { pair_b = b_pair->Run(AllReduce({{1, 0}}, 2, 0)); });
  ASSERT_TRUE(a_pair->Run(AllReduce({{0, 0}}, 2, 0)).ok());
  t.join();
  ASSERT_TRUE(pair_b.ok()) << pair_b;
  const int before = gpu_.aborts;
  // The peer watch found node B lost: the engine aborts the group's communicator.
  a_pair->Abort(absl::UnavailableError("node b:7451 (ranks 1) lost: no word for 1.5 s"));
  ASSERT_TRUE(backend_.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_GT(gpu_.aborts, before) << "the job's idle communicators on A were not aborted";
  a_pair->Abort(absl::UnavailableError("again"));  // idempotent: nothing left to abort
}

TEST_F(TwoNodesTest, EachGpuLaunchesItsTrainersOpsInTheirOrderSoGroupsOnOneGpuNeverDeadlock) {
  // Kernels finish once every rank's has started, a GPU starts them one at a time in launch
  // order (fake_gpu.h, FakeFabric).
  auto fabric = std::make_shared<testing::FakeFabric>();
  gpu_.SetFabric(fabric);
  gpu_b_.SetFabric(fabric);
  // Groups x and y of the job on both nodes, all on device 0; each trainer's program calls
  // x's op, then y's: their places in its order, as the engine gives them at submission.
  auto ax = Make(NodeSpec({0}, "a:7451", "x")), ay = Make(NodeSpec({0}, "a:7451", "y"));
  auto bx = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "x"));
  auto by = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "y"));
  auto in_order = [](core::Collective op, const std::shared_ptr<core::SubmitOrder>& order) {
    op.local[0].turn = core::Turn{order, order->Add()};
    return op;
  };
  auto order_a = std::make_shared<core::SubmitOrder>();
  auto order_b = std::make_shared<core::SubmitOrder>();
  const core::Collective x_a = in_order(Op(0, 0), order_a), y_a = in_order(Op(0, 0), order_a);
  const core::Collective x_b = in_order(Op(1, 0), order_b), y_b = in_order(Op(1, 0), order_b);
  absl::Status s_ax, s_ay, s_bx, s_by;
  // On node A, y's op reaches the data plane first (x waited for a local member, say); on
  // node B, x's. Each is answered (launched) and takes its trainer's next op's turn.
  std::thread a_y([&] {
    s_ay = ay->Run(y_a);
    order_a->Done(y_a.local[0].turn->index);
  });
  absl::SleepFor(absl::Milliseconds(200));
  std::thread a_x([&] {
    s_ax = ax->Run(x_a);
    order_a->Done(x_a.local[0].turn->index);
  });
  std::thread b([&] {
    s_bx = bx->Run(x_b);
    order_b->Done(x_b.local[0].turn->index);
    s_by = by->Run(y_b);
    order_b->Done(y_b.local[0].turn->index);
  });
  a_y.join();
  a_x.join();
  b.join();
  for (const absl::Status* s : {&s_ax, &s_ay, &s_bx, &s_by}) EXPECT_TRUE(s->ok()) << *s;
  // Both GPUs ran x, then y: every op finished, nothing waited for its deadline or was aborted.
  EXPECT_TRUE(Eventually([&] {
    return backend_.LaunchedOps() == 0 && b_backend_.LaunchedOps() == 0;
  })) << "the GPUs' kernels wait on each other";
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 0);
  // Node A built y's communicator first (its op came first), yet launched x's op first.
  std::vector<std::string> inits, colls;
  for (const std::string& line : gpu_.log) {
    const std::vector<std::string> w = absl::StrSplit(line, ' ');
    if (w[0] == "init") inits.push_back(w[1]);
    if (absl::StartsWith(w[0], "coll")) colls.push_back(w[1]);
  }
  ASSERT_GE(inits.size(), 3u);
  ASSERT_GE(colls.size(), 3u);
  const std::string y_comm = inits[inits.size() - 2], x_comm = inits.back();
  EXPECT_EQ(std::vector<std::string>(colls.end() - 2, colls.end()),
            (std::vector<std::string>{x_comm, y_comm}));
}

TEST_F(TwoNodesTest, AnElasticJobsEpochsBuildTheirDeviceGroupsAfreshGrownThenShrunk) {
  // Each membership of an elastic job is a job of its own ("j", "j.e1", ...): its device
  // groups are made afresh for its members, never the old communicators reused. Epoch 0 (nodes
  // A and B) ran in SetUp; node C joins (epoch 1, three ranks), then is lost (epoch 2, two).
  FakeGpu gpu_c;
  NcclBackend c_backend{&gpu_c};
  auto spec = [&](const std::string& job, int size, int rank, const std::string& node,
                  std::vector<std::string> nodes) {
    core::CommunicatorSpec s = Spec({rank}, size, "world", &store_);
    s.job = job;
    s.node = node;
    s.member_nodes = std::move(nodes);
    s.run = job + "-run";
    EXPECT_TRUE(store_.Set(job, core::kRunKey, s.run).ok());
    return s;
  };
  const std::vector<std::string> three = {"a:7451", "b:7451", "c:7451"};
  auto a1 = Make(spec("j.e1", 3, 0, "a:7451", three));
  auto b1 = *b_backend_.CreateCommunicator(spec("j.e1", 3, 1, "b:7451", three));
  auto c1 = *c_backend.CreateCommunicator(spec("j.e1", 3, 2, "c:7451", three));
  absl::Status on_b, on_c;
  std::thread tb([&] { on_b = b1->Run(AllReduce({{1, 0}}, 3, 0, absl::Seconds(20))); });
  std::thread tc([&] { on_c = c1->Run(AllReduce({{2, 0}}, 3, 0, absl::Seconds(20))); });
  const absl::Status on_a = a1->Run(AllReduce({{0, 0}}, 3, 0, absl::Seconds(20)));
  tb.join();
  tc.join();
  ASSERT_TRUE(on_a.ok() && on_b.ok() && on_c.ok()) << on_a << " " << on_b << " " << on_c;
  // One new group of three, its id agreed in epoch 1's namespace: not epoch 0's.
  EXPECT_EQ(gpu_.ids.back(), gpu_b_.ids.back());
  EXPECT_EQ(gpu_.ids.back(), gpu_c.ids.back());
  EXPECT_NE(gpu_.ids.back(), gpu_.ids.front());
  auto inits = [](FakeGpu& gpu, const std::string& what) {
    return std::count_if(gpu.log.begin(), gpu.log.end(), [&](const std::string& line) {
      return absl::StartsWith(line, "init ") && absl::EndsWith(line, what);
    });
  };
  EXPECT_EQ(inits(gpu_, "rank 0/3"), 1);
  EXPECT_EQ(inits(gpu_c, "rank 2/3"), 1);
  // Node C lost: the peer watch aborts the epoch's groups on the survivors.
  const int aborts = gpu_.aborts;
  a1->Abort(absl::UnavailableError("node c:7451 (ranks 2) lost: no word for 1.5 s"));
  b1->Abort(absl::UnavailableError("node c:7451 (ranks 2) lost: no word for 1.5 s"));
  ASSERT_TRUE(backend_.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_GT(gpu_.aborts, aborts);
  const std::vector<std::string> two = {"a:7451", "b:7451"};
  auto a2 = Make(spec("j.e2", 2, 0, "a:7451", two));
  auto b2 = *b_backend_.CreateCommunicator(spec("j.e2", 2, 1, "b:7451", two));
  std::thread tb2([&] { on_b = b2->Run(AllReduce({{1, 0}}, 2, 0, absl::Seconds(20))); });
  const absl::Status a_again = a2->Run(AllReduce({{0, 0}}, 2, 0, absl::Seconds(20)));
  tb2.join();
  ASSERT_TRUE(a_again.ok() && on_b.ok()) << a_again << " " << on_b;
  EXPECT_EQ(gpu_.ids.back(), gpu_b_.ids.back());
  EXPECT_NE(gpu_.ids.back(), gpu_c.ids.back());
  EXPECT_EQ(inits(gpu_b_, "rank 1/2"), 2);  // epoch 0's and epoch 2's
  EXPECT_EQ(inits(gpu_b_, "rank 1/3"), 1);
}

TEST_F(TwoNodesTest, CommunicatorsAbandonedOnOneNodeFailTheOthersNextOpAtOnce) {
  auto b_pair = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "pair"));
  auto a_pair = Make(NodeSpec({0}, "a:7451", "pair"));
  absl::Status pair_b;
  std::thread t([&] { pair_b = b_pair->Run(AllReduce({{1, 0}}, 2, 0)); });
  ASSERT_TRUE(a_pair->Run(AllReduce({{0, 0}}, 2, 0)).ok());
  t.join();
  ASSERT_TRUE(pair_b.ok()) << pair_b;
  // Another group of the job failed on A: A aborts its idle "world" communicators too (idle:
  // their earlier op has settled, else the abort would fail it and A's next op would say so).
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() == 0; }));
  backend_.AbortJob("j", absl::UnavailableError("group x: remote process exited"));
  ASSERT_TRUE(backend_.FlushAborts());  // aborts run on the aborter's thread
  EXPECT_EQ(gpu_.aborts, 2);
  // B's "world" communicators are live, so B's next op on them hangs (launched, answered); A
  // builds anew and waits for B's ranks, which never come.
  ASSERT_TRUE(Eventually([&] { return b_backend_.LaunchedOps() == 0; }));
  gpu_b_.streams_hang = true;
  gpu_.never_ready = true;
  auto [sa, sb] = RunBoth(1);
  EXPECT_TRUE(sb.ok()) << sb;
  // B's watcher hears that A abandoned them, aborts, and tells A it failed op 1.
  EXPECT_EQ(sa.code(), absl::StatusCode::kAborted) << sa;
  EXPECT_TRUE(absl::StrContains(sa.message(), "node b:7451 (ranks 1)")) << sa;
  EXPECT_TRUE(absl::StrContains(sa.message(), "abandoned")) << sa;
  // B failed on A's word: only that group went, B's "pair" communicator lives on.
  ASSERT_TRUE(Eventually([&] { return gpu_b_.Aborts() == 1; }));
  gpu_b_.streams_hang = false;
  gpu_.never_ready = false;
  absl::Status b2 = b_->Run(Op(1, 2));
  EXPECT_EQ(b2.code(), absl::StatusCode::kAborted) << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(), "seq=1 failed after it was launched")) << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(), "remote process exited")) << b2;
  ASSERT_TRUE(b_backend_.FlushAborts());
  EXPECT_EQ(gpu_b_.Aborts(), 1);
  // The next op builds on both nodes again.
  auto [a3, b3] = RunBoth(3);
  ASSERT_TRUE(a3.ok()) << a3;
  ASSERT_TRUE(b3.ok()) << b3;
  EXPECT_EQ(gpu_b_.ids.back(), gpu_.ids.back());
}

TEST_F(TwoNodesTest, AnOpThatFailedHereKeepsItsReasonAndNamesTheEarlierLaunchedOpsFailure) {
  ASSERT_TRUE(Eventually([&] { return b_backend_.LaunchedOps() == 0; }));
  gpu_b_.streams_hang = true;
  EXPECT_TRUE(b_->Run(Op(1, 1)).ok());  // launched
  gpu_b_.SetAsyncError(absl::UnavailableError("remote process exited"));
  ASSERT_TRUE(Eventually([&] { return gpu_b_.Aborts() == 1; }));
  gpu_b_.streams_hang = false;
  gpu_b_.SetAsyncError(absl::OkStatus());
  core::Collective failed = Op(1, 2);  // its rank never submitted it on B
  failed.local.clear();
  failed.local_failure = absl::DeadlineExceededError("rank 1 never submitted");
  absl::Status s = b_->Run(failed);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 never submitted")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "seq=1 failed after it was launched")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "remote process exited")) << s;
}

TEST_F(TwoNodesTest, ANodeWhoseTrainersLeftTellsTheOthers) {
  backend_.JobEnded("j");  // A's trainers are gone; B's are still in the job
  ASSERT_TRUE(Eventually([&] { return b_backend_.LaunchedOps() == 0; }));
  gpu_b_.streams_hang = true;
  EXPECT_TRUE(b_->Run(Op(1, 1)).ok());                            // launched
  ASSERT_TRUE(Eventually([&] { return gpu_b_.Aborts() == 1; }));  // its watcher heard
  gpu_b_.streams_hang = false;
  absl::Status sb = b_->Run(Op(1, 2));
  EXPECT_EQ(sb.code(), absl::StatusCode::kAborted) << sb;
  EXPECT_TRUE(absl::StrContains(sb.message(), "seq=1 failed after it was launched")) << sb;
  EXPECT_TRUE(absl::StrContains(sb.message(), "trainers on this node have left")) << sb;
  EXPECT_TRUE(absl::StrContains(sb.message(), "node a:7451")) << sb;
}

TEST_F(TwoNodesTest, NothingIsWrittenForARunThatIsOverAtTheRoot) {
  store_.DeleteJob("j");  // the root's trainers left: the run's keys went
  auto [sa, sb] = RunBoth(1, absl::UnavailableError("rank 0 left job j"));
  EXPECT_EQ(sa.code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(store_.List("j", "").status().code(), absl::StatusCode::kNotFound);  // no namespace
}

TEST_F(TwoNodesTest, NodesWhoseRanksSubmittedDifferentOpsFailTheNextOpWithDesyncNotAHang) {
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  gpu_.streams_hang = true;  // NCCL waits forever on mismatched ops
  gpu_b_.streams_hang = true;
  core::Collective on_b = Op(1, 1);
  on_b.fingerprint = "broadcast(float32, count=16, root=0) seq=1";
  auto [sa, sb] = RunBoth(Op(0, 1), on_b);
  EXPECT_TRUE(sa.ok()) << sa;  // launched: the nodes compare only after 100 ms
  EXPECT_TRUE(sb.ok()) << sb;
  // Each node's watcher finds the desync itself: only the group is aborted.
  ASSERT_TRUE(Eventually([&] { return gpu_.Aborts() == 1 && gpu_b_.Aborts() == 1; }));
  gpu_.streams_hang = false;
  gpu_b_.streams_hang = false;
  auto [a2, b2] = RunBoth(2);
  for (const absl::Status& s : {a2, b2}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "seq=1 failed after it was launched")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "desync across nodes in all_reduce job=j")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "all_reduce(mean, float32, count=16) seq=1")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "broadcast(float32, count=16, root=0) seq=1")) << s;
  }
  EXPECT_TRUE(absl::StrContains(a2.message(), "node a:7451 has all_reduce")) << a2;
  ASSERT_TRUE(backend_.FlushAborts());
  ASSERT_TRUE(b_backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 1);
  EXPECT_EQ(gpu_b_.Aborts(), 1);
  auto [a3, b3] = RunBoth(3);
  ASSERT_TRUE(a3.ok()) << a3;
  ASSERT_TRUE(b3.ok()) << b3;
}

TEST_F(TwoNodesTest, ASlowOpThatCompletesLeavesNothingBehindInTheStore) {
  // Both publish their fingerprints before the op completes.
  auto [sa, sb] = RunBothSlowly(1, absl::Milliseconds(300));
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sb.ok()) << sb;
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  ASSERT_TRUE(backend_.FlushAborts());
  EXPECT_EQ(gpu_.Aborts(), 0);
  // The fingerprints go as the settled ops are released (after their group's lock, once their
  // publishers are joined).
  EXPECT_TRUE(Eventually([&] {
    return *store_.List("j", "nccl/") == std::vector<std::string>{"nccl/r2/world/0/id"};
  })) << absl::StrJoin(*store_.List("j", "nccl/"), ",");
}

TEST_F(TwoNodesTest, AcrossNodesEverySegmentIsItsOwnCallEvenWhereContiguous) {
  // Each node sees only its own ranks' memory: merging would be its own decision, and the calls
  // on the two nodes would no longer pair up.
  const DeviceBuffer& xa = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& xb = BufferAt(0x9200'0000, 0, 1020);
  gpu_.calls.clear();
  gpu_b_.calls.clear();
  auto [sa, sb] = RunBoth(Fused({{0, {Seg(xa, 0, 4), Seg(xa, 4, 12)}}}, 2, 1),
                          Fused({{1, {Seg(xb, 0, 4), Seg(xb, 4, 12)}}}, 2, 1));
  ASSERT_TRUE(sa.ok()) << sa;
  ASSERT_TRUE(sb.ok()) << sb;
  for (FakeGpu* gpu : {&gpu_, &gpu_b_}) {
    ASSERT_EQ(gpu->calls.size(), 2u);
    EXPECT_EQ(gpu->calls[0].count, 4);
    EXPECT_EQ(gpu->calls[1].count, 12);
  }
}

TEST_F(TwoNodesTest, NodesWithDifferentSegmentationsFailWithADesyncBeforeAnyNcclCall) {
  // A fast op (the streams finish at once) split differently on the two nodes: NCCL would pair
  // the calls up and complete them with garbage. The nodes compare the split first.
  const DeviceBuffer& xa = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& xb = BufferAt(0x9200'0000, 0, 1020);
  const size_t calls_a = gpu_.calls.size(), calls_b = gpu_b_.calls.size();
  auto [sa, sb] = RunBoth(Fused({{0, {Seg(xa, 0, 4), Seg(xa, 8, 12)}}}, 2, 1),
                          Fused({{1, {Seg(xb, 0, 12), Seg(xb, 16, 4)}}}, 2, 1));
  for (const absl::Status& s : {sa, sb}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "desync across nodes in all_reduce job=j")) << s;
  }
  EXPECT_TRUE(absl::StrContains(sa.message(),
                                "node a:7451 has all_reduce(sum, float32, count=16) seq=1 "
                                "segments=[4,12] but node b:7451 has all_reduce(sum, float32, "
                                "count=16) seq=1 segments=[12,4]"))
      << sa;
  EXPECT_TRUE(absl::StrContains(sb.message(),
                                "node b:7451 has all_reduce(sum, float32, count=16) "
                                "seq=1 segments=[12,4] but node a:7451"))
      << sb;
  EXPECT_EQ(gpu_.calls.size(), calls_a);  // neither node called NCCL for it
  EXPECT_EQ(gpu_b_.calls.size(), calls_b);
  auto [a2, b2] = RunBoth(2);  // rebuilt on both
  ASSERT_TRUE(a2.ok()) << a2;
  ASSERT_TRUE(b2.ok()) << b2;
  EXPECT_EQ(gpu_b_.ids.back(), gpu_.ids.back());
}

TEST_F(TwoNodesTest, AFusedOpAgainstAContiguousOneFailsOnBothNodesNamingBoth) {
  // B's op is in one segment: it keeps the plain path (no extra round), launches and hangs in
  // NCCL; A waits for B's split, which B's watch publishes after 100 ms.
  ASSERT_TRUE(Eventually([&] { return b_backend_.LaunchedOps() == 0; }));
  gpu_b_.streams_hang = true;
  const DeviceBuffer& xa = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& xb = BufferAt(0x9200'0000, 0, 1020);
  const size_t calls_a = gpu_.calls.size();
  auto [sa, sb] = RunBoth(Fused({{0, {Seg(xa, 0, 4), Seg(xa, 8, 12)}}}, 2, 1),
                          Fused({{1, {Seg(xb, 0, 16)}}}, 2, 1));
  EXPECT_EQ(sa.code(), absl::StatusCode::kFailedPrecondition) << sa;
  EXPECT_TRUE(absl::StrContains(sa.message(),
                                "node a:7451 has all_reduce(sum, float32, count=16) seq=1 "
                                "segments=[4,12] but node b:7451 has all_reduce(sum, float32, "
                                "count=16) seq=1 segments=[16]"))
      << sa;
  EXPECT_EQ(gpu_.calls.size(), calls_a);
  EXPECT_TRUE(sb.ok()) << sb;                                     // launched
  ASSERT_TRUE(Eventually([&] { return gpu_b_.Aborts() == 1; }));  // B's watch found it
  gpu_b_.streams_hang = false;
  absl::Status b2 = b_->Run(Op(1, 2));
  EXPECT_EQ(b2.code(), absl::StatusCode::kAborted) << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(), "seq=1 failed after it was launched")) << b2;
  EXPECT_TRUE(absl::StrContains(b2.message(),
                                "node b:7451 has all_reduce(sum, float32, count=16) "
                                "seq=1 segments=[16] but node a:7451"))
      << b2;
}

TEST_F(TwoNodesTest, AFusedOpThatWaitedForTheOtherNodesSplitStillHearsItsCommunicatorsAbandoned) {
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  const DeviceBuffer& xa = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& xb = BufferAt(0x9200'0000, 0, 1020);
  gpu_.streams_hang = true;  // A's op waits in NCCL for B's ranks, which go
  // A comes first and compares its split for longer than kWatchAfter: its watch begins there,
  // before the op knows which communicators it runs on.
  absl::Status sa;
  std::thread t([&] { sa = a_->Run(Fused({{0, {Seg(xa, 0, 4), Seg(xa, 8, 12)}}}, 2, 1)); });
  absl::SleepFor(3 * PeerFailureWatch::kWatchAfter);
  absl::Status sb = b_->Run(Fused({{1, {Seg(xb, 0, 4), Seg(xb, 8, 12)}}}, 2, 1));
  t.join();
  ASSERT_TRUE(sa.ok()) << sa;  // launched
  ASSERT_TRUE(sb.ok()) << sb;
  b_backend_.JobEnded("j");  // B's trainers left: B abandons the communicators built at op 0
  // A's watcher hears it with no further op (not at the op's deadline of 20 s).
  ASSERT_TRUE(Eventually([&] { return gpu_.Aborts() == 1; }));
  gpu_.streams_hang = false;
  absl::Status a2 = a_->Run(Op(0, 2));
  EXPECT_EQ(a2.code(), absl::StatusCode::kAborted) << a2;
  EXPECT_TRUE(absl::StrContains(a2.message(), "seq=1 failed after it was launched")) << a2;
  EXPECT_TRUE(absl::StrContains(a2.message(), "abandoned")) << a2;
  EXPECT_TRUE(absl::StrContains(a2.message(), "node b:7451")) << a2;
}

TEST_F(TwoNodesTest, ALaunchedOpThatBuiltItsCommunicatorsHearsThemAbandoned) {
  ASSERT_TRUE(Eventually([&] { return backend_.LaunchedOps() + b_backend_.LaunchedOps() == 0; }));
  auto a_pair = Make(NodeSpec({0}, "a:7451", "pair"));
  auto b_pair = *b_backend_.CreateCommunicator(NodeSpec({1}, "b:7451", "pair"));
  gpu_.streams_hang = true;  // the pair's first op, which builds its communicators, hangs
  gpu_b_.streams_hang = true;
  absl::Status sb;
  std::thread t([&] { sb = b_pair->Run(AllReduce({{1, 0}}, 2, 0, absl::Seconds(20))); });
  absl::Status sa = a_pair->Run(AllReduce({{0, 0}}, 2, 0, absl::Seconds(20)));
  t.join();
  ASSERT_TRUE(sa.ok()) << sa;  // launched on both nodes
  ASSERT_TRUE(sb.ok()) << sb;
  // Another group of the job failed on B: B aborts the pair's communicators under its op, and
  // says so with broken/0 only (its op was answered: no fail/0).
  b_backend_.AbortJob("j", absl::UnavailableError("group x: remote process exited"));
  // (at once, or by B's watcher when it held the pair's lock then; B's world may wait for its
  // next op: nothing of it is launched)
  ASSERT_TRUE(Eventually([&] { return gpu_b_.Aborts() >= 1; }));
  // A's op hears it with no further op (not at its deadline of 20 s).
  ASSERT_TRUE(Eventually([&] { return gpu_.Aborts() == 1; }));
  gpu_.streams_hang = false;
  gpu_b_.streams_hang = false;
  absl::Status a2 = a_pair->Run(AllReduce({{0, 0}}, 2, 1));
  EXPECT_EQ(a2.code(), absl::StatusCode::kAborted) << a2;
  EXPECT_TRUE(absl::StrContains(a2.message(), "abandoned")) << a2;
  EXPECT_TRUE(absl::StrContains(a2.message(), "remote process exited")) << a2;
}

TEST_F(NcclBackendTest, LongSegmentationsAreDigestedInWhatTheNodesCompare) {
  // 40 segments on each of two nodes differing only in the middle: the published fingerprints
  // must still differ. Checked through the desync message, as above.
  store::MemoryStore store;
  ASSERT_TRUE(store.Set("j", core::kRunKey, "r").ok());
  FakeGpu gpu_b;
  NcclBackend node_b(&gpu_b);
  auto spec = [&](std::vector<int> local, const std::string& node) {
    core::CommunicatorSpec s = Spec(std::move(local), 2, "world", &store);
    s.node = node;
    s.member_nodes = {"a:1", "b:1"};
    s.run = "r";
    return s;
  };
  auto a = Make(spec({0}, "a:1"));
  auto b = *node_b.CreateCommunicator(spec({1}, "b:1"));
  const DeviceBuffer& xa = BufferAt(0x9000'0000, 0, 1000);
  const DeviceBuffer& xb = BufferAt(0x9200'0000, 0, 1020);
  core::View va, vb;
  for (int i = 0; i < 40; ++i) {
    va.push_back(Seg(xa, 10 * i, 2));
    vb.push_back(Seg(xb, 10 * i, i == 20 ? 3 : 2));
  }
  vb[21].count = 1;  // the same total
  gpu_.streams_hang = true;
  gpu_b.streams_hang = true;
  absl::Status sb;
  std::thread t([&] { sb = b->Run(Fused({{1, vb}}, 2)); });
  absl::Status sa = a->Run(Fused({{0, va}}, 2));
  t.join();
  for (const absl::Status& s : {sa, sb}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "(40 segments, digest ")) << s;
  }
  backend_.StopWatchdog();  // before `store` goes
}

// A backend whose communicators count their ops.
class CountingBackend final : public core::Backend {
 public:
  struct Comm final : core::Communicator {
    int* runs;
    std::vector<size_t>* batches;
    absl::Status Run(const core::Collective&) override {
      ++*runs;
      return absl::OkStatus();
    }
    void RunBatch(absl::Span<const core::Collective* const> ops,
                  absl::FunctionRef<void(size_t, absl::Status)> finished) override {
      batches->push_back(ops.size());
      for (size_t i = 0; i < ops.size(); ++i) finished(i, Run(*ops[i]));
    }
  };
  int runs = 0;
  std::vector<size_t> batches;     // sizes of the batches its communicators were handed
  std::vector<std::string> ended;  // jobs told JobEnded
  void JobEnded(const std::string& job) override { ended.push_back(job); }
  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec&) override {
    auto c = std::make_shared<Comm>();
    c->runs = &runs;
    c->batches = &batches;
    return c;
  }
};

TEST_F(NcclBackendTest, DispatchSendsHostOpsToTheCpuPlaneAndDeviceOpsToNccl) {
  CountingBackend cpu, gpu;
  DispatchBackend dispatch(&cpu, &gpu);
  auto comm = *dispatch.CreateCommunicator(Spec({0, 1}, 2));
  std::vector<std::byte> host_memory(64);
  core::Collective host;
  host.local.push_back({0, {{host_memory.data(), 16}}, {}});
  EXPECT_TRUE(comm->Run(host).ok());
  core::Collective barrier;  // no buffers at all
  EXPECT_TRUE(comm->Run(barrier).ok());
  EXPECT_EQ(cpu.runs, 2);
  core::Collective device = AllReduce({{0, 0}, {1, 1}}, 2);
  device.plane = core::Plane::kDevice;
  EXPECT_TRUE(comm->Run(device).ok());
  EXPECT_EQ(gpu.runs, 1);
  // An op that failed here before it had buffers goes to the plane the engine chose for it.
  core::Collective failed;
  failed.local_failure = absl::DeadlineExceededError("rank 1 never submitted");
  failed.plane = core::Plane::kDevice;
  EXPECT_TRUE(comm->Run(failed).ok());
  EXPECT_EQ(gpu.runs, 2);
  failed.plane = core::Plane::kHost;
  EXPECT_TRUE(comm->Run(failed).ok());
  EXPECT_EQ(cpu.runs, 3);
}

TEST_F(NcclBackendTest, DispatchHandsEachPlaneItsRunOfABatchWhole) {
  // The CPU plane overlaps a batch's exchanges across nodes only if it gets the batch at once.
  CountingBackend cpu, gpu;
  DispatchBackend dispatch(&cpu, &gpu);
  auto comm = *dispatch.CreateCommunicator(Spec({0, 1}, 2));
  std::vector<core::Collective> ops(6);
  for (size_t i = 3; i < 5; ++i) ops[i].plane = core::Plane::kDevice;
  std::vector<const core::Collective*> pointers;
  for (const core::Collective& op : ops) pointers.push_back(&op);
  std::vector<absl::Status> out(ops.size(), absl::UnknownError("not run"));
  comm->RunBatch(pointers, [&out](size_t i, absl::Status s) { out[i] = std::move(s); });
  for (const absl::Status& s : out) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(cpu.batches, (std::vector<size_t>{3, 1}));
  EXPECT_EQ(gpu.batches, (std::vector<size_t>{2}));
  EXPECT_EQ(cpu.runs, 4);
  EXPECT_EQ(gpu.runs, 2);
}

TEST_F(NcclBackendTest, DispatchTellsBothPlanesThatAJobEnded) {
  CountingBackend cpu, gpu;
  DispatchBackend dispatch(&cpu, &gpu);
  static_cast<core::Backend&>(dispatch).JobEnded("j");
  EXPECT_EQ(cpu.ended, std::vector<std::string>{"j"});
  EXPECT_EQ(gpu.ended, std::vector<std::string>{"j"});
}

// The engine ends a job on a thread of its own: the gRPC thread whose stream ended the last
// session returns at once, however long the job's launched ops run on the GPU; the backend is
// done with the job before its store namespace goes; a new run of the job starts after that, so
// none of its keys goes with the last run's.
TEST_F(NcclBackendTest, AJobEndsOffTheUnregisteringThreadAndANewRunStartsAfterItsKeysWent) {
  FakeGpu gpu;
  NcclBackend backend(&gpu);
  ipc::CudaImporter importer(&gpu);
  store::MemoryStore store;
  WorkerPool pool(2);
  std::atomic<int> backend_done{0};  // job ends the backend is through with
  core::Engine engine(&backend, &importer, &pool, core::EngineOptions(),
                      [&](const std::string& job) {
                        backend.JobEnded(job);
                        ++backend_done;
                        store.DeleteJob(job);
                      });
  auto join = [&engine](int rank) {
    v1::RegisterRequest req;
    req.set_job("j");
    req.set_world_size(2);
    req.set_rank(rank);
    req.set_local_world_size(2);
    req.set_local_rank(rank);
    return engine.Register(req);
  };
  auto r0 = join(0), r1 = join(1);
  ASSERT_TRUE(r0.ok() && r1.ok()) << r0.status() << r1.status();
  ASSERT_TRUE(store.Set("j", "last_run", "x").ok());
  gpu.streams_hang = true;  // the job's last op runs on the GPU until the test lets it finish
  ASSERT_TRUE((*backend.CreateCommunicator(Spec({0, 1}, 2)))
                  ->Run(AllReduce({{0, 0}, {1, 1}}, 2, 0, absl::Seconds(20)))
                  .ok());

  absl::Notification unregistered;
  std::thread trainers_leave([&] {
    engine.Unregister(**r0, "done");
    engine.Unregister(**r1, "done");  // the job's last session
    unregistered.Notify();
  });
  const bool prompt = unregistered.WaitForNotificationWithTimeout(absl::Seconds(10));
  // The job's new run comes while the last one still ends: it registers once the end is done.
  absl::StatusOr<std::shared_ptr<core::Session>> again;
  std::thread restart([&] {
    again = join(0);
    if (again.ok()) (void)store.Set("j", "new_run", "y");
  });
  EXPECT_TRUE(prompt) << "Unregister waited for the job's launched op";
  EXPECT_EQ(backend_done.load(), 0);              // the op still runs: the backend waits for it
  EXPECT_TRUE(store.Peek("j", "last_run").ok());  // and the job's keys are still there
  ASSERT_TRUE(backend.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 0);

  gpu.streams_hang = false;  // the GPU finishes the op
  trainers_leave.join();
  restart.join();
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(backend_done.load(), 1);
  ASSERT_TRUE(backend.FlushAborts());
  EXPECT_EQ(gpu.Aborts(), 2);  // the job's communicators were dropped after their op finished
  EXPECT_EQ(gpu.StreamsOpen(), 0);
  EXPECT_EQ(store.Peek("j", "last_run").status().code(), absl::StatusCode::kNotFound);
  absl::StatusOr<std::string> kept = store.Peek("j", "new_run");
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(*kept, "y");
  engine.Unregister(**again, "done");
}

}  // namespace
}  // namespace gradsync::backend::nccl
