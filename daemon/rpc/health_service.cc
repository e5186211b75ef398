// Implementation of health_service.h: Check, and Watch streams that send the current status
// and then each change.

#include "daemon/rpc/health_service.h"

#include <atomic>

#include "absl/strings/str_cat.h"
#include "daemon/rpc/call_util.h"

namespace gradsync::rpc {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

// Streams the status of one service: the current one at once, then each change. One write in
// flight; a change during a write is sent after it (only the latest). Owned by gRPC's reference
// (dropped in OnDone) and the registry's (dropped when it leaves HealthService::watchers_).
class HealthService::WatchReactor final : public grpc::ServerWriteReactor<HealthCheckResponse> {
 public:
  WatchReactor(HealthService* health, std::string service)
      : health_(health), service_(std::move(service)) {}

  const std::string& service() const { return service_; }

  /// Sends `status` if it differs from what was sent; `last`: end the stream after it.
  void Update(ServingStatus status, bool last) {
    absl::MutexLock lock(&mu_);
    latest_ = status;
    end_after_ = end_after_ || last;
    PumpLocked();
  }

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  void OnWriteDone(bool ok) override {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (!ok) {
      FinishLocked(grpc::Status(grpc::StatusCode::UNAVAILABLE, "health watch write failed"));
      return;
    }
    PumpLocked();
  }
  void OnCancel() override {
    absl::MutexLock lock(&mu_);
    FinishLocked(grpc::Status::CANCELLED);
  }
  void OnDone() override {
    health_->Forget(this);
    Unref();
  }

 private:
  void PumpLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_ || writing_) return;
    if (!sent_any_ || sent_ != latest_) {
      response_.set_status(latest_);
      sent_ = latest_;
      sent_any_ = true;
      writing_ = true;
      StartWrite(&response_);
      return;
    }
    if (end_after_) FinishLocked(grpc::Status::OK);
  }
  void FinishLocked(const grpc::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    Finish(status);
  }

  HealthService* const health_;
  const std::string service_;
  std::atomic<int> refs_{2};
  absl::Mutex mu_;
  HealthCheckResponse response_ ABSL_GUARDED_BY(mu_);
  ServingStatus latest_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  ServingStatus sent_ ABSL_GUARDED_BY(mu_) = HealthCheckResponse::UNKNOWN;
  bool sent_any_ ABSL_GUARDED_BY(mu_) = false;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool end_after_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
};

HealthService::HealthService(const std::vector<std::string>& services) {
  absl::MutexLock lock(&mu_);
  status_[""] = HealthCheckResponse::NOT_SERVING;
  for (const std::string& s : services) status_[s] = HealthCheckResponse::NOT_SERVING;
}

HealthService::~HealthService() { Shutdown(); }

HealthService::ServingStatus HealthService::StatusLocked(const std::string& service) const {
  auto it = status_.find(service);
  return it == status_.end() ? HealthCheckResponse::SERVICE_UNKNOWN : it->second;
}

void HealthService::SetServing(bool serving) {
  absl::MutexLock lock(&mu_);
  if (shut_down_) return;
  for (auto& [name, status] : status_) {
    status = serving ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
  }
  for (WatchReactor* w : watchers_) w->Update(StatusLocked(w->service()), false);
}

void HealthService::Shutdown() {
  absl::flat_hash_set<WatchReactor*> watchers;
  {
    absl::MutexLock lock(&mu_);
    if (shut_down_) return;
    shut_down_ = true;
    for (auto& [name, status] : status_) status = HealthCheckResponse::NOT_SERVING;
    watchers.swap(watchers_);
  }
  for (WatchReactor* w : watchers) {
    w->Update(HealthCheckResponse::NOT_SERVING, /*last=*/true);
    w->Unref();
  }
}

void HealthService::Forget(WatchReactor* watcher) {
  bool held = false;
  {
    absl::MutexLock lock(&mu_);
    held = watchers_.erase(watcher) > 0;
  }
  if (held) watcher->Unref();
}

grpc::ServerUnaryReactor* HealthService::Check(grpc::CallbackServerContext* ctx,
                                               const HealthCheckRequest* req,
                                               HealthCheckResponse* resp) {
  ServingStatus status;
  {
    absl::MutexLock lock(&mu_);
    status = StatusLocked(req->service());
  }
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    return Reply(ctx, absl::NotFoundError(absl::StrCat("unknown service '", req->service(), "'")));
  }
  resp->set_status(status);
  return Reply(ctx, absl::OkStatus());
}

grpc::ServerWriteReactor<HealthCheckResponse>* HealthService::Watch(grpc::CallbackServerContext*,
                                                                    const HealthCheckRequest* req) {
  auto* watcher = new WatchReactor(this, req->service());
  ServingStatus status;
  bool shut_down;
  {
    absl::MutexLock lock(&mu_);
    status = StatusLocked(req->service());
    shut_down = shut_down_;
    if (!shut_down) watchers_.insert(watcher);
  }
  if (shut_down) {
    watcher->Update(status, /*last=*/true);
    watcher->Unref();  // the registry never held it
  } else {
    watcher->Update(status, /*last=*/false);
  }
  return watcher;
}

}  // namespace gradsync::rpc
