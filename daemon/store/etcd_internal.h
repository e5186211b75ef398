#pragma once

// What the files of EtcdStore share (etcd_store.cc: calls, keys and the Store calls;
// etcd_leases.cc: the job leases and their keep-alive; etcd_watch.cc: waits as watches and
// the watch stream's threads). Not for other users.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "common/logging.h"
#include "daemon/store/etcd_store.h"
#include "etcd/etcdserverpb/rpc.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace gradsync::store {
namespace etcd_internal {

using etcdserverpb::Compare;
using etcdserverpb::RangeRequest;
using etcdserverpb::RangeResponse;
using etcdserverpb::TxnRequest;
using etcdserverpb::TxnResponse;

inline auto Log() { return logging::Logger("store"); }

// Bytes a value adds to a reply beyond its own (as MemoryStore counts them).
inline constexpr int64_t kValueOverheadBytes = 6;
// A wait reads its keys one by one in a transaction up to this many; past it, the range
// covering them (etcd refuses transactions of more than 128 operations by default).
inline constexpr size_t kMaxKeysReadOneByOne = 64;
// How often a daemon retries its compare-and-put of Add when other writers got there first.
inline constexpr int kMaxAddAttempts = 1000;

// etcd's end of the range of every key starting with `prefix`.
std::string PrefixEnd(std::string prefix);
// An endpoint without its scheme and trailing slashes.
std::string Endpoint(absl::string_view endpoint);
// 16 random hex digits.
std::string RandomId();
// The status of a call on a lease etcd no longer has.
bool LeaseGone(const absl::Status& s);
void SetPrefixRange(RangeRequest& r, const std::string& prefix);
Compare* AddCompare(TxnRequest& txn, const std::string& key, Compare::CompareTarget target,
                    Compare::CompareResult result);

}  // namespace etcd_internal

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

}  // namespace gradsync::store
