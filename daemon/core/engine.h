// The engine's public face: the daemon's core (sessions, buffers, groups, the op matcher,
// deadlines and faults) as the rpc and ipc layers call it. Its parts live in sessions.cc,
// resolve.cc, matcher.cc, formation.cc, inspect.cc and engine.cc (the submit path).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"
#include "common/worker_pool.h"
#include "daemon/core/backend.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/core/deadline_timer.h"
#include "daemon/core/job.h"
#include "daemon/core/op_counters.h"
#include "daemon/core/peer_watch.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core {

struct EngineOptions {
  /// Deadline of an op that names none, and the most an op may ask for.
  absl::Duration default_op_timeout = absl::Minutes(5);
  absl::Duration max_op_timeout = absl::Hours(1);
  int max_buffers_per_session = 4096;
  /// Node-wide: trainer sessions, and buffers registered by all of them.
  int max_sessions = 1024;
  int64_t max_buffers = 65536;
  /// Ops a session may have submitted and not yet been answered, on any transport (the gRPC
  /// stream or the doorbell, whose completion ring holds 1024). Past it an op fails at once.
  int max_ops_in_flight_per_session = 1024;
  int max_segments_per_op = 1 << 16;
  /// Matched ops moving at most this many bytes per member run on the thread that matched
  /// them (no hand-off); larger ones run on the worker pool.
  int64_t inline_bytes = 256 << 10;
  /// Finished ops each group remembers (Engine::GetHistory); 0: none.
  int history_size = 2000;
  /// An op still waiting this long after its first local submission gets one warning naming
  /// the ranks (and nodes) it waits for; zero: never.
  absl::Duration stall_warn = absl::Seconds(60);
  /// Elastic jobs: how long after the first node lost the daemon waits for more losses before
  /// it records the new membership (nodes lost together go in one decision).
  absl::Duration elastic_settle = absl::Milliseconds(300);
  /// Bumped as ops finish; may be null. Must outlive the engine.
  OpCounters* counters = nullptr;
};

/// Where the engine delivers op outcomes (the transport an op came by: the gRPC stream or the
/// shared-memory doorbell). Thread-safe and non-blocking; called without engine locks held,
/// possibly after the session ended (then it drops the event).
class SessionSink {
 public:
  virtual ~SessionSink() = default;
  virtual void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) = 0;
};

/// One trainer's attachment to the daemon (daemon/core/job.h). Opaque to the engine's callers;
/// created by Engine::Register.
class Session;

/// The daemon's core: sessions, buffer registry, groups, the op matcher, deadlines and faults
/// (docs/architecture.md section 4), over any Backend and BufferImporter. Thread-safe.
///
/// Matching: the k-th op a rank submits on a group is op k of that group; it runs once every
/// local member submitted its op k, and only after op k-1 of the group finished. Each member's
/// op must carry the same fingerprint, else every member gets FAILED_PRECONDITION naming both.
/// An op not matched by its deadline fails DEADLINE_EXCEEDED on the members that came, naming
/// the ones that did not (who then get the same error when they come). A rank whose session
/// ends fails the pending ops of its groups (UNAVAILABLE) and every later op on them; the job
/// is forgotten, store namespace included, once its last session ends.
///
/// Locks: Engine::mu_ before Job::mu before Session::mu. Sinks and the backend are called with
/// none held.
class Engine {
 public:
  using JobEndCallback = std::function<void(const std::string& job)>;
  /// The job store at a root daemon's address (this daemon's own store when the address is its
  /// own). "" asks for the store of a job that has no root daemon: one every daemon reaches
  /// itself (etcd), or an error when jobs need their root's (the embedded store). The pointer
  /// must stay valid for the engine's life.
  using StoreResolver = std::function<absl::StatusOr<gradsync::Store*>(const std::string&)>;

  /// How long Register waits for the end of the last run of the job it names.
  static constexpr absl::Duration kRestartWait = absl::Seconds(10);

  /// Everything passed must outlive the engine. `on_job_end` runs when a job's last session
  /// ends, on a thread of the engine's own (one per ending job, never the caller of Unregister:
  /// it may block for as long as the job's launched device ops run); the destructor waits for
  /// the ones still running. A new run of the same job id is registered only once the last
  /// run's `on_job_end` has returned (see Register), so it may delete the job's store namespace.
  Engine(Backend* backend, BufferImporter* importer, WorkerPool* pool, EngineOptions options,
         JobEndCallback on_job_end, StoreResolver resolve_store = nullptr);

  /// This daemon's TCP address as other daemons reach it ("host:port"); set once serving.
  /// Without it, jobs spanning nodes are refused.
  void SetNodeAddress(std::string address);
  /// The liveness of other daemons (jobs spanning nodes are watched once formed, until they
  /// end); null: none (a lost node is then noticed by the ops' deadlines). Set before serving;
  /// it must outlive the engine.
  void SetPeerWatch(PeerWatch* watch);
  ~Engine();

  /// Opens a session for one rank of a job. INVALID_ARGUMENT on a job id CheckJobId refuses, bad
  /// sizes or ones that disagree with the job's other ranks; RESOURCE_EXHAUSTED at max_sessions;
  /// ALREADY_EXISTS when the rank is taken; FAILED_PRECONDITION when the job lost a rank and still
  /// has sessions, or the job spans nodes. A job whose last run's end is still being cleaned up
  /// on this node (on_job_end running) is waited for, at most kRestartWait (the calling thread
  /// blocks: only a restart racing its last run's end does), then FAILED_PRECONDITION.
  absl::StatusOr<std::shared_ptr<Session>> Register(const v1::RegisterRequest& request,
                                                    std::optional<uint32_t> uid = std::nullopt);

  /// Ends a session (idempotent): unmaps its buffers once no running op uses them, fails the
  /// pending ops of its groups on the other ranks with UNAVAILABLE naming the rank and `reason`.
  /// How a session ended: the trainer closed it, or its connection was lost (it died).
  enum class End { kClosed, kLost };
  /// Ends a session (idempotent); see above. In an elastic job spanning nodes, a trainer lost
  /// (End::kLost) makes its node lost: this daemon records the next membership without the
  /// node's ranks (the others' ops fail, and they go on without it).
  void Unregister(Session& session, absl::string_view reason, End how);
  void Unregister(Session& session, absl::string_view reason) {
    Unregister(session, reason, End::kClosed);
  }

  /// Maps a buffer for the session. Errors from the importer; RESOURCE_EXHAUSTED past
  /// max_buffers_per_session or the node's max_buffers.
  absl::StatusOr<uint64_t> RegisterBuffer(Session& session,
                                          const v1::RegisterBufferRequest& request);
  /// NOT_FOUND for an unknown id. Ops already submitted keep their mapping until they finish.
  /// `released` (may be null) runs once the daemon no longer uses the buffer's events: every
  /// op that named it has been answered and has settled on the device (at once for a buffer
  /// with none); only then may the trainer destroy them (an imported event's record pending
  /// after its exporter destroyed it is undefined). It may run on this thread or another.
  absl::Status DeregisterBuffer(Session& session, uint64_t buffer_id,
                                std::function<void()> released = nullptr);
  /// `done` runs (on this thread or another) once every device op the session submitted so
  /// far has settled on the device, with OK or the first failure of one after its OK answer
  /// since the last report (ABORTED, its results not valid). Host ops settle at their answer.
  void Settle(Session& session, std::function<void(absl::Status)> done);

  /// Validates and matches an op; its outcome (an invalid request's error too) reaches `sink`
  /// with `tag`. An invalid op takes no sequence number. A session's ops must be submitted
  /// from one thread at a time, in the order the trainer sent them. An op past the session's
  /// max_ops_in_flight_per_session fails RESOURCE_EXHAUSTED at once (no sequence number).
  void Submit(const std::shared_ptr<Session>& session, const std::shared_ptr<SessionSink>& sink,
              uint64_t tag, const v1::OpRequest& op);

  /// Fails every pending op with UNAVAILABLE and refuses new sessions (the daemon drains).
  void Shutdown();

  absl::Duration default_op_timeout() const { return options_.default_op_timeout; }

  /// "job/rank#n": unique for the daemon's life; what logs and ListSessions show.
  static const std::string& SessionId(const Session& session);

  struct SessionInfo {
    std::string id, job;
    int rank, local_rank, world_size;
    int buffers;
    int64_t mapped_bytes;
  };
  std::vector<SessionInfo> ListSessions() const;
  /// Whether a session of this daemon holds the store namespace `ns`: a job running here (or
  /// ending), or the home of an elastic job running here. Takes the engine's lock; never
  /// calls into a store.
  bool HoldsNamespace(absl::string_view ns) const;
  /// The uids of the sessions holding `ns` (those registered with one). Same locks.
  absl::flat_hash_set<uint32_t> HolderUids(absl::string_view ns) const;

  /// What this node's daemon waits for before an op can complete here.
  enum class OpWait { kTrainers, kEarlierOp, kLocalCopy, kNetwork, kNccl };
  /// An op of a group that has not finished on this node.
  struct OpView {
    std::string group;
    uint64_t seq = 0;
    std::string fingerprint;
    Plane plane = Plane::kHost;
    OpWait waiting_for = OpWait::kTrainers;
    absl::Time queued;         // the first local rank submitted it
    std::vector<int> arrived;  // local ranks (global numbers) that submitted it
    std::vector<int> missing;  // local ranks that did not
    int64_t bytes = 0;         // per member
  };
  struct JobOpsView {
    std::string node;                       // this daemon's address in the job ("" if none)
    std::vector<std::string> node_of_rank;  // jobs spanning nodes, once formed; else empty
    std::vector<int> local_ranks;           // attached here, ascending
    std::vector<OpView> ops;                // by group, then seq
    std::vector<PeerState> peers;           // the peer watch's view of the job's other daemons
  };
  /// This node's unfinished ops of `job` (of `group` only, unless empty). NOT_FOUND when no
  /// rank of the job is attached here. Takes the job's lock briefly; never waits otherwise.
  absl::StatusOr<JobOpsView> ListOps(const std::string& job, const std::string& group) const;

  struct HistoryEntry {
    uint64_t seq = 0;
    std::string fingerprint;
    int64_t bytes = 0;
    Plane plane = Plane::kHost;
    absl::Time queued, started = absl::InfinitePast(), finished;  // started: never ran
    absl::Status outcome;
  };
  struct GroupHistory {
    std::vector<HistoryEntry> ops;  // oldest first
    uint64_t dropped = 0;           // older ops the ring no longer holds
  };
  /// The epochs of elastic job `job` (empty: of every job) formed here, oldest first (the
  /// last EpochHistory::kMaxRecords of all jobs).
  std::vector<EpochRecord> Epochs(const std::string& job) const;

  /// The group's last EngineOptions::history_size ops finished on this node. NOT_FOUND for a
  /// job with no rank attached here or a group that never had an op.
  absl::StatusOr<GroupHistory> GetHistory(const std::string& job, const std::string& group) const;

  struct Totals {
    int jobs = 0, sessions = 0, pending_ops = 0;
    int64_t mapped_bytes = 0;
  };
  /// Node-wide gauges for metrics (locks every job briefly).
  Totals GetTotals() const;

 private:
  using Job = internal::Job;
  using Group = internal::Group;
  using Arrival = internal::Arrival;
  using Ready = internal::Ready;
  using Completions = std::vector<std::function<void()>>;

  absl::StatusOr<Group*> GetGroupLocked(Job& job, const std::vector<int>& members,
                                        const std::string& key)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // Hands `arrival` (its session's next op on `group`) to the matcher and carries out the
  // outcome; `next_seq` is the session's count of ops on the group. True: the caller must Drain.
  bool ArriveLocked(Group& group, uint64_t& next_seq, Arrival arrival, Completions& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);
  // `send_to_other_nodes`: a group spanning nodes also sends the failure through the op's
  // cross-node exchange (not when the job or the daemon is ending).
  void FailPendingLocked(Group& group, uint64_t seq, const absl::Status& status, Completions& out,
                         bool send_to_other_nodes = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);
  // Fails every pending op of `group` with UNAVAILABLE "<op label> cannot complete: <why>".
  void FailAllPendingLocked(Group& group, const std::string& why, Completions& out,
                            bool send_to_other_nodes = true)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);
  // Breaks every group of `job` with `reason` and fails their pending ops with it on this node
  // only (the job or the daemon is ending: nothing goes to other nodes).
  void BreakGroupsLocked(Job& job, const std::string& reason, Completions& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  // Queues an op that runs on other nodes' daemons too (a failed op's verdict, or data) and
  // makes sure a Drain runs it on the pool.
  void EnqueueRemoteLocked(Group& group, Ready ready, Completions& out)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);
  void OnDeadline(const std::weak_ptr<Job>& job, Group* group, uint64_t seq);
  // Warns once about each op waiting longer than stall_warn; reschedules itself.
  void SweepStalls();
  // Runs a group's matched ops in order until none is left; large ones move to the pool.
  // Not checked by clang: it locks job->mu, the group's job's mutex, which the checker cannot
  // tell is group->job->mu.
  void Drain(std::shared_ptr<Job> job, Group* group, bool on_pool) ABSL_NO_THREAD_SAFETY_ANALYSIS;
  // Jobs spanning nodes: publish this node's ranks in the root store, wait for everyone's.
  void StartFormation(std::shared_ptr<Job> job, std::string node);
  void OnFormed(const std::weak_ptr<Job>& job, absl::StatusOr<std::vector<std::string>> nodes);
  // The first parked op's deadline passed and the job has not formed: formation fails (every
  // parked op with it), DEADLINE_EXCEEDED; an op never waits past its deadline for formation.
  void OnFormationDeadline(const std::weak_ptr<Job>& job, absl::Duration timeout);
  // The peer watch lost `node` of the job: its groups spanning it fail their pending, running
  // and later ops with UNAVAILABLE naming the node, its ranks and `cause`.
  // An elastic job lost node(s): records the new membership in the job's store, once for the
  // job (the first daemon's decision stands; the others' CompareSet finds it).
  void DecideMembership(const std::weak_ptr<Job>& job);
  // Unregister of a trainer lost in an elastic job: its node's ranks go (see Unregister).
  void NoteTrainerLost(Session& session, absl::string_view reason);
  // An elastic epoch formed here: kept for Epochs(), with the decision that made it (read
  // from the previous epoch's namespace).
  void RecordEpoch(const std::weak_ptr<Job>& job, absl::Time formed);
  // An elastic job lost a node: its membership decision, after --elastic_settle, once.
  void ScheduleDecisionLocked(Job& job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu);
  void OnPeerLost(const std::weak_ptr<Job>& job, const std::string& node,
                  const absl::Status& cause);
  // Submit past the formation check; `turn`: a device op's place in its trainer's order.
  void SubmitNow(const std::shared_ptr<Session>& session, const std::shared_ptr<SessionSink>& sink,
                 uint64_t tag, const v1::OpRequest& op, std::optional<Turn> turn);

  // An elastic epoch `id` ended a while ago and is not running again: its namespace, kept for
  // a decision, goes (the decision from `store`, then on_job_end_).
  void EndKeptEpoch(const std::string& id, gradsync::Store* store);
  // Runs on_job_end_(job) on a thread of its own, then releases the namespaces its end
  // releases (ReleasedAtEnd); `job` is in ending_ meanwhile.
  void EndJobLater(const std::string& job, gradsync::Store* store, EpochEnd elastic);
  // Once no op could still wait for an ended epoch's decision: ReleasedWhenAbandoned.
  void EndAbandoned(const EpochEnd& elastic, gradsync::Store* store);

  // Calls f for each job holding store namespace `ns`: the job of that id, or an elastic job
  // whose home it is.
  void ForEachJobHoldingLocked(absl::string_view ns, absl::FunctionRef<void(Job&)> f) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Backend* const backend_;
  BufferImporter* const importer_;
  WorkerPool* const pool_;
  const EngineOptions options_;
  const JobEndCallback on_job_end_;
  const StoreResolver resolve_store_;
  mutable absl::Mutex mu_;  // acquired before any Job::mu
  EpochHistory epochs_;
  absl::flat_hash_map<std::string, std::shared_ptr<Job>> jobs_ ABSL_GUARDED_BY(mu_);
  // Ids of jobs whose last session ended and whose on_job_end_ is still running (its thread
  // in job_ends_); a Register of such an id waits for it.
  absl::flat_hash_set<std::string> ending_ ABSL_GUARDED_BY(mu_);
  // The threads running on_job_end_, by job id (a finished one is joined by the job's next end
  // or the destructor).
  absl::flat_hash_map<std::string, std::thread> job_ends_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_ ABSL_GUARDED_BY(mu_) = 1;
  int sessions_ ABSL_GUARDED_BY(mu_) = 0;  // attached, node-wide
  std::atomic<int64_t> buffers_{0};        // registered by all sessions, node-wide
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::string node_address_ ABSL_GUARDED_BY(mu_);
  PeerWatch* peer_watch_ = nullptr;  // set before serving
  DeadlineTimer timer_;  // last: destroyed (its thread joined) before the state it touches
};

}  // namespace gradsync::core
