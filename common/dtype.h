// The wire's enums in C++: element sizes, and the one spelling of every enum's name (dtype, op
// kind, reduce op) that logs, errors, fingerprints and users see.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "gradsync/v1/gradsync.pb.h"
#include "gradsync/v1/types.pb.h"

namespace gradsync {

using DType = ::gradsync::v1::DType;

/// Bytes per element; 0 for DTYPE_UNSPECIFIED or an unknown value.
int64_t DTypeSize(DType dtype);

/// Lower-case name as PyTorch and NumPy print it ("float32", "bfloat16"); "unspecified" else.
absl::string_view DTypeName(DType dtype);

/// "all_reduce", "broadcast", "barrier", "all_gather", "reduce_scatter"; "unknown_op" else.
absl::string_view OpKindName(v1::OpKind kind);

/// "sum", "mean", "min", "max"; "none" for REDUCE_OP_UNSPECIFIED or an unknown value.
absl::string_view ReduceOpName(v1::ReduceOp op);

/// Parses a name from DTypeName (also accepts "float", "double", "half", "int", "long").
absl::StatusOr<DType> ParseDType(absl::string_view name);

/// Number of elements of a shape ([] is a scalar: 1). InvalidArgument on a negative dimension
/// or when the count overflows int64.
absl::StatusOr<int64_t> NumElements(const google::protobuf::RepeatedField<int64_t>& shape);

}  // namespace gradsync
