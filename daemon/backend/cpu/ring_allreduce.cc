// Implementation of ring_allreduce.h: the ring's steps, segment by segment, over RecordLinks.

#include "daemon/backend/cpu/ring_allreduce.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/record_links.h"

namespace gradsync::backend::cpu {
namespace {

constexpr uint64_t kRingMagic = 0x677372696e673031;  // "gsring01"
// Segments a node sends ahead of the ones it received in the same step.
constexpr int64_t kWindow = 2;
constexpr size_t kAlign = 64;  // segments stay 64-byte aligned in the peer's receive buffer

// Opens every segment's message.
struct SegmentHeader {
  uint64_t magic;
  uint64_t seq;
  uint32_t step;
  uint32_t segment;
  uint64_t bytes;  // of data, then zeros up to a multiple of kAlign
  uint64_t reserved[4];
};
static_assert(sizeof(SegmentHeader) == kAlign);

constexpr std::byte kZeros[kAlign] = {};

class Ring {
 public:
  Ring(RecordLinks& links, const RingSpec& spec, absl::Span<std::byte* const> buffers)
      : links_(links),
        spec_(spec),
        n_(links.nodes()),
        me_(links.me()),
        esize_(DTypeSize(spec.dtype)),
        segment_(std::max<int64_t>(1, static_cast<int64_t>(spec.segment_bytes) / esize_)),
        partial_(spec.op == v1::MEAN ? v1::SUM : spec.op) {
    for (std::byte* b : buffers) views_.push_back({{b, spec.count}});
  }

  absl::Status Run() {
    if (n_ == 1) {  // nothing to exchange: the members' reduction is the result
      std::vector<Slice> all = Members(0);
      Reduce(spec_.dtype, spec_.op, spec_.divisor, all, all, spec_.count);
      return absl::OkStatus();
    }
    for (int t = 0; t < 2 * (n_ - 1); ++t) {
      if (absl::Status s = Step(t); !s.ok()) return s;
    }
    return absl::OkStatus();
  }

 private:
  int Mod(int c) const { return ((c % n_) + n_) % n_; }
  int64_t Begin(int chunk) const { return spec_.count * chunk / n_; }
  int64_t Segments(int chunk) const {
    return (Begin(chunk + 1) - Begin(chunk) + segment_ - 1) / segment_;
  }
  // Elements [begin, end) of segment k of `chunk`.
  std::pair<int64_t, int64_t> Bounds(int chunk, int64_t k) const {
    const int64_t b = Begin(chunk) + k * segment_;
    return {b, std::min(b + segment_, Begin(chunk + 1))};
  }
  std::vector<Slice> Members(int64_t at) const {
    std::vector<Slice> out;
    for (const core::View& v : views_) out.push_back({&v, at});
    return out;
  }

  // Step t: reduce-scatter steps 0..n-2 (a node completes chunk me+1), then all-gather steps.
  absl::Status Step(int t) {
    const bool scatter = t < n_ - 1;
    const int s = scatter ? t : t - (n_ - 1);
    const int send_chunk = scatter ? Mod(me_ - s) : Mod(me_ + 1 - s);
    const int recv_chunk = scatter ? Mod(me_ - s - 1) : Mod(me_ - s);
    const int64_t sends = Segments(send_chunk);
    const int64_t receives = Segments(recv_chunk);
    int64_t i = 0, j = 0;
    while (i < sends || j < receives) {
      if (i < sends && (i < j + kWindow || j == receives)) {
        if (absl::Status st = SendSegment(t, s, scatter, send_chunk, i++); !st.ok()) return st;
      } else {
        if (absl::Status st = ReceiveSegment(t, s, scatter, recv_chunk, j++); !st.ok()) return st;
      }
    }
    return absl::OkStatus();
  }

  absl::Status SendSegment(int t, int s, bool scatter, int chunk, int64_t k) {
    const auto [b, e] = Bounds(chunk, k);
    if (scatter && s == 0 && views_.size() > 1) {  // the node's own sum, into buffers[0]
      const Slice into{&views_[0], b};
      Reduce(spec_.dtype, partial_, 1, Members(b), {&into, 1}, e - b);
    }
    const size_t bytes = static_cast<size_t>((e - b) * esize_);
    const SegmentHeader header{
        kRingMagic, spec_.seq, static_cast<uint32_t>(t), static_cast<uint32_t>(k), bytes, {}};
    const absl::Span<const std::byte> parts[] = {
        {reinterpret_cast<const std::byte*>(&header), sizeof(header)},
        {views_[0][0].data + b * esize_, bytes},
        {kZeros, (kAlign - bytes % kAlign) % kAlign}};
    return links_.SendTo(Mod(me_ + 1), parts, spec_.deadline);
  }

  absl::Status ReceiveSegment(int t, int s, bool scatter, int chunk, int64_t k) {
    const int from = Mod(me_ - 1);
    absl::StatusOr<absl::Span<const std::byte>> message = links_.Receive(from, spec_.deadline);
    if (!message.ok()) return message.status();
    const auto [b, e] = Bounds(chunk, k);
    const size_t bytes = static_cast<size_t>((e - b) * esize_);
    SegmentHeader header{};  // a message too short to hold one fails the magic check
    if (message->size() >= sizeof(header)) std::memcpy(&header, message->data(), sizeof(header));
    if (header.magic != kRingMagic || header.seq != spec_.seq ||
        header.step != static_cast<uint32_t>(t) || header.segment != static_cast<uint32_t>(k) ||
        header.bytes != bytes ||
        message->size() != sizeof(header) + (bytes + kAlign - 1) / kAlign * kAlign) {
      return absl::InternalError(absl::StrCat(
          "node ", links_.node(from), " sent a message that is not segment ", k, " of step ", t,
          " of seq ", spec_.seq, " (", message->size(), " bytes; it names seq ", header.seq,
          " step ", header.step, " segment ", header.segment, "): the nodes are out of step"));
    }
    // Read only: core::View names writable runs.
    const core::View received = {{const_cast<std::byte*>(message->data()) + sizeof(header), e - b}};
    const Slice from_link{&received, 0};
    if (!scatter) {  // a finished block: into every member
      Reduce(spec_.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&from_link, 1}, Members(b), e - b);
      return absl::OkStatus();
    }
    // Every chunk reaches a node once in the scatter: the peers' sum so far, plus this node's
    // members.
    std::vector<Slice> srcs = Members(b);
    srcs.push_back(from_link);
    if (s == n_ - 2) {  // the block is complete here: the result, into every member
      Reduce(spec_.dtype, spec_.op, spec_.divisor, srcs, Members(b), e - b);
    } else {
      const Slice into{&views_[0], b};
      Reduce(spec_.dtype, partial_, 1, srcs, {&into, 1}, e - b);
    }
    return absl::OkStatus();
  }

  RecordLinks& links_;
  const RingSpec& spec_;
  const int n_;
  const int me_;
  const int64_t esize_;
  const int64_t segment_;  // elements
  const v1::ReduceOp partial_;
  std::vector<core::View> views_;  // one per buffer
};

}  // namespace

absl::Status RingAllreduce(RecordLinks& links, const RingSpec& spec,
                           absl::Span<std::byte* const> buffers) {
  if (buffers.empty() || spec.count < 0) {
    return absl::InvalidArgumentError("ring all-reduce: no buffers, or a negative count");
  }
  return Ring(links, spec, buffers).Run();
}

}  // namespace gradsync::backend::cpu
