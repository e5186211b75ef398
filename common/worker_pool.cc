// Implementation of worker_pool.h: the worker loop, and ParallelFor with the caller taking
// part.

#include "common/worker_pool.h"

#include <atomic>
#include <memory>

namespace gradsync {

WorkerPool::WorkerPool(int threads) {
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

WorkerPool::~WorkerPool() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

void WorkerPool::RunOn(WorkerPool* pool, std::function<void()> task) {
  if (pool == nullptr) {
    task();
  } else {
    pool->Schedule(std::move(task));
  }
}

void WorkerPool::Schedule(std::function<void()> task) {
  {
    absl::MutexLock lock(&mu_);
    tasks_.push_back(std::move(task));
  }
  cv_.Signal();
}

void WorkerPool::Loop() {
  for (;;) {
    std::function<void()> task;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && tasks_.empty()) cv_.Wait(&mu_);  // idle until work or the end
      if (tasks_.empty()) return;                           // stopping, and nothing left to run
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    task();
  }
}

void WorkerPool::ParallelFor(int parts, const std::function<void(int)>& fn) {
  if (parts <= 1 || threads_.empty()) {
    for (int i = 0; i < parts; ++i) fn(i);
    return;
  }
  // Helpers that start after the caller finished everything find no part left and only touch
  // this shared state, never `fn`.
  struct State {
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    absl::Mutex mu;
    absl::CondVar cv;  // the last part is done
  };
  auto state = std::make_shared<State>();
  auto work = [state, parts, &fn] {
    for (int i; (i = state->next.fetch_add(1)) < parts;) {
      fn(i);
      if (state->done.fetch_add(1) + 1 == parts) {
        absl::MutexLock lock(&state->mu);
        state->cv.SignalAll();
      }
    }
  };
  const int helpers = std::min(parts - 1, size());
  for (int i = 0; i < helpers; ++i) {
    Schedule([state, parts, work] {
      if (state->next.load() < parts) work();
    });
  }
  work();
  // Unbounded, as every part is: fn runs to its end on the caller or a worker.
  absl::MutexLock lock(&state->mu);
  while (state->done.load() != parts) state->cv.Wait(&state->mu);
}

}  // namespace gradsync
