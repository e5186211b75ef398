// Implementation of mps.h.
#include "daemon/gpu/mps.h"

#include <sys/stat.h>
#include <unistd.h>

#include <memory>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace gradsync::gpu {

const char* MpsModeName(MpsMode mode) {
  switch (mode) {
    case MpsMode::kOn:
      return "on";
    case MpsMode::kOff:
      return "off";
    case MpsMode::kUnavailable:
      return "unavailable";
  }
  return "invalid";  // not a value of the enum: said, never taken for one
}

MpsState DecideMps(const MpsFacts& f) {
  const std::string control = f.pipe_dir + "/control";
  const std::string where = f.pipe_dir_from_env ? "CUDA_MPS_PIPE_DIRECTORY"
                                                : "CUDA_MPS_PIPE_DIRECTORY unset, NVIDIA's default";
  if (!f.gpu.ok()) return {MpsMode::kUnavailable, std::string(f.gpu.message())};
  if (f.devices <= 0) return {MpsMode::kUnavailable, "no CUDA device"};
  if (f.mps_devices >= f.devices) {
    return {MpsMode::kOn,
            absl::StrCat("contexts on all ", f.devices, " GPU(s) are MPS clients (", control, ")")};
  }
  if (f.mps_devices > 0) {
    return {MpsMode::kOff, absl::StrCat("only ", f.mps_devices, " of ", f.devices,
                                        " GPU(s) run this process as an MPS client (", control,
                                        "): the others time-slice with the trainers")};
  }
  switch (f.control) {
    case MpsFacts::Control::kMissing:
      return {MpsMode::kOff,
              absl::StrCat("no MPS control daemon: ", control, " does not exist (", where,
                           "); the GPU time-slices this daemon's kernels "
                           "with the trainers'")};
    case MpsFacts::Control::kNoAccess:
      return {MpsMode::kOff, absl::StrCat(control, " exists but this user (uid ", ::getuid(),
                                          ") cannot open it: CUDA runs without MPS here")};
    case MpsFacts::Control::kNotAPipe:
      return {MpsMode::kOff, absl::StrCat(control,
                                          " is not a pipe or socket: not an MPS control "
                                          "daemon's")};
    case MpsFacts::Control::kPipe:
      return {MpsMode::kOff,
              absl::StrCat(control,
                           " exists but CUDA did not make this process an MPS client "
                           "(a stale pipe of a stopped control daemon, or one this "
                           "process's CUDA could not reach)")};
  }
  return {MpsMode::kOff, "invalid control pipe state"};
}

namespace {

MpsFacts::Control LookAtControl(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return MpsFacts::Control::kMissing;
  if (!S_ISFIFO(st.st_mode) && !S_ISSOCK(st.st_mode)) return MpsFacts::Control::kNotAPipe;
  return ::access(path.c_str(), W_OK) == 0 ? MpsFacts::Control::kPipe
                                           : MpsFacts::Control::kNoAccess;
}

// The CUDA half of the facts, shared between the caller and the thread that asks CUDA. The
// status travels as its code and text, copied: an absl::Status shares its text by a reference
// count that the caller's copy and the thread's would drop on two threads.
struct CudaAnswer {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusCode code ABSL_GUARDED_BY(mu) = absl::StatusCode::kOk;
  std::string message ABSL_GUARDED_BY(mu);
  int devices ABSL_GUARDED_BY(mu) = 0;
  int mps_devices ABSL_GUARDED_BY(mu) = 0;
};

}  // namespace

MpsFacts GatherMpsFacts(GpuApi* gpu, const char* pipe_env, absl::Duration timeout) {
  MpsFacts f;
  f.pipe_dir_from_env = pipe_env != nullptr && *pipe_env != '\0';
  f.pipe_dir = f.pipe_dir_from_env ? pipe_env : kDefaultMpsPipeDirectory;
  f.control = LookAtControl(f.pipe_dir + "/control");
  auto answer = std::make_shared<CudaAnswer>();
  std::thread([gpu, answer] {
    absl::Status status;
    int devices = 0, mps = 0;
    if (absl::StatusOr<int> n = gpu->DeviceCount(); !n.ok()) {
      status = n.status();
    } else {
      devices = *n;
      for (int d = 0; d < devices && status.ok(); ++d) {
        absl::StatusOr<bool> on = gpu->MpsEnabled(d);
        if (!on.ok())
          status = on.status();
        else
          mps += *on ? 1 : 0;
      }
    }
    absl::MutexLock lock(&answer->mu);
    answer->code = status.code();
    answer->message = std::string(status.message());
    answer->devices = devices;
    answer->mps_devices = mps;
    answer->done = true;
  }).detach();
  f.cuda_answered = [answer, asked = absl::Now()]() -> absl::Status {
    absl::MutexLock lock(&answer->mu);
    if (answer->done) return absl::OkStatus();
    return absl::UnavailableError(absl::StrCat(
        "CUDA has not answered gradsyncd since it was first asked ",
        absl::FormatDuration(absl::Trunc(absl::Now() - asked, absl::Seconds(1))),
        " ago (its initialisation waits: an MPS server of another user draining? see "
        "deploy/mps.md); CUDA buffers are refused until it does: retry later, or use host "
        "buffers"));
  };
  absl::MutexLock lock(&answer->mu);
  if (!answer->mu.AwaitWithTimeout(absl::Condition(&answer->done), timeout)) {
    f.gpu = absl::DeadlineExceededError(
        absl::StrCat("CUDA did not initialise within ", absl::FormatDuration(timeout),
                     " (an MPS server of another user draining? see deploy/mps.md)"));
    return f;
  }
  f.gpu = absl::Status(answer->code, answer->message);
  f.devices = answer->devices;
  f.mps_devices = answer->mps_devices;
  return f;
}

}  // namespace gradsync::gpu
