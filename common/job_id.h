#pragma once

// The one rule every path applies to job ids.

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsync {

/// Longest job id, in bytes.
inline constexpr size_t kMaxJobIdBytes = 128;

/// The one rule for job ids, on every path that takes one (trainer sessions, the store,
/// inspection): 1 to kMaxJobIdBytes of letters, digits, '-', '_' and '.', and not "." or "..".
/// So an id is safe in a log line, a store key, a file or shared-memory name. InvalidArgument
/// naming the id (escaped) otherwise.
absl::Status CheckJobId(absl::string_view job);

/// Elastic jobs: the id of epoch `epoch` of job `base` ("base" for 0, "base.e<epoch>" after).
std::string ElasticJobId(absl::string_view base, int epoch);
/// The base of `id`, the id of epoch `epoch` of an elastic job; INVALID_ARGUMENT when `id` is
/// not such an id.
absl::StatusOr<std::string> ElasticBase(absl::string_view id, int epoch);
/// Whether `id` is the id of an epoch (0 or later) of elastic job `base`.
bool IsEpochOf(absl::string_view id, absl::string_view base);

}  // namespace gradsync
