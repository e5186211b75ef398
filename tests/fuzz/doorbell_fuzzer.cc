// The daemon's side of the op doorbell (common/doorbell.h) over a region whose header and
// request ring a hostile trainer wrote: the input. What DoorbellServer's thread does with it
// (validate the header, pop records, parse each as a TrainerRequest, write completions) must
// stay inside the region, never hand on a record longer than the ring allows, and never leave
// the ring in a state its thread neither consumes nor sleeps on.
//
// Input: a Prefix (56 bytes, little-endian), then ring bytes written from the request tail's
// position on (wrapping at the ring's end). tests/fuzz/make_corpus.sh writes the seeds.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "common/doorbell.h"
#include "fuzz_check.h"
#include "gradsync/v1/gradsync.pb.h"

namespace gradsync::doorbell {
namespace {

struct Prefix {
  // XORed into the header a trainer's Initialize writes (all zero: a valid header).
  uint32_t magic_xor;
  uint32_t version_xor;
  uint64_t request_ring_bytes_xor;
  uint32_t completion_slots_xor;
  uint32_t completions;  // how many completions the daemon writes afterwards (low 3 bits)
  uint64_t request_head;
  uint64_t request_tail;
  uint64_t completion_head;
  uint64_t completion_tail;
};
static_assert(sizeof(Prefix) == 56);

// Pops past this many records end the input (a 4 MiB ring holds 512 Ki empty records).
constexpr int kMaxRecords = 4096;

// The region lives for the process (5 MiB, exactly RegionBytes() so that ASan flags any access
// past it); each input dirties the header and a few ranges, which are zeroed afterwards.
std::byte* Region() {
  static std::byte* const region = [] {
    auto* r = static_cast<std::byte*>(std::aligned_alloc(alignof(Header), RegionBytes()));
    std::memset(r, 0, RegionBytes());
    return r;
  }();
  return region;
}

class DirtyRanges {
 public:
  void Write(uint64_t offset, const void* data, uint64_t bytes) {
    std::memcpy(Region() + offset, data, bytes);
    ranges_.emplace_back(offset, bytes);
  }
  void Mark(uint64_t offset, uint64_t bytes) { ranges_.emplace_back(offset, bytes); }
  ~DirtyRanges() {
    for (const auto& [offset, bytes] : ranges_) std::memset(Region() + offset, 0, bytes);
  }

 private:
  std::vector<std::pair<uint64_t, uint64_t>> ranges_;
};

void Fuzz(const uint8_t* data, size_t size) {
  if (size < sizeof(Prefix)) return;
  Prefix p;
  std::memcpy(&p, data, sizeof(p));
  data += sizeof(p);
  size -= sizeof(p);

  DirtyRanges dirty;
  dirty.Mark(0, kHeaderBytes);
  Header* h = reinterpret_cast<Header*>(Region());
  h->magic = kMagic ^ p.magic_xor;
  h->version = kVersion ^ p.version_xor;
  h->request_ring_bytes = kRequestRingBytes ^ p.request_ring_bytes_xor;
  h->completion_slots = kCompletionSlots ^ p.completion_slots_xor;
  h->request_head.store(p.request_head);
  h->request_tail.store(p.request_tail);
  h->completion_head.store(p.completion_head);
  h->completion_tail.store(p.completion_tail);
  const uint64_t ring = std::min<uint64_t>(size, kRequestRingBytes);
  const uint64_t pos = p.request_tail % kRequestRingBytes;
  const uint64_t first = std::min(ring, kRequestRingBytes - pos);
  dirty.Write(kHeaderBytes + pos, data, first);
  dirty.Write(kHeaderBytes, data + first, ring - first);

  Doorbell doorbell(Region());
  const bool valid_header = p.magic_xor == 0 && p.version_xor == 0 &&
                            p.request_ring_bytes_xor == 0 && p.completion_slots_xor == 0;
  GRADSYNC_FUZZ_CHECK(doorbell.Validate().ok() == valid_header);
  if (!valid_header) return;  // the daemon refuses the region before starting the thread

  // DoorbellServer::Loop: records until the ring is empty or a corrupt one ends the session.
  std::string record;
  v1::TrainerRequest request;
  for (int i = 0; i < kMaxRecords; ++i) {
    const uint64_t head = h->request_head.load();
    const uint64_t before = h->request_tail.load();
    bool got = false;
    const absl::Status status = doorbell.Pop(&record, &got);
    if (!status.ok()) {
      GRADSYNC_FUZZ_CHECK(status.code() == absl::StatusCode::kInvalidArgument);
      break;
    }
    if (!got) {
      // DaemonWait sleeps only while head == tail: anything else and the thread spins on a
      // ring it will never consume.
      GRADSYNC_FUZZ_CHECK(h->request_tail.load() == head);
      break;
    }
    const uint64_t after = h->request_tail.load();
    GRADSYNC_FUZZ_CHECK(record.size() <= kRequestRingBytes / 2);
    GRADSYNC_FUZZ_CHECK(after > before && after <= head);
    GRADSYNC_FUZZ_CHECK(after - before >= 8 + record.size());
    GRADSYNC_FUZZ_CHECK(after - before <= kRequestRingBytes);
    if (!request.ParseFromString(record) || !request.has_op()) break;
  }

  // Completions: the daemon writes slots at indices the trainer can corrupt.
  static const std::string kMessages[] = {"", "deadline", std::string(kMessageBytes, 'm'),
                                          std::string(3 * kMessageBytes, 'x')};
  for (uint32_t i = 0; i < (p.completions & 7); ++i) {
    const uint64_t head = h->completion_head.load();
    const bool room = head - h->completion_tail.load() < kCompletionSlots;
    const std::string& message = kMessages[i % 4];
    const uint64_t slot =
        kHeaderBytes + kRequestRingBytes + head % kCompletionSlots * sizeof(Completion);
    dirty.Mark(slot, sizeof(Completion));
    GRADSYNC_FUZZ_CHECK(doorbell.Complete(i, head, static_cast<int>(i), message) == room);
    if (!room) continue;
    GRADSYNC_FUZZ_CHECK(h->completion_head.load() == head + 1);
    const auto* c = reinterpret_cast<const Completion*>(Region() + slot);
    GRADSYNC_FUZZ_CHECK(c->message_bytes == std::min<size_t>(message.size(), kMessageBytes));
  }
  Completion c;
  if (doorbell.Next(&c)) GRADSYNC_FUZZ_CHECK(c.message_bytes <= kMessageBytes);
}

}  // namespace
}  // namespace gradsync::doorbell

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  gradsync::fuzz::QuietLogs();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gradsync::doorbell::Fuzz(data, size);
  return 0;
}
