// The CUDA IPC importer against a fake GpuApi: handle cache, refusals, nothing left open.
#include "daemon/ipc/cuda_importer.h"

#include <unistd.h>

#include <map>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "daemon/gpu/mps.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_gpu.h"

namespace gradsync::ipc {
namespace {

using testing::FakeGpu;

std::string Handle(char c) { return std::string(gpu::kIpcHandleBytes, c); }

v1::RegisterBufferRequest Cuda(const std::string& handle, int64_t offset, int64_t bytes,
                               int device = 0) {
  v1::RegisterBufferRequest r;
  r.set_bytes(bytes);
  v1::CudaIpcBuffer* c = r.mutable_cuda();
  c->set_mem_handle(handle);
  c->set_offset(offset);
  c->set_device(device);
  c->set_ready_event(Handle('r'));
  c->set_done_event(Handle('d'));
  c->set_pid(::getpid() + 1);  // "another process"
  return r;
}

class CudaImporterTest : public ::testing::Test {
 protected:
  void SetUp() override { gpu_.exported[Handle('a')] = 1 << 20; }
  // Everything opened was closed again.
  void ExpectNothingOpen() {
    EXPECT_EQ(importer_.open_allocations(), 0);
    EXPECT_TRUE(gpu_.mapped.empty());
    EXPECT_EQ(gpu_.opens, gpu_.closes);
    EXPECT_EQ(gpu_.events_open, 0);
  }
  FakeGpu gpu_;
  CudaImporter importer_{&gpu_};
};

TEST_F(CudaImporterTest, BuffersOfOneAllocationShareOneMappingUntilTheLastGoes) {
  auto a = importer_.Import(Cuda(Handle('a'), 0, 4096));
  auto b = importer_.Import(Cuda(Handle('a'), 4096, 8192));
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(gpu_.opens, 1);  // one open per allocation, counted by the importer
  EXPECT_EQ((*b)->data() - (*a)->data(), 4096);
  EXPECT_EQ((*b)->size(), 8192);
  EXPECT_NE((*a)->Describe().find("cuda:dev0"), std::string::npos) << (*a)->Describe();
  EXPECT_EQ(gpu_.events_open, 4);
  a->reset();
  EXPECT_EQ(importer_.open_allocations(), 1);
  EXPECT_EQ(gpu_.closes, 0);
  b->reset();
  ExpectNothingOpen();
}

TEST_F(CudaImporterTest, ReleasedEventsAreClosedAtOnceWhileTheMappingLivesOn) {
  // The engine releases a deregistered buffer's events while a launched op still holds its
  // mapping: the handles close then (the trainer may destroy its events), the memory later.
  auto a = importer_.Import(Cuda(Handle('a'), 0, 4096));
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(gpu_.events_open, 2);
  (*a)->ReleaseEvents();
  EXPECT_EQ(gpu_.events_open, 0);
  EXPECT_EQ((*a)->ready_event(), nullptr);  // nothing left to wait on or record
  EXPECT_EQ((*a)->done_event(), nullptr);
  EXPECT_EQ(importer_.open_allocations(), 1);
  (*a)->ReleaseEvents();  // idempotent
  a->reset();
  EXPECT_EQ(gpu_.destroyed_event_uses, 0);  // none destroyed twice
  ExpectNothingOpen();
}

TEST_F(CudaImporterTest, TheSameHandleOnAnotherDeviceIsAnotherMapping) {
  auto a = importer_.Import(Cuda(Handle('a'), 0, 16, 0));
  auto b = importer_.Import(Cuda(Handle('a'), 0, 16, 1));
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(importer_.open_allocations(), 2);
  a->reset();
  b->reset();
  ExpectNothingOpen();
}

TEST_F(CudaImporterTest, RefusesWhatCannotWorkAndLeavesNothingOpen) {
  auto code = [&](v1::RegisterBufferRequest r, const std::string& needle) {
    auto m = importer_.Import(r);
    EXPECT_FALSE(m.ok());
    EXPECT_NE(m.status().message().find(needle), std::string::npos) << m.status();
    return m.status().code();
  };
  using absl::StatusCode;
  EXPECT_EQ(code(Cuda("short", 0, 16), "mem_handle has 5 bytes"), StatusCode::kInvalidArgument);
  auto no_event = Cuda(Handle('a'), 0, 16);
  no_event.mutable_cuda()->clear_ready_event();
  EXPECT_EQ(code(no_event, "ready_event has 0 bytes"), StatusCode::kInvalidArgument);
  auto own = Cuda(Handle('a'), 0, 16);
  own.mutable_cuda()->set_pid(::getpid());
  EXPECT_EQ(code(own, "daemon's own process"), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Cuda(Handle('a'), 0, 16, 2), "device 2 does not exist here: this daemon sees 2"),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Cuda(Handle('a'), -1, 16), "must not be negative"), StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Cuda(Handle('a'), (1 << 20) - 8, 16), "beyond its allocation of 1048576"),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(code(Cuda(Handle('z'), 0, 16), "invalid resource handle"),
            StatusCode::kInvalidArgument);
  gpu_.event_error = absl::InternalError("event boom");
  EXPECT_EQ(code(Cuda(Handle('a'), 0, 16), "event boom"), StatusCode::kInternal);
  gpu_.event_error = absl::OkStatus();
  gpu_.device_error = absl::FailedPreconditionError("cudaGetDeviceCount: no CUDA driver");
  EXPECT_EQ(code(Cuda(Handle('a'), 0, 16), "cannot map CUDA buffers: cudaGetDeviceCount"),
            StatusCode::kFailedPrecondition);
  ExpectNothingOpen();
}

TEST_F(CudaImporterTest, TheDeviceIsFoundByItsUuidWhateverTheTrainerCallsIt) {
  // The trainer runs with CUDA_VISIBLE_DEVICES=1: its device 0 is the daemon's device 1.
  auto r = Cuda(Handle('a'), 0, 16, 0);
  r.mutable_cuda()->set_device_uuid(FakeGpu::Uuid(1));
  auto m = importer_.Import(r);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->device(), 1);
  EXPECT_EQ(gpu_.mapped.count({1, Handle('a')}), 1u);
  EXPECT_NE((*m)->Describe().find("cuda:dev1"), std::string::npos) << (*m)->Describe();
  m->reset();
  // A device the daemon does not see, and a malformed UUID.
  r.mutable_cuda()->set_device_uuid(std::string(gpu::kUuidBytes, '\x8a'));
  auto missing = importer_.Import(r);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.status().message().find(
                "device 0 (GPU-8a8a8a8a-8a8a-8a8a-8a8a-8a8a8a8a8a8a) is not among the 2"),
            std::string::npos)
      << missing.status();
  r.mutable_cuda()->set_device_uuid("short");
  EXPECT_EQ(importer_.Import(r).status().code(), absl::StatusCode::kInvalidArgument);
  ExpectNothingOpen();
}

TEST_F(CudaImporterTest, AFailureOfOneBufferDoesNotCloseItsNeighbours) {
  auto a = importer_.Import(Cuda(Handle('a'), 0, 16));
  ASSERT_TRUE(a.ok());
  EXPECT_FALSE(importer_.Import(Cuda(Handle('a'), 1 << 20, 16)).ok());  // beyond
  EXPECT_EQ(importer_.open_allocations(), 1);
  EXPECT_EQ(gpu_.closes, 0);
  a->reset();
  ExpectNothingOpen();
}

TEST(FakeGpuTest, AnOverlappingOpenOfOneProcessIsRefusedUntilTheFirstIsClosed) {
  FakeGpu gpu;
  const std::string old_handle = Handle('o'), new_handle = Handle('n'), other = Handle('x');
  for (const std::string& h : {old_handle, new_handle, other}) gpu.exported[h] = 1 << 20;
  gpu.exported_at[old_handle] = {7, 0x10000000};
  gpu.exported_at[new_handle] = {7, 0x10000000 + 4096};  // overlaps the old one
  gpu.exported_at[other] = {8, 0x10000000};              // another process's
  auto a = gpu.OpenMemHandle(0, old_handle);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(gpu.OpenMemHandle(0, new_handle).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(gpu.OpenMemHandle(0, old_handle).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(gpu.OpenMemHandle(0, other).ok());
  EXPECT_TRUE(gpu.OpenMemHandle(1, new_handle).ok());  // another device: another context
  ASSERT_TRUE(gpu.CloseMemHandle(0, *a).ok());
  EXPECT_TRUE(gpu.OpenMemHandle(0, new_handle).ok());
  EXPECT_EQ(gpu.AlreadyMappedRefusals(), 2);
}

TEST(FakeGpuTest, AnEventStandsForItsLatestRecordAndIsAnErrorOnceDestroyed) {
  FakeGpu gpu;
  gpu.op_time = absl::Milliseconds(200);
  auto s1 = gpu.CreateStream(0), s2 = gpu.CreateStream(0);
  auto e = gpu.CreateEvent(0);
  ASSERT_TRUE(s1.ok() && s2.ok() && e.ok());
  gpu::NcclCall call;
  call.stream = *s1;
  ASSERT_TRUE(gpu.NcclCollective(call).ok());  // call 0, on s1
  ASSERT_TRUE(gpu.RecordEvent(0, *e, *s1).ok());
  EXPECT_EQ(gpu.recorded_for(*e), 0);
  EXPECT_FALSE(*gpu.EventDone(0, *e));            // streams run in their own time
  ASSERT_TRUE(gpu.RecordEvent(0, *e, *s2).ok());  // an idle stream: replaces call 0
  EXPECT_EQ(gpu.recorded_for(*e), -1);
  EXPECT_TRUE(*gpu.EventDone(0, *e));
  EXPECT_FALSE(*gpu.StreamDone(0, *s1));
  EXPECT_TRUE(*gpu.StreamDone(0, *s2));
  ASSERT_TRUE(gpu.DestroyEvent(0, *e).ok());
  EXPECT_FALSE(gpu.RecordEvent(0, *e, *s1).ok());
  EXPECT_FALSE(gpu.StreamWaitEvent(0, *s1, *e).ok());
  EXPECT_FALSE(gpu.EventDone(0, *e).ok());
  EXPECT_FALSE(gpu.DestroyEvent(0, *e).ok());
  EXPECT_EQ(gpu.DestroyedEventUses(), 4);
}

// The trainer freed an allocation and got a new one at its address while the daemon still maps
// the old one for a launched op (here: a holder that lets go a little later).
TEST(CudaImporterReuseTest, AnAllocationAtAnAddressStillMappedIsMappedOnceTheOldOneCloses) {
  FakeGpu gpu;
  CudaImporter importer(&gpu, absl::Seconds(5));
  auto exported = [&](char c) {
    gpu.exported[Handle(c)] = 1 << 20;
    gpu.exported_at[Handle(c)] = {::getpid() + 1, 0x10000000};
    return Cuda(Handle(c), 0, 4096);
  };
  auto old_buffer = importer.Import(exported('o'));
  ASSERT_TRUE(old_buffer.ok()) << old_buffer.status();
  std::shared_ptr<core::MappedBuffer> held = *std::move(old_buffer);  // the launched op's pin
  std::thread settle([&] {
    absl::SleepFor(absl::Milliseconds(50));
    held.reset();  // the op's streams ran it: its mapping closes
  });
  const absl::Time start = absl::Now();
  auto fresh = importer.Import(exported('n'));
  const absl::Duration took = absl::Now() - start;
  settle.join();
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  EXPECT_GE(gpu.AlreadyMappedRefusals(), 1);
  EXPECT_GE(took, absl::Milliseconds(40));
  EXPECT_EQ(importer.open_allocations(), 1);
  EXPECT_EQ(gpu.mapped.count({0, Handle('n')}), 1u);
  fresh->reset();
  EXPECT_EQ(importer.open_allocations(), 0);
}

TEST(CudaImporterReuseTest, AMappingThatNeverClosesFailsTheNewOneAfterTheSettleTimeout) {
  FakeGpu gpu;
  CudaImporter importer(&gpu, absl::Milliseconds(100));
  for (char c : {'o', 'n'}) {
    gpu.exported[Handle(c)] = 1 << 20;
    gpu.exported_at[Handle(c)] = {::getpid() + 1, 0x10000000};
  }
  auto held = importer.Import(Cuda(Handle('o'), 0, 16));
  ASSERT_TRUE(held.ok());
  auto refused = importer.Import(Cuda(Handle('n'), 0, 16));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_NE(refused.status().message().find("still mapped for a launched op after 100ms"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(importer.open_allocations(), 1);
  EXPECT_EQ(gpu.events_open, 2);  // the held buffer's two, none of the refused one's
}

class CountingImporter final : public core::BufferImporter {
 public:
  int calls = 0;
  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> Import(
      const v1::RegisterBufferRequest&) override {
    ++calls;
    return absl::UnimplementedError("counted");
  }
};

TEST(DispatchImporterTest, SendsEachRegistrationToItsKind) {
  CountingImporter shm, cuda;
  DispatchImporter dispatch(&shm, &cuda);
  v1::RegisterBufferRequest r;
  r.set_shm_name("/x");
  (void)dispatch.Import(r);
  EXPECT_EQ(shm.calls, 1);
  r.mutable_cuda()->set_offset(0);
  auto both = dispatch.Import(r);
  EXPECT_EQ(both.status().code(), absl::StatusCode::kInvalidArgument);
  r.clear_shm_name();
  (void)dispatch.Import(r);
  EXPECT_EQ(cuda.calls, 1);
  EXPECT_EQ(shm.calls, 1);
}

TEST(CudaInitTest, CudaBuffersAreRefusedUntilCudaAnswersAndNoCallWaitsInsideItsInitialisation) {
  FakeGpu gpu;
  gpu.exported[Handle('a')] = 1 << 20;
  gpu.init_hangs = true;  // an MPS server of another user draining, say
  const gpu::MpsFacts facts = gpu::GatherMpsFacts(&gpu, "/nonexistent", absl::Milliseconds(100));
  EXPECT_EQ(facts.gpu.code(), absl::StatusCode::kDeadlineExceeded) << facts.gpu;
  CudaImporter importer(&gpu);
  importer.SetCudaAnswered(facts.cuda_answered);
  auto refused = importer.Import(Cuda(Handle('a'), 0, 4096));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kUnavailable) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "CUDA has not answered gradsyncd"))
      << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "CUDA buffers are refused until"))
      << refused.status();
  EXPECT_EQ(gpu.InitWaits(), 1);  // the start's probe only: the registration made no CUDA call
  EXPECT_EQ(gpu.opens, 0);
  gpu.init_hangs = false;  // CUDA answers at last
  bool answered = false;
  for (int i = 0; i < 500 && !answered; ++i) {
    answered = facts.cuda_answered().ok();
    if (!answered) absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(answered);
  auto b = importer.Import(Cuda(Handle('a'), 0, 4096));
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(gpu.opens, 1);
}

}  // namespace
}  // namespace gradsync::ipc
