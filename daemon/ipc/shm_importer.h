#pragma once

// Maps trainers' shared memory (sealed memfds redeemed from the fd channel) into the daemon,
// within node-wide mapping limits.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/synchronization/mutex.h"
#include "daemon/core/buffer_importer.h"
#include "daemon/ipc/fd_channel.h"

namespace gradsync::ipc {

/// What the daemon maps of trainers' shared memory, node-wide (buffers and doorbells of every
/// session). Mappings count against the kernel's vm.max_map_count (65530 by default), which
/// the daemon's own threads and libraries need too; mapped bytes are address space and page
/// tables. The defaults leave 5,530 of the kernel's default map count to the daemon, and let
/// it map as many bytes as the node has memory: trainers' shared memory lives in RAM, so honest
/// trainers, each mapping its own buffers once, stay below it.
struct MappingLimits {
  int64_t max_mappings = 60000;
  int64_t max_mapped_bytes = 0;  // 0: the node's physical memory
};

/// Maps trainers' shared memory read-write: memfds sealed against shrinking (F_SEAL_SHRINK),
/// redeemed from the fd channel by their one-time token (RegisterBufferRequest.fd_token); never
/// an object by name, nor one that could shrink under the mapping. Within `limits`: past either
/// one, RESOURCE_EXHAUSTED naming the flag (--max_mappings, --max_mapped_bytes), mapping
/// nothing. A mapping gives its share back when destroyed, even after the importer is gone.
/// Thread-safe.
class ShmImporter final : public core::BufferImporter {
 public:
  explicit ShmImporter(MappingLimits limits = {});

  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> Import(
      const v1::RegisterBufferRequest& request) override;
  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ImportDoorbell(const std::string& fd_token,
                                                                     int64_t bytes) override;

  /// The channel descriptors are redeemed from; set before serving, outlives the importer's use.
  void set_fd_channel(FdChannel* channel) { channel_.store(channel); }

  /// What is mapped now.
  int64_t mappings() const { return usage_->mappings.load(); }
  int64_t mapped_bytes() const { return usage_->bytes.load(); }

  struct Usage {
    std::atomic<int64_t> mappings{0};
    std::atomic<int64_t> bytes{0};
    // Live mappings per memory object (st_dev, st_ino): as data buffers, as doorbells.
    absl::Mutex mu;
    absl::flat_hash_map<std::pair<uint64_t, uint64_t>, std::pair<int, int>> objects
        ABSL_GUARDED_BY(mu);
  };

 private:
  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> ImportFd(
      const v1::RegisterBufferRequest& request, bool doorbell);

  const MappingLimits limits_;
  const std::shared_ptr<Usage> usage_;
  std::atomic<FdChannel*> channel_{nullptr};
};

}  // namespace gradsync::ipc
