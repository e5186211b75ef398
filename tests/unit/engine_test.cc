// The core engine against in-process collaborators: heap "shared memory" (FakeImporter), the
// real CPU backend, and sinks that record events, so the test decides the order of arrivals.

#include "daemon/core/engine.h"

#include <atomic>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "common/job_id.h"
#include "common/store_keys.h"
#include "daemon/backend/cpu/cpu_backend.h"
#include "daemon/store/memory_store.h"
#include "gtest/gtest.h"

namespace gradsync::core {
namespace {

// Heap buffers by name; counts live mappings so tests can see when the engine lets go.
class FakeImporter final : public BufferImporter {
 public:
  class Mapping final : public MappedBuffer {
   public:
    Mapping(FakeImporter* owner, std::byte* data, int64_t size, int device, bool events)
        : owner_(owner), data_(data), size_(size), device_(device), events_(events) {
      ++owner_->live;
    }
    ~Mapping() override {
      ReleaseEvents();
      --owner_->live;
    }
    std::byte* data() const override { return data_; }
    int64_t size() const override { return size_; }
    std::string Describe() const override { return "fake"; }
    int device() const override { return device_; }
    void* ready_event() const override { return events_ ? &owner_->event_ : nullptr; }
    void* done_event() const override { return events_ ? &owner_->event_ : nullptr; }
    void ReleaseEvents() override {
      if (events_.exchange(false)) ++owner_->events_released;
    }

   private:
    FakeImporter* owner_;
    std::byte* data_;
    int64_t size_;
    int device_;
    std::atomic<bool> events_;
  };

  std::vector<float>& Create(const std::string& name, size_t n) {
    absl::MutexLock lock(&mu_);
    return memory_[name] = std::vector<float>(n, 0.0f);
  }

  absl::StatusOr<std::unique_ptr<MappedBuffer>> Import(
      const v1::RegisterBufferRequest& req) override {
    absl::MutexLock lock(&mu_);
    // A CUDA registration maps the memory named by its handle's bytes, with events.
    const std::string name = req.has_cuda() ? req.cuda().mem_handle() : req.shm_name();
    auto it = memory_.find(name);
    if (it == memory_.end()) return absl::NotFoundError(name);
    if (static_cast<int64_t>(it->second.size() * 4) < req.bytes()) {
      return absl::FailedPreconditionError("too small");
    }
    // Names starting "gpu" stand for device buffers (device 0); "gpuev" ones and CUDA
    // registrations have events (a ready and a done).
    return std::make_unique<Mapping>(this, reinterpret_cast<std::byte*>(it->second.data()),
                                     req.bytes(), absl::StartsWith(name, "gpu") ? 0 : -1,
                                     req.has_cuda() || absl::StartsWith(name, "gpuev"));
  }

  std::atomic<int> live{0};
  std::atomic<int> events_released{0};  // by ReleaseEvents, or with the mapping

 private:
  mutable char event_ = 0;  // what every fake event points at
  absl::Mutex mu_;
  std::map<std::string, std::vector<float>> memory_;
};

class RecordingSink final : public SessionSink {
 public:
  struct Event {
    uint64_t tag, seq;
    absl::Status status;
  };
  void OpDone(uint64_t tag, uint64_t seq, const absl::Status& status) override {
    absl::MutexLock lock(&mu_);
    events_.push_back({tag, seq, status});
  }
  std::vector<Event> events() {
    absl::MutexLock lock(&mu_);
    return events_;
  }
  // Waits (bounded) for `n` events.
  bool WaitFor(size_t n, absl::Duration timeout = absl::Seconds(10)) {
    absl::MutexLock lock(&mu_);
    auto enough = [&] { return events_.size() >= n; };
    return mu_.AwaitWithTimeout(absl::Condition(&enough), timeout);
  }

 private:
  absl::Mutex mu_;
  std::vector<Event> events_;
};

class EngineTest : public ::testing::Test {
 protected:
  EngineTest()
      : pool_(2),
        backend_(&pool_),
        engine_(&backend_, &importer_, &pool_, Options(), [this](const std::string& job) {
          absl::MutexLock lock(&mu_);
          ended_.push_back(job);
        }) {}

  static EngineOptions Options() {
    EngineOptions o;
    o.default_op_timeout = absl::Seconds(20);
    return o;
  }

  struct Rank {
    std::shared_ptr<RecordingSink> sink = std::make_shared<RecordingSink>();
    std::shared_ptr<Session> session;
    uint64_t buffer = 0;
    std::vector<float>* memory = nullptr;
  };

  Rank Join(const std::string& job, int world, int rank, size_t floats = 16) {
    Rank r;
    v1::RegisterRequest req;
    req.set_job(job);
    req.set_world_size(world);
    req.set_rank(rank);
    req.set_local_rank(rank);
    req.set_local_world_size(world);
    auto s = engine_.Register(req);
    EXPECT_TRUE(s.ok()) << s.status();
    r.session = *s;
    const std::string name = job + "/" + std::to_string(rank);
    r.memory = &importer_.Create(name, floats);
    v1::RegisterBufferRequest breq;
    breq.set_shm_name(name);
    breq.set_bytes(static_cast<int64_t>(floats * 4));
    breq.set_dtype(v1::FLOAT32);
    auto id = engine_.RegisterBuffer(*r.session, breq);
    EXPECT_TRUE(id.ok()) << id.status();
    r.buffer = *id;
    return r;
  }

  static v1::OpRequest AllReduce(const Rank& r, int64_t count, const std::string& group = "world",
                                 int64_t timeout_ms = 0) {
    v1::OpRequest op;
    op.set_kind(v1::ALL_REDUCE);
    op.set_reduce_op(v1::SUM);
    op.set_dtype(v1::FLOAT32);
    op.set_group(group);
    op.set_timeout_ms(timeout_ms);
    v1::Segment* s = op.add_input();
    s->set_buffer_id(r.buffer);
    s->set_count(count);
    return op;
  }

  WorkerPool pool_;
  FakeImporter importer_;
  backend::cpu::CpuBackend backend_;
  Engine engine_;
  absl::Mutex mu_;
  std::vector<std::string> ended_;
};

TEST_F(EngineTest, OpRunsOnlyWhenEveryMemberArrivedAndOpsCompleteInSequence) {
  Rank a = Join("j", 2, 0), b = Join("j", 2, 1);
  for (int k = 0; k < 3; ++k) engine_.Submit(a.session, a.sink, 100 + k, AllReduce(a, 4));
  absl::SleepFor(absl::Milliseconds(50));
  EXPECT_TRUE(a.sink->events().empty());  // nothing runs with one member present
  (*a.memory)[0] = 1;
  (*b.memory)[0] = 2;
  for (int k = 0; k < 3; ++k) engine_.Submit(b.session, b.sink, 200 + k, AllReduce(b, 4));
  ASSERT_TRUE(a.sink->WaitFor(3));
  ASSERT_TRUE(b.sink->WaitFor(3));
  const auto events = a.sink->events();
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(events[k].status.ok()) << events[k].status;
    EXPECT_EQ(events[k].tag, 100u + k);
    EXPECT_EQ(events[k].seq, static_cast<uint64_t>(k));
  }
  // Three sums in sequence: 3, then 6, then 12.
  EXPECT_EQ((*a.memory)[0], 12.0f);
  EXPECT_EQ((*b.memory)[0], 12.0f);
}

TEST_F(EngineTest, ListOpsShowsWhoArrivedAndHistoryKeepsFinishedOpsInOrderWithOutcomes) {
  Rank a = Join("j", 3, 0), b = Join("j", 3, 1), c = Join("j", 3, 2);
  EXPECT_EQ(engine_.ListOps("nope", "").status().code(), absl::StatusCode::kNotFound);
  // Op 0 fails at its deadline (rank 2 missing), op 1 completes.
  engine_.Submit(a.session, a.sink, 1, AllReduce(a, 4, "world", 300));
  engine_.Submit(b.session, b.sink, 2, AllReduce(b, 4));
  auto view = engine_.ListOps("j", "");
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_EQ(view->ops.size(), 1u);
  EXPECT_EQ(view->ops[0].group, "world");
  EXPECT_EQ(view->ops[0].seq, 0u);
  EXPECT_EQ(view->ops[0].waiting_for, Engine::OpWait::kTrainers);
  EXPECT_EQ(view->ops[0].arrived, (std::vector<int>{0, 1}));
  EXPECT_EQ(view->ops[0].missing, (std::vector<int>{2}));
  EXPECT_EQ(view->ops[0].bytes, 16);
  EXPECT_TRUE(absl::StrContains(view->ops[0].fingerprint, "all_reduce(sum, float32, count=4"));
  EXPECT_EQ(view->local_ranks, (std::vector<int>{0, 1, 2}));
  ASSERT_TRUE(a.sink->WaitFor(1, absl::Seconds(5)));
  engine_.Submit(c.session, c.sink, 3, AllReduce(c, 4));  // told op 0's verdict
  for (Rank* r : {&a, &b, &c}) engine_.Submit(r->session, r->sink, 9, AllReduce(*r, 4));
  for (Rank* r : {&a, &b, &c}) ASSERT_TRUE(r->sink->WaitFor(2));
  auto view_after = engine_.ListOps("j", "world");
  ASSERT_TRUE(view_after.ok());
  EXPECT_TRUE(view_after->ops.empty());
  auto history = engine_.GetHistory("j", "world");
  ASSERT_TRUE(history.ok()) << history.status();
  ASSERT_EQ(history->ops.size(), 2u);
  EXPECT_EQ(history->dropped, 0u);
  EXPECT_EQ(history->ops[0].seq, 0u);
  EXPECT_EQ(history->ops[0].outcome.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(history->ops[0].started, absl::InfinitePast());  // never ran
  EXPECT_EQ(history->ops[1].seq, 1u);
  EXPECT_TRUE(history->ops[1].outcome.ok()) << history->ops[1].outcome;
  EXPECT_LE(history->ops[1].queued, history->ops[1].started);
  EXPECT_LE(history->ops[1].started, history->ops[1].finished);
  EXPECT_EQ(engine_.GetHistory("j", "0,1").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(EngineTest, MismatchNamesBothRanksAndBothFingerprints) {
  Rank a = Join("j", 2, 0), b = Join("j", 2, 1);
  engine_.Submit(a.session, a.sink, 1, AllReduce(a, 4));
  engine_.Submit(b.session, b.sink, 2, AllReduce(b, 5));
  ASSERT_TRUE(a.sink->WaitFor(1));
  ASSERT_TRUE(b.sink->WaitFor(1));
  for (const auto& e : {a.sink->events()[0], b.sink->events()[0]}) {
    EXPECT_EQ(e.status.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_TRUE(
        absl::StrContains(e.status.message(), "rank 0 submitted all_reduce(sum, float32, count=4"))
        << e.status;
    EXPECT_TRUE(
        absl::StrContains(e.status.message(), "rank 1 submitted all_reduce(sum, float32, count=5"))
        << e.status;
  }
}

TEST_F(EngineTest, DeadlineNamesMissingRanksAndLatecomersGetTheSameVerdict) {
  Rank a = Join("j", 3, 0), b = Join("j", 3, 1), c = Join("j", 3, 2);
  engine_.Submit(a.session, a.sink, 1, AllReduce(a, 4, "world", 100));
  ASSERT_TRUE(a.sink->WaitFor(1, absl::Seconds(5)));
  const absl::Status verdict = a.sink->events()[0].status;
  EXPECT_EQ(verdict.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(absl::StrContains(verdict.message(), "rank(s) 1,2 never submitted it (arrived: 0)"))
      << verdict;
  engine_.Submit(b.session, b.sink, 2, AllReduce(b, 4));
  engine_.Submit(c.session, c.sink, 3, AllReduce(c, 4));
  ASSERT_TRUE(b.sink->WaitFor(1));
  ASSERT_TRUE(c.sink->WaitFor(1));
  EXPECT_EQ(b.sink->events()[0].status, verdict);
  EXPECT_EQ(c.sink->events()[0].status, verdict);
  // Op 1 works for all three.
  for (Rank* r : {&a, &b, &c}) engine_.Submit(r->session, r->sink, 9, AllReduce(*r, 4));
  for (Rank* r : {&a, &b, &c}) {
    ASSERT_TRUE(r->sink->WaitFor(2));
    EXPECT_TRUE(r->sink->events()[1].status.ok()) << r->sink->events()[1].status;
    EXPECT_EQ(r->sink->events()[1].seq, 1u);
  }
}

TEST_F(EngineTest, LeavingRankFailsItsGroupsOnlyAndJobRestartsWhenEmpty) {
  Rank a = Join("j", 3, 0), b = Join("j", 3, 1), c = Join("j", 3, 2);
  engine_.Submit(a.session, a.sink, 1, AllReduce(a, 4));  // waits for 1 and 2
  engine_.Unregister(*c.session, "killed");
  ASSERT_TRUE(a.sink->WaitFor(1));
  EXPECT_EQ(a.sink->events()[0].status.code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(
      absl::StrContains(a.sink->events()[0].status.message(), "rank 2 left job j (killed)"));
  // A group without rank 2 still works.
  engine_.Submit(a.session, a.sink, 2, AllReduce(a, 4, "0,1"));
  engine_.Submit(b.session, b.sink, 3, AllReduce(b, 4, "0,1"));
  ASSERT_TRUE(a.sink->WaitFor(2));
  EXPECT_TRUE(a.sink->events()[1].status.ok()) << a.sink->events()[1].status;
  // Rank 2 cannot rejoin while the others hold the broken job.
  v1::RegisterRequest req;
  req.set_job("j");
  req.set_world_size(3);
  req.set_rank(2);
  req.set_local_rank(2);
  req.set_local_world_size(3);
  EXPECT_EQ(engine_.Register(req).status().code(), absl::StatusCode::kFailedPrecondition);
  engine_.Unregister(*a.session, "done");
  engine_.Unregister(*b.session, "done");
  // The job ends on the engine's thread; its next run registers once that end is done.
  EXPECT_TRUE(engine_.Register(req).ok());
  absl::MutexLock lock(&mu_);
  EXPECT_EQ(ended_, std::vector<std::string>{"j"});
}

TEST_F(EngineTest, DeregisteredBufferStaysMappedUntilItsOpFinishes) {
  Rank a = Join("j", 2, 0), b = Join("j", 2, 1);
  EXPECT_EQ(importer_.live.load(), 2);
  engine_.Submit(a.session, a.sink, 1, AllReduce(a, 4));
  EXPECT_TRUE(engine_.DeregisterBuffer(*a.session, a.buffer).ok());
  EXPECT_EQ(importer_.live.load(), 2);  // the pending op pins it
  EXPECT_EQ(engine_.DeregisterBuffer(*a.session, a.buffer).code(), absl::StatusCode::kNotFound);
  engine_.Submit(b.session, b.sink, 2, AllReduce(b, 4));
  ASSERT_TRUE(a.sink->WaitFor(1));
  EXPECT_TRUE(a.sink->events()[0].status.ok());
  for (int i = 0; i < 100 && importer_.live.load() != 1; ++i) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(importer_.live.load(), 1);
  engine_.Unregister(*b.session, "done");
  EXPECT_EQ(importer_.live.load(), 0);
}

TEST_F(EngineTest, ShutdownFailsPendingOpsAndRefusesSessions) {
  Rank a = Join("j", 2, 0);
  engine_.Submit(a.session, a.sink, 1, AllReduce(a, 4));
  engine_.Shutdown();
  ASSERT_TRUE(a.sink->WaitFor(1));
  EXPECT_EQ(a.sink->events()[0].status.code(), absl::StatusCode::kUnavailable);
  v1::RegisterRequest req;
  req.set_job("k");
  req.set_world_size(1);
  req.set_local_world_size(1);
  EXPECT_EQ(engine_.Register(req).status().code(), absl::StatusCode::kUnavailable);
}

TEST_F(EngineTest, ManyThreadsManyOpsStayMatched) {
  constexpr int kWorld = 4, kOps = 200;
  std::vector<Rank> ranks;
  for (int r = 0; r < kWorld; ++r) ranks.push_back(Join("j", kWorld, r, 1 << 17));
  std::vector<std::thread> threads;
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      for (int k = 0; k < kOps; ++k) {
        // Alternate small (inline) and large (pool) ops to mix the two paths.
        engine_.Submit(ranks[r].session, ranks[r].sink, k,
                       AllReduce(ranks[r], k % 2 ? (1 << 17) : 8));
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(ranks[r].sink->WaitFor(kOps));
    const auto events = ranks[r].sink->events();
    for (int k = 0; k < kOps; ++k) {
      EXPECT_TRUE(events[k].status.ok()) << events[k].status;
      EXPECT_EQ(events[k].seq, static_cast<uint64_t>(k));  // completion order = sequence order
    }
  }
}

TEST_F(EngineTest, AnOpWhoseBuffersAreBothHostAndDeviceIsRefusedWhenResolved) {
  Rank a = Join("j", 1, 0);
  importer_.Create("gpu-grad", 16);
  v1::RegisterBufferRequest breq;
  breq.set_shm_name("gpu-grad");  // FakeImporter: a device buffer
  breq.set_bytes(64);
  breq.set_dtype(v1::FLOAT32);
  absl::StatusOr<uint64_t> device = engine_.RegisterBuffer(*a.session, breq);
  ASSERT_TRUE(device.ok()) << device.status();
  v1::OpRequest op = AllReduce(a, 4);
  v1::Segment* s = op.add_input();
  s->set_buffer_id(*device);
  s->set_count(4);
  engine_.Submit(a.session, a.sink, 7, op);
  ASSERT_TRUE(a.sink->WaitFor(1));
  const RecordingSink::Event e = a.sink->events()[0];
  EXPECT_EQ(e.tag, 7u);
  EXPECT_EQ(e.seq, 0u);  // refused before it took a sequence number
  EXPECT_EQ(e.status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(e.status.message(),
                                "all_reduce job=j group=world rank=0: an op takes host or device "
                                "buffers, not both"))
      << e.status;
  // The next op is op 0: the refused one took no number.
  engine_.Submit(a.session, a.sink, 8, AllReduce(a, 4));
  ASSERT_TRUE(a.sink->WaitFor(2));
  EXPECT_TRUE(a.sink->events()[1].status.ok()) << a.sink->events()[1].status;
  EXPECT_EQ(a.sink->events()[1].seq, 0u);
}

// A backend that records what the engine hands it and runs nothing.
class RecordingBackend final : public Backend {
 public:
  absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(
      const CommunicatorSpec& spec) override {
    absl::MutexLock lock(&mu_);
    specs_.push_back(spec);
    return std::make_shared<Comm>(this);
  }
  std::vector<CommunicatorSpec> specs() {
    absl::MutexLock lock(&mu_);
    return specs_;
  }
  std::vector<Collective> ops() {
    absl::MutexLock lock(&mu_);
    return ops_;
  }
  // Set before the first op: the first Run waits (bounded) for `first_run_may_end`, and a
  // batch, once its first op finished, for `rest_may_finish`.
  bool gated = false;
  absl::Notification first_run_may_end, rest_may_finish;

 private:
  struct Comm final : Communicator {
    explicit Comm(RecordingBackend* owner) : owner(owner) {}
    absl::Status Run(const Collective& op) override {
      if (owner->gated && !ran_once) {
        owner->first_run_may_end.WaitForNotificationWithTimeout(absl::Seconds(10));
      }
      ran_once = true;
      absl::MutexLock lock(&owner->mu_);
      owner->ops_.push_back(op);
      return op.local_failure;
    }
    void RunBatch(absl::Span<const Collective* const> ops,
                  absl::FunctionRef<void(size_t, absl::Status)> finished) override {
      for (size_t i = 0; i < ops.size(); ++i) {
        if (i == 1 && owner->gated) {
          owner->rest_may_finish.WaitForNotificationWithTimeout(absl::Seconds(10));
        }
        finished(i, Run(*ops[i]));
      }
    }
    RecordingBackend* owner;
    bool ran_once = false;
  };
  absl::Mutex mu_;
  std::vector<CommunicatorSpec> specs_ ABSL_GUARDED_BY(mu_);
  std::vector<Collective> ops_ ABSL_GUARDED_BY(mu_);
};

// A backend whose communicators keep each op's mappings (Collective::keep_alive) after Run has
// returned, as the NCCL one does for a device op it has launched, until Release.
class KeepingBackend final : public Backend {
 public:
  absl::StatusOr<std::shared_ptr<Communicator>> CreateCommunicator(
      const CommunicatorSpec&) override {
    return std::make_shared<Comm>(this);
  }
  size_t kept() {
    absl::MutexLock lock(&mu_);
    return kept_.size();
  }
  void Release() {
    absl::MutexLock lock(&mu_);
    kept_.clear();
    settlements_.clear();
  }
  // The kept ops failed on the device after their answer (as the NCCL plane finds it).
  void FailKept(const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    for (const auto& s : settlements_) s->Fail(why);
  }
  // The first local member's place in its trainer's order, of each op run.
  std::vector<std::optional<Turn>> turns() {
    absl::MutexLock lock(&mu_);
    return turns_;
  }

 private:
  struct Comm final : Communicator {
    explicit Comm(KeepingBackend* owner) : owner(owner) {}
    absl::Status Run(const Collective& op) override {
      absl::MutexLock lock(&owner->mu_);
      if (op.keep_alive) owner->kept_.push_back(op.keep_alive);
      for (const auto& s : op.settlements) owner->settlements_.push_back(s);
      owner->turns_.push_back(op.local.empty() ? std::nullopt : op.local[0].turn);
      return absl::OkStatus();
    }
    KeepingBackend* owner;
  };
  absl::Mutex mu_;
  std::vector<std::shared_ptr<const void>> kept_ ABSL_GUARDED_BY(mu_);
  std::vector<std::optional<Turn>> turns_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<Settlements::Op>> settlements_ ABSL_GUARDED_BY(mu_);
};

TEST(EngineKeepAliveTest, AnOpsMappingsOutliveItsAnswerTheBuffersDeregistrationAndTheSession) {
  WorkerPool pool(2);
  FakeImporter importer;
  KeepingBackend backend;
  Engine engine(&backend, &importer, &pool, EngineOptions(), nullptr);
  v1::RegisterRequest req;
  req.set_job("k");
  req.set_world_size(1);
  req.set_rank(0);
  req.set_local_rank(0);
  req.set_local_world_size(1);
  auto session = engine.Register(req);
  ASSERT_TRUE(session.ok()) << session.status();
  importer.Create("gpu/k/0", 16);
  v1::RegisterBufferRequest breq;
  breq.set_shm_name("gpu/k/0");
  breq.set_bytes(64);
  breq.set_dtype(v1::FLOAT32);
  auto buffer = engine.RegisterBuffer(**session, breq);
  ASSERT_TRUE(buffer.ok()) << buffer.status();
  v1::OpRequest op;
  op.set_kind(v1::ALL_REDUCE);
  op.set_reduce_op(v1::SUM);
  op.set_dtype(v1::FLOAT32);
  op.set_group("world");
  v1::Segment* seg = op.add_input();
  seg->set_buffer_id(*buffer);
  seg->set_count(16);
  auto sink = std::make_shared<RecordingSink>();
  engine.Submit(*session, sink, 1, op);
  ASSERT_TRUE(sink->WaitFor(1));
  EXPECT_TRUE(sink->events()[0].status.ok());
  EXPECT_EQ(backend.kept(), 1u);
  EXPECT_TRUE(engine.DeregisterBuffer(**session, *buffer).ok());
  engine.Unregister(**session, "done");  // the session and the job end
  EXPECT_EQ(importer.live.load(), 1);    // the communicator still holds the op's mapping
  backend.Release();                     // the op finished on the device
  EXPECT_EQ(importer.live.load(), 0);
}

// A device buffer's events (ready, done) stand for their latest record: two ops in flight on
// one registration would share them, and a trainer waiting on the first op's "done" would wait
// for the second's only. The engine lets one op at a time hold them, and releases them (closes
// its handles) once the buffer is deregistered and no op in flight holds them, so the trainer
// may then destroy what it exported.
class EngineDeviceEventsTest : public ::testing::Test {
 protected:
  EngineDeviceEventsTest() : engine_(&backend_, &importer_, &pool_, EngineOptions(), nullptr) {
    for (int rank = 0; rank < 2; ++rank) {
      v1::RegisterRequest req;
      req.set_job("ev");
      req.set_world_size(2);
      req.set_rank(rank);
      req.set_local_rank(rank);
      req.set_local_world_size(2);
      auto s = engine_.Register(req);
      EXPECT_TRUE(s.ok()) << s.status();
      sessions_[rank] = *s;
      sinks_[rank] = std::make_shared<RecordingSink>();
    }
  }

  uint64_t Register(int rank, const std::string& name) {
    importer_.Create(name, 16);
    v1::RegisterBufferRequest breq;
    breq.set_shm_name(name);
    breq.set_bytes(64);
    breq.set_dtype(v1::FLOAT32);
    auto id = engine_.RegisterBuffer(*sessions_[rank], breq);
    EXPECT_TRUE(id.ok()) << id.status();
    return id.ok() ? *id : 0;
  }

  static v1::OpRequest AllReduce(uint64_t buffer, const std::string& group = "world") {
    v1::OpRequest op;
    op.set_kind(v1::ALL_REDUCE);
    op.set_reduce_op(v1::SUM);
    op.set_dtype(v1::FLOAT32);
    op.set_group(group);
    op.set_timeout_ms(20000);
    v1::Segment* s = op.add_input();
    s->set_buffer_id(buffer);
    s->set_count(16);
    return op;
  }

  WorkerPool pool_{2};
  FakeImporter importer_;
  KeepingBackend backend_;
  Engine engine_;
  std::shared_ptr<Session> sessions_[2];
  std::shared_ptr<RecordingSink> sinks_[2];
};

TEST_F(EngineDeviceEventsTest, OpsOfAnotherGroupOnABufferWhoseEventsOpsInFlightHoldAreRefused) {
  const uint64_t a = Register(0, "gpuev/0"), b = Register(1, "gpuev/1");
  engine_.Submit(sessions_[0], sinks_[0], 1, AllReduce(a));  // waits for rank 1
  // The same group's next op over the same registration: queued behind it (one daemon stream
  // runs the group's ops in order, so its "done" covers the first's).
  engine_.Submit(sessions_[0], sinks_[0], 2, AllReduce(a));
  // Another group's: refused at once, before it takes a sequence number.
  engine_.Submit(sessions_[0], sinks_[0], 3, AllReduce(a, "0"));
  ASSERT_TRUE(sinks_[0]->WaitFor(1));
  {
    const RecordingSink::Event e = sinks_[0]->events()[0];
    EXPECT_EQ(e.tag, 3u) << e.status;
    EXPECT_EQ(e.seq, 0u);
    EXPECT_EQ(e.status.code(), absl::StatusCode::kFailedPrecondition) << e.status;
    EXPECT_TRUE(absl::StrContains(
        e.status.message(),
        absl::StrCat("buffer ", a,
                     " (fake) is named by an op of group world still in flight: a "
                     "device buffer's ready/done events serve one group's ops at a time")))
        << e.status;
  }
  engine_.Submit(sessions_[1], sinks_[1], 1, AllReduce(b));
  engine_.Submit(sessions_[1], sinks_[1], 2, AllReduce(b));
  ASSERT_TRUE(sinks_[0]->WaitFor(3));
  ASSERT_TRUE(sinks_[1]->WaitFor(2));
  for (size_t k : {1, 2}) {
    const RecordingSink::Event e = sinks_[0]->events()[k];
    EXPECT_EQ(e.tag, k) << e.status;
    EXPECT_TRUE(e.status.ok()) << e.status;
    EXPECT_EQ(e.seq, k - 1);
  }
  // Every op of group world answered: group 0 may take the buffer now.
  engine_.Submit(sessions_[0], sinks_[0], 4, AllReduce(a, "0"));
  ASSERT_TRUE(sinks_[0]->WaitFor(4));
  EXPECT_EQ(sinks_[0]->events()[3].tag, 4u);
  EXPECT_TRUE(sinks_[0]->events()[3].status.ok()) << sinks_[0]->events()[3].status;
  // A buffer not registered (yet): refused before anything is taken, as Resolve would refuse it
  // (a registration racing the op must not let it run without holding its events).
  engine_.Submit(sessions_[0], sinks_[0], 9, AllReduce(999));
  ASSERT_TRUE(sinks_[0]->WaitFor(5));
  EXPECT_EQ(sinks_[0]->events()[4].tag, 9u);
  EXPECT_EQ(sinks_[0]->events()[4].status.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(sinks_[0]->events()[4].status.message(),
            "all_reduce job=ev group=world rank=0: buffer 999 is not registered in this session");
  // A host buffer takes no events: ops of two groups in flight over it are fine.
  const uint64_t host = Register(0, "host/0");
  engine_.Submit(sessions_[0], sinks_[0], 5, AllReduce(host));
  engine_.Submit(sessions_[0], sinks_[0], 6, AllReduce(host, "0"));
  ASSERT_TRUE(sinks_[0]->WaitFor(6));
  EXPECT_EQ(sinks_[0]->events()[5].tag, 6u);  // the one-rank group's op ran; 5 waits for rank 1
  EXPECT_TRUE(sinks_[0]->events()[5].status.ok()) << sinks_[0]->events()[5].status;
}

TEST_F(EngineDeviceEventsTest, TheSameDeviceMemoryMayBeRegisteredOncePerOpWithEventsOfItsOwn) {
  importer_.Create("gpu-alloc-7", 16);
  v1::RegisterBufferRequest breq;
  breq.set_bytes(64);
  breq.set_dtype(v1::FLOAT32);
  v1::CudaIpcBuffer* c = breq.mutable_cuda();
  c->set_mem_handle("gpu-alloc-7");
  c->set_ready_event("ready-1");
  c->set_done_event("done-1");
  auto first = engine_.RegisterBuffer(*sessions_[0], breq);
  ASSERT_TRUE(first.ok()) << first.status();
  auto again = engine_.RegisterBuffer(*sessions_[0], breq);  // the same registration twice
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists) << again.status();
  c->set_ready_event("ready-2");
  c->set_done_event("done-2");
  auto second = engine_.RegisterBuffer(*sessions_[0], breq);
  ASSERT_TRUE(second.ok()) << second.status();
  // Each registration carries one op in flight: two concurrent ops over the allocation.
  engine_.Submit(sessions_[0], sinks_[0], 1, AllReduce(*first));
  engine_.Submit(sessions_[0], sinks_[0], 2, AllReduce(*second, "0"));
  ASSERT_TRUE(sinks_[0]->WaitFor(1));
  EXPECT_EQ(sinks_[0]->events()[0].tag, 2u);
  EXPECT_TRUE(sinks_[0]->events()[0].status.ok()) << sinks_[0]->events()[0].status;
}

TEST_F(EngineDeviceEventsTest, EventsAreReleasedOnceDeregisteredAndEveryOpNamingThemHasSettled) {
  const uint64_t a = Register(0, "gpuev/0"), b = Register(1, "gpuev/1");
  engine_.Submit(sessions_[0], sinks_[0], 1, AllReduce(a));
  engine_.Submit(sessions_[1], sinks_[1], 1, AllReduce(b));
  ASSERT_TRUE(sinks_[0]->WaitFor(1));
  ASSERT_TRUE(sinks_[1]->WaitFor(1));
  ASSERT_EQ(backend_.kept(), 1u);  // launched: the op stays with the data plane
  EXPECT_EQ(importer_.events_released.load(), 0);
  std::atomic<bool> told_a{false}, told_c{false};
  ASSERT_TRUE(engine_.DeregisterBuffer(*sessions_[0], a, [&] { told_a = true; }).ok());
  // The launched op may still record "done" on the device: the events stay, and the trainer is
  // not told it may destroy them (an imported event's pending record after its exporter
  // destroyed it is undefined).
  EXPECT_EQ(importer_.events_released.load(), 0);
  EXPECT_FALSE(told_a);
  // Deregistered while an op not yet answered holds them: that op's answer is not enough
  // either; its settling on the device is.
  const uint64_t c = Register(0, "gpuev/2");
  engine_.Submit(sessions_[0], sinks_[0], 2, AllReduce(c));  // waits for rank 1
  ASSERT_TRUE(engine_.DeregisterBuffer(*sessions_[0], c, [&] { told_c = true; }).ok());
  engine_.Submit(sessions_[1], sinks_[1], 2, AllReduce(b));
  ASSERT_TRUE(sinks_[0]->WaitFor(2));
  EXPECT_TRUE(sinks_[0]->events()[1].status.ok()) << sinks_[0]->events()[1].status;
  ASSERT_EQ(backend_.kept(), 2u);
  EXPECT_EQ(importer_.events_released.load(), 0);
  EXPECT_FALSE(told_c);
  backend_.Release();  // both ops settled on the device
  EXPECT_EQ(importer_.events_released.load(), 2);
  EXPECT_TRUE(told_a);
  EXPECT_TRUE(told_c);
  // A buffer no op holds is released, and said so, at once.
  const uint64_t d = Register(0, "gpuev/3");
  bool told_d = false;
  ASSERT_TRUE(engine_.DeregisterBuffer(*sessions_[0], d, [&] { told_d = true; }).ok());
  EXPECT_TRUE(told_d);
  EXPECT_EQ(importer_.events_released.load(), 3);
  // The session's end releases the rest (rank 1's buffer).
  engine_.Unregister(*sessions_[1], "done");
  EXPECT_EQ(importer_.events_released.load(), 4);
  engine_.Unregister(*sessions_[0], "done");
  EXPECT_EQ(importer_.live.load(), 0);
  EXPECT_EQ(importer_.events_released.load(), 4);  // none twice
}

TEST_F(EngineDeviceEventsTest, DeviceOpsTakeTheirTrainersOrderAtSubmissionAndLeaveItAtTheAnswer) {
  const uint64_t a = Register(0, "gpuev/0"), c = Register(0, "gpuev/2");
  const uint64_t host = Register(0, "host/0");
  engine_.Submit(sessions_[0], sinks_[0], 1, AllReduce(a));       // world: waits for rank 1
  engine_.Submit(sessions_[0], sinks_[0], 2, AllReduce(c, "0"));  // group 0: runs at once
  engine_.Submit(sessions_[0], sinks_[0], 3, AllReduce(host, "0"));
  ASSERT_TRUE(sinks_[0]->WaitFor(2));
  std::vector<std::optional<Turn>> turns = backend_.turns();
  ASSERT_EQ(turns.size(), 2u);
  ASSERT_TRUE(turns[0].has_value());
  EXPECT_EQ(turns[0]->index, 2u);  // the trainer's second device op
  EXPECT_FALSE(turns[1].has_value()) << "a host op takes no turn";
  // Its turn waits for the first, which waits for rank 1: the data plane would not launch it.
  absl::Status early = turns[0]->order->AwaitTurn(turns[0]->index, absl::Now(), nullptr);
  EXPECT_EQ(early.code(), absl::StatusCode::kDeadlineExceeded) << early;
  EXPECT_TRUE(absl::StrContains(early.message(), "1 device op(s) its trainer submitted before"))
      << early;
  const uint64_t b = Register(1, "gpuev/1");
  engine_.Submit(sessions_[1], sinks_[1], 1, AllReduce(b));
  ASSERT_TRUE(sinks_[0]->WaitFor(3));  // the first is answered: launched
  EXPECT_TRUE(turns[0]->order->AwaitTurn(turns[0]->index, absl::Now(), nullptr).ok());
  backend_.Release();
}

TEST_F(EngineDeviceEventsTest, SettleWaitsForTheDeviceOpsAndReportsAFailureAfterAnAnswerOnce) {
  const uint64_t a = Register(0, "gpuev/0"), b = Register(1, "gpuev/1");
  engine_.Submit(sessions_[0], sinks_[0], 1, AllReduce(a));
  engine_.Submit(sessions_[1], sinks_[1], 1, AllReduce(b));
  ASSERT_TRUE(sinks_[0]->WaitFor(1));
  EXPECT_TRUE(sinks_[0]->events()[0].status.ok()) << sinks_[0]->events()[0].status;
  absl::Notification settled;
  absl::Status got = absl::UnknownError("not settled");
  engine_.Settle(*sessions_[0], [&](absl::Status s) {
    got = std::move(s);
    settled.Notify();
  });
  EXPECT_FALSE(settled.HasBeenNotified()) << "settled while the launched op runs on the device";
  backend_.FailKept(absl::AbortedError("all_reduce seq=0 failed on the GPU after its answer"));
  backend_.Release();  // the data plane lets the op go
  ASSERT_TRUE(settled.WaitForNotificationWithTimeout(absl::Seconds(5)));
  EXPECT_EQ(got.code(), absl::StatusCode::kAborted) << got;
  EXPECT_EQ(got.message(), "all_reduce seq=0 failed on the GPU after its answer");
  // Reported once; nothing in flight: at once.
  absl::Status again = absl::UnknownError("not settled");
  engine_.Settle(*sessions_[0], [&](absl::Status s) { again = std::move(s); });
  EXPECT_TRUE(again.ok()) << again;
  // An op answered with an error is the trainer's news already: not reported again.
  const uint64_t c = Register(0, "gpuev/2");
  engine_.Submit(sessions_[0], sinks_[0], 2, AllReduce(c, "x,y"));  // refused: a bad group
  ASSERT_TRUE(sinks_[0]->WaitFor(2));
  EXPECT_FALSE(sinks_[0]->events()[1].status.ok());
  absl::Status third = absl::UnknownError("not settled");
  engine_.Settle(*sessions_[0], [&](absl::Status s) { third = std::move(s); });
  EXPECT_TRUE(third.ok()) << third;
}

// Two engines as two nodes of one job, sharing the root's store: node A holds ranks 0 and 1,
// node B rank 2.
class TwoNodeEngineTest : public ::testing::Test {
 protected:
  struct Node {
    explicit Node(gradsync::Store* store, const std::string& address)
        : engine(
              &backend, &importer, &pool, EngineOptions(), nullptr,
              [store](const std::string&) -> absl::StatusOr<gradsync::Store*> { return store; }) {
      engine.SetNodeAddress(address);
    }
    FakeImporter importer;
    RecordingBackend backend;
    Engine engine;
    // Last, so gone first: its queued work (formation callbacks) runs while the engine lives.
    WorkerPool pool{2};
  };
  struct Member {
    std::shared_ptr<RecordingSink> sink = std::make_shared<RecordingSink>();
    std::shared_ptr<Session> session;
    uint64_t buffer = 0;
  };

  // Rank `rank` of job `job` on `node`; its buffer is a device buffer when `job` starts "gpu".
  Member Join(Node& node, const std::string& job, int rank, int local_rank, int local_world,
              bool elastic = false) {
    Member m;
    v1::RegisterRequest req;
    req.set_job(job);
    req.set_elastic(elastic);
    req.set_world_size(3);
    req.set_rank(rank);
    req.set_local_rank(local_rank);
    req.set_local_world_size(local_world);
    req.set_root_address("a:7451");
    auto s = node.engine.Register(req);
    EXPECT_TRUE(s.ok()) << s.status();
    m.session = *s;
    const std::string name = absl::StrCat(job, "/", rank);
    node.importer.Create(name, 16);
    v1::RegisterBufferRequest breq;
    breq.set_shm_name(name);
    breq.set_bytes(64);
    breq.set_dtype(v1::FLOAT32);
    auto id = node.engine.RegisterBuffer(*m.session, breq);
    EXPECT_TRUE(id.ok()) << id.status();
    m.buffer = *id;
    return m;
  }
  static v1::OpRequest AllReduce(const Member& m, int64_t count) {
    v1::OpRequest op;
    op.set_kind(v1::ALL_REDUCE);
    op.set_reduce_op(v1::SUM);
    op.set_dtype(v1::FLOAT32);
    op.set_group("world");
    v1::Segment* s = op.add_input();
    s->set_buffer_id(m.buffer);
    s->set_count(count);
    return op;
  }
  // Ranks 0 and 1 submit different ops (a desync on node A); rank 2 a matching one on B.
  // Returns the op node A's backend was handed.
  Collective DesyncOnA(const std::string& job) {
    const size_t before = a_.backend.ops().size();
    Member r0 = Join(a_, job, 0, 0, 2), r1 = Join(a_, job, 1, 1, 2), r2 = Join(b_, job, 2, 0, 1);
    a_.engine.Submit(r0.session, r0.sink, 1, AllReduce(r0, 4));
    a_.engine.Submit(r1.session, r1.sink, 1, AllReduce(r1, 5));
    b_.engine.Submit(r2.session, r2.sink, 1, AllReduce(r2, 4));
    EXPECT_TRUE(r0.sink->WaitFor(1));
    EXPECT_EQ(r0.sink->events()[0].status.code(), absl::StatusCode::kFailedPrecondition);
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (a_.backend.ops().size() == before && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    const std::vector<Collective> ops = a_.backend.ops();
    EXPECT_EQ(ops.size(), before + 1);
    return ops.size() > before ? ops[before] : Collective{};
  }

  store::MemoryStore store_;
  Node a_{&store_, "a:7451"};
  Node b_{&store_, "b:7451"};
};

// A batch of ops crossing nodes: each op goes to the history as it finishes, ListOps shows
// every op of the batch still running (not only the first), and the members are answered
// once the batch has finished.
TEST_F(TwoNodeEngineTest, OpsOfABatchAreRecordedOneByOneAndAnsweredTogether) {
  a_.backend.gated = true;
  Member r0 = Join(a_, "cpu", 0, 0, 2), r1 = Join(a_, "cpu", 1, 1, 2),
         r2 = Join(b_, "cpu", 2, 0, 1);
  // Op 0 runs alone and is held there until ops 1..3 are queued behind it: they go as a batch.
  auto submit = [&](uint64_t tag) {
    for (Member* m : {&r0, &r1, &r2}) {
      (m == &r2 ? b_ : a_).engine.Submit(m->session, m->sink, tag, AllReduce(*m, 4));
    }
  };
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  auto shown = [&](size_t n, Engine::OpWait first) {
    auto view = a_.engine.ListOps("cpu", "world");
    return view.ok() && view->ops.size() == n && view->ops[0].waiting_for == first;
  };
  submit(1);
  while (!shown(1, Engine::OpWait::kNetwork) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(shown(1, Engine::OpWait::kNetwork));
  for (uint64_t tag = 2; tag <= 4; ++tag) submit(tag);
  while (!shown(4, Engine::OpWait::kNetwork) && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(shown(4, Engine::OpWait::kNetwork));
  a_.backend.first_run_may_end.Notify();
  // Op 0 (alone) answered; op 1 of the batch in the history; 2 and 3 held in the batch.
  ASSERT_TRUE(r0.sink->WaitFor(1));
  auto recorded = [&](size_t n) {
    auto history = a_.engine.GetHistory("cpu", "world");
    return history.ok() && history->ops.size() == n;
  };
  while (!recorded(2) && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_TRUE(recorded(2));
  auto history = a_.engine.GetHistory("cpu", "world");
  EXPECT_EQ(history->ops[1].seq, 1u);
  EXPECT_TRUE(history->ops[1].outcome.ok()) << history->ops[1].outcome;
  EXPECT_EQ(r0.sink->events().size(), 1u);
  auto view = a_.engine.ListOps("cpu", "world");
  ASSERT_TRUE(view.ok()) << view.status();
  ASSERT_EQ(view->ops.size(), 2u);
  EXPECT_EQ(view->ops[0].seq, 2u);
  EXPECT_EQ(view->ops[1].seq, 3u);
  a_.backend.rest_may_finish.Notify();
  ASSERT_TRUE(r0.sink->WaitFor(4));
  ASSERT_TRUE(r1.sink->WaitFor(4));
  for (const RecordingSink::Event& e : r0.sink->events()) EXPECT_TRUE(e.status.ok()) << e.status;
  history = a_.engine.GetHistory("cpu", "world");
  ASSERT_TRUE(history.ok()) << history.status();
  EXPECT_EQ(history->ops.size(), 4u);
  EXPECT_TRUE(a_.engine.ListOps("cpu", "world")->ops.empty());
}

// A peer watch whose losses the test reports.
class FakePeerWatch final : public PeerWatch {
 public:
  void Watch(const std::string& job, const std::string&, std::vector<std::string>, int,
             gradsync::Store*, LostCallback on_lost) override {
    absl::MutexLock lock(&mu_);
    callbacks_[job] = std::move(on_lost);
  }
  void Unwatch(const std::string& job) override {
    absl::MutexLock lock(&mu_);
    callbacks_.erase(job);
  }
  std::vector<PeerState> Peers(const std::string&) const override { return {}; }
  std::map<std::string, int64_t> LossCounts() const override { return {}; }
  // Reports `node` lost for `job` as the real watch would; false while `job` is not watched.
  bool Lose(const std::string& job, const std::string& node, const absl::Status& cause) {
    LostCallback callback;
    {
      absl::MutexLock lock(&mu_);
      auto it = callbacks_.find(job);
      if (it == callbacks_.end()) return false;
      callback = it->second;
    }
    callback(node, cause);
    return true;
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, LostCallback> callbacks_ ABSL_GUARDED_BY(mu_);
};

TEST_F(TwoNodeEngineTest, AnElasticJobsDaemonsRecordOneDecisionOfItsNextMembership) {
  // Outlive the engines (which tell them when a job ends): kept for the process.
  static FakePeerWatch& watch_a = *new FakePeerWatch();
  static FakePeerWatch& watch_b = *new FakePeerWatch();
  a_.engine.SetPeerWatch(&watch_a);
  b_.engine.SetPeerWatch(&watch_b);
  for (const bool elastic : {false, true}) {
    const std::string job = elastic ? "el" : "plain";
    SCOPED_TRACE(job);
    Member r0 = Join(a_, job, 0, 0, 2, elastic), r1 = Join(a_, job, 1, 1, 2, elastic),
           r2 = Join(b_, job, 2, 0, 1, elastic);
    a_.engine.Submit(r0.session, r0.sink, 1, AllReduce(r0, 4));
    a_.engine.Submit(r1.session, r1.sink, 1, AllReduce(r1, 4));
    b_.engine.Submit(r2.session, r2.sink, 1, AllReduce(r2, 4));
    ASSERT_TRUE(r0.sink->WaitFor(1));  // formed: both nodes watch each other
    ASSERT_TRUE(r2.sink->WaitFor(1));
    // A partition: each side finds the other lost, at once.
    ASSERT_TRUE(
        watch_a.Lose(job, "b:7451", absl::UnavailableError("lost: the connection was reset")));
    ASSERT_TRUE(watch_b.Lose(job, "a:7451", absl::UnavailableError("lost: no word for 1.5 s")));
    absl::StatusOr<std::string> decision = store_.Get(
        job, std::string(kElasticDecisionKey), absl::Now() + absl::Seconds(elastic ? 10 : 1));
    if (!elastic) {
      EXPECT_EQ(decision.status().code(), absl::StatusCode::kDeadlineExceeded) << *decision;
      continue;
    }
    ASSERT_TRUE(decision.ok()) << decision.status();
    absl::StatusOr<MembershipDecision> d = MembershipDecision::Decode(*decision);
    ASSERT_TRUE(d.ok()) << d.status();
    // It says when it was made (Inspect's epochs measure the change from it).
    EXPECT_LE(d->at, absl::Now());
    EXPECT_GE(d->at, absl::Now() - absl::Seconds(30));
    const std::string described = d->Describe();
    const size_t at = described.find(" at="), why = described.find(" why=");
    ASSERT_TRUE(at != std::string::npos && why != std::string::npos && at < why) << described;
    const std::string made = described.substr(0, at) + described.substr(why);
    // Whichever side came first: one decision, the survivors in order.
    const std::string a_decides =
        "epoch=1 world=2 lost_ranks=2 lost_nodes=b:7451 why=node b:7451 (ranks 2) lost: the "
        "connection was reset";
    const std::string b_decides =
        "epoch=1 world=1 lost_ranks=0,1 lost_nodes=a:7451 why=node a:7451 (ranks 0,1) lost: no "
        "word for 1.5 s";
    EXPECT_TRUE(made == a_decides || made == b_decides) << described;
    absl::SleepFor(absl::Seconds(1));  // both have decided by now: the first stands
    EXPECT_EQ(*store_.Get(job, std::string(kElasticDecisionKey), absl::InfinitePast()), *decision);
    // Each node keeps the membership it formed, epoch 0 of 3 ranks.
    for (Node* node : {&a_, &b_}) {
      const std::vector<EpochRecord> epochs = node->engine.Epochs(job);
      ASSERT_EQ(epochs.size(), 1u);
      EXPECT_EQ(epochs[0].job, job);
      EXPECT_EQ(epochs[0].epoch, 0);
      EXPECT_EQ(epochs[0].world_size, 3);
      EXPECT_EQ(epochs[0].change, "");
    }
    EXPECT_TRUE(a_.engine.Epochs("plain").empty());  // a job that is not elastic has none
  }
}

TEST_F(TwoNodeEngineTest, EveryNodeOfARunSharesItsToken) {
  DesyncOnA("cpu");
  auto run = store_.Get("cpu", kRunKey, absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(run.ok()) << run.status();
  EXPECT_EQ(run->size(), 16u);
  // Node B makes its communicator when its own op runs, after formation, on its pool.
  const absl::Time give_up = absl::Now() + absl::Seconds(10);
  while (b_.backend.specs().empty() && absl::Now() < give_up) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_FALSE(a_.backend.specs().empty());
  ASSERT_FALSE(b_.backend.specs().empty());
  EXPECT_EQ(a_.backend.specs()[0].run, *run);
  EXPECT_EQ(b_.backend.specs()[0].run, *run);
}

TEST_F(TwoNodeEngineTest, AFailedOpSaysWhichPlaneItsMembersBuffersAreOn) {
  Collective host = DesyncOnA("cpu");
  EXPECT_EQ(host.local_failure.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(host.plane, Plane::kHost);
  Collective device = DesyncOnA("gpu");
  EXPECT_EQ(device.local_failure.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(device.plane, Plane::kDevice);
}

// Ops of a group that failed before any member named a buffer (a barrier) go to the plane of
// the group's last op, where the other nodes run it.
TEST_F(TwoNodeEngineTest, AnOpFailedBeforeAnyMemberNamedABufferGoesToTheGroupsLastPlane) {
  for (const auto& [job, plane] : {std::pair{std::string("gpu"), Plane::kDevice},
                                   std::pair{std::string("cpu"), Plane::kHost}}) {
    SCOPED_TRACE(job);
    const size_t before = a_.backend.ops().size();
    Member r0 = Join(a_, job, 0, 0, 2), r1 = Join(a_, job, 1, 1, 2), r2 = Join(b_, job, 2, 0, 1);
    a_.engine.Submit(r0.session, r0.sink, 1, AllReduce(r0, 4));
    a_.engine.Submit(r1.session, r1.sink, 1, AllReduce(r1, 4));
    v1::OpRequest barrier;
    barrier.set_kind(v1::BARRIER);
    barrier.set_group("world");
    barrier.set_name("x");
    a_.engine.Submit(r0.session, r0.sink, 2, barrier);
    barrier.set_name("y");  // a desync: the barrier fails on node A
    a_.engine.Submit(r1.session, r1.sink, 2, barrier);
    ASSERT_TRUE(r0.sink->WaitFor(2));
    for (const RecordingSink::Event& e : r0.sink->events()) {  // the two may come in any order
      EXPECT_EQ(e.status.code(),
                e.tag == 1 ? absl::StatusCode::kOk : absl::StatusCode::kFailedPrecondition)
          << e.status;
    }
    const absl::Time give_up = absl::Now() + absl::Seconds(10);
    while (a_.backend.ops().size() < before + 2 && absl::Now() < give_up) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    const std::vector<Collective> ops = a_.backend.ops();
    ASSERT_EQ(ops.size(), before + 2);
    EXPECT_TRUE(ops[before].local_failure.ok()) << ops[before].local_failure;
    EXPECT_EQ(ops[before].plane, plane);
    const Collective& failed = ops[before + 1];
    EXPECT_EQ(failed.kind, v1::BARRIER);
    EXPECT_EQ(failed.local_failure.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(failed.plane, plane);
    EXPECT_EQ(failed.seq, 1u);
    EXPECT_EQ(failed.label, absl::StrCat("barrier job=", job, " group=world seq=1"));
    EXPECT_TRUE(failed.local.empty());
  }
}

}  // namespace
}  // namespace gradsync::core
