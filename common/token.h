#pragma once

// Reads the cluster token that daemons share from its file.

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gradsync {

/// The cluster token daemons share (issue: daemon-to-daemon calls), read from a file: the
/// first line, surrounding whitespace removed. FailedPrecondition when the file cannot be
/// read, is empty, or grants any access to "others" (it is a secret: chmod 600 or 640).
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

/// Whether two secrets are equal, compared without an early exit, so the time taken does not
/// tell how much of a guess matched.
bool SameSecret(absl::string_view a, absl::string_view b);

/// Prefix of a client credential (ClientCredentialOf).
inline constexpr absl::string_view kClientCredentialPrefix = "gsc1.";

/// The job a client credential is for, given any namespace of it: the job's id, less an elastic
/// epoch's ".e<N>" (a job's epochs share its credential).
std::string CredentialJob(absl::string_view job);

/// The credential a client of job `job` spanning nodes (a trainer, a tool) presents over TCP
/// in the token's place: kClientCredentialPrefix, CredentialJob(job), '.', and the hex
/// HMAC-SHA256 under the cluster token of a fixed label and that job. Every daemon holding the
/// token computes the same one and can tell it from the token; it grants a client's rights on
/// that job's namespaces alone, never a daemon's (common/store_keys.h), and the token cannot be
/// recovered from it. A daemon hands it to the callers of its unix socket that may reach the
/// job. Empty when `token` is empty.
std::string ClientCredentialOf(absl::string_view token, absl::string_view job);

/// The job `credential` is for, when it is a client credential under `token` (compared in
/// constant time); nullopt otherwise.
std::optional<std::string> VerifyClientCredential(absl::string_view token,
                                                  absl::string_view credential);

}  // namespace gradsync
