#pragma once

// Pack plans (docs/architecture.md section 1): which gradients travel together in one fused
// collective, computed by a group's rank 0 and shared with the others through the job's store.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/store.h"
#include "gradsync/v1/types.pb.h"

namespace gradsync {

/// One gradient as backward produced it.
struct GradInfo {
  int32_t index = 0;  // parameter index
  v1::TensorSpec spec;
};

struct PackOptions {
  /// A dtype's pack closes once its bytes exceed this (so a pack may overshoot by one tensor).
  int64_t threshold_bytes = int64_t{10} << 20;
  /// The first N gradients in backward order go alone, so communication starts early.
  /// (MegEngine's planner fixes this at 8; here it is the caller's choice.)
  int32_t first_alone = 0;
};

/// The reference rule: walk `grads` in backward order; the first `first_alone` form one-element
/// packs; the rest accumulate per dtype, a dtype's pack closing as soon as its bytes exceed the
/// threshold; the open packs are emitted last, by dtype name. Pure; InvalidArgument on a bad
/// threshold, a repeated or negative index, an unspecified dtype or a negative dimension.
absl::StatusOr<v1::PackList> PlanPacks(absl::Span<const GradInfo> grads,
                                       const PackOptions& options = {});

/// Checks a plan received from elsewhere: non-empty packs, shapes parallel to indices, one dtype
/// per pack, no index twice, `bytes` equal to the members' sizes.
absl::Status ValidatePackList(const v1::PackList& pack_list);

/// Store key of a group's plan, under the reserved prefix.
std::string PackListKey(absl::string_view group);

/// Keys under this prefix are written only through typed calls (SetPackList).
inline constexpr absl::string_view kReservedKeyPrefix = "_gradsync/";
inline constexpr absl::string_view kPackListKeyPrefix = "_gradsync/packlist/";

/// Validates and stores `pack_list` for (job, group).
absl::Status PutPackList(Store& store, absl::string_view job, absl::string_view group,
                         const v1::PackList& pack_list);

/// Waits for (job, group)'s plan until `deadline`; DataLoss if the stored bytes do not parse.
absl::StatusOr<v1::PackList> FetchPackList(Store& store, absl::string_view job,
                                           absl::string_view group, absl::Time deadline);

/// Parses and validates a stored plan.
absl::StatusOr<v1::PackList> DecodePackList(absl::string_view bytes);

}  // namespace gradsync
