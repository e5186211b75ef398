#pragma once

// The one place where absl::Status and grpc::Status are converted (both directions).

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace gradsync {

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace gradsync
