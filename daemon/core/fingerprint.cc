// Fingerprints and labels of ops (see fingerprint.h).
#include "daemon/core/fingerprint.h"

#include "absl/strings/str_cat.h"

namespace gradsync::core::internal {

bool Reduces(v1::OpKind kind) { return kind == v1::ALL_REDUCE || kind == v1::REDUCE_SCATTER; }

std::string Fingerprint::Describe() const {
  std::string out = absl::StrCat(OpKindName(kind), "(");
  if (Reduces(kind)) absl::StrAppend(&out, ReduceOpName(reduce_op), ", ");
  if (kind != v1::BARRIER) absl::StrAppend(&out, DTypeName(dtype), ", count=", count, ", ");
  if (kind == v1::BROADCAST) absl::StrAppend(&out, "root=", root, ", ");
  absl::StrAppend(&out, "name='", name, "')");
  return out;
}

std::string OpLabel(v1::OpKind kind, absl::string_view job, absl::string_view group,
                    std::optional<uint64_t> seq) {
  std::string out = absl::StrCat(OpKindName(kind), " job=", job, " group=", group);
  if (seq.has_value()) absl::StrAppend(&out, " seq=", *seq);
  return out;
}

}  // namespace gradsync::core::internal
