#pragma once

// Device work of the GPU tests' trainer (gpu_worker), all on the trainer's own stream, so that
// what a check sees depends on the daemon honouring the stream order: "ready" recorded after
// the kernel that wrote an op's input, "done" waited for before the kernel that reads its
// output. Plain CUDA runtime calls; errors come back as cudaError_t.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace gradsync::testing {

/// Element i is base + step * (i % period): exact in float32 for the sizes used here.
struct Pattern {
  float base = 0;
  float step = 0;
  int64_t period = 1;
};

/// What one check found (zero it before the check: cudaMemsetAsync).
struct CheckSlot {
  unsigned long long wrong;  // elements that differ from the pattern
  unsigned int sampled;      // set by the first thread that records a wrong element
  float got;                 // that element's value
  long long index;           // and index
};

/// One thread spins for `us` microseconds of GPU time (%globaltimer, bounded by a loop count
/// too): the stream's next kernel starts that late.
cudaError_t LaunchDelay(int64_t us, cudaStream_t stream);
/// data[i] = pattern(i) for i < n.
cudaError_t LaunchFill(float* data, int64_t n, Pattern pattern, cudaStream_t stream);
/// Counts into `slot` the elements of data[0, n) that are not pattern(i) (NaN is wrong).
cudaError_t LaunchCheck(const float* data, int64_t n, Pattern pattern, CheckSlot* slot,
                        cudaStream_t stream);

}  // namespace gradsync::testing
