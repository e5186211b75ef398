#pragma once

// The in-memory Store a job's root daemon holds, with per-job limits and bounded waits.

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/store/job_store.h"

namespace gradsync::store {

struct MemoryStoreOptions {
  int64_t max_key_bytes = 512;
  int64_t max_value_bytes = int64_t{1} << 20;
  int64_t max_keys_per_job = 65536;
  int64_t max_jobs = 1024;
  int64_t max_waiters = 65536;
  /// Most bytes (keys and values) one job, and all jobs together, may hold; clients' own keys
  /// (common/store_keys.h) at most 7/8 of the total, the rest kept for the daemons'.
  int64_t max_job_bytes = int64_t{64} << 20;
  int64_t max_total_bytes = int64_t{256} << 20;
  /// A job no session on this daemon holds (MemoryStore::SetHolder) and that no call named for
  /// this long is removed. Checked every minute (or every ttl, if shorter).
  absl::Duration idle_job_ttl = absl::Hours(1);
  /// Most bytes of values one wait may return (each value counted as often as it was asked
  /// for, plus its framing): the daemon sets it to --max_message_bytes less the envelope.
  int64_t max_reply_bytes = (16 << 20) - 4096;
};

/// The in-memory Store held by a job's root daemon.
///
/// Jobs come into being with their first key and go with their last (a job with no key is no
/// job), and are checked against the limits on every write (ResourceExhausted names the limit):
/// keys and bytes per job, bytes and jobs in all. A job that no session of this daemon holds and
/// that no call has named for `idle_job_ttl` is removed (logged). Job ids follow CheckJobId. A wait
/// whose values would exceed max_reply_bytes fails ResourceExhausted before any value is copied; a
/// timed-out wait names its first few missing keys and counts the rest. Waits on a job that does
/// not exist yet are allowed: a rendezvous may start before the first writer. One thread fires wait
/// deadlines.
///
/// Lock order: mu_ only; callbacks run after it is released.
class MemoryStore final : public JobStore {
 public:
  explicit MemoryStore(MemoryStoreOptions options = {});
  ~MemoryStore() override;  // Shutdown()

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
  absl::StatusOr<std::vector<JobStats>> ListJobs() override;  // never fails
  absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> ListSizes(
      absl::string_view job, absl::string_view prefix) override;
  /// Removes a job's keys at once; its pending waits keep waiting.
  void DeleteJob(absl::string_view job) override;
  void Shutdown() override;

  /// Tells the store which jobs are held by this daemon's sessions (their namespaces are never
  /// removed for idleness). Called without any store lock held; must not call into the store.
  /// Waits for a sweep that is asking the previous holder; SetHolder(nullptr) before the
  /// holder goes.
  void SetHolder(std::function<bool(absl::string_view job)> held);
  /// Bytes (keys and values) held now, for metrics and tests.
  int64_t total_bytes();

 private:
  using Keys = std::map<std::string, std::string, std::less<>>;  // ordered for List(prefix)
  struct Job {
    Keys kv;
    int64_t value_bytes = 0;
    int64_t key_bytes = 0;
    absl::Time last_used = absl::Now();  // the last call that named the job
  };
  using Jobs = std::map<std::string, Job, std::less<>>;
  struct Waiter {
    std::string job;
    std::vector<std::string> keys;
    absl::Time deadline;
    WaitCallback done;
    std::string parked_on;  // the missing key it is indexed under
    // keys[0, present) were there when last looked at: a wake resumes after them, so a wait on
    // n keys set one by one costs O(n) lookups, not O(n^2) under mu_.
    size_t present = 0;
  };
  struct Fired {
    WaitCallback done;
    absl::StatusOr<std::vector<std::string>> result;
  };

  absl::Status CheckKey(absl::string_view job, absl::string_view key) const;
  // Writes `value` at (job, key), enforcing the limits; wakes the waiters it satisfies.
  absl::Status PutLocked(absl::string_view job, absl::string_view key, std::string value,
                         std::vector<Fired>& fired) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Completes `id` if all its keys exist, else parks it under its first missing key.
  void TryCompleteLocked(WaitId id, std::vector<Fired>& fired) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RemoveWaiterLocked(WaitId id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<std::string> MissingKeysLocked(const Waiter& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // DeadlineExceeded naming the keys `w` still misses.
  absl::Status ExpiredLocked(const Waiter& w) const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Runs the callbacks of the waits that completed or expired; never with mu_ held.
  static void RunWaitCallbacks(std::vector<Fired>& fired);
  void TimerLoop();
  // Marks `job` used now, if it exists.
  void TouchLocked(absl::string_view job) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes `key` of the job at `job_it`, and the job with its last key.
  void EraseLocked(Jobs::iterator job_it, Keys::iterator it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the job at `job_it` with all its keys.
  void EraseJobLocked(Jobs::iterator job_it) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes the jobs idle past the ttl that no session holds; releases mu_ while it asks.
  void SweepIdleLocked(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const MemoryStoreOptions options_;
  std::atomic<uint64_t> calls_{0};
  absl::Mutex mu_;
  Jobs jobs_ ABSL_GUARDED_BY(mu_);
  int64_t total_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // keys and values of every job
  std::function<bool(absl::string_view)> held_ ABSL_GUARDED_BY(mu_);
  bool sweeping_ ABSL_GUARDED_BY(mu_) = false;  // a sweep is asking held_ (mu_ released)
  absl::Time next_sweep_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<WaitId, Waiter> waiters_ ABSL_GUARDED_BY(mu_);
  // (job '\0' key) -> waiters parked on that missing key.
  absl::flat_hash_map<std::string, std::vector<WaitId>> parked_ ABSL_GUARDED_BY(mu_);
  std::multimap<absl::Time, WaitId> deadlines_ ABSL_GUARDED_BY(mu_);
  WaitId next_id_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::thread timer_;
};

}  // namespace gradsync::store
