#pragma once

// JobStore: the Store a daemon serves its jobs from, with what the daemon itself needs of it
// (the operator's views, a job's end, shutdown). MemoryStore and EtcdStore implement it.

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/store.h"

namespace gradsync::store {

/// A key of job `job` as every job store takes it: a valid job id, a key of 1 to
/// `max_key_bytes` bytes (--store_max_key_bytes); INVALID_ARGUMENT saying which.
absl::Status CheckJobKey(absl::string_view job, absl::string_view key, int64_t max_key_bytes);
/// The keys of a wait: at least one, each as CheckJobKey takes it.
absl::Status CheckWaitKeys(absl::string_view job, const std::vector<std::string>& keys,
                           int64_t max_key_bytes);

/// Size of one job's namespace, for inspection.
struct JobStats {
  std::string job;
  int64_t keys = 0;
  int64_t value_bytes = 0;
};

/// The Store behind a daemon's Store and Inspect services and its jobs' formation: the
/// embedded MemoryStore (the job's root daemon holds the keys) or EtcdStore (every daemon of a
/// job reaches the same etcd cluster). All methods are thread-safe; none waits past its own
/// bounded deadline.
class JobStore : public Store {
 public:
  /// Calls of the Store methods so far (Set, WaitAsync, Add, CompareSet, Delete, List), for
  /// metrics.
  virtual uint64_t calls() const = 0;

  /// The value of `key` now, without waiting: NotFound for a missing job or key.
  virtual absl::StatusOr<std::string> Peek(absl::string_view job, absl::string_view key) = 0;
  /// Every job, sorted by name.
  virtual absl::StatusOr<std::vector<JobStats>> ListJobs() = 0;
  /// (key, value size) for keys of `job` under `prefix`, sorted; NotFound for an unknown job.
  virtual absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> ListSizes(
      absl::string_view job, absl::string_view prefix) = 0;

  /// The job ended on this daemon: its keys go once no daemon holds the job any longer
  /// (embedded: at once, from the root's store). May block for the store's round trips (etcd:
  /// up to its call timeout); the engine calls it on a job-end thread, and a new run of the job
  /// registers once it has returned.
  virtual void DeleteJob(absl::string_view job) = 0;

  /// Fails every pending wait with Unavailable and refuses new ones. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace gradsync::store
