#pragma once

// Who may call the daemon: trainer sessions only on the unix socket, TCP calls only with the
// cluster token (a daemon) or the client credential derived from it (a trainer or a tool).

#include <unistd.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/token.h"
#include "daemon/rpc/listener.h"
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
  /// Who a call comes from, as far as the daemon can tell: what it may touch in a job's store
  /// follows from it (common/store_keys.h).
  enum class Caller {
    kLocal,   // the unix socket: a trainer or tool of the node (group gradsync)
    kClient,  // TCP with a job's client credential (ClientCredentialOf): a trainer elsewhere
    kDaemon,  // TCP with the cluster token: another daemon
  };

  /// A caller and, on the unix socket, its uid (SO_PEERCRED; unknown without LocalPeers).
  struct Who {
    Caller caller = Caller::kLocal;
    std::optional<uint32_t> uid;
    std::string job;  // kClient: the job its credential is for (CredentialJob)
  };

  /// An empty token checks nothing (TCP is then as open as the bind address makes it, and a
  /// TCP caller is taken for a daemon: tests only; the daemon never listens so).
  explicit PeerAuth(std::string token)
      : token_(std::move(token)), operator_uid_(static_cast<uint32_t>(::geteuid())) {}

  /// The caller of `ctx`, or UNAUTHENTICATED for a TCP call with neither the token nor the
  /// client credential.
  absl::StatusOr<Who> Identify(const grpc::CallbackServerContext* ctx) const;

  /// Authority per job: whether `who` may reach job `job`'s store namespace and inspection. A
  /// caller of the unix socket reaches a job (with its elastic epochs: CredentialJob) that no
  /// session on this daemon holds, or one that a session of its own uid holds; uid 0 and the
  /// daemon's own uid (operators) reach every job.
  /// A TCP client reaches the job its credential is for (its id and its elastic epochs'); a
  /// daemon (the token) every job. PERMISSION_DENIED naming the job otherwise.
  absl::Status MayReach(const Who& who, absl::string_view job) const;
  /// Identify, then MayReach: the caller of `ctx`, when it may reach job `job`.
  absl::StatusOr<Who> Reach(const grpc::CallbackServerContext* ctx, absl::string_view job) const;
  /// Whether a List of a job's keys shows `key` to `who`: the daemons' own keys (names only)
  /// to operators alone (IsOperator).
  bool MaySeeKey(const Who& who, absl::string_view key) const;
  /// A daemon (the token), or root or the daemon's own uid on the unix socket: who may see the
  /// names of the daemons' own keys (never their values, unless a daemon).
  bool IsOperator(const Who& who) const {
    return who.caller == Caller::kDaemon || (who.caller == Caller::kLocal && who.uid.has_value() &&
                                             (*who.uid == 0 || *who.uid == operator_uid_));
  }

  /// Where the unix socket's callers' uids come from, and which uids hold a job (the engine's
  /// sessions). Set before serving; without them MayReach lets every caller through.
  void SetLocalPeers(const LocalPeers* peers) { local_peers_ = peers; }
  /// Where a TCP connection that made an authenticated call is marked (for its listener's
  /// first-call deadline). Set before serving.
  void SetTcpPeers(TcpPeers* peers) { tcp_peers_ = peers; }
  using Holders = std::function<absl::flat_hash_set<uint32_t>(absl::string_view job)>;
  void SetJobHolders(Holders holders) { holders_ = std::move(holders); }

  /// What a caller of the unix socket presents over TCP to this cluster's daemons for job
  /// `job`; empty when this daemon has no token.
  std::string ClientCredentialFor(absl::string_view job) const {
    return ClientCredentialOf(token_, job);
  }

  /// OK for a call on the unix socket; PERMISSION_DENIED for any other, token or not: a trainer
  /// session maps the caller's memory, which only a local process can hand over.
  static absl::Status CheckTrainer(const grpc::CallbackServerContext* ctx);
  /// Whether `ctx` came in on the unix socket.
  static bool IsLocal(const grpc::CallbackServerContext* ctx);

 private:
  const std::string token_;
  const uint32_t operator_uid_;  // the daemon's own
  const LocalPeers* local_peers_ = nullptr;
  TcpPeers* tcp_peers_ = nullptr;
  Holders holders_;
};

/// Metadata key and value prefix a client sends the token in.
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";

}  // namespace gradsync::rpc
