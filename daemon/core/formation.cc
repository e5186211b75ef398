// Jobs spanning nodes: formation. Once a job's local ranks have all registered, this daemon
// agrees on the run's token in the root daemon's store, publishes which ranks it holds and waits
// for every rank's node; ops submitted meanwhile are parked and replayed in order once formed.
#include <algorithm>
#include <random>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/bounded_text.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/store_keys.h"
#include "daemon/core/engine.h"

namespace gradsync::core {
namespace {

auto Log() { return logging::Logger("core"); }

}  // namespace

namespace {
// How long formation's store calls are tried again on a transient failure.
constexpr absl::Duration kStoreRetry = absl::Seconds(10);

bool IsTransient(const absl::Status& s) { return s.code() == absl::StatusCode::kUnavailable; }
const absl::Status& StatusOf(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& StatusOf(const absl::StatusOr<T>& s) {
  return s.status();
}

// 16 random hex digits.
std::string RunToken() {
  std::random_device device;
  std::mt19937_64 bits((uint64_t{device()} << 32) ^ device() ^
                       static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat(absl::Hex(bits(), absl::kZeroPad16));
}
}  // namespace

void Engine::StartFormation(std::shared_ptr<Job> job, std::string node) {
  std::vector<int> mine;
  {
    absl::MutexLock lock(&job->mu);
    for (int r = 0; r < job->world_size; ++r) {
      if (job->ranks[r] != nullptr) mine.push_back(r);
    }
  }
  // A channel to a root daemon that restarted fails its first call (UNAVAILABLE) and then
  // connects again: such calls are tried again for a few seconds.
  const absl::Time retry_until = absl::Now() + std::min(options_.default_op_timeout, kStoreRetry);
  auto retry = [&](auto call) {
    absl::Duration pause = absl::Milliseconds(50);
    for (;;) {
      auto result = call();
      if (result.ok() || !IsTransient(StatusOf(result)) || absl::Now() + pause > retry_until) {
        return result;
      }
      absl::SleepFor(pause);
      pause = std::min(2 * pause, absl::Seconds(1));
    }
  };
  // The run's token: the first node to come sets it, every node reads the same one. The job's
  // keys are deleted when it ends at the root, so a later run of the same id makes a new one.
  absl::StatusOr<CompareSetResult> run = retry(
      [&] { return job->root_store->CompareSet(job->id, kRunKey, std::nullopt, RunToken()); });
  if (!run.ok()) {
    OnFormed(job, absl::Status(run.status().code(),
                               absl::StrCat("agreeing on the run: ", run.status().message())));
    return;
  }
  {
    absl::MutexLock lock(&job->mu);
    job->run = run->value;
  }
  if (job->membership != nullptr) {  // what lets a client ask for a join of this job
    absl::Status s = retry([&] { return job->membership->MarkElastic(); });
    if (!s.ok()) {
      OnFormed(job, absl::Status(s.code(), absl::StrCat("marking the job elastic: ", s.message())));
      return;
    }
  }
  for (int r : mine) {
    absl::Status s = retry([&] { return job->root_store->Set(job->id, RankKey(r), node); });
    if (!s.ok()) {
      OnFormed(job, absl::Status(s.code(), absl::StrCat("publishing rank ", r, ": ", s.message())));
      return;
    }
  }
  std::vector<std::string> keys;
  for (int r = 0; r < job->world_size; ++r) keys.push_back(RankKey(r));
  Log()->info("job forming job={} node={} local_ranks={} world_size={}", job->id, node,
              JoinBounded(mine, ","), job->world_size);
  job->root_store->WaitAsync(
      job->id, std::move(keys), absl::Now() + options_.default_op_timeout,
      [this, weak = std::weak_ptr<Job>(job), node](absl::StatusOr<std::vector<std::string>> v) {
        // Off the store's thread: replaying parked ops may compute.
        pool_->Schedule([this, weak, node, v = std::move(v)]() mutable {
          if (auto job = weak.lock()) {
            absl::MutexLock lock(&job->mu);
            job->node = node;
          }
          OnFormed(weak, std::move(v));
        });
      });
}

void Engine::OnFormationDeadline(const std::weak_ptr<Job>& weak, absl::Duration timeout) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  {
    absl::MutexLock lock(&job->mu);
    if (job->formation != Job::Formation::kLocal && job->formation != Job::Formation::kForming) {
      return;  // formed (or failed) in time
    }
  }
  // Who is missing: a wait that ends at once names the keys not there.
  std::vector<std::string> keys;
  for (int r = 0; r < job->world_size; ++r) keys.push_back(RankKey(r));
  absl::StatusOr<std::vector<std::string>> missing =
      job->root_store->WaitBlocking(job->id, keys, absl::Now() + absl::Milliseconds(100));
  std::deque<Job::Parked> failed;
  absl::Status error;
  if (!missing.ok() && job->membership != nullptr && job->epoch > 0) {
    std::optional<absl::Status> decided = job->membership->DecideUnformed(timeout);
    if (decided.has_value() && decided->ok()) return;  // it formed after all: OnFormed goes on
    if (decided.has_value()) error = *std::move(decided);
  }
  {
    absl::MutexLock lock(&job->mu);
    if (job->formation != Job::Formation::kLocal && job->formation != Job::Formation::kForming) {
      return;  // formed (or failed) meanwhile
    }
    job->formation = Job::Formation::kFailed;
    job->formation_error =
        !error.ok()
            ? error
            : absl::DeadlineExceededError(absl::StrCat(
                  "job ", job->id, " did not form across nodes (root ", job->root_address,
                  ") within its first op's deadline (", absl::FormatDuration(timeout), "): ",
                  missing.ok() ? "its ranks' daemons published only now"
                               : std::string(missing.status().message())));
    error = job->formation_error;
    failed.swap(job->parked);
  }
  Log()->warn("{}", std::string(error.message()));
  for (Job::Parked& p : failed) p.sink->OpDone(p.tag, 0, error);
}

void Engine::OnFormed(const std::weak_ptr<Job>& weak,
                      absl::StatusOr<std::vector<std::string>> nodes) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  {
    absl::MutexLock lock(&job->mu);
    if (job->formation == Job::Formation::kFailed) return;  // its deadline came first
  }
  // An elastic epoch past 0 formed here: unless its daemons already went on without some of
  // its ranks (the deadline of the first op, on another node).
  if (nodes.ok() && job->membership != nullptr) {
    if (job->epoch == 0) {
      job->membership->Formed();
    } else if (absl::Status s = job->membership->ClaimFormed(); !s.ok()) {
      nodes = s;
    }
  } else if (job->membership != nullptr && job->epoch > 0 &&
             nodes.status().code() == absl::StatusCode::kDeadlineExceeded) {
    // Its wait for every rank ended first (the same bound as its first op's deadline).
    std::optional<absl::Status> decided =
        job->membership->DecideUnformed(options_.default_op_timeout);
    if (decided.has_value() && !decided->ok()) nodes = *std::move(decided);
  }
  std::deque<Job::Parked> failed;
  absl::Status error;
  std::string nodes_listed;
  {
    absl::MutexLock lock(&job->mu);
    if (!nodes.ok()) {
      job->formation = Job::Formation::kFailed;
      job->formation_error =
          absl::Status(nodes.status().code() == absl::StatusCode::kDeadlineExceeded
                           ? absl::StatusCode::kDeadlineExceeded
                           : absl::StatusCode::kUnavailable,
                       absl::StrCat("job ", job->id, " did not form across nodes (root ",
                                    job->root_address, "): ", nodes.status().message()));
      error = job->formation_error;
      failed.swap(job->parked);
    } else {
      job->node_of_rank = *std::move(nodes);
      job->formation = Job::Formation::kReplaying;
      nodes_listed = JoinBounded(job->node_of_rank, ",");
    }
  }
  if (!error.ok()) {
    Log()->warn("{}", std::string(error.message()));
    for (Job::Parked& p : failed) p.sink->OpDone(p.tag, 0, error);
    return;
  }
  Log()->info("job formed job={} nodes={}", job->id, nodes_listed);
  if (job->elastic && job->root_store != nullptr) {  // a store call: not before the replay
    pool_->Schedule([this, weak, formed = absl::Now()] { RecordEpoch(weak, formed); });
  }
  if (peer_watch_ != nullptr) {  // the job's other daemons, watched until the job ends here
    std::vector<std::string> nodes;
    std::string run, me;
    {
      absl::MutexLock lock(&job->mu);
      nodes = job->node_of_rank;
      run = job->run;
      me = job->node;
    }
    std::sort(nodes.begin(), nodes.end());
    nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
    const int my_index =
        static_cast<int>(std::find(nodes.begin(), nodes.end(), me) - nodes.begin());
    peer_watch_->Watch(job->id, run, nodes, my_index, job->root_store,
                       [this, weak](const std::string& node, const absl::Status& cause) {
                         OnPeerLost(weak, node, cause);
                       });
  }
  for (;;) {  // parked ops first, in order; new ones park behind them until the queue is empty
    Job::Parked p;
    {
      absl::MutexLock lock(&job->mu);
      if (job->parked.empty()) {
        job->formation = Job::Formation::kFormed;
        return;
      }
      p = std::move(job->parked.front());
      job->parked.pop_front();
    }
    SubmitNow(p.session, p.sink, p.tag, p.op, p.turn);
  }
}

void Engine::OnPeerLost(const std::weak_ptr<Job>& weak, const std::string& node,
                        const absl::Status& cause) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  if (cause.code() == absl::StatusCode::kCancelled) {
    // It left on purpose: what it sent stays readable, so the ops it took part in complete, and
    // an op that needs more from it fails on its link. Only groups made from now on fail.
    absl::MutexLock lock(&job->mu);
    // (No membership decision for an elastic job: a node whose trainers end on purpose, as
    // every node's do at a job's end or a reset, is not lost.)
    job->lost_nodes.emplace(node, absl::StrCat("node ", node, " ", cause.message()));
    job->left_nodes.insert(node);
    return;
  }
  Completions out;
  std::vector<std::shared_ptr<Communicator>> running;
  std::string why;
  {
    absl::MutexLock lock(&job->mu);
    std::vector<int> ranks;
    for (int r = 0; r < static_cast<int>(job->node_of_rank.size()); ++r) {
      if (job->node_of_rank[r] == node) ranks.push_back(r);
    }
    why = absl::StrCat("node ", node, " (ranks ", JoinBounded(ranks, ","), ") ", cause.message());
    job->lost_nodes.emplace(node, why);
    ScheduleDecisionLocked(*job);
    for (auto& [key, group] : job->groups) {
      internal::AssertGroupOf(*job, *group);
      const std::vector<int>& members = group->members;
      const bool spans = std::any_of(ranks.begin(), ranks.end(), [&members](int r) {
        return std::binary_search(members.begin(), members.end(), r);
      });
      if (!spans) continue;
      if (group->broken.empty()) group->broken = why;
      running.push_back(group->comm);
      // The other survivors' watches find the node lost too: nothing goes to them.
      FailAllPendingLocked(*group, why, out, /*send_to_other_nodes=*/false);
    }
  }
  Log()->warn("job={} {}: its groups fail ({} here)", job->id, why, running.size());
  for (auto& fn : out) fn();
  // An op running now fails at once instead of waiting out its deadline.
  for (auto& comm : running) comm->Abort(absl::UnavailableError(why));
}

void Engine::ScheduleDecisionLocked(Job& job) {
  // An elastic job records its next membership once the losses of the moment are in.
  if (job.membership == nullptr || !job.membership->BeginDeciding()) return;
  timer_.Schedule(absl::Now() + options_.elastic_settle,
                  [this, weak = std::weak_ptr<Job>(job.shared_from_this())] {
                    // A store call: off the timer's thread.
                    pool_->Schedule([this, weak] { DecideMembership(weak); });
                  });
}

void Engine::DecideMembership(const std::weak_ptr<Job>& weak) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  std::vector<int> lost_ranks;
  std::vector<std::string> lost_nodes;
  std::string why;
  {
    absl::MutexLock lock(&job->mu);
    for (const auto& [node, reason] : job->lost_nodes) {
      if (job->left_nodes.count(node) > 0) continue;  // left on purpose: not lost
      lost_nodes.push_back(node);
      if (why.empty()) why = reason;
      for (int r = 0; r < static_cast<int>(job->node_of_rank.size()); ++r) {
        if (job->node_of_rank[r] == node) lost_ranks.push_back(r);
      }
    }
  }
  if (lost_ranks.empty() || job->membership == nullptr) return;
  std::sort(lost_ranks.begin(), lost_ranks.end());
  MembershipDecision decision;
  decision.epoch = job->epoch + 1;
  decision.world = job->world_size - static_cast<int>(lost_ranks.size());
  decision.lost_ranks = std::move(lost_ranks);
  decision.lost_nodes = std::move(lost_nodes);
  decision.at = absl::Now();
  decision.why = why;
  absl::StatusOr<EpochMembership::Recorded> recorded = job->membership->Decide(decision);
  if (!recorded.ok()) {
    Log()->warn(
        "elastic job={}: the new membership could not be recorded in the job's store (root {}), "
        "so its survivors cannot go on: {}; decision was: {}",
        job->id, job->root_address.empty() ? "etcd" : job->root_address,
        recorded.status().ToString(), decision.Describe());
    return;
  }
  if (recorded->ours) {
    Log()->warn(
        "elastic job={}: membership changed, epoch {} -> {}: world {} -> {}, ranks {} of "
        "node(s) {} lost ({})",
        job->id, job->epoch, job->epoch + 1, job->world_size, decision.world,
        JoinBounded(decision.lost_ranks, ","), JoinBounded(decision.lost_nodes, ","), why);
  } else {
    absl::StatusOr<MembershipDecision> theirs = MembershipDecision::Decode(recorded->decision);
    Log()->info("elastic job={}: the membership decision recorded by another daemon stands: {}",
                job->id, theirs.ok() ? theirs->Describe() : std::string(theirs.status().message()));
  }
}

void Engine::RecordEpoch(const std::weak_ptr<Job>& weak, absl::Time formed) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  absl::StatusOr<std::string> base = ElasticBase(job->id, job->epoch);
  if (!base.ok() || job->membership == nullptr) return;
  // A membership change this node took part in (a loss or a join): counted once it formed.
  if (job->epoch > 0 && options_.counters != nullptr) {
    options_.counters->membership_changes.fetch_add(1);
  }
  // The previous epoch's namespace keeps its decision while this runs.
  epochs_.Add(*std::move(base), job->epoch, job->world_size, formed,
              job->membership->PreviousDecision(absl::Milliseconds(500)));
}

std::vector<EpochRecord> Engine::Epochs(const std::string& job) const { return epochs_.Of(job); }

}  // namespace gradsync::core
