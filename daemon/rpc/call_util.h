#pragma once

// Helpers shared by the gRPC services: finishing a unary call from an absl::Status, and reading
// the call's deadline. Glue only; the work happens in the store and the core.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::rpc {

/// Finishes the call with `status` (converted in common/grpc_status) and returns its reactor.
grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status);

/// The deadline a waiting call waits until: the call's gRPC deadline, capped at now + max_wait,
/// less a margin (a quarter of the wait, at most 200 ms) so that our DEADLINE_EXCEEDED (which
/// names what is missing) reaches the
/// client before its own. InvalidArgument when the call carries no deadline.
absl::StatusOr<absl::Time> WaitDeadline(const grpc::CallbackServerContext* ctx,
                                        absl::string_view what, absl::Duration max_wait);

}  // namespace gradsync::rpc
