#pragma once

// Group keys: "world" or member ranks joined by ",", parsed and formed.

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace gradsync {

/// Group key of WORLD.
inline constexpr absl::string_view kWorldGroup = "world";

/// Parses a group key: "world", or member ranks in ascending order joined by ","
/// ("0,1,3"), as the reference optimizer's group key. Returns the ranks (empty for WORLD).
/// InvalidArgument names what is wrong (empty, not a number, negative, unsorted, repeated).
absl::StatusOr<std::vector<int>> ParseGroupKey(absl::string_view key);

/// The key of a group with these ranks (sorted and unique by the caller).
std::string GroupKey(absl::Span<const int> ranks);

}  // namespace gradsync
