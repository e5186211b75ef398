// Implementation of call_util.h: finishing a unary call from an absl::Status, and the deadline
// a waiting call waits until.

#include "daemon/rpc/call_util.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"

namespace gradsync::rpc {

grpc::ServerUnaryReactor* Reply(grpc::CallbackServerContext* ctx, const absl::Status& status) {
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  reactor->Finish(ToGrpcStatus(status));
  return reactor;
}

absl::StatusOr<absl::Time> WaitDeadline(const grpc::CallbackServerContext* ctx,
                                        absl::string_view what, absl::Duration max_wait) {
  if (ctx->deadline() == std::chrono::system_clock::time_point::max()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what,
        " waits and needs a deadline on the call (grpcurl -max-time, gradsyncctl --timeout)"));
  }
  const absl::Time now = absl::Now();
  const absl::Time deadline = std::min(absl::FromChrono(ctx->deadline()), now + max_wait);
  const absl::Duration margin =
      std::clamp((deadline - now) / 4, absl::Milliseconds(1), absl::Milliseconds(200));
  return deadline - margin;
}

}  // namespace gradsync::rpc
