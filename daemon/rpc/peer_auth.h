#pragma once

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::rpc {

/// The cluster-token check of calls that come over TCP (other daemons, remote tools). Calls on
/// the unix socket are trusted: its file mode and group guard it. With a token configured, a
/// TCP call must carry the metadata "authorization: Bearer <token>", else it is refused
/// UNAUTHENTICATED before it touches anything. Health and reflection stay open (they reveal
/// no job data). Immutable; thread-safe.
class PeerAuth {
 public:
  /// An empty token checks nothing (TCP is then as open as the bind address makes it).
  explicit PeerAuth(std::string token) : token_(std::move(token)) {}

  absl::Status Check(const grpc::CallbackServerContext* ctx) const;

  /// A reactor already finished with UNAUTHENTICATED, or nullptr when the call may proceed.
  grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* ctx) const;

 private:
  const std::string token_;
};

/// Metadata key and value prefix a client sends the token in.
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

}  // namespace gradsync::rpc
