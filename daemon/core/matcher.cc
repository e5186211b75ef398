// The op matcher of one group (see matcher.h).
#include "daemon/core/matcher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/bounded_text.h"
#include "daemon/core/engine.h"
#include "daemon/core/inspect.h"

namespace gradsync::core::internal {
namespace {

// An op that failed on this node before it could run, as the other nodes of its group must
// hear of it (the local members are told directly).
Ready FailedOp(const Group& group, uint64_t seq, const Fingerprint& fp, absl::Time deadline,
               const absl::Status& status, Plane plane) {
  Ready r;
  r.seq = seq;
  r.op = MakeCollective(group, seq, fp, deadline, plane);
  r.op.local_failure = status;
  r.record = false;
  return r;
}

// If op `seq` of the group failed before this member came, uses up the member's part of the
// verdict and returns it.
std::optional<absl::Status> TakeVerdict(Group& group, uint64_t seq)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu) {
  auto it = group.verdicts.find(seq);
  if (it == group.verdicts.end()) return std::nullopt;
  absl::Status status = it->second.status;
  if (--it->second.untold == 0) group.verdicts.erase(it);
  return status;
}

// A member left the group: this node refuses the group's ops. A group spanning nodes also sends
// the refusal through the op's exchange, since the other nodes may not know yet: the op takes its
// sequence number so every node's count stays aligned, and the first local member's submission
// speaks for the node.
Arrived Refuse(Group& group, uint64_t& next_seq, const Arrival& a)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu) {
  Arrived out;
  out.outcome = Arrived::Outcome::kAnswered;
  out.status = absl::UnavailableError(
      absl::StrCat(OpLabel(a.fp.kind, group.job->id, group.key), ": ", group.broken));
  if (!group.spans_nodes) return out;
  out.seq = next_seq++;
  if (std::optional<absl::Status> verdict = TakeVerdict(group, out.seq)) {
    out.status = *std::move(verdict);
    return out;
  }
  int others = -1;  // attached local members besides this one
  for (int gr : group.local_group_ranks) others += group.job->ranks[group.members[gr]] != nullptr;
  if (others > 0) group.verdicts[out.seq] = Verdict{out.status, others};
  out.for_other_nodes =
      FailedOp(group, out.seq, a.fp, a.deadline, out.status, a.plane.value_or(group.last_plane));
  return out;
}

}  // namespace

Collective MakeCollective(const Group& group, uint64_t seq, const Fingerprint& fp,
                          absl::Time deadline, Plane plane) {
  Collective c;
  c.kind = fp.kind;
  c.reduce_op = fp.reduce_op;
  c.dtype = fp.dtype;
  c.count = fp.count;
  c.root = fp.root;
  c.group_size = static_cast<int>(group.members.size());
  c.seq = seq;
  c.deadline = deadline;
  c.label = OpLabel(fp.kind, group.job->id, group.key, seq);
  c.fingerprint = absl::StrCat(fp.Describe(), " seq=", seq);
  c.plane = plane;
  return c;
}

Arrived Arrive(Group& group, uint64_t& next_seq, Arrival a) {
  if (!group.broken.empty()) return Refuse(group, next_seq, a);
  Arrived out;
  const uint64_t seq = out.seq = next_seq++;
  if (std::optional<absl::Status> verdict = TakeVerdict(group, seq)) {
    out.outcome = Arrived::Outcome::kAnswered;
    out.status = *std::move(verdict);
    return out;
  }
  const int local = static_cast<int>(group.local_group_ranks.size());
  Pending& p = group.pending[seq];
  if (p.arrived == 0) {
    p.fp = a.fp;
    p.first_rank = a.session->rank;
    p.arrivals.resize(local);
    p.queued = a.deadline - a.timeout;  // when Resolve took it
    p.plane = a.plane.value_or(Plane::kHost);
    p.bytes = a.bytes;
  }
  if (!(p.fp == a.fp)) {
    out.outcome = Arrived::Outcome::kDesync;
    out.status = absl::FailedPreconditionError(
        absl::StrCat("desync in job=", group.job->id, " group=", group.key, " seq=", seq, ": rank ",
                     p.first_rank, " submitted ", p.fp.Describe(), " but rank ", a.session->rank,
                     " submitted ", a.fp.Describe()));
    ++p.arrived;  // this member is answered by the caller, not by the verdict
    return out;
  }
  if (a.deadline < p.deadline) {
    p.deadline = a.deadline;
    p.timeout = a.timeout;
    out.arm_deadline = a.deadline;
  }
  const auto slot = std::lower_bound(group.local_group_ranks.begin(), group.local_group_ranks.end(),
                                     a.group_rank);
  p.arrivals[slot - group.local_group_ranks.begin()] = std::move(a);
  if (++p.arrived < local) return out;

  out.outcome = Arrived::Outcome::kMatched;
  out.arm_deadline.reset();
  Ready r;
  r.remote = group.spans_nodes;
  r.seq = seq;
  r.op = MakeCollective(group, seq, p.fp, p.deadline, p.plane);
  std::vector<std::shared_ptr<MappedBuffer>> pins;
  for (std::optional<Arrival>& m : p.arrivals) {
    // The member's record settles with the op itself (settlements), not with its views.
    if (m->turn && m->turn->settlement) {
      r.op.settlements.push_back(std::exchange(m->turn->settlement, nullptr));
    }
    r.op.local.push_back({m->group_rank, std::move(m->input), std::move(m->output), m->turn});
    r.to.emplace_back(std::move(m->sink), m->tag);
    for (auto& pin : m->pins) pins.push_back(std::move(pin));
    r.bytes = std::max(r.bytes, m->bytes);
  }
  if (!pins.empty()) {
    r.op.keep_alive =
        std::make_shared<const std::vector<std::shared_ptr<MappedBuffer>>>(std::move(pins));
  }
  out.disarm = std::move(p.timers);
  r.fp = std::move(p.fp);
  r.queued = p.queued;
  r.plane = p.plane;
  group.last_plane = p.plane;
  group.pending.erase(seq);
  group.ready.push_back(std::move(r));
  if (!group.running) {
    group.running = true;
    out.start_drain = true;
  }
  return out;
}

void KeepTimer(Group& group, uint64_t seq, DeadlineTimer::Id id) {
  auto it = group.pending.find(seq);
  if (it != group.pending.end()) it->second.timers.push_back(id);
}

FailedPending Fail(Group& group, uint64_t seq, const absl::Status& status,
                   const EngineOptions& options) {
  FailedPending out;
  auto it = group.pending.find(seq);
  if (it == group.pending.end()) return out;
  Pending& p = it->second;
  out.disarm = std::move(p.timers);
  const int untold = static_cast<int>(group.local_group_ranks.size()) - p.arrived;
  std::optional<Plane> plane;  // of the first member that named a buffer
  for (std::optional<Arrival>& a : p.arrivals) {
    if (!a.has_value()) continue;
    if (!plane) plane = a->plane;
    out.to.emplace_back(a->sink, a->tag);
  }
  NoteFinished(group, options, seq, p.fp, p.plane, p.bytes, p.queued, absl::InfinitePast(),
               absl::Now(), status);
  if (group.spans_nodes) {
    // The other nodes learn of it through the op's cross-node exchange (see Collective).
    out.for_other_nodes =
        FailedOp(group, seq, p.fp, p.deadline, status, plane.value_or(group.last_plane));
  }
  group.pending.erase(it);
  if (untold > 0) group.verdicts[seq] = Verdict{status, untold};
  return out;
}

std::optional<absl::Status> Expire(const Group& group, uint64_t seq, absl::Time now) {
  auto it = group.pending.find(seq);
  if (it == group.pending.end() || now < it->second.deadline) return std::nullopt;
  const Pending& p = it->second;
  std::vector<int> arrived, missing;
  for (size_t i = 0; i < p.arrivals.size(); ++i) {
    (p.arrivals[i].has_value() ? arrived : missing)
        .push_back(group.members[group.local_group_ranks[i]]);
  }
  return absl::DeadlineExceededError(absl::StrCat(
      OpLabel(p.fp.kind, group.job->id, group.key, seq), " name='", p.fp.name, "' timed out after ",
      absl::FormatDuration(p.timeout), ": rank(s) ", JoinBounded(missing, ","),
      " never submitted it (arrived: ", JoinBounded(arrived, ","), ")"));
}

}  // namespace gradsync::core::internal
