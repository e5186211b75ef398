// The GPU data plane's lifecycle on this node (see nccl_backend.h).

#include "daemon/backend/nccl/nccl_backend.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "daemon/backend/nccl/launched_ops.h"
#include "daemon/backend/nccl/nccl_communicator.h"
#include "daemon/backend/nccl/peer_signals.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

}  // namespace

namespace {

Aborter::Options AborterOptions(const NcclOptions& o) {
  Aborter::Options a;
  a.hung_after = o.abort_hung_after;
  a.on_hung = [counters = o.counters, tell = o.on_abort_hung](const absl::Status& why) {
    if (counters != nullptr) counters->nccl_aborts_hung.fetch_add(1);
    if (tell) tell(why);
  };
  a.on_returned = o.on_abort_returned;
  return a;
}

}  // namespace

NcclBackend::NcclBackend(gpu::GpuApi* api, NcclOptions options)
    : api_(api),
      options_(options),
      table_(api, options_.abort_drain, options_.counters, AborterOptions(options_)) {
  launch_watcher_ = std::thread([this] { WatchLaunched(); });
  if (options_.watch_every <= absl::ZeroDuration()) return;
  watchdog_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(options_.watch_every)) WatchIdle();
  });
}

void NcclBackend::WatchLaunched() {
  // Sleeps while no group has launched ops; while some have, looks at them every
  // kWatcherPace, skipping groups whose lock is held (an op of theirs is running and looks at
  // them itself). Nobody waits on these looks (a trainer's stream waits on its done event, the
  // group's next op looks itself), so they need not be sooner: they release finished ops'
  // buffers and catch a failure after launch.
  while (!stop_.HasBeenNotified()) {
    const std::vector<std::shared_ptr<GroupComms>> groups = table_.LaunchedGroups(kWatcherIdle);
    if (groups.empty()) continue;
    for (const std::shared_ptr<GroupComms>& c : groups) {
      DeferredWrites later;  // declared before the group's lock: written once it is released
      if (!c->mu.TryLock()) continue;
      LockedComms locked(c.get(), LockedComms::Adopt{});
      LookAtLaunchedLocked(table_, *c, later);
      if (c->launched.empty()) table_.ForgetLaunched(c.get());
    }
    (void)stop_.WaitForNotificationWithTimeout(kWatcherPace);
  }
}

void NcclBackend::SettleLaunched(const std::string& job, absl::Duration bound) {
  DeferredWrites later;  // declared before any group's lock: written once none is held
  for (auto& c : table_.OfJob(job)) {
    LockedComms locked(c.get());
    if (c->launched.empty()) continue;
    // Each op's own deadline bounds the wait (one past it fails); `bound` may end it sooner
    // (an infinite one saturates to InfiniteFuture).
    if (!AwaitLaunchedLocked(table_, *c, 0, absl::Now() + bound, later).ok()) {
      table_.AbortLocked(*c, absl::UnavailableError("the daemon is shutting down"), later);
    }
    table_.ForgetLaunched(c.get());
  }
}

void NcclBackend::WatchIdle() {
  DeferredWrites later;  // declared before any group's lock: written once none is held
  const absl::Time now = absl::Now();
  table_.DropKept(
      "their time is up",
      [now](const std::string&, const std::vector<int>&, absl::Time kept_until) {
        return now > kept_until;
      },
      later);
  for (auto& c : table_.OfJob("")) {
    if (!c->mu.TryLock()) continue;  // running an op, which watches its communicators itself
    LockedComms locked(c.get(), LockedComms::Adopt{});
    if (!c->launched.empty()) continue;        // not idle: the launch watcher looks at it
    if (c->abort_requested.exchange(false)) {  // AbortJobNow found this lock held: abort now
      table_.AbortWithJobLocked(*c, c->AbortReason(), later);
      continue;
    }
    absl::Status failed;
    for (gpu::Comm comm : c->comms) {
      if (absl::StatusOr<bool> r = api_->NcclCommReady(comm); !r.ok()) {
        failed = absl::Status(r.status().code(),
                              absl::StrCat("idle NCCL communicators of job=", c->job,
                                           " group=", c->group, " failed: ", r.status().message()));
        break;
      }
    }
    if (!failed.ok()) {  // idle: no kernels to stop on the job's other groups
      Log()->warn("aborting the group's communicators on this node job={} group={} error={}",
                  c->job, c->group, failed.ToString());
      table_.AbortLocked(*c, failed, later);
    }
  }
}

void NcclBackend::StopWatchdog() {
  if (!stop_.HasBeenNotified()) stop_.Notify();
  table_.WakeWatcher();
  if (watchdog_.joinable()) watchdog_.join();
  if (launch_watcher_.joinable()) launch_watcher_.join();
  // The ops still on the GPUs finish, or are aborted, while the stores their watches read are
  // still there; their buffers are released after.
  SettleLaunched("", options_.abort_drain);
  (void)table_.FlushAborts(options_.abort_drain + options_.abort_hung_after);
}

NcclBackend::~NcclBackend() {
  StopWatchdog();
  DeferredWrites none;  // the daemon is going: nobody to tell (every store is cleared below)
  for (auto& c : table_.TakeAll()) {
    LockedComms locked(c.get());
    c->store = nullptr;
    table_.AbortLocked(*c, absl::OkStatus(), none);
  }
  table_.StopAborter();  // runs the aborts queued: the buffers they hold go before the importer
}

absl::StatusOr<std::shared_ptr<core::Communicator>> NcclBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  return std::make_shared<NcclCommunicator>(&table_, spec);
}

size_t NcclBackend::LaunchedOps() {
  size_t n = 0;
  for (auto& c : table_.OfJob("")) {
    LockedComms locked(c.get());
    n += c->launched.size();
  }
  return n;
}

void NcclBackend::AbortJob(const std::string& job, const absl::Status& reason) {
  table_.AbortJob(job, reason);
}

void NcclBackend::JobEnded(const std::string& job) {
  DeferredWrites later;  // declared before any group's lock: written once none is held
  for (auto& c : table_.OfJob(job)) {
    LockedComms locked(c.get());
    if (c->erased) continue;
    // The job's ops still on the GPU finish first (or fail: each by its own deadline), so that
    // the communicators are not aborted under the other nodes' last ops. An op with no deadline
    // is waited for at most abort_drain: nobody is left here to end the wait.
    const bool no_deadline =
        std::any_of(c->launched.begin(), c->launched.end(),
                    [](const auto& op) { return op->op.deadline == absl::InfiniteFuture(); });
    const absl::Time until =
        no_deadline ? absl::Now() + options_.abort_drain : absl::InfiniteFuture();
    if (!AwaitLaunchedLocked(table_, *c, 0, until, later).ok()) {
      table_.AbortLocked(
          *c,
          absl::AbortedError(
              absl::StrCat("the job's trainers on this node have left and ", c->launched.size(),
                           " launched op(s), one with no deadline, were still running on the GPU ",
                           absl::FormatDuration(options_.abort_drain),
                           " (abort_drain) later; the oldest: ", c->launched.front()->op.label)),
          later);
    }
    table_.ForgetLaunched(c.get());
    c->launch_failure = absl::OkStatus();  // the job's trainers here are gone: nobody to tell
    if (options_.keep_after_job > absl::ZeroDuration() && !c->comms.empty() &&
        c->store == nullptr) {  // on this node alone: kept for a restart
      c->kept_until = absl::Now() + options_.keep_after_job;
      Log()->info("nccl communicators kept for a restart job={} group={} for={}", job, c->group,
                  absl::FormatDuration(options_.keep_after_job));
      continue;
    }
    // Other nodes still in the run hear that these communicators are gone (not after the run
    // is over at the root: see WriteWhileRunLasts).
    table_.DropLocked(*c, absl::UnavailableError("the job's trainers on this node have left"),
                      later);
  }
}

}  // namespace gradsync::backend::nccl
