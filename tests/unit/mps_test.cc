// The daemon's MPS decision (daemon/gpu/mps.h) on fake facts, and the facts gathered from a fake
// GPU and a real pipe directory.
#include "daemon/gpu/mps.h"

#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "gtest/gtest.h"
#include "tests/unit/fake_gpu.h"

namespace gradsync::gpu {
namespace {

MpsFacts GpuFacts(int devices, int mps_devices, MpsFacts::Control control) {
  MpsFacts f;
  f.pipe_dir = "/run/nvidia-mps";
  f.pipe_dir_from_env = true;
  f.devices = devices;
  f.mps_devices = mps_devices;
  f.control = control;
  return f;
}

TEST(MpsDecisionTest, OnWhenEveryDevicesContextsAreMpsClients) {
  const MpsState s = DecideMps(GpuFacts(2, 2, MpsFacts::Control::kPipe));
  EXPECT_EQ(s.mode, MpsMode::kOn);
  EXPECT_EQ(std::string(MpsModeName(s.mode)), "on");
  EXPECT_NE(s.reason.find("all 2 GPU(s)"), std::string::npos) << s.reason;
  EXPECT_NE(s.reason.find("/run/nvidia-mps/control"), std::string::npos) << s.reason;
}

TEST(MpsDecisionTest, TheAttributeDecidesNotThePipe) {
  // A pipe that CUDA did not use (stale, or another user's server) is not MPS.
  const MpsState stale = DecideMps(GpuFacts(1, 0, MpsFacts::Control::kPipe));
  EXPECT_EQ(stale.mode, MpsMode::kOff);
  EXPECT_NE(stale.reason.find("did not make this process an MPS client"), std::string::npos)
      << stale.reason;
}

TEST(MpsDecisionTest, OffNamesWhatIsMissing) {
  MpsFacts none = GpuFacts(1, 0, MpsFacts::Control::kMissing);
  none.pipe_dir = kDefaultMpsPipeDirectory;
  none.pipe_dir_from_env = false;
  const MpsState s = DecideMps(none);
  EXPECT_EQ(s.mode, MpsMode::kOff);
  EXPECT_NE(s.reason.find("no MPS control daemon: /tmp/nvidia-mps/control does not exist"),
            std::string::npos)
      << s.reason;
  EXPECT_NE(s.reason.find("CUDA_MPS_PIPE_DIRECTORY unset"), std::string::npos) << s.reason;

  const MpsState denied = DecideMps(GpuFacts(1, 0, MpsFacts::Control::kNoAccess));
  EXPECT_EQ(denied.mode, MpsMode::kOff);
  EXPECT_NE(denied.reason.find("cannot open it"), std::string::npos) << denied.reason;

  const MpsState file = DecideMps(GpuFacts(1, 0, MpsFacts::Control::kNotAPipe));
  EXPECT_EQ(file.mode, MpsMode::kOff);
  EXPECT_NE(file.reason.find("not a pipe"), std::string::npos) << file.reason;
}

TEST(MpsDecisionTest, SomeDevicesWithoutMpsIsOff) {
  const MpsState s = DecideMps(GpuFacts(8, 3, MpsFacts::Control::kPipe));
  EXPECT_EQ(s.mode, MpsMode::kOff);
  EXPECT_NE(s.reason.find("only 3 of 8"), std::string::npos) << s.reason;
}

TEST(MpsDecisionTest, UnavailableWithoutAUsableGpuWithCudasReason) {
  MpsFacts f = GpuFacts(0, 0, MpsFacts::Control::kPipe);
  f.gpu = absl::FailedPreconditionError("gradsyncd was built without CUDA (GRADSYNC_WITH_CUDA)");
  const MpsState s = DecideMps(f);
  EXPECT_EQ(s.mode, MpsMode::kUnavailable);
  EXPECT_EQ(std::string(MpsModeName(s.mode)), "unavailable");
  EXPECT_EQ(s.reason, "gradsyncd was built without CUDA (GRADSYNC_WITH_CUDA)");
  EXPECT_EQ(DecideMps(GpuFacts(0, 0, MpsFacts::Control::kMissing)).reason, "no CUDA device");
}

class MpsGatherTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/gradsync_mps_test.XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    ::unlink((dir_ + "/control").c_str());
    ::rmdir(dir_.c_str());
  }
  std::string dir_;
};

TEST_F(MpsGatherTest, ReadsThePipeDirectoryAndAsksEveryDevice) {
  testing::FakeGpu gpu;
  gpu.devices = 2;
  gpu.mps_devices = 2;
  MpsFacts f = GatherMpsFacts(&gpu, dir_.c_str(), absl::Seconds(5));
  EXPECT_EQ(f.pipe_dir, dir_);
  EXPECT_TRUE(f.pipe_dir_from_env);
  EXPECT_EQ(f.control, MpsFacts::Control::kMissing);
  ASSERT_TRUE(f.gpu.ok()) << f.gpu;
  EXPECT_EQ(f.devices, 2);
  EXPECT_EQ(f.mps_devices, 2);
  EXPECT_EQ(DecideMps(f).mode, MpsMode::kOn);

  ASSERT_EQ(::mkfifo((dir_ + "/control").c_str(), 0600), 0);
  gpu.mps_devices = 0;
  f = GatherMpsFacts(&gpu, dir_.c_str(), absl::Seconds(5));
  EXPECT_EQ(f.control, MpsFacts::Control::kPipe);  // ours, mode 0600
  EXPECT_EQ(f.mps_devices, 0);
  EXPECT_EQ(DecideMps(f).mode, MpsMode::kOff);
}

TEST_F(MpsGatherTest, ARegularFileIsNotAControlPipe) {
  std::ofstream(dir_ + "/control") << "x";
  testing::FakeGpu gpu;
  EXPECT_EQ(GatherMpsFacts(&gpu, dir_.c_str(), absl::Seconds(5)).control,
            MpsFacts::Control::kNotAPipe);
}

TEST_F(MpsGatherTest, UnsetOrEmptyEnvironmentMeansNvidiasDefaultDirectory) {
  testing::FakeGpu gpu;
  EXPECT_EQ(GatherMpsFacts(&gpu, nullptr, absl::Seconds(5)).pipe_dir, "/tmp/nvidia-mps");
  const MpsFacts empty = GatherMpsFacts(&gpu, "", absl::Seconds(5));
  EXPECT_EQ(empty.pipe_dir, "/tmp/nvidia-mps");
  EXPECT_FALSE(empty.pipe_dir_from_env);
}

TEST_F(MpsGatherTest, NoDriverIsUnavailableWithItsReason) {
  testing::FakeGpu gpu;
  gpu.device_error = absl::FailedPreconditionError("cudaGetDeviceCount: no CUDA-capable device");
  const MpsFacts f = GatherMpsFacts(&gpu, dir_.c_str(), absl::Seconds(5));
  const MpsState s = DecideMps(f);
  EXPECT_EQ(s.mode, MpsMode::kUnavailable);
  EXPECT_EQ(s.reason, "cudaGetDeviceCount: no CUDA-capable device");
}

}  // namespace
}  // namespace gradsync::gpu
