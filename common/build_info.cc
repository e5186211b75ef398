// Implementation of build_info.h: the version line, with CUDA and NCCL versions when built
// with CUDA.

#include "common/build_info.h"

#include "absl/strings/str_cat.h"
#include "common/version.h"

#ifdef GRADSYNC_WITH_CUDA
#include <cuda_runtime_api.h>
#include <nccl.h>
#endif

namespace gradsync {

std::string BuildInfo() {
#ifdef GRADSYNC_WITH_CUDA
  return absl::StrCat("gradsync ", GRADSYNC_VERSION, " (cuda ", CUDART_VERSION / 1000, ".",
                      (CUDART_VERSION % 1000) / 10, ", nccl ", NCCL_MAJOR, ".", NCCL_MINOR, ".",
                      NCCL_PATCH, ")");
#else
  return absl::StrCat("gradsync ", GRADSYNC_VERSION, " (cuda off)");
#endif
}

}  // namespace gradsync
