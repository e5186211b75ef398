// The thread that calls NCCL's aborts, and its watchdog (see aborter.h).

#include "daemon/backend/nccl/aborter.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

}  // namespace

Aborter::Aborter(Options options) : options_(std::move(options)) {
  thread_ = std::thread([this] { Loop(); });
  watchdog_ = std::thread([this] { Watch(); });
}

Aborter::~Aborter() { Stop(); }

void Aborter::Submit(std::string what, std::function<void()> work) {
  {
    absl::MutexLock lock(&mu_);
    if (!stop_) {
      queue_.emplace_back(std::move(what), std::move(work));
      return;
    }
  }
  work();  // the backend's end: nobody else is left to run it
}

bool Aborter::Flush(absl::Duration within) {
  absl::MutexLock lock(&mu_);
  // What the work submitted so far submits in turn (a job-wide abort's groups) runs too.
  auto idle = [this]()
                  ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return queue_.empty() && running_.empty(); };
  return mu_.AwaitWithTimeout(absl::Condition(&idle), within);
}

void Aborter::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  if (thread_.joinable()) thread_.join();
  if (watchdog_.joinable()) watchdog_.join();
}

int Aborter::hung() const {
  absl::MutexLock lock(&mu_);
  return hung_;
}

void Aborter::Loop() {
  while (true) {
    std::pair<std::string, std::function<void()>> next;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !queue_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopped, and everything queued has run
      next = std::move(queue_.front());
      queue_.pop_front();
      running_ = next.first;
      since_ = absl::Now();
      reported_ = false;
    }
    next.second();
    bool was_hung = false;
    absl::Duration took;
    {
      absl::MutexLock lock(&mu_);
      was_hung = reported_;
      took = absl::Now() - since_;
    }
    if (was_hung) {
      Log()->warn("{} returned after {} (it was reported hung)", next.first,
                  absl::FormatDuration(took));
      if (options_.on_returned) options_.on_returned();
    }
    absl::MutexLock lock(&mu_);  // done only now: Flush returns after what it said
    running_.clear();
    reported_ = false;
  }
}

void Aborter::Watch() {
  // Looks a few times per hung_after: an abort is reported at most a quarter of it late.
  const absl::Duration every =
      std::clamp(options_.hung_after / 4, absl::Milliseconds(10), absl::Seconds(1));
  while (true) {
    absl::Status hung;
    {
      absl::MutexLock lock(&mu_);
      auto woken = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stop_ && queue_.empty() && running_.empty();
      };
      if (mu_.AwaitWithTimeout(absl::Condition(&woken), every)) return;
      if (!running_.empty() && !reported_ && absl::Now() - since_ > options_.hung_after) {
        reported_ = true;
        ++hung_;
        hung = absl::DeadlineExceededError(absl::StrCat(
            running_, " has not returned after ", absl::FormatDuration(absl::Now() - since_),
            ": NCCL's abort is stuck (a kernel that never ends, a dead peer's transport); the "
            "GPU plane of this node cannot recover until it returns or gradsyncd restarts"));
      }
    }
    if (!hung.ok()) {
      Log()->error("{}", std::string(hung.message()));
      if (options_.on_hung) options_.on_hung(hung);
    }
  }
}

}  // namespace gradsync::backend::nccl
