// Trainer sessions: Engine::Register (a rank joins its job, which is made on its first rank),
// Unregister (a rank leaves: its groups break, the job ends with its last rank), the buffers a
// session maps (RegisterBuffer, DeregisterBuffer) and ListSessions.
#include <algorithm>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "common/bounded_text.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/store_keys.h"
#include "daemon/core/engine.h"

namespace gradsync::core {
namespace {

auto Log() { return logging::Logger("core"); }

constexpr int kMaxWorldSize = 1 << 16;

// The request's own fields: the job's id and epoch, the rank's placement.
absl::Status CheckPlacement(const v1::RegisterRequest& req) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(req.job()));
  if (req.elastic()) {
    GRADSYNC_RETURN_IF_ERROR(ElasticBase(req.job(), req.epoch()).status());
  } else if (req.epoch() != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("job ", req.job(), ": an epoch (", req.epoch(), ") goes with elastic jobs"));
  }
  if (req.world_size() < 1 || req.world_size() > kMaxWorldSize || req.rank() < 0 ||
      req.rank() >= req.world_size() || req.local_world_size() < 1 ||
      req.local_world_size() > req.world_size() || req.local_rank() < 0 ||
      req.local_rank() >= req.local_world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad placement: need 0 <= rank < world_size <= ", kMaxWorldSize,
                     " and 0 <= local_rank < local_world_size <= world_size; got rank=", req.rank(),
                     " world_size=", req.world_size(), " local_rank=", req.local_rank(),
                     " local_world_size=", req.local_world_size()));
  }
  return absl::OkStatus();
}

// Whether `req` may join `job` as it stands on this node: the same shape, root and epoch, no
// rank lost, one user's trainers, its rank and local rank free.
absl::Status CheckJoin(const internal::Job& job, const v1::RegisterRequest& req,
                       std::optional<uint32_t> uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu) {
  if (job.spans_nodes && job.root_address != req.root_address()) {
    return absl::InvalidArgumentError(absl::StrCat("job ", job.id, " has root_address ",
                                                   job.root_address, "; rank ", req.rank(),
                                                   " says ", req.root_address()));
  }
  if (job.world_size != req.world_size() || job.local_world_size != req.local_world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "job ", job.id, " has world_size=", job.world_size,
        " local_world_size=", job.local_world_size, "; rank ", req.rank(),
        " says world_size=", req.world_size(), " local_world_size=", req.local_world_size()));
  }
  if (job.elastic != req.elastic() || job.epoch != req.epoch()) {
    auto says = [](bool elastic, int epoch) {
      return elastic ? absl::StrCat("elastic at epoch ", epoch) : std::string("not elastic");
    };
    return absl::InvalidArgumentError(
        absl::StrCat("job ", job.id, " is ", says(job.elastic, job.epoch), "; rank ", req.rank(),
                     " says ", says(req.elastic(), req.epoch())));
  }
  if (!job.departed.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job.id, " lost rank(s) ", JoinBounded(job.departed, ","),
        "; it can start again once its remaining ", job.attached, " session(s) have ended"));
  }
  for (const Session* other : job.ranks) {  // one user's trainers per job on a node
    if (other != nullptr && other->uid.has_value() && other->uid != uid) {
      return absl::PermissionDeniedError(
          absl::StrCat("job ", job.id, " is held by another user's trainers on this node (uid ",
                       *other->uid, "); rank ", req.rank(), " of uid ",
                       uid.has_value() ? absl::StrCat(*uid) : "unknown", " refused"));
    }
  }
  if (Session* other = job.ranks[req.rank()]) {
    return absl::AlreadyExistsError(absl::StrCat("rank ", req.rank(), " of job ", job.id,
                                                 " is already registered (session ", other->id,
                                                 ")"));
  }
  if (int other = job.local_ranks[req.local_rank()]; other >= 0) {
    return absl::AlreadyExistsError(absl::StrCat("local_rank ", req.local_rank(), " of job ",
                                                 job.id, " is already taken by rank ", other));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::shared_ptr<Session>> Engine::Register(const v1::RegisterRequest& req,
                                                          std::optional<uint32_t> uid) {
  GRADSYNC_RETURN_IF_ERROR(CheckPlacement(req));
  const bool spans = req.local_world_size() != req.world_size();
  // A job spanning nodes names its root daemon, whose store it uses, unless every daemon
  // reaches the job's store itself (etcd).
  if (spans && req.root_address().empty() && !(resolve_store_ && resolve_store_("").ok())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", req.job(), " spans nodes (world_size=", req.world_size(),
        " local_world_size=", req.local_world_size(),
        ") but names no root_address (host:port of the daemon holding rank 0); the daemons' "
        "store is embedded (--store=etcd needs none)"));
  }
  bool start_formation = false;
  std::shared_ptr<Job> started;
  absl::MutexLock lock(&mu_);
  if (shutdown_) return absl::UnavailableError("daemon is shutting down");
  if (sessions_ >= options_.max_sessions) {
    return absl::ResourceExhaustedError(absl::StrCat("the daemon holds ", sessions_,
                                                     " trainer sessions, the limit "
                                                     "(--max_sessions); job ",
                                                     req.job(), " rank ", req.rank(), " refused"));
  }
  if (spans && node_address_.empty()) {
    return absl::FailedPreconditionError(
        "this daemon has no TCP listener (--port=-1), so it cannot join a job spanning nodes");
  }
  // The job's last run here may still be ending (its launched device ops finishing, then its
  // store namespace deleted): this run starts after, so none of its keys goes with the last's.
  if (ending_.contains(req.job())) {
    auto ended = [this, &req]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return shutdown_ || !ending_.contains(req.job());
    };
    if (!mu_.AwaitWithTimeout(absl::Condition(&ended), kRestartWait)) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", req.job(),
                       "'s last run is still ending on this node (its launched GPU ops "
                       "finish or fail by their deadlines) after ",
                       absl::FormatDuration(kRestartWait), "; start it again once it has"));
    }
    if (shutdown_) return absl::UnavailableError("daemon is shutting down");
  }
  if (!jobs_.contains(req.job())) {
    gradsync::Store* root_store = nullptr;
    if (spans) {
      absl::StatusOr<gradsync::Store*> store =
          resolve_store_ ? resolve_store_(req.root_address())
                         : absl::StatusOr<gradsync::Store*>(
                               absl::FailedPreconditionError("this daemon reaches no peers"));
      if (!store.ok()) {
        return absl::Status(store.status().code(), absl::StrCat("job store at ", req.root_address(),
                                                                ": ", store.status().message()));
      }
      root_store = *store;
    }
    jobs_[req.job()] = std::make_shared<Job>(req.job(), req.world_size(), req.local_world_size(),
                                             spans ? req.root_address() : "", root_store,
                                             req.elastic(), req.epoch());
  }
  std::shared_ptr<Job>& slot = jobs_[req.job()];
  Job& job = *slot;
  absl::MutexLock job_lock(&job.mu);
  GRADSYNC_RETURN_IF_ERROR(CheckJoin(job, req, uid));
  auto session =
      std::make_shared<Session>(absl::StrCat(job.id, "/", req.rank(), "#", next_session_++), slot,
                                req.rank(), req.local_rank());
  session->uid = uid;  // before it is published
  job.ranks[req.rank()] = session.get();
  job.local_ranks[req.local_rank()] = req.rank();
  ++job.attached;
  ++sessions_;
  if (job.spans_nodes && job.attached == job.local_world_size &&
      job.formation == Job::Formation::kLocal) {
    job.formation = Job::Formation::kForming;
    start_formation = true;
    started = slot;
  }
  Log()->info("session opened job={} rank={} local_rank={} world_size={} session={}", job.id,
              req.rank(), req.local_rank(), req.world_size(), session->id);
  if (start_formation) {
    pool_->Schedule([this, started, node = node_address_] { StartFormation(started, node); });
  }
  return session;
}

const std::string& Engine::SessionId(const Session& session) { return session.id; }

void Engine::NoteTrainerLost(Session& session, absl::string_view reason) {
  const std::shared_ptr<Job> job = session.job;
  if (job->membership == nullptr) return;
  {
    absl::MutexLock lock(&job->mu);
    internal::AssertSessionOf(*job, session);
    if (!session.attached || job->node.empty() || job->node_of_rank.empty()) return;  // unformed
    job->lost_nodes.emplace(job->node, absl::StrCat("node ", job->node, " (its trainer of rank ",
                                                    session.rank, " is gone: ", reason, ")"));
    // Else the decision on its way takes this node too.
    if (!job->membership->BeginDeciding()) return;
  }
  // Now, before the session ends (its job's end must find the decision there): one store
  // round trip, when a trainer of an elastic job dies.
  DecideMembership(job);
}

void Engine::Unregister(Session& session, absl::string_view reason, End how) {
  if (how == End::kLost) NoteTrainerLost(session, reason);
  Completions out;
  bool job_ended = false;
  const std::shared_ptr<Job>& job = session.job;
  {
    absl::MutexLock lock(&mu_);
    absl::MutexLock job_lock(&job->mu);
    internal::AssertSessionOf(*job, session);
    if (!session.attached) return;
    session.attached = false;
    job->ranks[session.rank] = nullptr;
    job->local_ranks[session.local_rank] = -1;
    --job->attached;
    --sessions_;
    if (job->attached > 0) {
      job->departed.push_back(session.rank);
      const std::string why =
          absl::StrCat("rank ", session.rank, " left job ", job->id, " (", reason, ")");
      for (auto& [key, group] : job->groups) {
        if (!std::binary_search(group->members.begin(), group->members.end(), session.rank)) {
          continue;
        }
        internal::AssertGroupOf(*job, *group);
        group->broken = why;
        FailAllPendingLocked(*group, why, out);
      }
    } else {
      BreakGroupsLocked(*job, "job ended", out);
      auto it = jobs_.find(job->id);
      if (it != jobs_.end() && it->second == job) jobs_.erase(it);
      job_ended = true;
      if (on_job_end_) ending_.insert(job->id);  // with the erase: no new run slips in between
    }
  }
  {
    absl::MutexLock lock(&session.mu);
    session.ended = true;
    buffers_.fetch_sub(static_cast<int64_t>(session.buffers.size()));
    for (auto& [id, buffer] : session.buffers) {
      if (buffer.use) buffer.use->Deregistered();  // or when its op in flight is answered
    }
    session.buffers.clear();  // unmapped now, or when the last op using them finishes
  }
  Log()->info("session closed job={} rank={} session={} reason={}", job->id, session.rank,
              session.id, std::string(reason));
  for (auto& fn : out) fn();
  if (job_ended) {
    Log()->info("job ended job={}", job->id);
    if (job->membership != nullptr) job->membership->End();
    if (peer_watch_ != nullptr) peer_watch_->Unwatch(job->id);  // its peers see it left
    if (on_job_end_) {
      EpochEnd elastic;
      if (job->elastic && job->root_store != nullptr) {
        if (absl::StatusOr<std::string> base = ElasticBase(job->id, job->epoch); base.ok()) {
          elastic.base = *std::move(base);
          elastic.epoch = job->epoch;
          absl::MutexLock lock(&job->mu);
          elastic.held_rank0 = !job->node_of_rank.empty() && job->node_of_rank[0] == job->node;
        }
      }
      EndJobLater(job->id, job->root_store, elastic);
      if (!elastic.base.empty()) {
        // A decision of its next membership keeps its namespace (server.cc) for survivors that
        // have not read it yet; the next epoch's end deletes it, else this, once no op could
        // still wait for it.
        timer_.Schedule(absl::Now() + options_.default_op_timeout,
                        [this, elastic, store = job->root_store] {
                          pool_->Schedule([this, elastic, store] { EndAbandoned(elastic, store); });
                        });
      }
    }
  }
}

void Engine::EndAbandoned(const EpochEnd& elastic, gradsync::Store* store) {
  // An epoch of the job runs: a later one, or one of a new run of the same id.
  bool runs = false;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, job] : jobs_) runs = runs || IsEpochOf(id, elastic.base);
    for (const std::string& id : ending_) runs = runs || IsEpochOf(id, elastic.base);
  }
  for (const std::string& id : ReleasedWhenAbandoned(elastic, runs)) EndKeptEpoch(id, store);
}

void Engine::EndKeptEpoch(const std::string& id, gradsync::Store* store) {
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_ || jobs_.contains(id) || ending_.contains(id)) return;  // running again
  }
  EpochMembership::DropDecision(*store, id);
  on_job_end_(id);
}

void Engine::EndJobLater(const std::string& id, gradsync::Store* store, EpochEnd elastic) {
  std::vector<std::thread> finished;  // their on_job_end_ has returned: joined outside the lock
  {
    absl::MutexLock lock(&mu_);
    for (auto it = job_ends_.begin(); it != job_ends_.end();) {
      // A thread of this id is done too: the job's new run registered after it.
      if (it->first != id && ending_.contains(it->first)) {
        ++it;
        continue;
      }
      finished.push_back(std::move(it->second));
      job_ends_.erase(it++);
    }
    job_ends_[id] = std::thread([this, id, store, elastic = std::move(elastic)] {
      // Read before the end: a namespace without a decision goes with it.
      const absl::StatusOr<bool> decided = elastic.base.empty()
                                               ? absl::StatusOr<bool>(false)
                                               : EpochMembership::HasDecision(*store, id);
      on_job_end_(id);
      for (const std::string& released : ReleasedAtEnd(elastic, decided)) {
        EndKeptEpoch(released, store);
      }
      absl::MutexLock lock(&mu_);
      ending_.erase(id);
    });
  }
  for (std::thread& t : finished) t.join();
}

absl::StatusOr<uint64_t> Engine::RegisterBuffer(Session& session,
                                                const v1::RegisterBufferRequest& req) {
  if (req.dtype() != v1::DTYPE_UNSPECIFIED && DTypeSize(req.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", req.dtype()));
  }
  // What names the memory: the shm object, or the CUDA allocation, the offset in it and the
  // registration's "ready" event (device memory may be registered once per op in flight on
  // it, each registration with events of its own: the daemon maps the allocation once).
  const std::string handle =
      req.has_cuda()
          ? absl::StrCat("cuda:dev", req.cuda().device(), ":",
                         absl::BytesToHexString(req.cuda().mem_handle()), "+", req.cuda().offset(),
                         " ready=", absl::BytesToHexString(req.cuda().ready_event()))
          : (req.fd_token().empty() ? req.shm_name() : absl::StrCat("memfd:", req.fd_token()));
  {
    absl::MutexLock lock(&session.mu);
    if (session.ended) return absl::FailedPreconditionError("session has ended");
    if (static_cast<int>(session.buffers.size()) >= options_.max_buffers_per_session) {
      return absl::ResourceExhaustedError(
          absl::StrCat("session has ", session.buffers.size(),
                       " buffers, the most allowed (--max_buffers_per_session)"));
    }
    for (const auto& [id, buffer] : session.buffers) {
      if (buffer.handle == handle) {
        return absl::AlreadyExistsError(
            absl::StrCat(handle, " is already registered as buffer ", id));
      }
    }
  }
  // The node's count is taken before mapping and given back if the buffer is not kept.
  if (buffers_.fetch_add(1) >= options_.max_buffers) {
    const int64_t held = buffers_.fetch_sub(1) - 1;
    return absl::ResourceExhaustedError(absl::StrCat(
        "the daemon holds ", held, " buffers of all sessions, the limit (--max_buffers)"));
  }
  // Map without the session lock: mapping a large object takes a while.
  absl::StatusOr<std::unique_ptr<MappedBuffer>> imported = importer_->Import(req);
  absl::MutexLock lock(&session.mu);
  if (!imported.ok() || session.ended) {
    buffers_.fetch_sub(1);
    if (!imported.ok()) return imported.status();
    return absl::FailedPreconditionError("session has ended");
  }
  std::shared_ptr<MappedBuffer> mapping = *std::move(imported);
  const uint64_t id = session.next_buffer_id++;
  Log()->debug("buffer registered session={} id={} {}", session.id, id, mapping->Describe());
  std::shared_ptr<Session::DeviceUse> use;
  if (mapping->ready_event() != nullptr || mapping->done_event() != nullptr) {
    use = std::make_shared<Session::DeviceUse>(mapping);
  }
  session.buffers.emplace(id,
                          Session::Buffer{std::move(mapping), req.dtype(), handle, std::move(use)});
  return id;
}

absl::Status Engine::DeregisterBuffer(Session& session, uint64_t buffer_id,
                                      std::function<void()> released) {
  std::shared_ptr<Session::DeviceUse> use;
  {
    absl::MutexLock lock(&session.mu);
    auto it = session.buffers.find(buffer_id);
    if (it == session.buffers.end()) {
      return absl::NotFoundError(
          absl::StrCat("buffer ", buffer_id, " is not registered in this session"));
    }
    use = it->second.use;
    session.buffers.erase(it);
  }
  buffers_.fetch_sub(1);
  Log()->debug("buffer deregistered session={} id={}", session.id, buffer_id);
  // Its events are the trainer's to destroy once `released` runs: every op that named it has
  // been answered and has settled on the device.
  if (use) {
    use->Deregistered(std::move(released));
  } else if (released) {
    released();
  }
  return absl::OkStatus();
}

void Engine::Settle(Session& session, std::function<void(absl::Status)> done) {
  session.settlements->Await(std::move(done));
}

std::vector<Engine::SessionInfo> Engine::ListSessions() const {
  std::vector<SessionInfo> out;
  absl::MutexLock lock(&mu_);
  for (const auto& [id, job] : jobs_) {
    absl::MutexLock job_lock(&job->mu);
    for (Session* s : job->ranks) {
      if (s == nullptr) continue;
      SessionInfo info{s->id, job->id, s->rank, s->local_rank, job->world_size, 0, 0};
      absl::MutexLock session_lock(&s->mu);
      info.buffers = static_cast<int>(s->buffers.size());
      for (const auto& [bid, b] : s->buffers) info.mapped_bytes += b.mapping->size();
      out.push_back(std::move(info));
    }
  }
  std::sort(out.begin(), out.end(), [](const SessionInfo& x, const SessionInfo& y) {
    return std::tie(x.job, x.rank) < std::tie(y.job, y.rank);
  });
  return out;
}

bool Engine::HoldsNamespace(absl::string_view ns) const {
  absl::MutexLock lock(&mu_);
  if (ending_.contains(ns)) return true;
  bool held = false;
  ForEachJobHoldingLocked(ns, [&](Job&) { held = true; });
  return held;
}

absl::flat_hash_set<uint32_t> Engine::HolderUids(absl::string_view ns) const {
  absl::flat_hash_set<uint32_t> uids;
  absl::MutexLock lock(&mu_);
  ForEachJobHoldingLocked(ns, [&](Job& job) {
    absl::MutexLock job_lock(&job.mu);
    for (const Session* s : job.ranks) {
      if (s != nullptr && s->uid.has_value()) uids.insert(*s->uid);
    }
  });
  return uids;
}

void Engine::ForEachJobHoldingLocked(absl::string_view ns, absl::FunctionRef<void(Job&)> f) const {
  for (const auto& [id, job] : jobs_) {
    bool holds = id == ns;
    if (!holds && job->elastic && job->epoch > 0) {  // an elastic job's home (epoch 0's id)
      absl::StatusOr<std::string> base = ElasticBase(id, job->epoch);
      holds = base.ok() && *base == ns;
    }
    if (holds) f(*job);
  }
}

}  // namespace gradsync::core
