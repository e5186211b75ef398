#include "daemon/backend/nccl/nccl_backend.h"

#include <algorithm>
#include <functional>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace gradsync::backend::nccl {
namespace {

auto Log() { return logging::Logger("nccl"); }

// How a waiting op paces its looks at its streams and communicators: it spins (yielding the
// core) for kSpin, so that a short op is seen done within a microsecond or two of finishing,
// then sleeps between looks, from kFirstSleep doubling up to kMaxSleep, so that a long op costs
// little CPU and is still seen done within 100 µs (under 1% of an op that long).
constexpr absl::Duration kSpin = absl::Milliseconds(2);
constexpr absl::Duration kFirstSleep = absl::Microseconds(10);
constexpr absl::Duration kMaxSleep = absl::Microseconds(100);

class Backoff {
 public:
  void Pause() {
    if (absl::Now() - start_ < kSpin) {
      std::this_thread::yield();
      return;
    }
    absl::SleepFor(sleep_);
    sleep_ = std::min(sleep_ * 2, kMaxSleep);
  }

 private:
  const absl::Time start_ = absl::Now();
  absl::Duration sleep_ = kFirstSleep;
};

// A local member's buffers for one op, checked: one device run each.
struct Member {
  int group_rank = 0;
  int device = -1;
  core::Run in{};
  core::Run out{};  // ALL_GATHER, REDUCE_SCATTER
};

bool HasOutput(v1::OpKind kind) { return kind == v1::ALL_GATHER || kind == v1::REDUCE_SCATTER; }

absl::StatusOr<std::vector<Member>> Members(const core::Collective& op) {
  std::vector<Member> out;
  for (const core::LocalMember& m : op.local) {
    Member member;
    member.group_rank = m.group_rank;
    const bool two = HasOutput(op.kind);
    if (m.input.size() != 1 || (two && m.output.size() != 1)) {
      return absl::UnimplementedError(absl::StrCat(
          op.label, ": on GPU buffers every rank's data must be one contiguous segment (rank ",
          m.group_rank, " has ", m.input.size(), "); fused ops are for host buffers"));
    }
    member.in = m.input[0];
    if (two) member.out = m.output[0];
    for (const core::Run* r : {&member.in, two ? &member.out : nullptr}) {
      if (r == nullptr) continue;
      if (r->buffer == nullptr || r->buffer->device() < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(op.label, ": rank ", m.group_rank, " names a host buffer"));
      }
      if (member.device >= 0 && r->buffer->device() != member.device) {
        return absl::InvalidArgumentError(absl::StrCat(op.label, ": rank ", m.group_rank,
                                                       "'s buffers are on devices ", member.device,
                                                       " and ", r->buffer->device()));
      }
      member.device = r->buffer->device();
    }
    out.push_back(member);
  }
  return out;
}

// One key of the job's store, waited for in the background from construction until it comes,
// the deadline passes or this object goes (the wait is cancelled).
class StoreKey {
 public:
  StoreKey(gradsync::Store* store, const std::string& job, std::string key, absl::Time deadline)
      : store_(store), state_(std::make_shared<State>()) {
    id_ = store_->WaitAsync(job, {std::move(key)}, deadline,
                            [state = state_](absl::StatusOr<std::vector<std::string>> v) {
                              absl::MutexLock lock(&state->mu);
                              state->finished = true;
                              if (v.ok()) state->value = std::move((*v)[0]);
                            });
  }
  ~StoreKey() {
    bool finished;
    {
      absl::MutexLock lock(&state_->mu);
      finished = state_->finished;
    }
    if (!finished) store_->CancelWait(id_);
  }
  StoreKey(const StoreKey&) = delete;
  StoreKey& operator=(const StoreKey&) = delete;

  /// The value, once the key exists.
  std::optional<std::string> value() const {
    absl::MutexLock lock(&state_->mu);
    return state_->value;
  }

 private:
  struct State {
    absl::Mutex mu;
    bool finished ABSL_GUARDED_BY(mu) = false;
    std::optional<std::string> value ABSL_GUARDED_BY(mu);
  };
  gradsync::Store* const store_;
  const std::shared_ptr<State> state_;  // shared with the callback, which may outlive this
  gradsync::Store::WaitId id_ = 0;
};

// An op that has run this long starts watching the store for other nodes' word on it: long
// enough that healthy ops seldom do (each look costs the job's root store a few calls), short
// against the deadline the other nodes would otherwise wait out.
constexpr absl::Duration kWatchAfter = absl::Milliseconds(100);

// "nccl/<run>/<group>/": where a group's keys live in the job's store, in this run of the job.
std::string Keys(const std::string& run, const std::string& group) {
  return absl::StrCat("nccl/", run, run.empty() ? "" : "/", group, "/");
}
std::string FailKey(const core::CommunicatorSpec& spec, uint64_t seq) {
  return absl::StrCat(Keys(spec.run, spec.group), "fail/", seq);
}
std::string BrokenKey(const std::string& run, const std::string& group, uint64_t built_at) {
  return absl::StrCat(Keys(run, group), "broken/", built_at);
}
std::string IdKey(const core::CommunicatorSpec& spec, uint64_t built_at) {
  return absl::StrCat(Keys(spec.run, spec.group), built_at, "/id");
}

// Writes `key` for the other nodes of run `run` of `job`, unless that run is over at the root
// (its keys deleted, or a new run begun): a late write would only bring the job's namespace
// back in the root's store, with nobody to read it. Logs what it could not write; returns
// whether it wrote.
bool Tell(gradsync::Store* store, const std::string& job, const std::string& run,
          const std::string& key, std::string value) {
  if (!run.empty()) {
    absl::StatusOr<std::string> current = store->Get(job, core::kRunKey, absl::InfinitePast());
    if (!current.ok() || *current != run) {
      Log()->debug("run over, not told job={} run={} key={}", job, run, key);
      return false;
    }
  }
  if (absl::Status s = store->Set(job, key, std::move(value)); !s.ok()) {
    Log()->warn("could not tell the other nodes job={} key={} error={}", job, key, s.ToString());
    return false;
  }
  return true;
}

// Other nodes' word that an op of a group spanning nodes cannot complete (see NcclBackend):
// `fail/<seq>` for the op itself, `broken/<b>` for the communicators it runs on (built at op
// `b`; none when the op builds its own), and a fingerprint under `op/<seq>/` that differs from
// this node's (the nodes' ranks submitted different ops: NCCL would hang on them, or mix them).
// The store is watched only once the op has run for kWatchAfter, so that an op that completes
// quickly costs the store nothing.
class PeerWord {
 public:
  // No store: a group on one node, nothing to watch.
  PeerWord(gradsync::Store* store, const core::CommunicatorSpec& spec, const core::Collective& op)
      : store_(store), spec_(spec), op_(op) {}

  /// The op runs on communicators built at op `built_at` (none: it builds its own).
  void RunsOn(std::optional<uint64_t> built_at) { built_at_ = built_at; }

  /// OK, or the reason another node's word gives: ABORTED (it failed the op or abandoned the
  /// communicators) or FAILED_PRECONDITION (desync).
  absl::Status Check() {
    if (store_ == nullptr) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (!fail_) {
      if (now - start_ < kWatchAfter) return absl::OkStatus();
      fail_.emplace(store_, spec_.job, FailKey(spec_, op_.seq), op_.deadline);
      if (built_at_) {
        broken_.emplace(store_, spec_.job, BrokenKey(spec_.run, spec_.group, *built_at_),
                        op_.deadline);
      }
      published_ = Tell(store_, spec_.job, spec_.run, OpKey(spec_.node), op_.fingerprint);
    }
    std::optional<std::string> failed = fail_->value();
    std::optional<std::string> broken = broken_ ? broken_->value() : std::nullopt;
    // A desync says more than another node's failure, which it may well have caused.
    if (failed || broken || now >= next_compare_) {
      next_compare_ = now + kCompareEvery;
      if (absl::Status s = CompareFingerprints(); !s.ok()) {
        desync_ = true;  // the other node finds the same, from this node's fingerprint
        return s;
      }
    }
    if (failed) {
      heard_fail_ = true;
      return absl::AbortedError(absl::StrCat("another node failed this op: ", *failed));
    }
    if (broken) {
      heard_ = true;
      return absl::AbortedError(
          absl::StrCat("another node abandoned the group's NCCL communicators: ", *broken));
    }
    return absl::OkStatus();
  }
  /// Whether the op failed because of another node's word.
  bool heard() const { return heard_ || heard_fail_ || desync_; }
  /// Whether the other nodes know already, or find out by themselves, that this op failed.
  bool others_know() const { return heard_fail_ || desync_; }

  /// The op is over: a fingerprint published for an op that completed is of no more use.
  /// After a failure it stays, for the nodes still comparing (failures are few).
  void Finished(const absl::Status& result) {
    if (published_ && result.ok()) (void)store_->Delete(spec_.job, OpKey(spec_.node));
  }

 private:
  static constexpr absl::Duration kCompareEvery = absl::Milliseconds(50);

  std::string OpKey(absl::string_view node) const {
    return absl::StrCat(Keys(spec_.run, spec_.group), "op/", op_.seq, "/", node);
  }

  // The fingerprints other nodes have published for this op, against this node's.
  absl::Status CompareFingerprints() {
    absl::StatusOr<std::vector<std::string>> keys = store_->List(spec_.job, OpKey(""));
    if (!keys.ok()) return absl::OkStatus();  // nothing published yet
    for (const std::string& key : *keys) {
      const std::string node = key.substr(OpKey("").size());
      if (node == spec_.node || compared_.count(node)) continue;
      // Already past: no waiting for a key its node has deleted meanwhile (its op completed).
      absl::StatusOr<std::string> theirs = store_->Get(spec_.job, key, absl::InfinitePast());
      if (!theirs.ok()) continue;
      compared_.insert(node);
      if (*theirs != op_.fingerprint) {
        return absl::FailedPreconditionError(
            absl::StrCat("desync across nodes in ", op_.label, ": node ", spec_.node, " has ",
                         op_.fingerprint, " but node ", node, " has ", *theirs));
      }
    }
    return absl::OkStatus();
  }

  gradsync::Store* const store_;
  const core::CommunicatorSpec& spec_;
  const core::Collective& op_;
  std::optional<uint64_t> built_at_;
  const absl::Time start_ = absl::Now();
  absl::Time next_compare_ = absl::InfinitePast();
  std::optional<StoreKey> fail_, broken_;
  std::set<std::string> compared_;  // nodes whose fingerprint matched
  bool published_ = false;
  bool heard_ = false, heard_fail_ = false, desync_ = false;
};

}  // namespace

/// The engine's handle on one group's NCCL collectives; the NCCL state itself lives in the
/// backend (NcclBackend::Comms) so that it outlives this object.
class NcclCommunicator final : public core::Communicator {
 public:
  NcclCommunicator(NcclBackend* backend, core::CommunicatorSpec spec)
      : backend_(backend), api_(backend->api_), spec_(std::move(spec)) {}

  absl::Status Run(const core::Collective& op) override {
    if (!Spanning() && !op.local_failure.ok()) return op.local_failure;
    std::shared_ptr<NcclBackend::Comms> c = backend_->LockedCommsFor(spec_.job, spec_.group);
    struct Unlock {
      absl::Mutex* mu;
      ~Unlock() { mu->Unlock(); }
    } unlock{&c->mu};
    if (c->kept_until != absl::InfinitePast()) {
      Log()->info("nccl communicators kept from the job's last run reused job={} group={}",
                  spec_.job, spec_.group);
      c->kept_until = absl::InfinitePast();
    }
    if (c->abort_requested.exchange(false)) {  // the job's communicators aborted while idle
      absl::Status why;
      {
        absl::MutexLock reason_lock(&c->reason_mu);
        why = c->abort_reason;
      }
      (void)backend_->AbortLocked(*c, why);
    }
    PeerWord peers(Spanning() ? spec_.rendezvous : nullptr, spec_, op);
    absl::Status s = RunLocked(*c, op, peers);
    peers.Finished(s);
    if (s.ok() || !Spanning()) return s;
    // This node is out of step with the others on this group now: its communicators go, and
    // the other nodes hear at once that this op failed rather than wait for it.
    if (!c->comms.empty()) (void)backend_->AbortLocked(*c, s);
    if (!peers.others_know()) {
      Tell(spec_.rendezvous, spec_.job, spec_.run, FailKey(spec_, op.seq),
           absl::StrCat(Who(), ": ", s.message()));
    }
    return s;
  }

 private:
  bool Spanning() const {
    return spec_.rendezvous != nullptr && spec_.local_members.size() != spec_.members.size();
  }
  // Whether group rank 0 is on this node (it makes the unique id).
  bool RootHere() const {
    return !spec_.local_members.empty() && spec_.local_members.front() == spec_.members.front();
  }
  // "node 10.0.0.2:7451 (ranks 2,3)": this node, in what it tells the others.
  std::string Who() const {
    return absl::StrCat("node ", spec_.node, " (ranks ", absl::StrJoin(spec_.local_members, ","),
                        ")");
  }

  absl::Status RunLocked(NcclBackend::Comms& c, const core::Collective& op, PeerWord& peers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    if (!op.local_failure.ok()) return op.local_failure;
    absl::StatusOr<std::vector<Member>> members = Members(op);
    if (!members.ok()) return members.status();
    if (members->empty()) return absl::OkStatus();
    std::vector<int> devices, ranks;
    for (const Member& m : *members) {
      devices.push_back(m.device);
      ranks.push_back(m.group_rank);
    }
    if (!c.comms.empty() &&
        (c.devices != devices || c.ranks != ranks || c.group_size != op.group_size)) {
      Log()->info("nccl layout changed job={} group={}: rebuilding", spec_.job, spec_.group);
      (void)backend_->AbortLocked(c, absl::AbortedError("its local ranks moved to other devices"));
    }
    if (c.comms.empty()) {
      if (absl::Status s = BuildLocked(c, op, *members, devices, peers); !s.ok()) return s;
    } else {
      peers.RunsOn(c.built_at);
    }
    for (int d : devices) {
      if (c.streams.count(d)) continue;
      absl::StatusOr<gpu::Stream> stream = api_->CreateStream(d);
      if (!stream.ok()) return Context(op, stream.status());
      c.streams[d] = *stream;
    }
    // The daemon's streams wait for the trainers' work on the buffers.
    for (const Member& m : *members) {
      for (const core::Run* r : {&m.in, HasOutput(op.kind) ? &m.out : nullptr}) {
        if (r == nullptr || r->buffer->ready_event() == nullptr) continue;
        if (absl::Status s =
                api_->StreamWaitEvent(m.device, c.streams[m.device], r->buffer->ready_event());
            !s.ok()) {
          return Context(op, s);
        }
      }
    }
    if (absl::Status s = Launch(c, op, *members); !s.ok()) {
      // Some ranks' kernels may be queued already: stopped, and gone, before the buffers go.
      return Context(op, WithDrain(s, backend_->AbortLocked(c, s)));
    }
    // Non-blocking communicators may still be putting the kernels on the streams after
    // ncclGroupEnd: until they are, neither the "done" events nor the streams say anything.
    if (absl::Status s =
            PollReady(c.comms, op.deadline, peers, "NCCL did not enqueue the op by its deadline");
        !s.ok()) {
      return Fail(c, op, s, peers);
    }
    // The trainers' streams may wait for this: record "done" on every written buffer.
    for (const Member& m : *members) {
      const core::Run& written = HasOutput(op.kind) ? m.out : m.in;
      if (written.buffer->done_event() == nullptr) continue;
      if (absl::Status e =
              api_->RecordEvent(m.device, written.buffer->done_event(), c.streams[m.device]);
          !e.ok()) {
        return Fail(c, op, e, peers);  // the kernels are queued: abort them before buffers go
      }
    }
    return WaitLocked(c, op, devices, peers);
  }

  static absl::Status Context(const core::Collective& op, const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat(op.label, ": ", s.message()));
  }
  // The op's failure `s`, saying so when the abort that followed left its streams busy.
  static absl::Status WithDrain(const absl::Status& s, const absl::Status& drained) {
    if (drained.ok()) return s;
    return absl::Status(s.code(), absl::StrCat(s.message(), " (", drained.message(), ")"));
  }

  // The unique id of the communicators op `op` builds: made here when the group's rank 0 is
  // local, otherwise fetched from the job's store, where that rank's node put it.
  absl::StatusOr<std::string> UniqueId(const core::Collective& op, const std::string& key,
                                       PeerWord& peers) {
    if (RootHere()) {
      absl::StatusOr<std::string> id = api_->NcclUniqueId();
      if (!id.ok()) return Context(op, id.status());
      if (Spanning()) {
        if (absl::Status s = spec_.rendezvous->Set(spec_.job, key, *id); !s.ok()) {
          return Context(op, s);
        }
      }
      return id;
    }
    if (spec_.rendezvous == nullptr) return absl::InternalError("no store to fetch the id");
    StoreKey id(spec_.rendezvous, spec_.job, key, op.deadline);
    Backoff backoff;
    while (true) {
      if (std::optional<std::string> v = id.value()) return *std::move(v);
      if (absl::Status s = peers.Check(); !s.ok()) return Context(op, s);
      if (absl::Now() > op.deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat(op.label, ": the NCCL id of group ", spec_.group,
                         " never came from the node of rank ", spec_.members.front()));
      }
      backoff.Pause();
    }
  }

  // Creates the group's communicators on this node, one per local member, through one
  // ncclGroupStart/End.
  absl::Status BuildLocked(NcclBackend::Comms& c, const core::Collective& op,
                           const std::vector<Member>& members, const std::vector<int>& devices,
                           PeerWord& peers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    absl::StatusOr<std::string> id = UniqueId(op, IdKey(spec_, op.seq), peers);
    if (!id.ok()) return id.status();
    backend_->DropKeptOn(devices, spec_.job);  // their GPU memory is this job's now
    std::vector<gpu::Comm> comms;
    absl::Status s = api_->NcclGroupStart();
    for (size_t i = 0; s.ok() && i < members.size(); ++i) {
      absl::StatusOr<gpu::Comm> comm =
          api_->NcclCommInitRank(members[i].device, op.group_size, *id, members[i].group_rank);
      ++backend_->comm_inits_;
      if (comm.ok()) {
        comms.push_back(*comm);
      } else {
        s = comm.status();
      }
    }
    if (absl::Status end = api_->NcclGroupEnd(); s.ok()) s = end;
    if (s.ok()) {  // non-blocking init
      s = PollReady(comms, op.deadline, peers,
                    absl::StrCat("NCCL communicators of group ", spec_.group, " (", op.group_size,
                                 " ranks) not ready by the deadline: a peer node never joined"));
    }
    if (!s.ok()) {
      for (gpu::Comm comm : comms) (void)api_->NcclCommAbort(comm);
      return Context(op, s);
    }
    c.comms = std::move(comms);
    c.devices = devices;
    c.ranks.clear();
    for (const Member& m : members) c.ranks.push_back(m.group_rank);
    c.group_size = op.group_size;
    if (Spanning() && RootHere() && c.id_built_at) {
      // Every node has its communicators from that id, or gave up on them: it is done.
      (void)spec_.rendezvous->Delete(spec_.job, IdKey(spec_, *c.id_built_at));
    }
    if (Spanning() && RootHere()) c.id_built_at = op.seq;
    c.built_at = op.seq;
    if (c.aborted && backend_->options_.counters != nullptr) {
      backend_->options_.counters->nccl_rebuilds.fetch_add(1);
    }
    c.aborted = false;
    c.store = Spanning() ? spec_.rendezvous : nullptr;
    c.run = spec_.run;
    c.node = Who();
    Log()->info("nccl communicators ready job={} group={} ranks={} local={} devices={}", spec_.job,
                spec_.group, op.group_size, members.size(), absl::StrJoin(devices, ","));
    return absl::OkStatus();
  }

  absl::Status Launch(NcclBackend::Comms& c, const core::Collective& op,
                      const std::vector<Member>& members) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    absl::Status s = api_->NcclGroupStart();
    for (size_t i = 0; s.ok() && i < members.size(); ++i) {
      const Member& m = members[i];
      gpu::NcclCall call;
      call.kind = op.kind;
      call.reduce_op = op.reduce_op;
      call.dtype = op.dtype;
      call.send = m.in.data;
      call.recv = HasOutput(op.kind) ? m.out.data : m.in.data;
      call.count = op.count;
      call.root = op.root;
      call.comm = c.comms[i];
      call.stream = c.streams[m.device];
      s = api_->NcclCollective(call);
    }
    if (absl::Status end = api_->NcclGroupEnd(); s.ok()) s = end;
    return s;
  }

  // Polls `comms` until all are ready (OK), one reports an error (that error), another node
  // gives up on the op (its word), or `deadline` passes (DEADLINE_EXCEEDED with `late`).
  // Non-blocking communicators leave ncclInProgress after initialising and after each
  // ncclGroupEnd.
  absl::Status PollReady(const std::vector<gpu::Comm>& comms, absl::Time deadline, PeerWord& peers,
                         absl::string_view late) {
    Backoff backoff;
    while (true) {
      bool ready = true;
      for (gpu::Comm comm : comms) {
        absl::StatusOr<bool> r = api_->NcclCommReady(comm);
        if (!r.ok()) return r.status();
        ready = ready && *r;
      }
      if (ready) return absl::OkStatus();
      if (absl::Status s = peers.Check(); !s.ok()) return s;
      if (absl::Now() > deadline) return absl::DeadlineExceededError(late);
      backoff.Pause();
    }
  }

  // Until the streams have run the op: an async NCCL error, a job-wide abort, another node's
  // word or the deadline abort the communicators and fail the op.
  absl::Status WaitLocked(NcclBackend::Comms& c, const core::Collective& op,
                          const std::vector<int>& devices, PeerWord& peers)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    Backoff backoff;
    while (true) {
      bool done = true;
      for (int d : devices) {
        absl::StatusOr<bool> r = api_->StreamDone(d, c.streams[d]);
        if (!r.ok()) return Fail(c, op, r.status(), peers);
        done = done && *r;
      }
      if (done) return absl::OkStatus();
      for (gpu::Comm comm : c.comms) {
        absl::StatusOr<bool> r = api_->NcclCommReady(comm);
        if (!r.ok()) return Fail(c, op, r.status(), peers);
      }
      if (c.abort_requested.exchange(false)) {
        absl::Status why;
        {
          absl::MutexLock reason_lock(&c.reason_mu);
          why = c.abort_reason;
        }
        const absl::Status drained = backend_->AbortLocked(c, why);
        return Context(op, WithDrain(absl::AbortedError(absl::StrCat(
                                         "aborted with the job's other NCCL communicators on "
                                         "this node: ",
                                         why.message())),
                                     drained));
      }
      if (absl::Status s = peers.Check(); !s.ok()) return Fail(c, op, s, peers);
      if (absl::Now() > op.deadline) {
        return Fail(c, op,
                    absl::DeadlineExceededError(
                        "did not complete by its deadline (a peer never entered it, or hung)"),
                    peers);
      }
      backoff.Pause();
    }
  }

  // Aborts the group's communicators on this node, and the job's others with them unless the
  // op failed on another node's word (that node has told the other groups itself).
  absl::Status Fail(NcclBackend::Comms& c, const core::Collective& op, const absl::Status& why,
                    const PeerWord& peers) ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) {
    const absl::Status status = Context(op, why);
    Log()->warn(
        "nccl op failed, aborting {} job={} error={}",
        peers.heard() ? "the group's communicators" : "the job's communicators on this node",
        spec_.job, status.ToString());
    const absl::Status drained = backend_->AbortLocked(c, status);
    if (!peers.heard()) backend_->AbortJob(spec_.job, status);
    return WithDrain(status, drained);
  }

  NcclBackend* const backend_;
  gpu::GpuApi* const api_;
  const core::CommunicatorSpec spec_;
};

NcclBackend::NcclBackend(gpu::GpuApi* api, NcclOptions options) : api_(api), options_(options) {
  if (options_.watch_every <= absl::ZeroDuration()) return;
  watchdog_ = std::thread([this] {
    while (!stop_.WaitForNotificationWithTimeout(options_.watch_every)) WatchIdle();
  });
}

void NcclBackend::WatchIdle() {
  const absl::Time now = absl::Now();
  DropKept("their time is up", [now](const Comms& c) { return now > c.kept_until; });
  for (auto& c : Listed("")) {
    if (!c->mu.TryLock()) continue;  // running an op, which watches its communicators itself
    absl::Status failed;
    for (gpu::Comm comm : c->comms) {
      if (absl::StatusOr<bool> r = api_->NcclCommReady(comm); !r.ok()) {
        failed = absl::Status(r.status().code(),
                              absl::StrCat("idle NCCL communicators of job=", c->job,
                                           " group=", c->group, " failed: ", r.status().message()));
        break;
      }
    }
    if (!failed.ok()) {  // idle: no kernels to stop on the job's other groups
      Log()->warn("aborting the group's communicators on this node job={} group={} error={}",
                  c->job, c->group, failed.ToString());
      (void)AbortLocked(*c, failed);
    }
    c->mu.Unlock();
  }
}

void NcclBackend::DropKeptOn(const std::vector<int>& devices, const std::string& job) {
  DropKept("another job needs their GPUs", [&](const Comms& c) {
    return c.job != job && std::any_of(c.devices.begin(), c.devices.end(), [&](int d) {
             return std::find(devices.begin(), devices.end(), d) != devices.end();
           });
  });
}

void NcclBackend::DropKept(absl::string_view why, const std::function<bool(const Comms&)>& which) {
  for (auto& c : Listed("")) {
    if (!c->mu.TryLock()) continue;  // running an op: not kept
    if (c->kept_until != absl::InfinitePast() && which(*c)) {
      Log()->info("nccl communicators kept after their job ended dropped ({}) job={} group={}",
                  std::string(why), c->job, c->group);
      DropLocked(*c, absl::OkStatus());
    }
    c->mu.Unlock();
  }
}

void NcclBackend::StopWatchdog() {
  if (watchdog_.joinable()) {
    stop_.Notify();
    watchdog_.join();
  }
}

NcclBackend::~NcclBackend() {
  StopWatchdog();
  std::map<std::pair<std::string, std::string>, std::shared_ptr<Comms>> all;
  {
    absl::MutexLock lock(&mu_);  // never held while taking a Comms::mu (ops hold those first)
    all.swap(comms_);
  }
  for (auto& [key, c] : all) {
    absl::MutexLock c_lock(&c->mu);
    c->store = nullptr;  // the daemon is going: nobody to tell
    (void)AbortLocked(*c, absl::OkStatus());
    DestroyStreamsLocked(*c);
  }
}

absl::StatusOr<std::shared_ptr<core::Communicator>> NcclBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  return std::make_shared<NcclCommunicator>(this, spec);
}

std::shared_ptr<NcclBackend::Comms> NcclBackend::CommsFor(const std::string& job,
                                                          const std::string& group) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Comms>& c = comms_[{job, group}];
  if (!c) {
    c = std::make_shared<Comms>();
    c->job = job;
    c->group = group;
  }
  return c;
}

std::shared_ptr<NcclBackend::Comms> NcclBackend::LockedCommsFor(const std::string& job,
                                                                const std::string& group) {
  while (true) {
    std::shared_ptr<Comms> c = CommsFor(job, group);
    c->mu.Lock();
    if (!c->erased) return c;
    c->mu.Unlock();  // dropped meanwhile: a fresh one is in comms_ now
  }
}

std::vector<std::shared_ptr<NcclBackend::Comms>> NcclBackend::Listed(const std::string& job) {
  std::vector<std::shared_ptr<Comms>> listed;
  absl::MutexLock lock(&mu_);
  for (auto& [key, c] : comms_) {
    if (job.empty() || key.first == job) listed.push_back(c);
  }
  return listed;
}

void NcclBackend::DropLocked(Comms& c, const absl::Status& why) {
  (void)AbortLocked(c, why);
  DestroyStreamsLocked(c);
  absl::MutexLock lock(&mu_);
  auto it = comms_.find({c.job, c.group});
  if (it != comms_.end() && it->second.get() == &c) comms_.erase(it);
  c.erased = true;
}

absl::Status NcclBackend::AbortLocked(Comms& c, const absl::Status& why) {
  if (c.comms.empty()) return absl::OkStatus();
  if (c.store != nullptr) {
    Tell(c.store, c.job, c.run, BrokenKey(c.run, c.group, c.built_at),
         absl::StrCat(c.node, ": ", why.message()));
  }
  c.aborted = true;
  if (options_.counters != nullptr) options_.counters->nccl_aborts.fetch_add(c.comms.size());
  for (gpu::Comm comm : c.comms) {
    // A non-blocking communicator may answer ncclInProgress: the abort goes on in NCCL's
    // background, and its kernels may still be on the streams (hence DrainLocked).
    if (absl::Status s = api_->NcclCommAbort(comm); !s.ok()) {
      Log()->warn("ncclCommAbort failed error={}", s.ToString());
    }
  }
  c.comms.clear();
  c.devices.clear();
  c.ranks.clear();
  c.group_size = 0;
  return DrainLocked(c);
}

absl::Status NcclBackend::DrainLocked(Comms& c) {
  const absl::Time start = absl::Now();
  Backoff backoff;
  std::vector<int> busy;
  while (true) {
    busy.clear();
    for (const auto& [device, stream] : c.streams) {
      absl::StatusOr<bool> done = api_->StreamDone(device, stream);
      if (!done.ok()) {  // a failed stream runs nothing more
        Log()->warn("stream failed after abort job={} group={} device={} error={}", c.job, c.group,
                    device, done.status().ToString());
        continue;
      }
      if (!*done) busy.push_back(device);
    }
    if (busy.empty()) return absl::OkStatus();
    if (absl::Now() - start >= options_.abort_drain) break;
    backoff.Pause();
  }
  const std::string devices = absl::StrJoin(busy, ",");
  Log()->error(
      "nccl streams still busy after abort, abandoned job={} group={} devices={} waited={}: the "
      "op's buffers are released while aborted kernels may still use them",
      c.job, c.group, devices, absl::FormatDuration(options_.abort_drain));
  // Abandoned: the next op gets fresh streams rather than queueing behind kernels that may never
  // end (cudaStreamDestroy returns at once and frees the stream once its work is done).
  DestroyStreamsLocked(c);
  return absl::InternalError(absl::StrCat("the streams of device(s) ", devices, " were still busy ",
                                          absl::FormatDuration(options_.abort_drain),
                                          " after ncclCommAbort; abandoned"));
}

void NcclBackend::DestroyStreamsLocked(Comms& c) {
  for (const auto& [device, stream] : c.streams) (void)api_->DestroyStream(device, stream);
  c.streams.clear();
}

void NcclBackend::AbortJob(const std::string& job, const absl::Status& reason) {
  for (auto& c : Listed(job)) {
    {
      absl::MutexLock reason_lock(&c->reason_mu);
      c->abort_reason = reason;
    }
    if (c->mu.TryLock()) {  // idle: abort now
      (void)AbortLocked(*c, reason);
      c->mu.Unlock();
    } else {  // running an op (possibly the caller's own): it aborts when it next polls
      c->abort_requested = true;
    }
  }
}

void NcclBackend::JobEnded(const std::string& job) {
  for (auto& c : Listed(job)) {
    absl::MutexLock lock(&c->mu);
    if (c->erased) continue;
    if (options_.keep_after_job > absl::ZeroDuration() && !c->comms.empty() &&
        c->store == nullptr) {  // on this node alone: kept for a restart
      c->kept_until = absl::Now() + options_.keep_after_job;
      Log()->info("nccl communicators kept for a restart job={} group={} for={}", job, c->group,
                  absl::FormatDuration(options_.keep_after_job));
      continue;
    }
    // Other nodes still in the run hear that these communicators are gone (not after the run
    // is over at the root: see Tell).
    DropLocked(*c, absl::UnavailableError("the job's trainers on this node have left"));
  }
}

namespace {

class DispatchCommunicator final : public core::Communicator {
 public:
  DispatchCommunicator(core::CommunicatorSpec spec, core::Backend* cpu, core::Backend* gpu)
      : spec_(std::move(spec)), cpu_backend_(cpu), gpu_backend_(gpu) {}

  absl::Status Run(const core::Collective& op) override {
    bool host = false, device = false;
    for (const core::LocalMember& m : op.local) {
      for (const core::View* v : {&m.input, &m.output}) {
        for (const core::Run& r : *v) {
          (r.buffer != nullptr && r.buffer->device() >= 0 ? device : host) = true;
        }
      }
    }
    if (host && device) {
      return absl::InvalidArgumentError(
          absl::StrCat(op.label, ": an op takes host or device buffers, not both"));
    }
    // The engine chose the plane (for a failed op: the one the group's other nodes run it on).
    device = op.plane == core::Plane::kDevice;
    std::shared_ptr<core::Communicator>& target = device ? gpu_ : cpu_;
    if (!target) {
      absl::StatusOr<std::shared_ptr<core::Communicator>> made =
          (device ? gpu_backend_ : cpu_backend_)->CreateCommunicator(spec_);
      if (!made.ok()) return made.status();
      target = *std::move(made);
    }
    return target->Run(op);
  }

 private:
  const core::CommunicatorSpec spec_;
  core::Backend* const cpu_backend_;
  core::Backend* const gpu_backend_;
  // A group's ops run one at a time (Communicator contract): no lock needed.
  std::shared_ptr<core::Communicator> cpu_, gpu_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<core::Communicator>> DispatchBackend::CreateCommunicator(
    const core::CommunicatorSpec& spec) {
  return std::make_shared<DispatchCommunicator>(spec, cpu_, gpu_);
}

}  // namespace gradsync::backend::nccl
