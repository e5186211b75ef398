// The NCCL state of every (job, group) on this node (see comms_table.h).

#include "daemon/backend/nccl/comms_table.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "daemon/backend/nccl/backoff.h"
#include "daemon/backend/nccl/launched_ops.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

}  // namespace

std::shared_ptr<GroupComms> CommsTable::Get(const std::string& job, const std::string& group) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<GroupComms>& c = comms_[{job, group}];
  if (!c) c = std::make_shared<GroupComms>(job, group);
  return c;
}

std::vector<std::shared_ptr<GroupComms>> CommsTable::OfJob(const std::string& job) {
  std::vector<std::shared_ptr<GroupComms>> listed;
  absl::MutexLock lock(&mu_);
  for (auto& [key, c] : comms_) {
    if (job.empty() || key.first == job) listed.push_back(c);
  }
  return listed;
}

std::vector<std::shared_ptr<GroupComms>> CommsTable::TakeAll() {
  std::map<std::pair<std::string, std::string>, std::shared_ptr<GroupComms>> all;
  {
    absl::MutexLock lock(&mu_);
    all.swap(comms_);
  }
  std::vector<std::shared_ptr<GroupComms>> taken;
  for (auto& [key, c] : all) taken.push_back(std::move(c));
  return taken;
}

// What an abort takes from a group, aborted on the aborter's thread while the group itself is
// empty: its next op builds afresh.
struct CommsTable::AbortTask {
  std::string job, group;
  std::shared_ptr<GroupComms> from;              // for the drain's note (null: never installed)
  std::vector<gpu::Comm> comms;                  // to abort
  std::vector<gpu::Comm> unused;                 // of those, the ones never installed
  std::map<int, gpu::Stream> streams;            // drained, then destroyed
  std::vector<std::shared_ptr<LaunchedOp>> ops;  // unfinished: released once drained
  absl::Status why;
  // Revoked first: the group's own communicators, and the job's other groups' for a job-wide
  // abort's share (with their generation then).
  Revoked revoke;
};

void CommsTable::DropLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later) {
  AbortLocked(c, why, later);
  absl::MutexLock lock(&mu_);
  auto it = comms_.find({c.job, c.group});
  if (it != comms_.end() && it->second.get() == &c) comms_.erase(it);
  c.erased = true;
}

void CommsTable::InstallLocked(GroupComms& c, std::vector<gpu::Comm> comms) {
  c.comms = std::move(comms);
  const uint64_t generation = c.generation.fetch_add(1) + 1;
  absl::MutexLock lock(&live_mu_);
  for (gpu::Comm comm : c.comms) live_[comm] = {&c, generation};
}

void CommsTable::AbortLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later) {
  AbortLocked(c, why, /*job_wide=*/false, later);
}

void CommsTable::AbortWithJobLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later) {
  AbortLocked(c, why, /*job_wide=*/true, later);
}

void CommsTable::AbortLocked(GroupComms& c, const absl::Status& why, bool job_wide,
                             DeferredWrites& later) {
  auto task = std::make_shared<AbortTask>();
  task->job = c.job;
  task->group = c.group;
  task->why = Unshared(why);  // goes to the aborter's thread
  // Before the abort: kernels it stops end early, and their events would then read as done.
  task->ops = TakeUnfinishedLocked(api_, c, why, later);
  if (!c.comms.empty()) {
    if (c.store != nullptr) {
      later.WriteWhileRunLasts(c.store, c.job, c.run, BrokenKey(c.run, c.group, c.built_at),
                               absl::StrCat(c.node, ": ", why.message()));
    }
    c.aborted = true;
    if (counters_ != nullptr) counters_->nccl_aborts.fetch_add(c.comms.size());
  }
  task->comms = std::exchange(c.comms, {});
  task->streams = std::exchange(c.streams, {});
  c.devices.clear();
  c.ranks.clear();
  c.group_size = 0;
  if (task->comms.empty() && task->streams.empty() && task->ops.empty()) return;
  task->from = c.shared_from_this();
  task->revoke.emplace_back(task->from, c.generation.load());
  if (job_wide) {
    for (auto& other : OfJob(c.job)) {
      if (other.get() != &c) task->revoke.emplace_back(other, other->generation.load());
    }
  }
  aborter_.Submit(
      absl::StrCat("the abort of the NCCL communicators of job=", c.job, " group=", c.group),
      [this, task] { RunAbort(*task); });
}

void CommsTable::AbortOnFailureLocked(GroupComms& c, const absl::Status& why, bool peer_word,
                                      DeferredWrites& later) {
  if (peer_word) {
    AbortLocked(c, why, later);
    return;
  }
  AbortJob(c.job, why);
  AbortWithJobLocked(c, why, later);
}

void CommsTable::AbortUnused(std::vector<gpu::Comm> comms, absl::string_view why) {
  if (comms.empty()) return;
  auto task = std::make_shared<AbortTask>();
  task->comms = comms;
  task->unused = std::move(comms);
  task->why = absl::AbortedError(why);
  aborter_.Submit(absl::StrCat("the abort of NCCL communicators never used (", why, ")"),
                  [this, task] { RunAbort(*task); });
}

void CommsTable::RunAbort(AbortTask& task) {
  // Every kernel of the task, and of the job's other groups when the whole job is aborted,
  // stops before the first abort frees memory (which waits for the device).
  Revoke(task.revoke);
  for (gpu::Comm comm : task.unused) RevokeOne(comm, task.job, task.group);
  {
    absl::MutexLock lock(&live_mu_);
    for (gpu::Comm comm : task.comms) live_.erase(comm);  // never revoked after its abort
  }
  for (gpu::Comm comm : task.comms) {
    if (absl::Status s = api_->NcclCommAbort(comm); !s.ok()) {
      Log()->warn("ncclCommAbort failed job={} group={} error={}", task.job, task.group,
                  s.ToString());
    }
  }
  const absl::Status drained = Drain(task.job, task.group, task.streams);
  if (!drained.ok() && task.from != nullptr) {
    absl::MutexLock lock(&task.from->reason_mu);
    task.from->abort_note = std::string(drained.message());
  }
  DeferredWrites later;  // the ops' watches end, then their buffers' mappings go
  ReleaseAborted(api_, std::move(task.ops), task.why, later);
}

absl::Status CommsTable::Drain(const std::string& job, const std::string& group,
                               const std::map<int, gpu::Stream>& streams) {
  const absl::Time start = absl::Now();
  Backoff backoff;
  std::vector<int> busy;
  while (true) {
    busy.clear();
    for (const auto& [device, stream] : streams) {
      absl::StatusOr<bool> done = api_->StreamDone(device, stream);
      if (!done.ok()) {  // a failed stream runs nothing more
        Log()->warn("stream failed after abort job={} group={} device={} error={}", job, group,
                    device, done.status().ToString());
        continue;
      }
      if (!*done) busy.push_back(device);
    }
    if (busy.empty() || absl::Now() - start >= abort_drain_) break;
    backoff.Pause();
  }
  const std::string devices = absl::StrJoin(busy, ",");
  if (!busy.empty()) {
    Log()->error(
        "nccl streams still busy after abort, abandoned job={} group={} devices={} waited={}: "
        "the op's buffers are released while aborted kernels may still use them",
        job, group, devices, absl::FormatDuration(abort_drain_));
  }
  // Destroyed either way: cudaStreamDestroy returns at once and frees a busy stream once its
  // work is done; the group's next op gets fresh streams.
  for (const auto& [device, stream] : streams) (void)api_->DestroyStream(device, stream);
  if (busy.empty()) return absl::OkStatus();
  return absl::InternalError(absl::StrCat("the streams of device(s) ", devices, " were still busy ",
                                          absl::FormatDuration(abort_drain_),
                                          " after ncclCommAbort; abandoned"));
}

void CommsTable::Revoke(const Revoked& groups) {
  absl::MutexLock lock(&live_mu_);
  for (auto it = live_.begin(); it != live_.end();) {
    const auto& [comm, live] = *it;
    auto mine = std::find_if(groups.begin(), groups.end(), [&live = live](const auto& g) {
      return g.first.get() == live.group && g.second == live.generation;
    });
    if (mine == groups.end()) {  // another job's, or built since
      ++it;
      continue;
    }
    mine->first->revoked_generation.store(live.generation);  // first: nothing settles now
    RevokeOne(comm, mine->first->job, mine->first->group);
    it = live_.erase(it);
  }
}

void CommsTable::RevokeOne(gpu::Comm comm, const std::string& job, const std::string& group) {
  if (absl::Status s = api_->NcclCommRevoke(comm);
      !s.ok() && s.code() != absl::StatusCode::kUnimplemented) {
    Log()->warn("ncclCommRevoke failed job={} group={} error={}", job, group, s.ToString());
  }
}

DeviceLaunches CommsTable::LaunchOn(std::vector<int> devices) {
  std::sort(devices.begin(), devices.end());
  devices.erase(std::unique(devices.begin(), devices.end()), devices.end());
  std::vector<absl::Mutex*> locks;
  {
    absl::MutexLock lock(&mu_);  // not held while waiting for a device (they stay in the map)
    for (int d : devices) {
      std::unique_ptr<absl::Mutex>& m = launch_locks_[d];
      if (!m) m = std::make_unique<absl::Mutex>();
      locks.push_back(m.get());
    }
  }
  return DeviceLaunches(std::move(locks));
}

absl::Status CommsTable::MayMakeRoot() const {
  const int left = roots_left_.load();
  if (left < kMaxLeftBootstrapRoots) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "this node makes no more NCCL ids: ", left,
      " failed builds left NCCL bootstrap roots behind (a thread and a listening socket each, "
      "waiting for ranks that never came, which NCCL cannot stop; at most ",
      kMaxLeftBootstrapRoots, "); restart gradsyncd once its jobs are done"));
}

void CommsTable::RootLeft(const std::string& job, const std::string& group) {
  const int left = roots_left_.fetch_add(1) + 1;
  if (counters_ != nullptr) counters_->nccl_bootstrap_roots_left.fetch_add(1);
  Log()->warn(
      "nccl bootstrap root left behind job={} group={}: its thread waits for ranks that never "
      "came ({} of at most {} on this node)",
      job, group, left, kMaxLeftBootstrapRoots);
}

void CommsTable::AbortJob(const std::string& job, const absl::Status& reason) {
  Revoked found;
  for (auto& c : OfJob(job)) {
    {
      absl::MutexLock reason_lock(&c->reason_mu);
      c->abort_reason = reason;
    }
    c->aborts.fetch_add(1);  // after the reason: whoever sees the count reads the reason
    found.emplace_back(c, c->generation.load());
  }
  if (found.empty()) return;
  aborter_.Submit(absl::StrCat("the abort of job=", job, "'s NCCL communicators on this node"),
                  [this, job, reason = Unshared(reason), found = std::move(found)] {
                    AbortJobNow(job, reason, found);
                  });
}

void CommsTable::AbortJobNow(const std::string& job, const absl::Status& reason,
                             const Revoked& found) {
  // All the job's kernels return first (a group running an op included: its lock is not
  // needed), then each idle group hands its communicators over (their aborts run next on this
  // thread); one running an op aborts when the op looks.
  Revoke(found);
  DeferredWrites later;
  // Aborts `c` if its lock is free (or its holder took the request meanwhile): whether done.
  auto try_abort = [&](GroupComms& c) {
    if (!c.abort_requested.load()) return true;  // its holder looked, and aborted it
    if (!c.mu.TryLock()) return false;
    LockedComms locked(&c, LockedComms::Adopt{});
    if (!c.erased && c.abort_requested.exchange(false)) AbortWithJobLocked(c, reason, later);
    return true;
  };
  std::vector<GroupComms*> busy;
  for (const auto& [c, generation] : found) {
    // Asked only now, once revoked: no other thread hands a group of the job to the aborter
    // (where its abort would run first) before every kernel of the job has been told to stop.
    c->abort_requested = true;
    if (!try_abort(*c)) busy.push_back(c.get());
  }
  // A group whose lock was held aborts when its holder next looks; one that lets go without
  // looking (a watcher done with it) is tried again here for a while, then left to the next
  // look (an op, the idle watchdog).
  for (int tries = 0; tries < 100 && !busy.empty(); ++tries) {
    absl::SleepFor(absl::Milliseconds(1));
    busy.erase(
        std::remove_if(busy.begin(), busy.end(), [&](GroupComms* c) { return try_abort(*c); }),
        busy.end());
  }
  Log()->info("job={} NCCL communicators on this node aborted ({} group(s)): {}", job, found.size(),
              reason.ToString());
}

void CommsTable::DropKept(
    absl::string_view why,
    absl::FunctionRef<bool(const std::string&, const std::vector<int>&, absl::Time)> which,
    DeferredWrites& later) {
  for (auto& c : OfJob("")) {
    if (!c->mu.TryLock()) continue;  // running an op: not kept
    LockedComms locked(c.get(), LockedComms::Adopt{});
    if (c->kept_until != absl::InfinitePast() && which(c->job, c->devices, c->kept_until)) {
      Log()->info("nccl communicators kept after their job ended dropped ({}) job={} group={}",
                  std::string(why), c->job, c->group);
      DropLocked(*c, absl::OkStatus(), later);
    }
  }
}

void CommsTable::DropKeptOn(const std::vector<int>& devices, const std::string& job,
                            DeferredWrites& later) {
  DropKept(
      "another job needs their GPUs",
      [&](const std::string& kept_job, const std::vector<int>& kept_devices, absl::Time) {
        return kept_job != job && std::any_of(kept_devices.begin(), kept_devices.end(), [&](int d) {
                 return std::find(devices.begin(), devices.end(), d) != devices.end();
               });
      },
      later);
}

void CommsTable::NoteLaunched(std::shared_ptr<GroupComms> c) {
  absl::MutexLock lock(&watch_mu_);
  const GroupComms* key = c.get();
  launched_groups_.emplace(key, std::move(c));
}

void CommsTable::ForgetLaunched(const GroupComms* c) {
  absl::MutexLock lock(&watch_mu_);
  launched_groups_.erase(c);
}

std::vector<std::shared_ptr<GroupComms>> CommsTable::LaunchedGroups(absl::Duration wait) {
  absl::MutexLock lock(&watch_mu_);
  watch_mu_.AwaitWithTimeout(absl::Condition(
                                 +[](CommsTable* t) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->watch_mu_) {
                                   return t->woken_ || !t->launched_groups_.empty();
                                 },
                                 this),
                             wait);
  std::vector<std::shared_ptr<GroupComms>> out;
  out.reserve(launched_groups_.size());
  for (const auto& [key, c] : launched_groups_) out.push_back(c);
  return out;
}

void CommsTable::WakeWatcher() {
  absl::MutexLock lock(&watch_mu_);
  woken_ = true;
}

}  // namespace gradsync::backend::nccl
