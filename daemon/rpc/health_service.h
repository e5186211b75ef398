#pragma once

// grpc.health.v1.Health for the daemon, overall and per service; draining tells watchers
// NOT_SERVING and ends their streams.

#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "grpc/health/v1/health.grpc.pb.h"

namespace gradsync::rpc {

/// grpc.health.v1.Health, overall ("") and per service. Our own rather than gRPC's built-in
/// one: it is generated protobuf code, so reflection resolves it (grpcurl needs no -proto), and
/// draining tells Watch streams NOT_SERVING and then ends them, so a watcher never holds a
/// drain open for its grace period.
class HealthService final : public grpc::health::v1::Health::CallbackService {
 public:
  using ServingStatus = grpc::health::v1::HealthCheckResponse::ServingStatus;

  /// Knows "" and `services`, all NOT_SERVING until SetServing(true).
  explicit HealthService(const std::vector<std::string>& services);
  ~HealthService() override;

  /// Every known service SERVING or NOT_SERVING; watchers are told. Thread-safe.
  void SetServing(bool serving);
  /// NOT_SERVING everywhere; watchers are told and their streams end; later changes are
  /// ignored. Idempotent.
  void Shutdown();

  grpc::ServerUnaryReactor* Check(grpc::CallbackServerContext* ctx,
                                  const grpc::health::v1::HealthCheckRequest* req,
                                  grpc::health::v1::HealthCheckResponse* resp) override;
  grpc::ServerWriteReactor<grpc::health::v1::HealthCheckResponse>* Watch(
      grpc::CallbackServerContext* ctx, const grpc::health::v1::HealthCheckRequest* req) override;

 private:
  class WatchReactor;
  void Forget(WatchReactor* watcher);
  ServingStatus StatusLocked(const std::string& service) const ABSL_SHARED_LOCKS_REQUIRED(mu_);

  absl::Mutex mu_;
  absl::flat_hash_map<std::string, ServingStatus> status_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<WatchReactor*> watchers_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace gradsync::rpc
