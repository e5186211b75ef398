// Implementation of link_collectives.h: segment messages, the ring's steps, broadcast and
// all-gather, over RecordLinks.

#include "daemon/backend/cpu/link_collectives.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/record_links.h"

namespace gradsync::backend::cpu {
namespace {

constexpr uint64_t kSegmentMagic = 0x677373656730310a;  // "gsseg01\n"
// Segments stay aligned in the peer's receive buffer.
constexpr size_t kAlign = RecordLinks::kAlign;

enum Kind : uint32_t { kRing = 1, kBroadcast = 2, kAllGather = 3 };

// Opens every segment's message.
struct SegmentHeader {
  uint64_t magic;
  uint64_t seq;
  uint32_t kind;
  uint32_t step;  // the ring's (or the all-gather's) step; 0 in a broadcast
  uint64_t segment;
  uint64_t bytes;  // of data, then zeros up to a multiple of kAlign
  uint64_t reserved[3];
};
static_assert(sizeof(SegmentHeader) == kAlign);

constexpr std::byte kZeros[kAlign] = {};

// Segment `segment` (its `data`) of the op to `to` (or every peer).
absl::Status SendSegment(RecordLinks& links, const LinkOp& op, int to, Kind kind, uint32_t step,
                         uint64_t segment, const std::byte* data, size_t bytes) {
  const SegmentHeader header{kSegmentMagic, op.seq, kind, step, segment, bytes, {}};
  const absl::Span<const std::byte> parts[] = {
      {reinterpret_cast<const std::byte*>(&header), sizeof(header)},
      {data, bytes},
      {kZeros, RecordLinks::Padded(bytes) - bytes}};
  return links.SendTo(to, parts, op.deadline);
}

// The next message from `from`, which must be that segment of the op: its data (valid until
// the next Receive from `from`).
absl::StatusOr<const std::byte*> ReceiveSegment(RecordLinks& links, const LinkOp& op, int from,
                                                Kind kind, uint32_t step, uint64_t segment,
                                                size_t bytes) {
  absl::StatusOr<absl::Span<const std::byte>> message = links.Receive(from, op.deadline);
  if (!message.ok()) return message.status();
  SegmentHeader header{};  // a message too short to hold one fails the magic check
  if (message->size() >= sizeof(header)) std::memcpy(&header, message->data(), sizeof(header));
  if (header.magic != kSegmentMagic || header.seq != op.seq || header.kind != kind ||
      header.step != step || header.segment != segment || header.bytes != bytes ||
      message->size() != SegmentMessageBytes(bytes)) {
    return absl::InternalError(
        absl::StrCat("node ", links.node(from), " sent a message that is not segment ", segment,
                     " (kind ", kind, ", step ", step, ") of seq ", op.seq, ": ", message->size(),
                     " bytes naming seq ", header.seq, " kind ", header.kind, " step ", header.step,
                     " segment ", header.segment, ": the nodes are out of step"));
  }
  return message->data() + sizeof(header);
}

// A step's `sends` segments out and `receives` in, at most `window` sends ahead of the receives
// (then the rest of whichever side is left): send(k) and receive(k) for each k in order.
template <typename SendFn, typename ReceiveFn>
absl::Status Windowed(int64_t sends, int64_t receives, int64_t window, SendFn send,
                      ReceiveFn receive) {
  int64_t i = 0, j = 0;
  while (i < sends || j < receives) {
    if (i < sends && (i < j + window || j == receives)) {
      GRADSYNC_RETURN_IF_ERROR(send(i++));
    } else {
      GRADSYNC_RETURN_IF_ERROR(receive(j++));
    }
  }
  return absl::OkStatus();
}

class Ring {
 public:
  Ring(RecordLinks& links, const LinkOp& op, const RingSpec& spec,
       absl::Span<std::byte* const> buffers, std::byte* result)
      : links_(links),
        op_(op),
        spec_(spec),
        n_(links.nodes()),
        me_(links.me()),
        esize_(DTypeSize(spec.dtype)),
        segment_(std::max<int64_t>(1, static_cast<int64_t>(op.segment_bytes) / esize_)),
        partial_(spec.op == v1::MEAN ? v1::SUM : spec.op) {
    for (std::byte* b : buffers) views_.push_back({{b, spec.count}});
    // The running sums and the result: in `result` when given (the buffers only read), else
    // in the first buffer (and the result in every one).
    acc_ = result != nullptr ? core::View{{result, spec.count}} : views_[0];
    separate_ = result != nullptr;
  }

  absl::Status Run() {
    if (n_ == 1) {  // nothing to exchange: the members' reduction is the result
      return Reduce(spec_.dtype, spec_.op, spec_.divisor, Members(0), Results(0), spec_.count);
    }
    for (int t = 0; t < 2 * (n_ - 1); ++t) GRADSYNC_RETURN_IF_ERROR(Step(t));
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
  // Where finished elements go: the result buffer, or every member.
  std::vector<Slice> Results(int64_t at) const {
    return separate_ ? std::vector<Slice>{{&acc_, at}} : Members(at);
  }

  // Step t: reduce-scatter steps 0..n-2 (a node completes chunk me+1), then all-gather steps.
  absl::Status Step(int t) {
    const bool scatter = t < n_ - 1;
    const int s = scatter ? t : t - (n_ - 1);
    const int send_chunk = scatter ? Mod(me_ - s) : Mod(me_ + 1 - s);
    const int recv_chunk = scatter ? Mod(me_ - s - 1) : Mod(me_ - s);
    return Windowed(
        Segments(send_chunk), Segments(recv_chunk), op_.window,
        [&](int64_t k) { return Send(t, scatter && s == 0, send_chunk, k); },
        [&](int64_t k) { return Receive(t, scatter && s == n_ - 2, scatter, recv_chunk, k); });
  }

  // `first`: the node's own block, whose members are summed here first (one member: sent as
  // it is).
  absl::Status Send(int t, bool first, int chunk, int64_t k) {
    const auto [b, e] = Bounds(chunk, k);
    const core::View* from = &acc_;
    if (first && views_.size() > 1) {
      const Slice into{&acc_, b};
      GRADSYNC_RETURN_IF_ERROR(Reduce(spec_.dtype, partial_, 1, Members(b), {&into, 1}, e - b));
    } else if (first) {
      from = &views_[0];
    }
    return SendSegment(links_, op_, Mod(me_ + 1), kRing, static_cast<uint32_t>(t),
                       static_cast<uint64_t>(k), (*from)[0].data + b * esize_,
                       static_cast<size_t>((e - b) * esize_));
  }

  // `last`: the scatter's last step, which completes the block.
  absl::Status Receive(int t, bool last, bool scatter, int chunk, int64_t k) {
    const auto [b, e] = Bounds(chunk, k);
    GRADSYNC_ASSIGN_OR_RETURN(
        const std::byte* const data,
        ReceiveSegment(links_, op_, Mod(me_ - 1), kRing, static_cast<uint32_t>(t),
                       static_cast<uint64_t>(k), static_cast<size_t>((e - b) * esize_)));
    // Read only: core::View names writable runs.
    const core::View received = {{const_cast<std::byte*>(data), e - b}};
    const Slice from_link{&received, 0};
    if (!scatter) {  // a finished block: into every member (or the result)
      return Copy(spec_.dtype, from_link, Results(b), e - b);
    }
    // Every chunk reaches a node once in the scatter: the peers' sum so far, plus this node's
    // members.
    std::vector<Slice> srcs = Members(b);
    srcs.push_back(from_link);
    if (last) {  // the result, into every member (or the result)
      return Reduce(spec_.dtype, spec_.op, spec_.divisor, srcs, Results(b), e - b);
    }
    const Slice into{&acc_, b};
    return Reduce(spec_.dtype, partial_, 1, srcs, {&into, 1}, e - b);
  }

  RecordLinks& links_;
  const LinkOp& op_;
  const RingSpec& spec_;
  const int n_;
  const int me_;
  const int64_t esize_;
  const int64_t segment_;  // elements
  const v1::ReduceOp partial_;
  std::vector<core::View> views_;  // one per buffer
  core::View acc_;                 // running sums (and the result when separate_)
  bool separate_ = false;          // the result goes to acc_ alone
};

// Segments of `bytes` bytes, and the bounds of segment k.
struct Segmented {
  size_t bytes;
  size_t segment;
  uint64_t count() const { return (bytes + segment - 1) / segment; }
  size_t begin(uint64_t k) const { return k * segment; }
  size_t size(uint64_t k) const { return std::min(segment, bytes - k * segment); }
};

}  // namespace

size_t SegmentMessageBytes(size_t segment_bytes) {
  return sizeof(SegmentHeader) + RecordLinks::Padded(segment_bytes);
}

absl::Status RingAllreduce(RecordLinks& links, const LinkOp& op, const RingSpec& spec,
                           absl::Span<std::byte* const> buffers, std::byte* result) {
  if (buffers.empty() || spec.count < 0 || DTypeSize(spec.dtype) <= 0 || op.window < 1) {
    return absl::InvalidArgumentError(
        "ring all-reduce: no buffers, a negative count, an unknown dtype or a window below 1");
  }
  return Ring(links, op, spec, buffers, result).Run();
}

absl::Status LinkBroadcast(RecordLinks& links, const LinkOp& op, int root,
                           absl::Span<std::byte> buffer) {
  const int n = links.nodes();
  const int me = links.me();
  if (root < 0 || root >= n) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: no node ", root));
  }
  // A chain around the ring from the root: each segment goes on as soon as it came, so the
  // pipeline fills once and every link carries the buffer once.
  const int place = ((me - root) % n + n) % n;  // hops from the root
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  const Segmented s{buffer.size(), std::max<size_t>(1, op.segment_bytes)};
  for (uint64_t k = 0; k < s.count(); ++k) {
    std::byte* const at = buffer.data() + s.begin(k);
    if (place > 0) {
      GRADSYNC_ASSIGN_OR_RETURN(const std::byte* const data,
                                ReceiveSegment(links, op, prev, kBroadcast, 0, k, s.size(k)));
      std::memcpy(at, data, s.size(k));
    }
    if (place < n - 1) {
      GRADSYNC_RETURN_IF_ERROR(SendSegment(links, op, next, kBroadcast, 0, k, at, s.size(k)));
    }
  }
  return absl::OkStatus();
}

absl::Status LinkAllGather(RecordLinks& links, const LinkOp& op,
                           absl::Span<const size_t> part_bytes, std::byte* output) {
  const int n = links.nodes();
  const int me = links.me();
  if (static_cast<int>(part_bytes.size()) != n || op.window < 1) {
    return absl::InvalidArgumentError("all-gather: not one part per node, or a window below 1");
  }
  const size_t segment = std::max<size_t>(1, op.segment_bytes);
  std::vector<size_t> offset(n, 0);
  for (int i = 1; i < n; ++i) offset[i] = offset[i - 1] + part_bytes[i - 1];
  const int next = (me + 1) % n;
  const int prev = (me + n - 1) % n;
  // A ring: at step t a node passes on part me - t (its own first) and takes part me - t - 1,
  // at most a window of segments ahead of what it took; each part crosses each link once.
  for (int t = 0; t + 1 < n; ++t) {
    const int out_part = ((me - t) % n + n) % n;
    const int in_part = ((me - t - 1) % n + n) % n;
    const Segmented out{part_bytes[out_part], segment};
    const Segmented in{part_bytes[in_part], segment};
    const auto step = static_cast<uint32_t>(t);
    GRADSYNC_RETURN_IF_ERROR(Windowed(
        static_cast<int64_t>(out.count()), static_cast<int64_t>(in.count()), op.window,
        [&](int64_t k) {
          return SendSegment(links, op, next, kAllGather, step, static_cast<uint64_t>(k),
                             output + offset[out_part] + out.begin(k), out.size(k));
        },
        [&](int64_t k) -> absl::Status {
          GRADSYNC_ASSIGN_OR_RETURN(const std::byte* const data,
                                    ReceiveSegment(links, op, prev, kAllGather, step,
                                                   static_cast<uint64_t>(k), in.size(k)));
          std::memcpy(output + offset[in_part] + in.begin(k), data, in.size(k));
          return absl::OkStatus();
        }));
  }
  return absl::OkStatus();
}

}  // namespace gradsync::backend::cpu
