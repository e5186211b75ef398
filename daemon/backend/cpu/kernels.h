#pragma once

// Element-wise kernels of the CPU data plane over segmented views. Half types (float16,
// bfloat16) are reduced in float32 and rounded once to nearest-even, never as raw integers.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "common/dtype.h"
#include "daemon/core/backend.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::backend::cpu {

/// Elements [offset, offset + n) of a view.
struct Slice {
  const core::View* view;
  int64_t offset;
};

/// For i in [0, n): every dst[i] = op over srcs[i]; MEAN divides the sum by `divisor`.
/// With one source every destination gets its value (MEAN still divides). Sources may alias
/// destinations element for element (in-place all-reduce); no other overlap. Single-threaded;
/// callers split ranges. An op other than SUM, MEAN, MIN and MAX, an unknown dtype, or n > 0
/// with no source is INTERNAL naming it (the engine validated the op: a caller's bug), checked
/// before any byte is written.
absl::Status Reduce(DType dtype, v1::ReduceOp op, int64_t divisor, absl::Span<const Slice> srcs,
                    absl::Span<const Slice> dsts, int64_t n);

/// For i in [0, n): every dst[i] = src[i] (the destinations may include `src` itself, element
/// for element; no other overlap). An unknown dtype is INTERNAL naming it, before any write.
absl::Status Copy(DType dtype, const Slice& src, absl::Span<const Slice> dsts, int64_t n);

/// float32 <-> float16 / bfloat16, round to nearest even (exposed for tests).
float HalfToFloat(uint16_t h);
uint16_t FloatToHalf(float f);
float BFloat16ToFloat(uint16_t b);
uint16_t FloatToBFloat16(float f);

}  // namespace gradsync::backend::cpu
