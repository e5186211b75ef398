// A trainer's device ops in submission order (see submit_order.h).

#include "daemon/core/submit_order.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace gradsync::core {

uint64_t SubmitOrder::Add() {
  absl::MutexLock lock(&mu_);
  outstanding_.insert(++next_);
  return next_;
}

void SubmitOrder::Done(uint64_t index) {
  absl::MutexLock lock(&mu_);
  outstanding_.erase(index);
}

absl::Status SubmitOrder::AwaitTurn(uint64_t index, absl::Time deadline,
                                    const std::function<absl::Status()>& interrupt) {
  // Looked at this often for the interrupt (a job-wide abort, another node's word).
  constexpr absl::Duration kLook = absl::Milliseconds(5);
  absl::MutexLock lock(&mu_);
  auto my_turn = [this, index]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return outstanding_.empty() || *outstanding_.begin() >= index;
  };
  while (!my_turn()) {
    if (interrupt) {
      mu_.Unlock();
      absl::Status s = interrupt();
      mu_.Lock();
      if (!s.ok()) return s;
      if (my_turn()) break;
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      const auto earlier = std::distance(outstanding_.begin(), outstanding_.lower_bound(index));
      return absl::DeadlineExceededError(
          absl::StrCat(earlier,
                       " device op(s) its trainer submitted before this one were not launched by "
                       "its deadline (a GPU's ops are launched in the order its trainer submitted "
                       "them, the same on every node)"));
    }
    mu_.AwaitWithDeadline(absl::Condition(&my_turn), std::min(deadline, now + kLook));
  }
  return absl::OkStatus();
}

Settlements::Op::~Op() {
  bool answered_ok = false;
  absl::Status failure;
  {
    absl::MutexLock lock(&mu_);
    answered_ok = answered_ok_;
    failure = failure_;
  }
  of_->Settled(answered_ok, std::move(failure));
}

void Settlements::Op::Answered(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  answered_ok_ = status.ok();
}

void Settlements::Op::Fail(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (failure_.ok()) failure_ = Unshared(why);  // the failing thread's copy stays there
}

void Settlements::Add() {
  absl::MutexLock lock(&mu_);
  ++unsettled_;
}

void Settlements::Settled(bool answered_ok, absl::Status failure) {
  std::vector<std::function<void(absl::Status)>> done;
  absl::Status report;
  {
    absl::MutexLock lock(&mu_);
    // Only a failure after an OK answer is news to the trainer.
    if (answered_ok && !failure.ok() && failure_.ok()) failure_ = std::move(failure);
    if (--unsettled_ > 0 || waiters_.empty()) return;
    done.swap(waiters_);
    report = std::exchange(failure_, absl::OkStatus());
  }
  for (auto& fn : done) fn(Unshared(report));
}

void Settlements::Await(std::function<void(absl::Status)> done) {
  absl::Status report;
  {
    absl::MutexLock lock(&mu_);
    if (unsettled_ > 0) {
      waiters_.push_back(std::move(done));
      return;
    }
    report = std::exchange(failure_, absl::OkStatus());
  }
  done(Unshared(report));
}

}  // namespace gradsync::core
