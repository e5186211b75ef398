#include "daemon/core/deadline_timer.h"

namespace gradsync::core {

DeadlineTimer::DeadlineTimer() : thread_([this] { Loop(); }) {}

DeadlineTimer::~DeadlineTimer() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

DeadlineTimer::Id DeadlineTimer::Schedule(absl::Time deadline, std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  const Id id = next_id_++;
  const bool earliest = by_time_.empty() || deadline < by_time_.begin()->first;
  callbacks_.emplace(id, Entry{by_time_.emplace(deadline, id), std::move(fn)});
  if (earliest) cv_.notify_all();
  return id;
}

void DeadlineTimer::Cancel(Id id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = callbacks_.find(id);
  if (it == callbacks_.end()) return;
  by_time_.erase(it->second.when);
  callbacks_.erase(it);
}

void DeadlineTimer::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    if (by_time_.empty()) {
      cv_.wait(lock);
      continue;
    }
    const auto [when, id] = *by_time_.begin();
    if (absl::Now() < when) {
      cv_.wait_until(lock, absl::ToChronoTime(when));
      continue;
    }
    by_time_.erase(by_time_.begin());
    auto it = callbacks_.find(id);
    std::function<void()> fn = std::move(it->second.fn);
    callbacks_.erase(it);
    lock.unlock();
    fn();
    lock.lock();
  }
}

}  // namespace gradsync::core
