// Implementation of etcd_store.h: waits as watches on one stream, and the threads that keep
// it (connect, read, recreate, settle, the control loop).

#include <algorithm>
#include <limits>
#include <random>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/bounded_text.h"
#include "common/job_id.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "daemon/store/etcd_internal.h"
#include "daemon/store/etcd_store.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::store {

using etcd_internal::kMaxKeysReadOneByOne;
using etcd_internal::kValueOverheadBytes;
using etcd_internal::Log;
using etcd_internal::RangeRequest;
using etcd_internal::RangeResponse;
using etcd_internal::TxnRequest;
using etcd_internal::TxnResponse;

// ---- Waits ----------------------------------------------------------------------------------

absl::Status EtcdStore::ReadKeys(const Waiter& w, std::vector<std::optional<std::string>>& values,
                                 int64_t& revision, int64_t at) {
  const std::string what = absl::StrCat("reading the keys of a wait job=", w.job);
  auto take = [&](const RangeResponse& range) {
    for (const auto& kv : range.kvs()) {
      auto it = w.index.find(kv.key());
      if (it == w.index.end()) continue;
      for (size_t i : it->second) values[i] = kv.value();
    }
  };
  // One Range call: `key`, or [key, range_end) when range_end is set.
  auto read_range = [&](const std::string& key, const std::string& range_end) -> absl::Status {
    RangeRequest request;
    request.set_key(key);
    if (!range_end.empty()) request.set_range_end(range_end);
    request.set_revision(at);
    RangeResponse r;
    GRADSYNC_RETURN_IF_ERROR(
        Call(what, Retry::kIdempotent, [&](Member& m, grpc::ClientContext& ctx) {
          r.Clear();
          return m.kv->Range(&ctx, request, &r);
        }));
    take(r);
    revision = r.header().revision();
    return absl::OkStatus();
  };
  values.assign(w.keys.size(), std::nullopt);
  if (w.index.size() == 1) {
    GRADSYNC_RETURN_IF_ERROR(read_range(w.index.begin()->first, ""));
  } else if (w.index.size() <= kMaxKeysReadOneByOne) {
    TxnRequest txn;
    for (const auto& [key, entries] : w.index) {
      auto* range = txn.add_success()->mutable_request_range();
      range->set_key(key);
      range->set_revision(at);
    }
    GRADSYNC_ASSIGN_OR_RETURN(TxnResponse r, Txn(what, Retry::kIdempotent, txn));
    for (const auto& op : r.responses()) take(op.response_range());
    revision = r.header().revision();
  } else {
    GRADSYNC_RETURN_IF_ERROR(read_range(w.lo, w.hi));
  }
  if (at != 0) revision = at;  // the header says the store's current revision
  return absl::OkStatus();
}

std::optional<absl::StatusOr<std::vector<std::string>>> EtcdStore::Complete(const Waiter& w) const {
  int64_t reply_bytes = 0;
  for (const auto& value : w.values) {
    if (!value.has_value()) return std::nullopt;
    reply_bytes += static_cast<int64_t>(value->size()) + kValueOverheadBytes;
  }
  if (reply_bytes > options_.limits.max_reply_bytes) {
    return absl::StatusOr<std::vector<std::string>>(absl::ResourceExhaustedError(absl::StrCat(
        "store wait job=", w.job, ": the reply would carry ", w.keys.size(), " values in ",
        reply_bytes, " bytes, more than the limit of ", options_.limits.max_reply_bytes,
        " (--max_message_bytes); ask for fewer keys")));
  }
  std::vector<std::string> values;
  values.reserve(w.values.size());
  for (const auto& value : w.values) values.push_back(*value);
  return absl::StatusOr<std::vector<std::string>>(std::move(values));
}

namespace {
std::vector<std::string> MissingKeys(const std::vector<std::string>& keys,
                                     const std::vector<std::optional<std::string>>& values) {
  std::vector<std::string> missing;
  absl::flat_hash_set<absl::string_view> seen;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!values[i].has_value() && seen.insert(keys[i]).second) missing.push_back(keys[i]);
  }
  return missing;
}
}  // namespace

std::string EtcdStore::ReachabilityLocked() const {
  if (watch_up_ || down_since_ == absl::InfinitePast()) return "";
  return absl::StrCat(
      "; ", name_, " unreachable for ",
      absl::FormatDuration(absl::Trunc(absl::Now() - down_since_, absl::Milliseconds(1))), ": ",
      last_error_);
}

absl::Status EtcdStore::ExpiredLocked(const Waiter& w) const {
  return absl::DeadlineExceededError(
      absl::StrCat("store wait job=", w.job, " timed out; missing keys: ",
                   JoinBounded(MissingKeys(w.keys, w.values)), ReachabilityLocked()));
}

absl::Status EtcdStore::UnreachableLocked(const Waiter& w) const {
  return absl::UnavailableError(absl::StrCat(
      "store wait job=", w.job, ": ", name_, " unreachable for ",
      absl::FormatDuration(absl::Trunc(absl::Now() - down_since_, absl::Milliseconds(1))), " (",
      last_error_, "); missing keys: ", JoinBounded(MissingKeys(w.keys, w.values))));
}

void EtcdStore::RemoveWaiterLocked(WaitId id) {
  auto it = waiters_.find(id);
  if (it == waiters_.end()) return;
  auto [lo, hi] = deadlines_.equal_range(it->second.deadline);
  for (auto d = lo; d != hi; ++d) {
    if (d->second == id) {
      deadlines_.erase(d);
      break;
    }
  }
  waiters_.erase(it);
}

void EtcdStore::RunCallbacks(std::vector<Fired>& fired) {
  for (Fired& f : fired) f.done(std::move(f.result));
  fired.clear();
}

Store::WaitId EtcdStore::WaitAsync(absl::string_view job, std::vector<std::string> keys,
                                   absl::Time deadline, WaitCallback done) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  absl::Status invalid = CheckWaitKeys(job, keys, options_.limits.max_key_bytes);
  WaitId id = 0;
  {
    absl::MutexLock lock(&mu_);
    id = next_id_++;
    if (invalid.ok() && shutdown_) invalid = absl::UnavailableError("store is shutting down");
    if (invalid.ok() && static_cast<int64_t>(waiters_.size()) >= options_.limits.max_waiters) {
      invalid = absl::ResourceExhaustedError(absl::StrCat(
          "store has ", waiters_.size(), " pending waits, the limit; try again later"));
    }
  }
  if (!invalid.ok()) {
    done(invalid);
    return id;
  }
  Waiter w;
  w.job = std::string(job);
  w.keys = std::move(keys);
  for (size_t i = 0; i < w.keys.size(); ++i) w.index[KeyOf(job, w.keys[i])].push_back(i);
  for (const auto& [key, entries] : w.index) {
    if (w.lo.empty() || key < w.lo) w.lo = key;
    if (key > w.hi) w.hi = key;
  }
  w.hi.push_back('\0');  // the range end is exclusive
  int64_t revision = 0;
  if (absl::Status read = ReadKeys(w, w.values, revision); !read.ok()) {
    done(absl::Status(read.code(), absl::StrCat("store wait job=", job, ": ", read.message())));
    return id;
  }
  if (auto complete = Complete(w)) {
    done(*std::move(complete));
    return id;
  }
  w.read_at = revision;
  w.next_revision = 0;  // from the current revision: see Waiter
  w.deadline = deadline;
  std::vector<Fired> fired;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) {
      fired.push_back({std::move(done), absl::UnavailableError("store is shutting down")});
    } else if (deadline <= absl::Now()) {
      fired.push_back({std::move(done), ExpiredLocked(w)});  // a probe: answered now
    } else {
      w.done = std::move(done);
      waiters_.emplace(id, std::move(w));
      deadlines_.emplace(deadline, id);
      if (!watch_up_) kick_ = true;  // the control thread connects the watch stream
    }
  }
  if (!fired.empty()) {
    RunCallbacks(fired);
    return id;
  }
  SendCreate(id);
  return id;
}

void EtcdStore::CancelWait(WaitId id) {
  std::vector<Fired> fired;
  bool watching = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    watching = it->second.watching;
    fired.push_back({std::move(it->second.done), absl::CancelledError("wait cancelled")});
    RemoveWaiterLocked(id);
  }
  RunCallbacks(fired);
  if (watching) SendCancel(id);
}

void EtcdStore::SendCreate(WaitId id) {
  absl::MutexLock write_lock(&write_mu_);
  if (!watch_) return;
  etcdserverpb::WatchRequest request;
  {
    absl::MutexLock lock(&mu_);
    if (!watch_up_ || watch_->generation != generation_) return;
    auto it = waiters_.find(id);
    if (it == waiters_.end() || it->second.watching) return;
    Waiter& w = it->second;
    w.watching = true;
    auto* create = request.mutable_create_request();
    create->set_key(w.lo);
    create->set_range_end(w.hi);
    create->set_start_revision(w.next_revision);
    create->set_watch_id(static_cast<int64_t>(id));
  }
  (void)watch_->rw->Write(request);  // on failure the reader sees the stream end
}

void EtcdStore::SendCancel(WaitId id, uint64_t generation) {
  absl::MutexLock write_lock(&write_mu_);
  if (!watch_ || (generation != 0 && watch_->generation != generation)) return;
  {
    absl::MutexLock lock(&mu_);
    if (!watch_up_ || watch_->generation != generation_) return;
  }
  etcdserverpb::WatchRequest request;
  request.mutable_cancel_request()->set_watch_id(static_cast<int64_t>(id));
  (void)watch_->rw->Write(request);
}

void EtcdStore::OnWatchResponse(const etcdserverpb::WatchResponse& response, uint64_t generation) {
  std::vector<Fired> fired;
  bool cancel = false;
  const WaitId id = static_cast<WaitId>(response.watch_id());
  {
    absl::MutexLock lock(&mu_);
    if (generation != generation_) return;
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;  // finished: its cancel is on its way
    Waiter& w = it->second;
    if (response.created() && !response.canceled() && w.next_revision == 0) {
      // Created from the current revision: changes after it come as events. Those between the
      // keys' read and it are read at it, if any happened.
      const int64_t created_at = response.header().revision();
      w.next_revision = created_at + 1;
      if (created_at > w.read_at) {
        w.settling = true;
        settle_.push_back(id);
        kick_ = true;
      }
    }
    if (response.canceled()) {
      if (response.compact_revision() > 0) {  // its start was compacted away: read again
        w.watching = false;
        w.reread = true;
        recreate_.push_back(id);
        kick_ = true;
      } else {
        fired.push_back(
            {std::move(w.done), absl::UnavailableError(absl::StrCat(
                                    "store wait job=", w.job, ": ", name_, " ended its watch: ",
                                    response.cancel_reason().empty() ? "no reason given"
                                                                     : response.cancel_reason()))});
        RemoveWaiterLocked(id);
      }
    } else if (response.events_size() > 0) {
      for (const auto& event : response.events()) {
        w.next_revision = std::max(w.next_revision, event.kv().mod_revision() + 1);
        auto entries = w.index.find(event.kv().key());
        if (entries == w.index.end()) continue;  // another key in the watched range
        std::optional<std::string> value;
        if (event.type() == mvccpb::Event::PUT) value = event.kv().value();
        if (w.settling) {
          w.buffered.push_back({event.kv().key(), std::move(value)});
          continue;
        }
        for (size_t i : entries->second) w.values[i] = value;
      }
      if (auto complete = w.settling ? std::nullopt : Complete(w)) {
        fired.push_back({std::move(w.done), *std::move(complete)});
        RemoveWaiterLocked(id);
        cancel = true;
      }
    }
  }
  RunCallbacks(fired);
  if (cancel) SendCancel(id, generation);
}

// ---- Threads --------------------------------------------------------------------------------

bool EtcdStore::ConnectWatch() {
  std::unique_ptr<WatchStream> old;
  {
    absl::MutexLock lock(&write_mu_);
    old = std::move(watch_);
  }
  if (old) {  // its reader has seen the end, or ends now
    old->ctx.TryCancel();
    old->reader.join();
    old.reset();
  }
  {
    absl::MutexLock lock(&mu_);
    watch_broken_ = false;
    watch_up_ = false;
  }
  const size_t index = current_.load();
  Member& m = *members_[index % members_.size()];
  const absl::Time start = absl::Now();
  // Opening a stream on a member that cannot be reached would block: wait for a connection
  // first, briefly, and try the next member next time.
  const bool connected = m.channel->WaitForConnected(
      absl::ToChronoTime(start + std::min(options_.rpc_timeout, absl::Seconds(1))));
  grpc::Status auth = connected ? Authenticate(m, start + options_.rpc_timeout) : grpc::Status::OK;
  if (!connected || !auth.ok()) {
    size_t expected = index;
    current_.compare_exchange_strong(expected, index + 1);
    absl::MutexLock lock(&mu_);
    if (down_since_ == absl::InfinitePast()) down_since_ = start;
    last_error_ = connected ? absl::StrCat(m.endpoint, ": ", auth.error_message())
                            : absl::StrCat(m.endpoint, ": cannot connect");
    return false;
  }
  auto stream = std::make_unique<WatchStream>();
  stream->member = index;
  // etcd ends the stream if its member loses the cluster's leader, instead of leaving the
  // watches silent: the stream then moves to another member.
  stream->ctx.AddMetadata("hasleader", "true");
  Authorize(stream->ctx);
  stream->rw = m.watch->Watch(&stream->ctx);
  absl::MutexLock write_lock(&write_mu_);
  absl::MutexLock lock(&mu_);
  const uint64_t generation = ++generation_;
  stream->generation = generation;
  watch_up_ = true;
  if (down_since_ != absl::InfinitePast()) {
    Log()->info("{} reachable again through {}", name_, m.endpoint);
  }
  down_since_ = absl::InfinitePast();
  recreate_.clear();
  for (auto& [id, w] : waiters_) {
    w.watching = false;
    recreate_.push_back(id);
  }
  WatchStream* raw = stream.get();
  raw->reader = std::thread([this, raw, generation] { ReadWatch(raw, generation); });
  watch_ = std::move(stream);
  return true;
}

void EtcdStore::ReadWatch(WatchStream* stream, uint64_t generation) {
  etcdserverpb::WatchResponse response;
  while (stream->rw->Read(&response)) OnWatchResponse(response, generation);
  const grpc::Status s = stream->rw->Finish();
  if (absl::StrContains(s.error_message(), "auth token")) {
    absl::MutexLock lock(&token_mu_);
    token_.clear();  // expired: the next stream authenticates again
  }
  absl::MutexLock lock(&mu_);
  if (generation != generation_ || shutdown_) return;
  watch_up_ = false;
  watch_broken_ = true;
  down_since_ = absl::Now();
  const Member& m = *members_[stream->member % members_.size()];
  last_error_ = absl::StrCat(m.endpoint, ": ", s.error_message());
  size_t expected = stream->member;
  current_.compare_exchange_strong(expected, stream->member + 1);
  Log()->warn("{}: watch stream on {} ended ({}); moving to the next member", name_, m.endpoint,
              s.error_message());
}

void EtcdStore::Recreate(WaitId id) {
  Waiter reread;  // what ReadKeys needs, copied: the keys are read with no lock held
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end()) return;
    if (it->second.reread) {
      reread.job = it->second.job;
      reread.keys = it->second.keys;
      reread.index = it->second.index;
      reread.lo = it->second.lo;
      reread.hi = it->second.hi;
    }
  }
  if (!reread.keys.empty()) {  // its revision was compacted: read the keys again, watch from there
    std::vector<std::optional<std::string>> values;
    int64_t revision = 0;
    const absl::Status read = ReadKeys(reread, values, revision);
    std::vector<Fired> fired;
    {
      absl::MutexLock lock(&mu_);
      auto it = waiters_.find(id);
      if (it == waiters_.end()) return;
      Waiter& w = it->second;
      if (!read.ok()) {
        fired.push_back({std::move(w.done), read});
        RemoveWaiterLocked(id);
      } else {
        w.values = std::move(values);
        w.read_at = revision;
        w.next_revision = revision + 1;
        w.reread = false;
        w.settling = false;
        w.buffered.clear();
        if (auto complete = Complete(w)) {
          fired.push_back({std::move(w.done), *std::move(complete)});
          RemoveWaiterLocked(id);
        }
      }
    }
    if (!fired.empty()) {
      RunCallbacks(fired);
      return;
    }
  }
  SendCreate(id);
}

void EtcdStore::Settle(WaitId id) {
  Waiter copy;  // what ReadKeys needs: the keys are read with no lock held
  int64_t at = 0;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end() || !it->second.settling) return;
    copy.job = it->second.job;
    copy.keys = it->second.keys;
    copy.index = it->second.index;
    copy.lo = it->second.lo;
    copy.hi = it->second.hi;
    at = it->second.next_revision - 1;
  }
  std::vector<std::optional<std::string>> values;
  int64_t revision = 0;
  const absl::Status read = ReadKeys(copy, values, revision, at);
  std::vector<Fired> fired;
  bool cancel = false;
  {
    absl::MutexLock lock(&mu_);
    auto it = waiters_.find(id);
    if (it == waiters_.end() || !it->second.settling) return;
    Waiter& w = it->second;
    if (!read.ok()) {
      fired.push_back({std::move(w.done),
                       absl::Status(read.code(),
                                    absl::StrCat("store wait job=", w.job, ": ", read.message()))});
      cancel = w.watching;
      RemoveWaiterLocked(id);
    } else {
      w.values = std::move(values);
      w.read_at = at;
      w.settling = false;
      for (Change& change : w.buffered) {
        for (size_t i : w.index.at(change.key)) w.values[i] = change.value;
      }
      w.buffered.clear();
      if (auto complete = Complete(w)) {
        fired.push_back({std::move(w.done), *std::move(complete)});
        cancel = w.watching;
        RemoveWaiterLocked(id);
      }
    }
  }
  RunCallbacks(fired);
  if (cancel) SendCancel(id);
}

void EtcdStore::ControlLoop() {
  absl::Time retry_at = absl::InfinitePast();
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    const absl::Time now = absl::Now();
    std::vector<Fired> fired;
    std::vector<WaitId> cancels;
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      const WaitId id = deadlines_.begin()->second;
      Waiter& w = waiters_.at(id);
      if (w.watching) cancels.push_back(id);
      fired.push_back({std::move(w.done), ExpiredLocked(w)});
      RemoveWaiterLocked(id);
    }
    // No member reachable for rpc_timeout: the waits fail rather than sit out their deadlines.
    if (!watch_up_ && down_since_ != absl::InfinitePast() &&
        now - down_since_ >= options_.rpc_timeout) {
      for (auto& [id, w] : waiters_) fired.push_back({std::move(w.done), UnreachableLocked(w)});
      waiters_.clear();
      deadlines_.clear();
      recreate_.clear();
    }
    if (!fired.empty()) {
      mu_.Unlock();
      RunCallbacks(fired);
      for (WaitId id : cancels) SendCancel(id);
      mu_.Lock();
      continue;
    }
    kick_ = false;
    if (watch_broken_ || (!watch_up_ && !waiters_.empty() && now >= retry_at)) {
      mu_.Unlock();
      const bool connected = ConnectWatch();
      mu_.Lock();
      retry_at = connected ? absl::InfinitePast() : absl::Now() + absl::Milliseconds(100);
      continue;
    }
    if (!settle_.empty()) {
      const WaitId id = settle_.front();
      settle_.pop_front();
      mu_.Unlock();
      Settle(id);
      mu_.Lock();
      continue;
    }
    if (watch_up_ && !recreate_.empty()) {
      std::vector<WaitId> ids(recreate_.begin(), recreate_.end());
      recreate_.clear();
      mu_.Unlock();
      for (WaitId id : ids) Recreate(id);
      mu_.Lock();
      continue;
    }
    // Sleep until the earliest deadline, a reconnection attempt, or new work.
    absl::Time next = deadlines_.empty() ? absl::InfiniteFuture() : deadlines_.begin()->first;
    if (!watch_up_ && !waiters_.empty()) {
      next = std::min(next, std::max(retry_at, now));
      if (down_since_ != absl::InfinitePast()) {
        next = std::min(next, down_since_ + options_.rpc_timeout);
      }
    }
    if (next <= now) continue;
    auto changed = [this, next]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
      return shutdown_ || kick_ || watch_broken_ || !settle_.empty() ||
             (watch_up_ && !recreate_.empty()) ||
             (!deadlines_.empty() && deadlines_.begin()->first < next);
    };
    mu_.AwaitWithDeadline(absl::Condition(&changed), next);
  }
}

}  // namespace gradsync::store
