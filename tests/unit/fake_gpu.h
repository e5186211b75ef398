#pragma once

// A fake GpuApi for unit tests of the GPU data plane on machines without a GPU: IPC mappings of
// "exported" allocations, events, streams and NCCL communicators, with every call that orders
// work logged ("wait s0 e1", "allreduce c2 s0 n=16", "close d0 h3", ...) and failures injectable.
//
// Streams model kernels that wait on peers: with streams_hang set, a collective's kernels never
// finish until their own communicator is aborted or revoked; after that they may stay busy a
// while longer (busy_after_abort) or for good (kernels_survive_abort). IPC mappings are
// reference-counted per (device, handle), as cudaIpcOpenMemHandle's are within one context.
//
// What NCCL 2.28 does and the fake holds to (NVIDIA/nccl v2.28.9-1):
// - ncclCommAbort blocks its caller, even on a non-blocking communicator: it raises its own
//   communicator's abort flag only (src/init.cc setCommAbortFlags), then forces a blocking group
//   (src/group.cc, destroyFlag), synchronises NCCL's internal streams (commDestroySync), joins
//   the proxy threads and frees device memory (cudaFree, which may synchronise the device).
//   Here: it stops its own kernels, takes abort_blocks, then waits (at most free_wait_limit,
//   counted in frees_blocked) while a kernel of another communicator on its device still runs.
// - NCCL's internal stream waits on the user stream after each kernel (src/enqueue.cc), so work
//   queued on the user stream that never completes (a wait on an event whose exporting process
//   died) blocks the abort: here for at most dead_wait_limit, counted in aborts_blocked.
// - ncclCommRevoke raises the abort flag and returns at once; the communicator reports "in
//   progress" until quiescent, then success; a second revoke is refused (src/init.cc).
// - ncclGetUniqueId starts a detached bootstrap root thread with a listening socket and no
//   timeout, which ends only once every rank has checked in (src/bootstrap.cc
//   bootstrapCreateRoot): here a root stays open (RootsOpen) until a communicator built from
//   its id here becomes ready.
//
// What CUDA documents and the fake holds to, so that code which relies on more fails here too:
// - an event stands for its latest record only: RecordEvent replaces what it marked, and
//   StreamWaitEvent orders a stream after the record the event holds at the time of the call
//   (recorded_for() says which collective that is);
// - an event destroyed (DestroyEvent) is an error to record, wait on or query, and to destroy
//   again (destroyed_event_uses counts the tries);
// - an allocation exported at a trainer's address range (exported_at) is refused
//   (ALREADY_EXISTS, cudaErrorAlreadyMapped) while an overlapping one of the same process is
//   mapped on that device, the same handle included, until that one is closed;
// - each stream runs its work in order, streams run concurrently: with op_time set, a
//   collective takes that long from when its stream (and the events it waits on) let it start,
//   and StreamDone/EventDone say so only then.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::testing {

/// What the fakes of a job's nodes share (the same `fabric` set on each): an NCCL kernel
/// finishes only once the kernel of every rank of its communicator has started, and a GPU
/// starts its NCCL kernels one at a time, in the order they were launched (what
/// NCCL_LAUNCH_ORDER_IMPLICIT=1 makes of the host's launch order: src/enqueue.cc, the device's
/// launchOrder stream; without it a GPU may still run them so, when they cannot all be
/// resident). So ops of two communicators launched in opposite orders on two nodes never
/// finish: the deadlock of NCCL's "Using multiple NCCL communicators concurrently".
struct FakeFabric {
  std::mutex mu;
  // (unique id, op number on its communicators) -> the ranks whose kernel has started
  std::map<std::pair<std::string, uint64_t>, std::set<int>> started;
};

class FakeGpu final : public gpu::GpuApi {
 public:
  /// Shares `fabric` with other nodes' fakes (null: every kernel finishes at once, but for
  /// streams_hang); also while other threads look at streams.
  void SetFabric(std::shared_ptr<FakeFabric> f) {
    std::lock_guard<std::mutex> lock(mu_);
    fabric = std::move(f);
  }
  // ---- knobs ----
  int devices = 2;
  absl::Status device_error;                // not OK: DeviceCount fails (no driver)
  int mps_devices = 0;                      // devices 0..mps_devices-1 are MPS clients
  absl::Status open_error;                  // not OK: OpenMemHandle fails
  absl::Status event_error;                 // not OK: OpenEventHandle fails
  std::map<std::string, int64_t> exported;  // mem handle -> allocation bytes
  std::vector<std::string> uuids;           // per device; empty: Uuid(device)
  int init_polls = 0;        // NcclCommReady says "in progress" this many times per comm
  int launch_polls = 0;      // ... and this many times after each collective (enqueueing)
  bool never_ready = false;  // communicators never finish initialising
  std::atomic<bool> streams_hang{false};  // the kernels of a collective hang until aborted
  int busy_after_abort = 0;  // ... and the streams stay busy this many looks after an abort
  bool kernels_survive_abort = false;  // ... or for good
  absl::Status async_error;            // not OK: NcclCommReady reports it once comms are ready
  /// mem handle -> (exporting process, its address of the allocation): opens of overlapping
  /// ranges of one process on one device are refused until closed (cudaErrorAlreadyMapped).
  std::map<std::string, std::pair<int, uint64_t>> exported_at;
  absl::Duration op_time = absl::ZeroDuration();       // how long a collective runs on its stream
  absl::Duration abort_blocks = absl::ZeroDuration();  // what ncclCommAbort takes itself
  absl::Duration free_wait_limit = absl::Seconds(3);   // bounds the fake's waits (no hang)
  absl::Duration dead_wait_limit = absl::Seconds(3);

  /// The process that exported `event` died before its record ran: the event never completes,
  /// and a stream that waits on it runs nothing after.
  void ExporterDied(gpu::Event event) {
    std::lock_guard<std::mutex> lock(mu_);
    dead_events_.insert(event);
  }
  /// Aborts whose free waited past free_wait_limit for another communicator's kernels.
  int FreesBlocked() { return UnderLock(frees_blocked); }
  /// Aborts that waited past dead_wait_limit for work behind a dead process's event.
  int AbortsBlocked() { return UnderLock(aborts_blocked); }
  /// Aborts that have returned.
  int AbortsDone() { return UnderLock(aborts_done); }
  /// Bootstrap roots (ncclGetUniqueId) still waiting for their ranks.
  int RootsOpen() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(open_roots_.size());
  }
  /// CUDA's initialisation does not answer while this is set: the first calls of the process
  /// (device count, attributes, handles) wait inside it, at most init_hang_limit each.
  std::atomic<bool> init_hangs{false};
  absl::Duration init_hang_limit = absl::Seconds(3);
  /// Calls that waited inside CUDA's initialisation.
  int InitWaits() { return UnderLock(init_waits_); }
  /// The threads that called ncclCommAbort.
  std::set<std::thread::id> AbortThreads() { return UnderLock(abort_threads_); }

  /// The collective (index into `calls`, -1: none) whose end `event`'s latest record marks.
  int recorded_for(gpu::Event event) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = events_.find(event);
    return it == events_.end() ? -1 : it->second.call;
  }
  int DestroyedEventUses() { return UnderLock(destroyed_event_uses); }
  int AlreadyMappedRefusals() { return UnderLock(already_mapped); }

  /// Sets async_error while other threads (a watchdog) may be polling.
  void SetAsyncError(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    async_error = std::move(s);
  }
  int Aborts() { return UnderLock(aborts); }
  int StreamsOpen() { return UnderLock(streams_open); }
  int EventsOpen() { return UnderLock(events_open); }
  int Closes() { return UnderLock(closes); }
  /// Whether a stream would report work still running now.
  bool StreamsBusy() {
    std::lock_guard<std::mutex> lock(mu_);
    return BusyLocked();
  }

  // ---- what happened ----
  std::map<std::pair<int, std::string>, std::byte*> mapped;
  std::map<std::pair<int, std::string>, int> map_refs;  // opens not yet closed, per mapping
  int opens = 0, closes = 0, events_open = 0, streams_open = 0, aborts = 0;
  int events_created = 0;        // by CreateEvent (the daemon's own)
  int closes_while_busy = 0;     // IPC mappings closed while a stream still ran kernels
  int destroyed_event_uses = 0;  // calls on an event after its DestroyEvent
  int already_mapped = 0;        // opens refused as overlapping a mapped allocation
  int frees_blocked = 0, aborts_blocked = 0, aborts_done = 0, double_revokes = 0;
  std::vector<int> call_devices;     // the current device at each NcclCollective
  std::vector<std::string> ids;      // unique id of every NcclCommInitRank
  std::vector<std::string> log;      // ordered calls on streams, events and NCCL
  std::vector<gpu::NcclCall> calls;  // every NcclCollective, in order, as it was called

  absl::StatusOr<int> DeviceCount() override {
    InitGate();
    if (!device_error.ok()) return device_error;
    return devices;
  }
  absl::StatusOr<bool> MpsEnabled(int device) override {
    InitGate();
    if (!device_error.ok()) return device_error;
    return device < mps_devices;
  }
  absl::StatusOr<std::string> DeviceUuid(int device) override {
    InitGate();
    if (!device_error.ok()) return device_error;
    if (device < 0 || device >= devices)
      return absl::InvalidArgumentError("invalid device ordinal");
    return uuids.empty() ? Uuid(device) : uuids.at(device);
  }
  /// The default UUID of device `d`: 16 bytes of 'A' + d.
  static std::string Uuid(int d) {
    return std::string(gpu::kUuidBytes, static_cast<char>('A' + d));
  }
  absl::StatusOr<void*> OpenMemHandle(int device, absl::string_view handle) override {
    InitGate();
    std::lock_guard<std::mutex> lock(mu_);
    if (!open_error.ok()) return open_error;
    const std::string h(handle);
    if (!exported.count(h)) return absl::InvalidArgumentError("invalid resource handle");
    if (auto at = exported_at.find(h); at != exported_at.end()) {
      const uint64_t begin = at->second.second, end = begin + exported.at(h);
      for (const auto& [key, base] : mapped) {
        auto other = exported_at.find(key.second);
        if (key.first != device || other == exported_at.end() ||
            other->second.first != at->second.first) {
          continue;
        }
        const uint64_t b = other->second.second, e = b + exported.at(key.second);
        if (b < end && begin < e) {
          ++already_mapped;
          return absl::AlreadyExistsError(
              "cudaIpcOpenMemHandle: cudaErrorAlreadyMapped (an overlapping allocation of the "
              "same process is mapped)");
        }
      }
    }
    ++opens;
    // A second open of a handle in the same context returns the same pointer, counted.
    if (mapped.count({device, h})) {
      ++map_refs[{device, h}];
      return mapped[{device, h}];
    }
    std::byte* base = reinterpret_cast<std::byte*>(0x7000'0000'0000) + (int64_t{opens} << 30);
    mapped[{device, h}] = base;
    map_refs[{device, h}] = 1;
    return base;
  }
  absl::Status CloseMemHandle(int device, void* base) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = mapped.begin(); it != mapped.end(); ++it) {
      if (it->first.first == device && it->second == base) {
        ++closes;
        if (BusyLocked()) ++closes_while_busy;
        log.push_back(absl::StrCat("close d", device, " ", Name(base)));
        if (--map_refs[it->first] == 0) {
          map_refs.erase(it->first);
          mapped.erase(it);
        }
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError("not mapped");
  }
  absl::StatusOr<int64_t> AllocationBytes(int device, void* base) override {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [key, b] : mapped) {
      if (key.first == device && b == base) return exported.at(key.second);
    }
    return absl::InvalidArgumentError("unknown base");
  }
  absl::StatusOr<gpu::Event> OpenEventHandle(int, absl::string_view) override {
    InitGate();
    std::lock_guard<std::mutex> lock(mu_);
    if (!event_error.ok()) return event_error;
    ++events_open;
    gpu::Event e = Handle(++next_);
    events_[e] = EventState{};
    return e;
  }
  absl::Status DestroyEvent(int, gpu::Event event) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = UsableLocked(event, "cudaEventDestroy"); !s.ok()) return s;
    --events_open;
    if (auto it = events_.find(event); it != events_.end()) it->second.destroyed = true;
    return absl::OkStatus();
  }
  absl::StatusOr<gpu::Stream> CreateStream(int device) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++streams_open;
    gpu::Stream s = Handle(++next_);
    log.push_back(absl::StrCat("stream d", device, " ", Name(s)));
    return s;
  }
  absl::Status DestroyStream(int, gpu::Stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    --streams_open;
    return absl::OkStatus();
  }
  absl::Status StreamWaitEvent(int, gpu::Stream stream, gpu::Event event) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = UsableLocked(event, "cudaStreamWaitEvent"); !s.ok()) return s;
    log.push_back(absl::StrCat("wait ", Name(stream), " ", Name(event)));
    if (dead_events_.count(event)) blocked_streams_.insert(stream);
    // Later work on the stream starts after the event's latest record, no earlier one.
    if (auto it = events_.find(event); it != events_.end()) {
      free_at_[stream] = std::max(free_at_[stream], it->second.at);
    }
    return absl::OkStatus();
  }
  absl::Status RecordEvent(int, gpu::Event event, gpu::Stream stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (absl::Status s = UsableLocked(event, "cudaEventRecord"); !s.ok()) return s;
    log.push_back(absl::StrCat("record ", Name(event), " ", Name(stream)));
    // The event now marks the stream's work so far, and nothing it marked before.
    EventState& e = events_[event];
    e.at = free_at_.count(stream) ? free_at_[stream] : absl::InfinitePast();
    e.call = last_call_.count(stream) ? last_call_[stream] : -1;
    e.stream = stream;
    return absl::OkStatus();
  }
  absl::StatusOr<bool> StreamDone(int, gpu::Stream stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    AdvanceLocked();
    if (auto it = free_at_.find(stream); it != free_at_.end() && absl::Now() < it->second) {
      return false;
    }
    if (!StreamBusyLocked(stream)) return true;
    if (aborted_ && busy_polls_ > 0) --busy_polls_;
    if (aborted_) log.push_back(absl::StrCat("busy ", Name(stream)));
    return false;
  }
  absl::StatusOr<gpu::Event> CreateEvent(int) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++events_open;
    ++events_created;
    gpu::Event e = Handle(++next_);
    events_[e] = EventState{};
    return e;
  }
  // Done once the work its latest record marks has run (op_time), and, with streams_hang,
  // when the hung kernels are gone.
  absl::StatusOr<bool> EventDone(int, gpu::Event event) override {
    std::lock_guard<std::mutex> lock(mu_);
    AdvanceLocked();
    if (absl::Status s = UsableLocked(event, "cudaEventQuery"); !s.ok()) return s;
    auto it = events_.find(event);
    if (it == events_.end() || it->second.stream == nullptr) {  // a trainer's (recorded there)
      log.push_back(absl::StrCat("query ", Name(event)));
    }
    if (dead_events_.count(event)) return false;  // its record never runs
    if (it != events_.end() && absl::Now() < it->second.at) return false;
    if (it == events_.end() || it->second.stream == nullptr) return true;
    return !StreamBusyLocked(it->second.stream);
  }
  absl::StatusOr<std::string> NcclUniqueId() override {
    std::lock_guard<std::mutex> lock(mu_);
    std::string id(gpu::kNcclUniqueIdBytes, static_cast<char>('A' + ids.size() % 26));
    id.replace(0, 8, absl::StrCat(absl::Hex(++roots_made_, absl::kZeroPad8)));
    open_roots_.insert(id);
    return id;
  }
  absl::StatusOr<gpu::Comm> NcclCommInitRank(int device, int nranks, absl::string_view id,
                                             int rank) override {
    std::lock_guard<std::mutex> lock(mu_);
    ids.emplace_back(id);
    gpu::Comm c = Handle(++next_);
    polls_[c] = init_polls;
    comm_device_[c] = device;
    comm_id_[c] = std::string(id);
    comm_rank_[c] = {rank, nranks};
    log.push_back(absl::StrCat("init ", Name(c), " d", device, " rank ", rank, "/", nranks));
    return c;
  }
  absl::StatusOr<bool> NcclCommReady(gpu::Comm comm) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (never_ready) return false;
    if (polls_[comm] > 0) {
      --polls_[comm];
      log.push_back(absl::StrCat("inprogress ", Name(comm)));
      return false;
    }
    if (!async_error.ok()) return async_error;
    if (revoked_.count(comm) && quiet_.insert(comm).second) return false;  // then quiescent
    open_roots_.erase(comm_id_[comm]);  // every rank checked in at the root
    return true;
  }
  absl::Status NcclCommAbort(gpu::Comm comm) override {
    int device = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++aborts;
      abort_threads_.insert(std::this_thread::get_id());
      log.push_back(absl::StrCat("abort ", Name(comm)));
      StopLocked(comm);
      device = comm_device_.count(comm) ? comm_device_[comm] : -1;
    }
    // NCCL's internal streams wait on the user stream: its kernels queued behind a dead
    // process's event never run, and the stream synchronisation waits for them.
    if (!WaitUntil(dead_wait_limit, [&]() {
          for (const Kernel& k : kernels_) {
            if (k.comm == comm && blocked_streams_.count(k.stream)) return false;
          }
          return true;
        })) {
      std::lock_guard<std::mutex> lock(mu_);
      ++aborts_blocked;
    }
    if (abort_blocks > absl::ZeroDuration()) absl::SleepFor(abort_blocks);
    // Frees device memory: waits for the device, other communicators' kernels included.
    if (!WaitUntil(free_wait_limit, [&]() {
          for (const Kernel& k : kernels_) {
            if (k.device == device && k.comm != comm && KernelRunsLocked(k)) return false;
          }
          return true;
        })) {
      std::lock_guard<std::mutex> lock(mu_);
      ++frees_blocked;
    }
    std::lock_guard<std::mutex> lock(mu_);
    ++aborts_done;
    log.push_back(absl::StrCat("aborted ", Name(comm)));
    return absl::OkStatus();
  }
  absl::Status NcclCommRevoke(gpu::Comm comm) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!revoked_.insert(comm).second) {
      ++double_revokes;
      return absl::InvalidArgumentError("ncclCommRevoke: communicator already revoked");
    }
    log.push_back(absl::StrCat("revoke ", Name(comm)));
    StopLocked(comm);
    return absl::OkStatus();
  }
  absl::Status NcclGroupStart() override {
    std::lock_guard<std::mutex> lock(mu_);
    log.push_back("group_start");
    return absl::OkStatus();
  }
  absl::Status NcclGroupEnd() override {
    std::lock_guard<std::mutex> lock(mu_);
    log.push_back("group_end");
    return absl::OkStatus();
  }
  absl::Status NcclCollective(const gpu::NcclCall& call) override {
    std::lock_guard<std::mutex> lock(mu_);
    log.push_back(absl::StrCat("coll", call.kind, " ", Name(call.comm), " ", Name(call.stream),
                               " n=", call.count, call.send == call.recv ? " inplace" : ""));
    calls.push_back(call);
    call_devices.push_back(call.device);
    last_call_[call.stream] = static_cast<int>(calls.size()) - 1;
    if (op_time > absl::ZeroDuration()) {  // in order on its stream, after what it waits on
      absl::Time& free = free_at_[call.stream];
      free = std::max(free, absl::Now()) + op_time;
    }
    polls_[call.comm] = launch_polls;
    aborted_ = false;  // new kernels, which hang (streams_hang) until their abort
    busy_polls_ = 0;
    // Kernels that have finished are forgotten; this one runs on its communicator's device.
    kernels_.erase(std::remove_if(kernels_.begin(), kernels_.end(),
                                  [this](const Kernel& k) { return !KernelRunsLocked(k); }),
                   kernels_.end());
    Kernel k;
    k.comm = call.comm;
    k.stream = call.stream;
    k.device = comm_device_.count(call.comm) ? comm_device_[call.comm] : call.device;
    if (fabric != nullptr) {
      k.on_fabric = true;
      k.id = comm_id_[call.comm];
      k.n = ++comm_ops_[call.comm];
      std::tie(k.rank, k.nranks) = comm_rank_[call.comm];
    }
    kernels_.push_back(std::move(k));
    return absl::OkStatus();
  }

  /// "e7": the short name of a fake handle.
  static std::string Name(void* h) {
    return absl::StrCat("h", reinterpret_cast<uintptr_t>(h) & 0xffff);
  }
  static void* Handle(uint64_t n) { return reinterpret_cast<void*>(0x5000'0000 + n); }

 private:
  struct Kernel {
    gpu::Comm comm = nullptr;
    gpu::Stream stream = nullptr;
    int device = -1;
    bool on_fabric = false;  // waits for its communicator's other ranks (FakeFabric)
    std::string id;
    uint64_t n = 0;
    int rank = 0, nranks = 1;
    bool finished = false;
  };
  // Whether kernel `k` still runs: hung on a peer until its communicator is stopped (or for
  // good, kernels_survive_abort), or never started behind a dead process's event.
  bool KernelRunsLocked(const Kernel& k) const {
    if (blocked_streams_.count(k.stream)) return true;
    if (k.on_fabric && !k.finished && !stopped_.count(k.comm)) return true;
    if (!streams_hang) return false;
    return !stopped_.count(k.comm) || kernels_survive_abort;
  }
  // The fabric's progress as this node sees it: on each device, the first kernel not finished
  // has started; it finishes once every rank of its communicator has started its own.
  void AdvanceLocked() {
    if (fabric == nullptr) return;
    std::lock_guard<std::mutex> lock(fabric->mu);
    std::set<int> blocked;  // devices whose first unfinished kernel waits
    for (Kernel& k : kernels_) {
      if (!k.on_fabric || k.finished || stopped_.count(k.comm) || blocked.count(k.device)) continue;
      std::set<int>& started = fabric->started[{k.id, k.n}];
      started.insert(k.rank);
      if (static_cast<int>(started.size()) >= k.nranks) {
        k.finished = true;
      } else {
        blocked.insert(k.device);
      }
    }
  }
  bool StreamBusyLocked(gpu::Stream stream) const {
    if (blocked_streams_.count(stream)) return true;
    for (const Kernel& k : kernels_) {
      if (k.stream == stream && KernelRunsLocked(k)) return true;
    }
    return aborted_ && busy_polls_ > 0;
  }
  bool BusyLocked() const {
    for (const Kernel& k : kernels_) {
      if (KernelRunsLocked(k)) return true;
    }
    return aborted_ && busy_polls_ > 0;
  }
  // The communicator's kernels return (its abort flag is up).
  void StopLocked(gpu::Comm comm) {
    bool hung = false;
    for (const Kernel& k : kernels_) hung = hung || (k.comm == comm && KernelRunsLocked(k));
    stopped_.insert(comm);
    if (hung && !aborted_) busy_polls_ = busy_after_abort;  // they stop, later
    aborted_ = aborted_ || hung;
  }
  // `field` read under the fake's lock (tests read what other threads change).
  template <typename T>
  T UnderLock(const T& field) {
    std::lock_guard<std::mutex> lock(mu_);
    return field;
  }
  // A call that waits while CUDA's initialisation does not answer (bounded: a test never hangs).
  void InitGate() {
    if (!init_hangs) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++init_waits_;
    }
    const absl::Time give_up = absl::Now() + init_hang_limit;
    while (init_hangs && absl::Now() < give_up) absl::SleepFor(absl::Milliseconds(1));
  }
  // Polls `done` (under the lock) until it holds or `limit` passes; whether it held.
  bool WaitUntil(absl::Duration limit, const std::function<bool()>& done) {
    const absl::Time give_up = absl::Now() + limit;
    while (true) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (done()) return true;
      }
      if (absl::Now() > give_up) return false;
      absl::SleepFor(absl::Milliseconds(1));
    }
  }

  // An event the fake handed out (OpenEventHandle, CreateEvent): what its latest record marks.
  struct EventState {
    absl::Time at = absl::InfinitePast();  // when the work before the record has run
    int call = -1;                         // the last collective before it on its stream
    gpu::Stream stream = nullptr;          // where it was last recorded (null: by a trainer)
    bool destroyed = false;
  };
  // An error for a destroyed event; events the fake never handed out pass (tests name some).
  absl::Status UsableLocked(gpu::Event event, absl::string_view call) {
    auto it = events_.find(event);
    if (it == events_.end() || !it->second.destroyed) return absl::OkStatus();
    ++destroyed_event_uses;
    return absl::InvalidArgumentError(
        absl::StrCat(call, ": invalid resource handle (event ", Name(event), " was destroyed)"));
  }

  std::mutex mu_;
  std::map<gpu::Event, EventState> events_;
  std::map<gpu::Stream, absl::Time> free_at_;  // when each stream's work so far has run
  std::map<gpu::Stream, int> last_call_;       // the last collective put on each stream
  bool aborted_ = false;                       // an abort came after the last collective
  int busy_polls_ = 0;  // looks at the streams left before the aborted kernels are gone
  uint64_t next_ = 0;
  std::map<gpu::Comm, int> polls_;
  std::shared_ptr<FakeFabric> fabric;
  std::map<gpu::Comm, int> comm_device_;
  std::map<gpu::Comm, std::string> comm_id_;
  std::map<gpu::Comm, std::pair<int, int>> comm_rank_;  // (rank, nranks)
  std::map<gpu::Comm, uint64_t> comm_ops_;
  std::set<gpu::Comm> stopped_, revoked_, quiet_;
  std::set<gpu::Event> dead_events_;
  std::set<gpu::Stream> blocked_streams_;
  std::vector<Kernel> kernels_;
  std::set<std::string> open_roots_;
  uint64_t roots_made_ = 0;
  std::set<std::thread::id> abort_threads_;
  int init_waits_ = 0;
};

}  // namespace gradsync::testing
