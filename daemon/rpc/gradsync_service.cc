// Implementation of gradsync_service.h: the per-session stream reactor that reads requests in
// order, queues the outcomes for writing, and stops reading while a trainer falls behind.

#include "daemon/rpc/gradsync_service.h"

#include <deque>
#include <iterator>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/version.h"
#include "daemon/ipc/doorbell_server.h"

namespace gradsync::rpc {
namespace {

auto Log() { return logging::Logger("rpc"); }

// Events a session may have queued for a trainer that does not read them; past it the session
// stops reading requests until the trainer catches up, so its queue cannot grow without bound.
// Above the ops one session may have in flight, so answering those never waits on this.
constexpr size_t kMaxQueuedEvents = 2048;

void SetStatus(const absl::Status& status, v1::TrainerEvent& event) {
  event.set_code(static_cast<int>(status.code()));
  if (!status.ok()) event.set_message(std::string(status.message()));
}

}  // namespace

// Reads one request at a time (requests are handled in the order sent) and keeps a write
// queue, since op outcomes arrive from any thread in any order. Lifetime: gRPC owns it until
// OnDone; the service's registry entry is removed in OnDone under the service lock, so
// EndSessions may cancel it under that lock. The core reaches it only through `sink_`, which
// OnDone detaches first.
class GradSyncService::SessionReactor final
    : public grpc::ServerBidiReactor<v1::TrainerRequest, v1::TrainerEvent> {
 public:
  // What the core holds: forwards events to the reactor while it exists.
  class Sink final : public core::SessionSink {
   public:
    explicit Sink(SessionReactor* reactor) : reactor_(reactor) {}
    void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) override {
      v1::TrainerEvent event;
      event.set_tag(tag);
      event.set_seq(seq);
      SetStatus(status, event);
      Send(std::move(event));
    }
    void Send(v1::TrainerEvent event) {
      absl::MutexLock lock(&mu_);
      if (reactor_ != nullptr) reactor_->Enqueue(std::move(event));
    }
    void Detach() {
      absl::MutexLock lock(&mu_);
      reactor_ = nullptr;
    }

   private:
    absl::Mutex mu_;
    SessionReactor* reactor_ ABSL_GUARDED_BY(mu_);
  };

  /// Reads the first request, or (`admitted` not OK) ends the stream before reading anything.
  SessionReactor(GradSyncService* service, grpc::CallbackServerContext* ctx,
                 const absl::Status& admitted, std::optional<uint32_t> uid)
      : service_(service), ctx_(ctx), uid_(uid), sink_(std::make_shared<Sink>(this)) {
    if (admitted.ok()) {
      StartRead(&request_);
    } else {
      Refuse(admitted);
    }
  }

  void Cancel() { ctx_->TryCancel(); }

  /// Ends the stream (the caller is not authorized, or its doorbell is corrupt).
  void Refuse(const absl::Status& status) { FinishNow(ToGrpcStatus(status)); }

  void OnReadDone(bool ok) override {
    {
      // Finished already (refused before the first request, or the doorbell was corrupt):
      // whatever was read is not acted on.
      absl::MutexLock lock(&mu_);
      if (finished_ && !session_) return;
    }
    if (!ok) {  // the trainer closed its side, died, or the call was cancelled
      if (ctx_->IsCancelled()) {
        EndSession("connection lost", core::Engine::End::kLost);
      } else {
        EndSession("trainer closed the session", core::Engine::End::kClosed);
      }
      return;
    }
    if (Handle()) ReadNext();
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!queue_.empty()) queue_.pop_front();  // the event just written (gRPC is done with it)
    if (!ok) {
      // The trainer is gone; the read side sees it too and ends the session.
      queue_.clear();
      finish_when_flushed_ = true;
    }
    if (read_paused_ && queue_.size() < kMaxQueuedEvents / 2 && !finished_ &&
        !finish_when_flushed_) {
      read_paused_ = false;
      StartRead(&request_);
    }
    FlushLocked();
  }

  void OnDone() override {
    sink_->Detach();
    if (doorbell_) doorbell_->Stop();
    if (session_) {  // no-op if ended
      engine().Unregister(*session_, "connection lost", core::Engine::End::kLost);
    }
    service_->Forget(this);
    delete this;
  }

  void Enqueue(v1::TrainerEvent event) {
    absl::MutexLock lock(&mu_);
    if (finished_ || finish_when_flushed_) return;
    queue_.push_back(std::move(event));
    FlushLocked();
  }

 private:
  core::Engine& engine() { return *service_->engine_; }

  // Reads the next request unless the trainer has left too many events unread.
  void ReadNext() {
    absl::MutexLock lock(&mu_);
    if (queue_.size() >= kMaxQueuedEvents) {
      read_paused_ = true;  // OnWriteDone resumes
      return;
    }
    StartRead(&request_);
  }

  // Answers one request. False when the stream was finished (a refused registration).
  bool Handle() {
    const uint64_t tag = request_.tag();
    v1::TrainerEvent event;
    event.set_tag(tag);
    switch (request_.request_case()) {
      case v1::TrainerRequest::kRegisterSession: {
        if (session_) {
          SetStatus(absl::FailedPreconditionError("this stream already has a session"), event);
          break;
        }
        if (!request_.register_session().doorbell_shm_name().empty()) {
          FinishNow(ToGrpcStatus(absl::InvalidArgumentError(
              "a doorbell is never registered by name (doorbell_shm_name): hand it over the "
              "daemon's fd channel as a sealed memfd and name its doorbell_fd_token")));
          return false;
        }
        auto session = engine().Register(request_.register_session(), uid_);
        if (session.ok() && !request_.register_session().doorbell_fd_token().empty()) {
          auto doorbell = ipc::DoorbellServer::Open(
              *service_->importer_, request_.register_session().doorbell_fd_token(), &engine(),
              *session, [this](const absl::Status& s) { Refuse(s); });
          if (!doorbell.ok()) {
            engine().Unregister(**session, "doorbell refused");
            session = doorbell.status();
          } else {
            doorbell_ = *std::move(doorbell);
            doorbell_->Start();
          }
        }
        if (!session.ok()) {
          Log()->info("register refused job={} rank={}: {}", request_.register_session().job(),
                      request_.register_session().rank(), std::string(session.status().message()));
          FinishNow(ToGrpcStatus(session.status()));
          return false;
        }
        session_ = *std::move(session);
        v1::RegisterReply& reply = *event.mutable_register_session();
        reply.set_session_id(core::Engine::SessionId(*session_));
        reply.set_default_op_timeout_ms(absl::ToInt64Milliseconds(engine().default_op_timeout()));
        reply.set_daemon_version(GRADSYNC_VERSION);
        SetStatus(absl::OkStatus(), event);
        break;
      }
      case v1::TrainerRequest::kRegisterBuffer:
      case v1::TrainerRequest::kDeregisterBuffer:
      case v1::TrainerRequest::kSettle:
      case v1::TrainerRequest::kOp:
        if (!session_) {
          FinishNow(grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                                 "the first request of a session must be register_session"));
          return false;
        }
        if (request_.has_op()) {
          engine().Submit(session_, sink_, tag, request_.op());  // answered through the sink
          return true;
        }
        if (request_.has_settle()) {  // answered once the session's device ops settled
          engine().Settle(*session_, [sink = sink_, event](absl::Status s) mutable {
            SetStatus(s, event);
            sink->Send(std::move(event));
          });
          return true;
        }
        if (request_.has_register_buffer()) {
          auto id = engine().RegisterBuffer(*session_, request_.register_buffer());
          SetStatus(id.status(), event);
          if (id.ok()) event.mutable_register_buffer()->set_buffer_id(*id);
        } else {
          // Answered once the daemon no longer uses the buffer's events (the trainer destroys
          // them then): at once, or when the last op naming it has settled on the device.
          absl::Status s = engine().DeregisterBuffer(
              *session_, request_.deregister_buffer().buffer_id(), [sink = sink_, event]() mutable {
                SetStatus(absl::OkStatus(), event);
                sink->Send(std::move(event));
              });
          if (s.ok()) return true;
          SetStatus(s, event);
        }
        break;
      default:
        SetStatus(absl::InvalidArgumentError("empty or unknown request"), event);
        break;
    }
    sink_->Send(std::move(event));
    return true;
  }

  void EndSession(absl::string_view reason, core::Engine::End how) {
    if (doorbell_) doorbell_->Stop();
    if (session_) engine().Unregister(*session_, reason, how);
    absl::MutexLock lock(&mu_);
    finish_when_flushed_ = true;
    FlushLocked();
  }

  void FinishNow(const grpc::Status& status) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
    if (writing_) {
      // The front event belongs to gRPC until OnWriteDone: drop only the ones behind it.
      queue_.erase(std::next(queue_.begin()), queue_.end());
      pending_finish_ = status;
    } else {
      queue_.clear();
      Finish(status);
    }
  }

  void FlushLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (writing_) return;
    if (finished_) {
      if (pending_finish_) {
        Finish(*pending_finish_);
        pending_finish_.reset();
      }
      return;
    }
    if (!queue_.empty()) {
      writing_ = true;
      StartWrite(&queue_.front());
      return;
    }
    if (finish_when_flushed_) {
      finished_ = true;
      Finish(grpc::Status::OK);
    }
  }

  GradSyncService* const service_;
  grpc::CallbackServerContext* const ctx_;
  const std::optional<uint32_t> uid_;  // the trainer process's (SO_PEERCRED), when known
  const std::shared_ptr<Sink> sink_;
  std::shared_ptr<core::Session> session_;         // set once by the reading side
  std::shared_ptr<ipc::DoorbellServer> doorbell_;  // set with session_ when the trainer has one
  v1::TrainerRequest request_;
  // Lock order: taken after Sink::mu_ (Sink::Send enqueues with it held). Not ABSL_ACQUIRED_AFTER:
  // the two live in different objects, which the annotation cannot name.
  absl::Mutex mu_;
  std::deque<v1::TrainerEvent> queue_ ABSL_GUARDED_BY(mu_);  // front is being written
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finish_when_flushed_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool read_paused_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> pending_finish_ ABSL_GUARDED_BY(mu_);
};

grpc::ServerBidiReactor<v1::TrainerRequest, v1::TrainerEvent>* GradSyncService::Session(
    grpc::CallbackServerContext* ctx) {
  absl::Status admitted = PeerAuth::CheckTrainer(ctx);
  absl::StatusOr<PeerAuth::Who> who = auth_->Identify(ctx);
  if (admitted.ok()) admitted = who.status();
  const std::optional<uint32_t> uid = who.ok() ? who->uid : std::nullopt;
  if (!admitted.ok()) {
    Log()->info("trainer session refused peer={}: {}", ctx->peer(),
                std::string(admitted.message()));
  }
  auto* reactor = new SessionReactor(this, ctx, admitted, uid);
  absl::MutexLock lock(&mu_);
  reactors_.insert(reactor);
  if (closed_) reactor->Cancel();
  return reactor;
}

void GradSyncService::Forget(SessionReactor* reactor) {
  absl::MutexLock lock(&mu_);
  reactors_.erase(reactor);
}

void GradSyncService::EndSessions() {
  absl::MutexLock lock(&mu_);
  closed_ = true;
  for (SessionReactor* reactor : reactors_) reactor->Cancel();
}

}  // namespace gradsync::rpc
