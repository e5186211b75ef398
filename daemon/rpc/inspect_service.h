#pragma once

#include "daemon/store/memory_store.h"
#include "gradsync/v1/inspect.grpc.pb.h"

namespace gradsync::rpc {

/// Read-only operator views of the daemon's store: jobs, keys, groups and pack lists.
/// Never waits: what is missing is NOT_FOUND at once.
class InspectService final : public v1::Inspect::CallbackService {
 public:
  /// `store` must outlive the service.
  explicit InspectService(store::MemoryStore* store) : store_(store) {}

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

 private:
  store::MemoryStore* const store_;
};

}  // namespace gradsync::rpc
