// Implementation of store_service.h: the Store service's unary calls and Session streams,
// with waiting calls completed from the store's callback and reserved keys kept read-only.

#include "daemon/rpc/store_service.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/group.h"
#include "common/grpc_status.h"
#include "common/job_id.h"
#include "common/pack_list.h"
#include "common/status_macros.h"
#include "common/store_keys.h"
#include "daemon/core/membership.h"
#include "daemon/core/node_join.h"
#include "daemon/rpc/call_util.h"

namespace gradsync::rpc {
namespace {

using Caller = PeerAuth::Caller;
using Who = PeerAuth::Who;

// What `caller` may do with `key` through the generic calls (common/store_keys.h).
absl::Status CheckAccess(Caller caller, absl::string_view key, bool write) {
  switch (ClassOfKey(key)) {
    case KeyClass::kClient:
      return absl::OkStatus();
    case KeyClass::kTyped:
      if (!write) return absl::OkStatus();
      return absl::PermissionDeniedError(absl::StrCat(
          "keys under '", kReservedKeyPrefix,
          "' are written and deleted only by typed calls (SetPackList), not by Set, Add, "
          "CompareSet or Delete"));
    case KeyClass::kDaemonWritten:
      if (!write || caller == Caller::kDaemon) return absl::OkStatus();
      return absl::PermissionDeniedError(
          absl::StrCat("'", kElasticDecisionKey,
                       "' and the membership records beside it are written by the daemons only; "
                       "joins go through "
                       "TakeTicket, WithdrawTicket and AdmitJoiners"));
    case KeyClass::kDaemonOnly:
      if (caller == Caller::kDaemon) return absl::OkStatus();
      return absl::PermissionDeniedError(absl::StrCat(
          "key '", absl::CHexEscape(key.substr(0, 64)),
          "' is the daemons' own (run tokens, nodes' addresses, link keys, NCCL ids): no client "
          "reads or writes it"));
  }
  return absl::InternalError("unknown key class");
}

// A unary call that completes when the store's wait does. Deleted once the wait callback,
// gRPC's OnDone and Start have all run; OnCancel (client gone) cancels the store wait.
class WaitReactor final : public grpc::ServerUnaryReactor {
 public:
  using OnValues = std::function<absl::Status(std::vector<std::string>)>;

  WaitReactor(gradsync::Store* store, OnValues on_values)
      : store_(store), on_values_(std::move(on_values)) {}

  void Start(absl::string_view job, std::vector<std::string> keys, absl::Time deadline) {
    const Store::WaitId id = store_->WaitAsync(
        job, std::move(keys), deadline, [this](absl::StatusOr<std::vector<std::string>> values) {
          absl::Status status = values.ok() ? on_values_(*std::move(values)) : values.status();
          Finish(ToGrpcStatus(status));
          Unref();
        });
    {
      absl::MutexLock lock(&mu_);
      id_ = id;
      if (cancel_requested_) store_->CancelWait(id);
    }
    Unref();  // Start's own: the wait may have answered and gRPC be done already
  }

  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    if (id_.has_value()) {
      store_->CancelWait(*id_);
    } else {
      cancel_requested_ = true;
    }
  }
  void OnDone() override { Unref(); }

 private:
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  gradsync::Store* const store_;
  const OnValues on_values_;
  std::atomic<int> refs_{3};  // the store callback, OnDone and Start
  absl::Mutex mu_;
  std::optional<Store::WaitId> id_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
};

// A Join: completes when its NodeJoin does; OnCancel (the caller gone) cancels it, which
// withdraws the node's ticket. Deleted once the join's answer, gRPC's OnDone and Start have
// all run.
class JoinReactor final : public grpc::ServerUnaryReactor {
 public:
  explicit JoinReactor(v1::JoinResponse* resp) : resp_(resp) {}

  void Start(gradsync::Store* store, WorkerPool* pool, std::string home, int ranks,
             absl::Time deadline) {
    std::shared_ptr<core::NodeJoin> join =
        core::NodeJoin::Start(store, pool, std::move(home), ranks, deadline,
                              [this](absl::StatusOr<core::NodeJoin::Admitted> admitted) {
                                if (admitted.ok()) {
                                  resp_->set_ticket(admitted->ticket);
                                  resp_->set_admission(std::move(admitted->admission));
                                }
                                Finish(ToGrpcStatus(admitted.status()));
                                Unref();
                              });
    bool cancel;
    {
      absl::MutexLock lock(&mu_);
      join_ = join;
      cancel = cancel_requested_;
    }
    if (cancel) join->Cancel();
    Unref();  // Start's own
  }

  void OnCancel() override {
    std::shared_ptr<core::NodeJoin> join;
    {
      absl::MutexLock lock(&mu_);
      cancel_requested_ = true;
      join = join_;
    }
    if (join != nullptr) join->Cancel();
  }
  void OnDone() override { Unref(); }

 private:
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  v1::JoinResponse* const resp_;
  std::atomic<int> refs_{3};  // the join's answer, OnDone and Start
  absl::Mutex mu_;
  std::shared_ptr<core::NodeJoin> join_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

// Strictly alternating: read a request, answer it inline (session calls never wait), write the
// answer, read the next. One call in flight per session, so no write queue is needed.
// Owned by two references: gRPC's (dropped in OnDone) and the service's registry (dropped when
// the session leaves it), so EndSessions can end it from another thread.
class StoreService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse> {
 public:
  SessionReactor(StoreService* service, grpc::CallbackServerContext* ctx, const Who& caller)
      : service_(service), ctx_(ctx), caller_(caller) {
    StartRead(&request_);
  }

  /// Ends the session now (the daemon drains): the stream is reset, so the call completes
  /// without waiting for the client to close its side. Thread-safe.
  void End() {
    absl::MutexLock lock(&mu_);
    EndLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "daemon is draining"));
    ctx_->TryCancel();
  }

  /// Refuses the session before any request: the client reads `status` as the stream's end.
  void Refuse(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    EndLocked(status);
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  void OnReadDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    if (!ok) {  // the client closed its side, or the call was cancelled
      EndLocked(grpc::Status::OK);
      return;
    }
    if (service_->offload_ == nullptr) {
      AnswerLocked();
      return;
    }
    // Off the gRPC thread, and with mu_ free while the store works (End takes it); the task's
    // reference keeps the session alive until it has run. Nothing else touches request_ or
    // response_ until the write starts.
    refs_.fetch_add(1);
    service_->offload_->Schedule([this] {
      Answer();
      {
        absl::MutexLock lock(&mu_);
        if (!ended_) StartWrite(&response_);
      }
      Unref();
    });
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    if (ended_) return;
    if (!ok) {
      EndLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "session write failed"));
      return;
    }
    StartRead(&request_);
  }

  void OnDone() override {
    service_->ForgetSession(this);
    Unref();
  }

 private:
  // Runs the request read last into response_.
  void Answer() {
    response_.Clear();
    const absl::Status status = service_->DoSessionOp(caller_, request_, &response_);
    response_.set_code(static_cast<int>(status.code()));
    if (!status.ok()) {
      response_.clear_result();
      response_.set_message(std::string(status.message()));
    }
  }

  void AnswerLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    Answer();
    StartWrite(&response_);
  }

  void EndLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (ended_) return;
    ended_ = true;
    Finish(status);
  }

  StoreService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const Who caller_;  // who opened the session: what its calls may touch
  std::atomic<int> refs_{2};
  absl::Mutex mu_;
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  v1::SessionRequest request_;
  v1::SessionResponse response_;
};

StoreService::~StoreService() = default;

absl::Status StoreService::Check(const Who& who, absl::string_view job, absl::string_view key,
                                 bool write) const {
  GRADSYNC_RETURN_IF_ERROR(auth_->MayReach(who, job));
  return CheckAccess(who.caller, key, write);
}

absl::Status StoreService::CheckReads(const Who& who, absl::string_view job,
                                      const std::vector<std::string>& keys) const {
  GRADSYNC_RETURN_IF_ERROR(auth_->MayReach(who, job));
  for (const std::string& key : keys) {
    GRADSYNC_RETURN_IF_ERROR(CheckAccess(who.caller, key, /*write=*/false));
  }
  return absl::OkStatus();
}

grpc::ServerUnaryReactor* StoreService::RunForJob(grpc::CallbackServerContext* ctx,
                                                  absl::string_view job,
                                                  std::function<absl::Status()> work) {
  if (absl::Status s = auth_->Reach(ctx, job).status(); !s.ok()) return Reply(ctx, s);
  return Run(ctx, std::move(work));
}

grpc::ServerUnaryReactor* StoreService::Run(grpc::CallbackServerContext* ctx,
                                            std::function<absl::Status()> work) {
  if (offload_ == nullptr) return Reply(ctx, work());
  grpc::ServerUnaryReactor* reactor = ctx->DefaultReactor();
  offload_->Schedule([reactor, work = std::move(work)] { reactor->Finish(ToGrpcStatus(work())); });
  return reactor;
}

grpc::ServerBidiReactor<v1::SessionRequest, v1::SessionResponse>* StoreService::Session(
    grpc::CallbackServerContext* ctx) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  auto* session = new SessionReactor(this, ctx, caller.value_or(Who{}));
  const absl::Status authorized = caller.status();
  bool closed = !authorized.ok();
  if (!closed) {
    absl::MutexLock lock(&sessions_mu_);
    closed = sessions_closed_;
    if (!closed) sessions_.insert(session);
  }
  if (closed) {
    if (authorized.ok()) {
      session->End();
    } else {
      session->Refuse(ToGrpcStatus(authorized));
    }
    session->Unref();  // the registry's reference: it never held the session
  }
  return session;
}

void StoreService::ForgetSession(SessionReactor* session) {
  bool held = false;
  {
    absl::MutexLock lock(&sessions_mu_);
    held = sessions_.erase(session) > 0;
  }
  if (held) session->Unref();
}

void StoreService::EndSessions() {
  absl::flat_hash_set<SessionReactor*> sessions;
  {
    absl::MutexLock lock(&sessions_mu_);
    sessions_closed_ = true;
    sessions.swap(sessions_);
  }
  for (SessionReactor* session : sessions) {
    session->End();
    session->Unref();
  }
}

absl::Status StoreService::DoSet(const Who& caller, const v1::SetRequest& req) {
  GRADSYNC_RETURN_IF_ERROR(Check(caller, req.job(), req.key(), /*write=*/true));
  return store_->Set(req.job(), req.key(), req.value());
}

absl::Status StoreService::DoPeek(const Who& caller, const v1::GetRequest& req,
                                  v1::GetResponse* resp) {
  GRADSYNC_RETURN_IF_ERROR(Check(caller, req.job(), req.key(), /*write=*/false));
  // A deadline in the past: the value if present, else an answer at once.
  auto values = store_->WaitBlocking(req.job(), {req.key()}, absl::InfinitePast());
  if (values.ok()) {
    resp->set_value(std::move(values->front()));
    return absl::OkStatus();
  }
  if (values.status().code() == absl::StatusCode::kDeadlineExceeded) {
    return absl::NotFoundError(absl::StrCat("job '", req.job(), "' has no key '", req.key(), "'"));
  }
  return values.status();
}

absl::Status StoreService::DoAdd(const Who& caller, const v1::AddRequest& req,
                                 v1::AddResponse* resp) {
  GRADSYNC_RETURN_IF_ERROR(Check(caller, req.job(), req.key(), /*write=*/true));
  GRADSYNC_ASSIGN_OR_RETURN(int64_t value, store_->Add(req.job(), req.key(), req.delta()));
  resp->set_value(value);
  return absl::OkStatus();
}

absl::Status StoreService::DoCompareSet(const Who& caller, const v1::CompareSetRequest& req,
                                        v1::CompareSetResponse* resp) {
  GRADSYNC_RETURN_IF_ERROR(Check(caller, req.job(), req.key(), /*write=*/true));
  if (req.expect_absent() && !req.expected().empty()) {
    return absl::InvalidArgumentError("CompareSet: set either expected or expect_absent, not both");
  }
  std::optional<std::string> expected;
  if (!req.expect_absent()) expected = req.expected();
  GRADSYNC_ASSIGN_OR_RETURN(
      CompareSetResult result,
      store_->CompareSet(req.job(), req.key(), std::move(expected), req.desired()));
  resp->set_swapped(result.swapped);
  resp->set_value(std::move(result.value));
  return absl::OkStatus();
}

absl::Status StoreService::DoDelete(const Who& caller, const v1::DeleteRequest& req,
                                    v1::DeleteResponse* resp) {
  GRADSYNC_RETURN_IF_ERROR(Check(caller, req.job(), req.key(), /*write=*/true));
  GRADSYNC_ASSIGN_OR_RETURN(bool deleted, store_->Delete(req.job(), req.key()));
  resp->set_deleted(deleted);
  return absl::OkStatus();
}

absl::Status StoreService::DoSessionOp(const Who& caller, const v1::SessionRequest& req,
                                       v1::SessionResponse* resp) {
  switch (req.op_case()) {
    case v1::SessionRequest::kSet:
      resp->mutable_set();
      return DoSet(caller, req.set());
    case v1::SessionRequest::kGet:
      return DoPeek(caller, req.get(), resp->mutable_get());
    case v1::SessionRequest::kAdd:
      return DoAdd(caller, req.add(), resp->mutable_add());
    case v1::SessionRequest::kCompareSet:
      return DoCompareSet(caller, req.compare_set(), resp->mutable_compare_set());
    case v1::SessionRequest::kDelete:
      return DoDelete(caller, req.delete_(), resp->mutable_delete_());
    default:
      return absl::InvalidArgumentError("session request carries no operation");
  }
}

grpc::ServerUnaryReactor* StoreService::Set(grpc::CallbackServerContext* ctx,
                                            const v1::SetRequest* req, v1::SetResponse*) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  return Run(ctx, [this, req, caller = *caller] { return DoSet(caller, *req); });
}

grpc::ServerUnaryReactor* StoreService::Get(grpc::CallbackServerContext* ctx,
                                            const v1::GetRequest* req, v1::GetResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  if (absl::Status s = Check(*caller, req->job(), req->key(), false); !s.ok()) {
    return Reply(ctx, s);
  }
  auto deadline = WaitDeadline(ctx, "Get", max_wait_);
  if (!deadline.ok()) return Reply(ctx, deadline.status());
  auto* reactor = new WaitReactor(store_, [resp](std::vector<std::string> values) {
    resp->set_value(std::move(values.front()));
    return absl::OkStatus();
  });
  WorkerPool::RunOn(offload_, [reactor, req, deadline = *deadline] {
    reactor->Start(req->job(), {req->key()}, deadline);
  });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Wait(grpc::CallbackServerContext* ctx,
                                             const v1::WaitRequest* req, v1::WaitResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  if (absl::Status s = CheckReads(*caller, req->job(), {req->keys().begin(), req->keys().end()});
      !s.ok()) {
    return Reply(ctx, s);
  }
  auto deadline = WaitDeadline(ctx, "Wait", max_wait_);
  if (!deadline.ok()) return Reply(ctx, deadline.status());
  auto* reactor = new WaitReactor(store_, [resp](std::vector<std::string> values) {
    for (std::string& v : values) resp->add_values(std::move(v));
    return absl::OkStatus();
  });
  WorkerPool::RunOn(offload_, [reactor, req, deadline = *deadline] {
    reactor->Start(req->job(), {req->keys().begin(), req->keys().end()}, deadline);
  });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Add(grpc::CallbackServerContext* ctx,
                                            const v1::AddRequest* req, v1::AddResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  return Run(ctx, [this, req, resp, caller = *caller] { return DoAdd(caller, *req, resp); });
}

grpc::ServerUnaryReactor* StoreService::CompareSet(grpc::CallbackServerContext* ctx,
                                                   const v1::CompareSetRequest* req,
                                                   v1::CompareSetResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  return Run(ctx, [this, req, resp, caller = *caller] { return DoCompareSet(caller, *req, resp); });
}

grpc::ServerUnaryReactor* StoreService::Delete(grpc::CallbackServerContext* ctx,
                                               const v1::DeleteRequest* req,
                                               v1::DeleteResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  return Run(ctx, [this, req, resp, caller = *caller] { return DoDelete(caller, *req, resp); });
}

grpc::ServerUnaryReactor* StoreService::List(grpc::CallbackServerContext* ctx,
                                             const v1::ListRequest* req, v1::ListResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  return Run(ctx, [this, req, resp, caller = *caller]() -> absl::Status {
    GRADSYNC_RETURN_IF_ERROR(auth_->MayReach(caller, req->job()));
    auto keys = store_->List(req->job(), req->prefix());
    if (!keys.ok()) return keys.status();
    keys->erase(std::remove_if(keys->begin(), keys->end(),
                               [&](const std::string& k) { return !auth_->MaySeeKey(caller, k); }),
                keys->end());
    int64_t reply_bytes = 0;
    for (const std::string& k : *keys) reply_bytes += static_cast<int64_t>(k.size()) + 6;
    if (reply_bytes > max_reply_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("List job=", req->job(), ": ", keys->size(), " keys in ", reply_bytes,
                       " bytes are more than a reply may carry (", max_reply_bytes_,
                       ", --max_message_bytes); list a narrower prefix"));
    }
    for (std::string& k : *keys) resp->add_keys(std::move(k));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* StoreService::SetPackList(grpc::CallbackServerContext* ctx,
                                                    const v1::SetPackListRequest* req,
                                                    v1::SetPackListResponse*) {
  return RunForJob(ctx, req->job(), [this, req] {
    return PutPackList(*store_, req->job(), req->group(), req->pack_list());
  });
}

grpc::ServerUnaryReactor* StoreService::GetPackList(grpc::CallbackServerContext* ctx,
                                                    const v1::GetPackListRequest* req,
                                                    v1::GetPackListResponse* resp) {
  if (absl::Status s = auth_->Reach(ctx, req->job()).status(); !s.ok()) return Reply(ctx, s);
  if (auto ranks = ParseGroupKey(req->group()); !ranks.ok()) return Reply(ctx, ranks.status());
  auto deadline = WaitDeadline(ctx, "GetPackList", max_wait_);
  if (!deadline.ok()) return Reply(ctx, deadline.status());
  auto* reactor = new WaitReactor(store_, [resp](std::vector<std::string> values) {
    auto pack_list = DecodePackList(values.front());
    if (pack_list.ok()) *resp->mutable_pack_list() = *std::move(pack_list);
    return pack_list.status();
  });
  WorkerPool::RunOn(offload_, [reactor, req, deadline = *deadline] {
    reactor->Start(req->job(), {PackListKey(req->group())}, deadline);
  });
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::ClientCredential(grpc::CallbackServerContext* ctx,
                                                         const v1::ClientCredentialRequest* req,
                                                         v1::ClientCredentialResponse* resp) {
  const absl::StatusOr<Who> caller = auth_->Identify(ctx);
  if (!caller.ok()) return Reply(ctx, caller.status());
  if (caller->caller != Caller::kLocal) {
    return Reply(ctx, absl::PermissionDeniedError(
                          "the client credential is handed out on the unix socket only"));
  }
  if (absl::Status s = CheckJobId(req->job()); !s.ok()) return Reply(ctx, s);
  // A user's trainers get the credential of a job their uid may reach here: not one another
  // user's trainers hold.
  if (absl::Status s = auth_->MayReach(*caller, req->job()); !s.ok()) return Reply(ctx, s);
  std::string credential = auth_->ClientCredentialFor(req->job());
  if (credential.empty()) {
    return Reply(ctx, absl::FailedPreconditionError(
                          "this daemon has no cluster token (--token_file), so no credential for "
                          "other nodes' daemons: start it with one, or give the client the token"));
  }
  resp->set_credential(std::move(credential));
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* StoreService::Join(grpc::CallbackServerContext* ctx,
                                             const v1::JoinRequest* req, v1::JoinResponse* resp) {
  if (absl::Status s = auth_->Reach(ctx, req->job()).status(); !s.ok()) return Reply(ctx, s);
  auto call_deadline = WaitDeadline(ctx, "Join", max_wait_ + kJoinGrace);
  if (!call_deadline.ok()) return Reply(ctx, call_deadline.status());
  const absl::Time now = absl::Now();
  if (req->wait_ms() < 1 || now + absl::Milliseconds(req->wait_ms()) + kJoinGrace >
                                *call_deadline + absl::Milliseconds(200)) {
    return Reply(ctx, absl::InvalidArgumentError(absl::StrCat(
                          "Join job=", req->job(), ": wait_ms=", req->wait_ms(),
                          " must be 1 or more, and the call's deadline must leave ",
                          absl::FormatDuration(kJoinGrace),
                          " past it (an admission under way, the ticket's withdrawal)")));
  }
  // NodeJoin takes its blocking steps to offload_ itself.
  auto* reactor = new JoinReactor(resp);
  reactor->Start(store_, offload_, req->job(), req->ranks(),
                 now + absl::Milliseconds(req->wait_ms()));
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::TakeTicket(grpc::CallbackServerContext* ctx,
                                                   const v1::TakeTicketRequest* req,
                                                   v1::TakeTicketResponse* resp) {
  return RunForJob(ctx, req->job(), [this, req, resp]() -> absl::Status {
    GRADSYNC_ASSIGN_OR_RETURN(int64_t ticket, core::TakeTicket(*store_, req->job(), req->ranks()));
    resp->set_ticket(ticket);
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* StoreService::WithdrawTicket(grpc::CallbackServerContext* ctx,
                                                       const v1::WithdrawTicketRequest* req,
                                                       v1::WithdrawTicketResponse* resp) {
  return RunForJob(ctx, req->job(), [this, req, resp]() -> absl::Status {
    GRADSYNC_ASSIGN_OR_RETURN(core::Withdrawal w,
                              core::WithdrawTicket(*store_, req->job(), req->ticket()));
    resp->set_withdrawn(w.withdrawn);
    resp->set_state(std::move(w.state));
    return absl::OkStatus();
  });
}

grpc::ServerUnaryReactor* StoreService::AdmitJoiners(grpc::CallbackServerContext* ctx,
                                                     const v1::AdmitJoinersRequest* req,
                                                     v1::AdmitJoinersResponse* resp) {
  return RunForJob(ctx, req->job(), [this, req, resp]() -> absl::Status {
    GRADSYNC_ASSIGN_OR_RETURN(
        core::Admission a,
        core::AdmitJoiners(*store_, req->job(), req->epoch(), req->min_world_size(),
                           std::max(1, req->min_joined())));
    resp->set_decided(a.decided);
    resp->set_decision(std::move(a.decision));
    resp->set_joined(a.joined);
    return absl::OkStatus();
  });
}

}  // namespace gradsync::rpc
