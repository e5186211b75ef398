// Implementation of doorbell_server.h: the thread that pops op records from a session's
// doorbell ring, submits them to the engine, and writes completions back.

#include "daemon/ipc/doorbell_server.h"

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::ipc {
namespace {

auto Log() { return logging::Logger("doorbell"); }

// How long the thread sleeps before re-checking its stop flag when no wake comes.
constexpr absl::Duration kIdleWait = absl::Milliseconds(100);

}  // namespace

absl::StatusOr<std::shared_ptr<DoorbellServer>> DoorbellServer::Open(
    core::BufferImporter& importer, const std::string& fd_token, core::Engine* engine,
    std::shared_ptr<core::Session> session, std::function<void(absl::Status)> on_error) {
  auto region = importer.ImportDoorbell(fd_token, static_cast<int64_t>(doorbell::RegionBytes()));
  if (!region.ok()) {
    return absl::Status(region.status().code(),
                        absl::StrCat("doorbell: ", region.status().message()));
  }
  std::shared_ptr<DoorbellServer> server(
      new DoorbellServer(*std::move(region), engine, std::move(session), std::move(on_error)));
  if (absl::Status s = server->doorbell_.Validate(); !s.ok()) return s;
  return server;
}

DoorbellServer::~DoorbellServer() { Stop(); }

void DoorbellServer::Start() {
  thread_ = std::thread([this] { Loop(); });  // the owner calls Stop before letting go
}

void DoorbellServer::Stop() {
  stop_.store(true);
  doorbell_.WakeDaemon();
  if (!thread_.joinable()) return;
  if (thread_.get_id() == std::this_thread::get_id()) {
    thread_.detach();  // the last reference went away on the doorbell thread itself
  } else {
    thread_.join();
  }
}

void DoorbellServer::Loop() {
  std::string record;
  v1::TrainerRequest request;
  const std::shared_ptr<core::SessionSink> self = shared_from_this();
  while (!stop_.load(std::memory_order_relaxed)) {
    bool got = false;
    absl::Status status = doorbell_.Pop(&record, &got);
    if (status.ok() && got) {
      if (!request.ParseFromString(record) || !request.has_op()) {
        status = absl::InvalidArgumentError("doorbell record is not a TrainerRequest with an op");
      } else {
        engine_->Submit(session_, self, request.tag(), request.op());
        continue;
      }
    }
    if (!status.ok()) {
      Log()->warn("ending session: {}", std::string(status.message()));
      on_error_(status);
      return;
    }
    doorbell_.DaemonWait(kIdleWait);
  }
}

void DoorbellServer::OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) {
  absl::MutexLock lock(&complete_mu_);
  if (!doorbell_.Complete(tag, seq, static_cast<int>(status.code()), status.message())) {
    Log()->warn("completion ring full (trainer exceeds {} ops in flight); op tag={} dropped",
                doorbell::kCompletionSlots, tag);
  }
}

}  // namespace gradsync::ipc
