// An elastic job's membership as the daemon records it (daemon/core/membership.h), on the
// embedded store: tickets, their withdrawal, and rank 0's admissions with every check; the
// decision's record; an epoch's states, one test per transition.

#include "daemon/core/membership.h"

#include <optional>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/store_keys.h"
#include "common/worker_pool.h"
#include "daemon/core/backend.h"
#include "daemon/core/node_join.h"
#include "daemon/store/memory_store.h"
#include "gradsync/v1/membership.pb.h"
#include "gtest/gtest.h"

namespace gradsync::core {
namespace {

class MembershipTest : public ::testing::Test {
 protected:
  // Epoch `epoch` of elastic job "j" formed with `world` ranks, as its daemons leave it.
  void Formed(int epoch, int world, bool elastic = true) {
    const std::string job = Epoch(epoch);
    ASSERT_TRUE(store_.Set(job, kRunKey, "0123456789abcdef").ok());
    if (elastic) {
      ASSERT_TRUE(store_.Set(job, kElasticKey, "1").ok());
    }
    for (int r = 0; r < world; ++r) ASSERT_TRUE(store_.Set(job, RankKey(r), "h:1").ok());
  }
  static std::string Epoch(int epoch) { return epoch == 0 ? "j" : absl::StrCat("j.e", epoch); }
  // The record at `key`; a ticket's or an admission's in words ("ranks=K", "claimed",
  // "withdrawn"; "epoch=E world=W rank=R min=M").
  std::string At(const std::string& job, const std::string& key) {
    auto v = store_.Peek(job, key);
    if (!v.ok()) return "<none>";
    if (absl::StrContains(key, "/ticket/")) {
      v1::JoinTicket t;
      if (!t.ParseFromString(*v)) return "<unreadable>";
      switch (t.state()) {
        case v1::JoinTicket::WAITING:
          return absl::StrCat("ranks=", t.ranks());
        case v1::JoinTicket::CLAIMED:
          return "claimed";
        case v1::JoinTicket::WITHDRAWN:
          return "withdrawn";
        default:
          return "<unreadable>";
      }
    }
    if (absl::StrContains(key, "/admit/")) {
      v1::JoinAdmission a;
      if (!a.ParseFromString(*v)) return "<unreadable>";
      return absl::StrCat("epoch=", a.epoch(), " world=", a.world(), " rank=", a.rank(),
                          " min=", a.min_world_size());
    }
    return *v;
  }

  store::MemoryStore store_;
};

TEST_F(MembershipTest, TicketsAreNumberedInOrderAndBoundedInRanksAndInNumber) {
  EXPECT_EQ(*TakeTicket(store_, "j", 2), 1);
  EXPECT_EQ(*TakeTicket(store_, "j", 1), 2);
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "ranks=2");
  EXPECT_EQ(TakeTicket(store_, "j", 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TakeTicket(store_, "j", kMaxJoinRanks + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  for (int i = 2; i < kMaxOutstandingTickets; ++i) ASSERT_TRUE(TakeTicket(store_, "j", 1).ok());
  const absl::Status full = TakeTicket(store_, "j", 1).status();
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted) << full;
  EXPECT_EQ(At("j", std::string(kElasticTicketsKey)), absl::StrCat(kMaxOutstandingTickets));
}

TEST_F(MembershipTest, AnAdmissionClaimsTheWaitingTicketsRecordsTheDecisionAndEachPlace) {
  Formed(0, 2);
  ASSERT_EQ(*TakeTicket(store_, "j", 2), 1);
  ASSERT_EQ(*TakeTicket(store_, "j", 1), 2);
  ASSERT_EQ(*TakeTicket(store_, "j", 3), 3);
  ASSERT_TRUE(WithdrawTicket(store_, "j", 2)->withdrawn);
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j", 1, 4);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->decided);
  EXPECT_EQ(a->joined, 5);
  absl::StatusOr<MembershipDecision> d = MembershipDecision::Decode(a->decision);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_TRUE(absl::StartsWith(d->Describe(), "epoch=1 world=7 lost_ranks= lost_nodes= joined=5 "))
      << d->Describe();
  EXPECT_EQ(At("j", std::string(kElasticDecisionKey)), a->decision);  // epoch 0's namespace
  EXPECT_EQ(At(Epoch(0), ElasticAdmitKey(1)), "epoch=1 world=7 rank=2 min=4");
  EXPECT_EQ(At(Epoch(0), ElasticAdmitKey(3)), "epoch=1 world=7 rank=4 min=4");
  EXPECT_EQ(At(Epoch(0), ElasticAdmitKey(2)), "<none>");
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "claimed");
  EXPECT_EQ(At("j", std::string(kElasticHandledKey)), "3");
  // A claimed ticket is no longer withdrawn: its node is being admitted.
  absl::StatusOr<Withdrawal> w = WithdrawTicket(store_, "j", 1);
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(w->withdrawn);
  EXPECT_EQ(w->state, "claimed");
}

TEST_F(MembershipTest, OneDecisionAdmitsAtMostItsRanksAndTheRestWait) {
  Formed(0, 1);
  ASSERT_EQ(*TakeTicket(store_, "j", kMaxJoinRanks), 1);
  ASSERT_EQ(*TakeTicket(store_, "j", kMaxJoinRanks), 2);  // the second does not fit
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j", 1, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->joined, kMaxJoinedPerDecision);
  EXPECT_EQ(At("j", ElasticTicketKey(2)), absl::StrCat("ranks=", kMaxJoinRanks));
  EXPECT_EQ(At("j", std::string(kElasticHandledKey)), "1");
}

TEST_F(MembershipTest, TooFewRanksWaitingOrATicketNotWrittenYetAdmitNobody) {
  Formed(0, 2);
  ASSERT_EQ(*TakeTicket(store_, "j", 1), 1);
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j", 1, 4, /*min_joined=*/2);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->decided);
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "ranks=1");  // still waiting, not claimed
  // A counter ahead of its tickets (taken, not written): the look ends there.
  ASSERT_TRUE(store_.Delete("j", ElasticTicketKey(1)).ok());
  ASSERT_TRUE(store_.Add("j", kElasticTicketsKey, 5).ok());
  a = AdmitJoiners(store_, "j", 1, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->decided);
  EXPECT_EQ(At("j", std::string(kElasticDecisionKey)), "<none>");
  // Those older than the newest were voided, so they hold up no later admission; the newest
  // (being written, as far as anyone knows) ends the look.
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "withdrawn");
  EXPECT_EQ(At("j", ElasticTicketKey(5)), "withdrawn");
  EXPECT_EQ(At("j", ElasticTicketKey(6)), "<none>");
  EXPECT_EQ(At("j", std::string(kElasticHandledKey)), "5");
  // Its writer comes late: the number is its own still; one voided is taken again.
  ASSERT_TRUE(store_.CompareSet("j", ElasticTicketKey(6), std::nullopt, "ranks=1").ok());
  EXPECT_EQ(*TakeTicket(store_, "j", 1), 7);
}

TEST_F(MembershipTest, ALossDecidedFirstWinsAndTheClaimsAreUndone) {
  Formed(1, 3);
  const std::string loss =
      MembershipDecision{2, 2, {2}, {"c:7451"}, 0, absl::Now(), "node c:7451 lost"}.Encode();
  ASSERT_TRUE(store_.Set("j.e1", kElasticDecisionKey, loss).ok());
  ASSERT_EQ(*TakeTicket(store_, "j", 1), 1);
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j.e1", 2, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->decided);
  EXPECT_EQ(a->joined, 0);
  EXPECT_EQ(a->decision, loss);
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "ranks=1");  // waits for a later commit
}

TEST_F(MembershipTest, AnAdmissionIsRefusedForAJobNotElasticNotFormedOrAnotherEpoch) {
  ASSERT_EQ(*TakeTicket(store_, "j", 1), 1);
  EXPECT_EQ(AdmitJoiners(store_, "j", 1, 1).status().code(),
            absl::StatusCode::kFailedPrecondition);  // nothing formed
  Formed(0, 2, /*elastic=*/false);
  absl::Status s = AdmitJoiners(store_, "j", 1, 1).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(s.message(), "not elastic")) << s;
  ASSERT_TRUE(store_.Set("j", kElasticKey, "1").ok());
  EXPECT_EQ(AdmitJoiners(store_, "j", 2, 1).status().code(),
            absl::StatusCode::kInvalidArgument);  // "j" is epoch 0, not 1
  EXPECT_EQ(AdmitJoiners(store_, "j", 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdmitJoiners(store_, "j", 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdmitJoiners(store_, "j", 1, 1, kMaxJoinedPerDecision + 1).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "ranks=1");  // nothing changed
  EXPECT_EQ(At("j", std::string(kElasticDecisionKey)), "<none>");
}

// ---- An epoch's states (EpochMembership), one test per transition -----------------------------

using State = EpochMembership::State;

TEST(MembershipDecisionTest, ItsRecordDecodesToEveryFieldAndReadsInWordsForPeople) {
  MembershipDecision d{3,
                       5,
                       {1, 4},
                       {"a:7451", "b:7451"},
                       2,
                       absl::FromUnixMillis(1234567),
                       "node a:7451 (ranks 1,4) lost: no word for 1.5 s"};
  absl::StatusOr<MembershipDecision> back = MembershipDecision::Decode(d.Encode());
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->epoch, 3);
  EXPECT_EQ(back->world, 5);
  EXPECT_EQ(back->lost_ranks, (std::vector<int>{1, 4}));
  EXPECT_EQ(back->lost_nodes, (std::vector<std::string>{"a:7451", "b:7451"}));
  EXPECT_EQ(back->joined, 2);
  EXPECT_EQ(back->at, absl::FromUnixMillis(1234567));
  EXPECT_EQ(back->why, d.why);
  EXPECT_EQ(back->Describe(),
            "epoch=3 world=5 lost_ranks=1,4 lost_nodes=a:7451,b:7451 joined=2 at=1234567 "
            "why=node a:7451 (ranks 1,4) lost: no word for 1.5 s");
  // Not a decision: empty (epoch 0), words, bytes that are no message.
  for (const std::string& bad :
       {std::string(), std::string("epoch=1 world=2 at=1 why="), std::string("\xff\xff\xff", 3)}) {
    EXPECT_EQ(MembershipDecision::Decode(bad).status().code(), absl::StatusCode::kInvalidArgument)
        << absl::CEscape(bad);
  }
}

TEST_F(MembershipTest, EpochZeroFormsWithoutAClaimAndMarksItselfElastic) {
  EpochMembership m(&store_, "j", 0, 2);
  EXPECT_EQ(m.state(), State::kForming);
  ASSERT_TRUE(m.MarkElastic().ok());
  EXPECT_EQ(At("j", kElasticKey), "1");
  EXPECT_TRUE(m.Formed());
  EXPECT_EQ(m.state(), State::kFormed);
  EXPECT_FALSE(m.Formed());  // once
  EXPECT_EQ(At("j", kFormationKey), "<none>");
}

TEST_F(MembershipTest, ALaterEpochClaimsFormedAndTheClaimIsTheOutcomeForEveryDaemon) {
  EpochMembership first(&store_, "j.e1", 1, 2), second(&store_, "j.e1", 1, 2);
  ASSERT_TRUE(first.ClaimFormed().ok());
  EXPECT_EQ(first.state(), State::kFormed);
  EXPECT_EQ(At("j.e1", kFormationKey), "formed");
  ASSERT_TRUE(second.ClaimFormed().ok());  // another daemon finds it formed
  EXPECT_EQ(second.state(), State::kFormed);
  // A daemon whose first op's deadline passed meanwhile finds it formed too: nothing fails.
  EpochMembership late(&store_, "j.e1", 1, 2);
  std::optional<absl::Status> decided = late.DecideUnformed(absl::Seconds(1));
  ASSERT_TRUE(decided.has_value());
  EXPECT_TRUE(decided->ok()) << *decided;
  EXPECT_EQ(late.state(), State::kFormed);
}

TEST_F(MembershipTest, AnEpochMissingRanksAtItsDeadlineIsUnformedAndDecidedWithoutThem) {
  ASSERT_TRUE(store_.Set("j.e1", RankKey(0), "h:1").ok());
  ASSERT_TRUE(store_.Set("j.e1", RankKey(2), "h:2").ok());
  EpochMembership m(&store_, "j.e1", 1, 3);
  std::optional<absl::Status> decided = m.DecideUnformed(absl::Seconds(30));
  ASSERT_TRUE(decided.has_value());
  EXPECT_EQ(decided->code(), absl::StatusCode::kUnavailable) << *decided;
  EXPECT_TRUE(absl::StrContains(decided->message(), "rank(s) 1 did not join epoch 1")) << *decided;
  EXPECT_EQ(m.state(), State::kUnformed);
  EXPECT_EQ(At("j.e1", kFormationKey), "unformed");
  absl::StatusOr<MembershipDecision> d =
      MembershipDecision::Decode(At("j.e1", std::string(kElasticDecisionKey)));
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->epoch, 2);
  EXPECT_EQ(d->world, 2);
  EXPECT_EQ(d->lost_ranks, std::vector<int>{1});
  // The daemon of rank 1 publishes late: its claim finds the epoch unformed.
  EpochMembership late(&store_, "j.e1", 1, 3);
  const absl::Status claim = late.ClaimFormed();
  EXPECT_EQ(claim.code(), absl::StatusCode::kUnavailable) << claim;
  EXPECT_EQ(late.state(), State::kUnformed);
}

TEST_F(MembershipTest, NothingIsDecidedForAnEpochNoRankOrEveryRankPublished) {
  EpochMembership none(&store_, "j.e1", 1, 2);
  EXPECT_FALSE(none.DecideUnformed(absl::Seconds(1)).has_value());
  EXPECT_EQ(none.state(), State::kForming);
  EXPECT_EQ(At("j.e1", std::string(kElasticDecisionKey)), "<none>");
}

TEST_F(MembershipTest, ALossMakesAFormedEpochDecideOnceAndTheFirstDecisionStands) {
  EpochMembership here(&store_, "j", 0, 3), there(&store_, "j", 0, 3);
  ASSERT_TRUE(here.Formed() && there.Formed());
  EXPECT_TRUE(here.BeginDeciding());
  EXPECT_FALSE(here.BeginDeciding());  // the decision on its way takes later losses too
  EXPECT_EQ(here.state(), State::kDeciding);
  absl::StatusOr<EpochMembership::Recorded> ours =
      here.Decide({1, 2, {2}, {"c:7451"}, 0, absl::Now(), "node c:7451 lost"});
  ASSERT_TRUE(ours.ok()) << ours.status();
  EXPECT_TRUE(ours->ours);
  EXPECT_EQ(here.state(), State::kDecided);
  ASSERT_TRUE(there.BeginDeciding());
  absl::StatusOr<EpochMembership::Recorded> theirs =
      there.Decide({1, 1, {1, 2}, {"b:7451", "c:7451"}, 0, absl::Now(), "two lost"});
  ASSERT_TRUE(theirs.ok()) << theirs.status();
  EXPECT_FALSE(theirs->ours);
  EXPECT_EQ(theirs->decision, ours->decision);
  EXPECT_EQ(there.state(), State::kDecided);
  EXPECT_EQ(At("j", std::string(kElasticDecisionKey)), ours->decision);
}

TEST_F(MembershipTest, TransitionsOutOfOrderAreRefusedAndChangeNothing) {
  EpochMembership m(&store_, "j", 0, 2);
  // No decision before a loss made the epoch decide.
  EXPECT_EQ(m.Decide({1, 1, {1}, {}, 0, absl::Now(), "x"}).status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(At("j", std::string(kElasticDecisionKey)), "<none>");
  EXPECT_EQ(m.state(), State::kForming);
  // An unformed epoch does not form, nor decide again.
  ASSERT_TRUE(store_.Set("j.e1", RankKey(0), "h:1").ok());
  EpochMembership unformed(&store_, "j.e1", 1, 2);
  ASSERT_TRUE(unformed.DecideUnformed(absl::Seconds(1)).has_value());
  ASSERT_EQ(unformed.state(), State::kUnformed);
  EXPECT_FALSE(unformed.Formed());
  EXPECT_FALSE(unformed.BeginDeciding());
  EXPECT_EQ(unformed.state(), State::kUnformed);
}

TEST_F(MembershipTest, AnEndedEpochStaysEndedAndItsDecisionKeepsItsNamespaceUntilDropped) {
  EpochMembership m(&store_, "j", 0, 2);
  ASSERT_TRUE(m.Formed() && m.BeginDeciding());
  ASSERT_TRUE(m.Decide({1, 1, {1}, {"b:7451"}, 0, absl::Now(), "lost"}).ok());
  m.End();
  EXPECT_EQ(m.state(), State::kEnded);
  EXPECT_FALSE(m.BeginDeciding());
  EXPECT_FALSE(m.Formed());
  EXPECT_EQ(m.state(), State::kEnded);
  EXPECT_EQ(*EpochMembership::HasDecision(store_, "j"), true);
  EpochMembership::DropDecision(store_, "j");
  EXPECT_EQ(EpochMembership::HasDecision(store_, "j").value_or(false), false);
  // The previous epoch's decision, as the next epoch's record shows it.
  const MembershipDecision previous{1, 1, {1}, {}, 0, absl::FromUnixMillis(5), "w"};
  ASSERT_TRUE(store_.Set("j", std::string(kElasticDecisionKey), previous.Encode()).ok());
  EpochMembership next(&store_, "j.e1", 1, 1);
  std::optional<MembershipDecision> got = next.PreviousDecision(absl::Milliseconds(100));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->Describe(), previous.Describe());
  EXPECT_FALSE(m.PreviousDecision(absl::Milliseconds(100)).has_value());  // epoch 0 has none
}

TEST_F(MembershipTest, ANamespaceIsKeptWhileItHoldsADecision) {
  Formed(1, 2);
  EXPECT_FALSE(RetainsNamespace(store_, "j.e1"));
  MembershipDecision next;
  next.epoch = 2;
  next.world = 1;
  ASSERT_TRUE(store_.Set("j.e1", kElasticDecisionKey, next.Encode()).ok());
  EXPECT_TRUE(RetainsNamespace(store_, "j.e1"));
  EpochMembership::DropDecision(store_, "j.e1");
  EXPECT_FALSE(RetainsNamespace(store_, "j.e1"));
  EXPECT_FALSE(RetainsNamespace(store_, "no-such-job"));
}

TEST(RetentionTest, AnEpochsEndReleasesThePreviousOneAndTheHomeWithTheLast) {
  using V = std::vector<std::string>;
  const absl::StatusOr<bool> decided = true, last = false;
  const absl::StatusOr<bool> gone = absl::NotFoundError("no keys");
  const absl::StatusOr<bool> failed = absl::UnavailableError("store down");
  EXPECT_EQ(ReleasedAtEnd({"", 3, true}, last), V{});  // not elastic
  EXPECT_EQ(ReleasedAtEnd({"j", 0, true}, decided), V{});
  EXPECT_EQ(ReleasedAtEnd({"j", 0, true}, last), V{});  // epoch 0's is the home itself
  EXPECT_EQ(ReleasedAtEnd({"j", 1, false}, decided), V{});
  EXPECT_EQ(ReleasedAtEnd({"j", 1, false}, last), V{"j"});
  EXPECT_EQ(ReleasedAtEnd({"j", 3, false}, decided), V{"j.e2"});
  EXPECT_EQ(ReleasedAtEnd({"j", 3, false}, last), (V{"j.e2", "j"}));
  EXPECT_EQ(ReleasedAtEnd({"j", 3, false}, gone), (V{"j.e2", "j"}));
  EXPECT_EQ(ReleasedAtEnd({"j", 3, false}, failed), V{"j.e2"});  // unknown: the home stays
}

TEST(RetentionTest, AnAbandonedEpochReleasesItselfAndTheHomeWhereRankZeroWasAndNothingRuns) {
  using V = std::vector<std::string>;
  EXPECT_EQ(ReleasedWhenAbandoned({"", 2, true}, false), V{});
  EXPECT_EQ(ReleasedWhenAbandoned({"j", 2, false}, false), V{"j.e2"});
  EXPECT_EQ(ReleasedWhenAbandoned({"j", 2, true}, false), (V{"j.e2", "j"}));
  EXPECT_EQ(ReleasedWhenAbandoned({"j", 2, true}, true), V{"j.e2"});
  EXPECT_EQ(ReleasedWhenAbandoned({"j", 0, true}, false), V{"j"});
  EXPECT_EQ(ReleasedWhenAbandoned({"j", 0, true}, true), V{});
}

TEST(EpochHistoryTest, KeepsTheLastRecordsWithTheChangeInPrintableWords) {
  EpochHistory history;
  const absl::Time t0 = absl::FromUnixSeconds(1000);
  history.Add("a", 0, 3, t0, std::nullopt);
  MembershipDecision change{1, 2, {2}, {"h:1"}, 0, t0, "node h:1 lost\x01"};
  history.Add("a", 1, 2, t0 + absl::Seconds(2), change);
  history.Add("b", 0, 4, t0, std::nullopt);
  std::vector<EpochRecord> a = history.Of("a");
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a[0].change, "");
  EXPECT_EQ(a[0].took, absl::ZeroDuration());
  EXPECT_EQ(a[1].epoch, 1);
  EXPECT_EQ(a[1].world_size, 2);
  EXPECT_EQ(a[1].took, absl::Seconds(2));
  EXPECT_TRUE(absl::StrContains(a[1].change, "lost_ranks=2")) << a[1].change;
  EXPECT_TRUE(absl::EndsWith(a[1].change, "lost?")) << a[1].change;
  EXPECT_EQ(history.Of("").size(), 3u);
  for (size_t i = 0; i < EpochHistory::kMaxRecords; ++i) history.Add("c", 0, 1, t0, std::nullopt);
  EXPECT_EQ(history.Of("").size(), EpochHistory::kMaxRecords);
  EXPECT_TRUE(history.Of("a").empty());  // the oldest went
}

// A joining node's wait (node_join.h): its daemon takes the ticket, is told its place, or
// withdraws the ticket when the wait ends without one. With a pool (an etcd store's call
// threads) and without (the embedded store: the steps run inline, on the caller's thread and
// the store's).
class NodeJoinTest : public MembershipTest, public ::testing::WithParamInterface<bool> {
 protected:
  // Starts a join of `ranks` ranks waiting until now + `wait`.
  std::shared_ptr<NodeJoin> Start(int ranks, absl::Duration wait) {
    return NodeJoin::Start(&store_, GetParam() ? &pool_ : nullptr, "j", ranks, absl::Now() + wait,
                           [this](absl::StatusOr<NodeJoin::Admitted> result) {
                             absl::MutexLock lock(&mu_);
                             ASSERT_FALSE(result_.has_value()) << "answered twice";
                             result_ = std::move(result);
                           });
  }
  // The join's answer (within 30 s).
  absl::StatusOr<NodeJoin::Admitted> Answer() {
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(
                                  +[](std::optional<absl::StatusOr<NodeJoin::Admitted>>* r) {
                                    return r->has_value();
                                  },
                                  &result_),
                              absl::Seconds(30))) {
      return absl::DeadlineExceededError("the test's own wait: no answer in 30 s");
    }
    return *result_;
  }
  // Waits (up to 10 s) for ticket `ticket`'s record to read `want`.
  bool TicketReads(int64_t ticket, const std::string& want) {
    for (int i = 0; i < 1000; ++i) {
      if (At("j", ElasticTicketKey(ticket)) == want) return true;
      absl::SleepFor(absl::Milliseconds(10));
    }
    return false;
  }

  WorkerPool pool_{2};
  absl::Mutex mu_;
  std::optional<absl::StatusOr<NodeJoin::Admitted>> result_ ABSL_GUARDED_BY(mu_);
};

TEST_P(NodeJoinTest, ANodeIsToldItsPlaceOnceTheJobAdmitsIt) {
  Formed(0, 3);
  auto join = Start(2, absl::Seconds(20));
  ASSERT_TRUE(TicketReads(1, "ranks=2"));
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j", 1, 4);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_EQ(a->joined, 2);
  absl::StatusOr<NodeJoin::Admitted> admitted = Answer();
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_EQ(admitted->ticket, 1);
  v1::JoinAdmission place;
  ASSERT_TRUE(place.ParseFromString(admitted->admission));
  EXPECT_EQ(place.epoch(), 1);
  EXPECT_EQ(place.world(), 5);
  EXPECT_EQ(place.rank(), 3);
  EXPECT_EQ(place.min_world_size(), 4);
  join->Cancel();  // answered: nothing changes
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "claimed");
}

TEST_P(NodeJoinTest, ANodeNotAdmittedInTimeHasItsTicketWithdrawn) {
  Formed(0, 1);
  auto join = Start(1, absl::Milliseconds(300));
  absl::StatusOr<NodeJoin::Admitted> answer = Answer();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kDeadlineExceeded) << answer.status();
  EXPECT_TRUE(absl::StrContains(answer.status().message(), "ticket 1 is withdrawn"))
      << answer.status();
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "withdrawn");
  // A later admission finds nobody waiting.
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j", 1, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->decided);
}

TEST_P(NodeJoinTest, ACallerThatGoesAwayHasItsTicketWithdrawn) {
  Formed(0, 1);
  auto join = Start(1, absl::Seconds(20));
  ASSERT_TRUE(TicketReads(1, "ranks=1"));
  join->Cancel();
  absl::StatusOr<NodeJoin::Admitted> answer = Answer();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kCancelled) << answer.status();
  EXPECT_EQ(At("j", ElasticTicketKey(1)), "withdrawn");
}

TEST_P(NodeJoinTest, ACancelBeforeTheTicketIsTakenStillLeavesNoneWaiting) {
  Formed(0, 1);
  auto join = Start(1, absl::Seconds(20));
  join->Cancel();  // the ticket is taken on the pool: before, during or after this
  absl::StatusOr<NodeJoin::Admitted> answer = Answer();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kCancelled) << answer.status();
  const std::string ticket = At("j", ElasticTicketKey(1));
  EXPECT_TRUE(ticket == "withdrawn" || ticket == "<none>") << ticket;
}

TEST_P(NodeJoinTest, AnAdmissionUnderWayAtTheDeadlineIsWaitedFor) {
  Formed(0, 1);
  auto join = Start(1, absl::Milliseconds(300));
  ASSERT_TRUE(TicketReads(1, "ranks=1"));
  // An admission claims the ticket, and writes the place only after the join's deadline.
  v1::JoinTicket waiting, claimed;
  waiting.set_state(v1::JoinTicket::WAITING);
  waiting.set_ranks(1);
  claimed.set_state(v1::JoinTicket::CLAIMED);
  ASSERT_TRUE(store_
                  .CompareSet("j", ElasticTicketKey(1), waiting.SerializeAsString(),
                              claimed.SerializeAsString())
                  ->swapped);
  absl::SleepFor(absl::Milliseconds(600));
  v1::JoinAdmission place;
  place.set_epoch(1);
  place.set_world(2);
  place.set_rank(1);
  place.set_min_world_size(1);
  ASSERT_TRUE(store_.Set("j", ElasticAdmitKey(1), place.SerializeAsString()).ok());
  absl::StatusOr<NodeJoin::Admitted> admitted = Answer();
  ASSERT_TRUE(admitted.ok()) << admitted.status();
  EXPECT_EQ(admitted->admission, place.SerializeAsString());
}

TEST_P(NodeJoinTest, BadRanksAreRefusedAndTakeNoTicket) {
  Formed(0, 1);
  auto join = Start(kMaxJoinRanks + 1, absl::Seconds(5));
  absl::StatusOr<NodeJoin::Admitted> answer = Answer();
  EXPECT_EQ(answer.status().code(), absl::StatusCode::kInvalidArgument) << answer.status();
  EXPECT_EQ(At("j", std::string(kElasticTicketsKey)), "<none>");
}

INSTANTIATE_TEST_SUITE_P(PoolOrInline, NodeJoinTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& p) {
                           return p.param ? "Pool" : "Inline";
                         });

}  // namespace
}  // namespace gradsync::core
