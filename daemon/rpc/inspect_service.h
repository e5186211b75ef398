#pragma once

// The Inspect gRPC service: read-only operator views of the daemon's store, sessions,
// unfinished ops (merged across the job's nodes) and op history.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "daemon/core/engine.h"
#include "daemon/rpc/peer_auth.h"
#include "daemon/store/job_store.h"
#include "gradsync/v1/inspect.grpc.pb.h"
#include "net/store_client.h"

namespace gradsync::rpc {

/// How ListOps reaches the other daemons of a job.
struct PeerLink {
  /// A channel to the daemon at "host:port" (may be cached); null: peers are not asked.
  std::function<std::shared_ptr<grpc::Channel>(const std::string& address)> channel;
  net::ClientOptions options;  // the cluster token sent to peers
  absl::Duration timeout = absl::Seconds(2);
};

/// One node's own view of a job's unfinished ops (ListOps with local_only), as the proto.
v1::ListOpsResponse LocalOpsView(const std::string& job, const core::Engine::JobOpsView& view,
                                 absl::Time now);

/// Merges every node's local view into the job's: per (group, seq) the ranks that arrived on
/// any node, and each missing rank with its node and why (its trainer has not submitted the op,
/// or its node did not answer: `answers[i].answered` false). `node_of_rank` maps ranks to nodes
/// (empty for one-node jobs: then every rank is `local.nodes(0)`'s).
v1::ListOpsResponse MergeOpsViews(const std::vector<std::string>& node_of_rank, int world_size,
                                  const std::vector<v1::ListOpsResponse>& views,
                                  const std::vector<v1::NodeAnswer>& answers);

/// Read-only operator views of the daemon: the store's jobs, keys, groups and pack lists, the
/// engine's trainer sessions, unfinished ops (this node's and, asked through it, the job's
/// other nodes') and op history.
/// Never waits on the job: what is missing is NOT_FOUND at once; ListOps waits at most
/// PeerLink::timeout for the other nodes, off the gRPC thread (callback client calls).
class InspectService final : public v1::Inspect::CallbackService {
 public:
  /// `store`, `engine` and `auth` must outlive the service. A ListKeys reply past
  /// `max_reply_bytes` is RESOURCE_EXHAUSTED (naming --max_message_bytes).
  InspectService(store::JobStore* store, const core::Engine* engine, int64_t max_reply_bytes,
                 const PeerAuth* auth, PeerLink peers = {})
      : store_(store),
        engine_(engine),
        max_reply_bytes_(max_reply_bytes),
        auth_(auth),
        peers_(std::move(peers)) {}

  /// What ListSessions' replies warn an operator of (set-up weaker than the security model
  /// assumes). Call before serving.
  void SetWarnings(std::vector<std::string> warnings) { warnings_ = std::move(warnings); }
  /// The daemon's MPS state for ListSessions' replies (daemon/gpu/mps.h). Call before serving.
  void SetMps(std::string mode, std::string reason) {
    mps_ = std::move(mode);
    mps_reason_ = std::move(reason);
  }

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
  grpc::ServerUnaryReactor* ListOps(grpc::CallbackServerContext* ctx, const v1::ListOpsRequest* req,
                                    v1::ListOpsResponse* resp) override;
  grpc::ServerUnaryReactor* GetHistory(grpc::CallbackServerContext* ctx,
                                       const v1::GetHistoryRequest* req,
                                       v1::GetHistoryResponse* resp) override;
  grpc::ServerUnaryReactor* ListEpochs(grpc::CallbackServerContext* ctx,
                                       const v1::ListEpochsRequest* req,
                                       v1::ListEpochsResponse* resp) override;

 private:
  store::JobStore* const store_;
  const core::Engine* const engine_;
  const int64_t max_reply_bytes_;
  const PeerAuth* const auth_;
  const PeerLink peers_;
  std::string mps_, mps_reason_;       // set before serving, read-only after
  std::vector<std::string> warnings_;  // likewise
};

}  // namespace gradsync::rpc
