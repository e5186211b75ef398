// Implementation of membership.h.

#include "daemon/core/membership.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/bounded_text.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/store_keys.h"
#include "daemon/core/backend.h"
#include "gradsync/v1/membership.pb.h"

namespace gradsync::core {
namespace {

// A ticket's record.
std::string Ticket(v1::JoinTicket::State state, int ranks = 0) {
  v1::JoinTicket t;
  t.set_state(state);
  t.set_ranks(ranks);
  return t.SerializeAsString();
}

// The ranks a waiting ticket's record asks to admit, else 0 (claimed, withdrawn).
int RanksOf(absl::string_view record) {
  v1::JoinTicket t;
  if (!t.ParseFromArray(record.data(), static_cast<int>(record.size())) ||
      t.state() != v1::JoinTicket::WAITING || t.ranks() < 1 || t.ranks() > kMaxJoinRanks) {
    return 0;
  }
  return t.ranks();
}

// A ticket's record in words, for its node: "waiting", "claimed", "withdrawn".
std::string TicketState(absl::string_view record) {
  v1::JoinTicket t;
  if (!t.ParseFromArray(record.data(), static_cast<int>(record.size()))) return "unreadable";
  switch (t.state()) {
    case v1::JoinTicket::WAITING:
      return "waiting";
    case v1::JoinTicket::CLAIMED:
      return "claimed";
    case v1::JoinTicket::WITHDRAWN:
      return "withdrawn";
    default:
      return "unreadable";
  }
}

// The counter at `key` (absent: 0).
absl::StatusOr<int64_t> Counter(gradsync::Store& store, absl::string_view job,
                                absl::string_view key) {
  return store.Add(job, key, 0);
}

std::optional<std::string> Peek(gradsync::Store& store, absl::string_view job,
                                absl::string_view key) {
  absl::StatusOr<std::string> v = store.Get(job, key, absl::InfinitePast());
  if (!v.ok()) return std::nullopt;
  return *std::move(v);
}

// The world of namespace `job`, an elastic job's formed epoch: the count of its ranks' node
// keys, so a caller cannot name another. FAILED_PRECONDITION (after `label`) otherwise.
absl::StatusOr<int> FormedElasticWorld(gradsync::Store& store, absl::string_view job,
                                       absl::string_view label) {
  if (!Peek(store, job, kRunKey).has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(label, "the namespace holds no formed job (no run token)"));
  }
  if (!Peek(store, job, kElasticKey).has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(label, "the job is not elastic"));
  }
  auto ranks = store.List(job, kRankKeyPrefix);
  if (!ranks.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(label, ranks.status().message()));
  }
  const int world = static_cast<int>(ranks->size());
  for (int r = 0; r < world; ++r) {
    if (!Peek(store, job, RankKey(r)).has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat(label, "the epoch has not formed: rank ", r, " has no node"));
    }
  }
  if (world == 0) return absl::FailedPreconditionError(absl::StrCat(label, "no ranks"));
  return world;
}

}  // namespace

absl::StatusOr<int64_t> TakeTicket(gradsync::Store& store, absl::string_view home, int ranks) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(home));
  const std::string label = absl::StrCat("TakeTicket job=", home, ": ");
  if (ranks < 1 || ranks > kMaxJoinRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, "ranks=", ranks, " is not 1 to ", kMaxJoinRanks));
  }
  GRADSYNC_ASSIGN_OR_RETURN(int64_t handled, Counter(store, home, kElasticHandledKey));
  GRADSYNC_ASSIGN_OR_RETURN(int64_t taken, Counter(store, home, kElasticTicketsKey));
  if (taken - handled >= kMaxOutstandingTickets) {
    return absl::ResourceExhaustedError(
        absl::StrCat(label, taken - handled, " tickets wait already (at most ",
                     kMaxOutstandingTickets, "); the job admits joining nodes at its commits"));
  }
  // Written only if no admission voided the number meanwhile (it voids a number taken and not
  // written when a later one is): else another.
  for (int tries = 0; tries < 3; ++tries) {
    GRADSYNC_ASSIGN_OR_RETURN(int64_t ticket, store.Add(home, kElasticTicketsKey, 1));
    GRADSYNC_ASSIGN_OR_RETURN(CompareSetResult written,
                              store.CompareSet(home, ElasticTicketKey(ticket), std::nullopt,
                                               Ticket(v1::JoinTicket::WAITING, ranks)));
    if (written.swapped) return ticket;
  }
  return absl::UnavailableError(absl::StrCat(label, "no ticket written in 3 tries"));
}

absl::StatusOr<Withdrawal> WithdrawTicket(gradsync::Store& store, absl::string_view home,
                                          int64_t ticket) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(home));
  if (ticket < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("WithdrawTicket job=", home, ": ticket ", ticket, " is not one"));
  }
  const std::string key = ElasticTicketKey(ticket);
  for (int tries = 0; tries < 4; ++tries) {  // a record changed between read and swap: again
    std::optional<std::string> now = Peek(store, home, key);
    if (!now.has_value()) return Withdrawal{false, "withdrawn"};
    if (RanksOf(*now) == 0) return Withdrawal{false, TicketState(*now)};
    GRADSYNC_ASSIGN_OR_RETURN(CompareSetResult r,
                              store.CompareSet(home, key, *now, Ticket(v1::JoinTicket::WITHDRAWN)));
    if (r.swapped) return Withdrawal{true, "withdrawn"};
  }
  return absl::UnavailableError(
      absl::StrCat("WithdrawTicket job=", home, " ticket=", ticket, ": its record keeps changing"));
}

absl::StatusOr<Admission> AdmitJoiners(gradsync::Store& store, absl::string_view job, int epoch,
                                       int min_world_size, int min_joined) {
  // One admission at a time on this daemon: two would both count the tickets they looked at.
  static absl::Mutex* const admitting = new absl::Mutex;
  absl::MutexLock lock(admitting);
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(job));
  const std::string label = absl::StrCat("AdmitJoiners job=", job, " epoch=", epoch, ": ");
  if (epoch < 1) {
    return absl::InvalidArgumentError(absl::StrCat(label, "a join starts epoch 1 or later"));
  }
  absl::StatusOr<std::string> home = ElasticBase(job, epoch - 1);
  if (!home.ok()) return absl::InvalidArgumentError(absl::StrCat(label, home.status().message()));
  if (min_world_size < 1 || min_world_size > kMaxElasticWorld) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, "min_world_size=", min_world_size, " is not 1 to ", kMaxElasticWorld));
  }
  if (min_joined < 1 || min_joined > kMaxJoinedPerDecision) {
    return absl::InvalidArgumentError(
        absl::StrCat(label, "min_joined=", min_joined, " is not 1 to ", kMaxJoinedPerDecision));
  }
  GRADSYNC_ASSIGN_OR_RETURN(const int world, FormedElasticWorld(store, job, label));
  if (std::optional<std::string> decided = Peek(store, job, kElasticDecisionKey)) {
    return Admission{true, *std::move(decided), 0};  // a change is on its way already
  }

  // The waiting tickets, in order, while they fit.
  GRADSYNC_ASSIGN_OR_RETURN(int64_t handled, Counter(store, *home, kElasticHandledKey));
  GRADSYNC_ASSIGN_OR_RETURN(int64_t taken, Counter(store, *home, kElasticTicketsKey));
  struct Claim {
    int64_t ticket;
    std::string record;
    int ranks;
  };
  std::vector<Claim> waiting, claimed;
  int64_t looked = 0;  // tickets dealt with (withdrawn, or claimed)
  int fit = 0;
  for (int64_t t = handled + 1; t <= taken && t <= handled + kMaxTicketsPerAdmission; ++t) {
    std::optional<std::string> record = Peek(store, *home, ElasticTicketKey(t));
    if (!record.has_value() && t < taken) {
      // Taken and not written while a later one was (its writer failed, or is slow: it then
      // takes another): voided, so that it holds up no admission.
      GRADSYNC_ASSIGN_OR_RETURN(CompareSetResult voided,
                                store.CompareSet(*home, ElasticTicketKey(t), std::nullopt,
                                                 Ticket(v1::JoinTicket::WITHDRAWN)));
      record = voided.value;
    }
    if (!record.has_value()) break;  // the newest, being written: a later commit admits it
    const int r = RanksOf(*record);
    if (r > 0 && (world + fit + r > kMaxElasticWorld || fit + r > kMaxJoinedPerDecision)) {
      break;  // this one and those after it wait for a later commit
    }
    ++looked;
    if (r == 0) continue;  // withdrawn
    waiting.push_back({t, *std::move(record), r});
    fit += r;
  }
  if (fit > 0 && fit < min_joined) return Admission{false, "", 0};  // too few yet: all wait
  int joined = 0;
  auto unclaim = [&] {
    for (const Claim& c : claimed) {
      (void)store.CompareSet(*home, ElasticTicketKey(c.ticket), Ticket(v1::JoinTicket::CLAIMED),
                             c.record);
    }
  };
  for (Claim& w : waiting) {
    absl::StatusOr<CompareSetResult> c = store.CompareSet(
        *home, ElasticTicketKey(w.ticket), w.record, Ticket(v1::JoinTicket::CLAIMED));
    if (!c.ok()) {
      unclaim();  // the store failed: they wait for a later commit
      return c.status();
    }
    if (!c->swapped) continue;  // withdrawn meanwhile
    joined += w.ranks;
    claimed.push_back(std::move(w));
  }
  if (joined == 0) {
    if (looked > 0) GRADSYNC_RETURN_IF_ERROR(store.Add(*home, kElasticHandledKey, looked).status());
    return Admission{false, "", 0};
  }
  absl::StatusOr<CompareSetResult> recorded = store.CompareSet(
      job, std::string(kElasticDecisionKey), std::nullopt,
      MembershipDecision{epoch,
                         world + joined,
                         {},
                         {},
                         joined,
                         absl::Now(),
                         absl::StrCat(claimed.size(), " node(s) joining (", joined, " rank(s))")}
          .Encode());
  if (!recorded.ok() || !recorded->swapped) {
    unclaim();  // a loss was decided first (or the store failed): they join at a later commit
    if (!recorded.ok()) return recorded.status();
    return Admission{true, std::move(recorded->value), 0};
  }
  int rank = world;
  for (const Claim& c : claimed) {
    // A joiner told nothing does not come: the epoch forms without its ranks (their deadline).
    v1::JoinAdmission admission;
    admission.set_epoch(epoch);
    admission.set_world(world + joined);
    admission.set_rank(rank);
    admission.set_min_world_size(min_world_size);
    (void)store.Set(*home, ElasticAdmitKey(c.ticket), admission.SerializeAsString());
    rank += c.ranks;
  }
  (void)store.Add(*home, kElasticHandledKey, looked);
  return Admission{true, std::move(recorded->value), joined};
}

std::string MembershipDecision::Encode() const {
  v1::MembershipDecision d;
  d.set_epoch(epoch);
  d.set_world(world);
  for (int r : lost_ranks) d.add_lost_ranks(r);
  for (const std::string& n : lost_nodes) d.add_lost_nodes(n);
  d.set_joined(joined);
  d.set_at_unix_ms(absl::ToUnixMillis(at == absl::InfinitePast() ? absl::Now() : at));
  d.set_why(why);
  return d.SerializeAsString();
}

absl::StatusOr<MembershipDecision> MembershipDecision::Decode(absl::string_view record) {
  v1::MembershipDecision d;
  if (!d.ParseFromArray(record.data(), static_cast<int>(record.size())) || d.epoch() < 1 ||
      d.world() < 0 || d.joined() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("not a membership decision (", record.size(), " bytes)"));
  }
  return MembershipDecision{d.epoch(),
                            d.world(),
                            {d.lost_ranks().begin(), d.lost_ranks().end()},
                            {d.lost_nodes().begin(), d.lost_nodes().end()},
                            d.joined(),
                            absl::FromUnixMillis(d.at_unix_ms()),
                            d.why()};
}

std::string MembershipDecision::Describe() const {
  return absl::StrCat("epoch=", epoch, " world=", world,
                      " lost_ranks=", absl::StrJoin(lost_ranks, ","),
                      " lost_nodes=", absl::StrJoin(lost_nodes, ","),
                      joined > 0 ? absl::StrCat(" joined=", joined) : "",
                      " at=", absl::ToUnixMillis(at), " why=", why);
}

const char* EpochMembership::StateName(State state) {
  switch (state) {
    case State::kForming:
      return "forming";
    case State::kFormed:
      return "formed";
    case State::kDeciding:
      return "deciding";
    case State::kDecided:
      return "decided";
    case State::kUnformed:
      return "unformed";
    case State::kEnded:
      return "ended";
  }
  return "invalid";
}

EpochMembership::EpochMembership(gradsync::Store* store, std::string job, int epoch, int world_size)
    : store_(store), job_(std::move(job)), epoch_(epoch), world_size_(world_size) {}

EpochMembership::State EpochMembership::state() const {
  absl::MutexLock lock(&mu_);
  return state_;
}

bool EpochMembership::Advance(std::initializer_list<State> from, State to) {
  absl::MutexLock lock(&mu_);
  for (State s : from) {
    if (state_ == s) {
      state_ = to;
      return true;
    }
  }
  return false;
}

absl::Status EpochMembership::MarkElastic() { return store_->Set(job_, kElasticKey, "1"); }

bool EpochMembership::Formed() { return Advance({State::kForming}, State::kFormed); }

absl::Status EpochMembership::ClaimFormed() {
  absl::StatusOr<CompareSetResult> outcome =
      store_->CompareSet(job_, kFormationKey, std::nullopt, "formed");
  if (!outcome.ok() || outcome->value == "formed") {
    Advance({State::kForming}, State::kFormed);
    return absl::OkStatus();
  }
  Advance({State::kForming}, State::kUnformed);
  return absl::UnavailableError(
      absl::StrCat("job ", job_,
                   " did not form by its first op's deadline: its daemons went "
                   "on without the ranks missing then (this node's came too late)"));
}

std::optional<absl::Status> EpochMembership::DecideUnformed(absl::Duration timeout) {
  // One outcome for every daemon of the epoch: formed, or not (then decided without the
  // ranks missing now; a rank publishing later finds it so in ClaimFormed).
  absl::StatusOr<CompareSetResult> outcome =
      store_->CompareSet(job_, kFormationKey, std::nullopt, "unformed");
  if (!outcome.ok()) return std::nullopt;
  if (outcome->value == "formed") {
    Advance({State::kForming}, State::kFormed);
    return absl::OkStatus();
  }
  absl::StatusOr<std::vector<std::string>> published = store_->List(job_, kRankKeyPrefix);
  if (!published.ok()) return std::nullopt;
  std::vector<bool> here(world_size_, false);
  for (absl::string_view key : *published) {
    int rank = -1;
    absl::ConsumePrefix(&key, kRankKeyPrefix);
    if (absl::SimpleAtoi(key, &rank) && rank >= 0 && rank < world_size_) here[rank] = true;
  }
  MembershipDecision d;
  for (int r = 0; r < world_size_; ++r) {
    if (!here[r]) d.lost_ranks.push_back(r);
  }
  if (d.lost_ranks.empty() || d.lost_ranks.size() == here.size()) return std::nullopt;
  d.epoch = epoch_ + 1;
  d.world = world_size_ - static_cast<int>(d.lost_ranks.size());
  d.why = absl::StrCat("rank(s) ", JoinBounded(d.lost_ranks, ","), " did not join epoch ", epoch_,
                       " within ", absl::FormatDuration(timeout));
  absl::StatusOr<CompareSetResult> recorded =
      store_->CompareSet(job_, std::string(kElasticDecisionKey), std::nullopt, d.Encode());
  if (!recorded.ok()) return std::nullopt;
  Advance({State::kForming}, State::kUnformed);
  if (recorded->swapped) {
    logging::Logger("core")->warn(
        "elastic job={}: membership changed, epoch {} -> {}: it did not form, {}", job_, epoch_,
        epoch_ + 1, d.why);
  }
  return absl::UnavailableError(absl::StrCat("job ", job_, " did not form: ", d.why,
                                             " (their node is lost or gone); the others go on"));
}

bool EpochMembership::BeginDeciding() {
  return Advance({State::kFormed, State::kForming}, State::kDeciding);
}

absl::StatusOr<EpochMembership::Recorded> EpochMembership::Decide(
    const MembershipDecision& decision) {
  if (state() != State::kDeciding) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", job_, ": a membership decision while ", StateName(state())));
  }
  absl::StatusOr<CompareSetResult> recorded =
      store_->CompareSet(job_, std::string(kElasticDecisionKey), std::nullopt, decision.Encode());
  if (!recorded.ok()) return recorded.status();
  Advance({State::kDeciding}, State::kDecided);
  return Recorded{recorded->swapped, std::move(recorded->value)};
}

std::optional<MembershipDecision> EpochMembership::PreviousDecision(absl::Duration wait) const {
  if (epoch_ == 0) return std::nullopt;
  absl::StatusOr<std::string> base = ElasticBase(job_, epoch_);
  if (!base.ok()) return std::nullopt;
  absl::StatusOr<std::vector<std::string>> decision = store_->WaitBlocking(
      ElasticJobId(*base, epoch_ - 1), {std::string(kElasticDecisionKey)}, absl::Now() + wait);
  if (!decision.ok() || decision->size() != 1) return std::nullopt;
  absl::StatusOr<MembershipDecision> d = MembershipDecision::Decode((*decision)[0]);
  if (!d.ok()) return std::nullopt;
  return *std::move(d);
}

void EpochMembership::End() {
  absl::MutexLock lock(&mu_);
  state_ = State::kEnded;
}

absl::StatusOr<bool> EpochMembership::HasDecision(gradsync::Store& store, absl::string_view job) {
  absl::StatusOr<std::vector<std::string>> decided =
      store.List(job, std::string(kElasticDecisionKey));
  if (!decided.ok()) return decided.status();
  return !decided->empty();
}

void EpochMembership::DropDecision(gradsync::Store& store, absl::string_view job) {
  (void)store.Delete(job, std::string(kElasticDecisionKey));
}

void EpochHistory::Add(std::string base, int epoch, int world_size, absl::Time formed,
                       const std::optional<MembershipDecision>& change) {
  EpochRecord record{std::move(base), epoch, world_size, "", formed, absl::ZeroDuration()};
  if (change.has_value()) {
    // Words from the store, shown to operators: printable ASCII, bounded.
    constexpr size_t kMaxChange = 1024;
    record.change = change->Describe().substr(0, kMaxChange);
    for (char& c : record.change) {
      if (c < 0x20 || c > 0x7e) c = '?';
    }
    record.took = formed - change->at;
  }
  absl::MutexLock lock(&mu_);
  records_.push_back(std::move(record));
  while (records_.size() > kMaxRecords) records_.pop_front();
}

std::vector<EpochRecord> EpochHistory::Of(const std::string& job) const {
  std::vector<EpochRecord> out;
  absl::MutexLock lock(&mu_);
  for (const EpochRecord& e : records_) {
    if (job.empty() || e.job == job) out.push_back(e);
  }
  return out;
}

bool RetainsNamespace(gradsync::Store& store, absl::string_view job) {
  absl::StatusOr<bool> kept = EpochMembership::HasDecision(store, job);
  return kept.ok() && *kept;
}

std::vector<std::string> ReleasedAtEnd(const EpochEnd& end, const absl::StatusOr<bool>& decided) {
  std::vector<std::string> out;
  if (end.base.empty()) return out;
  if (end.epoch >= 2) out.push_back(ElasticJobId(end.base, end.epoch - 1));
  const bool last =
      decided.ok() ? !*decided : decided.status().code() == absl::StatusCode::kNotFound;
  if (last && end.epoch >= 1) out.push_back(ElasticJobId(end.base, 0));
  return out;
}

std::vector<std::string> ReleasedWhenAbandoned(const EpochEnd& end, bool runs) {
  std::vector<std::string> out;
  if (end.base.empty()) return out;
  if (end.epoch > 0) out.push_back(ElasticJobId(end.base, end.epoch));
  if (end.held_rank0 && !runs) out.push_back(ElasticJobId(end.base, 0));
  return out;
}

}  // namespace gradsync::core
