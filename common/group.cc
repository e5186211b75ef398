// Implementation of group.h: parsing and forming group keys.

#include "common/group.h"

#include <algorithm>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace gradsync {

absl::StatusOr<std::vector<int>> ParseGroupKey(absl::string_view key) {
  if (key == kWorldGroup) return std::vector<int>{};
  if (key.empty())
    return absl::InvalidArgumentError("group key is empty: want \"world\" or ranks like \"0,1\"");
  std::vector<int> ranks;
  for (absl::string_view part : absl::StrSplit(key, ',')) {
    int rank = 0;
    const bool digits = !part.empty() && std::all_of(part.begin(), part.end(), absl::ascii_isdigit);
    if (!digits || (part.size() > 1 && part[0] == '0') || !absl::SimpleAtoi(part, &rank)) {
      return absl::InvalidArgumentError(absl::StrCat("group key '", key, "': '", part,
                                                     "' is not a rank (a non-negative integer)"));
    }
    if (!ranks.empty() && rank <= ranks.back()) {
      return absl::InvalidArgumentError(
          absl::StrCat("group key '", key, "': ranks must be ascending and unique"));
    }
    ranks.push_back(rank);
  }
  return ranks;
}

std::string GroupKey(absl::Span<const int> ranks) { return absl::StrJoin(ranks, ","); }

}  // namespace gradsync
