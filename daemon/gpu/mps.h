#pragma once

// Whether the daemon's kernels can run at the same time as the trainers' (docs/gpu.md,
// "Overlap"). Kernels of different CUDA contexts do not run concurrently on one GPU: the GPU
// time-slices contexts. Under MPS, every client process's work goes to the GPU through one
// server, so the daemon's NCCL kernels overlap a trainer's backward. Whether a process is an MPS
// client is decided by the CUDA driver when CUDA initialises: it connects to the control daemon's
// pipe in CUDA_MPS_PIPE_DIRECTORY (NVIDIA's default /tmp/nvidia-mps) and, if that works, every
// context it creates is an MPS client; the device attribute cudaDevAttrMpsEnabled ("contexts
// created on this device will be shared via MPS") reports the outcome. The pipe alone is not
// enough: it may be stale, or not reachable by this user.

#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::gpu {

/// NVIDIA's default pipe directory of the MPS control daemon and its clients.
inline constexpr char kDefaultMpsPipeDirectory[] = "/tmp/nvidia-mps";

/// What the daemon saw at start; DecideMps turns it into one answer.
struct MpsFacts {
  enum class Control { kMissing, kPipe, kNoAccess, kNotAPipe };
  std::string pipe_dir;  // CUDA_MPS_PIPE_DIRECTORY, else the default
  bool pipe_dir_from_env = false;
  Control control = Control::kMissing;  // <pipe_dir>/control, and whether this user may write it
  absl::Status gpu;  // not OK: CUDA cannot run here (no driver, no device, built without CUDA,
                     // or it did not answer in time), with the reason
  int devices = 0;
  int mps_devices = 0;  // devices whose cudaDevAttrMpsEnabled is set for this process
  /// OK once CUDA has answered the calls above (whatever it said), also later than `timeout`;
  /// UNAVAILABLE while it has not, saying since when. Until then any CUDA call of the daemon
  /// would wait inside CUDA's initialisation with no deadline. Thread-safe; never null from
  /// GatherMpsFacts.
  std::function<absl::Status()> cuda_answered;
};

enum class MpsMode { kOn, kOff, kUnavailable };

struct MpsState {
  MpsMode mode = MpsMode::kUnavailable;
  std::string reason;
};

/// "on", "off" or "unavailable": the log line's, the metric's and Inspect's word.
const char* MpsModeName(MpsMode mode);

/// On: every device's contexts are MPS clients. Off: a GPU is here but this process's kernels
/// are time-sliced with the trainers' (the reason says what is missing). Unavailable: no usable
/// GPU. Pure; unit-tested on fake facts.
MpsState DecideMps(const MpsFacts& facts);

/// Reads the pipe directory (`pipe_env`: CUDA_MPS_PIPE_DIRECTORY's value, null when unset) and
/// asks CUDA through `gpu`. The CUDA calls run on a thread of their own and are given up after
/// `timeout` (the driver may wait while an MPS server of another user drains); that thread is
/// then left to finish on its own and touches nothing but `gpu` and its own state. Called once,
/// at start, before the daemon serves.
MpsFacts GatherMpsFacts(GpuApi* gpu, const char* pipe_env, absl::Duration timeout);

}  // namespace gradsync::gpu
