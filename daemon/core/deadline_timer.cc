// The engine's timer thread (see deadline_timer.h).
#include "daemon/core/deadline_timer.h"

namespace gradsync::core {

DeadlineTimer::DeadlineTimer() : thread_([this] { Loop(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  thread_.join();
}

DeadlineTimer::Id DeadlineTimer::Schedule(absl::Time deadline, std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  const Id id = next_id_++;
  const bool earliest = by_time_.empty() || deadline < by_time_.begin()->first;
  callbacks_.emplace(id, Entry{by_time_.emplace(deadline, id), std::move(fn)});
  if (earliest) cv_.SignalAll();
  return id;
}

void DeadlineTimer::Cancel(Id id) {
  absl::MutexLock lock(&mu_);
  auto it = callbacks_.find(id);
  if (it == callbacks_.end()) return;
  by_time_.erase(it->second.when);
  callbacks_.erase(it);
}

void DeadlineTimer::Loop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    if (by_time_.empty()) {
      cv_.Wait(&mu_);
      continue;
    }
    const auto [when, id] = *by_time_.begin();
    if (absl::Now() < when) {
      cv_.WaitWithDeadline(&mu_, when);
      continue;
    }
    by_time_.erase(by_time_.begin());
    auto it = callbacks_.find(id);
    std::function<void()> fn = std::move(it->second.fn);
    callbacks_.erase(it);
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
}

}  // namespace gradsync::core
