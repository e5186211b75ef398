// The op matcher of one group on this node: pairs each local member's k-th op of the group into
// one Collective, refuses ops of a broken group, fails an op (desync, deadline, a rank gone) and
// keeps its verdict for the members still to come. Pure state changes on the Group under its
// job's mutex; each call returns a small outcome whose effects (answering sinks, timers, logs,
// running ops) the engine carries out after.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/core/job.h"

namespace gradsync::core {

struct EngineOptions;

namespace internal {

/// The collective of op `seq` of `group`: what its members agreed on, by when and on which
/// plane; `local` is left empty. The one place a Collective is made and an op's label formed.
Collective MakeCollective(const Group& group, uint64_t seq, const Fingerprint& fp,
                          absl::Time deadline, Plane plane);

/// What became of one member's op (Arrive).
struct Arrived {
  enum class Outcome {
    kWaiting,   // other local members are still to submit it
    kMatched,   // it was the last: the op is queued on group.ready
    kAnswered,  // answer the member at once with `status` (a broken group, or an earlier verdict)
    kDesync,    // its fingerprint differs from the first member's: fail the op with `status`
  };
  Outcome outcome = Outcome::kWaiting;
  uint64_t seq = 0;  // the op's number in the group; 0 when refused without taking one
  absl::Status status;
  std::optional<absl::Time> arm_deadline;  // kWaiting: the op's deadline moved earlier
  std::vector<DeadlineTimer::Id> disarm;   // kMatched: the op's deadline timers
  bool start_drain = false;                // kMatched: no Drain owns group.ready; start one
  std::optional<Ready> for_other_nodes;    // kAnswered: a refusal the other nodes must hear of
};

/// Member `a` submits its next op on `group`. `next_seq` is the member's count of ops on the
/// group; it takes the op's number from it (unless a group local to this node refuses it).
Arrived Arrive(Group& group, uint64_t& next_seq, Arrival a)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);

/// Keeps timer `id` with pending op `seq`, to be cancelled when the op matches or fails.
void KeepTimer(Group& group, uint64_t seq, DeadlineTimer::Id id)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);

/// What failing a pending op leaves to do (Fail).
struct FailedPending {
  std::vector<std::pair<std::shared_ptr<SessionSink>, uint64_t>> to;  // members that came
  std::vector<DeadlineTimer::Id> disarm;
  std::optional<Ready> for_other_nodes;  // groups spanning nodes: the verdict for the exchange
};

/// Fails pending op `seq` (if pending) with `status`: notes it finished (history, counters) and
/// keeps the verdict for the local members that have not submitted it yet.
FailedPending Fail(Group& group, uint64_t seq, const absl::Status& status,
                   const EngineOptions& options) ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);

/// DEADLINE_EXCEEDED naming the local ranks that never submitted pending op `seq`, when it is
/// past its deadline at `now`; nullopt when it is not pending or not due.
std::optional<absl::Status> Expire(const Group& group, uint64_t seq, absl::Time now)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);

}  // namespace internal
}  // namespace gradsync::core
