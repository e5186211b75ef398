#pragma once

// A fake GpuApi for unit tests of the GPU data plane on machines without a GPU: IPC mappings of
// "exported" allocations, events, streams and NCCL communicators, with every call that orders
// work logged ("wait s0 e1", "allreduce c2 s0 n=16", "close d0 h3", ...) and failures injectable.
//
// Streams model kernels that wait on peers: with streams_hang set, a collective's kernels never
// finish until ncclCommAbort stops them; after an abort they may stay busy a while longer
// (busy_after_abort) or for good (kernels_survive_abort), as the real ones do while NCCL's
// abort finishes in the background. IPC mappings are reference-counted per (device, handle),
// as cudaIpcOpenMemHandle's are within one context.
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
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::testing {

class FakeGpu final : public gpu::GpuApi {
 public:
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
  absl::Duration op_time = absl::ZeroDuration();  // how long a collective runs on its stream

  /// The collective (index into `calls`, -1: none) whose end `event`'s latest record marks.
  int recorded_for(gpu::Event event) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = events_.find(event);
    return it == events_.end() ? -1 : it->second.call;
  }
  int DestroyedEventUses() {
    std::lock_guard<std::mutex> lock(mu_);
    return destroyed_event_uses;
  }
  int AlreadyMappedRefusals() {
    std::lock_guard<std::mutex> lock(mu_);
    return already_mapped;
  }

  /// Sets async_error while other threads (a watchdog) may be polling.
  void SetAsyncError(absl::Status s) {
    std::lock_guard<std::mutex> lock(mu_);
    async_error = std::move(s);
  }
  int Aborts() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborts;
  }
  int StreamsOpen() {
    std::lock_guard<std::mutex> lock(mu_);
    return streams_open;
  }
  int EventsOpen() {
    std::lock_guard<std::mutex> lock(mu_);
    return events_open;
  }
  int Closes() {
    std::lock_guard<std::mutex> lock(mu_);
    return closes;
  }
  /// Whether a stream would report work still running now.
  bool StreamsBusy() {
    std::lock_guard<std::mutex> lock(mu_);
    return BusyLocked();
  }

  // ---- what happened ----
  std::map<std::pair<int, std::string>, std::byte*> mapped;
  std::map<std::pair<int, std::string>, int> map_refs;  // opens not yet closed, per mapping
  int opens = 0, closes = 0, events_open = 0, streams_open = 0, aborts = 0;
  int events_created = 0;            // by CreateEvent (the daemon's own)
  int closes_while_busy = 0;         // IPC mappings closed while a stream still ran kernels
  int destroyed_event_uses = 0;      // calls on an event after its DestroyEvent
  int already_mapped = 0;            // opens refused as overlapping a mapped allocation
  std::vector<int> call_devices;     // the current device at each NcclCollective
  std::vector<std::string> ids;      // unique id of every NcclCommInitRank
  std::vector<std::string> log;      // ordered calls on streams, events and NCCL
  std::vector<gpu::NcclCall> calls;  // every NcclCollective, in order, as it was called

  absl::StatusOr<int> DeviceCount() override {
    if (!device_error.ok()) return device_error;
    return devices;
  }
  absl::StatusOr<bool> MpsEnabled(int device) override {
    if (!device_error.ok()) return device_error;
    return device < mps_devices;
  }
  absl::StatusOr<std::string> DeviceUuid(int device) override {
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
    return absl::OkStatus();
  }
  absl::StatusOr<bool> StreamDone(int, gpu::Stream stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = free_at_.find(stream); it != free_at_.end() && absl::Now() < it->second) {
      return false;
    }
    if (!BusyLocked()) return true;
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
    if (absl::Status s = UsableLocked(event, "cudaEventQuery"); !s.ok()) return s;
    if (auto it = events_.find(event); it != events_.end() && absl::Now() < it->second.at) {
      return false;
    }
    return !BusyLocked();
  }
  absl::StatusOr<std::string> NcclUniqueId() override {
    std::lock_guard<std::mutex> lock(mu_);
    return std::string(gpu::kNcclUniqueIdBytes, static_cast<char>('A' + ids.size() % 26));
  }
  absl::StatusOr<gpu::Comm> NcclCommInitRank(int device, int nranks, absl::string_view id,
                                             int rank) override {
    std::lock_guard<std::mutex> lock(mu_);
    ids.emplace_back(id);
    gpu::Comm c = Handle(++next_);
    polls_[c] = init_polls;
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
    return true;
  }
  absl::Status NcclCommAbort(gpu::Comm comm) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++aborts;
    log.push_back(absl::StrCat("abort ", Name(comm)));
    if (!aborted_ && streams_hang) busy_polls_ = busy_after_abort;  // hung kernels stop, later
    aborted_ = true;
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
    aborted_ = false;  // new kernels, which hang (streams_hang) until the next abort
    busy_polls_ = 0;
    return absl::OkStatus();
  }

  /// "e7": the short name of a fake handle.
  static std::string Name(void* h) {
    return absl::StrCat("h", reinterpret_cast<uintptr_t>(h) & 0xffff);
  }
  static void* Handle(uint64_t n) { return reinterpret_cast<void*>(0x5000'0000 + n); }

 private:
  bool BusyLocked() const {
    if (!aborted_) return streams_hang;
    return (streams_hang && kernels_survive_abort) || busy_polls_ > 0;
  }

  // An event the fake handed out (OpenEventHandle, CreateEvent): what its latest record marks.
  struct EventState {
    absl::Time at = absl::InfinitePast();  // when the work before the record has run
    int call = -1;                         // the last collective before it on its stream
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
};

}  // namespace gradsync::testing
