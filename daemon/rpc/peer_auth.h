#pragma once

// Who may call the daemon: trainer sessions only on the unix socket, TCP calls only with the
// cluster token.

#include <string>

#include "absl/status/status.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::rpc {

/// Who may call what (docs/architecture.md section 6). The unix socket is the trainers' door: its
/// file mode and group guard it, and only it serves trainer sessions (CheckTrainer). TCP is for
/// other daemons and remote tools: a TCP call must carry the metadata "authorization: Bearer
/// <token>", else it is refused UNAUTHENTICATED before it touches anything (the daemon does not
/// listen on TCP without a token). Health and reflection stay open (they reveal no job data). With
/// --tls_* the TCP listener also requires a client certificate from the cluster's CA (checked in
/// the TLS handshake, before any call reaches this class); the token is required all the same.
/// Immutable; thread-safe.
class PeerAuth {
 public:
  /// An empty token checks nothing (TCP is then as open as the bind address makes it).
  explicit PeerAuth(std::string token) : token_(std::move(token)) {}

  absl::Status Check(const grpc::CallbackServerContext* ctx) const;

  /// OK for a call on the unix socket; PERMISSION_DENIED for any other, token or not: a trainer
  /// session maps the caller's memory, which only a local process can hand over.
  static absl::Status CheckTrainer(const grpc::CallbackServerContext* ctx);

  /// A reactor already finished with UNAUTHENTICATED, or nullptr when the call may proceed.
  grpc::ServerUnaryReactor* Refuse(grpc::CallbackServerContext* ctx) const;

 private:
  const std::string token_;
};

/// Metadata key and value prefix a client sends the token in.
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

}  // namespace gradsync::rpc
