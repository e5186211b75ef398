// Implementation of node_join.h.

#include "daemon/core/node_join.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/store_keys.h"
#include "common/worker_pool.h"
#include "daemon/core/membership.h"

namespace gradsync::core {
namespace {
auto Log() { return logging::Logger("core"); }
}  // namespace

std::shared_ptr<NodeJoin> NodeJoin::Start(gradsync::Store* store, WorkerPool* pool,
                                          std::string home, int ranks, absl::Time deadline,
                                          Done done) {
  auto join =
      std::make_shared<NodeJoin>(store, pool, std::move(home), ranks, deadline, std::move(done));
  WorkerPool::RunOn(join->pool_, [join] { join->Take(); });
  return join;
}

NodeJoin::NodeJoin(gradsync::Store* store, WorkerPool* pool, std::string home, int ranks,
                   absl::Time deadline, Done done)
    : store_(store),
      pool_(pool),
      home_(std::move(home)),
      ranks_(ranks),
      deadline_(deadline),
      done_(std::move(done)) {}

void NodeJoin::Cancel() {
  std::optional<Store::WaitId> wait;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || cancelled_) return;
    cancelled_ = true;
    wait = wait_;
  }
  // Outside mu_: the wait's callback may run inline. No wait yet: Take, or the step under way,
  // sees cancelled_.
  if (wait.has_value()) store_->CancelWait(*wait);
}

void NodeJoin::Take() {
  absl::StatusOr<int64_t> ticket = TakeTicket(*store_, home_, ranks_);
  if (!ticket.ok()) {
    Finish(ticket.status());
    return;
  }
  bool cancelled;
  {
    absl::MutexLock lock(&mu_);
    ticket_ = *ticket;
    cancelled = cancelled_;
  }
  Log()->info("join: ticket taken job={} ticket={} ranks={}", home_, *ticket, ranks_);
  if (cancelled) {
    Withdraw(absl::CancelledError("the join was cancelled"));
    return;
  }
  Wait(deadline_);
}

void NodeJoin::Wait(absl::Time until) {
  uint64_t wait;
  int64_t ticket;
  {
    absl::MutexLock lock(&mu_);
    wait = ++waits_;
    ticket = ticket_;
  }
  auto self = shared_from_this();
  const Store::WaitId id =
      store_->WaitAsync(home_, {ElasticAdmitKey(ticket)}, until,
                        [self, wait](absl::StatusOr<std::vector<std::string>> values) {
                          self->Waited(wait, std::move(values));
                        });
  bool cancel = false;
  {
    absl::MutexLock lock(&mu_);
    if (answered_ < wait) {  // still waiting (its callback may have run inline): Cancel ends it
      wait_ = id;
      cancel = cancelled_;
    }
  }
  if (cancel) store_->CancelWait(id);
}

void NodeJoin::Waited(uint64_t wait, absl::StatusOr<std::vector<std::string>> values) {
  int64_t ticket;
  {
    absl::MutexLock lock(&mu_);
    answered_ = wait;
    wait_.reset();
    ticket = ticket_;
  }
  if (values.ok()) {
    Finish(Admitted{ticket, std::move(values->front())});
    return;
  }
  // Not admitted (the deadline, Cancel, or the store failed): the ticket goes, off the
  // store's thread.
  auto self = shared_from_this();
  WorkerPool::RunOn(pool_, [self, why = values.status()] { self->Withdraw(why); });
}

void NodeJoin::Withdraw(absl::Status why) {
  int64_t ticket;
  {
    absl::MutexLock lock(&mu_);
    ticket = ticket_;
  }
  absl::StatusOr<Withdrawal> w = WithdrawTicket(*store_, home_, ticket);
  if (w.ok() && !w->withdrawn && w->state == "claimed") {
    // An admission is under way: its answer comes at once, or its claim is undone.
    bool again = false;
    {
      absl::MutexLock lock(&mu_);
      again = !cancelled_ && claimed_waits_ < kMaxClaimedJoinWaits;
      if (again) ++claimed_waits_;
    }
    if (again) {
      Log()->info("join: ticket claimed by an admission under way job={} ticket={}", home_, ticket);
      Wait(absl::Now() + kClaimedJoinWait);
      return;
    }
  }
  const std::string what =
      !w.ok() ? absl::StrCat("; withdrawing its ticket ", ticket, " failed: ", w.status().message())
      : w->withdrawn ? absl::StrCat("; its ticket ", ticket, " is withdrawn")
                     : absl::StrCat("; its ticket ", ticket, " is ", w->state);
  Log()->info("join: not admitted job={} ticket={} why={}{}", home_, ticket,
              std::string(why.message()), what);
  if (why.code() == absl::StatusCode::kDeadlineExceeded) {
    Finish(absl::DeadlineExceededError(
        absl::StrCat("elastic job ", home_,
                     ": the node was not admitted before the join's "
                     "deadline (the job's ranks admit joining nodes at state.commit())",
                     what)));
  } else if (why.code() == absl::StatusCode::kCancelled) {
    Finish(absl::CancelledError(absl::StrCat(
        "elastic job ", home_, ": the join was cancelled (its caller went away)", what)));
  } else {
    Finish(absl::Status(why.code(), absl::StrCat("elastic job ", home_,
                                                 ": waiting for the "
                                                 "node's admission failed: ",
                                                 why.message(), what)));
  }
}

void NodeJoin::Finish(absl::StatusOr<Admitted> result) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    finished_ = true;
  }
  if (result.ok()) {
    Log()->info("join: admitted job={} ticket={}", home_, result->ticket);
  }
  done_(std::move(result));
}

}  // namespace gradsync::core
