#pragma once

// Reads the cluster token that daemons share from its file.

#include <string>

#include "absl/status/statusor.h"

namespace gradsync {

/// The cluster token daemons share (issue: daemon-to-daemon calls), read from a file: the
/// first line, surrounding whitespace removed. FailedPrecondition when the file cannot be
/// read, is empty, or grants any access to "others" (it is a secret: chmod 600 or 640).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace gradsync
