// The engine's one timer thread: runs callbacks (op deadlines, stall sweeps) at their times.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace gradsync::core {

/// One thread that runs callbacks at their deadlines. Thread-safe. Callbacks run on the timer
/// thread without the timer's lock held, so they may Schedule or Cancel. The destructor drops
/// what has not fired. The timer's lock is taken last (the engine schedules and cancels with a
/// job's mutex held).
class DeadlineTimer {
 public:
  using Id = uint64_t;
  DeadlineTimer();
  ~DeadlineTimer();

  Id Schedule(absl::Time deadline, std::function<void()> fn);
  /// No-op when `id` already fired or was cancelled; the callback may be running right now.
  void Cancel(Id id);

 private:
  void Loop();

  absl::Mutex mu_;
  absl::CondVar cv_;  // signalled when the earliest deadline changes or the timer stops
  std::multimap<absl::Time, Id> by_time_ ABSL_GUARDED_BY(mu_);
  struct Entry {
    std::multimap<absl::Time, Id>::iterator when;
    std::function<void()> fn;
  };
  absl::flat_hash_map<Id, Entry> callbacks_ ABSL_GUARDED_BY(mu_);
  Id next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the state above exists
};

}  // namespace gradsync::core
