#pragma once

// The job store on an etcd cluster (etcd's v3 API over gRPC): every daemon of a job reaches the
// same keys directly, so a job has no root daemon and its store outlives any one node.

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/store/job_store.h"
#include "daemon/store/memory_store.h"

namespace grpc {
class Status;
class ClientContext;
}  // namespace grpc

namespace etcdserverpb {
class RangeResponse;
class TxnRequest;
class TxnResponse;
class WatchResponse;
}  // namespace etcdserverpb

namespace gradsync::store {

struct EtcdOptions {
  /// The cluster's client endpoints, "host:port" (an "http://" or "https://" prefix is
  /// dropped). Calls go to one member and move to the next when it cannot be reached.
  std::vector<std::string> endpoints;
  /// Every key of this store lives under it: <prefix>jobs/<job>/<key>, and the daemons holding
  /// a job under <prefix>members/<job>/. Daemons of one job must use the same prefix.
  std::string prefix = "/gradsync/";
  /// TLS to etcd when any is set: the CA the members' certificates chain to (empty: the
  /// system's roots), and this daemon's certificate and key when etcd asks for one.
  std::string ca_pem, cert_pem, key_pem;
  /// etcd's own authentication (Auth.Authenticate); empty user: none.
  std::string user, password;
  /// A job's keys outlive the last of its daemons (killed, or cut off from etcd) by at most
  /// this: the TTL of the job's lease, renewed every third of it.
  absl::Duration lease_ttl = absl::Seconds(10);
  /// Longest one store call may take, retries on other members included; also how long a
  /// pending wait survives with no member reachable before it fails Unavailable.
  absl::Duration rpc_timeout = absl::Seconds(5);
  /// The embedded store's limits, kept the same way (max_jobs and max_waiters count this
  /// daemon's jobs and waits; max_keys_per_job a job's keys across all its daemons).
  MemoryStoreOptions limits;
};

/// The Store of a job on etcd. Keys map to etcd keys under the prefix, one namespace per job;
/// waits are an initial read and then one etcd watch on the range covering the waited keys
/// (from the read's revision on, so nothing is missed); Add and CompareSet are etcd
/// transactions (Add retries its compare-and-put under contention).
///
/// A job's keys are tied to one etcd lease, whose id every daemon derives from the prefix and the
/// job (the first daemon grants it), and that every daemon holding the job keeps alive: a
/// daemon's first write for a job joins it in the same transaction (a member key under the
/// lease), DeleteJob leaves, and the last daemon to leave revokes it, which deletes the job's
/// keys. If every daemon of a job dies or loses etcd, the lease expires after lease_ttl and the
/// keys go with it.
///
/// Calls fail Unavailable naming etcd and its endpoints once no member answered within
/// rpc_timeout; Add and CompareSet are not retried once sent (the outcome would be unknown).
/// Construction never blocks: etcd is reached on first use.
///
/// Threads: the control thread (deadlines, watch stream (re)connection, watch re-creation and
/// settling), one reader of the watch stream, the lease keep-alive thread.
/// Lock order: write_mu_ before mu_; acquire_mu_ before mu_; no network call under mu_; wait
/// callbacks run with no lock held.
class EtcdStore final : public JobStore {
 public:
  explicit EtcdStore(EtcdOptions options);
  ~EtcdStore() override;  // Shutdown()

  uint64_t calls() const override { return calls_.load(std::memory_order_relaxed); }

  absl::Status Set(absl::string_view job, absl::string_view key, std::string value) override;
  WaitId WaitAsync(absl::string_view job, std::vector<std::string> keys, absl::Time deadline,
                   WaitCallback done) override;
  void CancelWait(WaitId id) override;
  absl::StatusOr<int64_t> Add(absl::string_view job, absl::string_view key, int64_t delta) override;
  absl::StatusOr<CompareSetResult> CompareSet(absl::string_view job, absl::string_view key,
                                              std::optional<std::string> expected,
                                              std::string desired) override;
  absl::StatusOr<bool> Delete(absl::string_view job, absl::string_view key) override;
  absl::StatusOr<std::vector<std::string>> List(absl::string_view job,
                                                absl::string_view prefix) override;

  absl::StatusOr<std::string> Peek(absl::string_view job, absl::string_view key) override;
  absl::StatusOr<std::vector<JobStats>> ListJobs() override;
  absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> ListSizes(
      absl::string_view job, absl::string_view prefix) override;
  /// Leaves the job: the last daemon to leave revokes its lease, which deletes its keys. Blocks
  /// for those calls (bounded by rpc_timeout): a new run of the job on this daemon starts after
  /// it.
  void DeleteJob(absl::string_view job) override;
  /// Also leaves every job this daemon holds (bounded by rpc_timeout in all).
  void Shutdown() override;

  /// OK once a member answers a read, within `timeout`; Unavailable naming the endpoints.
  absl::Status Probe(absl::Duration timeout);

  /// "etcd 127.0.0.1:2379,127.0.0.1:22379": how messages name the cluster.
  const std::string& name() const { return name_; }

 private:
  struct Member;
  struct WatchStream;
  // A change a watch reported while its wait was settling (not yet applied).
  struct Change {
    std::string key;
    std::optional<std::string> value;  // nullopt: deleted
  };
  struct Waiter {
    std::string job;
    std::vector<std::string> keys;                                // as asked, in order
    std::vector<std::optional<std::string>> values;               // per entry of keys
    absl::flat_hash_map<std::string, std::vector<size_t>> index;  // etcd key -> entries
    std::string lo, hi;                                           // the watched range
    absl::Time deadline;
    WaitCallback done;
    int64_t read_at = 0;  // the revision `values` were read at
    // Watch from here: everything before it has been seen. 0: the watch is created from the
    // store's current revision (etcd serves such a watch at once, where one from an older
    // revision waits for its catch-up loop, up to 100 ms), and the keys are read again at the
    // revision it was created at when that is past read_at ("settling").
    int64_t next_revision = 0;
    bool watching = false;  // a create was sent on the current stream
    bool reread = false;    // the watch's revision was compacted: read the keys again
    bool settling = false;  // read again at next_revision - 1; changes wait in `buffered`
    std::vector<Change> buffered;
  };
  struct Fired {
    WaitCallback done;
    absl::StatusOr<std::vector<std::string>> result;
  };
  // A job this daemon holds: the job's lease and the member key it joined with.
  struct Held {
    int64_t lease = 0;
    std::string member_key;
  };
  enum class Retry { kIdempotent, kOnlyUnsent };

  // One etcd call on the current member, moving to the next while members cannot be reached,
  // until `deadline` (default: rpc_timeout from now). Errors name etcd, the member and `what`.
  using Rpc = std::function<grpc::Status(Member&, grpc::ClientContext&)>;
  absl::Status Call(absl::string_view what, Retry retry, const Rpc& rpc,
                    std::optional<absl::Time> deadline = std::nullopt);
  absl::StatusOr<etcdserverpb::TxnResponse> Txn(absl::string_view what, Retry retry,
                                                const etcdserverpb::TxnRequest& request);
  absl::StatusOr<etcdserverpb::RangeResponse> Range(absl::string_view what, std::string key,
                                                    std::string range_end, bool count_only,
                                                    bool keys_only);
  void Authorize(grpc::ClientContext& ctx);
  // Fetches etcd's auth token for options_.user (when set and not yet held).
  grpc::Status Authenticate(Member& member, absl::Time deadline);

  absl::Status CheckKey(absl::string_view job, absl::string_view key) const;
  std::string JobPrefix(absl::string_view job) const;
  std::string KeyOf(absl::string_view job, absl::string_view key) const;
  // ResourceExhausted when `job` holds max_keys_per_job keys already.
  absl::Status CheckRoom(absl::string_view job);

  // The lease of `job`: the same id on every daemon.
  int64_t LeaseOf(absl::string_view job) const;
  // Grants `lease` (OK when it exists already).
  absl::Status Grant(absl::string_view job, int64_t lease);
  // Forgets `lease` for `job` after etcd said it is gone (expired): the next write re-joins.
  void ForgetLease(absl::string_view job, int64_t lease);
  // Adds this daemon's member key (when `member_key` is set) to a write's success branch.
  void AddJoin(etcdserverpb::TxnRequest& txn, const std::string& member_key, int64_t lease) const;
  // Leaves a job: removes the member key, revokes the lease when no member is left.
  void Release(const std::string& job, const Held& held, absl::Time deadline);
  // A write of a job's keys: puts under `lease`; when `join` is set, the write adds it with
  // AddJoin and says whether its success branch ran (the daemon then holds the job).
  using LeaseWrite = std::function<absl::StatusOr<bool>(int64_t lease, const std::string& join)>;
  // Runs `write`, joining the job on the first write; grants the lease and tries again when
  // etcd does not know it (the job's first daemon, or it expired).
  absl::Status WithLease(absl::string_view job, const LeaseWrite& write);

  // Reads the keys of `w` now: their values (nullopt: absent) and the revision read at.
  // At `at` (0: now).
  absl::Status ReadKeys(const Waiter& w, std::vector<std::optional<std::string>>& values,
                        int64_t& revision, int64_t at = 0);
  // The values once all are present (nullopt: not yet), or ResourceExhausted for a reply too
  // large.
  std::optional<absl::StatusOr<std::vector<std::string>>> Complete(const Waiter& w) const;
  absl::Status ExpiredLocked(const Waiter& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Unavailable for a wait that etcd could not be reached for (rpc_timeout and more).
  absl::Status UnreachableLocked(const Waiter& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  std::string ReachabilityLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  void RemoveWaiterLocked(WaitId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends the watch of `id` on the current stream unless it has one there.
  void SendCreate(WaitId id) ABSL_LOCKS_EXCLUDED(write_mu_, mu_);
  // Cancels the watch of `id` on the stream of `generation` (0: the current one), if it is
  // still the current stream.
  void SendCancel(WaitId id, uint64_t generation = 0) ABSL_LOCKS_EXCLUDED(write_mu_, mu_);
  void OnWatchResponse(const etcdserverpb::WatchResponse& response, uint64_t generation);
  static void RunCallbacks(std::vector<Fired>& fired);

  // Sends the watch of `id` again on a new stream (reading its keys again first when its
  // revision was compacted).
  void Recreate(WaitId id) ABSL_LOCKS_EXCLUDED(mu_);
  // Reads the keys of `id` again at the revision its watch was created at, then applies the
  // changes buffered meanwhile.
  void Settle(WaitId id) ABSL_LOCKS_EXCLUDED(mu_);
  void ControlLoop();
  // Opens a watch stream on the current member (waiting for it to connect, bounded); false
  // when none could be reached (the next member is tried next time).
  bool ConnectWatch();
  void ReadWatch(WatchStream* stream, uint64_t generation);
  void KeepAliveLoop();

  const EtcdOptions options_;
  const std::string name_;
  const std::string member_id_;  // this store's part of its member keys
  std::vector<std::unique_ptr<Member>> members_;
  std::atomic<size_t> current_{0};  // the member calls go to
  std::atomic<uint64_t> calls_{0};

  absl::Mutex token_mu_;
  std::string token_ ABSL_GUARDED_BY(token_mu_);  // etcd's auth token, when a user is set

  absl::Mutex acquire_mu_;  // one first write (a join) at a time

  absl::Mutex write_mu_;  // writes on the watch stream, and replacing it
  std::unique_ptr<WatchStream> watch_ ABSL_GUARDED_BY(write_mu_);

  mutable absl::Mutex mu_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  WaitId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<WaitId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, WaitId> deadlines_ ABSL_GUARDED_BY(mu_);
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // of the current watch stream
  bool watch_up_ ABSL_GUARDED_BY(mu_) = false;
  bool watch_broken_ ABSL_GUARDED_BY(mu_) = false;  // its reader ended: replace it
  bool kick_ ABSL_GUARDED_BY(mu_) = false;          // the control thread has work besides deadlines
  absl::Time down_since_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();  // past: never down
  std::string last_error_ ABSL_GUARDED_BY(mu_);       // why the watch stream is down
  std::deque<WaitId> recreate_ ABSL_GUARDED_BY(mu_);  // watches to send again
  std::deque<WaitId> settle_ ABSL_GUARDED_BY(mu_);    // waits to read again (Settle)
  absl::flat_hash_map<std::string, Held> held_ ABSL_GUARDED_BY(mu_);  // jobs by id
  uint64_t member_generation_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread control_;
  std::thread keepalive_;
};

}  // namespace gradsync::store
