// Implementation of grpc_status.h: absl::Status <-> grpc::Status, with long messages cut to
// kMaxStatusMessageBytes.

#include "common/grpc_status.h"

#include <string>

#include "absl/strings/str_cat.h"

namespace gradsync {

// absl::StatusCode and grpc::StatusCode share their numeric values (both follow google.rpc.Code).
grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  std::string message(status.message());
  if (message.size() > kMaxStatusMessageBytes) {
    const size_t cut = message.size() - kMaxStatusMessageBytes;
    message.resize(kMaxStatusMessageBytes);
    absl::StrAppend(&message, "... (", cut, " more bytes)");
  }
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::move(message));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace gradsync
