#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

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

 private:
  void Loop();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool stopping_ = false;                    // guarded by mu_
  std::vector<std::thread> threads_;
};

}  // namespace gradsync
