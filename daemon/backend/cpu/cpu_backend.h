#pragma once

// The CPU data plane: creates each group's communicator, local for a single-node group and
// over TCP links between the daemons for a group that spans nodes; its tuning.

#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/worker_pool.h"
#include "daemon/core/backend.h"

namespace gradsync::backend::cpu {

class LinkPark;

/// The CPU data plane's tuning: gradsyncd's --cpu_* flags (config.cc), logged at start. The
/// defaults were chosen by measurement; the flags are for benchmarking, not for everyday use.
/// Every daemon of a job must use the same inline_max_bytes, segment_bytes,
/// stream_message_bytes and all_to_all_max_nodes (they shape what travels between nodes: a
/// mismatch fails the job's ops that span nodes); the others are each node's own.
struct CpuTuning {
  /// Ops whose result is at most this many bytes travel inside their records: no link
  /// collective after the verdict.
  int64_t inline_max_bytes = 256 << 10;
  /// Groups of at most this many nodes exchange each op's record all-to-all (one hop, N - 1
  /// records a node); larger ones fold them up a binomial tree and pass the decision down
  /// (2 log2 N hops, a constant number of records a node).
  int64_t all_to_all_max_nodes = 4;
  /// The link collectives' segment, one message on the links: a multiple of 64, at least 4096.
  int64_t segment_bytes = 1 << 20;
  /// Segments a link collective sends ahead of the ones it received; at least 1.
  int64_t window_segments = 2;
  /// Most queued ops whose records are in flight at once (a longer batch is split).
  int64_t max_stage_ops = 256;
  /// A record stream message: at most this many bytes (it must hold one inline op's record),
  /// sent once it holds stream_flush_bytes so that the wire and the peer start while later
  /// records are packed.
  int64_t stream_message_bytes = 1 << 20;
  int64_t stream_flush_bytes = 256 << 10;
  /// How long past an op's deadline a node waits for its peers' verdicts and connections (a
  /// peer whose op failed at its own deadline comes a moment later).
  absl::Duration peer_grace = absl::Seconds(10);
  /// Below this many bytes per part a single-node op is not split across the worker pool.
  int64_t min_bytes_per_part = 256 << 10;
  /// Not a flag: --peer_timeout and a margin. A link to a peer that breaks (UNAVAILABLE) is most
  /// often a node lost, which the job's peer watch names with its cause within its timeout; the
  /// failing op waits up to this long for that word (Communicator::Abort), so that every
  /// survivor reports the loss the same way, whichever link saw it first. 0: no wait.
  absl::Duration await_peer_watch = absl::ZeroDuration();
};

/// Runs kernel(begin, n) over the elements [0, count), split into parts of whole elements
/// across `pool` (the caller takes one) when the traffic (`bytes`) makes it worth a thread
/// hand-off (min_bytes_per_part a part); one part without a pool. Returns the first part's
/// failure (the kernels check their arguments before writing, so every part fails alike and
/// nothing is written).
absl::Status SplitAcross(WorkerPool* pool, int64_t min_bytes_per_part, int64_t bytes, int64_t count,
                         const std::function<absl::Status(int64_t begin, int64_t n)>& kernel);

/// InvalidArgument naming the first bad field by its flag (--cpu_segment_bytes=...), OK when
/// the data plane can run with `tuning`.
absl::Status ValidateCpuTuning(const CpuTuning& tuning);

/// The CPU data plane: collectives over the local members' shared-memory buffers, computed by
/// the daemon (each element read once from every member and written once to every member),
/// split over the worker pool for large ops. A group that spans nodes gets a NodesCommunicator
/// (its members' bytes cross to the peer daemons over TCP) when the spec names the job's store
/// and this daemon's TCP address; without them, or for a group with members elsewhere in a job
/// that does not span nodes, creating the communicator is FAILED_PRECONDITION.
class CpuBackend final : public core::Backend {
 public:
  /// `pool` must outlive the backend and its communicators. `tuning` must be valid
  /// (ValidateCpuTuning: DaemonConfig's Validate checks it); logs it once, at info level.
  explicit CpuBackend(WorkerPool* pool, const CpuTuning& tuning = {});
  absl::StatusOr<std::shared_ptr<core::Communicator>> CreateCommunicator(
      const core::CommunicatorSpec& spec) override;

 private:
  WorkerPool* const pool_;
  const CpuTuning tuning_;
  // The connections elastic jobs' groups keep for their next epoch on this daemon.
  const std::shared_ptr<LinkPark> park_;
};

}  // namespace gradsync::backend::cpu
