#pragma once

// The order in which one trainer submitted its device ops, for the data plane to launch them in.
//
// NCCL's rule for several communicators on one GPU: their operations must be launched from the
// host in the same order on every rank, or kernels waiting on each other across nodes can
// deadlock (NCCL docs, "Using multiple NCCL communicators concurrently"; NCCL_LAUNCH_ORDER_IMPLICIT
// then makes the GPU follow that host order). Each group's ops reach the data plane when its
// local members have all submitted them, in whatever order a node's threads get there; so the
// daemon launches a trainer's device op only once every device op it submitted before has been
// launched or has failed: each GPU's launches follow its trainer's program order, which a
// training program keeps the same on every rank.

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace gradsync::core {

/// One trainer's (session's) device ops in submission order. Thread-safe.
class SubmitOrder {
 public:
  /// The next op's index, at its submission (1, 2, ...).
  uint64_t Add() ABSL_LOCKS_EXCLUDED(mu_);
  /// Op `index` was launched, answered or dropped: the ops after it may go.
  void Done(uint64_t index) ABSL_LOCKS_EXCLUDED(mu_);
  /// Waits until every op submitted before `index` is done: OK; what `interrupt` says when it
  /// is not OK (looked at every few milliseconds; may be null); DEADLINE_EXCEEDED at
  /// `deadline`, saying how many earlier ops are still outstanding.
  absl::Status AwaitTurn(uint64_t index, absl::Time deadline,
                         const std::function<absl::Status()>& interrupt) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex mu_;
  uint64_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::set<uint64_t> outstanding_ ABSL_GUARDED_BY(mu_);
};

/// One trainer's device ops answered OK and not yet settled on the device, and the first
/// failure of one after its answer: what a settle request (an elastic commit) waits for and
/// reports. Thread-safe.
class Settlements {
 public:
  /// One device op of the trainer, from its submission until it has settled: held by the op
  /// (Collective::settlements) for as long as any part of the daemon holds the op; a data plane
  /// that finds it failed after its answer says so (Fail) before letting it go.
  class Op {
   public:
    explicit Op(std::shared_ptr<Settlements> of) : of_(std::move(of)) { of_->Add(); }
    ~Op();
    Op(const Op&) = delete;
    Op& operator=(const Op&) = delete;
    /// The op was answered `status` (an op answered with an error is settled as far as its
    /// trainer is concerned: it knows).
    void Answered(const absl::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
    /// It failed on the device after its answer.
    void Fail(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);

   private:
    const std::shared_ptr<Settlements> of_;
    absl::Mutex mu_;
    bool answered_ok_ ABSL_GUARDED_BY(mu_) = false;
    absl::Status failure_ ABSL_GUARDED_BY(mu_);
  };

  /// `done` runs (here or on another thread) once every op submitted so far has settled, with
  /// OK or the first failure after an answer since the last report.
  void Await(std::function<void(absl::Status)> done) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Add() ABSL_LOCKS_EXCLUDED(mu_);
  void Settled(bool answered_ok, absl::Status failure) ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex mu_;
  int64_t unsettled_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void(absl::Status)>> waiters_ ABSL_GUARDED_BY(mu_);
};

/// A device op's place in its trainer's order (LocalMember::turn), and its record until it has
/// settled.
struct Turn {
  std::shared_ptr<SubmitOrder> order;
  uint64_t index = 0;
  std::shared_ptr<Settlements::Op> settlement = nullptr;
};

}  // namespace gradsync::core
