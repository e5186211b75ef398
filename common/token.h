#pragma once

// Reads the cluster token that daemons share from its file.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsync {

/// The cluster token daemons share (issue: daemon-to-daemon calls), read from a file: the
/// first line, surrounding whitespace removed. FailedPrecondition when the file cannot be
/// read, is empty, or grants any access to "others" (it is a secret: chmod 600 or 640).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

/// Prefix of a client credential (ClientCredentialOf).
inline constexpr absl::string_view kClientCredentialPrefix = "gsc1.";

/// The credential a client of a job spanning nodes (a trainer, a tool) presents over TCP in the
/// token's place: kClientCredentialPrefix and the hex HMAC-SHA256 of a fixed label under the
/// cluster token. Every daemon holding the token computes the same one and can tell it from the
/// token; it grants a client's rights, never a daemon's (common/store_keys.h), and the token
/// cannot be recovered from it. A daemon hands it to the callers of its unix socket.
/// Empty when `token` is empty.
std::string ClientCredentialOf(absl::string_view token);

}  // namespace gradsync
