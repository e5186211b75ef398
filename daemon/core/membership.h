#pragma once

// Membership records an elastic job's clients ask the daemons to write: the checks a request
// must pass before its record reaches the job's store, in one place.

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/store.h"

namespace gradsync::core {

/// Most ranks one decision admits, and the largest world it may make.
inline constexpr int kMaxJoinedPerDecision = 1024;
inline constexpr int kMaxElasticWorld = 1 << 16;
/// Longest reason a client may give for a join, in bytes.
inline constexpr size_t kMaxJoinWhyBytes = 256;

struct JoinDecision {
  bool decided = false;  // this request's record went in (else another was there first)
  std::string record;    // the decision now recorded
};

/// Records in `store` the decision that epoch `epoch` of the elastic job whose previous epoch
/// is namespace `job` admits `joined` more ranks, if no decision was recorded first (by a loss,
/// or another join); returns the record now there. Checks before writing anything: `job` is
/// epoch `epoch - 1` of its job's id, is elastic and has formed (its run token and every rank's
/// node are in it), `joined` is 1 to kMaxJoinedPerDecision, the new world at most kMaxElasticWorld,
/// `why` short and printable. FAILED_PRECONDITION, INVALID_ARGUMENT or RESOURCE_EXHAUSTED
/// otherwise, naming the check. The world is counted from the ranks' node keys, not taken
/// from the caller. Thread-safe as `store` is; returns after at most a few store calls.
absl::StatusOr<JoinDecision> DecideJoin(gradsync::Store& store, absl::string_view job, int epoch,
                                        int joined, absl::string_view why);

}  // namespace gradsync::core
