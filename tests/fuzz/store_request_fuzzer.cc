// Store request handling: a script of store calls with arbitrary jobs, keys, values and counters
// goes through the Store service's handlers (StoreService, called directly with gRPC's test
// reactor) and the waits through the MemoryStore they sit on, all with small limits. Nothing may
// crash, every limit must hold after every call, what a call reports must be what the store
// then holds, and every wait must be answered exactly once (by a write, its deadline or a
// cancel).
//
// Input: calls, each [kind][payload length][payload], the payload a request message of the
// kind's type (binary protobuf). tests/fuzz/make_corpus.sh writes the seeds.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "common/grpc_status.h"
#include "common/pack_list.h"
#include "daemon/rpc/peer_auth.h"
#include "daemon/rpc/store_service.h"
#include "daemon/store/memory_store.h"
#include "fuzz_check.h"
#include "grpc/grpc.h"
#include "grpcpp/test/default_reactor_test_peer.h"

namespace gradsync::store {
namespace {

enum Kind : uint8_t {
  kSet,          // SetRequest, through StoreService::Set
  kAdd,          // AddRequest
  kCompareSet,   // CompareSetRequest
  kDelete,       // DeleteRequest
  kList,         // ListRequest
  kSetPackList,  // SetPackListRequest
  kPeek,         // GetRequest: what a store session's get does (a wait with a past deadline)
  kWaitNow,      // WaitRequest with a past deadline: answered before WaitAsync returns
  kWaitLater,    // WaitRequest with an hour's deadline: answered by a write or a cancel
  kCancelWait,   // payload byte 0 picks one of the waits so far
  kDeleteJob,    // GetRequest's job: what the engine does when a job ends
  kKinds
};

constexpr size_t kMaxCalls = 64;

MemoryStoreOptions SmallLimits() {
  MemoryStoreOptions o;
  o.max_key_bytes = 40;  // room for a pack list's key ("_gradsync/packlist/" + group)
  o.max_value_bytes = 256;
  o.max_keys_per_job = 8;
  o.max_jobs = 4;
  o.max_waiters = 8;
  o.max_reply_bytes = 300;
  return o;
}
constexpr int64_t kMaxListReplyBytes = 100;

// Codes a call that never waits may answer with; anything else is a bug in the handler.
bool RequestError(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      return true;
    default:
      return false;
  }
}

struct WaitRecord {
  std::string job;
  std::vector<std::string> keys;
  int answers = 0;
  absl::StatusOr<std::vector<std::string>> result;
};

class Script {
 public:
  Script()
      : store_(SmallLimits()),
        auth_(""),
        service_(&store_, absl::Seconds(1), kMaxListReplyBytes, &auth_) {}

  void Run(const uint8_t* data, size_t size) {
    for (size_t calls = 0; calls < kMaxCalls && size >= 2; ++calls) {
      const uint8_t kind = data[0] % kKinds;
      const size_t len = std::min<size_t>(data[1], size - 2);
      const std::string payload(reinterpret_cast<const char*>(data + 2), len);
      data += 2 + len;
      size -= 2 + len;
      Call(static_cast<Kind>(kind), payload);
      CheckLimits();
    }
    // Back to an empty store for the next input: every wait still open is cancelled, every job
    // deleted.
    for (Store::WaitId id : ids_) store_.CancelWait(id);
    for (const auto& w : waits_) {
      GRADSYNC_FUZZ_CHECK(w->answers == 1);
      if (w->result.ok()) CheckWaitReply(*w);
    }
    const std::vector<JobStats> jobs = *store_.ListJobs();  // a copy: the StatusOr is a temporary
    for (const JobStats& job : jobs) store_.DeleteJob(job.job);
    GRADSYNC_FUZZ_CHECK(store_.ListJobs()->empty());
    waits_.clear();
    ids_.clear();
  }

 private:
  // A unary handler called as gRPC would, its status read from the test reactor.
  template <typename Req, typename Resp>
  grpc::Status Unary(grpc::ServerUnaryReactor* (rpc::StoreService::*method)(
                         grpc::CallbackServerContext*, const Req*, Resp*),
                     const Req& req, Resp* resp) {
    grpc::CallbackServerContext ctx;
    grpc::testing::DefaultReactorTestPeer peer(&ctx);
    grpc::ServerUnaryReactor* reactor = (service_.*method)(&ctx, &req, resp);
    GRADSYNC_FUZZ_CHECK(reactor == peer.reactor() && peer.test_status_set());
    const grpc::Status status = peer.test_status();
    static const bool verbose = std::getenv("GRADSYNC_FUZZ_VERBOSE") != nullptr;  // for triage
    if (verbose)
      std::fprintf(stderr, "%d %s\n", status.error_code(), status.error_message().c_str());
    GRADSYNC_FUZZ_CHECK(RequestError(static_cast<absl::StatusCode>(status.error_code())));
    return status;
  }

  absl::StatusOr<std::string> Peek(const std::string& job, const std::string& key) {
    return store_.Peek(job, key);
  }

  void Call(Kind kind, const std::string& payload) {
    switch (kind) {
      case kSet: {
        v1::SetRequest req;
        v1::SetResponse resp;
        if (!req.ParseFromString(payload)) return;
        if (Unary(&rpc::StoreService::Set, req, &resp).ok()) {
          GRADSYNC_FUZZ_CHECK(!absl::StartsWith(req.key(), kReservedKeyPrefix));
          GRADSYNC_FUZZ_CHECK(Peek(req.job(), req.key()).value_or("<none>") == req.value());
        }
        return;
      }
      case kAdd: {
        v1::AddRequest req;
        v1::AddResponse resp;
        if (!req.ParseFromString(payload)) return;
        if (Unary(&rpc::StoreService::Add, req, &resp).ok()) {
          int64_t stored = 0;
          GRADSYNC_FUZZ_CHECK(absl::SimpleAtoi(Peek(req.job(), req.key()).value_or(""), &stored));
          GRADSYNC_FUZZ_CHECK(stored == resp.value());
        }
        return;
      }
      case kCompareSet: {
        v1::CompareSetRequest req;
        v1::CompareSetResponse resp;
        if (!req.ParseFromString(payload)) return;
        const absl::StatusOr<std::string> before = Peek(req.job(), req.key());
        if (Unary(&rpc::StoreService::CompareSet, req, &resp).ok()) {
          const absl::StatusOr<std::string> after = Peek(req.job(), req.key());
          GRADSYNC_FUZZ_CHECK(resp.value() == after.value_or(""));
          if (resp.swapped()) {
            GRADSYNC_FUZZ_CHECK(after.ok() && *after == req.desired());
            GRADSYNC_FUZZ_CHECK(req.expect_absent() ? !before.ok()
                                                    : before.ok() && *before == req.expected());
          } else {
            GRADSYNC_FUZZ_CHECK(before.ok() == after.ok() && before.value_or("") == resp.value());
          }
        }
        return;
      }
      case kDelete: {
        v1::DeleteRequest req;
        v1::DeleteResponse resp;
        if (!req.ParseFromString(payload)) return;
        const bool existed = Peek(req.job(), req.key()).ok();
        if (Unary(&rpc::StoreService::Delete, req, &resp).ok()) {
          GRADSYNC_FUZZ_CHECK(resp.deleted() == existed);
          GRADSYNC_FUZZ_CHECK(!Peek(req.job(), req.key()).ok());
        }
        return;
      }
      case kList: {
        v1::ListRequest req;
        v1::ListResponse resp;
        if (!req.ParseFromString(payload)) return;
        if (Unary(&rpc::StoreService::List, req, &resp).ok()) {
          int64_t bytes = 0;
          for (int i = 0; i < resp.keys_size(); ++i) {
            GRADSYNC_FUZZ_CHECK(absl::StartsWith(resp.keys(i), req.prefix()));
            GRADSYNC_FUZZ_CHECK(i == 0 || resp.keys(i - 1) < resp.keys(i));
            GRADSYNC_FUZZ_CHECK(Peek(req.job(), resp.keys(i)).ok());
            bytes += static_cast<int64_t>(resp.keys(i).size()) + 6;
          }
          GRADSYNC_FUZZ_CHECK(bytes <= kMaxListReplyBytes);
        }
        return;
      }
      case kSetPackList: {
        v1::SetPackListRequest req;
        v1::SetPackListResponse resp;
        if (!req.ParseFromString(payload)) return;
        if (Unary(&rpc::StoreService::SetPackList, req, &resp).ok()) {
          auto stored = Peek(req.job(), PackListKey(req.group()));
          GRADSYNC_FUZZ_CHECK(stored.ok() && DecodePackList(*stored).ok());
        }
        return;
      }
      case kPeek: {
        v1::GetRequest req;
        if (!req.ParseFromString(payload)) return;
        auto values = store_.WaitBlocking(req.job(), {req.key()}, absl::InfinitePast());
        if (values.ok()) {
          GRADSYNC_FUZZ_CHECK(values->size() == 1 && Peek(req.job(), req.key()).ok());
        } else {
          GRADSYNC_FUZZ_CHECK(RequestError(values.status().code()) ||
                              values.status().code() == absl::StatusCode::kDeadlineExceeded);
        }
        return;
      }
      case kWaitNow:
      case kWaitLater: {
        v1::WaitRequest req;
        if (!req.ParseFromString(payload)) return;
        const bool now = kind == kWaitNow;
        int pending = 0;
        for (const auto& w : waits_) pending += w->answers == 0;
        auto w = std::make_shared<WaitRecord>();
        w->job = req.job();
        w->keys.assign(req.keys().begin(), req.keys().end());
        waits_.push_back(w);
        ids_.push_back(store_.WaitAsync(req.job(), w->keys,
                                        now ? absl::InfinitePast() : absl::Now() + absl::Hours(1),
                                        [w](absl::StatusOr<std::vector<std::string>> result) {
                                          ++w->answers;
                                          w->result = std::move(result);
                                        }));
        if (w->answers == 1 && w->result.ok()) CheckWaitReply(*w);
        if (now) GRADSYNC_FUZZ_CHECK(w->answers == 1);
        if (w->answers == 0) GRADSYNC_FUZZ_CHECK(pending < SmallLimits().max_waiters);
        return;
      }
      case kCancelWait:
        if (!ids_.empty() && !payload.empty()) {
          const size_t i = static_cast<uint8_t>(payload[0]) % ids_.size();
          store_.CancelWait(ids_[i]);
          GRADSYNC_FUZZ_CHECK(waits_[i]->answers == 1);
        }
        return;
      case kDeleteJob: {
        v1::GetRequest req;
        if (!req.ParseFromString(payload)) return;
        store_.DeleteJob(req.job());
        GRADSYNC_FUZZ_CHECK(!store_.List(req.job(), "").ok());
        return;
      }
      case kKinds:
        return;
    }
  }

  // A wait's values are the keys' values when it was answered: the ones the store holds now,
  // unless a later call changed them.
  void CheckWaitReply(const WaitRecord& w) {
    GRADSYNC_FUZZ_CHECK(w.result->size() == w.keys.size());
    int64_t bytes = 0;
    for (const std::string& v : *w.result) bytes += static_cast<int64_t>(v.size()) + 6;
    GRADSYNC_FUZZ_CHECK(bytes <= SmallLimits().max_reply_bytes);
  }

  void CheckLimits() {
    const MemoryStoreOptions limits = SmallLimits();
    const std::vector<JobStats> jobs = *store_.ListJobs();
    GRADSYNC_FUZZ_CHECK(static_cast<int64_t>(jobs.size()) <= limits.max_jobs);
    for (const JobStats& job : jobs) {
      GRADSYNC_FUZZ_CHECK(job.keys <= limits.max_keys_per_job);
      auto sizes = store_.ListSizes(job.job, "");
      GRADSYNC_FUZZ_CHECK(sizes.ok() && static_cast<int64_t>(sizes->size()) == job.keys);
      int64_t bytes = 0;
      for (const auto& [key, size] : *sizes) {
        GRADSYNC_FUZZ_CHECK(!key.empty() &&
                            static_cast<int64_t>(key.size()) <= limits.max_key_bytes);
        GRADSYNC_FUZZ_CHECK(size <= limits.max_value_bytes);
        bytes += size;
      }
      GRADSYNC_FUZZ_CHECK(bytes == job.value_bytes);
    }
  }

  MemoryStore store_;
  rpc::PeerAuth auth_;
  rpc::StoreService service_;
  std::vector<std::shared_ptr<WaitRecord>> waits_;
  std::vector<Store::WaitId> ids_;
};

}  // namespace
}  // namespace gradsync::store

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gradsync::fuzz::QuietLogs();
  grpc_init();  // held for the process: each call's server context would start and stop gRPC
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // One store for the process (a store per input would start and join its timer thread each
  // time, most of a run's cost under ASan); each input leaves it empty.
  static auto* const script = new gradsync::store::Script();
  script->Run(data, size);
  return 0;
}
