// What the engine shows about its ops (see inspect.h): the history ring, ListOps, GetHistory,
// GetTotals and the stall warnings.
#include "daemon/core/inspect.h"

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded_text.h"
#include "common/group.h"
#include "common/logging.h"
#include "daemon/core/engine.h"

namespace gradsync::core {
namespace internal {

void NoteFinished(Group& group, const EngineOptions& options, uint64_t seq, const Fingerprint& fp,
                  Plane plane, int64_t bytes, absl::Time queued, absl::Time started,
                  absl::Time finished, const absl::Status& status) {
  if (options.history_size > 0) {
    const size_t size = static_cast<size_t>(options.history_size);
    if (group.history.size() < size) group.history.emplace_back();
    HistorySlot& slot = group.history[group.history_written % size];
    ++group.history_written;
    slot.seq = seq;
    slot.fp = fp;
    slot.bytes = bytes;
    slot.plane = plane;
    slot.queued = queued;
    slot.started = started;
    slot.finished = finished;
    slot.outcome = status;
  }
  if (options.counters != nullptr) {
    options.counters->OpFinished(fp.kind, plane, status.code(), bytes, finished - queued);
  }
}

}  // namespace internal

namespace {

auto Log() { return logging::Logger("core"); }

using internal::Group;
using internal::Ready;

// The view of a matched op (queued or running) of a group on this node.
Engine::OpView ReadyView(const Group& group, const Ready& r, Engine::OpWait waiting) {
  Engine::OpView v;
  v.group = group.key;
  v.seq = r.seq;
  v.fingerprint = r.fp.Describe();
  v.plane = r.plane;
  v.waiting_for = waiting;
  v.queued = r.queued;
  for (int gr : group.local_group_ranks) v.arrived.push_back(group.members[gr]);
  v.bytes = r.bytes;
  return v;
}

Engine::OpWait RunningWait(const Group& group, const Ready& r) {
  if (r.plane == Plane::kDevice) return Engine::OpWait::kNccl;
  return group.spans_nodes ? Engine::OpWait::kNetwork : Engine::OpWait::kLocalCopy;
}

// The local members of pending op `p` that submitted it and those that did not (global ranks).
void ArrivedAndMissing(const Group& group, const internal::Pending& p, std::vector<int>& arrived,
                       std::vector<int>& missing) {
  for (size_t i = 0; i < p.arrivals.size(); ++i) {
    (p.arrivals[i].has_value() ? arrived : missing)
        .push_back(group.members[group.local_group_ranks[i]]);
  }
}

// "3 (node 10.0.0.2:7451), 5 (node ...)": ranks with the node that holds each, when known.
std::string RanksWithNodes(const std::vector<int>& ranks, const std::vector<std::string>& node_of,
                           const std::string& fallback) {
  std::vector<std::string> parts;
  for (int r : ranks) {
    const std::string& node = r < static_cast<int>(node_of.size()) ? node_of[r] : fallback;
    parts.push_back(node.empty() ? absl::StrCat(r) : absl::StrCat(r, " (node ", node, ")"));
    if (parts.size() == 16 && ranks.size() > 16) {
      parts.push_back(absl::StrCat("... ", ranks.size() - 16, " more"));
      break;
    }
  }
  return absl::StrJoin(parts, ", ");
}

}  // namespace

void Engine::SweepStalls() {
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    for (const auto& [id, job] : jobs_) {
      absl::MutexLock job_lock(&job->mu);
      const std::string node = job->node.empty() ? node_address_ : job->node;
      for (const auto& [key, group] : job->groups) {
        internal::AssertGroupOf(*job, *group);
        for (auto& [seq, p] : group->pending) {
          if (p.stall_warned || now - p.queued < options_.stall_warn) continue;
          p.stall_warned = true;
          std::vector<int> arrived, missing;
          ArrivedAndMissing(*group, p, arrived, missing);
          Log()->warn(
              "op stalled job={} group={} seq={} op={} waited={} deadline_in={}: rank(s) {} have "
              "not submitted it (arrived here: {})",
              job->id, key, seq, p.fp.Describe(), absl::FormatDuration(now - p.queued),
              absl::FormatDuration(p.deadline - now),
              RanksWithNodes(missing, job->node_of_rank, node), JoinBounded(arrived, ","));
          if (options_.counters != nullptr) options_.counters->stalls.fetch_add(1);
        }
        Ready* r = group->running_ops.empty() ? nullptr : &group->running_ops.front();
        if (r == nullptr || r->stall_warned || now - r->queued < options_.stall_warn) continue;
        r->stall_warned = true;
        std::vector<int> remote;  // members on other nodes
        for (size_t i = 0, l = 0; i < group->members.size(); ++i) {
          if (l < group->local_group_ranks.size() &&
              group->local_group_ranks[l] == static_cast<int>(i)) {
            ++l;
          } else {
            remote.push_back(group->members[i]);
          }
        }
        const OpWait wait = RunningWait(*group, *r);
        Log()->warn(
            "op stalled job={} group={} seq={} op={} waited={}: every rank here submitted it; "
            "waiting on {}{}{}",
            job->id, key, r->seq, r->fp.Describe(), absl::FormatDuration(now - r->queued),
            wait == OpWait::kNccl      ? "NCCL"
            : wait == OpWait::kNetwork ? "the network"
                                       : "the copy",
            remote.empty() ? "" : " for rank(s) ", RanksWithNodes(remote, job->node_of_rank, ""));
        if (options_.counters != nullptr) options_.counters->stalls.fetch_add(1);
      }
    }
  }
  const absl::Duration period =
      std::clamp(options_.stall_warn / 4, absl::Milliseconds(100), absl::Seconds(1));
  timer_.Schedule(now + period, [this] { SweepStalls(); });
}

absl::StatusOr<Engine::JobOpsView> Engine::ListOps(const std::string& job_id,
                                                   const std::string& group_filter) const {
  std::shared_ptr<Job> job;
  JobOpsView view;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("no rank of job ", job_id, " is attached here"));
    }
    job = it->second;
    view.node = node_address_;
  }
  absl::MutexLock lock(&job->mu);
  if (!job->node.empty()) view.node = job->node;
  view.node_of_rank = job->node_of_rank;
  for (Session* s : job->ranks) {
    if (s != nullptr) view.local_ranks.push_back(s->rank);
  }
  // Lock order: a job's mutex before the watch's (which calls back with none of its own held).
  if (peer_watch_ != nullptr) view.peers = peer_watch_->Peers(job_id);
  for (const auto& [key, group] : job->groups) {
    if (!group_filter.empty() && key != group_filter) continue;
    internal::AssertGroupOf(*job, *group);
    for (const auto& [seq, p] : group->pending) {
      OpView v;
      v.group = key;
      v.seq = seq;
      v.fingerprint = p.fp.Describe();
      v.plane = p.plane;
      v.waiting_for = OpWait::kTrainers;
      v.queued = p.queued;
      v.bytes = p.bytes;
      ArrivedAndMissing(*group, p, v.arrived, v.missing);
      view.ops.push_back(std::move(v));
    }
    for (const Ready& r : group->running_ops) {
      if (r.record) view.ops.push_back(ReadyView(*group, r, RunningWait(*group, r)));
    }
    for (const Ready& r : group->ready) {
      if (r.record) view.ops.push_back(ReadyView(*group, r, OpWait::kEarlierOp));
    }
  }
  std::sort(view.ops.begin(), view.ops.end(), [](const OpView& x, const OpView& y) {
    return std::tie(x.group, x.seq) < std::tie(y.group, y.seq);
  });
  return view;
}

absl::StatusOr<Engine::GroupHistory> Engine::GetHistory(const std::string& job_id,
                                                        const std::string& group_key) const {
  std::shared_ptr<Job> job;
  {
    absl::MutexLock lock(&mu_);
    auto it = jobs_.find(job_id);
    if (it == jobs_.end()) {
      return absl::NotFoundError(absl::StrCat("no rank of job ", job_id, " is attached here"));
    }
    job = it->second;
  }
  const std::string key = group_key.empty() ? std::string(kWorldGroup) : group_key;
  GroupHistory out;
  absl::MutexLock lock(&job->mu);
  auto it = job->groups.find(key);
  if (it == job->groups.end()) {
    return absl::NotFoundError(
        absl::StrCat("job ", job_id, " has no group ", key, " on this node (no op yet)"));
  }
  const Group& group = *it->second;
  internal::AssertGroupOf(*job, group);
  const uint64_t held = std::min<uint64_t>(group.history_written, group.history.size());
  out.dropped = group.history_written - held;
  out.ops.reserve(held);
  for (uint64_t i = group.history_written - held; i < group.history_written; ++i) {
    const internal::HistorySlot& slot = group.history[i % group.history.size()];
    out.ops.push_back({slot.seq, slot.fp.Describe(), slot.bytes, slot.plane, slot.queued,
                       slot.started, slot.finished, slot.outcome});
  }
  return out;
}

Engine::Totals Engine::GetTotals() const {
  Totals t;
  absl::MutexLock lock(&mu_);
  t.jobs = static_cast<int>(jobs_.size());
  t.sessions = sessions_;
  for (const auto& [id, job] : jobs_) {
    absl::MutexLock job_lock(&job->mu);
    for (const auto& [key, group] : job->groups) {
      internal::AssertGroupOf(*job, *group);
      t.pending_ops +=
          static_cast<int>(group->pending.size() + group->ready.size() + group->running_ops.size());
    }
    for (Session* s : job->ranks) {
      if (s == nullptr) continue;
      absl::MutexLock session_lock(&s->mu);
      for (const auto& [bid, b] : s->buffers) t.mapped_bytes += b.mapping->size();
    }
  }
  return t;
}

}  // namespace gradsync::core
