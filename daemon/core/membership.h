#pragma once

// An elastic job's joins, as its clients ask the daemons for them: a joining node takes a
// ticket, rank 0 of the job admits the waiting tickets at a commit. The daemon checks every
// request and writes every record itself (the tickets, the membership decision, the
// admissions); clients only read the decision and their admission.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/store.h"

namespace gradsync::core {

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
