// Op request resolution (Engine::Submit, Engine::Resolve): the input is a v1::OpRequest as a
// trainer sends it (binary protobuf), submitted by the one rank of a world-size-1 job against
// the session's registered buffers. Every op must be answered exactly once, at once (nothing
// waits on peers), with OK or a request error; an op that runs must name only whole elements
// inside its buffers, with the counts its kind needs and no two runs overlapping. Buffers are
// heap allocations of exactly their registered size, and the communicator touches every byte
// it is given, so ASan reports what the checks miss.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/worker_pool.h"
#include "daemon/core/backend.h"
#include "daemon/core/engine.h"
#include "fuzz_check.h"

namespace gradsync::core {
namespace {

// Buffers of exactly the requested bytes, by name; the mapping owns its allocation.
class HeapImporter final : public BufferImporter {
 public:
  class Mapping final : public MappedBuffer {
   public:
    explicit Mapping(int64_t size) : data_(new std::byte[size]()), size_(size) {}
    std::byte* data() const override { return data_.get(); }
    int64_t size() const override { return size_; }
    std::string Describe() const override { return "heap"; }

   private:
    const std::unique_ptr<std::byte[]> data_;
    const int64_t size_;
  };

  absl::StatusOr<std::unique_ptr<MappedBuffer>> Import(
      const v1::RegisterBufferRequest& req) override {
    return std::make_unique<Mapping>(req.bytes());
  }
};

int64_t Elements(const View& view) {
  int64_t n = 0;
  for (const Run& run : view) n += run.count;
  return n;
}

// Checks what the engine promises a communicator, then writes and reads every byte it names.
class TouchingCommunicator final : public Communicator {
 public:
  absl::Status Run(const Collective& op) override {
    ++runs;
    GRADSYNC_FUZZ_CHECK(op.local_failure.ok());
    GRADSYNC_FUZZ_CHECK(op.group_size == 1 && op.local.size() == 1);
    const LocalMember& me = op.local[0];
    GRADSYNC_FUZZ_CHECK(me.group_rank == 0);
    const int64_t esize = op.kind == v1::BARRIER ? 1 : DTypeSize(op.dtype);
    GRADSYNC_FUZZ_CHECK(esize > 0);
    const int64_t in = Elements(me.input), out = Elements(me.output);
    switch (op.kind) {
      case v1::ALL_REDUCE:
      case v1::BROADCAST:
        GRADSYNC_FUZZ_CHECK(in == op.count && me.output.empty());
        break;
      case v1::ALL_GATHER:
      case v1::REDUCE_SCATTER:  // with one member, input and output hold the same count
        GRADSYNC_FUZZ_CHECK(in == op.count && out == op.count);
        break;
      case v1::BARRIER:
        GRADSYNC_FUZZ_CHECK(me.input.empty() && me.output.empty());
        break;
      default:
        GRADSYNC_FUZZ_CHECK(false && "unknown kind reached the communicator");
    }
    std::vector<std::pair<const std::byte*, const std::byte*>> spans;
    for (const View* view : {&me.input, &me.output}) {
      for (const core::Run& run : *view) {
        GRADSYNC_FUZZ_CHECK(run.count > 0 && run.buffer != nullptr);
        const std::byte* begin = run.buffer->data();
        const std::byte* end = begin + run.buffer->size();
        GRADSYNC_FUZZ_CHECK(run.data >= begin && run.count <= (end - run.data) / esize);
        GRADSYNC_FUZZ_CHECK((run.data - begin) % esize == 0);
        std::memset(run.data, 0x5a, run.count * esize);
        spans.emplace_back(run.data, run.data + run.count * esize);
      }
    }
    std::sort(spans.begin(), spans.end());
    for (size_t i = 1; i < spans.size(); ++i) {
      GRADSYNC_FUZZ_CHECK(spans[i].first >= spans[i - 1].second);
    }
    return absl::OkStatus();
  }

  int64_t runs = 0;
};

class TouchingBackend final : public Backend {
 public:
  absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(
      const CommunicatorSpec& spec) override {
    GRADSYNC_FUZZ_CHECK(spec.members.size() == 1 && spec.local_members == spec.members);
    return comm;
  }
  const std::shared_ptr<TouchingCommunicator> comm = std::make_shared<TouchingCommunicator>();
};

class RecordingSink final : public SessionSink {
 public:
  void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) override {
    ++calls;
    last_tag = tag;
    last = status;
  }
  int calls = 0;
  uint64_t last_tag = 0;
  absl::Status last;
};

// One engine for the process: a world-size-1 job whose rank registered a few small buffers,
// typed and untyped, some of sizes no element divides.
struct Node {
  Node() : pool(1), engine(&backend, &importer, &pool, Options(), [](const std::string&) {}) {
    v1::RegisterRequest reg;
    reg.set_job("fuzz");
    reg.set_world_size(1);
    reg.set_local_world_size(1);
    session = *engine.Register(reg);
    const std::pair<v1::DType, int64_t> buffers[] = {
        {v1::FLOAT32, 64}, {v1::DTYPE_UNSPECIFIED, 37}, {v1::INT8, 3},
        {v1::FLOAT64, 24}, {v1::DTYPE_UNSPECIFIED, 0},  {v1::BFLOAT16, 10}};
    int n = 0;
    for (const auto& [dtype, bytes] : buffers) {
      v1::RegisterBufferRequest req;
      req.set_shm_name("buffer" + std::to_string(n++));
      req.set_bytes(bytes);
      req.set_dtype(dtype);
      GRADSYNC_FUZZ_CHECK(engine.RegisterBuffer(*session, req).ok());  // ids 1, 2, ...
    }
  }

  static EngineOptions Options() {
    EngineOptions o;
    o.default_op_timeout = absl::Seconds(1);
    return o;
  }

  WorkerPool pool;
  HeapImporter importer;
  TouchingBackend backend;
  Engine engine;
  std::shared_ptr<Session> session;
};

void Fuzz(const uint8_t* data, size_t size) {
  static Node* const node = new Node();  // lives for the process: its threads never join
  v1::OpRequest op;
  if (!op.ParseFromArray(data, static_cast<int>(size))) return;
  auto sink = std::make_shared<RecordingSink>();
  const int64_t runs = node->backend.comm->runs;
  node->engine.Submit(node->session, sink, 42, op);
  // One rank, small buffers: the op is matched and run on this thread, or refused.
  GRADSYNC_FUZZ_CHECK(sink->calls == 1 && sink->last_tag == 42);
  const absl::StatusCode code = sink->last.code();
  static const bool verbose = std::getenv("GRADSYNC_FUZZ_VERBOSE") != nullptr;  // for triage
  if (verbose) std::fprintf(stderr, "%s\n", sink->last.ToString().c_str());
  GRADSYNC_FUZZ_CHECK(code == absl::StatusCode::kOk || code == absl::StatusCode::kInvalidArgument ||
                      code == absl::StatusCode::kNotFound);
  GRADSYNC_FUZZ_CHECK(node->backend.comm->runs == runs + (code == absl::StatusCode::kOk ? 1 : 0));
}

}  // namespace
}  // namespace gradsync::core

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gradsync::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradsync::core::Fuzz(data, size);
  return 0;
}
