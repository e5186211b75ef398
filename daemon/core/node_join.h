#pragma once

// A joining node's side of an elastic job's joins, run by a daemon (Store.Join): part of the
// membership room (membership.h), which holds the records it reads and writes.

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/elastic_records.h"
#include "common/store.h"

namespace gradsync {
class WorkerPool;
}

namespace gradsync::core {

/// How long a join whose deadline passed while an admission had claimed its ticket waits for
/// that admission (each time), and how many times.
inline constexpr absl::Duration kClaimedJoinWait = absl::Seconds(2);
inline constexpr int kMaxClaimedJoinWaits =
    4;  // Together (8 s) within kJoinGrace (10 s): the caller is still there for the answer.

/// One joining node's wait to be admitted: takes its ticket for `ranks` ranks in the home
/// `home`, waits until `deadline` for the admission an AdmitJoiners writes, and withdraws the
/// ticket when the wait ends without one (the deadline, or Cancel: the caller went away),
/// unless an admission claimed it: then it waits for that admission kClaimedJoinWait more (at
/// most kMaxClaimedJoinWaits times, a claim being undone meanwhile). `done` runs exactly once:
/// with the ticket and its admission record, or the error (DEADLINE_EXCEEDED: not admitted in
/// time, ticket withdrawn; CANCELLED: Cancel; the store's or TakeTicket's error). Store calls
/// that block run on `pool`; without one (a store whose calls do not wait on the network, as
/// the embedded one), inline: on Start's caller and on the store's wait callback, which holds
/// no store lock (common/store.h).
class NodeJoin : public std::enable_shared_from_this<NodeJoin> {
 public:
  struct Admitted {
    int64_t ticket = 0;
    std::string admission;  // a gradsync.v1.JoinAdmission, as the store holds it
  };
  using Done = std::function<void(absl::StatusOr<Admitted>)>;

  static std::shared_ptr<NodeJoin> Start(gradsync::Store* store, WorkerPool* pool, std::string home,
                                         int ranks, absl::Time deadline, Done done);
  /// The caller went away: the wait ends (CANCELLED) and the ticket is withdrawn. A no-op once
  /// done.
  void Cancel();

  NodeJoin(gradsync::Store* store, WorkerPool* pool, std::string home, int ranks,
           absl::Time deadline, Done done);

 private:
  void Take();
  void Wait(absl::Time until);
  void Waited(uint64_t wait, absl::StatusOr<std::vector<std::string>> values);
  void Withdraw(absl::Status why);
  void Finish(absl::StatusOr<Admitted> result);

  gradsync::Store* const store_;
  WorkerPool* const pool_;
  const std::string home_;
  const int ranks_;
  const absl::Time deadline_;
  const Done done_;
  absl::Mutex mu_;
  int64_t ticket_ ABSL_GUARDED_BY(mu_) = 0;
  // The store wait under way (Cancel ends it); waits are numbered, one at a time: waits_ is
  // the last begun, answered_ the last whose callback ran.
  std::optional<Store::WaitId> wait_ ABSL_GUARDED_BY(mu_);
  uint64_t waits_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t answered_ ABSL_GUARDED_BY(mu_) = 0;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  int claimed_waits_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradsync::core
