// The one CUDA error conversion (common/cuda_util.h) and which errors leave the context broken.
// Built with CUDA only; the runtime's error strings need no device.
#include "common/cuda_util.h"

#include <cuda_runtime_api.h>

#include "gtest/gtest.h"

namespace gradsync::cuda {
namespace {

TEST(CudaUtilTest, ErrorsBecomeStatusesWithTheCallAndDevice) {
  EXPECT_TRUE(FromCuda(cudaSuccess, "cudaSetDevice", 0).ok());
  absl::Status s = FromCuda(cudaErrorInvalidResourceHandle, "cudaIpcOpenMemHandle", 1);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(),
            "cudaIpcOpenMemHandle (device 1): invalid resource handle "
            "(cudaErrorInvalidResourceHandle)");
  EXPECT_EQ(FromCuda(cudaErrorNoDevice, "cudaGetDeviceCount").code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(FromCuda(cudaErrorMemoryAllocation, "cudaMalloc", 0).code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(FromCuda(cudaErrorIllegalAddress, "cudaStreamQuery", 0).code(),
            absl::StatusCode::kInternal);
}

TEST(CudaUtilTest, OnlyKernelFaultsAreSticky) {
  for (cudaError_t e : {cudaErrorIllegalAddress, cudaErrorLaunchFailure, cudaErrorAssert,
                        cudaErrorMisalignedAddress, cudaErrorIllegalInstruction}) {
    EXPECT_TRUE(IsSticky(e)) << cudaGetErrorName(e);
  }
  for (cudaError_t e : {cudaSuccess, cudaErrorNotReady, cudaErrorInvalidValue, cudaErrorNoDevice,
                        cudaErrorInvalidResourceHandle, cudaErrorMemoryAllocation}) {
    EXPECT_FALSE(IsSticky(e)) << cudaGetErrorName(e);
  }
}

}  // namespace
}  // namespace gradsync::cuda
