// What the engine remembers and shows about its ops: each group's ring of finished ops (written
// here, read by Engine::GetHistory), and, in inspect.cc, Engine::ListOps, GetHistory, GetTotals
// and the stall warnings (Engine::SweepStalls).
#pragma once

#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/core/job.h"

namespace gradsync::core {

struct EngineOptions;

namespace internal {

/// Notes an op that finished on this node (ran, or failed before running: `started` is
/// InfinitePast) in its group's history ring and in the options' counters.
void NoteFinished(Group& group, const EngineOptions& options, uint64_t seq, const Fingerprint& fp,
                  Plane plane, int64_t bytes, absl::Time queued, absl::Time started,
                  absl::Time finished, const absl::Status& status)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(group.job->mu);

}  // namespace internal
}  // namespace gradsync::core
