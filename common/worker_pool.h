#pragma once

// A fixed pool of worker threads with Schedule and ParallelFor.

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace gradsync {

/// A fixed set of worker threads. Schedule posts a task; ParallelFor splits one job over the
/// workers with the caller taking part, so it completes even when every worker is busy (no
/// nested-use deadlock). Thread-safe. The destructor runs the queued tasks, then joins.
class WorkerPool {
 public:
  explicit WorkerPool(int threads);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void Schedule(std::function<void()> task);

  /// Runs fn(0) ... fn(parts - 1), each exactly once, on the caller and idle workers; returns
  /// when all have returned.
  void ParallelFor(int parts, const std::function<void(int)>& fn);

  int size() const { return static_cast<int>(threads_.size()); }

  /// `task` on `pool`, or on the caller when `pool` is null (for callers whose pool is
  /// optional).
  static void RunOn(WorkerPool* pool, std::function<void()> task);

 private:
  void Loop();

  absl::Mutex mu_;
  absl::CondVar cv_;  // a task was queued, or the pool is stopping
  std::deque<std::function<void()>> tasks_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace gradsync
