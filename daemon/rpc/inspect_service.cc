// Implementation of inspect_service.h: the Inspect calls, and ListOps' fan-out to the job's
// other daemons and the merge of their views.

#include "daemon/rpc/inspect_service.h"

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/group.h"
#include "common/job_id.h"
#include "common/pack_list.h"
#include "daemon/rpc/call_util.h"

namespace gradsync::rpc {

grpc::ServerUnaryReactor* InspectService::ListJobs(grpc::CallbackServerContext* ctx,
                                                   const v1::ListJobsRequest*,
                                                   v1::ListJobsResponse* resp) {
  const absl::StatusOr<PeerAuth::Who> who = auth_->Identify(ctx);
  if (!who.ok()) return Reply(ctx, who.status());
  absl::StatusOr<std::vector<store::JobStats>> jobs = store_->ListJobs();
  if (!jobs.ok()) return Reply(ctx, jobs.status());
  for (const store::JobStats& stats : *jobs) {
    if (!auth_->MayReach(*who, stats.job).ok()) continue;  // another user's
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
  const absl::StatusOr<PeerAuth::Who> who = auth_->Reach(ctx, req->job());
  if (!who.ok()) return Reply(ctx, who.status());
  auto keys = store_->List(req->job(), kPackListKeyPrefix);
  if (keys.ok()) {
    for (const std::string& key : *keys) resp->add_groups(key.substr(kPackListKeyPrefix.size()));
  }
  return Reply(ctx, keys.status());
}

grpc::ServerUnaryReactor* InspectService::ListKeys(grpc::CallbackServerContext* ctx,
                                                   const v1::ListKeysRequest* req,
                                                   v1::ListKeysResponse* resp) {
  const absl::StatusOr<PeerAuth::Who> who = auth_->Reach(ctx, req->job());
  if (!who.ok()) return Reply(ctx, who.status());
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
      if (!auth_->MaySeeKey(*who, key)) continue;  // the daemons' own, to a client
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
  const absl::StatusOr<PeerAuth::Who> who = auth_->Reach(ctx, req->job());
  if (!who.ok()) return Reply(ctx, who.status());
  if (auto ranks = ParseGroupKey(req->group()); !ranks.ok()) return Reply(ctx, ranks.status());
  auto bytes = store_->Peek(req->job(), PackListKey(req->group()));
  if (!bytes.ok() && bytes.status().code() != absl::StatusCode::kNotFound) {
    return Reply(ctx, bytes.status());  // the store cannot be read (etcd unreachable)
  }
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
  const absl::StatusOr<PeerAuth::Who> who = auth_->Identify(ctx);
  if (!who.ok()) return Reply(ctx, who.status());
  if (!req->job().empty()) {
    if (absl::Status s = CheckJobId(req->job()); !s.ok()) return Reply(ctx, s);
  }
  for (const core::Engine::SessionInfo& info : engine_->ListSessions()) {
    if (!req->job().empty() && info.job != req->job()) continue;
    if (!auth_->MayReach(*who, info.job).ok()) continue;  // another user's
    v1::SessionSummary* s = resp->add_sessions();
    s->set_session_id(info.id);
    s->set_job(info.job);
    s->set_rank(info.rank);
    s->set_local_rank(info.local_rank);
    s->set_world_size(info.world_size);
    s->set_buffers(info.buffers);
    s->set_mapped_bytes(info.mapped_bytes);
  }
  resp->set_mps(mps_);
  resp->set_mps_reason(mps_reason_);
  for (const std::string& w : warnings_) resp->add_warnings(w);
  return Reply(ctx, absl::OkStatus());
}

namespace {

v1::WaitingFor ToProto(core::Engine::OpWait wait) {
  switch (wait) {
    case core::Engine::OpWait::kTrainers:
      return v1::TRAINER;
    case core::Engine::OpWait::kEarlierOp:
      return v1::EARLIER_OP;
    case core::Engine::OpWait::kLocalCopy:
      return v1::LOCAL_COPY;
    case core::Engine::OpWait::kNetwork:
      return v1::NETWORK;
    case core::Engine::OpWait::kNccl:
      return v1::NCCL;
  }
  return v1::WAITING_FOR_UNSPECIFIED;
}

const char* PlaneName(core::Plane plane) {
  return plane == core::Plane::kDevice ? "device" : "host";
}

int64_t UnixMicros(absl::Time t) { return t == absl::InfinitePast() ? 0 : absl::ToUnixMicros(t); }

// A ListOps call waiting for the job's other nodes; finishes the call when the last answers.
struct OpsFanOut {
  struct Peer {
    std::string node;
    std::unique_ptr<v1::Inspect::Stub> stub;
    grpc::ClientContext ctx;
    v1::ListOpsRequest req;
    v1::ListOpsResponse resp;
  };
  grpc::ServerUnaryReactor* reactor = nullptr;
  v1::ListOpsResponse* out = nullptr;
  std::vector<std::string> node_of_rank;
  int world_size = 0;
  std::vector<v1::ListOpsResponse> views;  // [0]: this node's
  std::vector<v1::NodeAnswer> answers;     // by node; [0]: this node
  std::vector<std::unique_ptr<Peer>> peers;
  std::atomic<int> left{0};

  void Answered(size_t i, const grpc::Status& status) {
    // Each peer writes only its own slots; the last one merges.
    v1::NodeAnswer& answer = answers[i + 1];
    if (status.ok()) {
      answer.set_answered(true);
      views[i + 1] = std::move(peers[i]->resp);
    } else {
      answer.set_error(
          absl::StrCat(absl::StatusCodeToString(static_cast<absl::StatusCode>(status.error_code())),
                       ": ", status.error_message()));
    }
    if (left.fetch_sub(1) == 1) {
      *out = MergeOpsViews(node_of_rank, world_size, views, answers);
      reactor->Finish(grpc::Status::OK);
    }
  }
};

}  // namespace

v1::ListOpsResponse LocalOpsView(const std::string& job, const core::Engine::JobOpsView& view,
                                 absl::Time now) {
  v1::ListOpsResponse resp;
  resp.set_job(job);
  for (const core::PeerState& peer : view.peers) {
    v1::PeerLiveness* p = resp.add_peers();
    p->set_node(peer.node);
    p->set_state(core::PeerStateName(peer.state));
    p->set_last_heard_seconds(peer.last_heard == absl::InfiniteDuration()
                                  ? -1.0
                                  : absl::ToDoubleSeconds(peer.last_heard));
    p->set_cause(peer.cause);
  }
  v1::NodeAnswer* me = resp.add_nodes();
  me->set_node(view.node);
  me->set_answered(true);
  for (int r : view.local_ranks) me->add_ranks(r);
  for (const core::Engine::OpView& op : view.ops) {
    v1::PendingOp* p = resp.add_ops();
    p->set_group(op.group);
    p->set_seq(op.seq);
    p->set_fingerprint(op.fingerprint);
    p->set_plane(PlaneName(op.plane));
    p->set_age_seconds(absl::ToDoubleSeconds(now - op.queued));
    p->set_bytes(op.bytes);
    v1::NodeOpState* n = p->add_nodes();
    n->set_node(view.node);
    n->set_waiting_for(ToProto(op.waiting_for));
    n->set_age_seconds(p->age_seconds());
    for (int r : op.arrived) {
      p->add_arrived_ranks(r);
      n->add_arrived_ranks(r);
    }
    for (int r : op.missing) {
      n->add_missing_ranks(r);
      v1::MissingRank* m = p->add_missing_ranks();
      m->set_rank(r);
      m->set_node(view.node);
      m->set_waiting_for(v1::TRAINER);
      m->set_detail("its trainer has not submitted the op");
    }
  }
  return resp;
}

v1::ListOpsResponse MergeOpsViews(const std::vector<std::string>& node_of_rank, int world_size,
                                  const std::vector<v1::ListOpsResponse>& views,
                                  const std::vector<v1::NodeAnswer>& answers) {
  v1::ListOpsResponse out;
  if (!views.empty()) out.set_job(views[0].job());
  if (!views.empty()) *out.mutable_peers() = views[0].peers();  // this node's watch
  std::map<std::string, const v1::NodeAnswer*> answer_of;
  for (const v1::NodeAnswer& a : answers) {
    *out.add_nodes() = a;
    answer_of[a.node()] = &out.nodes(out.nodes_size() - 1);
  }
  // Every op any node holds, by (group, seq).
  std::map<std::pair<std::string, uint64_t>, std::vector<const v1::PendingOp*>> ops;
  for (const v1::ListOpsResponse& view : views) {
    for (const v1::PendingOp& op : view.ops()) ops[{op.group(), op.seq()}].push_back(&op);
  }
  for (const auto& [key, held] : ops) {
    v1::PendingOp* merged = out.add_ops();
    merged->set_group(key.first);
    merged->set_seq(key.second);
    merged->set_fingerprint(held[0]->fingerprint());
    merged->set_plane(held[0]->plane());
    merged->set_bytes(held[0]->bytes());
    std::set<int> arrived;
    std::map<int, std::string> missing_here;  // rank -> node that has the op and lacks it
    for (const v1::PendingOp* op : held) {
      merged->set_age_seconds(std::max(merged->age_seconds(), op->age_seconds()));
      for (const v1::NodeOpState& n : op->nodes()) {
        *merged->add_nodes() = n;
        arrived.insert(n.arrived_ranks().begin(), n.arrived_ranks().end());
        for (int r : n.missing_ranks()) missing_here[r] = n.node();
      }
    }
    for (int r : arrived) merged->add_arrived_ranks(r);
    std::vector<int> members;
    if (key.first == kWorldGroup) {
      for (int r = 0; r < world_size; ++r) members.push_back(r);
    } else if (auto parsed = ParseGroupKey(key.first); parsed.ok()) {
      members = *std::move(parsed);
    }
    for (int r : members) {
      if (arrived.count(r) > 0) continue;
      v1::MissingRank* m = merged->add_missing_ranks();
      m->set_rank(r);
      const std::string node = r < static_cast<int>(node_of_rank.size())
                                   ? node_of_rank[r]
                                   : (answers.empty() ? "" : answers[0].node());
      m->set_node(node);
      auto a = answer_of.find(node);
      if (a != answer_of.end() && !a->second->answered()) {
        m->set_waiting_for(v1::NODE_UNREACHABLE);
        m->set_detail(absl::StrCat("node did not answer: ", a->second->error()));
      } else if (missing_here.count(r) > 0) {
        m->set_waiting_for(v1::TRAINER);
        m->set_detail("its trainer has not submitted the op (other ranks of its node have)");
      } else {
        m->set_waiting_for(v1::TRAINER);
        m->set_detail(absl::StrCat("its trainer has not submitted the op (its node has no rank at ",
                                   "seq ", key.second, " yet)"));
      }
    }
  }
  return out;
}

grpc::ServerUnaryReactor* InspectService::ListOps(grpc::CallbackServerContext* ctx,
                                                  const v1::ListOpsRequest* req,
                                                  v1::ListOpsResponse* resp) {
  const absl::StatusOr<PeerAuth::Who> who = auth_->Reach(ctx, req->job());
  if (!who.ok()) return Reply(ctx, who.status());
  if (absl::Status s = CheckJobId(req->job()); !s.ok()) return Reply(ctx, s);
  absl::StatusOr<core::Engine::JobOpsView> view = engine_->ListOps(req->job(), req->group());
  if (!view.ok()) return Reply(ctx, view.status());
  const absl::Time now = absl::Now();
  v1::ListOpsResponse local = LocalOpsView(req->job(), *view, now);
  std::vector<std::string> others;  // the job's other nodes
  for (const std::string& node : view->node_of_rank) {
    if (node != view->node && std::find(others.begin(), others.end(), node) == others.end()) {
      others.push_back(node);
    }
  }
  if (req->local_only()) {
    *resp = std::move(local);
    return Reply(ctx, absl::OkStatus());
  }
  int world_size = static_cast<int>(view->node_of_rank.size());
  if (world_size == 0) {  // one node: every rank is here
    for (const core::Engine::SessionInfo& s : engine_->ListSessions()) {
      if (s.job == req->job()) world_size = s.world_size;
    }
  }
  std::vector<v1::NodeAnswer> answers = {local.nodes(0)};
  if (others.empty() || !peers_.channel) {
    for (const std::string& node : others) {
      answers.emplace_back().set_node(node);
      answers.back().set_error("this daemon does not ask its peers");
    }
    *resp = MergeOpsViews(view->node_of_rank, world_size, {local}, answers);
    return Reply(ctx, absl::OkStatus());
  }
  auto fan = std::make_shared<OpsFanOut>();
  fan->reactor = ctx->DefaultReactor();
  fan->out = resp;
  fan->node_of_rank = view->node_of_rank;
  fan->world_size = world_size;
  fan->views.resize(others.size() + 1);
  fan->views[0] = std::move(local);
  fan->answers = std::move(answers);
  for (const std::string& node : others) {
    v1::NodeAnswer& a = fan->answers.emplace_back();
    a.set_node(node);
    for (size_t r = 0; r < view->node_of_rank.size(); ++r) {
      if (view->node_of_rank[r] == node) a.add_ranks(static_cast<int>(r));
    }
    auto peer = std::make_unique<OpsFanOut::Peer>();
    peer->node = node;
    peer->stub = v1::Inspect::NewStub(peers_.channel(node));
    net::Authorize(peer->ctx, peers_.options);
    peer->ctx.set_deadline(absl::ToChronoTime(now + peers_.timeout));
    peer->req.set_job(req->job());
    peer->req.set_group(req->group());
    peer->req.set_local_only(true);
    fan->peers.push_back(std::move(peer));
  }
  fan->left = static_cast<int>(fan->peers.size());
  grpc::ServerUnaryReactor* reactor = fan->reactor;
  for (size_t i = 0; i < fan->peers.size(); ++i) {
    OpsFanOut::Peer& peer = *fan->peers[i];
    peer.stub->async()->ListOps(&peer.ctx, &peer.req, &peer.resp,
                                [fan, i](grpc::Status status) { fan->Answered(i, status); });
  }
  return reactor;
}

grpc::ServerUnaryReactor* InspectService::GetHistory(grpc::CallbackServerContext* ctx,
                                                     const v1::GetHistoryRequest* req,
                                                     v1::GetHistoryResponse* resp) {
  const absl::StatusOr<PeerAuth::Who> who = auth_->Reach(ctx, req->job());
  if (!who.ok()) return Reply(ctx, who.status());
  if (absl::Status s = CheckJobId(req->job()); !s.ok()) return Reply(ctx, s);
  const std::string group = req->group().empty() ? std::string(kWorldGroup) : req->group();
  absl::StatusOr<core::Engine::GroupHistory> history = engine_->GetHistory(req->job(), group);
  if (!history.ok()) return Reply(ctx, history.status());
  resp->set_job(req->job());
  resp->set_group(group);
  resp->set_dropped(history->dropped);
  for (const core::Engine::HistoryEntry& e : history->ops) {
    v1::HistoryEntry* h = resp->add_ops();
    h->set_seq(e.seq);
    h->set_fingerprint(e.fingerprint);
    h->set_bytes(e.bytes);
    h->set_plane(PlaneName(e.plane));
    h->set_queued_unix_us(UnixMicros(e.queued));
    h->set_started_unix_us(UnixMicros(e.started));
    h->set_finished_unix_us(UnixMicros(e.finished));
    h->set_outcome(absl::StatusCodeToString(e.outcome.code()));
    h->set_error(std::string(e.outcome.message()));
  }
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* InspectService::ListEpochs(grpc::CallbackServerContext* ctx,
                                                     const v1::ListEpochsRequest* req,
                                                     v1::ListEpochsResponse* resp) {
  const absl::StatusOr<PeerAuth::Who> who = auth_->Identify(ctx);
  if (!who.ok()) return Reply(ctx, who.status());
  if (!req->job().empty()) {
    if (absl::Status s = CheckJobId(req->job()); !s.ok()) return Reply(ctx, s);
  }
  for (const core::EpochRecord& e : engine_->Epochs(req->job())) {
    if (!auth_->MayReach(*who, e.job).ok()) continue;  // another user's
    v1::Epoch* out = resp->add_epochs();
    out->set_job(e.job);
    out->set_epoch(e.epoch);
    out->set_world_size(e.world_size);
    out->set_change(e.change);
    out->set_formed_unix_us(UnixMicros(e.formed));
    out->set_took_seconds(absl::ToDoubleSeconds(e.took));
  }
  return Reply(ctx, absl::OkStatus());
}

}  // namespace gradsync::rpc
