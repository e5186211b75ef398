#pragma once

// Random secrets as hex text (tokens, keys), from the kernel's random source.

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"

namespace gradsync {

/// `bytes` random bytes from getrandom(2), as 2 * bytes lowercase hex characters.
absl::StatusOr<std::string> RandomHex(size_t bytes);

}  // namespace gradsync
