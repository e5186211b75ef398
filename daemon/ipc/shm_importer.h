#pragma once

#include "daemon/core/buffer_importer.h"

namespace gradsync::ipc {

/// Maps POSIX shared-memory objects (shm_open names) read-write. Stateless and thread-safe.
class ShmImporter final : public core::BufferImporter {
 public:
  absl::StatusOr<std::unique_ptr<core::MappedBuffer>> Import(
      const v1::RegisterBufferRequest& request) override;
};

}  // namespace gradsync::ipc
