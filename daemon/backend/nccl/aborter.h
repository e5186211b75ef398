#pragma once

// The one thread that calls NCCL's aborts on this node, and the watchdog over it.
//
// ncclCommAbort blocks, even on a non-blocking communicator: it forces a blocking group, waits
// for NCCL's internal streams, joins its proxy threads and frees device memory, which waits for
// the device (NVIDIA/nccl src/init.cc, ncclCommAbort -> commReclaim -> commFree; docs/gpu.md).
// Under load that takes seconds, and forever when a kernel of another communicator on the same
// GPU spins on a lost peer. So no thread that others wait on (the peer watch's heartbeats,
// gRPC's, an op's) calls it: they hand what is to be aborted to this thread (CommsTable's
// AbortTask) and go on. Whatever runs here longer than `hung_after` is reported once (the
// daemon's health goes NOT_SERVING, an error line, a metric), and again when it returns.

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace gradsync::backend::nccl {

class Aborter {
 public:
  struct Options {
    /// An abort still running this long is reported through on_hung.
    absl::Duration hung_after = absl::Seconds(30);
    /// Told once per abort that runs past hung_after (DEADLINE_EXCEEDED naming it); may be null.
    std::function<void(const absl::Status&)> on_hung;
    /// Told when an abort reported to on_hung returns at last; may be null.
    std::function<void()> on_returned;
  };
  explicit Aborter(Options options);
  /// Stop().
  ~Aborter();
  Aborter(const Aborter&) = delete;
  Aborter& operator=(const Aborter&) = delete;

  /// Runs `work` on the aborter's thread after what was submitted before it; `what` names it
  /// in the watchdog's words ("the abort of job=j group=world"). After Stop, runs it here.
  void Submit(std::string what, std::function<void()> work) ABSL_LOCKS_EXCLUDED(mu_);
  /// Waits until nothing is queued or running (what the work submitted so far submits in turn
  /// included), at most `within`; whether that came.
  bool Flush(absl::Duration within) ABSL_LOCKS_EXCLUDED(mu_);
  /// Runs what is queued, then ends the threads (waits for an abort that runs; idempotent).
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);
  /// Aborts that ran past hung_after so far.
  int hung() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();
  void Watch();

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<std::pair<std::string, std::function<void()>>> queue_ ABSL_GUARDED_BY(mu_);
  std::string running_ ABSL_GUARDED_BY(mu_);  // what runs now (empty: nothing)
  absl::Time since_ ABSL_GUARDED_BY(mu_);
  bool reported_ ABSL_GUARDED_BY(mu_) = false;  // the running one was reported hung
  int hung_ ABSL_GUARDED_BY(mu_) = 0;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_, watchdog_;  // last: they start once the state above exists
};

}  // namespace gradsync::backend::nccl
