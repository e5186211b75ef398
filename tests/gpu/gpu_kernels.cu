#include <algorithm>

#include "tests/gpu/gpu_kernels.h"

namespace gradsync::testing {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

__device__ long long GlobalTimerNs() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__global__ void Delay(long long ns, long long max_naps) {
  const long long start = GlobalTimerNs();
  for (long long nap = 0; nap < max_naps && GlobalTimerNs() - start < ns; ++nap) {
    __nanosleep(1000);
  }
}

__device__ float At(const Pattern& p, int64_t i) {
  return p.base + p.step * static_cast<float>(i % p.period);
}

__global__ void Fill(float* data, int64_t n, Pattern p) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    data[i] = At(p, i);
  }
}

__global__ void Check(const float* data, int64_t n, Pattern p, CheckSlot* slot) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const float want = At(p, i);
    const float got = data[i];
    if (!(fabsf(got - want) <= 1e-5f * fmaxf(1.0f, fabsf(want)))) {
      atomicAdd(&slot->wrong, 1ULL);
      if (atomicCAS(&slot->sampled, 0u, 1u) == 0u) {
        slot->got = got;
        slot->index = i;
      }
    }
  }
}

unsigned int Blocks(int64_t n) {
  return static_cast<unsigned int>(
      std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

}  // namespace

cudaError_t LaunchDelay(int64_t us, cudaStream_t stream) {
  // Naps of about 1 us; at most 4x as many as the delay needs, should the timer not move.
  Delay<<<1, 1, 0, stream>>>(us * 1000, 4 * us + 1000);
  return cudaGetLastError();
}

cudaError_t LaunchFill(float* data, int64_t n, Pattern pattern, cudaStream_t stream) {
  Fill<<<Blocks(n), kThreads, 0, stream>>>(data, n, pattern);
  return cudaGetLastError();
}

cudaError_t LaunchCheck(const float* data, int64_t n, Pattern pattern, CheckSlot* slot,
                        cudaStream_t stream) {
  Check<<<Blocks(n), kThreads, 0, stream>>>(data, n, pattern, slot);
  return cudaGetLastError();
}

}  // namespace gradsync::testing
