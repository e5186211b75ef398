#include "client/store_client.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/grpc_status.h"

namespace gradsync::client {

std::string NormalizeTarget(absl::string_view target) {
  if (absl::StartsWith(target, "/")) return absl::StrCat("unix:", target);
  return std::string(target);
}

std::shared_ptr<grpc::Channel> Connect(absl::string_view target, const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  return grpc::CreateCustomChannel(NormalizeTarget(target), grpc::InsecureChannelCredentials(),
                                   args);
}

struct StoreClient::PendingWait {
  grpc::ClientContext ctx;
  std::thread thread;
  bool finished = false;
};

StoreClient::StoreClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)), options_(options), stub_(v1::Store::NewStub(channel_)) {}

StoreClient::~StoreClient() {
  absl::flat_hash_map<WaitId, std::unique_ptr<PendingWait>> pending;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, wait] : pending_) wait->ctx.TryCancel();
    pending = std::move(pending_);
  }
  for (auto& [id, wait] : pending) wait->thread.join();
}

void StoreClient::Prepare(grpc::ClientContext& ctx) const {
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
}

absl::Status StoreClient::Set(absl::string_view job, absl::string_view key, std::string value) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::SetRequest req;
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  req.set_value(std::move(value));
  v1::SetResponse resp;
  return FromGrpcStatus(stub_->Set(&ctx, req, &resp));
}

absl::StatusOr<std::vector<std::string>> StoreClient::CallWait(grpc::ClientContext& ctx,
                                                               const v1::WaitRequest& request) {
  v1::WaitResponse response;
  const grpc::Status status = stub_->Wait(&ctx, request, &response);
  if (status.ok()) {
    return std::vector<std::string>(response.values().begin(), response.values().end());
  }
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED &&
      !absl::StrContains(status.error_message(), "missing keys")) {
    // Our own deadline fired before the daemon's answer: name the keys all the same.
    return absl::DeadlineExceededError(absl::StrCat(
        "store wait job=", request.job(),
        " timed out; missing keys: ", absl::StrJoin(request.keys(), ", "), " (client deadline)"));
  }
  return FromGrpcStatus(status);
}

absl::StatusOr<std::vector<std::string>> StoreClient::WaitBlocking(absl::string_view job,
                                                                   std::vector<std::string> keys,
                                                                   absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::WaitRequest req;
  req.set_job(std::string(job));
  for (std::string& key : keys) req.add_keys(std::move(key));
  return CallWait(ctx, req);
}

Store::WaitId StoreClient::WaitAsync(absl::string_view job, std::vector<std::string> keys,
                                     absl::Time deadline, WaitCallback done) {
  v1::WaitRequest req;
  req.set_job(std::string(job));
  for (std::string& key : keys) req.add_keys(std::move(key));
  absl::MutexLock lock(&mu_);
  const WaitId id = next_id_++;
  // Reap the threads of finished waits.
  for (auto it = pending_.begin(); it != pending_.end();) {
    if (it->second->finished) {
      it->second->thread.join();
      pending_.erase(it++);
    } else {
      ++it;
    }
  }
  auto wait = std::make_unique<PendingWait>();
  PendingWait* w = wait.get();
  w->ctx.set_deadline(absl::ToChronoTime(deadline));
  pending_[id] = std::move(wait);
  w->thread = std::thread([this, w, req = std::move(req), done = std::move(done)] {
    done(CallWait(w->ctx, req));
    absl::MutexLock lock(&mu_);
    w->finished = true;
  });
  return id;
}

void StoreClient::CancelWait(WaitId id) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(id);
  if (it != pending_.end() && !it->second->finished) it->second->ctx.TryCancel();
}

absl::StatusOr<int64_t> StoreClient::Add(absl::string_view job, absl::string_view key,
                                         int64_t delta) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::AddRequest req;
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  req.set_delta(delta);
  v1::AddResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->Add(&ctx, req, &resp)); !s.ok()) return s;
  return resp.value();
}

absl::StatusOr<CompareSetResult> StoreClient::CompareSet(absl::string_view job,
                                                         absl::string_view key,
                                                         std::optional<std::string> expected,
                                                         std::string desired) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::CompareSetRequest req;
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  if (expected.has_value()) {
    req.set_expected(*std::move(expected));
  } else {
    req.set_expect_absent(true);
  }
  req.set_desired(std::move(desired));
  v1::CompareSetResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->CompareSet(&ctx, req, &resp)); !s.ok()) return s;
  return CompareSetResult{resp.swapped(), resp.value()};
}

absl::StatusOr<bool> StoreClient::Delete(absl::string_view job, absl::string_view key) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::DeleteRequest req;
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  v1::DeleteResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->Delete(&ctx, req, &resp)); !s.ok()) return s;
  return resp.deleted();
}

absl::StatusOr<std::vector<std::string>> StoreClient::List(absl::string_view job,
                                                           absl::string_view prefix) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::ListRequest req;
  req.set_job(std::string(job));
  req.set_prefix(std::string(prefix));
  v1::ListResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->List(&ctx, req, &resp)); !s.ok()) return s;
  return std::vector<std::string>(resp.keys().begin(), resp.keys().end());
}

absl::Status StoreClient::SetPackList(absl::string_view job, absl::string_view group,
                                      const v1::PackList& plan) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::SetPackListRequest req;
  req.set_job(std::string(job));
  req.set_group(std::string(group));
  *req.mutable_pack_list() = plan;
  v1::SetPackListResponse resp;
  return FromGrpcStatus(stub_->SetPackList(&ctx, req, &resp));
}

absl::StatusOr<v1::PackList> StoreClient::GetPackList(absl::string_view job,
                                                      absl::string_view group,
                                                      absl::Time deadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::GetPackListRequest req;
  req.set_job(std::string(job));
  req.set_group(std::string(group));
  v1::GetPackListResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->GetPackList(&ctx, req, &resp)); !s.ok()) return s;
  return std::move(*resp.mutable_pack_list());
}

}  // namespace gradsync::client
