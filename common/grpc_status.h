#pragma once

// The one place where absl::Status and grpc::Status are converted (both directions).

#include <cstddef>

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace gradsync {

/// Longest status message sent: gRPC carries it in the trailers, which a peer drops past its
/// metadata limit (8 KiB by default), so a longer one is cut here and says so.
inline constexpr size_t kMaxStatusMessageBytes = 4096;

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace gradsync
