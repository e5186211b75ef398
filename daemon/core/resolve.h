// Request resolution: one member's OpRequest checked against the wire's rules, the engine's
// limits and its session's buffers, and turned into an Arrival that knows its fingerprint, its
// group, its buffers and its data plane.
#pragma once

#include "absl/status/statusor.h"
#include "daemon/core/job.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core {

struct EngineOptions;

namespace internal {

/// Resolves `op` for `session` (takes the session's mutex briefly; not the job's). Errors name
/// the op ("all_reduce job=j group=0,1 rank=1: ..."): INVALID_ARGUMENT for a bad request (an op
/// whose buffers are both host and device memory too), NOT_FOUND for an unknown buffer,
/// FAILED_PRECONDITION once the session ended. The Arrival's session, sink and tag are unset.
absl::StatusOr<Arrival> Resolve(Session& session, const v1::OpRequest& op,
                                const EngineOptions& options);

}  // namespace internal
}  // namespace gradsync::core
