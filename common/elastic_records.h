#pragma once

// The records of the elastic protocol that daemons write in a job's store (their messages are
// in proto/gradsync/v1/membership.proto; daemon/core/membership.cc writes them), read for
// clients and tools: as JSON, by one parser.

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gradsync {

/// What a Store.Join call's deadline leaves past its wait for an admission: for an admission
/// under way then, and the ticket's withdrawal (the daemon refuses a call with less).
inline constexpr absl::Duration kJoinGrace = absl::Seconds(10);

/// The kind of record at `key` of a job's store: "decision", "ticket" or "admission"; nullopt
/// for a key that holds none of them.
std::optional<std::string> ElasticRecordKind(absl::string_view key);

/// A record of kind `kind` as JSON (proto field names, every field, enums by name).
/// INVALID_ARGUMENT for an unknown kind, or bytes that are not such a record.
absl::StatusOr<std::string> ElasticRecordJson(absl::string_view kind, absl::string_view record);

}  // namespace gradsync
