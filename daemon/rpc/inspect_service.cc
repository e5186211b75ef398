#include "daemon/rpc/inspect_service.h"

#include "absl/strings/str_cat.h"
#include "common/group.h"
#include "common/job_id.h"
#include "common/pack_list.h"
#include "daemon/rpc/call_util.h"

namespace gradsync::rpc {

grpc::ServerUnaryReactor* InspectService::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const v1::ListJobsRequest*,
                                                   v1::ListJobsResponse* resp) {
  if (auto* refused = auth_->Refuse(ctx)) return refused;
  for (const store::JobStats& stats : store_->ListJobs()) {
    v1::JobSummary* job = resp->add_jobs();
    job->set_job(stats.job);
    job->set_keys(stats.keys);
    job->set_value_bytes(stats.value_bytes);
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InspectService::ListGroups(grpc::CallbackServerContext* ctx,
                                                     const v1::ListGroupsRequest* req,
                                                     v1::ListGroupsResponse* resp) {
  if (auto* refused = auth_->Refuse(ctx)) return refused;
  auto keys = store_->List(req->job(), kPackListKeyPrefix);
  if (keys.ok()) {
    for (const std::string& key : *keys) resp->add_groups(key.substr(kPackListKeyPrefix.size()));
  }
  return Reply(ctx, keys.status());
}

grpc::ServerUnaryReactor* InspectService::ListKeys(grpc::CallbackServerContext* ctx,
                                                   const v1::ListKeysRequest* req,
                                                   v1::ListKeysResponse* resp) {
  if (auto* refused = auth_->Refuse(ctx)) return refused;
  auto sizes = store_->ListSizes(req->job(), req->prefix());
  if (sizes.ok()) {
    int64_t reply_bytes = 0;
    for (const auto& [key, bytes] : *sizes) reply_bytes += static_cast<int64_t>(key.size()) + 16;
    if (reply_bytes > max_reply_bytes_) {
      return Reply(ctx, absl::ResourceExhaustedError(absl::StrCat(
                            "ListKeys job=", req->job(), ": ", sizes->size(),
                            " keys are more than a reply may carry (", max_reply_bytes_,
                            " bytes, --max_message_bytes); list a narrower prefix")));
    }
    for (const auto& [key, bytes] : *sizes) {
      v1::KeyInfo* info = resp->add_keys();
      info->set_key(key);
      info->set_value_bytes(bytes);
    }
  }
  return Reply(ctx, sizes.status());
}

grpc::ServerUnaryReactor* InspectService::GetPackList(grpc::CallbackServerContext* ctx,
                                                      const v1::InspectPackListRequest* req,
                                                      v1::InspectPackListResponse* resp) {
  if (auto* refused = auth_->Refuse(ctx)) return refused;
  if (auto ranks = ParseGroupKey(req->group()); !ranks.ok()) return Reply(ctx, ranks.status());
  auto bytes = store_->Peek(req->job(), PackListKey(req->group()));
  if (!bytes.ok()) {
    return Reply(ctx, absl::NotFoundError(absl::StrCat("no pack list for job=", req->job(),
                                                       " group=", req->group(), " (",
                                                       bytes.status().message(), ")")));
  }
  auto pack_list = DecodePackList(*bytes);
  if (!pack_list.ok()) return Reply(ctx, pack_list.status());
  resp->set_job(req->job());
  resp->set_group(req->group());
  int64_t total = 0;
  for (const v1::Pack& pack : pack_list->packs()) total += pack.bytes();
  resp->set_total_bytes(total);
  *resp->mutable_pack_list() = *std::move(pack_list);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InspectService::ListSessions(grpc::CallbackServerContext* ctx,
                                                       const v1::ListSessionsRequest* req,
                                                       v1::ListSessionsResponse* resp) {
  if (auto* refused = auth_->Refuse(ctx)) return refused;
  if (!req->job().empty()) {
    if (absl::Status s = CheckJobId(req->job()); !s.ok()) return Reply(ctx, s);
  }
  for (const core::Engine::SessionInfo& info : engine_->ListSessions()) {
    if (!req->job().empty() && info.job != req->job()) continue;
    v1::SessionSummary* s = resp->add_sessions();
    s->set_session_id(info.id);
    s->set_job(info.job);
    s->set_rank(info.rank);
    s->set_local_rank(info.local_rank);
    s->set_world_size(info.world_size);
    s->set_buffers(info.buffers);
    s->set_mapped_bytes(info.mapped_bytes);
  }
  return Reply(ctx, absl::OkStatus());
}

}  // namespace gradsync::rpc
