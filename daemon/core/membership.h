#pragma once

// The membership of elastic jobs, on the daemon: one place for every record of the elastic
// protocol in a job's store and for the state of an epoch.
//
// An epoch is a namespace of the job's store (ElasticJobId(base, epoch)). Its daemons form it
// (EpochMembership: forming, then formed, or unformed when its first op's deadline found ranks
// missing), decide its end when a node is lost (deciding, decided: the next epoch's
// MembershipDecision at kElasticDecisionKey, the first writer wins), and end it. Nodes join
// between epochs: a joining node takes a ticket, rank 0 of the job admits the waiting tickets at
// a commit (TakeTicket, WithdrawTicket, AdmitJoiners). The daemon checks every request and writes
// every record itself (the tickets, the decision, the admissions); clients only read the
// decision and their admission.

#include <cstdint>
#include <deque>
#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"

namespace gradsync::core {

/// An elastic epoch past 0: "formed" or "unformed", whichever its daemons set first (by
/// CompareSet) once every rank published, or once its first op's deadline passed without.
inline constexpr char kFormationKey[] = "daemon/formation";
/// Set by every daemon of an elastic job spanning nodes as it forms: a join may be decided.
inline constexpr char kElasticKey[] = "daemon/elastic";

/// The next membership of an elastic job, recorded once at the end of an epoch (in its
/// namespace, at kElasticDecisionKey) as a gradsync.v1.MembershipDecision: this is its one
/// writer and reader in the daemon; trainers read it as JSON through the C ABI
/// (gs_record_json).
struct MembershipDecision {
  int epoch = 0;                         // the next epoch
  int world = 0;                         // its world size
  std::vector<int> lost_ranks;           // ranks of this epoch not in the next
  std::vector<std::string> lost_nodes;   // their nodes, where known
  int joined = 0;                        // ranks admitted from tickets
  absl::Time at = absl::InfinitePast();  // when it was decided
  std::string why;

  std::string Encode() const;  // the record
  /// INVALID_ARGUMENT when `record` is not a decision's.
  static absl::StatusOr<MembershipDecision> Decode(absl::string_view record);
  /// For people (logs, Inspect's epochs): "epoch=E world=W lost_ranks=R,.. lost_nodes=N,..
  /// [joined=J] at=MS why=TEXT".
  std::string Describe() const;
};

/// One elastic epoch of a job spanning nodes, on this daemon: its state, and the records it
/// writes in the epoch's namespace of the job's store. Thread-safe; store calls are made
/// without its lock. Transitions (docs/architecture.md, "Membership"):
///   kForming  -> kFormed    Formed (epoch 0), or ClaimFormed won or found the epoch formed
///   kForming  -> kUnformed  ClaimFormed found, or DecideUnformed recorded, that the epoch's
///                           daemons went on without ranks missing at its first op's deadline
///   kFormed   -> kDeciding  BeginDeciding: a node lost (once; the caller decides after the
///                           losses of the moment are in)
///   kDeciding -> kDecided   Decide recorded the next membership, or found one recorded first
///   any       -> kEnded     End: the epoch's last session on this node ended
/// Any other transition is refused (the call returns false, or an error, and changes nothing).
class EpochMembership {
 public:
  enum class State { kForming, kFormed, kDeciding, kDecided, kUnformed, kEnded };
  static const char* StateName(State state);

  /// Epoch `epoch` (namespace `job`) of `world_size` ranks, in `store` (which outlives this).
  EpochMembership(gradsync::Store* store, std::string job, int epoch, int world_size);

  State state() const;
  /// The namespace's mark that the job is elastic: what lets a client ask for a join.
  absl::Status MarkElastic();
  /// Epoch 0 formed (it has no outcome to claim: a lost rank there ends the job's first try).
  bool Formed();
  /// An epoch past 0 formed here: claims that outcome, unless its daemons already went on
  /// without some ranks (UNAVAILABLE, kUnformed). A store failure counts as formed.
  absl::Status ClaimFormed();
  /// The epoch did not form by `timeout`: one outcome for every daemon. OK when it formed
  /// after all (kFormed); UNAVAILABLE naming the ranks missing once the next membership without
  /// them is recorded (kUnformed); nullopt when nothing can be decided (the store failed, or no
  /// rank or every rank published).
  std::optional<absl::Status> DecideUnformed(absl::Duration timeout);
  /// kFormed (or kForming) -> kDeciding: true for the call that made the change.
  bool BeginDeciding();
  struct Recorded {
    bool ours = false;     // this call's decision was recorded (else another's was first)
    std::string decision;  // the record now
  };
  /// kDeciding -> kDecided: records `decision` unless another was recorded first. A store
  /// failure leaves the state as it was.
  absl::StatusOr<Recorded> Decide(const MembershipDecision& decision);
  /// The decision that ended the previous epoch (waits up to `wait` for it); nullopt for epoch
  /// 0, or when it cannot be read.
  std::optional<MembershipDecision> PreviousDecision(absl::Duration wait) const;
  /// -> kEnded.
  void End();

  /// Retention: whether namespace `job` holds a decision (so it is kept after its job ended
  /// here, for survivors that have not read it); NOT_FOUND when the namespace is gone.
  static absl::StatusOr<bool> HasDecision(gradsync::Store& store, absl::string_view job);
  /// Deletes the decision of namespace `job` (its next epoch ended, or the job was abandoned).
  static void DropDecision(gradsync::Store& store, absl::string_view job);

 private:
  // Moves to `to` when the state is one of `from`; false otherwise.
  bool Advance(std::initializer_list<State> from, State to);

  gradsync::Store* const store_;
  const std::string job_;
  const int epoch_;
  const int world_size_;
  mutable absl::Mutex mu_;
  State state_ ABSL_GUARDED_BY(mu_) = State::kForming;
};

/// An elastic job's membership formed on this node (Inspect's ListEpochs).
struct EpochRecord {
  std::string job;  // the job's own id
  int epoch = 0;
  int world_size = 0;
  std::string change;  // the decision that made it, in words; empty for epoch 0
  absl::Time formed;
  absl::Duration took;  // from the decision's time to `formed`; zero when unknown
};

/// The epochs formed on this node, the last kMaxRecords of all jobs. Thread-safe.
class EpochHistory {
 public:
  static constexpr size_t kMaxRecords = 256;
  /// Epoch `epoch` of job `base`, of `world_size` ranks, formed at `formed`; `change` the
  /// decision that made it (nullopt: epoch 0, or unread), shown to operators: its words are
  /// bounded and made printable here.
  void Add(std::string base, int epoch, int world_size, absl::Time formed,
           const std::optional<MembershipDecision>& change);
  /// The epochs of job `job` (empty: of every job), oldest first.
  std::vector<EpochRecord> Of(const std::string& job) const;

 private:
  mutable absl::Mutex mu_;
  std::deque<EpochRecord> records_ ABSL_GUARDED_BY(mu_);
};

/// Retention of an elastic job's namespaces (one per epoch; epoch 0's is the job's home, which
/// holds its joiners' tickets). A namespace whose job ended on a node stays while it holds a
/// decision of the next membership (RetainsNamespace), for survivors that have not read it;
/// the next epoch's end releases it (ReleasedAtEnd), or, once no op could still wait for it,
/// the job's abandonment (ReleasedWhenAbandoned); the home goes with the job's last epoch.
struct EpochEnd {
  std::string base;  // the job's id (epoch 0's); empty: not elastic, or not spanning nodes
  int epoch = 0;
  bool held_rank0 = false;  // this node held rank 0 in it
};
/// Whether the namespace `job`, whose job ended here, is kept: it holds a decision.
bool RetainsNamespace(gradsync::Store& store, absl::string_view job);
/// The namespaces released when epoch `end` ended here, besides its own: the previous epoch's
/// (no decision left to keep it; never the home), and the home when `end` was the job's last.
/// `decided`: HasDecision of its namespace, read before its end (NOT_FOUND: gone, so no
/// decision; another failure keeps the home).
std::vector<std::string> ReleasedAtEnd(const EpochEnd& end, const absl::StatusOr<bool>& decided);
/// The namespaces released once no op could still wait for ended epoch `end`'s decision: its
/// own (not the home), and the home when this node held rank 0 and no epoch of the job (nor of
/// a new run of its id) runs here (`runs`).
std::vector<std::string> ReleasedWhenAbandoned(const EpochEnd& end, bool runs);

/// Most ranks one node brings, most ranks one decision admits, the largest world it may make,
/// most tickets taken and not handled, most tickets one admission looks at.
inline constexpr int kMaxJoinRanks = 1024;
inline constexpr int kMaxJoinedPerDecision = 1024;
inline constexpr int kMaxElasticWorld = 1 << 16;
inline constexpr int64_t kMaxOutstandingTickets = 1024;
inline constexpr int kMaxTicketsPerAdmission = 64;

/// Takes a ticket for a node of `ranks` ranks joining the elastic job whose home (epoch 0's
/// namespace) is `home`: the ticket's number, its record written. INVALID_ARGUMENT for ranks
/// outside 1..kMaxJoinRanks; RESOURCE_EXHAUSTED when kMaxOutstandingTickets are waiting.
absl::StatusOr<int64_t> TakeTicket(gradsync::Store& store, absl::string_view home, int ranks);

struct Withdrawal {
  bool withdrawn = false;  // this call withdrew it
  std::string state;       // the ticket's record now: "withdrawn", "claimed", "ranks=K"...
};
/// Withdraws ticket `ticket` of `home` unless an admission claimed it (then `state` says so).
absl::StatusOr<Withdrawal> WithdrawTicket(gradsync::Store& store, absl::string_view home,
                                          int64_t ticket);

struct Admission {
  bool decided = false;  // the epoch has a decision now (this one, or a loss recorded first)
  std::string decision;  // the record at the decision key, when decided
  int joined = 0;        // ranks this call admitted
};
/// Admits the nodes waiting for the elastic job whose current epoch is namespace `job`, in
/// ticket order, while the world stays within kMaxElasticWorld and the ranks admitted within
/// kMaxJoinedPerDecision: claims their tickets, records the decision that epoch `epoch` (the
/// namespace's plus one) has them, and tells each its place ("epoch=E world=W rank=R min=M" at
/// its admission key); none when the nodes waiting bring fewer than `min_joined` ranks (a job
/// below its min_world_size admits only enough). The newest ticket not written yet ends the
/// look; an older one is voided (its writer failed, or takes another). A decision recorded
/// first (a loss) wins, and the claims are undone, as they are when the store fails midway.
/// Checks first that `job` is epoch `epoch - 1` of an elastic job that formed, and that
/// `min_world_size` and `min_joined` are within bounds; FAILED_PRECONDITION / INVALID_ARGUMENT
/// naming the check. One call at a time on a daemon (rank 0 makes them, at its commits).
absl::StatusOr<Admission> AdmitJoiners(gradsync::Store& store, absl::string_view job, int epoch,
                                       int min_world_size, int min_joined = 1);

}  // namespace gradsync::core
