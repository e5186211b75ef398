#pragma once

// The op doorbell: a shared-memory region between one trainer and its daemon that carries op
// submissions and their completions without a gRPC message or a thread hand-off inside the
// daemon. The trainer creates the region and names it in its Register request; the daemon
// maps it for the session's life. Control calls (register, buffers) stay on the gRPC stream,
// which also tells either side at once when the other is gone.
//
// Layout: a Header page, a byte ring of requests (trainer -> daemon: serialized
// TrainerRequest records), and a ring of fixed completion slots (daemon -> trainer). Each ring
// has one producer and one consumer process; each side sleeps on a futex word in the header
// after announcing it (Dekker style: store "sleeping", then re-check; the producer publishes,
// then checks "sleeping"), so no wake-up is lost.
//
// The daemon treats the region as untrusted input: every length and index is checked, and a
// corrupt record ends the session, never the daemon.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace gradsync::doorbell {

inline constexpr uint32_t kMagic = 0x67736462;  // "gsdb"
inline constexpr uint32_t kVersion = 1;
inline constexpr uint64_t kHeaderBytes = 4096;
inline constexpr uint64_t kRequestRingBytes = 4 << 20;
inline constexpr uint32_t kCompletionSlots = 1024;  // also the most ops in flight per session
inline constexpr uint32_t kMessageBytes = 1000;     // longer error messages are cut

struct Header {
  uint32_t magic;
  uint32_t version;
  uint64_t request_ring_bytes;
  uint32_t completion_slots;
  uint32_t reserved;
  alignas(64) std::atomic<uint64_t> request_head;  // trainer: bytes published
  alignas(64) std::atomic<uint64_t> request_tail;  // daemon: bytes consumed
  alignas(64) std::atomic<uint32_t> daemon_futex;  // bumped to wake the daemon
  std::atomic<uint32_t> daemon_sleeping;
  alignas(64) std::atomic<uint64_t> completion_head;  // daemon: slots published
  alignas(64) std::atomic<uint64_t> completion_tail;  // trainer: slots consumed
  alignas(64) std::atomic<uint32_t> trainer_futex;    // bumped to wake the trainer
  std::atomic<uint32_t> trainer_sleeping;
};
static_assert(sizeof(Header) <= kHeaderBytes);
static_assert(std::atomic<uint64_t>::is_always_lock_free);

struct Completion {
  uint64_t tag;
  uint64_t seq;
  int32_t code;
  uint32_t message_bytes;
  char message[kMessageBytes];
};

/// Bytes of the whole region.
constexpr uint64_t RegionBytes() {
  return kHeaderBytes + kRequestRingBytes + uint64_t{kCompletionSlots} * sizeof(Completion);
}

/// A view of a mapped region (does not own the mapping). Each method is for one side only, as
/// its name says; a side's methods must not run concurrently with themselves.
class Doorbell {
 public:
  explicit Doorbell(std::byte* base) : base_(base), header_(reinterpret_cast<Header*>(base)) {}

  /// Trainer: writes a fresh header into a zeroed region.
  void Initialize();
  /// Daemon: InvalidArgument unless the header is one this build understands.
  absl::Status Validate() const;

  /// Trainer: publishes one record and wakes the daemon if it sleeps. False when the ring has
  /// no room right now (retry after the daemon consumed).
  bool Push(absl::string_view record);
  /// Daemon: the next record, or false when there is none. InvalidArgument on a corrupt ring.
  absl::Status Pop(std::string* record, bool* got);
  /// Daemon: sleeps until a record may be there, `wake` was called, or `timeout`.
  void DaemonWait(absl::Duration timeout);
  /// Daemon (any thread): wakes DaemonWait.
  void WakeDaemon();

  /// Daemon (callers serialize): publishes a completion and wakes the trainer if it sleeps.
  /// False if the ring is full (the trainer broke its in-flight limit).
  bool Complete(uint64_t tag, uint64_t seq, int code, absl::string_view message);
  /// Trainer: the next completion, or false.
  bool Next(Completion* out);
  /// Trainer: sleeps until a completion may be there or `timeout`.
  void TrainerWait(absl::Duration timeout);

 private:
  std::byte* requests() const { return base_ + kHeaderBytes; }
  Completion* completions() const {
    return reinterpret_cast<Completion*>(base_ + kHeaderBytes + kRequestRingBytes);
  }

  std::byte* const base_;
  Header* const header_;
};

}  // namespace gradsync::doorbell
