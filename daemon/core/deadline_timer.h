#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/time/time.h"

namespace gradsync::core {

/// One thread that runs callbacks at their deadlines. Thread-safe. Callbacks run on the timer
/// thread without the timer's lock held, so they may Schedule or Cancel. The destructor drops
/// what has not fired.
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

  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<absl::Time, Id> by_time_;  // guarded by mu_
  struct Entry {
    std::multimap<absl::Time, Id>::iterator when;
    std::function<void()> fn;
  };
  absl::flat_hash_map<Id, Entry> callbacks_;  // guarded by mu_
  Id next_id_ = 1;                            // guarded by mu_
  bool stopping_ = false;                     // guarded by mu_
  std::thread thread_;
};

}  // namespace gradsync::core
