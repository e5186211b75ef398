// Implementation of membership.h.

#include "daemon/core/membership.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "common/job_id.h"
#include "common/status_macros.h"
#include "common/store_keys.h"
#include "daemon/core/backend.h"

namespace gradsync::core {
namespace {

constexpr absl::string_view kRanksPrefix = "ranks=";
constexpr absl::string_view kClaimed = "claimed";
constexpr absl::string_view kWithdrawn = "withdrawn";

// The ranks a ticket's record asks to admit: "ranks=K", else 0 (withdrawn, claimed).
int RanksOf(absl::string_view record) {
  int ranks = 0;
  if (!absl::ConsumePrefix(&record, kRanksPrefix) || !absl::SimpleAtoi(record, &ranks) ||
      ranks < 1 || ranks > kMaxJoinRanks) {
    return 0;
  }
  return ranks;
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
                                               absl::StrCat(kRanksPrefix, ranks)));
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
    if (!now.has_value() || RanksOf(*now) == 0) {
      return Withdrawal{false, now.value_or(std::string(kWithdrawn))};
    }
    GRADSYNC_ASSIGN_OR_RETURN(CompareSetResult r,
                              store.CompareSet(home, key, *now, std::string(kWithdrawn)));
    if (r.swapped) return Withdrawal{true, std::string(kWithdrawn)};
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
  // The epoch formed, as an elastic job: the world is the count of its ranks' node keys, so a
  // caller cannot name another.
  if (!Peek(store, job, kRunKey).has_value()) {
    return absl::FailedPreconditionError(
        absl::StrCat(label, "the namespace holds no formed job (no run token)"));
  }
  if (!Peek(store, job, kElasticKey).has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(label, "the job is not elastic"));
  }
  auto ranks = store.List(job, kRankKeyPrefix);
  if (!ranks.ok())
    return absl::FailedPreconditionError(absl::StrCat(label, ranks.status().message()));
  const int world = static_cast<int>(ranks->size());
  for (int r = 0; r < world; ++r) {
    if (!Peek(store, job, RankKey(r)).has_value()) {
      return absl::FailedPreconditionError(
          absl::StrCat(label, "the epoch has not formed: rank ", r, " has no node"));
    }
  }
  if (world == 0) return absl::FailedPreconditionError(absl::StrCat(label, "no ranks"));
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
      GRADSYNC_ASSIGN_OR_RETURN(
          CompareSetResult voided,
          store.CompareSet(*home, ElasticTicketKey(t), std::nullopt, std::string(kWithdrawn)));
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
      (void)store.CompareSet(*home, ElasticTicketKey(c.ticket), std::string(kClaimed), c.record);
    }
  };
  for (Claim& w : waiting) {
    absl::StatusOr<CompareSetResult> c =
        store.CompareSet(*home, ElasticTicketKey(w.ticket), w.record, std::string(kClaimed));
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
      MembershipDecisionText(
          epoch, world + joined, {}, {}, joined,
          absl::StrCat(claimed.size(), " node(s) joining (", joined, " rank(s))")));
  if (!recorded.ok() || !recorded->swapped) {
    unclaim();  // a loss was decided first (or the store failed): they join at a later commit
    if (!recorded.ok()) return recorded.status();
    return Admission{true, std::move(recorded->value), 0};
  }
  int rank = world;
  for (const Claim& c : claimed) {
    // A joiner told nothing does not come: the epoch forms without its ranks (their deadline).
    (void)store.Set(*home, ElasticAdmitKey(c.ticket),
                    absl::StrCat("epoch=", epoch, " world=", world + joined, " rank=", rank,
                                 " min=", min_world_size));
    rank += c.ranks;
  }
  (void)store.Add(*home, kElasticHandledKey, looked);
  return Admission{true, std::move(recorded->value), joined};
}

}  // namespace gradsync::core
