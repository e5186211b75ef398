#pragma once

#include "daemon/core/engine.h"
#include "daemon/rpc/peer_auth.h"
#include "daemon/store/memory_store.h"
#include "gradsync/v1/inspect.grpc.pb.h"

namespace gradsync::rpc {

/// Read-only operator views of the daemon: the store's jobs, keys, groups and pack lists, and
/// the engine's trainer sessions.
/// Never waits: what is missing is NOT_FOUND at once.
class InspectService final : public v1::Inspect::CallbackService {
 public:
  /// `store`, `engine` and `auth` must outlive the service. A ListKeys reply past
  /// `max_reply_bytes` is RESOURCE_EXHAUSTED (naming --max_message_bytes).
  InspectService(store::MemoryStore* store, const core::Engine* engine, int64_t max_reply_bytes,
                 const PeerAuth* auth)
      : store_(store), engine_(engine), max_reply_bytes_(max_reply_bytes), auth_(auth) {}

  grpc::ServerUnaryReactor* ListJobs(grpc::CallbackServerContext* ctx,
                                     const v1::ListJobsRequest* req,
                                     v1::ListJobsResponse* resp) override;
  grpc::ServerUnaryReactor* ListGroups(grpc::CallbackServerContext* ctx,
                                       const v1::ListGroupsRequest* req,
                                       v1::ListGroupsResponse* resp) override;
  grpc::ServerUnaryReactor* ListKeys(grpc::CallbackServerContext* ctx,
                                     const v1::ListKeysRequest* req,
                                     v1::ListKeysResponse* resp) override;
  grpc::ServerUnaryReactor* GetPackList(grpc::CallbackServerContext* ctx,
                                        const v1::InspectPackListRequest* req,
                                        v1::InspectPackListResponse* resp) override;
  grpc::ServerUnaryReactor* ListSessions(grpc::CallbackServerContext* ctx,
                                         const v1::ListSessionsRequest* req,
                                         v1::ListSessionsResponse* resp) override;

 private:
  store::MemoryStore* const store_;
  const core::Engine* const engine_;
  const int64_t max_reply_bytes_;
  const PeerAuth* const auth_;
};

}  // namespace gradsync::rpc
