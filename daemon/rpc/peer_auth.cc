// Implementation of peer_auth.h: the bearer-token check on TCP calls (compared in constant
// time) and the unix-socket-only check for trainer sessions.

#include "daemon/rpc/peer_auth.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "common/store_keys.h"

namespace gradsync::rpc {

absl::StatusOr<PeerAuth::Who> PeerAuth::Identify(const grpc::CallbackServerContext* ctx) const {
  if (IsLocal(ctx)) {
    Who who{Caller::kLocal, std::nullopt, ""};
    if (local_peers_ != nullptr) {
      if (std::optional<LocalPeer> peer = local_peers_->Find(ctx->peer())) who.uid = peer->uid;
    }
    return who;
  }
  if (token_.empty()) return Who{Caller::kDaemon, std::nullopt, ""};
  const auto& metadata = ctx->client_metadata();
  auto it = metadata.find(kAuthMetadataKey);
  if (it != metadata.end()) {
    const absl::string_view value(it->second.data(), it->second.size());
    if (absl::StartsWith(value, kBearerPrefix)) {
      const absl::string_view presented = value.substr(sizeof(kBearerPrefix) - 1);
      std::optional<Who> who;
      if (SameSecret(presented, token_)) {
        who = Who{Caller::kDaemon, std::nullopt, ""};
      } else if (std::optional<std::string> job = VerifyClientCredential(token_, presented)) {
        who = Who{Caller::kClient, std::nullopt, *std::move(job)};
      }
      if (who.has_value()) {
        if (tcp_peers_ != nullptr) tcp_peers_->MarkAuthenticated(ctx->peer());
        return *std::move(who);
      }
    }
  }
  return absl::UnauthenticatedError(
      "missing or wrong cluster token: TCP calls must carry the token of the daemon's "
      "--token_file, or the client credential a daemon of the cluster hands out on its unix "
      "socket (gradsyncctl --token_file)");
}

absl::Status PeerAuth::MayReach(const Who& who, absl::string_view job) const {
  if (who.caller == Caller::kDaemon) return absl::OkStatus();
  if (who.caller == Caller::kClient) {
    if (CredentialJob(job) == who.job) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat("the client credential presented is for job '",
                                                    who.job, "', not '", job, "'"));
  }
  if (!holders_ || IsOperator(who)) return absl::OkStatus();
  // A job's namespaces go together (its id and its elastic epochs', as its credential): one
  // held by a user holds them all.
  const std::string family = CredentialJob(job);
  absl::flat_hash_set<uint32_t> holders = holders_(family);
  if (family != job) {  // a job whose own id ends ".e<N>" (not elastic) holds it too
    const absl::flat_hash_set<uint32_t> own = holders_(job);
    holders.insert(own.begin(), own.end());
  }
  if (holders.empty() || (who.uid.has_value() && holders.contains(*who.uid))) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(
      "job '", job,
      "' is held by another user's trainers on this node: a caller of the unix "
      "socket reaches only the jobs its own user's trainers hold (or that none holds)"));
}

absl::StatusOr<PeerAuth::Who> PeerAuth::Reach(const grpc::CallbackServerContext* ctx,
                                              absl::string_view job) const {
  absl::StatusOr<Who> who = Identify(ctx);
  if (!who.ok()) return who.status();
  GRADSYNC_RETURN_IF_ERROR(MayReach(*who, job));
  return who;
}

bool PeerAuth::MaySeeKey(const Who& who, absl::string_view key) const {
  return IsOperator(who) || ClassOfKey(key) != KeyClass::kDaemonOnly;
}

bool PeerAuth::IsLocal(const grpc::CallbackServerContext* ctx) {
  // "fd:": a connection the daemon's Listener accepted on the unix socket; "unix:": one gRPC did.
  return absl::StartsWith(ctx->peer(), "fd:") || absl::StartsWith(ctx->peer(), "unix:");
}

absl::Status PeerAuth::CheckTrainer(const grpc::CallbackServerContext* ctx) {
  if (IsLocal(ctx)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      "trainer sessions (gradsync.v1.GradSync) are served on the daemon's unix socket only; "
      "TCP is for other daemons");
}

}  // namespace gradsync::rpc
