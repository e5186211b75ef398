#pragma once

// The Store of a remote gradsyncd over gRPC, and the channel it travels on (target names, the
// cluster token, mutual TLS): shared by the trainer's SDK (client/) and by daemons reaching a
// job's root store on another node (daemon/), neither of which may include the other.

#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"
#include "common/tls.h"
#include "gradsync/v1/store.grpc.pb.h"
#include "gradsync/v1/types.pb.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::net {

struct ClientOptions {
  /// Deadline of calls that do not wait (Set, Add, List, ...).
  absl::Duration rpc_timeout = absl::Seconds(10);
  int max_message_bytes = 16 << 20;
  /// Trainer sessions (Client) submit ops through a shared-memory doorbell instead of the
  /// gRPC stream: no message encoding on the daemon's gRPC threads, no hand-off.
  bool doorbell = true;
  /// The cluster token (common/token.h) sent with every call; daemons require it over TCP.
  std::string token;
  /// Mutual TLS for TCP targets (common/tls.h: ReadTlsFiles): this client's certificate and key
  /// are presented, and the daemon must present a certificate signed by `tls->ca` that names the
  /// host of the target (subjectAltName). Required by daemons started with --tls_*; the token is
  /// still sent. Unix-socket targets ignore it (local, plaintext).
  std::optional<TlsPem> tls;
};

/// Adds the cluster token of `options` (if any) to a call.
void Authorize(grpc::ClientContext& ctx, const ClientOptions& options);

/// "unix:/p" or "host:port" as given; a bare absolute path becomes "unix:<path>".
std::string NormalizeTarget(absl::string_view target);

/// A channel to a gradsyncd (unix socket or TCP), with the client limits applied; over TCP with
/// mutual TLS when `options.tls` is set, else plaintext.
std::shared_ptr<grpc::Channel> Connect(absl::string_view target, const ClientOptions& options = {});

/// The Store of a remote gradsyncd, over gRPC. Thread-safe; calls may run concurrently.
/// Waits carry their deadline to the daemon, which answers DEADLINE_EXCEEDED naming the keys.
///
/// Every call is a synchronous gRPC call on the caller's thread: gRPC's callback API would start
/// background pollers that take every later completion on another thread, and a thread hand-off
/// per call costs more than the call itself on small VMs. WaitAsync therefore runs its call on
/// a thread of its own, alive only while the wait is. Calls that never wait travel on one
/// long-lived Session stream (several times cheaper than a unary call), polled by the caller.
class StoreClient final : public Store {
 public:
  StoreClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options = {});
  ~StoreClient() override;  // cancels pending waits and waits for their callbacks

  absl::Status Set(absl::string_view job, absl::string_view key, std::string value) override;
  WaitId WaitAsync(absl::string_view job, std::vector<std::string> keys, absl::Time deadline,
                   WaitCallback done) override;
  void CancelWait(WaitId id) override;
  absl::StatusOr<std::vector<std::string>> WaitBlocking(absl::string_view job,
                                                        std::vector<std::string> keys,
                                                        absl::Time deadline) override;
  absl::StatusOr<int64_t> Add(absl::string_view job, absl::string_view key, int64_t delta) override;
  absl::StatusOr<CompareSetResult> CompareSet(absl::string_view job, absl::string_view key,
                                              std::optional<std::string> expected,
                                              std::string desired) override;
  absl::StatusOr<bool> Delete(absl::string_view job, absl::string_view key) override;
  absl::StatusOr<std::vector<std::string>> List(absl::string_view job,
                                                absl::string_view prefix) override;

  /// Stores the group's pack plan (the daemon validates it).
  absl::Status SetPackList(absl::string_view job, absl::string_view group,
                           const v1::PackList& plan);
  /// Waits for the group's pack plan until `deadline`.
  absl::StatusOr<v1::PackList> GetPackList(absl::string_view job, absl::string_view group,
                                           absl::Time deadline);

  /// An elastic job's joins (Store.TakeTicket, WithdrawTicket, AdmitJoiners; the daemon
  /// checks and writes the records). `job` is the home namespace for tickets, the current
  /// epoch's for admissions.
  absl::StatusOr<int64_t> TakeTicket(absl::string_view job, int ranks);
  /// Store.Join: the node of `ranks` ranks waits at most `wait` to be admitted to the elastic
  /// job whose home is `job`; its daemon takes, and withdraws, the ticket. The call's deadline
  /// leaves `grace` past `wait` (the daemon's kJoinGrace).
  absl::StatusOr<v1::JoinResponse> Join(absl::string_view job, int ranks, absl::Duration wait,
                                        absl::Duration grace);
  absl::StatusOr<v1::WithdrawTicketResponse> WithdrawTicket(absl::string_view job, int64_t ticket);
  absl::StatusOr<v1::AdmitJoinersResponse> AdmitJoiners(absl::string_view job, int epoch,
                                                        int min_world_size, int min_joined);

  /// The credential for job `job` the daemon at this (unix socket) target hands out for TCP
  /// calls to its cluster's daemons (Store.ClientCredential).
  absl::StatusOr<std::string> ClientCredential(absl::string_view job);

  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  struct PendingWait;
  struct Session;
  void Prepare(grpc::ClientContext& ctx) const;
  // One call on the Session stream, on the caller's thread, bounded by rpc_timeout. nullopt
  // when the stream is in use by another thread or cannot be opened: the caller then makes the
  // unary call instead (nothing was sent). A transport failure after sending is returned as
  // is, never retried (Add is not idempotent), and the next call opens a new stream.
  std::optional<absl::StatusOr<v1::SessionResponse>> CallSession(const v1::SessionRequest& req);
  // One call that never waits (set, add, compare_set, delete): on the session when it can,
  // else as the matching unary RPC.
  absl::StatusOr<v1::SessionResponse> Call(const v1::SessionRequest& op);
  std::optional<absl::StatusOr<v1::SessionResponse>> CallSessionLocked(
      const v1::SessionRequest& req) ABSL_EXCLUSIVE_LOCKS_REQUIRED(session_mu_);
  absl::Status OpenSessionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session_mu_);
  void CloseSessionLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(session_mu_);
  // The Wait RPC with the waited-for keys named in a client-side timeout too.
  absl::StatusOr<std::vector<std::string>> CallWait(grpc::ClientContext& ctx,
                                                    const v1::WaitRequest& request);

  const std::shared_ptr<grpc::Channel> channel_;
  const ClientOptions options_;
  const std::unique_ptr<v1::Store::Stub> stub_;
  absl::Mutex mu_;
  absl::flat_hash_map<WaitId, std::unique_ptr<PendingWait>> pending_ ABSL_GUARDED_BY(mu_);
  WaitId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::Mutex session_mu_;  // a busy session (TryLock fails) sends callers unary
  std::unique_ptr<Session> session_ ABSL_GUARDED_BY(session_mu_);
};

}  // namespace gradsync::net
