// An elastic job's joins as the daemon records them (daemon/core/membership.h), on the
// embedded store: tickets, their withdrawal, and rank 0's admissions with every check.

#include "daemon/core/membership.h"

#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/store_keys.h"
#include "daemon/core/backend.h"
#include "daemon/store/memory_store.h"
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
  std::string At(const std::string& job, const std::string& key) {
    auto v = store_.Peek(job, key);
    return v.ok() ? *v : "<none>";
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
  EXPECT_TRUE(absl::StartsWith(a->decision, "epoch=1 world=7 lost_ranks= lost_nodes= joined=5 "))
      << a->decision;
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
  ASSERT_TRUE(store_.Set("j.e1", kElasticDecisionKey, "epoch=2 world=2 lost_ranks=2").ok());
  ASSERT_EQ(*TakeTicket(store_, "j", 1), 1);
  absl::StatusOr<Admission> a = AdmitJoiners(store_, "j.e1", 2, 1);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_TRUE(a->decided);
  EXPECT_EQ(a->joined, 0);
  EXPECT_EQ(a->decision, "epoch=2 world=2 lost_ranks=2");
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

}  // namespace
}  // namespace gradsync::core
