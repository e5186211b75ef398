// The engine's state, as types: a trainer's session, a job, a group of a job and the op records
// the matcher keeps (one member's arrival, a pending op, a matched op, a failed op's verdict, a
// finished op in the history ring), each with the lock that guards it.
//
// Lock order: Engine::mu_ before Job::mu before Session::mu. Job::mu guards the job, its groups
// and the sessions' per-job counters; clang's checker names it `job->mu` from a session or a
// group and `mu` inside the job (AssertGroupOf tells it they are one mutex).
#pragma once

#include <atomic>
#include <cassert>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/store.h"
#include "daemon/core/backend.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/core/deadline_timer.h"
#include "daemon/core/fingerprint.h"
#include "daemon/core/membership.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core {

class SessionSink;
class Session;

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
  // Where its buffers live; none when it names no buffer (a barrier, an empty op).
  std::optional<Plane> plane;
  absl::Duration timeout;
  absl::Time deadline;
  std::optional<Turn> turn;  // a device op's place in its trainer's order (submit_order.h)
};

// Op k of a group while not every local member has submitted it.
struct Pending {
  Fingerprint fp;
  int first_rank = 0;
  std::vector<std::optional<Arrival>> arrivals;  // by index in Group::local_group_ranks
  int arrived = 0;
  absl::Time deadline = absl::InfiniteFuture();
  absl::Duration timeout;
  std::vector<DeadlineTimer::Id> timers;
  absl::Time queued;  // the first local member's submission
  Plane plane = Plane::kHost;
  int64_t bytes = 0;
  bool stall_warned = false;
};

// Op k of a group, matched (or a failed op's verdict for the other nodes), waiting for op k-1
// to finish.
struct Ready {
  bool remote = false;  // waits on other daemons: never run on the submitting thread
  Collective op;
  uint64_t seq = 0;
  std::vector<std::pair<std::shared_ptr<SessionSink>, uint64_t>> to;  // (sink, tag)
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

// An op that failed before it could run, kept for the local members that have not submitted it
// yet: each gets this status when it does.
struct Verdict {
  absl::Status status;
  int untold;  // local members still to submit it
};

struct Group;

struct Job : std::enable_shared_from_this<Job> {
  Job(std::string id, int world_size, int local_world_size, std::string root_address,
      gradsync::Store* root_store, bool elastic = false, int epoch = 0)
      : id(std::move(id)),
        world_size(world_size),
        local_world_size(local_world_size),
        spans_nodes(local_world_size < world_size),
        root_address(std::move(root_address)),
        root_store(root_store),
        elastic(elastic),
        epoch(epoch),
        membership(elastic && root_store != nullptr
                       ? std::make_unique<EpochMembership>(root_store, this->id, epoch, world_size)
                       : nullptr),
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
  // Elastic jobs (RegisterRequest.elastic): this membership's epoch; a lost node makes the
  // daemons record the next one (Engine::DecideMembership).
  const bool elastic;
  const int epoch;
  // An elastic job spanning nodes: this epoch's state and records (null otherwise).
  const std::unique_ptr<EpochMembership> membership;
  enum class Formation { kLocal, kForming, kReplaying, kFormed, kFailed };
  struct Parked {
    std::shared_ptr<Session> session;
    std::shared_ptr<SessionSink> sink;
    uint64_t tag;
    v1::OpRequest op;
    std::optional<Turn> turn;
  };
  // Acquired after Engine::mu_ (when both are held).
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
  // Nodes the peer watch declared lost (or left), with why: groups spanning them fail.
  std::map<std::string, std::string> lost_nodes ABSL_GUARDED_BY(mu);
  std::set<std::string> left_nodes ABSL_GUARDED_BY(mu);  // of those, the ones that left on purpose
  std::deque<Parked> parked ABSL_GUARDED_BY(mu);
  // Groups are never removed while the job lives: a Group* stays valid as long as its job.
  absl::flat_hash_map<std::string, std::unique_ptr<Group>> groups ABSL_GUARDED_BY(mu);
};

// One group of a job as this node sees it: its op matcher's state, the queue of matched ops and
// its history. Everything that changes is guarded by the job's mutex.
struct Group {
  Group(Job* job, std::string key, std::vector<int> members, std::vector<int> local_group_ranks,
        bool spans_nodes, std::shared_ptr<Communicator> comm)
      : job(job),
        key(std::move(key)),
        members(std::move(members)),
        local_group_ranks(std::move(local_group_ranks)),
        spans_nodes(spans_nodes),
        comm(std::move(comm)) {}

  Job* const job;  // owner
  const std::string key;
  const std::vector<int> members;            // global ranks, ascending
  const std::vector<int> local_group_ranks;  // group ranks of the members attached here, ascending
  const bool spans_nodes;
  // Used by the one Drain that owns `ready`, outside the lock (Communicator: calls never overlap).
  const std::shared_ptr<Communicator> comm;

  std::map<uint64_t, Pending> pending ABSL_GUARDED_BY(job->mu);
  std::map<uint64_t, Verdict> verdicts ABSL_GUARDED_BY(job->mu);  // ops failed before all came
  std::deque<Ready> ready ABSL_GUARDED_BY(job->mu);
  bool running ABSL_GUARDED_BY(job->mu) = false;  // a Drain owns `ready`
  // Of the last op matched here (for ops failed before any member named a buffer).
  Plane last_plane ABSL_GUARDED_BY(job->mu) = Plane::kHost;
  // Non-empty once a member left: every op fails with it.
  std::string broken ABSL_GUARDED_BY(job->mu);
  // The ops a Drain popped and runs outside the lock (its local batch) that have not finished
  // yet, the first running, the others in flight with it; set and narrowed under the job's
  // mutex, so readers holding it may look at them.
  absl::Span<Ready> running_ops ABSL_GUARDED_BY(job->mu);
  // The last EngineOptions::history_size finished ops: a ring filled in place, so recording
  // an op allocates nothing once it is full (a fingerprint name past the SSO aside).
  std::vector<HistorySlot> history ABSL_GUARDED_BY(job->mu);
  uint64_t history_written ABSL_GUARDED_BY(job->mu) = 0;
};

/// Tells clang's lock checker that `group` belongs to `job`, whose mutex the caller holds: it
/// cannot see that `group.job->mu` and `job.mu` are one mutex. Checked in debug builds.
inline void AssertGroupOf(const Job& job, const Group& group) ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu)
    ABSL_ASSERT_EXCLUSIVE_LOCK(group.job->mu) {
  assert(group.job == &job);
  (void)job;
  (void)group;
}

}  // namespace internal

/// One trainer's attachment to the daemon (Engine::Register).
class Session {
 public:
  /// A device buffer's events serve the ops of one group at a time: an event stands for its
  /// latest record, and only a group's ops run in order on one daemon stream (there a later
  /// "done" covers the earlier ops). An op of another group while some are in flight would
  /// replace their "done" with one of another stream, and a trainer waiting for them would wait
  /// for it only. The group whose ops hold them, from submission to answer, how many, and
  /// whether the buffer went meanwhile (its events are then released at the last answer).
  struct DeviceUse {
    explicit DeviceUse(std::shared_ptr<MappedBuffer> mapping) : mapping(std::move(mapping)) {}
    const std::shared_ptr<MappedBuffer> mapping;
    absl::Mutex mu;
    std::string group ABSL_GUARDED_BY(mu);
    int ops ABSL_GUARDED_BY(mu) = 0;        // ops that named it, not yet answered
    int on_device ABSL_GUARDED_BY(mu) = 0;  // ops that named it, not yet settled (DeviceHold)
    bool deregistered ABSL_GUARDED_BY(mu) = false;
    // Told once the events are released (DeregisterBuffer's answer).
    std::vector<std::function<void()>> when_released ABSL_GUARDED_BY(mu);

    /// The buffer goes (deregistered, or its session ended): its events are released, and
    /// `then` runs (may be null), once no op holds them: every op that named it has been
    /// answered and has settled on the device (a device op answered once launched holds them
    /// until its streams have run it, or were drained after an abort). Until then the daemon
    /// may still record "done" on them, so the trainer must not destroy them.
    void Deregistered(std::function<void()> then = nullptr) {
      {
        absl::MutexLock lock(&mu);
        deregistered = true;
        if (then) when_released.push_back(std::move(then));
        if (ops > 0 || on_device > 0) return;
      }
      Release();
    }
    /// An op that held the events has its answer.
    void Done() {
      {
        absl::MutexLock lock(&mu);
        if (--ops > 0 || on_device > 0 || !deregistered) return;
      }
      Release();
    }
    /// An op that names the buffer holds it on the device (DeviceHold).
    void Hold() {
      absl::MutexLock lock(&mu);
      ++on_device;
    }
    /// ... and has settled there.
    void Unhold() {
      {
        absl::MutexLock lock(&mu);
        if (--on_device > 0 || ops > 0 || !deregistered) return;
      }
      Release();
    }

   private:
    void Release() {
      std::vector<std::function<void()>> then;
      {
        absl::MutexLock lock(&mu);
        then.swap(when_released);
      }
      mapping->ReleaseEvents();
      for (auto& fn : then) fn();
    }
  };

  /// One op's hold on a device buffer from its resolution until it has settled on the device:
  /// the op's pin of the buffer's mapping (Collective::keep_alive) owns it, so it goes when the
  /// data plane lets the op go.
  struct DeviceHold {
    explicit DeviceHold(std::shared_ptr<DeviceUse> use) : use(std::move(use)) { this->use->Hold(); }
    ~DeviceHold() { use->Unhold(); }
    DeviceHold(const DeviceHold&) = delete;
    DeviceHold& operator=(const DeviceHold&) = delete;
    const std::shared_ptr<DeviceUse> use;
  };

  struct Buffer {
    std::shared_ptr<MappedBuffer> mapping;
    DType dtype;
    std::string handle;              // what the trainer registered it by (its shm name)
    std::shared_ptr<DeviceUse> use;  // device buffers with events only
  };

  Session(std::string id, std::shared_ptr<internal::Job> job, int rank, int local_rank)
      : id(std::move(id)), job(std::move(job)), rank(rank), local_rank(local_rank) {}

  const std::string id;
  const std::shared_ptr<internal::Job> job;
  const int rank;
  const int local_rank;
  // The uid of the trainer process (the unix socket's SO_PEERCRED), when known: a job's
  // sessions on a node are one user's. Set before the session is published; read-only after.
  std::optional<uint32_t> uid;

  absl::Mutex mu ABSL_ACQUIRED_AFTER(job->mu);
  absl::flat_hash_map<uint64_t, Buffer> buffers ABSL_GUARDED_BY(mu);
  uint64_t next_buffer_id ABSL_GUARDED_BY(mu) = 1;
  bool ended ABSL_GUARDED_BY(mu) = false;

  absl::flat_hash_map<std::string, uint64_t> next_seq ABSL_GUARDED_BY(job->mu);  // by group key
  bool attached ABSL_GUARDED_BY(job->mu) = true;

  // Ops submitted whose outcome the session has not been sent yet (Engine::Submit).
  std::atomic<int> ops_in_flight{0};
  // Its device ops in submission order: each GPU launches them in that order.
  const std::shared_ptr<SubmitOrder> device_order = std::make_shared<SubmitOrder>();
  // Its device ops answered OK and not yet settled on the device (Engine::Settle).
  const std::shared_ptr<Settlements> settlements = std::make_shared<Settlements>();
};

namespace internal {

/// Tells clang's lock checker that `session` belongs to `job`, whose mutex the caller holds (as
/// AssertGroupOf does for a group). Checked in debug builds.
inline void AssertSessionOf(const Job& job, const Session& session)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(job.mu) ABSL_ASSERT_EXCLUSIVE_LOCK(session.job->mu) {
  assert(session.job.get() == &job);
  (void)job;
  (void)session;
}

}  // namespace internal

}  // namespace gradsync::core
