// Implementation of etcd_store.h: the job leases, with their keep-alive.

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

using etcd_internal::LeaseGone;
using etcd_internal::Log;
using etcd_internal::RangeRequest;
using etcd_internal::RangeResponse;
using etcd_internal::SetPrefixRange;
using etcd_internal::TxnRequest;

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
