// The core's seam to trainer memory: a handle (shm, memfd, CUDA IPC) imported once into a
// MappedBuffer the core keeps alive while ops use it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core {

/// A trainer's buffer mapped into the daemon. Unmapped when destroyed; the core keeps it alive
/// (shared) while any op that refers to it runs, so a deregistration never pulls memory from
/// under a collective.
class MappedBuffer {
 public:
  virtual ~MappedBuffer() = default;
  virtual std::byte* data() const = 0;
  virtual int64_t size() const = 0;
  /// "shm:/gradsync-1234-0 bytes=4096" for logs and errors.
  virtual std::string Describe() const = 0;
  /// CUDA device ordinal of device memory; -1 for host memory (data() is then CPU-addressable).
  virtual int device() const { return -1; }
  /// Device buffers: the trainer's "ready" event (the daemon's stream waits on it before
  /// reading) and "done" event (recorded after writing; the trainer's stream waits on it).
  /// Null once ReleaseEvents ran.
  virtual void* ready_event() const { return nullptr; }
  virtual void* done_event() const { return nullptr; }
  /// Device buffers: closes the daemon's handles of the two events now, though the mapping may
  /// live on (ops launched on it hold it until they settle; their calls on the events are
  /// enqueued by then). The engine calls it once no op that may still use the events is in
  /// flight and the buffer was deregistered (or its session ended): from then on the trainer
  /// may destroy the events it exported. Idempotent.
  virtual void ReleaseEvents() {}
};

/// Turns a handle a trainer sent (a shared-memory descriptor's token; a CUDA IPC handle on GPU
/// nodes) into a mapping. Thread-safe. Errors: NOT_FOUND (no such object), FAILED_PRECONDITION
/// (too small, not accessible), INVALID_ARGUMENT (malformed handle).
class BufferImporter {
 public:
  virtual ~BufferImporter() = default;
  virtual absl::StatusOr<std::unique_ptr<MappedBuffer>> Import(
      const v1::RegisterBufferRequest& request) = 0;
  /// A session's doorbell region: `bytes` of shared memory handed over under `fd_token`. The
  /// same memory is never both a doorbell and a data buffer (a trainer could otherwise have the
  /// daemon write collective results into its ring). UNIMPLEMENTED where there are none.
  virtual absl::StatusOr<std::unique_ptr<MappedBuffer>> ImportDoorbell(const std::string& fd_token,
                                                                       int64_t bytes) {
    (void)fd_token;
    (void)bytes;
    return absl::UnimplementedError("this importer maps no doorbells");
  }
};

}  // namespace gradsync::core
