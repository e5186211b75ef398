// The NCCL state of every (job, group) on this node (see comms_table.h).

#include "daemon/backend/nccl/comms_table.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"
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

void CommsTable::DropLocked(GroupComms& c, const absl::Status& why, DeferredWrites& later) {
  (void)AbortLocked(c, why, later);
  DestroyStreamsLocked(c);
  absl::MutexLock lock(&mu_);
  auto it = comms_.find({c.job, c.group});
  if (it != comms_.end() && it->second.get() == &c) comms_.erase(it);
  c.erased = true;
}

absl::Status CommsTable::AbortLocked(GroupComms& c, const absl::Status& why,
                                     DeferredWrites& later) {
  // Before the abort: kernels it stops end early, and their events would then read as done.
  std::vector<std::shared_ptr<LaunchedOp>> unfinished = TakeUnfinishedLocked(api_, c, why, later);
  if (c.comms.empty()) {
    ReleaseAbortedLocked(api_, c, std::move(unfinished), why, later);
    return absl::OkStatus();
  }
  if (c.store != nullptr) {
    later.WriteWhileRunLasts(c.store, c.job, c.run, BrokenKey(c.run, c.group, c.built_at),
                             absl::StrCat(c.node, ": ", why.message()));
  }
  c.aborted = true;
  if (counters_ != nullptr) counters_->nccl_aborts.fetch_add(c.comms.size());
  for (gpu::Comm comm : c.comms) {
    // A non-blocking communicator may answer ncclInProgress: the abort goes on in NCCL's
    // background, and its kernels may still be on the streams (hence DrainLocked).
    if (absl::Status s = api_->NcclCommAbort(comm); !s.ok()) {
      Log()->warn("ncclCommAbort failed error={}", s.ToString());
    }
  }
  c.comms.clear();
  c.devices.clear();
  c.ranks.clear();
  c.group_size = 0;
  absl::Status drained = DrainLocked(c);
  ReleaseAbortedLocked(api_, c, std::move(unfinished), why, later);
  return drained;
}

absl::Status CommsTable::DrainLocked(GroupComms& c) {
  const absl::Time start = absl::Now();
  Backoff backoff;
  std::vector<int> busy;
  while (true) {
    busy.clear();
    for (const auto& [device, stream] : c.streams) {
      absl::StatusOr<bool> done = api_->StreamDone(device, stream);
      if (!done.ok()) {  // a failed stream runs nothing more
        Log()->warn("stream failed after abort job={} group={} device={} error={}", c.job, c.group,
                    device, done.status().ToString());
        continue;
      }
      if (!*done) busy.push_back(device);
    }
    if (busy.empty()) return absl::OkStatus();
    if (absl::Now() - start >= abort_drain_) break;
    backoff.Pause();
  }
  const std::string devices = absl::StrJoin(busy, ",");
  Log()->error(
      "nccl streams still busy after abort, abandoned job={} group={} devices={} waited={}: the "
      "op's buffers are released while aborted kernels may still use them",
      c.job, c.group, devices, absl::FormatDuration(abort_drain_));
  // Abandoned: the next op gets fresh streams rather than queueing behind kernels that may never
  // end (cudaStreamDestroy returns at once and frees the stream once its work is done).
  DestroyStreamsLocked(c);
  return absl::InternalError(absl::StrCat("the streams of device(s) ", devices, " were still busy ",
                                          absl::FormatDuration(abort_drain_),
                                          " after ncclCommAbort; abandoned"));
}

void CommsTable::DestroyStreamsLocked(GroupComms& c) {
  for (const auto& [device, stream] : c.streams) (void)api_->DestroyStream(device, stream);
  c.streams.clear();
}

void CommsTable::AbortJob(const std::string& job, const absl::Status& reason,
                          DeferredWrites& later) {
  for (auto& c : OfJob(job)) {
    {
      absl::MutexLock reason_lock(&c->reason_mu);
      c->abort_reason = reason;
    }
    c->aborts.fetch_add(1);  // after the reason: whoever sees the count reads the reason
    if (!c->mu.TryLock()) {  // running an op (possibly the caller's own): it aborts when it looks
      c->abort_requested = true;
      continue;
    }
    LockedComms locked(c.get(), LockedComms::Adopt{});  // idle: abort now
    (void)AbortLocked(*c, reason, later);
  }
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
