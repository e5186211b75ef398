// Device ops watched from their launch until the GPU has finished them (see launched_ops.h).

#include "daemon/backend/nccl/launched_ops.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"
#include "daemon/backend/nccl/backoff.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

// The engine's op without its members (their views point into memory the op's keep_alive
// holds; nothing after the launch reads them).
core::Collective WithoutMembers(const core::Collective& op) {
  core::Collective c = op;
  c.local.clear();
  c.local.shrink_to_fit();
  return c;
}

// Whether every device has finished the op (an error: a stream of it failed). An op not yet
// answered has not: its Run is still recording its end.
absl::StatusOr<bool> Finished(gpu::GpuApi* api, const LaunchedOp& op) {
  if (!op.answered.load()) return false;
  for (const auto& [device, event] : op.finished) {
    absl::StatusOr<bool> done = api->EventDone(device, event);
    if (!done.ok() || !*done) return done;
  }
  return true;
}

// Settles `op` (already out of the group's list) with `result`: its events go now; its watch
// ends and its buffers' mappings are let go once no group lock is held.
void Release(gpu::GpuApi* api, std::shared_ptr<LaunchedOp> op, absl::Status result,
             DeferredWrites& later) {
  for (const auto& [device, event] : op->finished) (void)api->DestroyEvent(device, event);
  if (op->answered.load() && !result.ok()) {  // its trainers hear at their next settle
    const absl::Status failed = absl::AbortedError(
        absl::StrCat(op->op.label,
                     " failed on the GPU after it was answered OK, so its results are not "
                     "valid: ",
                     result.message()));
    for (const auto& settlement : op->op.settlements) settlement->Fail(failed);
  }
  if (!op->answered.load()) {  // its Run ends its watch; the mappings go with the last holder
    later.Defer([op = std::move(op)] {});
    return;
  }
  later.Defer([op = std::move(op), result = std::move(result)] { op->peers.Finished(result); });
}

// Whether `c`'s communicators were revoked by a job-wide abort: their kernels return early and
// the events after them fire, so nothing may be settled as finished.
bool RevokedLocked(const GroupComms& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
  return c.generation.load() != 0 && c.revoked_generation.load() == c.generation.load();
}

// The first of the group's launched ops that was answered (null: none).
const LaunchedOp* FirstAnsweredLocked(const GroupComms& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
  for (const auto& op : c.launched) {
    if (op->answered.load()) return op.get();
  }
  return nullptr;
}

// Settles the group's oldest launched ops while they have finished; returns the first failure
// seen (its op is left first in the list).
absl::Status SettleFinishedLocked(gpu::GpuApi* api, GroupComms& c, DeferredWrites& later)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
  while (!c.launched.empty()) {
    absl::StatusOr<bool> done = Finished(api, *c.launched.front());
    if (!done.ok()) return done.status();
    if (!*done) break;
    // Looked at after the events: a revoke (which takes no group lock) marks the group before
    // it stops the kernels, so events that fired because of it are seen here as revoked.
    if (RevokedLocked(c)) break;
    std::shared_ptr<LaunchedOp> op = std::move(c.launched.front());
    c.launched.pop_front();
    Release(api, std::move(op), absl::OkStatus(), later);
  }
  return absl::OkStatus();
}

// What the group's next op reports: launched op `failed` (still in the list) failed with `why`.
absl::Status Remembered(const GroupComms& c, const LaunchedOp& failed, const absl::Status& why)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
  const size_t others = c.launched.empty() ? 0 : c.launched.size() - 1;
  return absl::AbortedError(
      absl::StrCat(failed.op.label,
                   " failed after it was launched (and answered OK), so its results are not valid",
                   others > 0 ? absl::StrCat(", nor those of the group's ", others,
                                             " other launched op(s) not finished with it")
                              : "",
                   ": ", why.message().empty() ? "its communicators were dropped" : why.message()));
}

}  // namespace

LaunchedOp::LaunchedOp(std::shared_ptr<const core::CommunicatorSpec> spec,
                       const core::Collective& op, gradsync::Store* store, std::string fingerprint)
    : spec(std::move(spec)),
      op(WithoutMembers(op)),
      peers(store, *this->spec, this->op, std::move(fingerprint)) {}

void LookAtLaunchedLocked(CommsTable& table, GroupComms& c, DeferredWrites& later) {
  gpu::GpuApi* const api = table.api();
  if (absl::Status s = SettleFinishedLocked(api, c, later); !s.ok()) {
    FailLaunchedLocked(table, c, c.launched.front(), s, later);
    return;
  }
  for (gpu::Comm comm : c.comms) {
    if (c.launched.empty()) break;  // nothing in flight to fail
    if (absl::StatusOr<bool> r = api->NcclCommReady(comm); !r.ok()) {
      FailLaunchedLocked(table, c, c.launched.front(), r.status(), later);
      return;
    }
  }
  // Another group of the job failed, also while this one is idle: AbortJobNow found this lock
  // held (by the watcher, say) and left the abort to whoever held it.
  if (c.abort_requested.exchange(false)) {
    table.AbortWithJobLocked(
        c,
        absl::AbortedError(absl::StrCat("aborted with the job's other NCCL communicators on this "
                                        "node: ",
                                        c.AbortReason().message())),
        later);
    return;
  }
  const absl::Time now = absl::Now();
  for (const std::shared_ptr<LaunchedOp>& op : c.launched) {
    // Only the oldest watches the store: the group's ops finish in order on its streams, so
    // the others can neither finish nor hang before it settles (then the next is the oldest),
    // and a watch per launched op would cost the job's root store a fingerprint and a wait per
    // node for each of up to kMaxLaunchedPerGroup ops. (Check only reads what its background
    // waits got: no store round trip under the group's lock.)
    absl::Status s = op == c.launched.front() ? op->peers.Check() : absl::OkStatus();
    if (s.ok() && now > op->op.deadline) {
      s = absl::DeadlineExceededError(
          "did not finish on the GPU by its deadline (a peer never entered it, or hung)");
    }
    if (!s.ok()) {
      const std::shared_ptr<LaunchedOp> failed = op;  // the list empties under it
      FailLaunchedLocked(table, c, failed, s, later);
      return;
    }
  }
}

absl::Status AwaitLaunchedLocked(CommsTable& table, GroupComms& c, size_t keep, absl::Time deadline,
                                 DeferredWrites& later) {
  Backoff backoff;
  while (true) {
    LookAtLaunchedLocked(table, c, later);
    if (c.launched.size() <= keep) return absl::OkStatus();
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(c.launched.size(), " earlier ops of the group still running on the GPU (",
                       "the oldest: ", c.launched.front()->op.label, ")"));
    }
    backoff.Pause();
  }
}

void FailLaunchedLocked(CommsTable& table, GroupComms& c, const std::shared_ptr<LaunchedOp>& failed,
                        const absl::Status& why, DeferredWrites& later) {
  const std::shared_ptr<LaunchedOp> op = failed;  // kept while the abort empties the list
  const absl::Status status(why.code(), absl::StrCat(op->op.label, ": ", why.message()));
  const bool on_peer_word = op->peers.failed_on_peer_word();
  Log()->warn("nccl op failed after it was launched, aborting {} job={} group={} error={}",
              on_peer_word ? "the group's communicators" : "the job's communicators on this node",
              c.job, c.group, status.ToString());
  table.CountLaunchFailure();
  if (c.launch_failure.ok()) c.launch_failure = Remembered(c, *op, why);
  table.AbortOnFailureLocked(c, status, on_peer_word, later);
  // The other nodes hear at once that this op failed here rather than wait for it.
  if (c.store != nullptr && !op->peers.peers_know()) {
    later.WriteWhileRunLasts(c.store, c.job, c.run, FailKey(*op->spec, op->op.seq),
                             absl::StrCat(c.node, ": ", status.message()));
  }
}

std::vector<std::shared_ptr<LaunchedOp>> TakeUnfinishedLocked(gpu::GpuApi* api, GroupComms& c,
                                                              const absl::Status& why,
                                                              DeferredWrites& later) {
  (void)SettleFinishedLocked(api, c, later);  // an op whose stream failed did not finish
  if (c.launched.empty()) return {};
  const LaunchedOp* answered = FirstAnsweredLocked(c);
  if (c.launch_failure.ok() && answered != nullptr) {
    c.launch_failure = Remembered(c, *answered, why);
  }
  std::vector<std::shared_ptr<LaunchedOp>> out(c.launched.begin(), c.launched.end());
  c.launched.clear();
  return out;
}

void ReleaseAborted(gpu::GpuApi* api, std::vector<std::shared_ptr<LaunchedOp>> ops,
                    const absl::Status& why, DeferredWrites& later) {
  const absl::Status result = why.ok() ? absl::AbortedError("aborted") : why;
  for (std::shared_ptr<LaunchedOp>& op : ops) Release(api, std::move(op), result, later);
}

absl::Status TakeLaunchFailureLocked(GroupComms& c, const core::Collective& op) {
  if (c.launch_failure.ok()) return absl::OkStatus();
  const std::string note = c.TakeAbortNote();
  const absl::Status s = absl::AbortedError(
      absl::StrCat(op.label, ": not run, the group's earlier op ", c.launch_failure.message(),
                   note.empty() ? "" : absl::StrCat(" (", note, ")"),
                   "; its NCCL communicators were aborted and the group's next op rebuilds them"));
  c.launch_failure = absl::OkStatus();
  return s;
}

}  // namespace gradsync::backend::nccl
