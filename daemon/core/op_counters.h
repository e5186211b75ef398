// Op counters the engine and the NCCL backend bump and the metrics exporter reads.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/core/backend.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::core {

/// Counters the engine and the NCCL backend bump as ops finish; read by the metrics exporter at
/// scrape time. Every member is a relaxed atomic: bumping one is a few uncontended atomic adds,
/// cheap enough for every op, and readers never block writers. Thread-safe.
class OpCounters {
 public:
  static constexpr int kKinds = v1::OpKind_ARRAYSIZE;  // by v1::OpKind
  static constexpr int kPlanes = 2;
  static constexpr int kCodes = 17;  // absl::StatusCode 0..16
  /// Upper bounds (seconds) of the op latency histogram's buckets, from a local all-reduce of a
  /// few bytes to a stalled op near its deadline; the last bucket is +Inf.
  static constexpr std::array<double, 18> kLatencyBounds = {
      50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3,
      50e-3, 0.1,    0.25,   0.5,    1,    2.5,    10,   60,    300};

  /// An op of this node finished (ran, or failed before running), once per op and node.
  /// `latency` runs from its first local submission to its end.
  void OpFinished(v1::OpKind kind, Plane plane, absl::StatusCode code, int64_t bytes,
                  absl::Duration latency) {
    const int k = kind >= 0 && kind < kKinds ? kind : 0;
    const int p = static_cast<int>(plane);
    const int c = static_cast<int>(code) >= 0 && static_cast<int>(code) < kCodes
                      ? static_cast<int>(code)
                      : static_cast<int>(absl::StatusCode::kUnknown);
    ops_[k][p][c].fetch_add(1, std::memory_order_relaxed);
    if (code == absl::StatusCode::kOk) bytes_[k][p].fetch_add(bytes, std::memory_order_relaxed);
    const double seconds = absl::ToDoubleSeconds(latency);
    size_t b = 0;
    while (b < kLatencyBounds.size() && seconds > kLatencyBounds[b]) ++b;
    latency_buckets_[p][b].fetch_add(1, std::memory_order_relaxed);
    latency_sum_ns_[p].fetch_add(absl::ToInt64Nanoseconds(latency), std::memory_order_relaxed);
  }

  uint64_t ops(int kind, int plane, int code) const {
    return ops_[kind][plane][code].load(std::memory_order_relaxed);
  }
  uint64_t bytes(int kind, int plane) const {
    return bytes_[kind][plane].load(std::memory_order_relaxed);
  }
  /// Ops of the plane whose latency fell in bucket `b` (not cumulative); b == size: +Inf.
  uint64_t latency_bucket(int plane, size_t b) const {
    return latency_buckets_[plane][b].load(std::memory_order_relaxed);
  }
  double latency_sum_seconds(int plane) const {
    return static_cast<double>(latency_sum_ns_[plane].load(std::memory_order_relaxed)) * 1e-9;
  }

  std::atomic<uint64_t> deadline_expiries{0};          // pending ops failed by their deadline here
  std::atomic<uint64_t> desyncs{0};                    // fingerprint mismatches seen here
  std::atomic<uint64_t> stalls{0};                     // stall warnings logged (--stall_warn)
  std::atomic<uint64_t> nccl_aborts{0};                // NCCL communicators aborted
  std::atomic<uint64_t> membership_changes{0};         // elastic epochs past 0 formed here
  std::atomic<uint64_t> nccl_aborts_hung{0};           // NCCL aborts that ran past their bound
  std::atomic<uint64_t> nccl_bootstrap_roots_left{0};  // NCCL ids whose build failed here
  std::atomic<uint64_t> nccl_rebuilds{0};           // NCCL communicators built again after an abort
  std::atomic<uint64_t> nccl_launched_failures{0};  // GPU ops failed after they were answered

 private:
  std::atomic<uint64_t> ops_[kKinds][kPlanes][kCodes] = {};
  std::atomic<int64_t> bytes_[kKinds][kPlanes] = {};
  std::atomic<uint64_t> latency_buckets_[kPlanes][kLatencyBounds.size() + 1] = {};
  std::atomic<int64_t> latency_sum_ns_[kPlanes] = {};
};

}  // namespace gradsync::core
