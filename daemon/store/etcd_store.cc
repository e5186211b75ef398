// Implementation of etcd_store.h: the Store calls as etcd reads, puts and transactions with
// failover between members (the job leases: etcd_leases.cc; waits: etcd_watch.cc).

#include "daemon/store/etcd_store.h"

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
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::store {

using etcd_internal::AddCompare;
using etcd_internal::Compare;
using etcd_internal::Endpoint;
using etcd_internal::kMaxAddAttempts;
using etcd_internal::PrefixEnd;
using etcd_internal::RandomId;
using etcd_internal::RangeRequest;
using etcd_internal::RangeResponse;
using etcd_internal::SetPrefixRange;
using etcd_internal::TxnRequest;
using etcd_internal::TxnResponse;

namespace etcd_internal {
// etcd's end of the range of every key starting with `prefix`.
std::string PrefixEnd(std::string prefix) {
  for (size_t i = prefix.size(); i-- > 0;) {
    if (static_cast<unsigned char>(prefix[i]) < 0xff) {
      ++prefix[i];
      prefix.resize(i + 1);
      return prefix;
    }
  }
  return std::string(1, '\0');
}

std::string Endpoint(absl::string_view endpoint) {
  for (absl::string_view scheme : {"http://", "https://"}) {
    if (absl::StartsWith(endpoint, scheme)) endpoint.remove_prefix(scheme.size());
  }
  while (absl::EndsWith(endpoint, "/")) endpoint.remove_suffix(1);
  return std::string(endpoint);
}

// 16 random hex digits.
std::string RandomId() {
  std::random_device device;
  std::mt19937_64 bits((uint64_t{device()} << 32) ^ device() ^
                       static_cast<uint64_t>(absl::ToUnixNanos(absl::Now())));
  return absl::StrCat(absl::Hex(bits(), absl::kZeroPad16));
}

bool LeaseGone(const absl::Status& s) {
  return s.code() == absl::StatusCode::kNotFound &&
         absl::StrContains(s.message(), "lease not found");
}

void SetPrefixRange(RangeRequest& r, const std::string& prefix) {
  r.set_key(prefix);
  r.set_range_end(PrefixEnd(prefix));
}

Compare* AddCompare(TxnRequest& txn, const std::string& key, Compare::CompareTarget target,
                    Compare::CompareResult result) {
  Compare* c = txn.add_compare();
  c->set_key(key);
  c->set_target(target);
  c->set_result(result);
  return c;
}
}  // namespace etcd_internal

EtcdStore::EtcdStore(EtcdOptions options)
    : options_(std::move(options)),
      name_(absl::StrCat("etcd ", absl::StrJoin(options_.endpoints, ","))),
      member_id_(RandomId()) {
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  if (!options_.ca_pem.empty() || !options_.cert_pem.empty()) {
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = options_.ca_pem;
    ssl.pem_private_key = options_.key_pem;
    ssl.pem_cert_chain = options_.cert_pem;
    credentials = grpc::SslCredentials(ssl);
  } else {
    credentials = grpc::InsecureChannelCredentials();
  }
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(std::numeric_limits<int>::max());
  args.SetMaxSendMessageSize(std::numeric_limits<int>::max());
  // Connections of their own (a test holds several stores in one process, as several daemons).
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  // A member that stops answering on an open connection is found by pings (etcd permits one
  // every 5 s); a member back up is reconnected within a second.
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  for (const std::string& configured : options_.endpoints) {
    auto m = std::make_unique<Member>();
    m->endpoint = Endpoint(configured);
    m->channel = grpc::CreateCustomChannel(m->endpoint, credentials, args);
    m->kv = etcdserverpb::KV::NewStub(m->channel);
    m->watch = etcdserverpb::Watch::NewStub(m->channel);
    m->lease = etcdserverpb::Lease::NewStub(m->channel);
    m->auth = etcdserverpb::Auth::NewStub(m->channel);
    members_.push_back(std::move(m));
  }
  control_ = std::thread([this] { ControlLoop(); });
  keepalive_ = std::thread([this] { KeepAliveLoop(); });
}

EtcdStore::~EtcdStore() {
  Shutdown();
  control_.join();
  keepalive_.join();
  std::unique_ptr<WatchStream> stream;
  {
    absl::MutexLock lock(&write_mu_);
    stream = std::move(watch_);
  }
  if (stream) {
    stream->ctx.TryCancel();
    stream->reader.join();
  }
}

// ---- Calls ----------------------------------------------------------------------------------

void EtcdStore::Authorize(grpc::ClientContext& ctx) {
  if (options_.user.empty()) return;
  absl::MutexLock lock(&token_mu_);
  if (!token_.empty()) ctx.AddMetadata("token", token_);
}

grpc::Status EtcdStore::Authenticate(Member& member, absl::Time deadline) {
  if (options_.user.empty()) return grpc::Status::OK;
  {
    absl::MutexLock lock(&token_mu_);
    if (!token_.empty()) return grpc::Status::OK;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  etcdserverpb::AuthenticateRequest request;
  request.set_name(options_.user);
  request.set_password(options_.password);
  etcdserverpb::AuthenticateResponse response;
  grpc::Status s = member.auth->Authenticate(&ctx, request, &response);
  if (!s.ok()) {
    return grpc::Status(s.error_code(), absl::StrCat("authenticating as user '", options_.user,
                                                     "': ", s.error_message()));
  }
  absl::MutexLock lock(&token_mu_);
  token_ = response.token();
  return grpc::Status::OK;
}

absl::Status EtcdStore::Call(absl::string_view what, Retry retry, const Rpc& rpc,
                             std::optional<absl::Time> deadline_or) {
  if (members_.empty()) {
    return absl::FailedPreconditionError(absl::StrCat("etcd store has no endpoints: ", what));
  }
  const absl::Time deadline = deadline_or.value_or(absl::Now() + options_.rpc_timeout);
  const size_t n = members_.size();
  // A member that accepts connections but never answers holds one attempt this long at most.
  const absl::Duration attempt_limit =
      n > 1 ? std::max(options_.rpc_timeout / static_cast<int64_t>(n), absl::Milliseconds(500))
            : options_.rpc_timeout;
  absl::Duration backoff = absl::Milliseconds(10);
  bool reauthenticated = false;
  std::string last = "no attempt before the deadline";
  for (;;) {
    const size_t index = current_.load();
    Member& m = *members_[index % n];
    const absl::Time attempt_deadline = std::min(deadline, absl::Now() + attempt_limit);
    const bool was_ready = m.channel->GetState(false) == GRPC_CHANNEL_READY;
    grpc::Status s = Authenticate(m, attempt_deadline);
    if (s.ok()) {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(attempt_deadline));
      Authorize(ctx);
      s = rpc(m, ctx);
    }
    if (s.ok()) return absl::OkStatus();
    const grpc::StatusCode code = s.error_code();
    if (code == grpc::StatusCode::UNAUTHENTICATED && !options_.user.empty() && !reauthenticated &&
        absl::StrContains(s.error_message(), "auth token")) {
      absl::MutexLock lock(&token_mu_);
      token_.clear();  // expired: fetch a new one and try again
      reauthenticated = true;
      continue;
    }
    const bool unreachable =
        code == grpc::StatusCode::UNAVAILABLE ||
        (code == grpc::StatusCode::DEADLINE_EXCEEDED && absl::Now() < deadline);
    if (!unreachable) {
      return absl::Status(
          static_cast<absl::StatusCode>(code),
          absl::StrCat(name_, " (", m.endpoint, "): ", what, ": ", s.error_message()));
    }
    last = absl::StrCat(m.endpoint, ": ", s.error_message());
    if (retry == Retry::kOnlyUnsent && was_ready) {
      return absl::UnavailableError(absl::StrCat(
          name_, ": ", what, ": the call to ", m.endpoint,
          " failed after it was sent, so whether it took effect is unknown: ", s.error_message()));
    }
    size_t expected = index;
    current_.compare_exchange_strong(expected, index + 1);
    if (absl::Now() + backoff >= deadline) break;
    absl::SleepFor(backoff);
    backoff = std::min(backoff * 2, absl::Milliseconds(250));
  }
  return absl::UnavailableError(absl::StrCat(name_, " unreachable: ", what,
                                             ": no member answered in time; last error: ", last));
}

absl::StatusOr<TxnResponse> EtcdStore::Txn(absl::string_view what, Retry retry,
                                           const TxnRequest& request) {
  TxnResponse response;
  GRADSYNC_RETURN_IF_ERROR(Call(what, retry, [&](Member& m, grpc::ClientContext& ctx) {
    response.Clear();
    return m.kv->Txn(&ctx, request, &response);
  }));
  return response;
}

absl::StatusOr<RangeResponse> EtcdStore::Range(absl::string_view what, std::string key,
                                               std::string range_end, bool count_only,
                                               bool keys_only) {
  RangeRequest request;
  request.set_key(std::move(key));
  request.set_range_end(std::move(range_end));
  request.set_count_only(count_only);
  request.set_keys_only(keys_only);
  RangeResponse response;
  GRADSYNC_RETURN_IF_ERROR(Call(what, Retry::kIdempotent, [&](Member& m, grpc::ClientContext& ctx) {
    response.Clear();
    return m.kv->Range(&ctx, request, &response);
  }));
  return response;
}

absl::Status EtcdStore::Probe(absl::Duration timeout) {
  RangeRequest request;
  SetPrefixRange(request, options_.prefix);
  request.set_count_only(true);
  RangeResponse response;
  return Call(
      "reading the store's prefix", Retry::kIdempotent,
      [&](Member& m, grpc::ClientContext& ctx) { return m.kv->Range(&ctx, request, &response); },
      absl::Now() + timeout);
}

// ---- Keys and limits ------------------------------------------------------------------------

absl::Status EtcdStore::CheckKey(absl::string_view job, absl::string_view key) const {
  return CheckJobKey(job, key, options_.limits.max_key_bytes);
}

std::string EtcdStore::JobPrefix(absl::string_view job) const {
  return absl::StrCat(options_.prefix, "jobs/", job, "/");
}

std::string EtcdStore::KeyOf(absl::string_view job, absl::string_view key) const {
  return absl::StrCat(options_.prefix, "jobs/", job, "/", key);
}

absl::Status EtcdStore::CheckRoom(absl::string_view job) {
  RangeRequest request;
  SetPrefixRange(request, JobPrefix(job));
  request.set_count_only(true);
  // The member's own view: a limit needs no consensus round, and reads cost no disk write.
  request.set_serializable(true);
  RangeResponse r;
  GRADSYNC_RETURN_IF_ERROR(Call(absl::StrCat("counting the keys of job ", job), Retry::kIdempotent,
                                [&](Member& m, grpc::ClientContext& ctx) {
                                  r.Clear();
                                  return m.kv->Range(&ctx, request, &r);
                                }));
  if (r.count() >= options_.limits.max_keys_per_job) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "job '", job, "' holds ", r.count(), " keys, the limit (--store_max_keys_per_job)"));
  }
  return absl::OkStatus();
}

// ---- Store calls ----------------------------------------------------------------------------

absl::Status EtcdStore::Set(absl::string_view job, absl::string_view key, std::string value) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  GRADSYNC_RETURN_IF_ERROR(CheckKey(job, key));
  if (static_cast<int64_t>(value.size()) > options_.limits.max_value_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("value for key '", key, "' is ", value.size(), " bytes; the limit is ",
                     options_.limits.max_value_bytes, " (--store_max_value_bytes)"));
  }
  const std::string full = KeyOf(job, key);
  const std::string what = absl::StrCat("Set job=", job, " key=", key);
  return WithLease(job, [&](int64_t lease, const std::string& join) -> absl::StatusOr<bool> {
    // Replacing a key needs no room; a new one is counted against the job's limit first, by a
    // read of the member's own view (no consensus round, no disk write: a transaction with a
    // put in it would be one even when its compare fails). Writers racing for the last room
    // may pass the limit by one key each.
    TxnRequest room;
    auto* exists = room.add_success()->mutable_request_range();
    exists->set_key(full);
    exists->set_count_only(true);
    exists->set_serializable(true);
    auto* count = room.add_success()->mutable_request_range();
    SetPrefixRange(*count, JobPrefix(job));
    count->set_count_only(true);
    count->set_serializable(true);
    GRADSYNC_ASSIGN_OR_RETURN(TxnResponse counted, Txn(what, Retry::kIdempotent, room));
    const int64_t keys = counted.responses(1).response_range().count();
    if (counted.responses(0).response_range().count() == 0 &&
        keys >= options_.limits.max_keys_per_job) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "job '", job, "' holds ", keys, " keys, the limit (--store_max_keys_per_job)"));
    }
    TxnRequest txn;  // no compare: the put (and the job's join) always happen
    auto* put = txn.add_success()->mutable_request_put();
    put->set_key(full);
    put->set_value(value);
    put->set_lease(lease);
    AddJoin(txn, join, lease);
    GRADSYNC_RETURN_IF_ERROR(Txn(what, Retry::kIdempotent, txn).status());
    return true;
  });
}

absl::StatusOr<int64_t> EtcdStore::Add(absl::string_view job, absl::string_view key,
                                       int64_t delta) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  GRADSYNC_RETURN_IF_ERROR(CheckKey(job, key));
  const std::string full = KeyOf(job, key);
  const std::string what = absl::StrCat("Add job=", job, " key=", key);
  int64_t result = 0;
  GRADSYNC_RETURN_IF_ERROR(
      WithLease(job, [&](int64_t lease, const std::string& join) -> absl::StatusOr<bool> {
        GRADSYNC_ASSIGN_OR_RETURN(RangeResponse current, Range(what, full, "", false, false));
        for (int attempt = 0; attempt < kMaxAddAttempts; ++attempt) {
          const bool exists = current.kvs_size() > 0;
          int64_t value = 0;
          if (exists && !absl::SimpleAtoi(current.kvs(0).value(), &value)) {
            return absl::FailedPreconditionError(
                absl::StrCat("Add on key '", key, "': its value is not a decimal int64 counter"));
          }
          if ((delta > 0 && value > std::numeric_limits<int64_t>::max() - delta) ||
              (delta < 0 && value < std::numeric_limits<int64_t>::min() - delta)) {
            return absl::OutOfRangeError(absl::StrCat("Add on key '", key, "' overflows int64"));
          }
          if (!exists) GRADSYNC_RETURN_IF_ERROR(CheckRoom(job));
          const int64_t next = value + delta;
          // Put the sum only if nobody wrote the key since it was read; else read it again.
          TxnRequest txn;
          if (exists) {
            AddCompare(txn, full, Compare::MOD, Compare::EQUAL)
                ->set_mod_revision(current.kvs(0).mod_revision());
          } else {
            AddCompare(txn, full, Compare::CREATE, Compare::EQUAL)->set_create_revision(0);
          }
          auto* put = txn.add_success()->mutable_request_put();
          put->set_key(full);
          put->set_value(absl::StrCat(next));
          put->set_lease(lease);
          AddJoin(txn, join, lease);
          txn.add_failure()->mutable_request_range()->set_key(full);
          GRADSYNC_ASSIGN_OR_RETURN(TxnResponse r, Txn(what, Retry::kOnlyUnsent, txn));
          if (r.succeeded()) {
            result = next;
            return true;
          }
          current = std::move(*r.mutable_responses(0)->mutable_response_range());
        }
        return absl::AbortedError(absl::StrCat(what, ": other writers changed the key ",
                                               kMaxAddAttempts, " times in a row"));
      }));
  return result;
}

absl::StatusOr<CompareSetResult> EtcdStore::CompareSet(absl::string_view job, absl::string_view key,
                                                       std::optional<std::string> expected,
                                                       std::string desired) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  GRADSYNC_RETURN_IF_ERROR(CheckKey(job, key));
  if (static_cast<int64_t>(desired.size()) > options_.limits.max_value_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("value for key '", key, "' is ", desired.size(), " bytes; the limit is ",
                     options_.limits.max_value_bytes, " (--store_max_value_bytes)"));
  }
  const std::string full = KeyOf(job, key);
  const std::string what = absl::StrCat("CompareSet job=", job, " key=", key);
  CompareSetResult result;
  auto current_of = [](const TxnResponse& r) {
    const RangeResponse& range = r.responses(0).response_range();
    return range.kvs_size() > 0 ? range.kvs(0).value() : std::string();
  };
  GRADSYNC_RETURN_IF_ERROR(
      WithLease(job, [&](int64_t lease, const std::string& join) -> absl::StatusOr<bool> {
        if (!expected.has_value()) {
          // Creating a key: it must be absent, and the job must have room for it.
          TxnRequest probe;
          AddCompare(probe, full, Compare::CREATE, Compare::EQUAL)->set_create_revision(0);
          SetPrefixRange(*probe.add_success()->mutable_request_range(), JobPrefix(job));
          probe.mutable_success(0)->mutable_request_range()->set_count_only(true);
          probe.add_failure()->mutable_request_range()->set_key(full);
          GRADSYNC_ASSIGN_OR_RETURN(TxnResponse probed, Txn(what, Retry::kIdempotent, probe));
          if (!probed.succeeded()) {
            result = CompareSetResult{false, current_of(probed)};
            return false;
          }
          if (probed.responses(0).response_range().count() >= options_.limits.max_keys_per_job) {
            return absl::ResourceExhaustedError(
                absl::StrCat("job '", job, "' holds ", probed.responses(0).response_range().count(),
                             " keys, the limit (--store_max_keys_per_job)"));
          }
        }
        TxnRequest txn;
        if (expected.has_value()) {
          // A value compare fails on an absent key, as CompareSet must.
          AddCompare(txn, full, Compare::VALUE, Compare::EQUAL)->set_value(*expected);
        } else {
          AddCompare(txn, full, Compare::CREATE, Compare::EQUAL)->set_create_revision(0);
        }
        auto* put = txn.add_success()->mutable_request_put();
        put->set_key(full);
        put->set_value(desired);
        put->set_lease(lease);
        AddJoin(txn, join, lease);
        txn.add_failure()->mutable_request_range()->set_key(full);
        GRADSYNC_ASSIGN_OR_RETURN(TxnResponse r, Txn(what, Retry::kOnlyUnsent, txn));
        result = r.succeeded() ? CompareSetResult{true, desired}
                               : CompareSetResult{false, current_of(r)};
        return r.succeeded();
      }));
  return result;
}

absl::StatusOr<bool> EtcdStore::Delete(absl::string_view job, absl::string_view key) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  GRADSYNC_RETURN_IF_ERROR(CheckKey(job, key));
  TxnRequest txn;  // no compare: the success branch always runs
  txn.add_success()->mutable_request_delete_range()->set_key(KeyOf(job, key));
  SetPrefixRange(*txn.add_success()->mutable_request_range(), JobPrefix(job));
  txn.mutable_success(1)->mutable_request_range()->set_count_only(true);
  GRADSYNC_ASSIGN_OR_RETURN(
      TxnResponse r, Txn(absl::StrCat("Delete job=", job, " key=", key), Retry::kIdempotent, txn));
  const int64_t deleted = r.responses(0).response_delete_range().deleted();
  if (deleted == 0 && r.responses(1).response_range().count() == 0) {
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no keys"));
  }
  return deleted > 0;
}

absl::StatusOr<std::vector<std::pair<std::string, int64_t>>> EtcdStore::ListSizes(
    absl::string_view job, absl::string_view prefix) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(job));
  const std::string job_prefix = JobPrefix(job);
  TxnRequest txn;
  SetPrefixRange(*txn.add_success()->mutable_request_range(), absl::StrCat(job_prefix, prefix));
  SetPrefixRange(*txn.add_success()->mutable_request_range(), job_prefix);
  txn.mutable_success(1)->mutable_request_range()->set_count_only(true);
  GRADSYNC_ASSIGN_OR_RETURN(TxnResponse r, Txn(absl::StrCat("List job=", job, " prefix=", prefix),
                                               Retry::kIdempotent, txn));
  if (r.responses(1).response_range().count() == 0) {
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no keys"));
  }
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& kv : r.responses(0).response_range().kvs()) {
    out.emplace_back(kv.key().substr(job_prefix.size()), static_cast<int64_t>(kv.value().size()));
  }
  return out;  // etcd answers sorted by key
}

absl::StatusOr<std::vector<std::string>> EtcdStore::List(absl::string_view job,
                                                         absl::string_view prefix) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(job));
  const std::string job_prefix = JobPrefix(job);
  TxnRequest txn;
  SetPrefixRange(*txn.add_success()->mutable_request_range(), absl::StrCat(job_prefix, prefix));
  txn.mutable_success(0)->mutable_request_range()->set_keys_only(true);
  SetPrefixRange(*txn.add_success()->mutable_request_range(), job_prefix);
  txn.mutable_success(1)->mutable_request_range()->set_count_only(true);
  GRADSYNC_ASSIGN_OR_RETURN(TxnResponse r, Txn(absl::StrCat("List job=", job, " prefix=", prefix),
                                               Retry::kIdempotent, txn));
  if (r.responses(1).response_range().count() == 0) {
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no keys"));
  }
  std::vector<std::string> keys;
  for (const auto& kv : r.responses(0).response_range().kvs()) {
    keys.push_back(kv.key().substr(job_prefix.size()));
  }
  return keys;
}

absl::StatusOr<std::string> EtcdStore::Peek(absl::string_view job, absl::string_view key) {
  GRADSYNC_RETURN_IF_ERROR(CheckJobId(job));
  GRADSYNC_ASSIGN_OR_RETURN(RangeResponse r, Range(absl::StrCat("reading job=", job, " key=", key),
                                                   KeyOf(job, key), "", false, false));
  if (r.kvs_size() == 0) {
    return absl::NotFoundError(absl::StrCat("job '", job, "' has no key '", key, "'"));
  }
  return std::move(*r.mutable_kvs(0)->mutable_value());
}

absl::StatusOr<std::vector<JobStats>> EtcdStore::ListJobs() {
  const std::string jobs_prefix = absl::StrCat(options_.prefix, "jobs/");
  GRADSYNC_ASSIGN_OR_RETURN(RangeResponse r, Range("listing the jobs", jobs_prefix,
                                                   PrefixEnd(jobs_prefix), false, false));
  std::map<std::string, JobStats> jobs;
  for (const auto& kv : r.kvs()) {
    const absl::string_view rest = absl::string_view(kv.key()).substr(jobs_prefix.size());
    const size_t slash = rest.find('/');
    if (slash == rest.npos) continue;
    JobStats& stats = jobs[std::string(rest.substr(0, slash))];
    ++stats.keys;
    stats.value_bytes += static_cast<int64_t>(kv.value().size());
  }
  std::vector<JobStats> out;
  for (auto& [name, stats] : jobs) {
    stats.job = name;
    out.push_back(std::move(stats));
  }
  return out;
}

void EtcdStore::DeleteJob(absl::string_view job) {
  Held held;
  {
    absl::MutexLock lock(&mu_);
    auto it = held_.find(job);
    if (it == held_.end()) return;
    held = it->second;
    held_.erase(it);
  }
  Release(std::string(job), held, absl::Now() + options_.rpc_timeout);
}

void EtcdStore::Shutdown() {
  std::vector<Fired> fired;
  std::vector<std::pair<std::string, Held>> held;
  {
    absl::MutexLock lock(&mu_);
    if (shutdown_) return;
    shutdown_ = true;
    for (auto& [id, w] : waiters_) {
      fired.push_back({std::move(w.done), absl::UnavailableError("store is shutting down")});
    }
    waiters_.clear();
    deadlines_.clear();
    recreate_.clear();
    for (auto& [job, h] : held_) held.emplace_back(job, h);
    held_.clear();
  }
  RunCallbacks(fired);
  const absl::Time deadline = absl::Now() + options_.rpc_timeout;
  for (const auto& [job, h] : held) Release(job, h, deadline);
}

}  // namespace gradsync::store
