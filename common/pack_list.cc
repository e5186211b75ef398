// Implementation of pack_list.h: planning packs, validating them, and storing and fetching a
// group's plan in the job's store.

#include "common/pack_list.h"

#include <map>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "common/group.h"
#include "common/status_macros.h"

namespace gradsync {
namespace {

absl::StatusOr<int64_t> TensorBytes(const v1::TensorSpec& spec, int32_t index) {
  const int64_t item = DTypeSize(spec.dtype());
  if (item == 0) {
    return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": dtype is unspecified"));
  }
  auto elements = NumElements(spec.shape());
  if (!elements.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", index, ": ", elements.status().message()));
  }
  if (*elements > INT64_MAX / item) {
    return absl::InvalidArgumentError(absl::StrCat("parameter ", index, ": size overflows int64"));
  }
  return *elements * item;
}

void Append(v1::Pack& pack, const GradInfo& grad, int64_t bytes) {
  pack.set_dtype(grad.spec.dtype());
  pack.add_indices(grad.index);
  *pack.add_shapes() = grad.spec;
  pack.set_bytes(pack.bytes() + bytes);
}

}  // namespace

absl::StatusOr<v1::PackList> PlanPacks(absl::Span<const GradInfo> grads,
                                       const PackOptions& options) {
  if (options.threshold_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("pack threshold must be positive, got ", options.threshold_bytes));
  }
  if (options.first_alone < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("first_alone must be >= 0, got ", options.first_alone));
  }
  v1::PackList plan;
  plan.set_threshold_bytes(options.threshold_bytes);
  plan.set_first_alone(options.first_alone);
  // Open packs by dtype name: the name orders the final flush like the reference.
  std::map<absl::string_view, v1::Pack> open;
  absl::flat_hash_set<int32_t> seen;
  int32_t position = 0;
  for (const GradInfo& grad : grads) {
    if (grad.index < 0) {
      return absl::InvalidArgumentError(absl::StrCat("negative parameter index ", grad.index));
    }
    if (!seen.insert(grad.index).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", grad.index, " appears twice in the gradient order"));
    }
    GRADSYNC_ASSIGN_OR_RETURN(int64_t bytes, TensorBytes(grad.spec, grad.index));
    if (position++ < options.first_alone) {
      Append(*plan.add_packs(), grad, bytes);
      continue;
    }
    v1::Pack& pack = open[DTypeName(grad.spec.dtype())];
    Append(pack, grad, bytes);
    if (pack.bytes() > options.threshold_bytes) {
      *plan.add_packs() = std::move(pack);
      pack.Clear();
    }
  }
  for (auto& [name, pack] : open) {
    if (pack.indices_size() > 0) *plan.add_packs() = std::move(pack);
  }
  return plan;
}

absl::Status ValidatePackList(const v1::PackList& pack_list) {
  if (pack_list.threshold_bytes() < 0 || pack_list.first_alone() < 0) {
    return absl::InvalidArgumentError("pack list: threshold_bytes and first_alone must be >= 0");
  }
  absl::flat_hash_set<int32_t> seen;
  for (int p = 0; p < pack_list.packs_size(); ++p) {
    const v1::Pack& pack = pack_list.packs(p);
    if (pack.indices_size() == 0) {
      return absl::InvalidArgumentError(absl::StrCat("pack ", p, " is empty"));
    }
    if (pack.shapes_size() != pack.indices_size()) {
      return absl::InvalidArgumentError(absl::StrCat("pack ", p, " has ", pack.indices_size(),
                                                     " indices but ", pack.shapes_size(),
                                                     " shapes"));
    }
    int64_t total = 0;
    for (int i = 0; i < pack.indices_size(); ++i) {
      const int32_t index = pack.indices(i);
      if (index < 0 || !seen.insert(index).second) {
        return absl::InvalidArgumentError(
            absl::StrCat("pack ", p, ": parameter index ", index, " is negative or repeated"));
      }
      if (pack.shapes(i).dtype() != pack.dtype()) {
        return absl::InvalidArgumentError(absl::StrCat("pack ", p, ": parameter ", index, " is ",
                                                       DTypeName(pack.shapes(i).dtype()), " in a ",
                                                       DTypeName(pack.dtype()), " pack"));
      }
      auto bytes = TensorBytes(pack.shapes(i), index);
      if (!bytes.ok()) {
        return absl::InvalidArgumentError(absl::StrCat("pack ", p, ": ", bytes.status().message()));
      }
      if (*bytes > INT64_MAX - total) {
        return absl::InvalidArgumentError(absl::StrCat("pack ", p, ": size overflows int64"));
      }
      total += *bytes;
    }
    if (total != pack.bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("pack ", p, ": bytes is ", pack.bytes(),
                                                     " but its members add up to ", total));
    }
  }
  return absl::OkStatus();
}

std::string PackListKey(absl::string_view group) { return absl::StrCat(kPackListKeyPrefix, group); }

absl::Status PutPackList(Store& store, absl::string_view job, absl::string_view group,
                         const v1::PackList& pack_list) {
  GRADSYNC_RETURN_IF_ERROR(ParseGroupKey(group).status());
  GRADSYNC_RETURN_IF_ERROR(ValidatePackList(pack_list));
  return store.Set(job, PackListKey(group), pack_list.SerializeAsString());
}

absl::StatusOr<v1::PackList> DecodePackList(absl::string_view bytes) {
  v1::PackList pack_list;
  if (!pack_list.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    return absl::DataLossError("stored pack list does not parse");
  }
  GRADSYNC_RETURN_IF_ERROR(ValidatePackList(pack_list));
  return pack_list;
}

absl::StatusOr<v1::PackList> FetchPackList(Store& store, absl::string_view job,
                                           absl::string_view group, absl::Time deadline) {
  GRADSYNC_RETURN_IF_ERROR(ParseGroupKey(group).status());
  GRADSYNC_ASSIGN_OR_RETURN(std::string bytes, store.Get(job, PackListKey(group), deadline));
  return DecodePackList(bytes);
}

}  // namespace gradsync
