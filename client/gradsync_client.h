#pragma once

// The C++ client library: a trainer's session with its node's gradsyncd, its registered buffers
// (shared memory or CUDA), and its ops in flight.

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/store_client.h"
#include "common/doorbell.h"
#include "common/dtype.h"
#include "gradsync/v1/gradsync.grpc.pb.h"

namespace gradsync::client {

/// Where a trainer sits in its job.
struct Placement {
  std::string job;
  int world_size = 1;
  int rank = 0;
  int local_rank = 0;
  int local_world_size = 1;
  /// Jobs spanning nodes: "host:port" of the daemon on rank 0's node (its TCP listener).
  std::string root_address;
  /// An elastic job (RegisterRequest.elastic), at membership `epoch` (its id then ends
  /// ".e<epoch>", see ElasticJobId).
  bool elastic = false;
  int epoch = 0;
};

/// `count` elements starting `byte_offset` bytes into a registered buffer. An op may name
/// segments of count 0, or none: it then runs on every rank in order, and writes nothing.
struct Segment {
  uint64_t buffer_id = 0;
  int64_t byte_offset = 0;
  int64_t count = 0;
};

struct OpOptions {
  std::string group = "world";                    // or member ranks ascending joined by ","
  std::string name;                               // part of the fingerprint every rank must match
  absl::Duration timeout = absl::ZeroDuration();  // zero: the daemon's default
};

/// A POSIX shared-memory region this process created, mapped here and registered with the
/// daemon. The name is unlinked as soon as the daemon has mapped it, so nothing is left behind
/// in /dev/shm whatever happens to either process. Destroy it with Client::DestroyBuffer (or
/// just drop it: the daemon unmaps its side when the session ends).
class SharedBuffer {
 public:
  ~SharedBuffer();
  SharedBuffer(const SharedBuffer&) = delete;
  SharedBuffer& operator=(const SharedBuffer&) = delete;

  std::byte* data() const { return data_; }
  int64_t size() const { return size_; }
  uint64_t id() const { return id_; }
  DType dtype() const { return dtype_; }
  /// The whole buffer as one segment of `count` elements of its dtype (or of `element_bytes`).
  Segment Whole(int64_t element_bytes) const { return {id_, 0, size_ / element_bytes}; }

 private:
  friend class Client;
  SharedBuffer(std::byte* data, int64_t size, DType dtype)
      : data_(data), size_(size), dtype_(dtype) {}
  std::byte* const data_;
  const int64_t size_;
  const DType dtype_;
  uint64_t id_ = 0;
};

/// A CUDA device buffer of this process registered with the daemon (GPU nodes), exported the
/// way PyTorch shares caching-allocator blocks: the IPC handle of the allocation it lies in,
/// its offset there, and two interprocess events. The memory stays the caller's; it must stay
/// allocated while registered. Ops name it like any buffer ({id(), byte_offset, count}).
/// An event stands for its latest record, so a registration serves one group's ops at a time
/// (they run in order on one daemon stream): the daemon refuses (FAILED_PRECONDITION) an op
/// naming it while a not yet completed op of another group names it. Ops of other groups that
/// may overlap on the same memory each take a registration of their own (register it again:
/// the daemon maps the allocation once).
class CudaBuffer {
 public:
  ~CudaBuffer();  // destroys the events: deregister first (Client::DestroyCudaBuffer does),
                  // once the buffer's ops completed (the daemon then has closed its handles)
  CudaBuffer(const CudaBuffer&) = delete;
  CudaBuffer& operator=(const CudaBuffer&) = delete;

  uint64_t id() const { return id_; }
  void* data() const { return data_; }
  int64_t size() const { return size_; }
  int device() const { return device_; }
  /// The daemon's next op on the buffer starts after `stream`'s work so far (records "ready").
  /// Call it before submitting the op. `stream` is a cudaStream_t (null: the legacy stream of
  /// the buffer's device). The caller's current device is left as it was.
  absl::Status Ready(void* stream = nullptr);
  /// `stream`'s later work waits for the daemon's last write of the buffer ("done"). An op's
  /// Wait() returning OK means the write is enqueued on the daemon's stream; call this (or
  /// synchronise) before reading the result on the device, and before the buffer's next op
  /// (whose "done" replaces this one's).
  absl::Status WaitDone(void* stream = nullptr);

 private:
  friend class Client;
  CudaBuffer() = default;
  uint64_t id_ = 0;
  void* data_ = nullptr;
  int64_t size_ = 0;
  int device_ = -1;
  void* ready_ = nullptr;  // cudaEvent_t
  void* done_ = nullptr;
};

/// The CUDA allocation a device pointer lies in, as the driver reports it (no daemon call).
struct CudaAllocation {
  /// Unique among this process's allocations for its whole life (never reused after a free):
  /// what a cache of registrations keys on. 0: `ptr` is no CUDA allocation (or it was freed).
  uint64_t id = 0;
  uintptr_t base = 0;
  int64_t bytes = 0;
  int device = -1;
  /// cudaIpcGetMemHandle can export it (false for cuMemCreate memory, e.g. PyTorch's
  /// expandable segments): RegisterCudaBuffer would fail on it.
  bool ipc_capable = false;
};
/// Two driver calls (cuPointerGetAttributes, cuMemGetAddressRange, reached through the runtime:
/// no libcuda link); no synchronisation. FAILED_PRECONDITION in a build without CUDA or without
/// a driver.
absl::StatusOr<CudaAllocation> CudaAllocationOf(const void* ptr);

class Client;

/// The daemon's fd channel (daemon/ipc/fd_channel.h) from the trainer's side. Client uses these;
/// they are public for tools and tests that speak the wire directly.
/// Connects to `path` ("<socket>.fd"); returns the connected socket (the caller closes it).
absl::StatusOr<int> ConnectFdChannel(const std::string& path);
/// Sends `fd` on a connected channel socket; returns the one-time token the daemon answered.
absl::StatusOr<std::string> SendFd(int sock, int fd, absl::Time deadline);

/// An op in flight: a future. Waiting drives the connection on the caller's thread (no
/// background thread, no hand-off), so many ops can be in flight while the caller computes.
/// Thread-safe; copyable (copies share the outcome).
class Op {
 public:
  Op() = default;
  /// Blocks until the daemon answers: the op's deadline plus a margin at most (then
  /// DEADLINE_EXCEEDED "no answer from gradsyncd"). Returns the same status every time.
  absl::Status Wait();
  /// Waits at most `slice` (never past the op's deadline plus margin, as Wait). True once
  /// answered or once that deadline has passed, with `*status` what Wait() returns; false while
  /// the op is still pending. Lets a caller wake up regularly (Python handles signals between).
  bool WaitFor(absl::Duration slice, absl::Status* status);
  /// True once answered; never blocks.
  bool Done();
  /// This rank's sequence number of the op on its group (valid once done).
  uint64_t seq();

 private:
  friend class Client;
  struct State;
  Op(Client* client, std::shared_ptr<State> state) : client_(client), state_(std::move(state)) {}
  Client* client_ = nullptr;
  std::shared_ptr<State> state_;
};

/// A trainer's session with its node's gradsyncd: one long-lived stream, so the daemon knows at
/// once when this process dies. Thread-safe. The Client must outlive its Ops and buffers.
class Client {
 public:
  /// Connects to `target` (unix socket path, "unix:path" or host:port) and registers.
  /// Registration refusals come back as the daemon's status (ALREADY_EXISTS, ...).
  static absl::StatusOr<std::unique_ptr<Client>> Connect(absl::string_view target,
                                                         const Placement& placement,
                                                         ClientOptions options = {});
  /// Ends the session: waits at most rpc_timeout for the daemon to acknowledge, then cancels
  /// the stream (a stopped or stuck daemon cannot hold it longer). Every call and Op::Wait on
  /// the client must have returned; ops still unanswered end UNAVAILABLE "client closed".
  ~Client();

  /// Creates `bytes` of shared memory, maps it and registers it. `dtype` UNSPECIFIED: any op
  /// dtype; otherwise ops on the buffer must use it.
  absl::StatusOr<std::unique_ptr<SharedBuffer>> CreateBuffer(int64_t bytes,
                                                             DType dtype = v1::DTYPE_UNSPECIFIED);
  /// Deregisters a buffer from the daemon (ops already submitted keep it until they finish).
  absl::Status DestroyBuffer(std::unique_ptr<SharedBuffer> buffer);
  /// Registers `bytes` of device memory at `device_ptr` (GPU nodes; FAILED_PRECONDITION in a
  /// build without CUDA or where CUDA cannot run).
  absl::StatusOr<std::unique_ptr<CudaBuffer>> RegisterCudaBuffer(
      void* device_ptr, int64_t bytes, DType dtype = v1::DTYPE_UNSPECIFIED);
  absl::Status DestroyCudaBuffer(std::unique_ptr<CudaBuffer> buffer);
  /// Hands `fd` (a memfd sealed with F_SEAL_SHRINK; the caller keeps its own copy) to the
  /// daemon over its fd channel and returns the one-time token to register it under
  /// (RegisterBufferRequest.fd_token). Unix-socket sessions only.
  absl::StatusOr<std::string> ShareFd(int fd);
  /// Registers memory as the request states it (fd_token from ShareFd, or CUDA IPC), for
  /// callers that manage their own memory.
  absl::StatusOr<uint64_t> RegisterBuffer(const v1::RegisterBufferRequest& request);
  absl::Status DeregisterBuffer(uint64_t buffer_id);
  /// Waits until every device op of this session has settled on the device: OK, or the failure
  /// of one answered OK that failed on the device afterwards (ABORTED, reported once). At most
  /// the default op timeout (and rpc_timeout).
  absl::Status Settle();

  Op AllReduceAsync(DType dtype, v1::ReduceOp op, std::vector<Segment> data,
                    const OpOptions& options = {});
  Op BroadcastAsync(DType dtype, int root, std::vector<Segment> data,
                    const OpOptions& options = {});
  Op BarrierAsync(const OpOptions& options = {});
  Op AllGatherAsync(DType dtype, std::vector<Segment> input, std::vector<Segment> output,
                    const OpOptions& options = {});
  Op ReduceScatterAsync(DType dtype, v1::ReduceOp op, std::vector<Segment> input,
                        std::vector<Segment> output, const OpOptions& options = {});
  /// Any op, as the wire states it.
  Op Submit(const v1::OpRequest& request);

  absl::Status AllReduce(DType dtype, v1::ReduceOp op, std::vector<Segment> data,
                         const OpOptions& options = {}) {
    return AllReduceAsync(dtype, op, std::move(data), options).Wait();
  }
  absl::Status Broadcast(DType dtype, int root, std::vector<Segment> data,
                         const OpOptions& options = {}) {
    return BroadcastAsync(dtype, root, std::move(data), options).Wait();
  }
  absl::Status Barrier(const OpOptions& options = {}) { return BarrierAsync(options).Wait(); }

  const Placement& placement() const { return placement_; }
  absl::Duration default_op_timeout() const { return default_op_timeout_; }

 private:
  friend class Op;
  // Completion-queue tags: the stream's operations, at most one of each in flight.
  enum Tag : intptr_t { kStart = 1, kWrite, kRead, kWritesDone, kFinish };
  static constexpr uint32_t TagBit(intptr_t tag) { return 1u << static_cast<uint32_t>(tag); }

  Client(Placement placement, ClientOptions options);
  absl::Status Open(absl::string_view target);
  // Queues a request; the returned state completes when its event arrives.
  std::shared_ptr<Op::State> Send(v1::TrainerRequest request, absl::Duration answer_within);
  // An op through the doorbell ring (waits while the ring is full).
  std::shared_ptr<Op::State> Ring(v1::TrainerRequest request, absl::Duration answer_within);
  // Creates and maps the doorbell region and shares it; returns its fd token.
  absl::StatusOr<std::string> CreateDoorbell();
  // Takes every completion off the ring.
  void DrainRingLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A non-blocking look at the stream (a broken session fails the ring's ops too); mu_ is
  // released while polling.
  void CheckStreamLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drives the stream until `state` completes or `deadline` passes.
  absl::Status Await(Op::State& state, absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // DEADLINE_EXCEEDED for an op not answered by `deadline`; once the op's own deadline (plus
  // margin) has passed, that is its outcome for good.
  absl::Status GiveUpLocked(Op::State& state) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool Poll(Op::State& state) ABSL_LOCKS_EXCLUDED(mu_);
  // One completion-queue event, waited for until `deadline` (in the past: only those already
  // there). mu_ is released while waiting; the caller checked !driving_.
  grpc::CompletionQueue::NextStatus DriveOnceLocked(absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drives (or waits for the thread that does) until `done` (called with mu_ held) or
  // `deadline`; false at the deadline. mu_ is released while waiting.
  bool DriveUntilLocked(const std::function<bool()>& done, absl::Time deadline)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One completion-queue event. Issues the next read/write.
  void HandleLocked(intptr_t tag, bool ok) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one place a stream operation starts. False, and nothing started, once the queue is shut
  // down, while the same operation is in flight, or where gRPC forbids it (a write beside
  // another or after WritesDone, Finish twice).
  bool StartLocked(Tag tag) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool InFlightLocked(Tag tag) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return (in_flight_ & TagBit(tag)) != 0;
  }
  void StartWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void BreakLocked(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<v1::TrainerEvent> Call(v1::TrainerRequest request);

  const Placement placement_;
  const ClientOptions options_;
  absl::Duration default_op_timeout_ = absl::Minutes(5);
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::GradSync::Stub> stub_;
  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::ClientAsyncReaderWriter<v1::TrainerRequest, v1::TrainerEvent>> stream_;

  // Also guards every Op::State of this client (which cannot say so: a State does not know it).
  absl::Mutex mu_;
  absl::CondVar cv_;                           // a driver handled an event, or stopped driving
  bool driving_ ABSL_GUARDED_BY(mu_) = false;  // a thread is inside cq_.AsyncNext
  std::deque<v1::TrainerRequest> writes_ ABSL_GUARDED_BY(mu_);  // front is being written
  uint32_t in_flight_ ABSL_GUARDED_BY(mu_) = 0;        // TagBit of each operation in flight
  bool queue_shut_down_ ABSL_GUARDED_BY(mu_) = false;  // cq_.Shutdown() is next: start nothing
  bool started_ ABSL_GUARDED_BY(mu_) = false;          // the call reached the daemon
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;      // WritesDone started: no more writes
  bool finish_started_ ABSL_GUARDED_BY(mu_) = false;   // Finish is called once
  v1::TrainerEvent event_ ABSL_GUARDED_BY(mu_);        // the read in flight
  grpc::Status finish_status_ ABSL_GUARDED_BY(mu_);
  absl::Status broken_ ABSL_GUARDED_BY(mu_);  // once not OK, every op fails with it
  uint64_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Op::State>> pending_ ABSL_GUARDED_BY(mu_);

  std::string fd_channel_path_;  // "<socket>.fd" for unix-socket targets, else empty
  absl::Mutex fd_mu_;            // one ShareFd at a time on fd_sock_; never with mu_ held
  int fd_sock_ ABSL_GUARDED_BY(fd_mu_) = -1;  // connection to the fd channel, opened on first use

  std::byte* doorbell_base_ = nullptr;  // mapped for the client's life
  // Set once, before the session starts; the ring's consumer side (Next) runs under mu_.
  std::unique_ptr<doorbell::Doorbell> doorbell_;
  // Ops sent by the ring and not yet completed (<= kCompletionSlots).
  int ring_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gradsync::client
