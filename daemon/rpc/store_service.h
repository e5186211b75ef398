#pragma once

// The Store gRPC service over any Store: validates requests and never blocks a gRPC thread.

#include <cstdint>

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"
#include "common/worker_pool.h"
#include "daemon/rpc/peer_auth.h"
#include "gradsync/v1/store.grpc.pb.h"

namespace gradsync::rpc {

/// gRPC glue for the Store service over any Store. Validates requests, never blocks a gRPC
/// thread: waiting calls complete from the store's callback, and the calls of a store that
/// goes over the network (etcd) run on the `offload` pool. What a call may touch follows from its
/// caller (PeerAuth::Identify) and the key's class (common/store_keys.h): keys under
/// kReservedKeyPrefix change only through typed calls; the daemons' own keys are PERMISSION_DENIED
/// to clients (local or TCP with the client credential), and List leaves them out; the
/// membership decision is written by daemons only. A List reply past `max_reply_bytes` is
/// RESOURCE_EXHAUSTED (the store bounds wait replies itself).
class StoreService final : public v1::Store::CallbackService {
 public:
  /// `store` and `auth` must outlive the service. `offload`: where the calls that reach the
  /// store run when it may block on the network (an etcd store, each call an etcd round trip):
  /// null, inline on the gRPC thread (the embedded store never blocks). It must outlive every
  /// call (the server's shutdown waits for them).
  StoreService(gradsync::Store* store, absl::Duration max_wait, int64_t max_reply_bytes,
               const PeerAuth* auth, WorkerPool* offload = nullptr)
      : store_(store),
        max_wait_(max_wait),
        max_reply_bytes_(max_reply_bytes),
        auth_(auth),
        offload_(offload) {}
  ~StoreService() override;

  /// Ends every open Session with UNAVAILABLE and refuses new ones (the daemon is draining).
  void EndSessions();

  grpc::ServerUnaryReactor* Set(grpc::CallbackServerContext* ctx, const v1::SetRequest* req,
                                v1::SetResponse* resp) override;
  grpc::ServerUnaryReactor* Get(grpc::CallbackServerContext* ctx, const v1::GetRequest* req,
                                v1::GetResponse* resp) override;
  grpc::ServerUnaryReactor* Wait(grpc::CallbackServerContext* ctx, const v1::WaitRequest* req,
                                 v1::WaitResponse* resp) override;
  grpc::ServerUnaryReactor* Add(grpc::CallbackServerContext* ctx, const v1::AddRequest* req,
                                v1::AddResponse* resp) override;
  grpc::ServerUnaryReactor* CompareSet(grpc::CallbackServerContext* ctx,
                                       const v1::CompareSetRequest* req,
                                       v1::CompareSetResponse* resp) override;
  grpc::ServerUnaryReactor* Delete(grpc::CallbackServerContext* ctx, const v1::DeleteRequest* req,
                                   v1::DeleteResponse* resp) override;
  grpc::ServerUnaryReactor* List(grpc::CallbackServerContext* ctx, const v1::ListRequest* req,
                                 v1::ListResponse* resp) override;
  grpc::ServerUnaryReactor* SetPackList(grpc::CallbackServerContext* ctx,
                                        const v1::SetPackListRequest* req,
                                        v1::SetPackListResponse* resp) override;
  grpc::ServerUnaryReactor* GetPackList(grpc::CallbackServerContext* ctx,
                                        const v1::GetPackListRequest* req,
                                        v1::GetPackListResponse* resp) override;
  grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* Session(
      grpc::CallbackServerContext* ctx) override;
  grpc::ServerUnaryReactor* ClientCredential(grpc::CallbackServerContext* ctx,
                                             const v1::ClientCredentialRequest* req,
                                             v1::ClientCredentialResponse* resp) override;
  grpc::ServerUnaryReactor* Join(grpc::CallbackServerContext* ctx, const v1::JoinRequest* req,
                                 v1::JoinResponse* resp) override;
  grpc::ServerUnaryReactor* TakeTicket(grpc::CallbackServerContext* ctx,
                                       const v1::TakeTicketRequest* req,
                                       v1::TakeTicketResponse* resp) override;
  grpc::ServerUnaryReactor* WithdrawTicket(grpc::CallbackServerContext* ctx,
                                           const v1::WithdrawTicketRequest* req,
                                           v1::WithdrawTicketResponse* resp) override;
  grpc::ServerUnaryReactor* AdmitJoiners(grpc::CallbackServerContext* ctx,
                                         const v1::AdmitJoinersRequest* req,
                                         v1::AdmitJoinersResponse* resp) override;

 private:
  class SessionReactor;
  void ForgetSession(SessionReactor* session);

  // Finishes the call with what `work` returns: at once, or once it ran on offload_.
  grpc::ServerUnaryReactor* Run(grpc::CallbackServerContext* ctx,
                                std::function<absl::Status()> work);
  // Run, for a caller that may reach job `job` (PeerAuth::MayReach); else its refusal.
  grpc::ServerUnaryReactor* RunForJob(grpc::CallbackServerContext* ctx, absl::string_view job,
                                      std::function<absl::Status()> work);

  // The calls that never wait, shared by the unary methods and Session; `caller` decides which
  // keys they may touch (common/store_keys.h).
  using Caller = PeerAuth::Caller;
  using Who = PeerAuth::Who;
  // What `who` may touch: job `job` (PeerAuth::MayReach), then `key` by its class.
  absl::Status Check(const Who& who, absl::string_view job, absl::string_view key,
                     bool write) const;
  absl::Status CheckReads(const Who& who, absl::string_view job,
                          const std::vector<std::string>& keys) const;
  absl::Status DoSet(const Who& caller, const v1::SetRequest& req);
  absl::Status DoPeek(const Who& caller, const v1::GetRequest& req, v1::GetResponse* resp);
  absl::Status DoAdd(const Who& caller, const v1::AddRequest& req, v1::AddResponse* resp);
  absl::Status DoCompareSet(const Who& caller, const v1::CompareSetRequest& req,
                            v1::CompareSetResponse* resp);
  absl::Status DoDelete(const Who& caller, const v1::DeleteRequest& req, v1::DeleteResponse* resp);
  absl::Status DoSessionOp(const Who& caller, const v1::SessionRequest& req,
                           v1::SessionResponse* resp);

  gradsync::Store* const store_;
  const absl::Duration max_wait_;
  const int64_t max_reply_bytes_;
  const PeerAuth* const auth_;
  WorkerPool* const offload_;
  absl::Mutex sessions_mu_;
  absl::flat_hash_set<SessionReactor*> sessions_ ABSL_GUARDED_BY(sessions_mu_);
  bool sessions_closed_ ABSL_GUARDED_BY(sessions_mu_) = false;
};

}  // namespace gradsync::rpc
