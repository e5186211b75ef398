// One group's NCCL collectives on this node (see nccl_communicator.h).

#include "daemon/backend/nccl/nccl_communicator.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/dtype.h"
#include "common/logging.h"
#include "daemon/backend/nccl/backoff.h"
#include "daemon/backend/nccl/launched_ops.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

// Ends an op's waits once the group's job-wide abort count passes `seen`, with the abort's
// reason (the peer watch's word on a lost node, another group's failure).
std::function<absl::Status()> AbortInterrupt(GroupComms& c, uint64_t seen) {
  return [&c, seen]() -> absl::Status {
    if (c.aborts.load() == seen) return absl::OkStatus();
    const absl::Status reason = c.AbortReason();
    return reason.ok() ? absl::AbortedError("the job's communicators on this node were aborted")
                       : reason;
  };
}

bool HasOutput(v1::OpKind kind) { return kind == v1::ALL_GATHER || kind == v1::REDUCE_SCATTER; }

absl::Status Context(const core::Collective& op, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(op.label, ": ", s.message()));
}

// The element counts of a view's segments.
std::vector<int64_t> Counts(const core::View& view) {
  std::vector<int64_t> counts;
  counts.reserve(view.size());
  for (const core::Run& r : view) counts.push_back(r.count);
  return counts;
}

// "[4,12]": a segmentation as errors and the nodes' fingerprints give it. Past kListed segments
// the middle is left out and a digest of all the counts stands for them, so that two different
// segmentations give different texts (but for a 64-bit hash collision).
std::string SegmentList(const std::vector<int64_t>& counts) {
  constexpr size_t kListed = 16;
  if (counts.size() <= kListed) return absl::StrCat("[", absl::StrJoin(counts, ","), "]");
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over the counts' bytes
  for (int64_t n : counts) {
    for (int i = 0; i < 8; ++i) {
      h ^= (static_cast<uint64_t>(n) >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  }
  const size_t half = kListed / 2;
  return absl::StrCat("[", absl::StrJoin(counts.begin(), counts.begin() + half, ","), ",...,",
                      absl::StrJoin(counts.end() - half, counts.end(), ","), "] (", counts.size(),
                      " segments, digest ", absl::Hex(h, absl::kZeroPad16), ")");
}

// `view` with the segments that follow each other in one buffer merged.
core::View MergeAdjacent(const core::View& view, int64_t esize) {
  core::View out;
  for (const core::Run& r : view) {
    if (!out.empty() && out.back().buffer == r.buffer &&
        out.back().data + out.back().count * esize == r.data) {
      out.back().count += r.count;
    } else {
      out.push_back(r);
    }
  }
  return out;
}

// The buffers `a` and `b` (when not null) lie in, each once, in the order they first appear.
std::vector<const core::MappedBuffer*> Buffers(const core::View& a, const core::View* b) {
  std::vector<const core::MappedBuffer*> out;
  absl::flat_hash_set<const core::MappedBuffer*> seen;  // a pack may have many segments
  for (const core::View* view : {&a, b}) {
    if (view == nullptr) continue;
    for (const core::Run& r : *view) {
      if (seen.insert(r.buffer).second) out.push_back(r.buffer);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<NcclCommunicator::Member>> NcclCommunicator::Members(
    const core::Collective& op) {
  std::vector<Member> out;
  const bool two = HasOutput(op.kind);
  for (const core::LocalMember& m : op.local) {
    Member member;
    member.group_rank = m.group_rank;
    member.in = m.input;
    if (two) member.out = m.output;
    if (member.in.empty() || (two && member.out.empty())) {
      return absl::InvalidArgumentError(
          absl::StrCat(op.label, ": rank ", m.group_rank, " names no device buffer"));
    }
    for (const core::View* view : {&member.in, two ? &member.out : nullptr}) {
      if (view == nullptr) continue;
      for (const core::Run& r : *view) {
        if (r.buffer == nullptr || r.buffer->device() < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat(op.label, ": rank ", m.group_rank, " names a host buffer"));
        }
        if (r.count <= 0) {  // the engine drops empty segments: NCCL takes size_t counts
          return absl::InvalidArgumentError(absl::StrCat(
              op.label, ": rank ", m.group_rank, " has a segment of ", r.count, " elements"));
        }
        if (member.device >= 0 && r.buffer->device() != member.device) {
          return absl::InvalidArgumentError(
              absl::StrCat(op.label, ": rank ", m.group_rank, "'s buffers are on devices ",
                           member.device, " and ", r.buffer->device()));
        }
        member.device = r.buffer->device();
      }
    }
    out.push_back(std::move(member));
  }
  return out;
}

absl::StatusOr<NcclCommunicator::Plan> NcclCommunicator::MakePlan(
    const core::Collective& op) const {
  absl::StatusOr<std::vector<Member>> members = Members(op);
  if (!members.ok()) return members.status();
  Plan plan;
  plan.members = *std::move(members);
  if (plan.members.empty()) return plan;
  const int64_t esize = DTypeSize(op.dtype);
  if (esize <= 0) return absl::InvalidArgumentError(absl::StrCat(op.label, ": unknown dtype"));
  if (HasOutput(op.kind)) {
    // ALL_GATHER writes rank r's input to [r*count, (r+1)*count) of the whole output, and
    // REDUCE_SCATTER gives rank r that range of the reduced input: one NCCL call per segment
    // would lay each segment out rank by rank on its own instead, which is not the op. So each
    // rank's input and output must each be one range (adjacent segments merged); a pack of
    // them belongs in one buffer, or on host buffers (the CPU plane copies through a scratch).
    Call call;
    for (const Member& m : plan.members) {
      const core::View in = MergeAdjacent(m.in, esize), out = MergeAdjacent(m.out, esize);
      if (in.size() != 1 || out.size() != 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            op.label, ": on GPU buffers ", v1::OpKind_Name(op.kind),
            " takes each rank's input and output as one contiguous range (rank ", m.group_rank,
            "'s input is in ", in.size(), " and its output in ", out.size(),
            " separate segments): it lays the output out rank by rank over the whole array, "
            "which one NCCL call per segment cannot do"));
      }
      call.send_recv.emplace_back(in[0].data, out[0].data);
    }
    call.count = op.count;
    plan.calls.push_back(std::move(call));
    return plan;
  }
  // ALL_REDUCE and BROADCAST: elementwise, so segment by segment, the same on every rank.
  const Member& first = plan.members.front();
  const std::vector<int64_t> segments = Counts(first.in);
  for (const Member& m : plan.members) {
    if (std::vector<int64_t> theirs = Counts(m.in); theirs != segments) {
      return absl::FailedPreconditionError(absl::StrCat(
          "desync in ", op.label, ": rank ", first.group_rank, " has segments ",
          SegmentList(segments), " but rank ", m.group_rank, " has ", SegmentList(theirs)));
    }
  }
  int64_t total = 0;
  for (int64_t n : segments) total += n;
  if (total != op.count) {
    return absl::InvalidArgumentError(absl::StrCat(op.label, ": the segments hold ", total,
                                                   " elements but the op has ", op.count));
  }
  for (size_t k = 0; k < segments.size(); ++k) {
    // Segment k continues the last call where it follows it in memory on every local rank
    // (and the group is within this node: see MakePlan's declaration).
    bool merge = k > 0 && !Spanning();
    for (const Member& m : plan.members) {
      merge = merge && m.in[k].buffer == m.in[k - 1].buffer &&
              m.in[k].data == m.in[k - 1].data + m.in[k - 1].count * esize;
    }
    if (merge) {
      plan.calls.back().count += segments[k];
      continue;
    }
    Call call;
    call.count = segments[k];
    for (const Member& m : plan.members) call.send_recv.emplace_back(m.in[k].data, m.in[k].data);
    plan.calls.push_back(std::move(call));
  }
  return plan;
}

std::string NcclCommunicator::NodeFingerprint(const core::Collective& op) {
  if (!op.local_failure.ok() || op.local.empty() || HasOutput(op.kind)) return op.fingerprint;
  // The local ranks' segmentations are the same, or the op fails before it looks at the store.
  return absl::StrCat(op.fingerprint, " segments=", SegmentList(Counts(op.local.front().input)));
}

std::vector<std::string> NcclCommunicator::OtherNodes() const {
  std::vector<std::string> out;
  for (const std::string& node : spec_->member_nodes) {
    if (node != spec_->node && std::find(out.begin(), out.end(), node) == out.end()) {
      out.push_back(node);
    }
  }
  return out;
}

std::string NcclCommunicator::NodeAndRanks() const {
  return absl::StrCat("node ", spec_->node, " (ranks ", absl::StrJoin(spec_->local_members, ","),
                      ")");
}

absl::Status NcclCommunicator::Run(const core::Collective& op) {
  if (!Spanning() && !op.local_failure.ok()) return op.local_failure;
  // Declared before the group's lock: what the op decides to tell the other nodes is written,
  // and launched ops settled meanwhile are released, once the lock is released.
  DeferredWrites later;
  const auto launched = std::make_shared<LaunchedOp>(
      spec_, op, Spanning() ? spec_->rendezvous : nullptr, NodeFingerprint(op));
  absl::Status s;
  bool watched = false;  // the group owns `launched` now: only under its lock from here on
  std::optional<Prepared> prepared;
  for (int tries = 0; true;) {
    std::shared_ptr<GroupComms> c = table_->Get(spec_->job, spec_->group);
    if (!prepared) prepared = Prepare(*c, op, *launched, later);
    LockedComms locked(c.get());
    if (c->erased) {  // dropped meanwhile (its job ended here, or a kept group another job needed)
      if (prepared->comms.empty() && ++tries <= 2) {
        prepared.reset();  // it built nothing: prepared again on the fresh group in the table
        continue;
      }
      // Communicators built for a group that went: not installed anywhere (the job they were
      // for may have ended here), so aborted below, and the op fails.
      s = Context(op, absl::UnavailableError("the group's NCCL state on this node was dropped "
                                             "while the op prepared (its job ended here)"));
      break;
    }
    // The group's communicators went while the op prepared to use them (dropped or rebuilt
    // elsewhere; an abort fails the op instead): prepared again, a few times at most.
    if (prepared->status.ok() && prepared->comms.empty() && prepared->plan.ok() &&
        !prepared->plan->members.empty() && c->launch_failure.ok() &&
        NeedsBuildLocked(*c, *prepared, op.group_size) &&
        c->aborts.load() == prepared->aborts_seen && ++tries <= 2) {
      prepared.reset();
      continue;
    }
    s = RunOnGroupLocked(*c, op, launched, *prepared, later);
    if (launched->in_group) {  // its kernels were queued: the group, or an abort, holds it
      watched = true;
      if (s.ok()) {
        launched->answered = true;
        table_->NoteLaunched(c);
      }
    }
    break;
  }
  // Built for the op but not taken (it failed first): gone, so the other nodes' fail too.
  table_->AbortUnused(std::exchange(prepared->comms, {}),
                      "built for an op that failed before it used them");
  if (watched && s.ok()) return s;
  // The events of an op taken by an abort go with it, once its streams are drained.
  if (!watched) {
    for (const auto& [device, event] : launched->finished) (void)api_->DestroyEvent(device, event);
  }
  launched->peers.Finished(s);
  // This node is out of step with the others on this group now (its communicators went under
  // the lock): the other nodes hear at once that this op failed rather than wait for it.
  if (!s.ok() && Spanning() && !launched->peers.peers_know()) {
    later.WriteWhileRunLasts(spec_->rendezvous, spec_->job, spec_->run, FailKey(*spec_, op.seq),
                             absl::StrCat(NodeAndRanks(), ": ", s.message()));
  }
  return s;
}

NcclCommunicator::Prepared NcclCommunicator::Prepare(GroupComms& c, const core::Collective& op,
                                                     LaunchedOp& launched, DeferredWrites& later) {
  Prepared p;
  p.aborts_seen = c.aborts.load();
  // Checked before any NCCL call: a local desync or a refused layout never reaches NCCL.
  if (!op.local_failure.ok()) return p;  // RunLocked fails the op with it
  p.plan = MakePlan(op);
  if (!p.plan.ok() || p.plan->members.empty()) return p;
  for (const Member& m : p.plan->members) {
    p.devices.push_back(m.device);
    p.ranks.push_back(m.group_rank);
  }
  PeerFailureWatch& peers = launched.peers;
  // A job-wide abort (a lost node, another group's failure) ends the waits below at once.
  peers.InterruptWith(AbortInterrupt(c, p.aborts_seen));
  // A fused op across nodes: its calls follow its segmentation, which the engine's fingerprint
  // does not hold, and a fast op split differently would complete with garbage before the
  // watch compares: the nodes compare it before any NCCL call. (A contiguous op keeps to the
  // watch after PeerFailureWatch::kWatchAfter: no extra round.)
  if (Spanning() && !HasOutput(op.kind) && op.local.front().input.size() > 1) {
    p.status = peers.CompareBeforeLaunch(OtherNodes());
  }
  bool build = false;
  if (p.status.ok()) {
    LockedComms locked(&c);  // a look (and a deferred abort): nothing waits on others under it
    if (!c.erased && c.abort_requested.exchange(false)) {  // aborted while an op ran
      table_->AbortWithJobLocked(c, c.AbortReason(), later);
    }
    // A launched op's failure fails this op before it builds anything (RunOnGroupLocked).
    build = c.erased || (c.launch_failure.ok() && NeedsBuildLocked(c, p, op.group_size));
  }
  if (build) p.status = Build(op, p, peers, later, &p.comms);
  if (p.status.ok()) p.status = AwaitTrainers(op, *p.plan, peers);
  // Last, just before the launch: every device op its trainers submitted before this one has
  // been launched (or failed), so each GPU's launches follow its trainers' program order.
  for (const core::LocalMember& m : op.local) {
    if (!p.status.ok() || !m.turn.has_value()) continue;
    if (absl::Status s = m.turn->order->AwaitTurn(m.turn->index, op.deadline,
                                                  [&peers] { return peers.Check(); });
        !s.ok()) {
      p.status = Context(
          op, absl::Status(s.code(), absl::StrCat("rank ", m.group_rank, ": ", s.message())));
    }
  }
  peers.InterruptWith(nullptr);
  return p;
}

absl::Status NcclCommunicator::AwaitTrainers(const core::Collective& op, const Plan& plan,
                                             PeerFailureWatch& peers) {
  // Each buffer's "ready" event, once: polled here rather than waited on by the daemon's
  // stream, since a stream that waits on an event of a process that dies before the record runs
  // waits forever, and NCCL's internal streams wait on that stream: ncclCommAbort would wait
  // with them (docs/gpu.md, "A trainer dies mid-op").
  std::vector<std::pair<int, const core::MappedBuffer*>> waiting;
  absl::flat_hash_set<const core::MappedBuffer*> seen;
  for (const Member& m : plan.members) {
    for (const core::MappedBuffer* b : Buffers(m.in, HasOutput(op.kind) ? &m.out : nullptr)) {
      if (b->ready_event() != nullptr && seen.insert(b).second)
        waiting.emplace_back(m.group_rank, b);
    }
  }
  Backoff backoff;
  for (size_t next = 0; next < waiting.size();) {
    const auto& [rank, buffer] = waiting[next];
    absl::StatusOr<bool> done = api_->EventDone(buffer->device(), buffer->ready_event());
    if (!done.ok()) return Context(op, done.status());
    if (*done) {
      ++next;
      continue;
    }
    if (absl::Status s = peers.Check(); !s.ok()) return Context(op, s);
    if (absl::Now() > op.deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          op.label, ": rank ", rank, "'s trainer never said its buffer (", buffer->Describe(),
          ") was ready: its \"ready\" event did not complete by the op's deadline (the trainer's "
          "GPU work before the op is stuck, or its process died with the event's record "
          "queued); nothing was launched"));
    }
    backoff.Pause();
  }
  return absl::OkStatus();
}

bool NcclCommunicator::NeedsBuildLocked(const GroupComms& c, const Prepared& p, int group_size) {
  return c.comms.empty() || c.devices != p.devices || c.ranks != p.ranks ||
         c.group_size != group_size;
}

absl::Status NcclCommunicator::RunOnGroupLocked(GroupComms& c, const core::Collective& op,
                                                const std::shared_ptr<LaunchedOp>& launched,
                                                Prepared& prepared, DeferredWrites& later) {
  if (c.kept_until != absl::InfinitePast()) {
    Log()->info("nccl communicators kept from the job's last run reused job={} group={}",
                spec_->job, spec_->group);
    c.kept_until = absl::InfinitePast();
  }
  if (c.abort_requested.exchange(false)) {  // the job's communicators aborted while idle
    table_->AbortWithJobLocked(c, c.AbortReason(), later);
  }
  // The group's earlier ops still on the GPU: a failure of one since fails this op (one that
  // failed here already keeps its own reason, and the earlier op's is added below).
  LookAtLaunchedLocked(*table_, c, later);
  absl::Status s = op.local_failure.ok() ? TakeLaunchFailureLocked(c, op) : absl::OkStatus();
  if (s.ok() && op.local_failure.ok() &&
      c.launched.size() >= kMaxLaunchedPerGroup) {  // the GPU is behind: wait
    if (absl::Status w =
            AwaitLaunchedLocked(*table_, c, kMaxLaunchedPerGroup - 1, op.deadline, later);
        !w.ok()) {
      s = absl::DeadlineExceededError(absl::StrCat(op.label, ": not launched by its deadline, ",
                                                   w.message(), " (at most ", kMaxLaunchedPerGroup,
                                                   " may be)"));
    } else {
      s = TakeLaunchFailureLocked(c, op);
    }
  }
  if (s.ok()) s = RunLocked(c, op, launched, prepared, later);
  if (s.ok()) return s;
  if (Spanning() && !c.comms.empty()) {
    // The other nodes run this op: its calls would no longer pair up. The earlier ops, which
    // every node runs, finish first (or fail).
    (void)AwaitLaunchedLocked(*table_, c, 0, op.deadline, later);
    if (!c.comms.empty()) table_->AbortLocked(c, s, later);
  }
  if (!c.launch_failure.ok()) {  // earlier launched ops went with this op's abort
    s = absl::Status(s.code(), absl::StrCat(s.message(), "; and the group's earlier op ",
                                            c.launch_failure.message()));
    c.launch_failure = absl::OkStatus();
  }
  return s;
}

absl::Status NcclCommunicator::RunLocked(GroupComms& c, const core::Collective& op,
                                         const std::shared_ptr<LaunchedOp>& launched,
                                         Prepared& prepared, DeferredWrites& later) {
  PeerFailureWatch& peers = launched->peers;
  if (!op.local_failure.ok()) return op.local_failure;
  if (!prepared.plan.ok()) return prepared.plan.status();
  const Plan& plan = *prepared.plan;
  const std::vector<Member>& members = plan.members;
  if (members.empty()) return absl::OkStatus();
  if (c.aborts.load() != prepared.aborts_seen) {  // while it prepared: its comms are gone
    const absl::Status reason = c.AbortReason();
    return Context(op, reason.ok() ? absl::AbortedError("the job's communicators on this node "
                                                        "were aborted")
                                   : reason);
  }
  if (!prepared.status.ok()) return prepared.status;
  const std::vector<int>& devices = prepared.devices;
  if (!c.comms.empty() && NeedsBuildLocked(c, prepared, op.group_size)) {
    // The earlier ops on the old communicators finish (or fail) first.
    if (absl::Status w = AwaitLaunchedLocked(*table_, c, 0, op.deadline, later); !w.ok()) {
      return Context(op, w);
    }
    if (absl::Status f = TakeLaunchFailureLocked(c, op); !f.ok()) return f;
    Log()->info("nccl layout changed job={} group={}: rebuilding", spec_->job, spec_->group);
    table_->AbortLocked(c, absl::AbortedError("its local ranks moved to other devices"), later);
  }
  if (c.comms.empty()) {
    if (prepared.comms.empty()) {
      return Context(op, absl::UnavailableError("the group's NCCL communicators went while the "
                                                "op prepared to use them"));
    }
    InstallLocked(c, op, prepared, later);
  }
  // Also when this op built them: once launched and answered, its failure on another node
  // (a job-wide abort there that took its launched ops) says only broken/<b>, not fail/<seq>.
  peers.RunsOn(c.built_at);
  for (int d : devices) {
    if (c.streams.count(d)) continue;
    absl::StatusOr<gpu::Stream> stream = api_->CreateStream(d);
    if (!stream.ok()) return Context(op, stream.status());
    c.streams[d] = *stream;
  }
  // The trainers' work on the buffers is done (AwaitTrainers, before the lock): the daemon's
  // streams depend on no other process.
  // From here the op's kernels may be queued: the group holds it (and its buffers' mappings),
  // and an abort takes it along until the streams are drained.
  launched->in_group = true;
  c.launched.push_back(launched);
  if (absl::Status s = LaunchLocked(c, op, plan); !s.ok()) {
    // Some ranks' kernels may be queued already: stopped, and gone, before the buffers go.
    table_->AbortLocked(c, s, later);
    return Context(op, s);
  }
  // Non-blocking communicators may still be putting the kernels on the streams after
  // ncclGroupEnd: until they are, neither the "done" events nor the streams say anything. The
  // group's lock is held: no store call while it waits, but a job-wide abort ends the wait.
  peers.InterruptWith(AbortInterrupt(c, c.aborts.load()));
  absl::Status enqueued =
      PollReady(c.comms, op.deadline, peers, "NCCL did not enqueue the op by its deadline",
                /*read_store=*/false);
  peers.InterruptWith(nullptr);
  if (!enqueued.ok()) return FailLocked(c, op, enqueued, peers, later);
  // The trainers' streams may wait for this: record "done" on every written buffer.
  for (const Member& m : members) {
    for (const core::MappedBuffer* b : Buffers(HasOutput(op.kind) ? m.out : m.in, nullptr)) {
      if (b->done_event() == nullptr) continue;
      if (absl::Status e = api_->RecordEvent(m.device, b->done_event(), c.streams[m.device]);
          !e.ok()) {
        return FailLocked(c, op, e, peers, later);  // the kernels are queued: abort them first
      }
    }
  }
  // The daemon's own mark of the op's end on each of its streams: the op stays watched until
  // they are all reached (launched_ops.h). Answered now: launched, stream ordered.
  for (const auto& [device, stream] : c.streams) {
    if (std::find(devices.begin(), devices.end(), device) == devices.end()) continue;
    absl::StatusOr<gpu::Event> event = api_->CreateEvent(device);
    if (!event.ok()) return FailLocked(c, op, event.status(), peers, later);
    launched->finished.emplace_back(device, *event);
    if (absl::Status e = api_->RecordEvent(device, *event, stream); !e.ok()) {
      return FailLocked(c, op, e, peers, later);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> NcclCommunicator::UniqueId(const core::Collective& op,
                                                       const std::string& key,
                                                       PeerFailureWatch& peers) {
  if (RootHere()) {
    if (absl::Status s = table_->MayMakeRoot(); !s.ok()) return Context(op, s);
    absl::StatusOr<std::string> id = api_->NcclUniqueId();
    if (!id.ok()) return Context(op, id.status());
    if (Spanning()) {
      if (absl::Status s = spec_->rendezvous->Set(spec_->job, key, *id); !s.ok()) {
        table_->RootLeft(spec_->job, spec_->group);
        return Context(op, s);
      }
    }
    return id;
  }
  if (spec_->rendezvous == nullptr) return absl::InternalError("no store to fetch the id");
  BackgroundKeyWait id(spec_->rendezvous, spec_->job, key, op.deadline);
  Backoff backoff;
  while (true) {
    if (std::optional<std::string> v = id.value()) return *std::move(v);
    if (absl::Status s = peers.Check(); !s.ok()) return Context(op, s);
    if (absl::Now() > op.deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(op.label, ": the NCCL id of group ", spec_->group,
                       " never came from the node of rank ", spec_->members.front()));
    }
    backoff.Pause();
  }
}

absl::Status NcclCommunicator::Build(const core::Collective& op, const Prepared& p,
                                     PeerFailureWatch& peers, DeferredWrites& later,
                                     std::vector<gpu::Comm>* out) {
  absl::StatusOr<std::string> id = UniqueId(op, IdKey(*spec_, op.seq), peers);
  if (!id.ok()) return id.status();
  table_->DropKeptOn(p.devices, spec_->job, later);  // their GPU memory is this job's now
  const std::vector<Member>& members = p.plan->members;
  std::vector<gpu::Comm> comms;
  absl::Status s = api_->NcclGroupStart();
  for (size_t i = 0; s.ok() && i < members.size(); ++i) {
    absl::StatusOr<gpu::Comm> comm =
        api_->NcclCommInitRank(members[i].device, op.group_size, *id, members[i].group_rank);
    table_->CountInit();
    if (comm.ok()) {
      comms.push_back(*comm);
    } else {
      s = comm.status();
    }
  }
  if (absl::Status end = api_->NcclGroupEnd(); s.ok()) s = end;
  if (s.ok()) {  // non-blocking init
    s = PollReady(comms, op.deadline, peers,
                  absl::StrCat("NCCL communicators of group ", spec_->group, " (", op.group_size,
                               " ranks) not ready by the deadline: a peer node never joined"));
  }
  if (!s.ok()) {
    // Their initialisation may still wait for a peer: the abort waits for it, on the aborter.
    table_->AbortUnused(std::move(comms), s.message());
    // The bootstrap root this node made for them waits on for the ranks that never came.
    if (RootHere()) table_->RootLeft(spec_->job, spec_->group);
    return Context(op, s);
  }
  *out = std::move(comms);
  return absl::OkStatus();
}

void NcclCommunicator::InstallLocked(GroupComms& c, const core::Collective& op, Prepared& p,
                                     DeferredWrites& later) {
  table_->InstallLocked(c, std::exchange(p.comms, {}));
  c.devices = p.devices;
  c.ranks = p.ranks;
  c.group_size = op.group_size;
  if (Spanning() && RootHere() && c.id_built_at) {
    // Every node has its communicators from that id, or gave up on them: it is done.
    later.Delete(spec_->rendezvous, spec_->job, IdKey(*spec_, *c.id_built_at));
  }
  if (Spanning() && RootHere()) c.id_built_at = op.seq;
  c.built_at = op.seq;
  if (c.aborted) table_->CountRebuild();
  c.aborted = false;
  c.store = Spanning() ? spec_->rendezvous : nullptr;
  c.run = spec_->run;
  c.node = NodeAndRanks();
  Log()->info("nccl communicators ready job={} group={} ranks={} local={} devices={}", spec_->job,
              spec_->group, op.group_size, p.devices.size(), absl::StrJoin(p.devices, ","));
}

absl::Status NcclCommunicator::LaunchLocked(GroupComms& c, const core::Collective& op,
                                            const Plan& plan) {
  // One thread at a time launches on a device (NCCL: "it is not safe to issue NCCL operations
  // in parallel to independent communicators located on the same device with multiple
  // threads"), and in the order the launches come (NCCL_LAUNCH_ORDER_IMPLICIT then runs them
  // in that order on the GPU).
  std::vector<int> devices;
  for (const Member& m : plan.members) devices.push_back(m.device);
  const DeviceLaunches launching = table_->LaunchOn(std::move(devices));
  absl::Status s = api_->NcclGroupStart();
  for (const Call& each : plan.calls) {
    for (size_t i = 0; s.ok() && i < plan.members.size(); ++i) {
      const Member& m = plan.members[i];
      gpu::NcclCall call;
      call.kind = op.kind;
      call.reduce_op = op.reduce_op;
      call.dtype = op.dtype;
      call.send = each.send_recv[i].first;
      call.recv = each.send_recv[i].second;
      call.count = each.count;
      call.root = op.root;
      call.device = m.device;
      call.comm = c.comms[i];
      call.stream = c.streams[m.device];
      s = api_->NcclCollective(call);
    }
  }
  if (absl::Status end = api_->NcclGroupEnd(); s.ok()) s = end;
  return s;
}

absl::Status NcclCommunicator::PollReady(const std::vector<gpu::Comm>& comms, absl::Time deadline,
                                         PeerFailureWatch& peers, absl::string_view late,
                                         bool read_store) {
  Backoff backoff;
  while (true) {
    bool ready = true;
    for (gpu::Comm comm : comms) {
      absl::StatusOr<bool> r = api_->NcclCommReady(comm);
      if (!r.ok()) return r.status();
      ready = ready && *r;
    }
    if (ready) return absl::OkStatus();
    if (absl::Status s = read_store ? peers.Check() : peers.Interrupted(); !s.ok()) return s;
    if (absl::Now() > deadline) return absl::DeadlineExceededError(late);
    backoff.Pause();
  }
}

absl::Status NcclCommunicator::FailLocked(GroupComms& c, const core::Collective& op,
                                          const absl::Status& why, const PeerFailureWatch& peers,
                                          DeferredWrites& later) {
  const absl::Status status = Context(op, why);
  Log()->warn("nccl op failed, aborting {} job={} error={}",
              peers.failed_on_peer_word() ? "the group's communicators"
                                          : "the job's communicators on this node",
              spec_->job, status.ToString());
  table_->AbortOnFailureLocked(c, status, peers.failed_on_peer_word(), later);
  return status;
}

void NcclCommunicator::Abort(const absl::Status& status) { table_->AbortJob(spec_->job, status); }

}  // namespace gradsync::backend::nccl
