// Implementation of doorbell.h: the request and completion rings, and the spin-then-futex
// waits and wake-ups of each side.

#include "common/doorbell.h"

#include <linux/futex.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <functional>

#include "absl/strings/str_cat.h"

namespace gradsync::doorbell {
namespace {

// Records are 8-byte aligned: a uint64 length, then the bytes. kSkip marks the unused tail of
// the ring before a record that wraps to its start.
constexpr uint64_t kSkip = ~uint64_t{0};
constexpr uint64_t Align8(uint64_t n) { return (n + 7) & ~uint64_t{7}; }

// Shared (not process-private) futexes: the word lives in memory two processes map.
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}
void FutexWakeAll(std::atomic<uint32_t>* word) {
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

// GRADSYNC_SPIN_US in the environment overrides the default watch time (0: sleep at once).
absl::Duration SpinTime() {
  static const absl::Duration spin = [] {
    const char* env = std::getenv("GRADSYNC_SPIN_US");
    return absl::Microseconds(env != nullptr ? std::max(0, std::atoi(env)) : 50);
  }();
  return spin;
}

}  // namespace

void Doorbell::Initialize() {
  header_->magic = kMagic;
  header_->version = kVersion;
  header_->request_ring_bytes = kRequestRingBytes;
  header_->completion_slots = kCompletionSlots;
}

absl::Status Doorbell::Validate() const {
  if (header_->magic != kMagic || header_->version != kVersion ||
      header_->request_ring_bytes != kRequestRingBytes ||
      header_->completion_slots != kCompletionSlots) {
    return absl::InvalidArgumentError(absl::StrCat(
        "doorbell region has magic ", header_->magic, " version ", header_->version,
        "; this daemon speaks version ", kVersion, " (client and daemon builds differ?)"));
  }
  return absl::OkStatus();
}

bool Doorbell::Push(absl::string_view record) {
  const uint64_t need = 8 + Align8(record.size());
  if (need > kRequestRingBytes / 2) return false;
  uint64_t head = header_->request_head.load(std::memory_order_relaxed);
  const uint64_t tail = header_->request_tail.load(std::memory_order_acquire);
  const uint64_t pos = head % kRequestRingBytes;
  const uint64_t skip = kRequestRingBytes - pos < need ? kRequestRingBytes - pos : 0;
  if (head + skip + need - tail > kRequestRingBytes) return false;
  if (skip > 0) {
    std::memcpy(requests() + pos, &kSkip, 8);
    head += skip;
  }
  std::byte* at = requests() + head % kRequestRingBytes;
  const uint64_t len = record.size();
  std::memcpy(at, &len, 8);
  if (!record.empty()) std::memcpy(at + 8, record.data(), record.size());
  header_->request_head.store(head + need, std::memory_order_seq_cst);
  if (header_->daemon_sleeping.load(std::memory_order_seq_cst) != 0) WakeDaemon();
  return true;
}

absl::Status Doorbell::Pop(std::string* record, bool* got) {
  *got = false;
  uint64_t tail = header_->request_tail.load(std::memory_order_relaxed);
  for (int hops = 0; hops < 2; ++hops) {
    const uint64_t head = header_->request_head.load(std::memory_order_acquire);
    if (tail == head) return absl::OkStatus();
    const uint64_t pos = tail % kRequestRingBytes;
    if (head - tail > kRequestRingBytes || head < tail || pos % 8 != 0) {
      return absl::InvalidArgumentError("doorbell request ring indices are corrupt");
    }
    uint64_t len;
    std::memcpy(&len, requests() + pos, 8);
    if (len == kSkip) {
      // Consumed now: with no record behind it the ring is empty, which DaemonWait must see
      // (else the daemon's thread spins on a ring it never drains).
      tail += kRequestRingBytes - pos;
      header_->request_tail.store(tail, std::memory_order_release);
      continue;
    }
    const uint64_t need = 8 + Align8(len);
    if (len > kRequestRingBytes / 2 || need > kRequestRingBytes - pos || need > head - tail) {
      return absl::InvalidArgumentError(
          absl::StrCat("doorbell record of ", len, " bytes is corrupt"));
    }
    record->assign(reinterpret_cast<const char*>(requests() + pos + 8), len);
    header_->request_tail.store(tail + need, std::memory_order_release);
    *got = true;
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError("doorbell request ring skips twice");
}

// Watches the ring for up to `spin` before sleeping: a wake-up through the kernel costs tens
// of microseconds on small VMs, and ops come back to back. The watcher yields the core between
// looks, so a runnable thread (the daemon's, or the trainer's compute) is never held up; on a
// 2-core VM this took the 4 KiB 2-rank all-reduce from ~90 us (futex only) to ~15-20 us, where
// a pause-spin made it slower (three spinners, two cores).
bool SpinUntil(const std::function<bool()>& ready, absl::Duration spin) {
  const absl::Time until = absl::Now() + spin;
  for (int i = 0;; ++i) {
    if (ready()) return true;
    if ((i & 7) == 7 && absl::Now() >= until) return false;
    sched_yield();
  }
}

void Doorbell::DaemonWait(absl::Duration timeout) {
  if (SpinUntil(
          [&] {
            return header_->request_head.load(std::memory_order_acquire) !=
                   header_->request_tail.load(std::memory_order_relaxed);
          },
          SpinTime())) {
    return;
  }
  const uint32_t seen = header_->daemon_futex.load(std::memory_order_seq_cst);
  header_->daemon_sleeping.store(1, std::memory_order_seq_cst);
  if (header_->request_head.load(std::memory_order_seq_cst) ==
      header_->request_tail.load(std::memory_order_relaxed)) {
    FutexWait(&header_->daemon_futex, seen, timeout);
  }
  header_->daemon_sleeping.store(0, std::memory_order_relaxed);
}

void Doorbell::WakeDaemon() {
  header_->daemon_futex.fetch_add(1, std::memory_order_seq_cst);
  FutexWakeAll(&header_->daemon_futex);
}

bool Doorbell::Complete(uint64_t tag, uint64_t seq, int code, absl::string_view message) {
  const uint64_t head = header_->completion_head.load(std::memory_order_relaxed);
  const uint64_t tail = header_->completion_tail.load(std::memory_order_acquire);
  if (head - tail >= kCompletionSlots) return false;
  Completion& c = completions()[head % kCompletionSlots];
  c.tag = tag;
  c.seq = seq;
  c.code = code;
  c.message_bytes = static_cast<uint32_t>(std::min<size_t>(message.size(), kMessageBytes));
  if (c.message_bytes > 0) std::memcpy(c.message, message.data(), c.message_bytes);
  header_->completion_head.store(head + 1, std::memory_order_seq_cst);
  if (header_->trainer_sleeping.load(std::memory_order_seq_cst) != 0) {
    header_->trainer_futex.fetch_add(1, std::memory_order_seq_cst);
    FutexWakeAll(&header_->trainer_futex);
  }
  return true;
}

bool Doorbell::Next(Completion* out) {
  const uint64_t tail = header_->completion_tail.load(std::memory_order_relaxed);
  if (tail == header_->completion_head.load(std::memory_order_acquire)) return false;
  const Completion& c = completions()[tail % kCompletionSlots];
  out->tag = c.tag;
  out->seq = c.seq;
  out->code = c.code;
  out->message_bytes = std::min(c.message_bytes, kMessageBytes);
  std::memcpy(out->message, c.message, out->message_bytes);
  header_->completion_tail.store(tail + 1, std::memory_order_release);
  return true;
}

void Doorbell::TrainerWait(absl::Duration timeout) {
  if (SpinUntil(
          [&] {
            return header_->completion_head.load(std::memory_order_acquire) !=
                   header_->completion_tail.load(std::memory_order_relaxed);
          },
          SpinTime())) {
    return;
  }
  const uint32_t seen = header_->trainer_futex.load(std::memory_order_seq_cst);
  // A count, not a flag: several trainer threads may sleep at once.
  header_->trainer_sleeping.fetch_add(1, std::memory_order_seq_cst);
  if (header_->completion_head.load(std::memory_order_seq_cst) ==
      header_->completion_tail.load(std::memory_order_relaxed)) {
    FutexWait(&header_->trainer_futex, seen, timeout);
  }
  header_->trainer_sleeping.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace gradsync::doorbell
