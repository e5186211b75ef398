#include "daemon/rpc/store_service.h"

#include <atomic>
#include <functional>
#include <optional>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/group.h"
#include "common/grpc_status.h"
#include "common/pack_list.h"
#include "daemon/rpc/call_util.h"

namespace gradsync::rpc {
namespace {

absl::Status CheckWritable(absl::string_view key) {
  if (absl::StartsWith(key, kReservedKeyPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "keys under '", kReservedKeyPrefix, "' are written only by typed calls (SetPackList)"));
  }
  return absl::OkStatus();
}

// A unary call that completes when the store's wait does. Deleted once both the wait callback
// and gRPC's OnDone have run; OnCancel (client gone) cancels the store wait.
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
    absl::MutexLock lock(&mu_);
    id_ = id;
    if (cancel_requested_) store_->CancelWait(id);
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
  std::atomic<int> refs_{2};  // the store callback and OnDone
  absl::Mutex mu_;
  std::optional<Store::WaitId> id_ ABSL_GUARDED_BY(mu_);
  bool cancel_requested_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

grpc::ServerUnaryReactor* StoreService::Set(grpc::CallbackServerContext* ctx,
                                            const v1::SetRequest* req, v1::SetResponse*) {
  absl::Status s = CheckWritable(req->key());
  if (s.ok()) s = store_->Set(req->job(), req->key(), req->value());
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* StoreService::Get(grpc::CallbackServerContext* ctx,
                                            const v1::GetRequest* req, v1::GetResponse* resp) {
  auto deadline = WaitDeadline(ctx, "Get", max_wait_);
  if (!deadline.ok()) return Reply(ctx, deadline.status());
  auto* reactor = new WaitReactor(store_, [resp](std::vector<std::string> values) {
    resp->set_value(std::move(values.front()));
    return absl::OkStatus();
  });
  reactor->Start(req->job(), {req->key()}, *deadline);
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Wait(grpc::CallbackServerContext* ctx,
                                             const v1::WaitRequest* req, v1::WaitResponse* resp) {
  auto deadline = WaitDeadline(ctx, "Wait", max_wait_);
  if (!deadline.ok()) return Reply(ctx, deadline.status());
  auto* reactor = new WaitReactor(store_, [resp](std::vector<std::string> values) {
    for (std::string& v : values) resp->add_values(std::move(v));
    return absl::OkStatus();
  });
  reactor->Start(req->job(), {req->keys().begin(), req->keys().end()}, *deadline);
  return reactor;
}

grpc::ServerUnaryReactor* StoreService::Add(grpc::CallbackServerContext* ctx,
                                            const v1::AddRequest* req, v1::AddResponse* resp) {
  absl::Status s = CheckWritable(req->key());
  if (s.ok()) {
    auto value = store_->Add(req->job(), req->key(), req->delta());
    if (value.ok()) resp->set_value(*value);
    s = value.status();
  }
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* StoreService::CompareSet(grpc::CallbackServerContext* ctx,
                                                   const v1::CompareSetRequest* req,
                                                   v1::CompareSetResponse* resp) {
  absl::Status s = CheckWritable(req->key());
  if (s.ok() && req->expect_absent() && !req->expected().empty()) {
    s = absl::InvalidArgumentError("CompareSet: set either expected or expect_absent, not both");
  }
  if (s.ok()) {
    std::optional<std::string> expected;
    if (!req->expect_absent()) expected = req->expected();
    auto result = store_->CompareSet(req->job(), req->key(), std::move(expected), req->desired());
    if (result.ok()) {
      resp->set_swapped(result->swapped);
      resp->set_value(std::move(result->value));
    }
    s = result.status();
  }
  return Reply(ctx, s);
}

grpc::ServerUnaryReactor* StoreService::Delete(grpc::CallbackServerContext* ctx,
                                               const v1::DeleteRequest* req,
                                               v1::DeleteResponse* resp) {
  auto deleted = store_->Delete(req->job(), req->key());
  if (deleted.ok()) resp->set_deleted(*deleted);
  return Reply(ctx, deleted.status());
}

grpc::ServerUnaryReactor* StoreService::List(grpc::CallbackServerContext* ctx,
                                             const v1::ListRequest* req, v1::ListResponse* resp) {
  auto keys = store_->List(req->job(), req->prefix());
  if (keys.ok()) {
    for (std::string& k : *keys) resp->add_keys(std::move(k));
  }
  return Reply(ctx, keys.status());
}

grpc::ServerUnaryReactor* StoreService::SetPackList(grpc::CallbackServerContext* ctx,
                                                    const v1::SetPackListRequest* req,
                                                    v1::SetPackListResponse*) {
  return Reply(ctx, PutPackList(*store_, req->job(), req->group(), req->pack_list()));
}

grpc::ServerUnaryReactor* StoreService::GetPackList(grpc::CallbackServerContext* ctx,
                                                    const v1::GetPackListRequest* req,
                                                    v1::GetPackListResponse* resp) {
  if (auto ranks = ParseGroupKey(req->group()); !ranks.ok()) return Reply(ctx, ranks.status());
  auto deadline = WaitDeadline(ctx, "GetPackList", max_wait_);
  if (!deadline.ok()) return Reply(ctx, deadline.status());
  auto* reactor = new WaitReactor(store_, [resp](std::vector<std::string> values) {
    auto pack_list = DecodePackList(values.front());
    if (pack_list.ok()) *resp->mutable_pack_list() = *std::move(pack_list);
    return pack_list.status();
  });
  reactor->Start(req->job(), {PackListKey(req->group())}, *deadline);
  return reactor;
}

}  // namespace gradsync::rpc
