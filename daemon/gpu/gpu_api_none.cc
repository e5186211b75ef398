// GpuApi of a daemon built without CUDA: every call says so.
#include "daemon/gpu/gpu_api.h"

namespace gradsync::gpu {
namespace {

absl::Status NoCuda() {
  return absl::FailedPreconditionError("gradsyncd was built without CUDA (GRADSYNC_WITH_CUDA)");
}

class NoGpuApi final : public GpuApi {
 public:
  absl::StatusOr<int> DeviceCount() override { return NoCuda(); }
  absl::StatusOr<bool> MpsEnabled(int) override { return NoCuda(); }
  absl::StatusOr<std::string> DeviceUuid(int) override { return NoCuda(); }
  absl::StatusOr<void*> OpenMemHandle(int, absl::string_view) override { return NoCuda(); }
  absl::Status CloseMemHandle(int, void*) override { return NoCuda(); }
  absl::StatusOr<int64_t> AllocationBytes(int, void*) override { return NoCuda(); }
  absl::StatusOr<Event> OpenEventHandle(int, absl::string_view) override { return NoCuda(); }
  absl::Status DestroyEvent(int, Event) override { return NoCuda(); }
  absl::StatusOr<Stream> CreateStream(int) override { return NoCuda(); }
  absl::Status DestroyStream(int, Stream) override { return NoCuda(); }
  absl::Status StreamWaitEvent(int, Stream, Event) override { return NoCuda(); }
  absl::Status RecordEvent(int, Event, Stream) override { return NoCuda(); }
  absl::StatusOr<bool> StreamDone(int, Stream) override { return NoCuda(); }
  absl::StatusOr<Event> CreateEvent(int) override { return NoCuda(); }
  absl::StatusOr<bool> EventDone(int, Event) override { return NoCuda(); }
  absl::StatusOr<std::string> NcclUniqueId() override { return NoCuda(); }
  absl::StatusOr<Comm> NcclCommInitRank(int, int, absl::string_view, int) override {
    return NoCuda();
  }
  absl::StatusOr<bool> NcclCommReady(Comm) override { return NoCuda(); }
  absl::Status NcclCommAbort(Comm) override { return NoCuda(); }
  absl::Status NcclCommRevoke(Comm) override { return NoCuda(); }
  absl::Status NcclGroupStart() override { return NoCuda(); }
  absl::Status NcclGroupEnd() override { return NoCuda(); }
  absl::Status NcclCollective(const NcclCall&) override { return NoCuda(); }
};

}  // namespace

std::unique_ptr<GpuApi> NewGpuApi(BrokenHandler) { return std::make_unique<NoGpuApi>(); }

}  // namespace gradsync::gpu
