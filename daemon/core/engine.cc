#include "daemon/core/engine.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <tuple>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded_text.h"
#include "common/group.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace gradsync::core {
namespace {

auto Log() { return logging::Logger("core"); }

constexpr size_t kMaxNameLength = 256;
constexpr int kMaxWorldSize = 1 << 16;

absl::string_view KindName(v1::OpKind kind) {
  switch (kind) {
    case v1::ALL_REDUCE:
      return "all_reduce";
    case v1::BROADCAST:
      return "broadcast";
    case v1::BARRIER:
      return "barrier";
    case v1::ALL_GATHER:
      return "all_gather";
    case v1::REDUCE_SCATTER:
      return "reduce_scatter";
    default:
      return "unknown_op";
  }
}

absl::string_view ReduceName(v1::ReduceOp op) {
  switch (op) {
    case v1::SUM:
      return "sum";
    case v1::MEAN:
      return "mean";
    case v1::MIN:
      return "min";
    case v1::MAX:
      return "max";
    default:
      return "none";
  }
}

bool Reduces(v1::OpKind kind) { return kind == v1::ALL_REDUCE || kind == v1::REDUCE_SCATTER; }

// What every member's k-th op of a group must agree on.
struct Fingerprint {
  v1::OpKind kind = v1::OP_KIND_UNSPECIFIED;
  v1::ReduceOp reduce_op = v1::REDUCE_OP_UNSPECIFIED;
  DType dtype = v1::DTYPE_UNSPECIFIED;
  int64_t count = 0;
  int root = 0;
  std::string name;

  bool operator==(const Fingerprint& o) const {
    return kind == o.kind && reduce_op == o.reduce_op && dtype == o.dtype && count == o.count &&
           root == o.root && name == o.name;
  }
  std::string Describe() const {
    std::string out = absl::StrCat(KindName(kind), "(");
    if (Reduces(kind)) absl::StrAppend(&out, ReduceName(reduce_op), ", ");
    if (kind != v1::BARRIER) absl::StrAppend(&out, DTypeName(dtype), ", count=", count, ", ");
    if (kind == v1::BROADCAST) absl::StrAppend(&out, "root=", root, ", ");
    absl::StrAppend(&out, "name='", name, "')");
    return out;
  }
};

}  // namespace

class Session {
 public:
  struct Buffer {
    std::shared_ptr<MappedBuffer> mapping;
    DType dtype;
    std::string handle;  // what the trainer registered it by (its shm name)
  };

  Session(std::string id, std::shared_ptr<internal::Job> job, int rank, int local_rank)
      : id(std::move(id)), job(std::move(job)), rank(rank), local_rank(local_rank) {}

  const std::string id;
  const std::shared_ptr<internal::Job> job;
  const int rank;
  const int local_rank;

  absl::Mutex mu;
  absl::flat_hash_map<uint64_t, Buffer> buffers ABSL_GUARDED_BY(mu);
  uint64_t next_buffer_id ABSL_GUARDED_BY(mu) = 1;
  bool ended ABSL_GUARDED_BY(mu) = false;

  // Guarded by job->mu.
  absl::flat_hash_map<std::string, uint64_t> next_seq;  // per group key
  bool attached = true;

  // Ops submitted whose outcome the session has not been sent yet (Engine::Submit).
  std::atomic<int> ops_in_flight{0};
};

namespace {

// Stands in for the transport's sink while an op is in flight: the session's count of ops in
// flight drops when the outcome is sent, or when the engine lets go of the op unanswered.
class InFlightSink final : public SessionSink {
 public:
  InFlightSink(std::shared_ptr<Session> session, std::shared_ptr<SessionSink> inner)
      : session_(std::move(session)), inner_(std::move(inner)) {}
  ~InFlightSink() override { Release(); }
  void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) override {
    Release();
    inner_->OpDone(tag, seq, status);
  }

 private:
  void Release() {
    if (!released_.exchange(true)) session_->ops_in_flight.fetch_sub(1);
  }

  const std::shared_ptr<Session> session_;
  const std::shared_ptr<SessionSink> inner_;
  std::atomic<bool> released_{false};
};

}  // namespace

namespace internal {

// One member's submission of an op, resolved against its session's buffers.
struct Arrival {
  std::shared_ptr<Session> session;
  std::shared_ptr<SessionSink> sink;
  uint64_t tag = 0;
  Fingerprint fp;
  std::string group_key;
  std::vector<int> members;
  int group_rank = 0;
  View input, output;
  std::vector<std::shared_ptr<MappedBuffer>> pins;  // keep the mappings while the op lives
  int64_t bytes = 0;                                // moved per member
  absl::Duration timeout;
  absl::Time deadline;
};

// Op k of a group while not every member has submitted it.
struct Pending {
  Fingerprint fp;
  int first_rank = 0;
  std::vector<std::optional<Arrival>> by_member;  // by group rank
  int arrived = 0;
  absl::Time deadline = absl::InfiniteFuture();
  absl::Duration timeout;
  std::vector<DeadlineTimer::Id> timers;
  absl::Time queued;  // the first local member's submission
  Plane plane = Plane::kHost;
  int64_t bytes = 0;
  bool stall_warned = false;
};

// Op k of a group, matched, waiting for op k-1 to finish.
struct Ready {
  bool remote = false;  // waits on other daemons: never run on the submitting thread
  Collective op;
  uint64_t seq = 0;
  std::vector<std::pair<std::shared_ptr<SessionSink>, uint64_t>> to;  // (sink, tag)
  std::vector<std::shared_ptr<MappedBuffer>> pins;
  int64_t bytes = 0;
  // For history, ListOps and stall warnings.
  Fingerprint fp;
  absl::Time queued, started;
  Plane plane = Plane::kHost;
  bool record = true;  // false: a verdict already recorded here, carried to the other nodes
  bool stall_warned = false;
};

// One finished op in a group's history ring.
struct HistorySlot {
  uint64_t seq = 0;
  Fingerprint fp;
  int64_t bytes = 0;
  Plane plane = Plane::kHost;
  absl::Time queued, started, finished;
  absl::Status outcome;
};

// An op that failed before it could run, kept for the members that have not submitted it yet.
struct Failed {
  absl::Status status;
  int remaining;  // members still to be told
};

struct Group {
  Job* job = nullptr;  // owner
  std::string key;
  std::vector<int> members;
  std::vector<int> local_group_ranks;  // group ranks of the members attached here, ascending
  bool spans_nodes = false;
  std::shared_ptr<Communicator> comm;
  std::map<uint64_t, Pending> pending;
  std::map<uint64_t, Failed> failed;
  std::deque<Ready> ready;
  bool running = false;  // a Drain owns `ready`
  Plane last_plane = Plane::kHost;  // of the last op matched here (for ops failed before)
  std::string broken;    // non-empty once a member left: every op fails with it
  // The op a Drain popped and runs outside the lock (its local); set and cleared under the
  // job's mutex, so readers holding it may look at it.
  Ready* running_op = nullptr;
  // The last EngineOptions::history_size finished ops: a ring filled in place, so recording
  // an op allocates nothing once it is full (a fingerprint name past the SSO aside).
  std::vector<HistorySlot> history;
  uint64_t history_written = 0;
};

struct Job : std::enable_shared_from_this<Job> {
  Job(std::string id, int world_size, int local_world_size, std::string root_address,
      gradsync::Store* root_store)
      : id(std::move(id)),
        world_size(world_size),
        local_world_size(local_world_size),
        spans_nodes(local_world_size < world_size),
        root_address(std::move(root_address)),
        root_store(root_store),
        ranks(world_size, nullptr),
        local_ranks(local_world_size, -1) {}

  const std::string id;
  const int world_size;
  const int local_world_size;
  // Jobs spanning nodes: the daemons find each other through the root daemon's store, where
  // each publishes which ranks it holds; ops wait (parked, in order) until all have.
  const bool spans_nodes;
  const std::string root_address;
  gradsync::Store* const root_store;
  enum class Formation { kLocal, kForming, kReplaying, kFormed, kFailed };
  struct Parked {
    std::shared_ptr<Session> session;
    std::shared_ptr<SessionSink> sink;
    uint64_t tag;
    v1::OpRequest op;
  };
  absl::Mutex mu;
  std::vector<Session*> ranks ABSL_GUARDED_BY(mu);   // attached session by global rank
  std::vector<int> local_ranks ABSL_GUARDED_BY(mu);  // global rank by local rank, -1: free
  int attached ABSL_GUARDED_BY(mu) = 0;
  std::vector<int> departed ABSL_GUARDED_BY(mu);  // ranks that left while others stayed
  Formation formation ABSL_GUARDED_BY(mu) = Formation::kLocal;
  absl::Status formation_error ABSL_GUARDED_BY(mu);
  std::string run ABSL_GUARDED_BY(mu);                        // once formed
  std::vector<std::string> node_of_rank ABSL_GUARDED_BY(mu);  // once formed
  std::string node ABSL_GUARDED_BY(mu);                       // this daemon's, once formed
  std::deque<Parked> parked ABSL_GUARDED_BY(mu);
  absl::flat_hash_map<std::string, std::unique_ptr<Group>> groups ABSL_GUARDED_BY(mu);
};

}  // namespace internal

using internal::Failed;

namespace {

// Whether `a` names device buffers (true), host buffers (false) or none (nullopt).
std::optional<bool> OnDevice(const internal::Arrival& a) {
  for (const View* v : {&a.input, &a.output}) {
    for (const Run& r : *v) {
      if (r.buffer != nullptr) return r.buffer->device() >= 0;
    }
  }
  return std::nullopt;
}

Plane PlaneOf(std::optional<bool> on_device) {
  return on_device.value_or(false) ? Plane::kDevice : Plane::kHost;
}

// An op that failed on this node before it could run, as the other nodes of its group must
// hear of it (the local members are told directly).
internal::Ready FailedOp(const internal::Group& group, uint64_t seq, const Fingerprint& fp,
                         absl::Time deadline, const absl::Status& status,
                         std::optional<bool> on_device) {
  internal::Ready r;
  r.seq = seq;
  r.op.kind = fp.kind;
  r.op.dtype = fp.dtype;
  r.op.group_size = static_cast<int>(group.members.size());
  r.op.deadline = deadline;
  r.op.label =
      absl::StrCat(KindName(fp.kind), " job=", group.job->id, " group=", group.key, " seq=", seq);
  r.op.fingerprint = absl::StrCat(fp.Describe(), " seq=", seq);
  r.op.local_failure = status;
  r.op.plane = on_device ? PlaneOf(on_device) : group.last_plane;
  r.record = false;
  return r;
}

// If op `seq` of the group failed before this member came, answers the member with that
// verdict (using up its part of the failed record) and returns true.
bool AnswerFailedLocked(internal::Group& group, uint64_t seq,
                        const std::shared_ptr<SessionSink>& sink, uint64_t tag,
                        std::vector<std::function<void()>>& out) {
  auto f = group.failed.find(seq);
  if (f == group.failed.end()) return false;
  out.push_back([sink, tag, seq, status = f->second.status] { sink->OpDone(tag, seq, status); });
  if (--f->second.remaining == 0) group.failed.erase(f);
  return true;
}

// Notes an op that finished on this node in its group's history ring and in the counters.
// The group's job mutex must be held.
void NoteFinished(internal::Group& group, const EngineOptions& options, uint64_t seq,
                  const Fingerprint& fp, Plane plane, int64_t bytes, absl::Time queued,
                  absl::Time started, absl::Time finished, const absl::Status& status) {
  if (options.history_size > 0) {
    const size_t size = static_cast<size_t>(options.history_size);
    if (group.history.size() < size) group.history.emplace_back();
    internal::HistorySlot& slot = group.history[group.history_written % size];
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

}  // namespace
using internal::Pending;
using internal::Ready;

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

Engine::~Engine() { Shutdown(); }

absl::StatusOr<std::shared_ptr<Session>> Engine::Register(const v1::RegisterRequest& req) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(req.job()));
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
  const bool spans = req.local_world_size() != req.world_size();
  if (spans && req.root_address().empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("job ", req.job(), " spans nodes (world_size=", req.world_size(),
                     " local_world_size=", req.local_world_size(),
                     ") but names no root_address (host:port of the daemon holding rank 0)"));
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
                                             spans ? req.root_address() : "", root_store);
  }
  std::shared_ptr<Job>& slot = jobs_[req.job()];
  Job& job = *slot;
  absl::MutexLock job_lock(&job.mu);
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
  if (!job.departed.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job ", job.id, " lost rank(s) ", JoinBounded(job.departed, ","),
        "; it can start again once its remaining ", job.attached, " session(s) have ended"));
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
  auto session =
      std::make_shared<Session>(absl::StrCat(job.id, "/", req.rank(), "#", next_session_++), slot,
                                req.rank(), req.local_rank());
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

void Engine::Unregister(Session& session, absl::string_view reason) {
  Completions out;
  bool job_ended = false;
  Job& job = *session.job;
  {
    absl::MutexLock lock(&mu_);
    absl::MutexLock job_lock(&job.mu);
    if (!session.attached) return;
    session.attached = false;
    job.ranks[session.rank] = nullptr;
    job.local_ranks[session.local_rank] = -1;
    --job.attached;
    --sessions_;
    if (job.attached > 0) {
      job.departed.push_back(session.rank);
      const std::string why =
          absl::StrCat("rank ", session.rank, " left job ", job.id, " (", reason, ")");
      for (auto& [key, group] : job.groups) {
        if (!std::binary_search(group->members.begin(), group->members.end(), session.rank)) {
          continue;
        }
        group->broken = why;
        while (!group->pending.empty()) {
          const uint64_t seq = group->pending.begin()->first;
          FailPendingLocked(*group, seq,
                            absl::UnavailableError(absl::StrCat(
                                KindName(group->pending.begin()->second.fp.kind), " job=", job.id,
                                " group=", key, " seq=", seq, " cannot complete: ", why)),
                            out);
        }
      }
    } else {
      for (auto& [key, group] : job.groups) {
        group->broken = "job ended";
        while (!group->pending.empty()) {
          FailPendingLocked(*group, group->pending.begin()->first,
                            absl::UnavailableError("job ended"), out, /*tell_peers=*/false);
        }
      }
      auto it = jobs_.find(job.id);
      if (it != jobs_.end() && it->second.get() == &job) jobs_.erase(it);
      job_ended = true;
    }
  }
  {
    absl::MutexLock lock(&session.mu);
    session.ended = true;
    buffers_.fetch_sub(static_cast<int64_t>(session.buffers.size()));
    session.buffers.clear();  // unmapped now, or when the last op using them finishes
  }
  Log()->info("session closed job={} rank={} session={} reason={}", job.id, session.rank,
              session.id, std::string(reason));
  for (auto& fn : out) fn();
  if (job_ended) {
    Log()->info("job ended job={}", job.id);
    if (on_job_end_) on_job_end_(job.id);
  }
}

absl::StatusOr<uint64_t> Engine::RegisterBuffer(Session& session,
                                                const v1::RegisterBufferRequest& req) {
  if (req.dtype() != v1::DTYPE_UNSPECIFIED && DTypeSize(req.dtype()) == 0) {
    return absl::InvalidArgumentError(absl::StrCat("unknown dtype ", req.dtype()));
  }
  // What names the memory: the shm object, or the CUDA allocation and the offset in it.
  const std::string handle =
      req.has_cuda()
          ? absl::StrCat("cuda:dev", req.cuda().device(), ":",
                         absl::BytesToHexString(req.cuda().mem_handle()), "+", req.cuda().offset())
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
  std::unique_ptr<MappedBuffer> mapping = *std::move(imported);
  const uint64_t id = session.next_buffer_id++;
  Log()->debug("buffer registered session={} id={} {}", session.id, id, mapping->Describe());
  session.buffers.emplace(id, Session::Buffer{std::move(mapping), req.dtype(), handle});
  return id;
}

absl::Status Engine::DeregisterBuffer(Session& session, uint64_t buffer_id) {
  absl::MutexLock lock(&session.mu);
  if (session.buffers.erase(buffer_id) == 0) {
    return absl::NotFoundError(
        absl::StrCat("buffer ", buffer_id, " is not registered in this session"));
  }
  buffers_.fetch_sub(1);
  Log()->debug("buffer deregistered session={} id={}", session.id, buffer_id);
  return absl::OkStatus();
}

absl::StatusOr<Engine::Arrival> Engine::Resolve(Session& session, const v1::OpRequest& op) {
  const Job& job = *session.job;
  Arrival a;
  Fingerprint& fp = a.fp;
  fp.kind = op.kind();
  const std::string what = absl::StrCat(KindName(op.kind()), " job=", job.id, " group=", op.group(),
                                        " rank=", session.rank, ": ");
  auto invalid = [&what](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(what, parts...));
  };
  if (!v1::OpKind_IsValid(op.kind()) || op.kind() == v1::OP_KIND_UNSPECIFIED) {
    return invalid("unknown op kind ", static_cast<int>(op.kind()));
  }
  const bool barrier = op.kind() == v1::BARRIER;
  const int64_t esize = barrier ? 1 : DTypeSize(op.dtype());
  if (!barrier) {
    if (esize == 0) return invalid("unknown dtype ", static_cast<int>(op.dtype()));
    fp.dtype = op.dtype();
  }
  if (Reduces(op.kind())) {
    if (op.reduce_op() < v1::SUM || op.reduce_op() > v1::MAX) {
      return invalid("needs a reduce_op (sum, mean, min, max); got ",
                     static_cast<int>(op.reduce_op()));
    }
    fp.reduce_op = op.reduce_op();
  }
  if (op.name().size() > kMaxNameLength) {
    return invalid("name longer than ", kMaxNameLength, " characters");
  }
  fp.name = op.name();
  if (op.timeout_ms() < 0 || absl::Milliseconds(op.timeout_ms()) > options_.max_op_timeout) {
    return invalid("timeout_ms ", op.timeout_ms(), " is not in [0, ",
                   absl::ToInt64Milliseconds(options_.max_op_timeout), "]");
  }
  if (op.input_size() + op.output_size() > options_.max_segments_per_op) {
    return invalid(op.input_size() + op.output_size(), " segments; at most ",
                   options_.max_segments_per_op, " per op");
  }

  // Group and membership.
  a.group_key = op.group().empty() ? std::string(kWorldGroup) : op.group();
  if (a.group_key == kWorldGroup) {
    for (int r = 0; r < job.world_size; ++r) a.members.push_back(r);
  } else {
    auto members = ParseGroupKey(a.group_key);
    if (!members.ok()) return invalid(members.status().message());
    a.members = *std::move(members);
    if (a.members.back() >= job.world_size) {
      return invalid("group names rank ", a.members.back(), " but the job has world_size ",
                     job.world_size);
    }
  }
  auto me = std::lower_bound(a.members.begin(), a.members.end(), session.rank);
  if (me == a.members.end() || *me != session.rank) {
    return invalid("rank ", session.rank, " is not a member of the group");
  }
  a.group_rank = static_cast<int>(me - a.members.begin());
  const int size = static_cast<int>(a.members.size());
  if (op.kind() == v1::BROADCAST) {
    if (op.root() < 0 || op.root() >= size) {
      return invalid("root ", op.root(), " is not a group rank in [0, ", size, ")");
    }
    fp.root = op.root();
  }

  // Segments against this session's buffers.
  struct Extent {
    uint64_t buffer;
    int64_t begin, end;
  };
  std::vector<Extent> extents;
  int64_t in_count = 0, out_count = 0;
  {
    absl::MutexLock lock(&session.mu);
    if (session.ended) return absl::FailedPreconditionError(absl::StrCat(what, "session ended"));
    auto resolve = [&](const google::protobuf::RepeatedPtrField<v1::Segment>& segments, View& view,
                       int64_t& total) -> absl::Status {
      for (const v1::Segment& seg : segments) {
        auto it = session.buffers.find(seg.buffer_id());
        if (it == session.buffers.end()) {
          return absl::NotFoundError(
              absl::StrCat(what, "buffer ", seg.buffer_id(), " is not registered in this session"));
        }
        const Session::Buffer& buffer = it->second;
        if (buffer.dtype != v1::DTYPE_UNSPECIFIED && buffer.dtype != op.dtype()) {
          return invalid("buffer ", seg.buffer_id(), " was registered as ", DTypeName(buffer.dtype),
                         " but the op is ", DTypeName(op.dtype()));
        }
        const int64_t size_bytes = buffer.mapping->size();
        if (seg.count() < 0 || seg.byte_offset() < 0 || seg.byte_offset() % esize != 0 ||
            seg.byte_offset() > size_bytes ||
            seg.count() > (size_bytes - seg.byte_offset()) / esize) {
          return invalid("segment (buffer ", seg.buffer_id(), ", byte_offset ", seg.byte_offset(),
                         ", count ", seg.count(), ") is outside the buffer's ", size_bytes,
                         " bytes or not aligned to the ", esize, "-byte element");
        }
        if (seg.count() == 0) continue;
        view.push_back(
            {buffer.mapping->data() + seg.byte_offset(), seg.count(), buffer.mapping.get()});
        extents.push_back(
            {seg.buffer_id(), seg.byte_offset(), seg.byte_offset() + seg.count() * esize});
        if (a.pins.empty() || a.pins.back() != buffer.mapping) a.pins.push_back(buffer.mapping);
        total += seg.count();
      }
      return absl::OkStatus();
    };
    GRADSYNC_RETURN_IF_ERROR(resolve(op.input(), a.input, in_count));
    GRADSYNC_RETURN_IF_ERROR(resolve(op.output(), a.output, out_count));
  }
  std::sort(extents.begin(), extents.end(), [](const Extent& x, const Extent& y) {
    return x.buffer != y.buffer ? x.buffer < y.buffer : x.begin < y.begin;
  });
  for (size_t i = 1; i < extents.size(); ++i) {
    if (extents[i].buffer == extents[i - 1].buffer && extents[i].begin < extents[i - 1].end) {
      return invalid("segments overlap in buffer ", extents[i].buffer, " (bytes [",
                     extents[i - 1].begin, ", ", extents[i - 1].end, ") and [", extents[i].begin,
                     ", ", extents[i].end, "))");
    }
  }

  switch (op.kind()) {
    case v1::ALL_REDUCE:
    case v1::BROADCAST:
      if (op.output_size() > 0) return invalid("works in place on `input`; `output` must be empty");
      fp.count = in_count;
      a.bytes = in_count * esize;
      break;
    case v1::BARRIER:
      if (op.input_size() + op.output_size() > 0) return invalid("takes no buffers");
      break;
    case v1::ALL_GATHER:
      if (out_count != in_count * size) {
        return invalid("output has ", out_count, " elements; needs input count ", in_count,
                       " x group size ", size);
      }
      fp.count = in_count;
      a.bytes = out_count * esize;
      break;
    case v1::REDUCE_SCATTER:
      if (in_count != out_count * size) {
        return invalid("input has ", in_count, " elements; needs output count ", out_count,
                       " x group size ", size);
      }
      fp.count = out_count;
      a.bytes = in_count * esize;
      break;
    default:
      break;
  }
  a.timeout =
      op.timeout_ms() > 0 ? absl::Milliseconds(op.timeout_ms()) : options_.default_op_timeout;
  a.deadline = absl::Now() + a.timeout;
  return a;
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
  auto group = std::make_unique<Group>();
  if (job.spans_nodes) {  // formed: every rank's node is known
    spec.local_members.clear();
    for (size_t i = 0; i < members.size(); ++i) {
      const std::string& node = job.node_of_rank[members[i]];
      spec.member_nodes.push_back(node);
      if (node == job.node) {
        spec.local_members.push_back(members[i]);
        group->local_group_ranks.push_back(static_cast<int>(i));
      }
    }
    spec.node = job.node;
    spec.rendezvous = job.root_store;
    spec.run = job.run;
    group->spans_nodes = spec.local_members.size() != members.size();
  } else {
    for (size_t i = 0; i < members.size(); ++i) {
      group->local_group_ranks.push_back(static_cast<int>(i));
    }
  }
  GRADSYNC_ASSIGN_OR_RETURN(std::shared_ptr<Communicator> comm, backend_->CreateCommunicator(spec));
  group->job = &job;
  group->key = key;
  group->members = members;
  group->comm = std::move(comm);
  // Ranks that left before the group existed break it too.
  for (int r : job.departed) {
    if (std::binary_search(members.begin(), members.end(), r)) {
      group->broken = absl::StrCat("rank ", r, " left job ", job.id);
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
                               Completions& out, bool tell_peers) {
  auto it = group.pending.find(seq);
  if (it == group.pending.end()) return;
  Pending& p = it->second;
  for (DeadlineTimer::Id id : p.timers) timer_.Cancel(id);
  const int remaining = static_cast<int>(group.local_group_ranks.size()) - p.arrived;
  std::optional<bool> on_device;
  for (std::optional<Arrival>& a : p.by_member) {
    if (!a.has_value()) continue;
    if (!on_device) on_device = OnDevice(*a);
    out.push_back([s = a->sink, tag = a->tag, seq, status] { s->OpDone(tag, seq, status); });
  }
  NoteFinished(group, options_, seq, p.fp, p.plane, p.bytes, p.queued, absl::InfinitePast(),
               absl::Now(), status);
  if (group.spans_nodes && tell_peers) {
    // The other nodes learn of it through the op's cross-node exchange (see Collective).
    EnqueueRemoteLocked(group, FailedOp(group, seq, p.fp, p.deadline, status, on_device), out);
  }
  group.pending.erase(it);
  if (remaining > 0) group.failed[seq] = Failed{status, remaining};
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
  const std::shared_ptr<SessionSink> sink = std::make_shared<InFlightSink>(session, transport);
  Job& job = *session->job;
  if (job.spans_nodes) {
    absl::Status failed;
    {
      absl::MutexLock lock(&job.mu);
      if (job.formation == Job::Formation::kFailed) {
        failed = job.formation_error;
      } else if (job.formation != Job::Formation::kFormed) {
        job.parked.push_back({session, sink, tag, op});  // replayed in order once formed
        return;
      }
    }
    if (!failed.ok()) {
      sink->OpDone(tag, 0, failed);
      return;
    }
  }
  SubmitNow(session, sink, tag, op);
}

void Engine::SubmitNow(const std::shared_ptr<Session>& session,
                       const std::shared_ptr<SessionSink>& sink, uint64_t tag,
                       const v1::OpRequest& op) {
  absl::StatusOr<Arrival> resolved = Resolve(*session, op);
  if (!resolved.ok()) {
    sink->OpDone(tag, 0, resolved.status());
    return;
  }
  Arrival& a = *resolved;
  a.session = session;
  a.sink = sink;
  a.tag = tag;
  Job& job = *session->job;
  Completions out;
  Group* group = nullptr;
  bool drain = false;
  {
    absl::MutexLock lock(&job.mu);
    absl::Status refused;
    if (!session->attached) {
      refused = absl::FailedPreconditionError("session has ended");
    } else if (auto g = GetGroupLocked(job, a.members, a.group_key); !g.ok()) {
      refused = g.status();
    } else {
      group = *g;
      if (!group->broken.empty()) {
        refused = absl::UnavailableError(absl::StrCat(KindName(a.fp.kind), " job=", job.id,
                                                      " group=", group->key, ": ", group->broken));
      }
    }
    if (!refused.ok() && group != nullptr && group->spans_nodes && !group->broken.empty() &&
        session->attached) {
      // A member left: this node refuses the group's ops, and the other nodes, which may not
      // know yet, hear it through the op's exchange. The op takes its sequence number so
      // every node's count stays aligned; the first local member's submission tells the peers.
      const uint64_t seq = session->next_seq[group->key]++;
      if (!AnswerFailedLocked(*group, seq, sink, tag, out)) {
        int others = -1;  // attached local members besides this one
        for (int gr : group->local_group_ranks) others += job.ranks[group->members[gr]] != nullptr;
        if (others > 0) group->failed[seq] = Failed{refused, others};
        out.push_back([sink, tag, seq, refused] { sink->OpDone(tag, seq, refused); });
        EnqueueRemoteLocked(*group, FailedOp(*group, seq, a.fp, a.deadline, refused, OnDevice(a)),
                            out);
      }
    } else if (!refused.ok()) {
      out.push_back([sink, tag, refused] { sink->OpDone(tag, 0, refused); });
    } else {
      const uint64_t seq = session->next_seq[group->key]++;
      const int size = static_cast<int>(group->members.size());
      const int local = static_cast<int>(group->local_group_ranks.size());
      if (!AnswerFailedLocked(*group, seq, sink, tag, out)) {
        Pending& p = group->pending[seq];
        if (p.arrived == 0) {
          p.fp = a.fp;
          p.first_rank = session->rank;
          p.by_member.resize(local);
          p.queued = a.deadline - a.timeout;  // when Resolve took it
          p.plane = PlaneOf(OnDevice(a));
          p.bytes = a.bytes;
        }
        if (!(p.fp == a.fp)) {
          const absl::Status desync = absl::FailedPreconditionError(
              absl::StrCat("desync in job=", job.id, " group=", group->key, " seq=", seq, ": rank ",
                           p.first_rank, " submitted ", p.fp.Describe(), " but rank ",
                           session->rank, " submitted ", a.fp.Describe()));
          Log()->warn("{}", std::string(desync.message()));
          if (options_.counters != nullptr) options_.counters->desyncs.fetch_add(1);
          out.push_back([sink, tag, seq, desync] { sink->OpDone(tag, seq, desync); });
          ++p.arrived;  // this one is told here, not by the failed record
          FailPendingLocked(*group, seq, desync, out);
        } else {
          if (a.deadline < p.deadline) {
            p.deadline = a.deadline;
            p.timeout = a.timeout;
            p.timers.push_back(
                timer_.Schedule(a.deadline, [this, weak = std::weak_ptr<Job>(session->job), group,
                                             seq] { OnDeadline(weak, group, seq); }));
          }
          const int index =
              static_cast<int>(std::lower_bound(group->local_group_ranks.begin(),
                                                group->local_group_ranks.end(), a.group_rank) -
                               group->local_group_ranks.begin());
          p.by_member[index] = std::move(a);
          if (++p.arrived == local) {
            Ready r;
            r.remote = group->spans_nodes;
            r.seq = seq;
            Collective& c = r.op;
            c.kind = p.fp.kind;
            c.reduce_op = p.fp.reduce_op;
            c.dtype = p.fp.dtype;
            c.count = p.fp.count;
            c.root = p.fp.root;
            c.group_size = size;
            c.seq = seq;
            c.deadline = p.deadline;
            c.label = absl::StrCat(KindName(c.kind), " job=", job.id, " group=", group->key,
                                   " seq=", seq);
            c.fingerprint = absl::StrCat(p.fp.Describe(), " seq=", seq);
            for (std::optional<Arrival>& m : p.by_member) {
              c.local.push_back({m->group_rank, std::move(m->input), std::move(m->output)});
              r.to.emplace_back(std::move(m->sink), m->tag);
              for (auto& pin : m->pins) r.pins.push_back(std::move(pin));
              r.bytes = std::max(r.bytes, m->bytes);
            }
            for (DeadlineTimer::Id id : p.timers) timer_.Cancel(id);
            r.fp = std::move(p.fp);
            r.queued = p.queued;
            r.plane = p.plane;
            c.plane = p.plane;
            group->last_plane = p.plane;
            group->pending.erase(seq);
            group->ready.push_back(std::move(r));
            if (!group->running) {
              group->running = true;
              drain = true;
            }
          }
        }
      }
    }
  }
  for (auto& fn : out) fn();
  if (drain) Drain(session->job, group, /*on_pool=*/false);
}

namespace {
// 16 random hex digits.
std::string RunToken() {
  std::random_device device;
  std::mt19937_64 bits((uint64_t{device()} << 32) ^ device() ^
                       static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat(absl::Hex(bits(), absl::kZeroPad16));
}
}  // namespace

void Engine::StartFormation(std::shared_ptr<Job> job, std::string node) {
  std::vector<int> mine;
  {
    absl::MutexLock lock(&job->mu);
    for (int r = 0; r < job->world_size; ++r) {
      if (job->ranks[r] != nullptr) mine.push_back(r);
    }
  }
  // The run's token: the first node to come sets it, every node reads the same one. The job's
  // keys are deleted when it ends at the root, so a later run of the same id makes a new one.
  absl::StatusOr<CompareSetResult> run =
      job->root_store->CompareSet(job->id, kRunKey, std::nullopt, RunToken());
  if (!run.ok()) {
    OnFormed(job, absl::Status(run.status().code(),
                               absl::StrCat("agreeing on the run: ", run.status().message())));
    return;
  }
  {
    absl::MutexLock lock(&job->mu);
    job->run = run->value;
  }
  for (int r : mine) {
    absl::Status s = job->root_store->Set(job->id, absl::StrCat("daemon/rank/", r), node);
    if (!s.ok()) {
      OnFormed(job, absl::Status(s.code(), absl::StrCat("publishing rank ", r, ": ", s.message())));
      return;
    }
  }
  std::vector<std::string> keys;
  for (int r = 0; r < job->world_size; ++r) keys.push_back(absl::StrCat("daemon/rank/", r));
  Log()->info("job forming job={} node={} local_ranks={} world_size={}", job->id, node,
              JoinBounded(mine, ","), job->world_size);
  job->root_store->WaitAsync(
      job->id, std::move(keys), absl::Now() + options_.default_op_timeout,
      [this, weak = std::weak_ptr<Job>(job), node](absl::StatusOr<std::vector<std::string>> v) {
        // Off the store's thread: replaying parked ops may compute.
        pool_->Schedule([this, weak, node, v = std::move(v)]() mutable {
          if (auto job = weak.lock()) {
            absl::MutexLock lock(&job->mu);
            job->node = node;
          }
          OnFormed(weak, std::move(v));
        });
      });
}

void Engine::OnFormed(const std::weak_ptr<Job>& weak,
                      absl::StatusOr<std::vector<std::string>> nodes) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  std::deque<Job::Parked> failed;
  absl::Status error;
  {
    absl::MutexLock lock(&job->mu);
    if (!nodes.ok()) {
      job->formation = Job::Formation::kFailed;
      job->formation_error =
          absl::Status(nodes.status().code() == absl::StatusCode::kDeadlineExceeded
                           ? absl::StatusCode::kDeadlineExceeded
                           : absl::StatusCode::kUnavailable,
                       absl::StrCat("job ", job->id, " did not form across nodes (root ",
                                    job->root_address, "): ", nodes.status().message()));
      error = job->formation_error;
      failed.swap(job->parked);
    } else {
      job->node_of_rank = *std::move(nodes);
      job->formation = Job::Formation::kReplaying;
    }
  }
  if (!error.ok()) {
    Log()->warn("{}", std::string(error.message()));
    for (Job::Parked& p : failed) p.sink->OpDone(p.tag, 0, error);
    return;
  }
  Log()->info("job formed job={} nodes={}", job->id, JoinBounded(job->node_of_rank, ","));
  for (;;) {  // parked ops first, in order; new ones park behind them until the queue is empty
    Job::Parked p;
    {
      absl::MutexLock lock(&job->mu);
      if (job->parked.empty()) {
        job->formation = Job::Formation::kFormed;
        return;
      }
      p = std::move(job->parked.front());
      job->parked.pop_front();
    }
    SubmitNow(p.session, p.sink, p.tag, p.op);
  }
}

void Engine::OnDeadline(const std::weak_ptr<Job>& weak, Group* group, uint64_t seq) {
  std::shared_ptr<Job> job = weak.lock();
  if (!job) return;
  Completions out;
  {
    absl::MutexLock lock(&job->mu);
    auto it = group->pending.find(seq);
    if (it == group->pending.end() || absl::Now() < it->second.deadline) return;
    const Pending& p = it->second;
    std::vector<int> arrived, missing;
    for (size_t i = 0; i < p.by_member.size(); ++i) {
      (p.by_member[i].has_value() ? arrived : missing)
          .push_back(group->members[group->local_group_ranks[i]]);
    }
    const absl::Status status = absl::DeadlineExceededError(
        absl::StrCat(KindName(p.fp.kind), " job=", job->id, " group=", group->key, " seq=", seq,
                     " name='", p.fp.name, "' timed out after ", absl::FormatDuration(p.timeout),
                     ": rank(s) ", JoinBounded(missing, ","),
                     " never submitted it (arrived: ", JoinBounded(arrived, ","), ")"));
    Log()->warn("{}", std::string(status.message()));
    if (options_.counters != nullptr) options_.counters->deadline_expiries.fetch_add(1);
    FailPendingLocked(*group, seq, status, out);
  }
  for (auto& fn : out) fn();
}

void Engine::Drain(std::shared_ptr<Job> job, Group* group, bool on_pool) {
  // A run of consecutive ready host-plane ops that wait on other daemons (Gloo) goes to the
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
        // FailedOp leaves op.seq unset; communicators spanning nodes match ops by it.
        batch.back().op.seq = batch.back().seq;
      } while (batch.front().remote && batch.front().op.plane == Plane::kHost &&
               !group->ready.empty() && group->ready.front().remote &&
               group->ready.front().op.plane == Plane::kHost && batch.size() < kMaxBatchOps &&
               batch_bytes + group->ready.front().bytes <= kMaxBatchBytes);
      if (batch.front().record) group->running_op = &batch.front();
    }
    std::vector<absl::Status> statuses(batch.size());
    if (batch.size() == 1) {
      statuses[0] = group->comm->Run(batch[0].op);
    } else {
      std::vector<const Collective*> ops;
      for (const Ready& r : batch) ops.push_back(&r.op);
      group->comm->RunBatch(ops, absl::MakeSpan(statuses));
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      Ready& r = batch[i];
      const absl::Status& status = statuses[i];
      if (r.record) {  // before the members hear of it: history never lags the trainers
        const absl::Time finished = absl::Now();
        absl::MutexLock lock(&job->mu);
        if (group->running_op == &r) group->running_op = nullptr;
        NoteFinished(*group, options_, r.seq, r.fp, r.plane, r.bytes, r.queued, r.started, finished,
                     status);
      }
      if (!status.ok()) {
        Log()->warn("op failed {} status={}", r.op.label, status.ToString());
      } else {
        Log()->trace("op done {} count={}", r.op.label, r.op.count);
      }
      for (auto& [sink, tag] : r.to) sink->OpDone(tag, r.seq, status);
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
      for (auto& [key, group] : job->groups) {
        group->broken = "daemon is shutting down";
        while (!group->pending.empty()) {
          FailPendingLocked(*group, group->pending.begin()->first,
                            absl::UnavailableError("daemon is shutting down"), out,
                            /*tell_peers=*/false);
        }
      }
    }
  }
  for (auto& fn : out) fn();
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

}  // namespace gradsync::core

namespace gradsync::core {
namespace {

// The view of a matched op (queued or running) of a group on this node.
Engine::OpView ReadyView(const internal::Group& group, const Ready& r, Engine::OpWait waiting) {
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

Engine::OpWait RunningWait(const internal::Group& group, const Ready& r) {
  if (r.plane == Plane::kDevice) return Engine::OpWait::kNccl;
  return group.spans_nodes ? Engine::OpWait::kNetwork : Engine::OpWait::kLocalCopy;
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
        for (auto& [seq, p] : group->pending) {
          if (p.stall_warned || now - p.queued < options_.stall_warn) continue;
          p.stall_warned = true;
          std::vector<int> arrived, missing;
          for (size_t i = 0; i < p.by_member.size(); ++i) {
            (p.by_member[i].has_value() ? arrived : missing)
                .push_back(group->members[group->local_group_ranks[i]]);
          }
          Log()->warn(
              "op stalled job={} group={} seq={} op={} waited={} deadline_in={}: rank(s) {} have "
              "not submitted it (arrived here: {})",
              job->id, key, seq, p.fp.Describe(), absl::FormatDuration(now - p.queued),
              absl::FormatDuration(p.deadline - now),
              RanksWithNodes(missing, job->node_of_rank, node), JoinBounded(arrived, ","));
          if (options_.counters != nullptr) options_.counters->stalls.fetch_add(1);
        }
        Ready* r = group->running_op;
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
  for (const auto& [key, group] : job->groups) {
    if (!group_filter.empty() && key != group_filter) continue;
    for (const auto& [seq, p] : group->pending) {
      OpView v;
      v.group = key;
      v.seq = seq;
      v.fingerprint = p.fp.Describe();
      v.plane = p.plane;
      v.waiting_for = OpWait::kTrainers;
      v.queued = p.queued;
      v.bytes = p.bytes;
      for (size_t i = 0; i < p.by_member.size(); ++i) {
        (p.by_member[i].has_value() ? v.arrived : v.missing)
            .push_back(group->members[group->local_group_ranks[i]]);
      }
      view.ops.push_back(std::move(v));
    }
    if (group->running_op != nullptr) {
      view.ops.push_back(
          ReadyView(*group, *group->running_op, RunningWait(*group, *group->running_op)));
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
      t.pending_ops += static_cast<int>(group->pending.size() + group->ready.size()) +
                       (group->running_op != nullptr ? 1 : 0);
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
