// Implementation of dtype.h: element sizes, enum names, dtype parsing, and element counts of
// shapes.

#include "common/dtype.h"

#include <limits>

#include "absl/strings/str_cat.h"

namespace gradsync {

int64_t DTypeSize(DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
    case v1::INT32:
      return 4;
    case v1::FLOAT64:
    case v1::INT64:
      return 8;
    case v1::FLOAT16:
    case v1::BFLOAT16:
      return 2;
    case v1::UINT8:
    case v1::INT8:
      return 1;
    default:
      return 0;
  }
}

absl::string_view DTypeName(DType dtype) {
  switch (dtype) {
    case v1::FLOAT32:
      return "float32";
    case v1::FLOAT64:
      return "float64";
    case v1::FLOAT16:
      return "float16";
    case v1::BFLOAT16:
      return "bfloat16";
    case v1::INT32:
      return "int32";
    case v1::INT64:
      return "int64";
    case v1::UINT8:
      return "uint8";
    case v1::INT8:
      return "int8";
    default:
      return "unspecified";
  }
}

absl::string_view OpKindName(v1::OpKind kind) {
  switch (kind) {
    case v1::ALL_REDUCE:
      return "all_reduce";
    case v1::BROADCAST:
      return "broadcast";
    case v1::BARRIER:
      return "barrier";
    case v1::ALL_GATHER:
      return "all_gather";
    case v1::REDUCE_SCATTER:
      return "reduce_scatter";
    default:
      return "unknown_op";
  }
}

absl::string_view ReduceOpName(v1::ReduceOp op) {
  switch (op) {
    case v1::SUM:
      return "sum";
    case v1::MEAN:
      return "mean";
    case v1::MIN:
      return "min";
    case v1::MAX:
      return "max";
    default:
      return "none";
  }
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  static constexpr std::pair<absl::string_view, DType> kAliases[] = {{"float", v1::FLOAT32},
                                                                     {"double", v1::FLOAT64},
                                                                     {"half", v1::FLOAT16},
                                                                     {"int", v1::INT32},
                                                                     {"long", v1::INT64}};
  for (int d = v1::DType_MIN; d <= v1::DType_MAX; ++d) {
    auto dtype = static_cast<DType>(d);
    if (dtype != v1::DTYPE_UNSPECIFIED && DTypeName(dtype) == name) return dtype;
  }
  for (const auto& [alias, dtype] : kAliases) {
    if (alias == name) return dtype;
  }
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "'"));
}

absl::StatusOr<int64_t> NumElements(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t dim : shape) {
    if (dim < 0) return absl::InvalidArgumentError(absl::StrCat("negative dimension ", dim));
    if (dim != 0 && n > std::numeric_limits<int64_t>::max() / dim) {
      return absl::InvalidArgumentError("element count overflows int64");
    }
    n *= dim;
  }
  return n;
}

}  // namespace gradsync
