// Implementation of memory_store.h: the per-job key-value maps and their limits, pending waits,
// and the thread that fires wait deadlines.

#include "daemon/store/memory_store.h"

#include <algorithm>
#include <limits>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/bounded_text.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/store_keys.h"

namespace gradsync::store {
namespace {

std::string ParkKey(absl::string_view job, absl::string_view key) {
  return absl::StrCat(job, absl::string_view("\0", 1), key);
}

// Bytes a value adds to a reply beyond its own: its field tag and length prefix at most.
constexpr int64_t kValueOverheadBytes = 6;

// How often idle jobs are looked for.
constexpr absl::Duration kSweepEvery = absl::Minutes(1);

auto Log() { return logging::Logger("store"); }

}  // namespace

MemoryStore::MemoryStore(MemoryStoreOptions options)
    : options_(options), timer_([this] { TimerLoop(); }) {}

MemoryStore::~MemoryStore() {
  Shutdown();
  timer_.join();
}

absl::Status MemoryStore::CheckKey(absl::string_view job, absl::string_view key) const {
  return CheckJobKey(job, key, options_.max_key_bytes);
}

absl::Status MemoryStore::PutLocked(absl::string_view job, absl::string_view key, std::string value,
                                    std::vector<Fired>& fired) {
  if (shutdown_) return absl::UnavailableError("store is shutting down");
  if (static_cast<int64_t>(value.size()) > options_.max_value_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("value for key '", key, "' is ", value.size(), " bytes; the limit is ",
                     options_.max_value_bytes, " (--store_max_value_bytes)"));
  }
  auto job_it = jobs_.find(job);
  const std::string* current = nullptr;
  if (job_it != jobs_.end()) {
    auto found = job_it->second.kv.find(key);
    if (found != job_it->second.kv.end()) current = &found->second;
  }
  // What the write adds, checked against every limit before anything changes.
  const int64_t added = current != nullptr ? static_cast<int64_t>(value.size()) -
                                                 static_cast<int64_t>(current->size())
                                           : static_cast<int64_t>(key.size() + value.size());
  if (job_it == jobs_.end() && static_cast<int64_t>(jobs_.size()) >= options_.max_jobs) {
    return absl::ResourceExhaustedError(absl::StrCat("store holds ", jobs_.size(),
                                                     " jobs, the limit (--store_max_jobs); job '",
                                                     job, "' refused"));
  }
  if (current == nullptr && job_it != jobs_.end() &&
      static_cast<int64_t>(job_it->second.kv.size()) >= options_.max_keys_per_job) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job, "' holds ", job_it->second.kv.size(),
                     " keys, the limit (--store_max_keys_per_job)"));
  }
  const int64_t job_bytes =
      job_it == jobs_.end() ? 0 : job_it->second.key_bytes + job_it->second.value_bytes;
  if (added > 0 && job_bytes + added > options_.max_job_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("job '", job, "' would hold ", job_bytes + added,
                     " bytes of keys and values, more than its quota (--store_max_job_bytes ",
                     options_.max_job_bytes, ")"));
  }
  // Clients' own keys may fill 7/8 of the store: the rest is kept for the daemons' (formation,
  // links, membership), so that no client's bytes stop a job from forming.
  const int64_t total_limit = ClassOfKey(key) == KeyClass::kClient
                                  ? options_.max_total_bytes - options_.max_total_bytes / 8
                                  : options_.max_total_bytes;
  if (added > 0 && total_bytes_ + added > total_limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "the store would hold ", total_bytes_ + added, " bytes of keys and values, more than it ",
        total_limit == options_.max_total_bytes ? "may" : "keeps for clients' keys",
        " (--store_max_total_bytes ", options_.max_total_bytes, "); key '", key, "' of job '", job,
        "' refused"));
  }
  if (job_it == jobs_.end()) job_it = jobs_.emplace(std::string(job), Job{}).first;
  Job& j = job_it->second;
  auto it = j.kv.find(key);
  if (it == j.kv.end()) {
    it = j.kv.emplace(std::string(key), std::string()).first;
    j.key_bytes += static_cast<int64_t>(key.size());
  }
  j.value_bytes += static_cast<int64_t>(value.size()) - static_cast<int64_t>(it->second.size());
  total_bytes_ += added;
  j.last_used = absl::Now();
  it->second = std::move(value);

  auto parked = parked_.find(ParkKey(job, key));
  if (parked != parked_.end()) {
    std::vector<WaitId> ids = std::move(parked->second);
    parked_.erase(parked);
    for (WaitId id : ids) TryCompleteLocked(id, fired);
  }
  return absl::OkStatus();
}

std::vector<std::string> MemoryStore::MissingKeysLocked(const Waiter& w) const {
  std::vector<std::string> missing;
  absl::flat_hash_set<absl::string_view> seen;
  auto job_it = jobs_.find(w.job);
  for (const std::string& key : w.keys) {
    if (job_it != jobs_.end() && job_it->second.kv.count(key) != 0) continue;
    if (seen.insert(key).second) missing.push_back(key);
  }
  return missing;
}

void MemoryStore::TryCompleteLocked(WaitId id, std::vector<Fired>& fired) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  Waiter& w = it->second;
  auto job_it = jobs_.find(w.job);
  auto lookup = [&](const std::string& key)
                    ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> const std::string* {
    if (job_it == jobs_.end()) return nullptr;
    auto found = job_it->second.kv.find(key);
    return found == job_it->second.kv.end() ? nullptr : &found->second;
  };
  auto park = [&](size_t missing) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    w.present = missing;
    w.parked_on = w.keys[missing];
    parked_[ParkKey(w.job, w.parked_on)].push_back(id);
  };
  for (; w.present < w.keys.size(); ++w.present) {
    if (lookup(w.keys[w.present]) == nullptr) return park(w.present);
  }
  // Every key was seen; find the values (one may have been deleted since) and the reply's size,
  // and copy only once both are known to be fine.
  std::vector<const std::string*> found_values;
  found_values.reserve(w.keys.size());
  int64_t reply_bytes = 0;
  for (size_t i = 0; i < w.keys.size(); ++i) {
    const std::string* value = lookup(w.keys[i]);
    if (value == nullptr) return park(i);
    found_values.push_back(value);
    reply_bytes += static_cast<int64_t>(value->size()) + kValueOverheadBytes;
  }
  if (reply_bytes > options_.max_reply_bytes) {
    fired.push_back({std::move(w.done),
                     absl::ResourceExhaustedError(absl::StrCat(
                         "store wait job=", w.job, ": the reply would carry ", w.keys.size(),
                         " values in ", reply_bytes, " bytes, more than the limit of ",
                         options_.max_reply_bytes, " (--max_message_bytes); ask for fewer keys"))});
    RemoveWaiterLocked(id);
    return;
  }
  std::vector<std::string> values;
  values.reserve(found_values.size());
  for (const std::string* value : found_values) values.push_back(*value);
  fired.push_back({std::move(w.done), std::move(values)});
  RemoveWaiterLocked(id);
}

void MemoryStore::RemoveWaiterLocked(WaitId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  Waiter& w = it->second;
  if (!w.parked_on.empty()) {
    auto parked = parked_.find(ParkKey(w.job, w.parked_on));
    if (parked != parked_.end()) {
      auto& ids = parked->second;
      ids.erase(std::remove(ids.begin(), ids.end(), id), ids.end());
      if (ids.empty()) parked_.erase(parked);
    }
  }
  auto [lo, hi] = deadlines_.equal_range(w.deadline);
  for (auto d = lo; d != hi; ++d) {
    if (d->second == id) {
      deadlines_.erase(d);
      break;
    }
  }
  waiters_.erase(it);
}

absl::Status MemoryStore::ExpiredLocked(const Waiter& w) const {
  return absl::DeadlineExceededError(absl::StrCat(
      "store wait job=", w.job, " timed out; missing keys: ", JoinBounded(MissingKeysLocked(w))));
}

void MemoryStore::RunWaitCallbacks(std::vector<Fired>& fired) {
  for (Fired& f : fired) f.done(std::move(f.result));
  fired.clear();
}

absl::Status MemoryStore::Set(absl::string_view job, absl::string_view key, std::string value) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  if (absl::Status s = CheckKey(job, key); !s.ok()) return s;
  std::vector<Fired> fired;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    status = PutLocked(job, key, std::move(value), fired);
  }
  RunWaitCallbacks(fired);
  return status;
}

Store::WaitId MemoryStore::WaitAsync(absl::string_view job, std::vector<std::string> keys,
                                     absl::Time deadline, WaitCallback done) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  absl::Status invalid = CheckWaitKeys(job, keys, options_.max_key_bytes);
  std::vector<Fired> fired;
  WaitId id = 0;
  {
    absl::MutexLock lock(&mu_);
    id = next_id_++;
    if (invalid.ok() && shutdown_) invalid = absl::UnavailableError("store is shutting down");
    if (invalid.ok() && static_cast<int64_t>(waiters_.size()) >= options_.max_waiters) {
      invalid = absl::ResourceExhaustedError(absl::StrCat(
          "store has ", waiters_.size(), " pending waits, the limit; try again later"));
    }
    if (!invalid.ok()) {
      fired.push_back({std::move(done), invalid});
    } else {
      TouchLocked(job);
      Waiter& w = waiters_[id];
      w.job = std::string(job);
      w.keys = std::move(keys);
      w.deadline = deadline;
      w.done = std::move(done);
      deadlines_.emplace(deadline, id);
      TryCompleteLocked(id, fired);
      if (waiters_.count(id) != 0 && deadline <= absl::Now()) {
        // Already expired (a probe): answer now rather than from the timer thread.
        Waiter& parked = waiters_.at(id);
        fired.push_back({std::move(parked.done), ExpiredLocked(parked)});
        RemoveWaiterLocked(id);
      }
    }
  }
  RunWaitCallbacks(fired);
  return id;
}

void MemoryStore::CancelWait(WaitId id) {
  std::vector<Fired> fired;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    fired.push_back({std::move(it->second.done), absl::CancelledError("wait cancelled")});
    RemoveWaiterLocked(id);
  }
  RunWaitCallbacks(fired);
}

absl::StatusOr<int64_t> MemoryStore::Add(absl::string_view job, absl::string_view key,
                                         int64_t delta) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  if (absl::Status s = CheckKey(job, key); !s.ok()) return s;
  std::vector<Fired> fired;
  absl::StatusOr<int64_t> result;
  {
    absl::MutexLock lock(&mu_);
    int64_t current = 0;
    auto job_it = jobs_.find(job);
    if (job_it != jobs_.end()) {
      auto it = job_it->second.kv.find(key);
      if (it != job_it->second.kv.end() && !absl::SimpleAtoi(it->second, &current)) {
        return absl::FailedPreconditionError(
            absl::StrCat("Add on key '", key, "': its value is not a decimal int64 counter"));
      }
    }
    if ((delta > 0 && current > std::numeric_limits<int64_t>::max() - delta) ||
        (delta < 0 && current < std::numeric_limits<int64_t>::min() - delta)) {
      return absl::OutOfRangeError(absl::StrCat("Add on key '", key, "' overflows int64"));
    }
    const int64_t next = current + delta;
    absl::Status s = PutLocked(job, key, absl::StrCat(next), fired);
    result = s.ok() ? absl::StatusOr<int64_t>(next) : s;
  }
  RunWaitCallbacks(fired);
  return result;
}

absl::StatusOr<CompareSetResult> MemoryStore::CompareSet(absl::string_view job,
                                                         absl::string_view key,
                                                         std::optional<std::string> expected,
                                                         std::string desired) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  if (absl::Status s = CheckKey(job, key); !s.ok()) return s;
  std::vector<Fired> fired;
  absl::StatusOr<CompareSetResult> result;
  {
    absl::MutexLock lock(&mu_);
    const std::string* current = nullptr;
    auto job_it = jobs_.find(job);
    if (job_it != jobs_.end()) {
      auto it = job_it->second.kv.find(key);
      if (it != job_it->second.kv.end()) current = &it->second;
    }
    const bool match = expected.has_value() ? (current && *current == *expected) : !current;
    if (!match) {
      result = CompareSetResult{false, current ? *current : std::string()};
    } else {
      std::string value = desired;
      absl::Status s = PutLocked(job, key, std::move(desired), fired);
      result =
          s.ok() ? absl::StatusOr<CompareSetResult>(CompareSetResult{true, std::move(value)}) : s;
    }
  }
  RunWaitCallbacks(fired);
  return result;
}

absl::StatusOr<bool> MemoryStore::Delete(absl::string_view job, absl::string_view key) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  if (absl::Status s = CheckKey(job, key); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto job_it = jobs_.find(job);
  if (job_it == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no keys"));
  job_it->second.last_used = absl::Now();
  auto it = job_it->second.kv.find(key);
  if (it == job_it->second.kv.end()) return false;
  EraseLocked(job_it, it);
  return true;
}

void MemoryStore::EraseLocked(Jobs::iterator job_it, Keys::iterator it) {
  Job& j = job_it->second;
  const int64_t bytes = static_cast<int64_t>(it->first.size() + it->second.size());
  j.key_bytes -= static_cast<int64_t>(it->first.size());
  j.value_bytes -= static_cast<int64_t>(it->second.size());
  total_bytes_ -= bytes;
  j.kv.erase(it);
  if (j.kv.empty()) EraseJobLocked(job_it);  // a job with no key is no job: it counts for nothing
}

void MemoryStore::EraseJobLocked(Jobs::iterator job_it) {
  total_bytes_ -= job_it->second.key_bytes + job_it->second.value_bytes;
  jobs_.erase(job_it);
}

void MemoryStore::TouchLocked(absl::string_view job) {
  auto it = jobs_.find(job);
  if (it != jobs_.end()) it->second.last_used = absl::Now();
}

absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> MemoryStore::ListSizes(
    absl::string_view job, absl::string_view prefix) {
  if (absl::Status s = CheckJobId(job); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto job_it = jobs_.find(job);
  if (job_it == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no keys"));
  job_it->second.last_used = absl::Now();
  std::vector<std::pair<std::string, int64_t>> out;
  const auto& kv = job_it->second.kv;
  for (auto it = kv.lower_bound(prefix); it != kv.end() && absl::StartsWith(it->first, prefix);
       ++it) {
    out.emplace_back(it->first, static_cast<int64_t>(it->second.size()));
  }
  return out;
}

absl::StatusOr<std::vector<std::string>> MemoryStore::List(absl::string_view job,
                                                           absl::string_view prefix) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  auto sizes = ListSizes(job, prefix);
  if (!sizes.ok()) return sizes.status();
  std::vector<std::string> keys;
  keys.reserve(sizes->size());
  for (auto& [key, size] : *sizes) keys.push_back(std::move(key));
  return keys;
}

absl::StatusOr<std::string> MemoryStore::Peek(absl::string_view job, absl::string_view key) {
  if (absl::Status s = CheckJobId(job); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  auto job_it = jobs_.find(job);
  if (job_it == jobs_.end())
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no keys"));
  auto it = job_it->second.kv.find(key);
  if (it == job_it->second.kv.end()) {
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no key '", key, "'"));
  }
  return it->second;
}

absl::StatusOr<std::vector<JobStats>> MemoryStore::ListJobs() {
  absl::MutexLock lock(&mu_);
  std::vector<JobStats> out;
  for (const auto& [name, job] : jobs_) {
    out.push_back({name, static_cast<int64_t>(job.kv.size()), job.value_bytes});
  }
  return out;
}

void MemoryStore::DeleteJob(absl::string_view job) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job);
  if (it != jobs_.end()) EraseJobLocked(it);
}

void MemoryStore::SetHolder(std::function<bool(absl::string_view job)> held) {
  absl::MutexLock lock(&mu_);
  auto idle = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return !sweeping_; };
  mu_.Await(absl::Condition(&idle));  // no sweep calls the one it replaces any longer
  held_ = std::move(held);
}

int64_t MemoryStore::total_bytes() {
  absl::MutexLock lock(&mu_);
  return total_bytes_;
}

void MemoryStore::SweepIdleLocked(absl::Time now) {
  absl::flat_hash_set<absl::string_view> waited;  // a pending wait holds its job too
  for (const auto& [id, w] : waiters_) waited.insert(w.job);
  std::vector<std::pair<std::string, absl::Time>> idle;
  for (const auto& [name, job] : jobs_) {
    if (now - job.last_used >= options_.idle_job_ttl && !waited.contains(name)) {
      idle.emplace_back(name, job.last_used);
    }
  }
  if (idle.empty()) return;
  const std::function<bool(absl::string_view)> held = held_;
  std::vector<bool> keep(idle.size(), false);
  sweeping_ = true;
  mu_.Unlock();  // the holder (the engine) takes its own locks, which may call into the store
  for (size_t i = 0; i < idle.size(); ++i) keep[i] = held && held(idle[i].first);
  mu_.Lock();
  sweeping_ = false;
  for (size_t i = 0; i < idle.size(); ++i) {
    auto it = jobs_.find(idle[i].first);
    // Used meanwhile, or held: it stays.
    if (keep[i] || it == jobs_.end() || it->second.last_used != idle[i].second) continue;
    Log()->info(
        "store: removing job={} keys={} bytes={}: no session here holds it and no call "
        "named it for {}",
        it->first, it->second.kv.size(), it->second.key_bytes + it->second.value_bytes,
        absl::FormatDuration(options_.idle_job_ttl));
    EraseJobLocked(it);
  }
}

void MemoryStore::Shutdown() {
  std::vector<Fired> fired;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    for (auto& [id, w] : waiters_) {
      fired.push_back({std::move(w.done), absl::UnavailableError("store is shutting down")});
    }
    waiters_.clear();
    parked_.clear();
    deadlines_.clear();
  }
  RunWaitCallbacks(fired);
}

void MemoryStore::TimerLoop() {
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    const absl::Time now = absl::Now();
    if (now >= next_sweep_) {
      SweepIdleLocked(now);
      next_sweep_ = absl::Now() + std::min(kSweepEvery, options_.idle_job_ttl);
      continue;
    }
    const absl::Time next = std::min(
        next_sweep_, deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first);
    if (next > now) {
      // Woken by any change of the earliest deadline or by shutdown.
      auto changed = [this, next]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return shutdown_ || (!deadlines_.empty() && deadlines_.begin()->first < next);
      };
      mu_.AwaitWithDeadline(absl::Condition(&changed), next);
      continue;
    }
    std::vector<Fired> fired;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const WaitId id = deadlines_.begin()->second;
      Waiter& w = waiters_.at(id);
      fired.push_back({std::move(w.done), ExpiredLocked(w)});
      RemoveWaiterLocked(id);
    }
    mu_.Unlock();
    RunWaitCallbacks(fired);
    mu_.Lock();
  }
}

}  // namespace gradsync::store
