#pragma once

// The daemon side of one session's doorbell: a thread between the shared-memory op ring and
// the core.

#include <atomic>
#include <functional>
#include <memory>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "common/doorbell.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/core/engine.h"

namespace gradsync::ipc {

/// The daemon side of one session's doorbell (common/doorbell.h): a thread that takes op
/// records from the shared-memory ring, hands them to the core in order, and writes their
/// outcomes back. Sleeps on the ring's futex when idle.
class DoorbellServer final : public core::SessionSink,
                             public std::enable_shared_from_this<DoorbellServer> {
 public:
  /// Maps the trainer's region by name and checks its header. `on_error` runs (on the
  /// doorbell thread) if the trainer corrupts the ring; the caller should end the session.
  static absl::StatusOr<std::shared_ptr<DoorbellServer>> Open(
      core::BufferImporter& importer, const std::string& fd_token, core::Engine* engine,
      std::shared_ptr<core::Session> session, std::function<void(absl::Status)> on_error);
  ~DoorbellServer() override;

  void Start();
  /// Stops and joins the thread. Idempotent; never from the doorbell thread.
  void Stop();

  void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) override;

 private:
  DoorbellServer(std::unique_ptr<core::MappedBuffer> region, core::Engine* engine,
                 std::shared_ptr<core::Session> session, std::function<void(absl::Status)> on_error)
      : region_(std::move(region)),
        doorbell_(region_->data()),
        engine_(engine),
        session_(std::move(session)),
        on_error_(std::move(on_error)) {}
  void Loop();

  const std::unique_ptr<core::MappedBuffer> region_;
  doorbell::Doorbell doorbell_;
  core::Engine* const engine_;
  const std::shared_ptr<core::Session> session_;
  const std::function<void(absl::Status)> on_error_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
  // Completions come from any daemon thread; the completion ring of doorbell_ has one producer
  // at a time: whoever holds this. (Not ABSL_GUARDED_BY: the doorbell thread reads the request
  // ring of the same doorbell_ without it.)
  absl::Mutex complete_mu_;
};

}  // namespace gradsync::ipc
