#pragma once

// The NCCL backend's test fixture over the fake GPU (fake_gpu.h): device buffers as the CUDA
// importer makes them, ops and communicator specs, and a look at what the fake logged.

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/backend/nccl/nccl_backend.h"
#include "gtest/gtest.h"
#include "tests/unit/fake_gpu.h"

namespace gradsync::backend::nccl {

using testing::FakeGpu;

// A registered device buffer as the CUDA importer makes it.
class DeviceBuffer final : public core::MappedBuffer {
 public:
  DeviceBuffer(int device, uintptr_t address, void* ready, void* done)
      : device_(device), data_(reinterpret_cast<std::byte*>(address)), ready_(ready), done_(done) {}
  std::byte* data() const override { return data_; }
  int64_t size() const override { return 1 << 20; }
  std::string Describe() const override { return "fake device buffer"; }
  int device() const override { return device_; }
  void* ready_event() const override { return ready_; }
  void* done_event() const override { return done_; }

 private:
  int device_;
  std::byte* data_;
  void* ready_;
  void* done_;
};

class NcclBackendTest : public ::testing::Test {
 protected:
  // Member r of the group: its buffer on `device`, events e(10r+1) ready and e(10r+2) done.
  const DeviceBuffer& Buffer(int r, int device) {
    absl::MutexLock lock(&buffers_mu_);  // tests make members from several threads
    buffers_.push_back(std::make_unique<DeviceBuffer>(device, 0x9000'0000 + r * 0x10000,
                                                      FakeGpu::Handle(1000 + 10 * r + 1),
                                                      FakeGpu::Handle(1000 + 10 * r + 2)));
    return *buffers_.back();
  }
  core::Collective AllReduce(const std::vector<std::pair<int, int>>& rank_device, int size,
                             uint64_t seq = 0, absl::Duration timeout = absl::Seconds(5)) {
    core::Collective op;
    op.kind = v1::ALL_REDUCE;
    op.reduce_op = v1::MEAN;
    op.dtype = v1::FLOAT32;
    op.count = 16;
    op.group_size = size;
    op.seq = seq;
    op.deadline = absl::Now() + timeout;
    op.label = absl::StrCat("all_reduce job=j group=world seq=", seq);
    for (auto [rank, device] : rank_device) {
      const DeviceBuffer& b = Buffer(rank, device);
      op.local.push_back({rank, {{b.data(), 16, &b}}, {}});
    }
    return op;
  }
  // A device buffer of its own at `address` on `device`, events e(id+1) ready and e(id+2) done.
  const DeviceBuffer& BufferAt(uintptr_t address, int device, int id) {
    absl::MutexLock lock(&buffers_mu_);
    buffers_.push_back(std::make_unique<DeviceBuffer>(device, address, FakeGpu::Handle(id + 1),
                                                      FakeGpu::Handle(id + 2)));
    return *buffers_.back();
  }
  // Segment of `count` floats at element `at` of `b`.
  static core::Run Seg(const DeviceBuffer& b, int64_t at, int64_t count) {
    return {b.data() + at * 4, count, &b};
  }
  // A fused all-reduce (sum, float32) of `views` (group rank, input segments).
  static core::Collective Fused(const std::vector<std::pair<int, core::View>>& views, int size,
                                uint64_t seq = 0) {
    core::Collective op;
    op.kind = v1::ALL_REDUCE;
    op.reduce_op = v1::SUM;
    op.dtype = v1::FLOAT32;
    for (const core::Run& r : views.front().second) op.count += r.count;
    op.group_size = size;
    op.seq = seq;
    op.deadline = absl::Now() + absl::Seconds(20);
    op.label = absl::StrCat("all_reduce job=j group=world seq=", seq);
    op.fingerprint = absl::StrCat("all_reduce(sum, float32, count=", op.count, ") seq=", seq);
    for (const auto& [rank, view] : views) op.local.push_back({rank, view, {}});
    return op;
  }
  core::CommunicatorSpec Spec(std::vector<int> local, int size, const std::string& group = "world",
                              gradsync::Store* store = nullptr) {
    core::CommunicatorSpec spec;
    spec.job = "j";
    spec.group = group;
    for (int r = 0; r < size; ++r) spec.members.push_back(r);
    spec.local_members = std::move(local);
    spec.rendezvous = store;
    return spec;
  }
  std::shared_ptr<core::Communicator> Make(const core::CommunicatorSpec& spec) {
    auto c = backend_.CreateCommunicator(spec);
    EXPECT_TRUE(c.ok());
    return *c;
  }
  // Polls `done` (at most 2500 times over 5 s) until it holds: what a watcher thread does is
  // seen without a further op.
  static bool Eventually(const std::function<bool()>& done) {
    const absl::Time give_up = absl::Now() + absl::Seconds(5);
    for (int i = 0; i < 2500 && absl::Now() < give_up; ++i) {
      if (done()) return true;
      absl::SleepFor(absl::Milliseconds(2));
    }
    return done();
  }
  int Count(const std::string& prefix) {
    return static_cast<int>(std::count_if(gpu_.log.begin(), gpu_.log.end(),
                                          [&](auto& l) { return absl::StartsWith(l, prefix); }));
  }

  FakeGpu gpu_;
  NcclBackend backend_{&gpu_};
  absl::Mutex buffers_mu_;
  std::vector<std::unique_ptr<DeviceBuffer>> buffers_ ABSL_GUARDED_BY(buffers_mu_);
};

}  // namespace gradsync::backend::nccl
