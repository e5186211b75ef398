// A remote gradsyncd's Store over gRPC, and the channel to it (see store_client.h).

#include "net/store_client.h"

#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded_text.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace gradsync::net {

std::string NormalizeTarget(absl::string_view target) {
  if (absl::StartsWith(target, "/")) return absl::StrCat("unix:", target);
  return std::string(target);
}

std::shared_ptr<grpc::Channel> Connect(absl::string_view target, const ClientOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  const std::string normalized = NormalizeTarget(target);
  if (!options.tls.has_value() || absl::StartsWith(normalized, "unix:")) {
    return grpc::CreateCustomChannel(normalized, grpc::InsecureChannelCredentials(), args);
  }
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = options.tls->ca;
  ssl.pem_private_key = options.tls->private_key;
  ssl.pem_cert_chain = options.tls->cert_chain;
  return grpc::CreateCustomChannel(normalized, grpc::SslCredentials(ssl), args);
}

void Authorize(grpc::ClientContext& ctx, const ClientOptions& options) {
  if (!options.token.empty()) ctx.AddMetadata("authorization", "Bearer " + options.token);
}

struct StoreClient::PendingWait {
  grpc::ClientContext ctx;
  std::thread thread;
  bool finished = false;
};

StoreClient::StoreClient(std::shared_ptr<grpc::Channel> channel, ClientOptions options)
    : channel_(std::move(channel)), options_(options), stub_(v1::Store::NewStub(channel_)) {}

struct StoreClient::Session {
  // Completion tags, one bit each, so `outstanding` tracks what the queue still owes us.
  enum Tag : intptr_t { kStart = 1, kWrite = 2, kRead = 4, kFinish = 8 };

  grpc::ClientContext ctx;
  grpc::CompletionQueue cq;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::SessionRequest, v1::SessionResponse>> stream;
  intptr_t outstanding = 0;
  bool finish_called = false;
  grpc::Status finish_status;

  // Polls until every tag in `want` has completed, on this thread. False if one failed or
  // the deadline passed.
  bool Drive(intptr_t want, absl::Time deadline) {
    bool all_ok = true;
    while ((outstanding & want) != 0) {
      void* tag = nullptr;
      bool ok = false;
      const auto r = cq.AsyncNext(&tag, &ok, absl::ToChronoTime(deadline));
      if (r != grpc::CompletionQueue::GOT_EVENT) return false;
      outstanding &= ~reinterpret_cast<intptr_t>(tag);
      all_ok = all_ok && ok;
    }
    return all_ok;
  }
};

absl::Status StoreClient::OpenSessionLocked() {
  auto session = std::make_unique<Session>();
  Authorize(session->ctx, options_);
  session->stream = stub_->PrepareAsyncSession(&session->ctx, &session->cq);
  session->stream->StartCall(reinterpret_cast<void*>(Session::kStart));
  session->outstanding = Session::kStart;
  const bool ok = session->Drive(Session::kStart, absl::Now() + options_.rpc_timeout);
  session_ = std::move(session);
  if (!ok) {
    CloseSessionLocked();
    return absl::UnavailableError("cannot open a store session");
  }
  return absl::OkStatus();
}

void StoreClient::CloseSessionLocked() {
  if (!session_) return;
  Session& s = *session_;
  s.ctx.TryCancel();  // every outstanding operation now completes promptly
  if (!s.finish_called) {
    s.stream->Finish(&s.finish_status, reinterpret_cast<void*>(Session::kFinish));
    s.outstanding |= Session::kFinish;
  }
  s.cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (s.cq.Next(&tag, &ok)) {
  }
  session_.reset();
}

std::optional<absl::StatusOr<v1::SessionResponse>> StoreClient::CallSession(
    const v1::SessionRequest& req) {
  // Oversized requests go unary, where gRPC refuses them with RESOURCE_EXHAUSTED and the
  // session survives.
  if (req.ByteSizeLong() + 1024 > static_cast<size_t>(options_.max_message_bytes)) {
    return std::nullopt;
  }
  if (!session_mu_.TryLock()) return std::nullopt;  // in use by another thread: go unary
  std::optional<absl::StatusOr<v1::SessionResponse>> out = CallSessionLocked(req);
  session_mu_.Unlock();
  return out;
}

std::optional<absl::StatusOr<v1::SessionResponse>> StoreClient::CallSessionLocked(
    const v1::SessionRequest& req) {
  if (!session_ && !OpenSessionLocked().ok()) return std::nullopt;
  Session& s = *session_;
  v1::SessionResponse resp;
  s.stream->Write(req, reinterpret_cast<void*>(Session::kWrite));
  s.stream->Read(&resp, reinterpret_cast<void*>(Session::kRead));
  s.outstanding |= Session::kWrite | Session::kRead;
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  if (!s.Drive(Session::kWrite | Session::kRead, deadline)) {
    if (absl::Now() >= deadline) {
      CloseSessionLocked();
      return absl::DeadlineExceededError(absl::StrCat("store call got no answer within ",
                                                      absl::FormatDuration(options_.rpc_timeout)));
    }
    // The daemon may have ended the stream with a reason (UNAUTHENTICATED, draining): fetch it.
    absl::Status why = absl::UnavailableError("store session broke (daemon gone?)");
    s.stream->Finish(&s.finish_status, reinterpret_cast<void*>(Session::kFinish));
    s.finish_called = true;
    s.outstanding |= Session::kFinish;
    if (s.Drive(Session::kFinish, absl::Now() + absl::Seconds(1)) && !s.finish_status.ok()) {
      why = FromGrpcStatus(s.finish_status);
    }
    CloseSessionLocked();
    return why;
  }
  if (resp.code() != 0) {
    return absl::Status(static_cast<absl::StatusCode>(resp.code()), resp.message());
  }
  return resp;
}

StoreClient::~StoreClient() {
  {
    absl::MutexLock lock(&session_mu_);
    CloseSessionLocked();
  }
  absl::flat_hash_map<WaitId, std::unique_ptr<PendingWait>> pending;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, wait] : pending_) wait->ctx.TryCancel();
    pending = std::move(pending_);
  }
  for (auto& [id, wait] : pending) wait->thread.join();
}

void StoreClient::Prepare(grpc::ClientContext& ctx) const {
  Authorize(ctx, options_);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
}

absl::Status StoreClient::Set(absl::string_view job, absl::string_view key, std::string value) {
  v1::SessionRequest op;
  v1::SetRequest& req = *op.mutable_set();
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  req.set_value(std::move(value));
  return Call(op).status();
}

absl::StatusOr<v1::SessionResponse> StoreClient::Call(const v1::SessionRequest& op) {
  if (auto r = CallSession(op)) return *std::move(r);
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::SessionResponse resp;
  grpc::Status status;
  switch (op.op_case()) {
    case v1::SessionRequest::kSet:
      status = stub_->Set(&ctx, op.set(), resp.mutable_set());
      break;
    case v1::SessionRequest::kAdd:
      status = stub_->Add(&ctx, op.add(), resp.mutable_add());
      break;
    case v1::SessionRequest::kCompareSet:
      status = stub_->CompareSet(&ctx, op.compare_set(), resp.mutable_compare_set());
      break;
    case v1::SessionRequest::kDelete:
      status = stub_->Delete(&ctx, op.delete_(), resp.mutable_delete_());
      break;
    default:  // a get waits when its key is absent: WaitBlocking handles it
      return absl::InternalError("StoreClient::Call takes only calls that never wait");
  }
  if (!status.ok()) return FromGrpcStatus(status);
  return resp;
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
        " timed out; missing keys: ", JoinBounded(request.keys(), ", "), " (client deadline)"));
  }
  return FromGrpcStatus(status);
}

absl::StatusOr<std::vector<std::string>> StoreClient::WaitBlocking(absl::string_view job,
                                                                   std::vector<std::string> keys,
                                                                   absl::Time deadline) {
  if (keys.size() == 1) {
    // Most gets find their key: ask on the session first, wait with a unary call if absent.
    v1::SessionRequest op;
    op.mutable_get()->set_job(std::string(job));
    op.mutable_get()->set_key(keys.front());
    if (auto r = CallSession(op);
        r.has_value() && r->status().code() != absl::StatusCode::kNotFound) {
      if (!r->ok()) return r->status();
      return std::vector<std::string>{std::move(*(*r)->mutable_get()->mutable_value())};
    }
  }
  grpc::ClientContext ctx;
  Authorize(ctx, options_);
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
  Authorize(w->ctx, options_);
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
  v1::SessionRequest op;
  v1::AddRequest& req = *op.mutable_add();
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  req.set_delta(delta);
  GRADSYNC_ASSIGN_OR_RETURN(v1::SessionResponse resp, Call(op));
  return resp.add().value();
}

absl::StatusOr<CompareSetResult> StoreClient::CompareSet(absl::string_view job,
                                                         absl::string_view key,
                                                         std::optional<std::string> expected,
                                                         std::string desired) {
  v1::SessionRequest op;
  v1::CompareSetRequest& req = *op.mutable_compare_set();
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  if (expected.has_value()) {
    req.set_expected(*std::move(expected));
  } else {
    req.set_expect_absent(true);
  }
  req.set_desired(std::move(desired));
  GRADSYNC_ASSIGN_OR_RETURN(v1::SessionResponse resp, Call(op));
  return CompareSetResult{resp.compare_set().swapped(), resp.compare_set().value()};
}

absl::StatusOr<bool> StoreClient::Delete(absl::string_view job, absl::string_view key) {
  v1::SessionRequest op;
  v1::DeleteRequest& req = *op.mutable_delete_();
  req.set_job(std::string(job));
  req.set_key(std::string(key));
  GRADSYNC_ASSIGN_OR_RETURN(v1::SessionResponse resp, Call(op));
  return resp.delete_().deleted();
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
  Authorize(ctx, options_);
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::GetPackListRequest req;
  req.set_job(std::string(job));
  req.set_group(std::string(group));
  v1::GetPackListResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->GetPackList(&ctx, req, &resp)); !s.ok()) return s;
  return std::move(*resp.mutable_pack_list());
}

absl::StatusOr<int64_t> StoreClient::TakeTicket(absl::string_view job, int ranks) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::TakeTicketRequest req;
  req.set_job(std::string(job));
  req.set_ranks(ranks);
  v1::TakeTicketResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->TakeTicket(&ctx, req, &resp)); !s.ok()) return s;
  return resp.ticket();
}

absl::StatusOr<v1::JoinResponse> StoreClient::Join(absl::string_view job, int ranks,
                                                   absl::Duration wait, absl::Duration grace) {
  grpc::ClientContext ctx;
  Authorize(ctx, options_);
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + wait + grace + absl::Seconds(1)));
  v1::JoinRequest req;
  req.set_job(std::string(job));
  req.set_ranks(ranks);
  req.set_wait_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(wait)));
  v1::JoinResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->Join(&ctx, req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<v1::WithdrawTicketResponse> StoreClient::WithdrawTicket(absl::string_view job,
                                                                       int64_t ticket) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::WithdrawTicketRequest req;
  req.set_job(std::string(job));
  req.set_ticket(ticket);
  v1::WithdrawTicketResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->WithdrawTicket(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  return resp;
}

absl::StatusOr<v1::AdmitJoinersResponse> StoreClient::AdmitJoiners(absl::string_view job, int epoch,
                                                                   int min_world_size,
                                                                   int min_joined) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::AdmitJoinersRequest req;
  req.set_job(std::string(job));
  req.set_epoch(epoch);
  req.set_min_world_size(min_world_size);
  req.set_min_joined(min_joined);
  v1::AdmitJoinersResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->AdmitJoiners(&ctx, req, &resp)); !s.ok()) return s;
  return resp;
}

absl::StatusOr<std::string> StoreClient::ClientCredential(absl::string_view job) {
  grpc::ClientContext ctx;
  Prepare(ctx);
  v1::ClientCredentialRequest req;
  req.set_job(std::string(job));
  v1::ClientCredentialResponse resp;
  if (absl::Status s = FromGrpcStatus(stub_->ClientCredential(&ctx, req, &resp)); !s.ok()) {
    return s;
  }
  return std::move(*resp.mutable_credential());
}

}  // namespace gradsync::net
