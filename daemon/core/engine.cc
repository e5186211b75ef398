// The submit path: Engine::Submit takes a member's op, has it resolved (resolve.h), hands it
// to its group's matcher (matcher.h) under the job's mutex and carries out what the matcher
// decided: answers, deadline timers, failures sent to other nodes, and Drain, which runs a
// group's matched ops in sequence order. Also the engine's life (construction, Shutdown).
#include "daemon/core/engine.h"

#include <algorithm>
#include <atomic>

#include "absl/strings/str_cat.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "daemon/core/inspect.h"
#include "daemon/core/matcher.h"
#include "daemon/core/resolve.h"

namespace gradsync::core {
namespace {

auto Log() { return logging::Logger("core"); }

// Stands in for the transport's sink while an op is in flight: the session's count of ops in
// flight drops when the outcome is sent, or when the engine lets go of the op unanswered.
// It also holds the events of the device buffers the op names (Session::DeviceUse) until then.
class InFlightSink final : public SessionSink {
 public:
  InFlightSink(std::shared_ptr<Session> session, std::shared_ptr<SessionSink> inner,
               std::vector<std::shared_ptr<Session::DeviceUse>> uses, std::optional<Turn> turn)
      : session_(std::move(session)),
        inner_(std::move(inner)),
        uses_(std::move(uses)),
        settlement_(turn ? std::exchange(turn->settlement, nullptr) : nullptr),
        turn_(std::move(turn)) {}
  ~InFlightSink() override { Release(); }
  void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) override {
    if (settlement_) settlement_->Answered(status);
    Release();
    inner_->OpDone(tag, seq, status);
  }

 private:
  void Release() {
    if (released_.exchange(true)) return;
    for (const auto& use : uses_) use->Done();
    if (turn_) turn_->order->Done(turn_->index);  // answered: launched, or failed
    // The op's record settles once the data plane lets the op go (it holds it from here).
    settlement_.reset();
    session_->ops_in_flight.fetch_sub(1);
  }

  const std::shared_ptr<Session> session_;
  const std::shared_ptr<SessionSink> inner_;
  const std::vector<std::shared_ptr<Session::DeviceUse>> uses_;
  std::shared_ptr<Settlements::Op> settlement_;  // until the answer
  const std::optional<Turn> turn_;               // its place in the order (no settlement)
  std::atomic<bool> released_{false};
};

// Takes the events of every device buffer `op` names for it: FAILED_PRECONDITION, taking
// none, when ops of another group still in flight hold one of them; NOT_FOUND (as Resolve
// says it) for a buffer not registered, so that none registered meanwhile is used untaken.
absl::StatusOr<std::vector<std::shared_ptr<Session::DeviceUse>>> TakeDeviceBuffers(
    Session& session, const v1::OpRequest& op) {
  std::vector<std::shared_ptr<Session::DeviceUse>> taken;
  absl::MutexLock lock(&session.mu);
  std::vector<uint64_t> ids;
  for (const auto* segments : {&op.input(), &op.output()}) {
    for (const v1::Segment& segment : *segments) ids.push_back(segment.buffer_id());
  }
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  for (uint64_t id : ids) {
    auto it = session.buffers.find(id);
    if (it == session.buffers.end()) {
      for (const auto& held : taken) held->Done();
      return absl::NotFoundError(absl::StrCat(
          internal::OpLabel(op.kind(), session.job->id, op.group()), " rank=", session.rank,
          ": buffer ", id, " is not registered in this session"));
    }
    if (!it->second.use) continue;
    Session::DeviceUse& use = *it->second.use;
    absl::MutexLock use_lock(&use.mu);
    if (use.ops > 0 && use.group != op.group()) {
      for (const auto& held : taken) held->Done();
      return absl::FailedPreconditionError(absl::StrCat(
          "buffer ", id, " (", it->second.mapping->Describe(), ") is named by an op of group ",
          use.group,
          " still in flight: a device buffer's ready/done events serve one group's "
          "ops at a time (register the memory again for ops of other groups that may overlap)"));
    }
    use.group = op.group();
    ++use.ops;
    taken.push_back(it->second.use);
  }
  return taken;
}

// Answers one member's op after the locks are released.
void Answer(std::vector<std::function<void()>>& out, std::shared_ptr<SessionSink> sink,
            uint64_t tag, uint64_t seq, absl::Status status) {
  out.push_back([sink = std::move(sink), tag, seq, status = std::move(status)] {
    sink->OpDone(tag, seq, status);
  });
}

}  // namespace

Engine::Engine(Backend* backend, BufferImporter* importer, WorkerPool* pool, EngineOptions options,
               JobEndCallback on_job_end, StoreResolver resolve_store)
    : backend_(backend),
      importer_(importer),
      pool_(pool),
      options_(options),
      on_job_end_(std::move(on_job_end)),
      resolve_store_(std::move(resolve_store)) {
  if (options_.stall_warn > absl::ZeroDuration()) {
    timer_.Schedule(absl::Now() + absl::Seconds(1), [this] { SweepStalls(); });
  }
}

void Engine::SetNodeAddress(std::string address) {
  absl::MutexLock lock(&mu_);
  node_address_ = std::move(address);
}

void Engine::SetPeerWatch(PeerWatch* watch) { peer_watch_ = watch; }

Engine::~Engine() {
  Shutdown();
  // The jobs still ending finish their end (their launched device ops, their store namespace)
  // while everything they touch is still there.
  absl::flat_hash_map<std::string, std::thread> ends;
  {
    absl::MutexLock lock(&mu_);
    ends.swap(job_ends_);
  }
  for (auto& [job, thread] : ends) thread.join();
}

absl::StatusOr<Engine::Group*> Engine::GetGroupLocked(Job& job, const std::vector<int>& members,
                                                      const std::string& key) {
  auto it = job.groups.find(key);
  if (it != job.groups.end()) return it->second.get();
  CommunicatorSpec spec;
  spec.job = job.id;
  spec.group = key;
  spec.members = members;
  spec.local_members = members;
  std::vector<int> local_group_ranks;
  bool spans_nodes = false;
  if (job.spans_nodes) {  // formed: every rank's node is known
    spec.local_members.clear();
    for (size_t i = 0; i < members.size(); ++i) {
      const std::string& node = job.node_of_rank[members[i]];
      spec.member_nodes.push_back(node);
      if (node == job.node) {
        spec.local_members.push_back(members[i]);
        local_group_ranks.push_back(static_cast<int>(i));
      }
    }
    spec.node = job.node;
    spec.rendezvous = job.root_store;
    spec.run = job.run;
    spec.elastic = job.elastic;
    spans_nodes = spec.local_members.size() != members.size();
    if (job.elastic && spans_nodes) {
      absl::StatusOr<std::string> home = ElasticBase(job.id, job.epoch);
      if (home.ok()) spec.elastic_home = *std::move(home);
      spec.epoch = job.epoch;
    }
  } else {
    for (size_t i = 0; i < members.size(); ++i) local_group_ranks.push_back(static_cast<int>(i));
  }
  GRADSYNC_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, backend_->CreateCommunicator(spec));
  auto group = std::make_unique<Group>(&job, key, members, std::move(local_group_ranks),
                                       spans_nodes, std::move(comm));
  internal::AssertGroupOf(job, *group);
  // Ranks that left before the group existed break it too, and so do nodes lost before.
  for (int r : job.departed) {
    if (std::binary_search(members.begin(), members.end(), r)) {
      group->broken = absl::StrCat("rank ", r, " left job ", job.id);
    }
  }
  for (const std::string& node : spec.member_nodes) {
    if (auto lost = job.lost_nodes.find(node); lost != job.lost_nodes.end()) {
      group->broken = lost->second;
    }
  }
  Log()->debug("group created job={} group={} size={}", job.id, key, members.size());
  return job.groups.emplace(key, std::move(group)).first->second.get();
}

void Engine::EnqueueRemoteLocked(Group& group, Ready ready, Completions& out) {
  ready.remote = true;
  group.ready.push_back(std::move(ready));
  if (!group.running) {
    group.running = true;
    std::shared_ptr<Job> job = group.job->shared_from_this();
    Group* g = &group;
    out.push_back([this, job, g] { pool_->Schedule([this, job, g] { Drain(job, g, true); }); });
  }
}

void Engine::FailPendingLocked(Group& group, uint64_t seq, const absl::Status& status,
                               Completions& out, bool send_to_other_nodes) {
  internal::FailedPending failed = internal::Fail(group, seq, status, options_);
  for (DeadlineTimer::Id id : failed.disarm) timer_.Cancel(id);
  for (auto& [sink, tag] : failed.to) Answer(out, std::move(sink), tag, seq, status);
  if (failed.for_other_nodes.has_value() && send_to_other_nodes) {
    EnqueueRemoteLocked(group, *std::move(failed.for_other_nodes), out);
  }
}

void Engine::FailAllPendingLocked(Group& group, const std::string& why, Completions& out,
                                  bool send_to_other_nodes) {
  while (!group.pending.empty()) {
    const auto& [seq, pending] = *group.pending.begin();
    FailPendingLocked(group, seq,
                      absl::UnavailableError(absl::StrCat(
                          internal::OpLabel(pending.fp.kind, group.job->id, group.key, seq),
                          " cannot complete: ", why)),
                      out, send_to_other_nodes);
  }
}

void Engine::Submit(const std::shared_ptr<Session>& session,
                    const std::shared_ptr<SessionSink>& transport, uint64_t tag,
                    const v1::OpRequest& op) {
  if (const int held = session->ops_in_flight.fetch_add(1);
      held >= options_.max_ops_in_flight_per_session) {
    session->ops_in_flight.fetch_sub(1);
    transport->OpDone(tag, 0,
                      absl::ResourceExhaustedError(absl::StrCat(
                          "session ", session->id, " has ", held,
                          " ops in flight, the limit (--max_ops_in_flight_per_session); wait "
                          "for some to finish")));
    return;
  }
  absl::StatusOr<std::vector<std::shared_ptr<Session::DeviceUse>>> uses =
      TakeDeviceBuffers(*session, op);
  if (!uses.ok()) {
    session->ops_in_flight.fetch_sub(1);
    transport->OpDone(tag, 0, uses.status());
    return;
  }
  // A device op takes its place in its trainer's order now, as submitted (submit_order.h).
  std::optional<Turn> turn;
  if (!uses->empty()) {
    turn = Turn{session->device_order, session->device_order->Add(),
                std::make_shared<Settlements::Op>(session->settlements)};
  }
  const std::shared_ptr<SessionSink> sink =
      std::make_shared<InFlightSink>(session, transport, *std::move(uses), turn);
  const std::shared_ptr<Job>& job = session->job;
  if (job->spans_nodes) {
    absl::Status failed;
    {
      absl::MutexLock lock(&job->mu);
      if (job->formation == Job::Formation::kFailed) {
        failed = job->formation_error;
      } else if (job->formation != Job::Formation::kFormed) {
        if (job->parked.empty() && job->formation != Job::Formation::kReplaying) {
          // Formation may take no longer than the first op waiting for it.
          const absl::Duration timeout = op.timeout_ms() > 0 ? absl::Milliseconds(op.timeout_ms())
                                                             : options_.default_op_timeout;
          timer_.Schedule(absl::Now() + timeout, [this, weak = std::weak_ptr<Job>(job), timeout] {
            // Off the timer's thread: it asks the store who is missing.
            pool_->Schedule([this, weak, timeout] { OnFormationDeadline(weak, timeout); });
          });
        }
        job->parked.push_back({session, sink, tag, op, turn});  // replayed in order once formed
        return;
      }
    }
    if (!failed.ok()) {
      sink->OpDone(tag, 0, failed);
      return;
    }
  }
  SubmitNow(session, sink, tag, op, turn);
}

void Engine::SubmitNow(const std::shared_ptr<Session>& session,
                       const std::shared_ptr<SessionSink>& sink, uint64_t tag,
                       const v1::OpRequest& op, std::optional<Turn> turn) {
  absl::StatusOr<Arrival> resolved = internal::Resolve(*session, op, options_);
  if (!resolved.ok()) {
    sink->OpDone(tag, 0, resolved.status());
    return;
  }
  resolved->turn = std::move(turn);
  resolved->session = session;
  resolved->sink = sink;
  resolved->tag = tag;
  const std::shared_ptr<Job>& job = session->job;
  Completions out;
  Group* group = nullptr;
  bool drain = false;
  {
    absl::MutexLock lock(&job->mu);
    internal::AssertSessionOf(*job, *session);
    absl::StatusOr<Group*> found;
    if (!session->attached) {
      Answer(out, sink, tag, 0, absl::FailedPreconditionError("session has ended"));
    } else if (found = GetGroupLocked(*job, resolved->members, resolved->group_key); !found.ok()) {
      Answer(out, sink, tag, 0, found.status());
    } else {
      group = *found;
      internal::AssertGroupOf(*job, *group);
      drain = ArriveLocked(*group, session->next_seq[group->key], *std::move(resolved), out);
    }
  }
  for (auto& fn : out) fn();
  if (drain) Drain(job, group, /*on_pool=*/false);
}

bool Engine::ArriveLocked(Group& group, uint64_t& next_seq, Arrival arrival, Completions& out) {
  const std::shared_ptr<SessionSink> sink = arrival.sink;
  const uint64_t tag = arrival.tag;
  const std::weak_ptr<Job> weak_job = arrival.session->job;
  internal::Arrived arrived = internal::Arrive(group, next_seq, std::move(arrival));
  const uint64_t seq = arrived.seq;
  switch (arrived.outcome) {
    case internal::Arrived::Outcome::kWaiting:
      if (arrived.arm_deadline.has_value()) {
        Group* g = &group;
        internal::KeepTimer(group, seq,
                            timer_.Schedule(*arrived.arm_deadline, [this, weak_job, g, seq] {
                              OnDeadline(weak_job, g, seq);
                            }));
      }
      return false;
    case internal::Arrived::Outcome::kMatched:
      for (DeadlineTimer::Id id : arrived.disarm) timer_.Cancel(id);
      return arrived.start_drain;
    case internal::Arrived::Outcome::kAnswered:
      Answer(out, sink, tag, seq, arrived.status);
      if (arrived.for_other_nodes.has_value()) {
        EnqueueRemoteLocked(group, *std::move(arrived.for_other_nodes), out);
      }
      return false;
    case internal::Arrived::Outcome::kDesync:
      Log()->warn("{}", std::string(arrived.status.message()));
      if (options_.counters != nullptr) options_.counters->desyncs.fetch_add(1);
      Answer(out, sink, tag, seq, arrived.status);
      FailPendingLocked(group, seq, arrived.status, out);
      return false;
  }
  return false;
}

void Engine::OnDeadline(const std::weak_ptr<Job>& weak, Group* group, uint64_t seq) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;  // the group went with its job
  Completions out;
  {
    absl::MutexLock lock(&job->mu);
    internal::AssertGroupOf(*job, *group);
    std::optional<absl::Status> expired = internal::Expire(*group, seq, absl::Now());
    if (!expired.has_value()) return;
    Log()->warn("{}", std::string(expired->message()));
    if (options_.counters != nullptr) options_.counters->deadline_expiries.fetch_add(1);
    FailPendingLocked(*group, seq, *expired, out);
  }
  for (auto& fn : out) fn();
}

void Engine::Drain(std::shared_ptr<Job> job, Group* group, bool on_pool) {
  // A run of consecutive ready host-plane ops that wait on other daemons goes to the
  // communicator in one call (their exchanges overlap on the wire), bounded so that the first's
  // members are told soon and a batch's buffers stay small. Device-plane ops run one by one.
  constexpr size_t kMaxBatchOps = 256;
  constexpr int64_t kMaxBatchBytes = 32 << 20;
  for (;;) {
    std::vector<Ready> batch;
    {
      absl::MutexLock lock(&job->mu);
      if (group->ready.empty()) {
        group->running = false;
        return;
      }
      if (!on_pool &&
          (group->ready.front().remote || group->ready.front().bytes > options_.inline_bytes)) {
        pool_->Schedule([this, job, group] { Drain(job, group, /*on_pool=*/true); });
        return;
      }
      int64_t batch_bytes = 0;
      do {
        batch_bytes += group->ready.front().bytes;
        batch.push_back(std::move(group->ready.front()));
        group->ready.pop_front();
        batch.back().started = absl::Now();
      } while (batch.front().remote && batch.front().op.plane == Plane::kHost &&
               !group->ready.empty() && group->ready.front().remote &&
               group->ready.front().op.plane == Plane::kHost && batch.size() < kMaxBatchOps &&
               batch_bytes + group->ready.front().bytes <= kMaxBatchBytes);
      group->running_ops = absl::MakeSpan(batch);
    }
    // Each op goes to the history (and leaves ListOps) as soon as it finishes; its members are
    // answered when the batch has finished (answering each op at once woke the trainers 200
    // times during a 200-op batch and made it 10-15 % slower on two cores).
    // An op the communicator never reports is failed, never answered OK with its buffers as
    // they were.
    std::vector<absl::Status> statuses(
        batch.size(), absl::InternalError("the data plane did not report the op's outcome"));
    auto finished = [&](size_t i, absl::Status status) {
      Ready& r = batch[i];
      {
        // Before the members hear of it: history never lags the trainers.
        const absl::Time now = absl::Now();
        absl::MutexLock lock(&job->mu);
        internal::AssertGroupOf(*job, *group);
        group->running_ops = absl::MakeSpan(batch).subspan(i + 1);
        if (r.record) {
          NoteFinished(*group, options_, r.seq, r.fp, r.plane, r.bytes, r.queued, r.started, now,
                       status);
        }
      }
      statuses[i] = std::move(status);
    };
    std::vector<const Collective*> ops;
    for (const Ready& r : batch) ops.push_back(&r.op);
    group->comm->RunBatch(ops, finished);  // of one op: the same as Run, in every communicator
    {
      absl::MutexLock lock(&job->mu);
      group->running_ops = {};  // every op finished (the batch goes now)
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      const Ready& r = batch[i];
      const absl::Status& status = statuses[i];
      if (!status.ok()) {
        Log()->warn("op failed {} status={}", r.op.label, status.ToString());
      } else {
        Log()->trace("op done {} count={}", r.op.label, r.op.count);
      }
      for (auto& [sink, tag] : r.to) sink->OpDone(tag, r.seq, status);
    }
  }
}

void Engine::BreakGroupsLocked(Job& job, const std::string& reason, Completions& out) {
  for (auto& [key, group] : job.groups) {
    internal::AssertGroupOf(job, *group);
    group->broken = reason;
    while (!group->pending.empty()) {
      FailPendingLocked(*group, group->pending.begin()->first, absl::UnavailableError(reason), out,
                        /*send_to_other_nodes=*/false);
    }
  }
}

void Engine::Shutdown() {
  Completions out;
  {
    absl::MutexLock lock(&mu_);
    shutdown_ = true;
    for (auto& [id, job] : jobs_) {
      absl::MutexLock job_lock(&job->mu);
      BreakGroupsLocked(*job, "daemon is shutting down", out);
    }
  }
  for (auto& fn : out) fn();
}

}  // namespace gradsync::core
