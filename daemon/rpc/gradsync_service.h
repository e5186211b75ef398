#pragma once

// The GradSync gRPC service: one bidi stream per trainer session, handing requests to the core
// in order and writing op outcomes back.

#include "absl/container/flat_hash_set.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/core/engine.h"
#include "daemon/rpc/peer_auth.h"
#include "gradsync/v1/gradsync.grpc.pb.h"

namespace gradsync::rpc {

/// gRPC glue for the GradSync service: one bidi stream per trainer session. Reads requests in
/// order and hands them to the core; op outcomes are written back as the core reports them.
/// Never blocks a gRPC thread on a collective (small matched ops are computed inline by the
/// core; nothing waits for a peer here).
class GradSyncService final : public v1::GradSync::CallbackService {
 public:
  /// `engine`, `importer` (which maps doorbell regions) and `auth` must outlive the service.
  GradSyncService(core::Engine* engine, core::BufferImporter* importer, const PeerAuth* auth)
      : engine_(engine), importer_(importer), auth_(auth) {}

  /// Ends every open session (UNAVAILABLE) and refuses new ones: the daemon drains.
  void EndSessions();

  grpc::ServerBidiReactor<v1::TrainerRequest, v1::TrainerEvent>* Session(
      grpc::CallbackServerContext* ctx) override;

 private:
  class SessionReactor;
  void Forget(SessionReactor* reactor);

  core::Engine* const engine_;
  core::BufferImporter* const importer_;
  const PeerAuth* const auth_;
  absl::Mutex mu_;
  absl::flat_hash_set<SessionReactor*> reactors_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace gradsync::rpc
