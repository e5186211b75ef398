#pragma once

// How a thread waiting on GPU work paces its looks at streams and communicators.

#include <algorithm>
#include <thread>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace gradsync::backend::nccl {

/// Spins (yielding the core) for kSpin, so that a short op is seen done within a microsecond or
/// two of finishing, then sleeps between looks, from kFirstSleep doubling up to kMaxSleep, so
/// that a long op costs little CPU and is still seen done within 100 µs (under 1% of an op that
/// long). One per wait; not thread-safe.
class Backoff {
 public:
  static constexpr absl::Duration kSpin = absl::Milliseconds(2);
  static constexpr absl::Duration kFirstSleep = absl::Microseconds(10);
  static constexpr absl::Duration kMaxSleep = absl::Microseconds(100);

  void Pause() {
    if (absl::Now() - start_ < kSpin) {
      std::this_thread::yield();
      return;
    }
    absl::SleepFor(sleep_);
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
  }

 private:
  const absl::Time start_ = absl::Now();
  absl::Duration sleep_ = kFirstSleep;
};

}  // namespace gradsync::backend::nccl
