// Implementation of nodes_communicator.h: the per-op verdict exchange (with small ops' data
// inline), batching of queued ops, the link collectives for larger ops, and link failure.

#include "daemon/backend/cpu/nodes_communicator.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/link_collectives.h"
#include "daemon/backend/cpu/record_links.h"

namespace gradsync::backend::cpu {
namespace {

// How long past an op's deadline a node waits for its peers' verdicts (and connections).
constexpr absl::Duration kGrace = absl::Seconds(10);
// The link collectives' segment: one message on the links.
constexpr size_t kSegmentBytes = 1 << 20;
// Ops moving at most this many bytes per node travel inside their record: one exchange instead
// of a verdict round and then a link collective.
constexpr int64_t kInlineMaxBytes = 256 << 10;
// Most ops whose records are in flight at once (RunBatch splits longer runs).
constexpr size_t kMaxStageOps = 256;
// A stream message: at most this many bytes, sent once it holds kStreamFlushBytes so that the
// wire and the peer start while later records are packed.
constexpr size_t kStreamMessageBytes = 1 << 20;
constexpr size_t kStreamFlushBytes = 256 << 10;
// Send buffers a communicator keeps between stages (a 200 x 40 KiB batch takes about 30).
constexpr size_t kKeptSendMessages = 32;
constexpr uint64_t kStreamMagic = 0x67737265636f7264;  // "gsrecord"

std::chrono::milliseconds MillisUntil(absl::Time deadline) {
  return std::chrono::milliseconds(
      std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - absl::Now())));
}

// What one node sends every other for each op, on its stream: its view of the op, then its
// inline contribution (payload_bytes of it, padded to RecordLinks::kAlign so that payloads stay
// aligned for the reduction kernels).
struct RecordHeader {
  uint64_t seq;
  int32_t code;
  uint32_t payload_bytes;
  uint64_t fingerprint_hash;  // of the whole fingerprint (the text below may be cut)
  char fingerprint[240];
  char message[248];
};
static_assert(sizeof(RecordHeader) == 512);
// Opens every stream message; `bytes` counts the whole message, this header included.
struct MessageHeader {
  uint64_t magic;
  uint64_t bytes;
  uint64_t records;
  uint64_t reserved[5];
};
static_assert(sizeof(MessageHeader) == 64);
// FNV-1a: the same on every node for the same text.
uint64_t HashOf(std::string_view s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ static_cast<uint8_t>(c)) * 1099511628211ull;
  return h;
}

}  // namespace

struct NodesCommunicator::Exchange {
  absl::Status local;  // this node's verdict
  bool inline_data = false;
  const std::byte* mine = nullptr;  // this node's record, in an outbox message
};

// This node's messages of one stage (its records are read again when each op finishes).
struct NodesCommunicator::Outbox {
  struct Message {
    std::unique_ptr<std::byte[]> memory;  // kStreamMessageBytes
    size_t bytes = sizeof(MessageHeader);
    uint64_t records = 0;
    bool sent = false;
  };
  std::vector<Message> messages;  // the last one is open while not sent
  absl::Time deadline;            // of sending: the stage's latest op deadline, kGrace at least
};

// Where this node is in a peer's current message (from RecordLinks::Receive, valid until the
// next Receive from that peer).
struct NodesCommunicator::PeerStream {
  const std::byte* next = nullptr;  // the current message's next record
  const std::byte* end = nullptr;   // and its end
};

NodesCommunicator::NodesCommunicator(core::CommunicatorSpec spec) : spec_(std::move(spec)) {
  nodes_ = spec_.member_nodes;
  std::sort(nodes_.begin(), nodes_.end());
  nodes_.erase(std::unique(nodes_.begin(), nodes_.end()), nodes_.end());
  for (const std::string& n : spec_.member_nodes) {
    node_of_group_rank_.push_back(
        static_cast<int>(std::lower_bound(nodes_.begin(), nodes_.end(), n) - nodes_.begin()));
  }
  my_node_ =
      static_cast<int>(std::lower_bound(nodes_.begin(), nodes_.end(), spec_.node) - nodes_.begin());
  members_on_node_.assign(nodes_.size(), 0);
  for (int node : node_of_group_rank_) ++members_on_node_[node];
}

NodesCommunicator::~NodesCommunicator() = default;

std::string NodesCommunicator::PeersWithRanks() const {
  std::string out;
  for (size_t i = 0; i < nodes_.size(); ++i) {
    if (static_cast<int>(i) == my_node_) continue;
    absl::StrAppend(&out, out.empty() ? "node " : "; node ", nodes_[i], " (ranks ");
    bool first = true;
    for (size_t m = 0; m < spec_.members.size(); ++m) {
      if (node_of_group_rank_[m] != static_cast<int>(i)) continue;
      absl::StrAppend(&out, first ? "" : ",", spec_.members[m]);
      first = false;
    }
    absl::StrAppend(&out, ")");
  }
  return out;
}

absl::Status NodesCommunicator::Connect(absl::Time deadline) {
  if (links_) return absl::OkStatus();
  RecordLinks::Spec links;
  links.store = spec_.rendezvous;
  links.job = spec_.job;
  // Under the run's token: a late key of an earlier run of this job id is never read.
  links.prefix =
      absl::StrCat("records/", spec_.run, spec_.run.empty() ? "" : "/", spec_.group, "/");
  links.nodes = nodes_;
  links.me = my_node_;
  links.max_message_bytes = std::max(kStreamMessageBytes, SegmentMessageBytes(kSegmentBytes));
  absl::StatusOr<std::unique_ptr<RecordLinks>> connected =
      RecordLinks::Connect(std::move(links), deadline);
  if (!connected.ok()) {
    return absl::Status(connected.status().code(),
                        absl::StrCat("connecting job=", spec_.job, " group=", spec_.group,
                                     " nodes=", nodes_.size(), ": ", connected.status().message()));
  }
  links_ = *std::move(connected);
  streams_.assign(nodes_.size(), PeerStream{});
  return absl::OkStatus();
}

absl::Status NodesCommunicator::BrokenStatus(const core::Collective& op) const {
  return absl::Status(broken_.code(), absl::StrCat(op.label, ": the group's link to its other ",
                                                   "nodes failed earlier: ", broken_.message()));
}

absl::Status NodesCommunicator::FailLink(const core::Collective& op, absl::Status error) {
  // A peer daemon died, or did not reach the op by its deadline. The nodes may now disagree
  // on where the group's sequence stands, so the group stays failed (its ranks form the job
  // again) rather than reconnecting to stale rendezvous keys.
  streams_.clear();
  links_.reset();
  if (absl::Now() >= op.deadline) {
    error = absl::DeadlineExceededError(
        absl::StrCat(op.label, " did not complete by its deadline: ", "it waited for ",
                     PeersWithRanks(), " (", error.message(), ")"));
  }
  broken_ = error;
  return error;
}

absl::Status NodesCommunicator::Run(const core::Collective& op) {
  const core::Collective* const ops[] = {&op};
  absl::Status out;
  RunBatch(ops, [&out](size_t, absl::Status s) { out = std::move(s); });
  return out;
}

void NodesCommunicator::RunBatch(absl::Span<const core::Collective* const> ops,
                                 absl::FunctionRef<void(size_t, absl::Status)> finished) {
  size_t i = 0;
  while (i < ops.size()) {
    if (!broken_.ok()) {
      finished(i, BrokenStatus(*ops[i]));
      ++i;
      continue;
    }
    // Connecting is a rendezvous with every node of the group, which each starts at its first
    // op of the group: allow the peers kGrace past this op's deadline (the op still fails if
    // late).
    if (absl::Status s = Connect(std::max(ops[i]->deadline, absl::Now() + kGrace)); !s.ok()) {
      finished(i, FailLink(*ops[i], std::move(s)));
      ++i;
      continue;
    }
    const size_t end = StageEnd(ops, i);
    RunStage(ops.subspan(i, end - i), i, finished);
    i = end;
  }
}

namespace {

// [begin, end) addresses of a view's runs.
void AddRanges(const core::View& v, int64_t esize,
               std::vector<std::pair<uintptr_t, uintptr_t>>& out) {
  for (const core::Run& r : v) {
    const auto b = reinterpret_cast<uintptr_t>(r.data);
    out.emplace_back(b, b + static_cast<uintptr_t>(r.count * esize));
  }
}

}  // namespace

size_t NodesCommunicator::StageEnd(absl::Span<const core::Collective* const> ops,
                                   size_t begin) const {
  // An inline op's contribution is packed when its messages are posted, before the ops ahead
  // of it in the stage complete: it must not read bytes one of them writes.
  std::vector<std::pair<uintptr_t, uintptr_t>> written, read;
  size_t end = begin;
  for (; end < ops.size() && end - begin < kMaxStageOps; ++end) {
    const core::Collective& op = *ops[end];
    if (!op.local_failure.ok()) continue;  // names no buffer
    const int64_t esize = DTypeSize(op.dtype);
    read.clear();
    for (const core::LocalMember& m : op.local) AddRanges(m.input, esize, read);
    for (const auto& [rb, re] : read) {
      for (const auto& [wb, we] : written) {
        if (rb < we && wb < re) return end == begin ? begin + 1 : end;
      }
    }
    // An op that runs a link collective ends its stage: its segments follow its record on the
    // streams, and the ops behind it post their verdicts (their deadline checks) once it is
    // done, so one whose deadline passes while it runs fails by its verdict on every node, not
    // by a timeout that breaks the group's link.
    if (!TravelsInline(op)) return end + 1;
    const bool writes_output = op.kind == v1::ALL_GATHER || op.kind == v1::REDUCE_SCATTER;
    for (const core::LocalMember& m : op.local) {
      AddRanges(writes_output ? m.output : m.input, esize, written);
    }
  }
  return end;
}

std::unique_ptr<std::byte[]> NodesCommunicator::TakeSendMemory() {
  if (free_send_memory_.empty()) {
    // Not value-initialized: pages a message never reaches are never touched.
    return std::unique_ptr<std::byte[]>(new std::byte[kStreamMessageBytes]);
  }
  std::unique_ptr<std::byte[]> m = std::move(free_send_memory_.back());
  free_send_memory_.pop_back();
  return m;
}

const std::byte* NodesCommunicator::NextRecord(int node, uint64_t seq,
                                               std::chrono::milliseconds timeout) {
  PeerStream& stream = streams_[node];
  if (stream.next == stream.end) {
    absl::StatusOr<absl::Span<const std::byte>> message =
        links_->Receive(node, absl::Now() + absl::FromChrono(timeout));
    ThrowIfFailed(message.status());
    const std::byte* const m = message->data();
    MessageHeader header{};  // a message too short to hold one fails the magic check
    if (message->size() >= sizeof(header)) std::memcpy(&header, m, sizeof(header));
    if (header.magic != kStreamMagic || header.bytes != message->size() || header.records == 0) {
      throw std::runtime_error(absl::StrCat("malformed stream message from node ", nodes_[node]));
    }
    stream.next = m + sizeof(header);
    stream.end = m + header.bytes;
  }
  const std::byte* const record = stream.next;
  RecordHeader header;
  if (static_cast<size_t>(stream.end - record) < sizeof(header)) {
    throw std::runtime_error(absl::StrCat("malformed stream message from node ", nodes_[node]));
  }
  std::memcpy(&header, record, sizeof(header));
  const size_t bytes = sizeof(header) + RecordLinks::Padded(header.payload_bytes);
  if (header.seq != seq || static_cast<size_t>(stream.end - record) < bytes) {
    throw std::runtime_error(absl::StrCat("node ", nodes_[node], " sent the record of seq ",
                                          header.seq, " where seq ", seq,
                                          " was due: the nodes are out of step"));
  }
  stream.next = record + bytes;
  return record;
}

void NodesCommunicator::Flush(Outbox& outbox) {
  if (outbox.messages.empty() || outbox.messages.back().sent) return;
  Outbox::Message& m = outbox.messages.back();
  const MessageHeader header{kStreamMagic, m.bytes, m.records, {}};
  std::memcpy(m.memory.get(), &header, sizeof(header));
  m.sent = true;
  ThrowIfFailed(links_->Send({m.memory.get(), m.bytes}, outbox.deadline));
}

void NodesCommunicator::RunStage(absl::Span<const core::Collective* const> ops, size_t first,
                                 absl::FunctionRef<void(size_t, absl::Status)> finished) {
  std::vector<Exchange> exchanges(ops.size());
  Outbox outbox;
  // Peers whose op failed at their own deadline come a moment later (as in Finish).
  outbox.deadline = absl::Now() + kGrace;
  for (const core::Collective* op : ops) outbox.deadline = std::max(outbox.deadline, op->deadline);
  size_t done = 0;  // ops told to `finished`
  try {
    for (size_t k = 0; k < ops.size(); ++k) Post(*ops[k], exchanges[k], outbox);
    Flush(outbox);
    for (; done < ops.size(); ++done) finished(first + done, Finish(*ops[done], exchanges[done]));
    // A few kept for the next stage; a large batch's others go back to the allocator.
    for (Outbox::Message& m : outbox.messages) {
      if (free_send_memory_.size() < kKeptSendMessages) {
        free_send_memory_.push_back(std::move(m.memory));
      }
    }
  } catch (const std::exception& e) {
    const size_t failed = std::min(done, ops.size() - 1);  // all done: the last sends failed
    const core::Collective& op = *ops[failed];
    const absl::Status status =
        FailLink(op, absl::UnavailableError(absl::StrCat(op.label, " across ", nodes_.size(),
                                                         " nodes failed (peers: ", PeersWithRanks(),
                                                         "): ", e.what())));
    if (done < ops.size()) finished(first + done, status);
    for (size_t k = done + 1; k < ops.size(); ++k) finished(first + k, BrokenStatus(*ops[k]));
  }
}

int64_t NodesCommunicator::InlineBytes(const core::Collective& op, int node) const {
  const int64_t esize = DTypeSize(op.dtype);
  switch (op.kind) {
    case v1::ALL_REDUCE:
      return op.count * esize;
    case v1::REDUCE_SCATTER:
      return op.count * op.group_size * esize;
    case v1::BROADCAST:
      return node == node_of_group_rank_[op.root] ? op.count * esize : 0;
    case v1::ALL_GATHER:
      return members_on_node_[node] * op.count * esize;
    default:
      return 0;
  }
}

// Decided from what the fingerprint pins (kind, dtype, count, root) and the group's layout:
// nodes that agree on the op decide the same.
bool NodesCommunicator::TravelsInline(const core::Collective& op) const {
  if (op.kind == v1::BARRIER) return true;
  if (op.kind == v1::BROADCAST &&
      (op.root < 0 || op.root >= static_cast<int>(node_of_group_rank_.size()))) {
    return false;
  }
  for (size_t node = 0; node < nodes_.size(); ++node) {
    if (InlineBytes(op, static_cast<int>(node)) > kInlineMaxBytes) return false;
  }
  return true;
}

void NodesCommunicator::Pack(const core::Collective& op, std::byte* payload) {
  const int64_t n = op.count;
  const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
  std::vector<Slice> inputs;
  for (const core::LocalMember& m : op.local) inputs.push_back({&m.input, 0});
  switch (op.kind) {
    case v1::ALL_REDUCE:
    case v1::REDUCE_SCATTER: {
      const int64_t total = op.kind == v1::ALL_REDUCE ? n : n * op.group_size;
      const core::View out_view = {{payload, total}};
      const Slice out{&out_view, 0};
      Reduce(op.dtype, partial, 1, inputs, {&out, 1}, total);
      return;
    }
    case v1::BROADCAST:
      for (const core::LocalMember& m : op.local) {
        if (m.group_rank != op.root) continue;
        const core::View out_view = {{payload, n}};
        const Slice out{&out_view, 0};
        const Slice src{&m.input, 0};
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&src, 1}, {&out, 1}, n);
      }
      return;
    case v1::ALL_GATHER: {
      const core::View out_view = {{payload, n * static_cast<int64_t>(op.local.size())}};
      int64_t at = 0;
      for (const Slice& src : inputs) {  // ascending group rank
        const Slice out{&out_view, at};
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&src, 1}, {&out, 1}, n);
        at += n;
      }
      return;
    }
    default:
      return;
  }
}

void NodesCommunicator::Unpack(const core::Collective& op,
                               absl::Span<const std::byte* const> payloads) {
  const int64_t n = op.count;
  const int64_t total = op.kind == v1::REDUCE_SCATTER ? n * op.group_size : n;
  // Read only: core::View names writable runs.
  std::vector<core::View> views;
  for (const std::byte* p : payloads) views.push_back({{const_cast<std::byte*>(p), total}});
  switch (op.kind) {
    case v1::ALL_REDUCE: {
      std::vector<Slice> srcs, dsts;
      for (const core::View& v : views) srcs.push_back({&v, 0});
      for (const core::LocalMember& m : op.local) dsts.push_back({&m.input, 0});
      Reduce(op.dtype, op.reduce_op, op.group_size, srcs, dsts, n);
      return;
    }
    case v1::REDUCE_SCATTER:
      for (const core::LocalMember& m : op.local) {
        std::vector<Slice> srcs;
        for (const core::View& v : views) srcs.push_back({&v, m.group_rank * n});
        const Slice dst{&m.output, 0};
        Reduce(op.dtype, op.reduce_op, op.group_size, srcs, {&dst, 1}, n);
      }
      return;
    case v1::BROADCAST: {
      const Slice src{&views[node_of_group_rank_[op.root]], 0};
      std::vector<Slice> dsts;
      for (const core::LocalMember& m : op.local) {
        if (m.group_rank != op.root) dsts.push_back({&m.input, 0});
      }
      Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&src, 1}, dsts, n);
      return;
    }
    case v1::ALL_GATHER: {
      std::vector<int64_t> next(nodes_.size(), 0);  // next block of each node's part
      for (int q = 0; q < op.group_size; ++q) {
        const int node = node_of_group_rank_[q];
        const core::View part = {{views[node][0].data, n * members_on_node_[node]}};
        const Slice from{&part, next[node]};
        next[node] += n;
        std::vector<Slice> dsts;
        for (const core::LocalMember& m : op.local) dsts.push_back({&m.output, q * n});
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&from, 1}, dsts, n);
      }
      return;
    }
    default:
      return;
  }
}

void NodesCommunicator::Post(const core::Collective& op, Exchange& ex, Outbox& outbox) {
  ex.local = op.local_failure;
  if (ex.local.ok() && absl::Now() > op.deadline) {
    ex.local = absl::DeadlineExceededError(absl::StrCat(
        op.label, " did not complete by its deadline: it waited for ", PeersWithRanks()));
  }
  ex.inline_data = ex.local.ok() && TravelsInline(op);
  const int64_t payload = ex.inline_data ? InlineBytes(op, my_node_) : 0;
  const size_t bytes = sizeof(RecordHeader) + RecordLinks::Padded(static_cast<size_t>(payload));
  if (!outbox.messages.empty() && !outbox.messages.back().sent &&
      outbox.messages.back().bytes + bytes > kStreamMessageBytes) {
    Flush(outbox);
  }
  if (outbox.messages.empty() || outbox.messages.back().sent) {
    outbox.messages.emplace_back().memory = TakeSendMemory();
  }
  Outbox::Message& m = outbox.messages.back();
  std::byte* const record = m.memory.get() + m.bytes;
  RecordHeader header{};
  header.seq = op.seq;
  header.code = static_cast<int32_t>(ex.local.code());
  header.payload_bytes = static_cast<uint32_t>(payload);
  header.fingerprint_hash = HashOf(op.fingerprint);
  std::snprintf(header.fingerprint, sizeof(header.fingerprint), "%s", op.fingerprint.c_str());
  std::snprintf(header.message, sizeof(header.message), "%s",
                std::string(ex.local.message()).c_str());
  std::memcpy(record, &header, sizeof(header));
  if (ex.inline_data) Pack(op, record + sizeof(RecordHeader));
  ex.mine = record;
  m.bytes += bytes;
  ++m.records;
  if (m.bytes >= kStreamFlushBytes) Flush(outbox);
}

absl::Status NodesCommunicator::Finish(const core::Collective& op, Exchange& ex) {
  // Peers whose op failed at their own deadline (a rank missing there) come a moment later.
  const auto timeout = std::max(MillisUntil(op.deadline), absl::ToChronoMilliseconds(kGrace));
  std::vector<const std::byte*> records(nodes_.size());
  std::vector<RecordHeader> headers(nodes_.size());
  for (size_t node = 0; node < nodes_.size(); ++node) {
    records[node] = static_cast<int>(node) == my_node_
                        ? ex.mine
                        : NextRecord(static_cast<int>(node), op.seq, timeout);
    std::memcpy(&headers[node], records[node], sizeof(RecordHeader));
  }
  if (!op.local_failure.ok()) return op.local_failure;
  // A peer's own failure says more than our "we waited for the peers".
  for (size_t node = 0; node < nodes_.size(); ++node) {
    const RecordHeader& h = headers[node];
    if (static_cast<int>(node) != my_node_ && h.code != 0) {
      return absl::Status(
          static_cast<absl::StatusCode>(h.code),
          absl::StrCat(op.label, " failed on node ", nodes_[node], ": ",
                       std::string(h.message, strnlen(h.message, sizeof(h.message)))));
    }
  }
  if (!ex.local.ok()) return ex.local;
  const RecordHeader& mine = headers[my_node_];
  for (size_t node = 0; node < nodes_.size(); ++node) {
    const RecordHeader& h = headers[node];
    if (h.fingerprint_hash != mine.fingerprint_hash ||
        std::strncmp(h.fingerprint, mine.fingerprint, sizeof(h.fingerprint)) != 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("desync across nodes in ", op.label, ": node ", spec_.node, " has ",
                       op.fingerprint, " but node ", nodes_[node], " has ",
                       std::string(h.fingerprint, strnlen(h.fingerprint, sizeof(h.fingerprint)))));
    }
  }
  if (!ex.inline_data) {
    // The collective's segments follow the op's record on every stream: a record left after it
    // in a peer's message means the peer is out of step (an honest one ends its stage here). Its
    // messages are about to be read past, so this is checked before, never after.
    for (size_t node = 0; node < nodes_.size(); ++node) {
      if (static_cast<int>(node) != my_node_ && streams_[node].next != streams_[node].end) {
        throw std::runtime_error(absl::StrCat("node ", nodes_[node], " sent records after ",
                                              op.label, "'s: the nodes are out of step"));
      }
    }
    return RunLarge(op);
  }
  std::vector<const std::byte*> payloads(nodes_.size());
  for (size_t node = 0; node < nodes_.size(); ++node) {
    const int64_t want = InlineBytes(op, static_cast<int>(node));
    if (headers[node].payload_bytes != static_cast<uint64_t>(want)) {
      return absl::InternalError(absl::StrCat(op.label, ": node ", nodes_[node], " sent ",
                                              headers[node].payload_bytes, " bytes, not ", want));
    }
    payloads[node] = records[node] + sizeof(RecordHeader);
  }
  Unpack(op, payloads);
  return absl::OkStatus();
}

LinkOp NodesCommunicator::LinkOpOf(const core::Collective& op) const {
  LinkOp out;
  out.seq = op.seq;
  out.deadline = op.deadline;
  out.segment_bytes = kSegmentBytes;
  return out;
}

void NodesCommunicator::AllreduceAcrossNodes(const core::Collective& op, int64_t n,
                                             absl::Span<std::byte* const> buffers, bool finish) {
  RingSpec ring;
  ring.dtype = op.dtype;
  // Unfinished, MEAN sums: the caller divides once at the end, by the group size.
  ring.op = finish || op.reduce_op != v1::MEAN ? op.reduce_op : v1::SUM;
  ring.divisor = op.group_size;
  ring.count = n;
  ThrowIfFailed(RingAllreduce(*links_, LinkOpOf(op), ring, buffers));
}

void NodesCommunicator::ThrowIfFailed(const absl::Status& status) {
  if (!status.ok()) throw std::runtime_error(std::string(status.message()));
}

void NodesCommunicator::ReduceIntoScratch(const core::Collective& op, int64_t n) {
  const int64_t esize = DTypeSize(op.dtype);
  const v1::ReduceOp partial = op.reduce_op == v1::MEAN ? v1::SUM : op.reduce_op;
  scratch_.resize(static_cast<size_t>(n * esize));
  const core::View scratch = {{scratch_.data(), n}};
  const Slice out{&scratch, 0};
  std::vector<Slice> locals;
  for (const core::LocalMember& m : op.local) locals.push_back({&m.input, 0});
  Reduce(op.dtype, partial, 1, locals, {&out, 1}, n);
  std::byte* const buffer = scratch_.data();
  AllreduceAcrossNodes(op, n, {&buffer, 1}, /*finish=*/false);
}

absl::Status NodesCommunicator::RunLarge(const core::Collective& op) {
  const int64_t esize = DTypeSize(op.dtype);
  const int64_t n = op.count;
  switch (op.kind) {
    case v1::ALL_REDUCE: {
      // Contiguous members (the usual case): the ring reduces them in its own passes and
      // writes each finished block (MEAN divided) to every member.
      std::vector<std::byte*> contiguous;
      for (const core::LocalMember& m : op.local) {
        if (m.input.size() == 1 && m.input[0].count == n) contiguous.push_back(m.input[0].data);
      }
      if (contiguous.size() == op.local.size()) {
        AllreduceAcrossNodes(op, n, contiguous, /*finish=*/true);
        return absl::OkStatus();
      }
      // Fused ops (members' segments): through one contiguous scratch buffer.
      ReduceIntoScratch(op, n);
      const core::View scratch = {{scratch_.data(), n}};
      const Slice from{&scratch, 0};
      std::vector<Slice> locals;
      for (const core::LocalMember& m : op.local) locals.push_back({&m.input, 0});
      Reduce(op.dtype, op.reduce_op, op.group_size, {&from, 1}, locals, n);
      return absl::OkStatus();
    }
    case v1::BROADCAST: {
      if (op.root < 0 || op.root >= static_cast<int>(node_of_group_rank_.size())) {
        return absl::InvalidArgumentError(absl::StrCat(op.label, ": no rank ", op.root));
      }
      scratch_.resize(static_cast<size_t>(n * esize));
      const core::View scratch = {{scratch_.data(), n}};
      const Slice buf{&scratch, 0};
      std::vector<Slice> locals;
      for (const core::LocalMember& m : op.local) {
        locals.push_back({&m.input, 0});
        if (m.group_rank == op.root) {
          const Slice src{&m.input, 0};
          Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&src, 1}, {&buf, 1}, n);
        }
      }
      ThrowIfFailed(LinkBroadcast(*links_, LinkOpOf(op), node_of_group_rank_[op.root],
                                  absl::MakeSpan(scratch_.data(), scratch_.size())));
      Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&buf, 1}, locals, n);
      return absl::OkStatus();
    }
    case v1::REDUCE_SCATTER: {
      // The whole input reduced across nodes, then each local member takes its block.
      const int64_t total = n * op.group_size;
      ReduceIntoScratch(op, total);
      const core::View scratch = {{scratch_.data(), total}};
      for (const core::LocalMember& m : op.local) {
        const Slice from{&scratch, m.group_rank * n};
        const Slice to{&m.output, 0};
        Reduce(op.dtype, op.reduce_op, op.group_size, {&from, 1}, {&to, 1}, n);
      }
      return absl::OkStatus();
    }
    case v1::ALL_GATHER: {
      // Each node's part is its members' inputs (ascending group rank), the parts in node
      // order; every block is then copied to its place in every member's output.
      std::vector<size_t> part_bytes(nodes_.size(), 0);
      for (int node : node_of_group_rank_) part_bytes[node] += static_cast<size_t>(n * esize);
      std::vector<int64_t> next(nodes_.size(), 0);  // elements before each node's next block
      for (size_t i = 1; i < nodes_.size(); ++i) {
        next[i] = next[i - 1] + static_cast<int64_t>(part_bytes[i - 1]) / esize;
      }
      std::vector<int64_t> block_start(op.group_size);
      for (int q = 0; q < op.group_size; ++q) {
        block_start[q] = next[node_of_group_rank_[q]];
        next[node_of_group_rank_[q]] += n;
      }
      const int64_t total = n * op.group_size;
      scratch_.resize(static_cast<size_t>(total * esize));
      const core::View gathered = {{scratch_.data(), total}};
      for (const core::LocalMember& m : op.local) {
        const Slice from{&m.input, 0};
        const Slice to{&gathered, block_start[m.group_rank]};
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&from, 1}, {&to, 1}, n);
      }
      ThrowIfFailed(LinkAllGather(*links_, LinkOpOf(op), part_bytes, scratch_.data()));
      for (int q = 0; q < op.group_size; ++q) {
        const Slice from{&gathered, block_start[q]};
        std::vector<Slice> dsts;
        for (const core::LocalMember& m : op.local) dsts.push_back({&m.output, q * n});
        Reduce(op.dtype, v1::REDUCE_OP_UNSPECIFIED, 1, {&from, 1}, dsts, n);
      }
      return absl::OkStatus();
    }
    default:  // a barrier is its records alone (TravelsInline)
      return absl::InternalError(absl::StrCat(op.label, ": not an op that moves data"));
  }
}

}  // namespace gradsync::backend::cpu
