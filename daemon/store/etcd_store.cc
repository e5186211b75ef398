// Implementation of etcd_store.h: the Store calls as etcd reads, puts and transactions with
// failover between members, waits as watches on one stream, and the job leases with their
// keep-alive.

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
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::store {
namespace {

using etcdserverpb::Compare;
using etcdserverpb::RangeRequest;
using etcdserverpb::RangeResponse;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;

auto Log() { return logging::Logger("store"); }

// Bytes a value adds to a reply beyond its own (as MemoryStore counts them).
constexpr int64_t kValueOverheadBytes = 6;
// A wait reads its keys one by one in a transaction up to this many; past it, the range
// covering them (etcd refuses transactions of more than 128 operations by default).
constexpr size_t kMaxKeysReadOneByOne = 64;
// How often a daemon retries its compare-and-put of Add when other writers got there first.
constexpr int kMaxAddAttempts = 1000;

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

}  // namespace

struct EtcdStore::Member {
  std::string endpoint;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<etcdserverpb::KV::Stub> kv;
  std::unique_ptr<etcdserverpb::Watch::Stub> watch;
  std::unique_ptr<etcdserverpb::Lease::Stub> lease;
  std::unique_ptr<etcdserverpb::Auth::Stub> auth;
};

struct EtcdStore::WatchStream {
  grpc::ClientContext ctx;
  std::unique_ptr<grpc::ClientReaderWriter<etcdserverpb::WatchRequest, etcdserverpb::WatchResponse>>
      rw;
  std::thread reader;
  size_t member = 0;
  uint64_t generation = 0;
};

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
  if (absl::Status s = CheckJobId(job); !s.ok()) return s;
  if (key.empty()) return absl::InvalidArgumentError("key is empty");
  if (static_cast<int64_t>(key.size()) > options_.limits.max_key_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("key is ", key.size(), " bytes; the limit is ",
                                                   options_.limits.max_key_bytes,
                                                   " (--store_max_key_bytes)"));
  }
  return absl::OkStatus();
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

// ---- Job leases -----------------------------------------------------------------------------

int64_t EtcdStore::LeaseOf(absl::string_view job) const {
  // FNV-1a over the prefix and the job: every daemon of the job names the same lease, so none
  // has to publish it, and the first write of each joins it in the same transaction.
  uint64_t h = 14695981039346656037ull;
  for (absl::string_view part : {absl::string_view(options_.prefix), job}) {
    for (unsigned char c : part) h = (h ^ c) * 1099511628211ull;
  }
  const int64_t id = static_cast<int64_t>(h & 0x7fffffffffffffffull);
  return id == 0 ? 1 : id;
}

absl::Status EtcdStore::Grant(absl::string_view job, int64_t lease) {
  etcdserverpb::LeaseGrantRequest grant;
  grant.set_id(lease);
  grant.set_ttl(std::max<int64_t>(1, absl::ToInt64Seconds(options_.lease_ttl)));
  etcdserverpb::LeaseGrantResponse granted;
  absl::Status s = Call(absl::StrCat("granting the lease of job ", job), Retry::kIdempotent,
                        [&](Member& m, grpc::ClientContext& ctx) {
                          return m.lease->LeaseGrant(&ctx, grant, &granted);
                        });
  if (absl::StrContains(s.message(), "lease already exists")) return absl::OkStatus();
  if (s.ok() && !granted.error().empty()) {
    return absl::UnavailableError(
        absl::StrCat(name_, ": granting the lease of job ", job, ": ", granted.error()));
  }
  return s;
}

void EtcdStore::ForgetLease(absl::string_view job, int64_t lease) {
  absl::MutexLock lock(&mu_);
  auto it = held_.find(job);
  if (it != held_.end() && it->second.lease == lease) held_.erase(it);
}

absl::Status EtcdStore::WithLease(absl::string_view job, const LeaseWrite& write) {
  const int64_t lease = LeaseOf(job);
  absl::Status s;
  for (int attempt = 0; attempt < 3; ++attempt) {
    bool held = false;
    {
      absl::MutexLock lock(&mu_);
      if (shutdown_) return absl::UnavailableError("store is shutting down");
      held = held_.contains(job);
    }
    if (held) {
      s = write(lease, "").status();
      if (!LeaseGone(s)) return s;
      Log()->warn(
          "the etcd lease of job={} expired (etcd unreachable for longer than its TTL?): its keys "
          "are gone; joining it anew",
          std::string(job));
      ForgetLease(job, lease);
      continue;
    }
    // Joining: one first write at a time, so that this daemon holds one member key per job.
    absl::MutexLock joining(&acquire_mu_);
    std::string member_key;
    {
      absl::MutexLock lock(&mu_);
      if (held_.contains(job)) continue;
      if (static_cast<int64_t>(held_.size()) >= options_.limits.max_jobs) {
        return absl::ResourceExhaustedError(absl::StrCat("this daemon holds ", held_.size(),
                                                         " jobs in etcd, the limit "
                                                         "(--store_max_jobs); job '",
                                                         job, "' refused"));
      }
      member_key = absl::StrCat(options_.prefix, "members/", job, "/", member_id_, ".",
                                ++member_generation_);
    }
    absl::StatusOr<bool> joined = write(lease, member_key);
    if (joined.ok()) {
      if (*joined) {
        absl::MutexLock lock(&mu_);
        held_[std::string(job)] = Held{lease, member_key};
      }
      return absl::OkStatus();
    }
    s = joined.status();
    if (!LeaseGone(s)) return s;
    GRADSYNC_RETURN_IF_ERROR(Grant(job, lease));  // the job's first daemon, or it expired
  }
  return s;
}

void EtcdStore::AddJoin(TxnRequest& txn, const std::string& member_key, int64_t lease) const {
  if (member_key.empty()) return;
  auto* join = txn.add_success()->mutable_request_put();
  join->set_key(member_key);
  join->set_value(name_);
  join->set_lease(lease);
}

void EtcdStore::Release(const std::string& job, const Held& held, absl::Time deadline) {
  etcdserverpb::DeleteRangeRequest leave;
  leave.set_key(held.member_key);
  etcdserverpb::DeleteRangeResponse left;
  absl::Status s = Call(
      absl::StrCat("leaving job ", job), Retry::kIdempotent,
      [&](Member& m, grpc::ClientContext& ctx) { return m.kv->DeleteRange(&ctx, leave, &left); },
      deadline);
  const std::string members = absl::StrCat(options_.prefix, "members/", job, "/");
  RangeRequest count;
  SetPrefixRange(count, members);
  count.set_count_only(true);
  RangeResponse counted;
  if (s.ok()) {
    s = Call(
        absl::StrCat("counting the daemons of job ", job), Retry::kIdempotent,
        [&](Member& m, grpc::ClientContext& ctx) { return m.kv->Range(&ctx, count, &counted); },
        deadline);
  }
  if (s.ok() && counted.count() == 0) {
    etcdserverpb::LeaseRevokeRequest revoke;
    revoke.set_id(held.lease);
    etcdserverpb::LeaseRevokeResponse revoked;
    s = Call(
        absl::StrCat("revoking the lease of job ", job), Retry::kIdempotent,
        [&](Member& m, grpc::ClientContext& ctx) {
          return m.lease->LeaseRevoke(&ctx, revoke, &revoked);
        },
        deadline);
    if (LeaseGone(s)) s = absl::OkStatus();
    if (s.ok()) Log()->debug("job's keys removed from etcd job={}", job);
  }
  if (!s.ok()) {
    Log()->warn("leaving job={} in etcd failed (its keys go when its lease expires): {}", job,
                s.ToString());
  }
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
  values.assign(w.keys.size(), std::nullopt);
  if (w.index.size() == 1) {
    RangeRequest request;
    request.set_key(w.index.begin()->first);
    request.set_revision(at);
    RangeResponse r;
    GRADSYNC_RETURN_IF_ERROR(
        Call(what, Retry::kIdempotent, [&](Member& m, grpc::ClientContext& ctx) {
          r.Clear();
          return m.kv->Range(&ctx, request, &r);
        }));
    take(r);
    revision = r.header().revision();
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
    RangeRequest request;
    request.set_key(w.lo);
    request.set_range_end(w.hi);
    request.set_revision(at);
    RangeResponse r;
    GRADSYNC_RETURN_IF_ERROR(
        Call(what, Retry::kIdempotent, [&](Member& m, grpc::ClientContext& ctx) {
          r.Clear();
          return m.kv->Range(&ctx, request, &r);
        }));
    take(r);
    revision = r.header().revision();
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
  absl::Status invalid;
  if (keys.empty()) invalid = absl::InvalidArgumentError("wait needs at least one key");
  for (const std::string& key : keys) {
    if (!invalid.ok()) break;
    invalid = CheckKey(job, key);
  }
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

void EtcdStore::KeepAliveLoop() {
  const absl::Duration every = std::max(options_.lease_ttl / 3, absl::Milliseconds(100));
  absl::MutexLock lock(&mu_);
  while (!shutdown_) {
    mu_.AwaitWithTimeout(absl::Condition(&shutdown_), every);
    if (shutdown_) break;
    absl::flat_hash_set<int64_t> leases;
    for (const auto& [job, held] : held_) leases.insert(held.lease);
    if (leases.empty() || members_.empty()) continue;
    mu_.Unlock();
    absl::flat_hash_set<int64_t> gone;
    const size_t index = current_.load();
    Member& m = *members_[index % members_.size()];
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + std::min(options_.rpc_timeout, every)));
    Authorize(ctx);
    auto stream = m.lease->LeaseKeepAlive(&ctx);
    for (int64_t lease : leases) {
      etcdserverpb::LeaseKeepAliveRequest request;
      request.set_id(lease);
      if (!stream->Write(request)) break;
    }
    stream->WritesDone();
    etcdserverpb::LeaseKeepAliveResponse response;
    size_t answered = 0;
    while (stream->Read(&response)) {
      ++answered;
      if (response.ttl() <= 0) gone.insert(response.id());
    }
    const grpc::Status s = stream->Finish();
    if (!s.ok() || answered < leases.size()) {
      size_t expected = index;
      current_.compare_exchange_strong(expected, index + 1);
      Log()->warn("{}: renewing {} job lease(s) on {} failed: {}", name_, leases.size(), m.endpoint,
                  s.ok() ? "not every lease was answered" : s.error_message());
    }
    mu_.Lock();
    for (auto it = held_.begin(); it != held_.end();) {
      if (gone.contains(it->second.lease)) {
        Log()->error("the etcd lease of job={} expired: its keys are gone from etcd", it->first);
        held_.erase(it++);
      } else {
        ++it;
      }
    }
  }
}

}  // namespace gradsync::store
