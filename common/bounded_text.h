#pragma once

// Error texts are bounded: a list in a message names its first few items and counts the rest,
// so a status always fits in gRPC's trailers however many keys or ranks a request named.

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace gradsync {

/// Items an error message names before it only counts the rest.
inline constexpr size_t kListedInErrors = 8;
/// Longest item (a key) shown in an error message; longer ones are cut with "...".
inline constexpr size_t kItemBytesInErrors = 64;

/// "a, b, c" or, past `shown` items, "a, b, c and 9997 more". Items are anything StrCat takes.
template <typename Range>
std::string JoinBounded(const Range& items, absl::string_view separator = ", ",
                        size_t shown = kListedInErrors) {
  std::string out;
  size_t n = 0;
  for (const auto& item : items) {
    if (n < shown) {
      std::string text = absl::StrCat(item);
      if (text.size() > kItemBytesInErrors)
        text = absl::StrCat(text.substr(0, kItemBytesInErrors), "...");
      absl::StrAppend(&out, n == 0 ? "" : separator, text);
    }
    ++n;
  }
  if (n > shown) absl::StrAppend(&out, " and ", n - shown, " more");
  return out;
}

}  // namespace gradsync
