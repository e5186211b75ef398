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

#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/gpu/gpu_api.h"

namespace gradsync::testing {

class FakeGpu final : public gpu::GpuApi {
 public:
  // ---- knobs ----
  int devices = 2;
  absl::Status device_error;                // not OK: DeviceCount fails (no driver)
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
  std::vector<std::string> ids;      // unique id of every NcclCommInitRank
  std::vector<std::string> log;      // ordered calls on streams, events and NCCL
  std::vector<gpu::NcclCall> calls;  // every NcclCollective, in order, as it was called

  absl::StatusOr<int> DeviceCount() override {
    if (!device_error.ok()) return device_error;
    return devices;
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
    return Handle(++next_);
  }
  absl::Status DestroyEvent(int, gpu::Event) override {
    std::lock_guard<std::mutex> lock(mu_);
    --events_open;
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
    log.push_back(absl::StrCat("wait ", Name(stream), " ", Name(event)));
    return absl::OkStatus();
  }
  absl::Status RecordEvent(int, gpu::Event event, gpu::Stream stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    log.push_back(absl::StrCat("record ", Name(event), " ", Name(stream)));
    return absl::OkStatus();
  }
  absl::StatusOr<bool> StreamDone(int, gpu::Stream stream) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!BusyLocked()) return true;
    if (aborted_ && busy_polls_ > 0) --busy_polls_;
    if (aborted_) log.push_back(absl::StrCat("busy ", Name(stream)));
    return false;
  }
  absl::StatusOr<gpu::Event> CreateEvent(int) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++events_open;
    ++events_created;
    return Handle(++next_);
  }
  // The fake's streams finish their work all at once: an event is done when they are.
  absl::StatusOr<bool> EventDone(int, gpu::Event) override {
    std::lock_guard<std::mutex> lock(mu_);
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

  std::mutex mu_;
  bool aborted_ = false;  // an abort came after the last collective
  int busy_polls_ = 0;    // looks at the streams left before the aborted kernels are gone
  uint64_t next_ = 0;
  std::map<gpu::Comm, int> polls_;
};

}  // namespace gradsync::testing
