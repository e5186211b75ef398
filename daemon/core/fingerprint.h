// What names an op: its fingerprint (what every member's k-th op of a group must agree on) and
// its label ("all_reduce job=j group=0,1 seq=17"), the one spelling errors and logs use.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/string_view.h"
#include "common/dtype.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core::internal {

/// Whether ops of this kind combine values with a reduce op.
bool Reduces(v1::OpKind kind);

// What every member's k-th op of a group must agree on.
struct Fingerprint {
  v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
  v1::ReduceOp reduce_op = v1::REDUCE_OP_UNSPECIFIED;
  DType dtype = v1::DTYPE_UNSPECIFIED;
  int64_t count = 0;
  int root = 0;
  std::string name;

  bool operator==(const Fingerprint& o) const {
    return kind == o.kind && reduce_op == o.reduce_op && dtype == o.dtype && count == o.count &&
           root == o.root && name == o.name;
  }
  /// "all_reduce(sum, float32, count=16, name='w')".
  std::string Describe() const;
};

/// "all_reduce job=j group=0,1 seq=17"; without " seq=" for an op that has no sequence number.
std::string OpLabel(v1::OpKind kind, absl::string_view job, absl::string_view group,
                    std::optional<uint64_t> seq = std::nullopt);

}  // namespace gradsync::core::internal
