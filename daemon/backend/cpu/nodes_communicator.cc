// Implementation of nodes_communicator.h: the per-op verdict exchange (with small ops' data
// inline), batching of queued ops, the link collectives for larger ops, link failure and abort.

#include "daemon/backend/cpu/nodes_communicator.h"

#include <poll.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/bounded_text.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/store_keys.h"
#include "daemon/backend/cpu/kernels.h"
#include "daemon/backend/cpu/link_collectives.h"
#include "daemon/backend/cpu/link_plan.h"
#include "daemon/backend/cpu/record_links.h"
#include "daemon/backend/cpu/socket.h"

namespace gradsync::backend::cpu {
namespace {

auto Log() { return logging::Logger("cpu"); }

// Send buffers a communicator keeps between stages (a 200 x 40 KiB batch takes about 30).
constexpr size_t kKeptSendMessages = 32;
constexpr uint64_t kStreamMagic = 0x67737265636f7264;  // "gsrecord"

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

// `status` with the op's label in front ("all_reduce job=j group=world seq=3: ..."); OK stays OK.
absl::Status Labeled(const core::Collective& op, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(op.label, ": ", status.message()));
}

}  // namespace

// What travels up the group's tree for each op, on each stream (a node's record covers its
// subtree, a contiguous range of nodes from its own: link_plan.h), and back down as the op's
// decision (the root's record, covering every node): the range's first failure, its first
// node's fingerprint and the first one that differs, then the range's inline data (payload_bytes
// of it, padded to RecordLinks::kAlign so that payloads stay aligned for the reduction kernels):
// the partial reduction of its nodes' contributions, or their parts in node order.
struct NodesCommunicator::RecordHeader {
  uint64_t seq;
  int32_t code;  // of the first failure: one of a node's own before a deadline's, then node order
  uint32_t payload_bytes;
  uint64_t fingerprint_hash;  // of first_node's whole fingerprint (the text below may be cut)
  char fingerprint[240];
  char message[240];    // the failure's
  int32_t failed_node;  // the failure's node; -1 when code is 0
  int32_t first_node;   // the range's first node, whose fingerprint is above
  int32_t other_node;   // the range's first node whose fingerprint differs from it, or -1
  int32_t late;         // the failure is a deadline that passed (this node waited for others)
  uint64_t other_hash;
  char other[240];  // other_node's fingerprint
};

struct NodesCommunicator::Exchange {
  absl::Status local;  // this node's verdict
  bool late = false;   // local failed by the deadline alone
  bool inline_data = false;
  std::vector<std::byte> own;     // this node's record, when it has children to fold in
  const std::byte* up = nullptr;  // the subtree's record, in an outbox message (the root's:
                                  // the decision)
  absl::Status result;            // the op's outcome, once Finish decided it
};

// This node's messages of one stage (its records are read again when each op finishes).
struct NodesCommunicator::Outbox {
  struct Message {
    std::unique_ptr<std::byte[]> memory;  // tuning_.stream_message_bytes
    size_t bytes = sizeof(MessageHeader);
    uint64_t records = 0;
    bool sent = false;
  };
  std::vector<Message> messages;  // the last one is open while not sent
  absl::Time deadline;  // of sending: the stage's latest op deadline, peer_grace from now at least
};

// Where this node is in a peer's current message (from RecordLinks::Receive, valid until the
// next Receive from that peer).
struct NodesCommunicator::PeerStream {
  const std::byte* next = nullptr;  // the current message's next record
  const std::byte* end = nullptr;   // and its end
};

size_t NodesCommunicator::MinStreamMessageBytes(int64_t inline_bytes) {
  static_assert(sizeof(RecordHeader) == 768);  // the wire's (and a multiple of RecordLinks::kAlign)
  return sizeof(MessageHeader) + sizeof(RecordHeader) +
         RecordLinks::Padded(static_cast<size_t>(std::max<int64_t>(0, inline_bytes)));
}

NodesCommunicator::NodesCommunicator(core::CommunicatorSpec spec, const CpuTuning& tuning,
                                     WorkerPool* pool, std::shared_ptr<LinkPark> park)
    : spec_(std::move(spec)), tuning_(tuning), pool_(pool), park_(std::move(park)) {
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
  all_to_all_ = static_cast<int64_t>(nodes_.size()) <= tuning_.all_to_all_max_nodes;
  if (!all_to_all_) {
    parent_ = TreeParent(my_node_);
    children_ = TreeChildren(static_cast<int>(nodes_.size()), my_node_);
  }
  setup_ = ValidateCpuTuning(tuning_);
  if (setup_.ok()) {
    const int fd = sock::NewCancelFd();
    const int err = errno;
    cancel_fd_ = UniqueFd(fd);
    if (fd < 0) {
      setup_ = absl::ResourceExhaustedError(
          absl::StrCat("job=", spec_.job, " group=", spec_.group, ": no eventfd to cancel the ",
                       "group's waits: ", sock::Error("eventfd", err).message()));
    }
  }
}

NodesCommunicator::~NodesCommunicator() { ReleaseLinks(); }

void NodesCommunicator::ReleaseLinks() {
  if (links_) links_->Park();
  streams_.clear();
  links_.reset();
}

void NodesCommunicator::Abort(const absl::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (!aborted_.ok()) return;  // the first status stays
    aborted_ = status.ok() ? absl::InternalError("aborted with an OK status") : status;
  }
  // Wakes the wait the running op is in (if any), and every later one at once: never read back.
  if (cancel_fd_.get() >= 0) sock::Signal(cancel_fd_.get());
}

absl::Status NodesCommunicator::Aborted() const {
  absl::MutexLock lock(&mu_);
  return aborted_;
}

absl::Status NodesCommunicator::Unrunnable(const core::Collective& op) const {
  if (absl::Status aborted = Aborted(); !aborted.ok()) return Labeled(op, aborted);
  if (!setup_.ok()) return Labeled(op, setup_);
  if (!broken_.ok()) return BrokenStatus(op);
  return absl::OkStatus();
}

std::string NodesCommunicator::PeersWithRanks() const {
  // Bounded: a group of hundreds of nodes names the first few and counts the rest.
  std::string out;
  size_t named = 0;
  for (size_t i = 0; i < nodes_.size() && named < kListedInErrors; ++i) {
    if (static_cast<int>(i) == my_node_) continue;
    std::vector<int> ranks;
    for (size_t m = 0; m < spec_.members.size(); ++m) {
      if (node_of_group_rank_[m] == static_cast<int>(i)) ranks.push_back(spec_.members[m]);
    }
    absl::StrAppend(&out, named++ == 0 ? "" : "; ", "node ", nodes_[i], " (ranks ",
                    JoinBounded(ranks, ","), ")");
  }
  if (nodes_.size() - 1 > named) {
    absl::StrAppend(&out, " and ", nodes_.size() - 1 - named, " more node(s)");
  }
  return out;
}

absl::Status NodesCommunicator::Connect(absl::Time deadline) {
  if (links_) return absl::OkStatus();
  RecordLinks::Spec links;
  links.store = spec_.rendezvous;
  links.job = spec_.job;
  // Under the run's token: a late key of an earlier run of this job id is never read.
  links.prefix = absl::StrCat(kRecordLinksKeyPrefix, spec_.run, spec_.run.empty() ? "" : "/",
                              spec_.group, "/");
  links.nodes = nodes_;
  links.me = my_node_;
  // A small group's all-to-all needs every pair (an empty list: every other node).
  if (!all_to_all_) links.peers = GroupLinks(static_cast<int>(nodes_.size()), my_node_);
  const size_t linked = all_to_all_ ? nodes_.size() - 1 : links.peers.size();
  links.max_message_bytes =
      std::max(static_cast<size_t>(tuning_.stream_message_bytes),
               SegmentMessageBytes(static_cast<size_t>(tuning_.segment_bytes)));
  links.cancel_fd = cancel_fd_.get();
  if (park_ != nullptr && !spec_.elastic_home.empty()) {
    links.park = park_.get();
    links.home = spec_.elastic_home;
    links.epoch = spec_.epoch;
  }
  absl::StatusOr<std::unique_ptr<RecordLinks>> connected =
      RecordLinks::Connect(std::move(links), deadline);
  if (!connected.ok()) {
    return absl::Status(connected.status().code(),
                        absl::StrCat("connecting job=", spec_.job, " group=", spec_.group,
                                     " nodes=", nodes_.size(), ": ", connected.status().message()));
  }
  links_ = *std::move(connected);
  streams_.assign(nodes_.size(), PeerStream{});
  if (const int kept = links_->adopted(); kept > 0) {
    Log()->info("job={} group={}: {} of {} links taken over from an earlier epoch, the rest made",
                spec_.job, spec_.group, kept, linked);
  }
  return absl::OkStatus();
}

absl::Status NodesCommunicator::BrokenStatus(const core::Collective& op) const {
  return absl::Status(broken_.code(), absl::StrCat(op.label, ": the group's link to its other ",
                                                   "nodes failed earlier: ", broken_.message()));
}

absl::Status NodesCommunicator::FailLink(const core::Collective& op, const absl::Status& error) {
  // A peer daemon died, or did not reach the op by its deadline, or sent what it should not
  // have. The nodes may now disagree on where the group's sequence stands, so the group stays
  // failed (its ranks form the job again) rather than reconnecting to stale rendezvous keys.
  if (error.code() == absl::StatusCode::kUnavailable && Aborted().ok() &&
      tuning_.await_peer_watch > absl::ZeroDuration() && cancel_fd_.get() >= 0) {
    // Most likely a node lost: its cause comes from the peer watch (CpuTuning), with the links
    // still open so that no peer takes our closing them for a loss of ours.
    (void)sock::WaitFor(cancel_fd_.get(), POLLIN, absl::Now() + tuning_.await_peer_watch);
  }
  ReleaseLinks();
  if (absl::Status aborted = Aborted(); !aborted.ok()) {
    broken_ = aborted;
    return Labeled(op, aborted);
  }
  if (error.code() == absl::StatusCode::kDeadlineExceeded) {
    broken_ = absl::DeadlineExceededError(
        absl::StrCat(op.label, " did not complete by its deadline: ", "it waited for ",
                     PeersWithRanks(), " (", error.message(), ")"));
  } else {
    broken_ = absl::Status(error.code(), absl::StrCat(op.label, " across ", nodes_.size(),
                                                      " nodes failed (peers: ", PeersWithRanks(),
                                                      "): ", error.message()));
  }
  return broken_;
}

absl::Status NodesCommunicator::Run(const core::Collective& op) {
  const core::Collective* const ops[] = {&op};
  absl::Status out = absl::InternalError(absl::StrCat(op.label, ": no outcome"));
  RunBatch(ops, [&out](size_t, absl::Status s) { out = std::move(s); });
  return out;
}

void NodesCommunicator::RunBatch(absl::Span<const core::Collective* const> ops,
                                 absl::FunctionRef<void(size_t, absl::Status)> finished) {
  size_t i = 0;
  while (i < ops.size()) {
    if (absl::Status s = Unrunnable(*ops[i]); !s.ok()) {
      finished(i, std::move(s));
      ++i;
      continue;
    }
    // Connecting is a rendezvous with every node of the group, which each starts at its first
    // op of the group: allow the peers peer_grace past this op's deadline (the op still fails
    // if late).
    if (absl::Status s = Connect(std::max(ops[i]->deadline, absl::Now() + tuning_.peer_grace));
        !s.ok()) {
      finished(i, FailLink(*ops[i], s));
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
  const size_t max_ops = static_cast<size_t>(tuning_.max_stage_ops);
  std::vector<std::pair<uintptr_t, uintptr_t>> written, read;
  size_t end = begin;
  for (; end < ops.size() && end - begin < max_ops; ++end) {
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
    return std::unique_ptr<std::byte[]>(
        new std::byte[static_cast<size_t>(tuning_.stream_message_bytes)]);
  }
  std::unique_ptr<std::byte[]> m = std::move(free_send_memory_.back());
  free_send_memory_.pop_back();
  return m;
}

absl::StatusOr<const std::byte*> NodesCommunicator::NextRecord(int node, uint64_t seq,
                                                               absl::Time deadline) {
  PeerStream& stream = streams_[node];
  if (stream.next == stream.end) {
    GRADSYNC_ASSIGN_OR_RETURN(const absl::Span<const std::byte> message,
                              links_->Receive(node, deadline));
    const std::byte* const m = message.data();
    MessageHeader header{};  // a message too short to hold one fails the magic check
    if (message.size() >= sizeof(header)) std::memcpy(&header, m, sizeof(header));
    if (header.magic != kStreamMagic || header.bytes != message.size() || header.records == 0) {
      return absl::InternalError(absl::StrCat("malformed stream message from node ", nodes_[node]));
    }
    if (node == parent_) {
      // The decisions, on down the tree as they came: every node reads the same bytes.
      for (int child : children_) {
        const absl::Span<const std::byte> parts[] = {message};
        GRADSYNC_RETURN_IF_ERROR(links_->SendTo(child, parts, deadline));
      }
    }
    stream.next = m + sizeof(header);
    stream.end = m + header.bytes;
  }
  const std::byte* const record = stream.next;
  RecordHeader header;
  if (static_cast<size_t>(stream.end - record) < sizeof(header)) {
    return absl::InternalError(absl::StrCat("malformed stream message from node ", nodes_[node]));
  }
  std::memcpy(&header, record, sizeof(header));
  const size_t bytes = sizeof(header) + RecordLinks::Padded(header.payload_bytes);
  if (header.seq != seq || static_cast<size_t>(stream.end - record) < bytes) {
    return absl::InternalError(absl::StrCat("node ", nodes_[node], " sent the record of seq ",
                                            header.seq, " where seq ", seq,
                                            " was due: the nodes are out of step"));
  }
  // A record covers the sender's subtree (the root's, every node): the nodes it names lie there.
  const int first = node == parent_ ? 0 : node;
  const int end = all_to_all_ ? node + 1 : SubtreeEnd(static_cast<int>(nodes_.size()), first);
  const auto within = [&](int32_t i) { return i >= first && i < end; };
  if (header.first_node != first || (header.code != 0 && !within(header.failed_node)) ||
      (header.other_node != -1 && !within(header.other_node)) || header.code < 0 ||
      header.code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::InternalError(absl::StrCat("node ", nodes_[node],
                                            " sent a malformed record of seq ", seq,
                                            " (nodes or status out of range)"));
  }
  stream.next = record + bytes;
  return record;
}

absl::Status NodesCommunicator::Flush(Outbox& outbox) {
  if (outbox.messages.empty() || outbox.messages.back().sent) return absl::OkStatus();
  Outbox::Message& m = outbox.messages.back();
  const MessageHeader header{kStreamMagic, m.bytes, m.records, {}};
  std::memcpy(m.memory.get(), &header, sizeof(header));
  m.sent = true;
  // To every node in an all-to-all; else up the tree, and the root's records, the decisions,
  // down to its children.
  const absl::Span<const std::byte> parts[] = {{m.memory.get(), m.bytes}};
  if (all_to_all_) return links_->SendTo(RecordLinks::kEveryPeer, parts, outbox.deadline);
  if (parent_ >= 0) return links_->SendTo(parent_, parts, outbox.deadline);
  for (int child : children_) {
    GRADSYNC_RETURN_IF_ERROR(links_->SendTo(child, parts, outbox.deadline));
  }
  return absl::OkStatus();
}

void NodesCommunicator::RunStage(absl::Span<const core::Collective* const> ops, size_t first,
                                 absl::FunctionRef<void(size_t, absl::Status)> finished) {
  std::vector<Exchange> exchanges(ops.size());
  Outbox outbox;
  // Peers whose op failed at their own deadline come a moment later (as in Finish).
  outbox.deadline = absl::Now() + tuning_.peer_grace;
  for (const core::Collective* op : ops) outbox.deadline = std::max(outbox.deadline, op->deadline);
  // Every op's own verdict first: the wait for the children's records must not make it late.
  for (size_t k = 0; k < ops.size(); ++k) Judge(*ops[k], exchanges[k]);
  absl::Status link;  // not OK once the group's link failed
  for (size_t k = 0; k < ops.size() && link.ok(); ++k) link = Post(*ops[k], exchanges[k], outbox);
  if (link.ok()) link = Flush(outbox);
  size_t done = 0;  // ops told to `finished`
  for (; done < ops.size() && link.ok(); ++done) {
    link = Finish(*ops[done], exchanges[done]);
    if (!link.ok()) break;
    finished(first + done, std::move(exchanges[done].result));
  }
  if (link.ok()) {
    // A few kept for the next stage; a large batch's others go back to the allocator.
    for (Outbox::Message& m : outbox.messages) {
      if (free_send_memory_.size() < kKeptSendMessages) {
        free_send_memory_.push_back(std::move(m.memory));
      }
    }
    return;
  }
  // Every op is told once: a link fails only while some are left (their records or data).
  finished(first + done, FailLink(*ops[done], link));
  for (size_t k = done + 1; k < ops.size(); ++k) finished(first + k, Unrunnable(*ops[k]));
}

void NodesCommunicator::Judge(const core::Collective& op, Exchange& ex) const {
  ex.local = op.local_failure;
  if (ex.local.ok() && absl::Now() > op.deadline) {
    ex.local = absl::DeadlineExceededError(absl::StrCat(
        op.label, " did not complete by its deadline: it waited for ", PeersWithRanks()));
    ex.late = true;
  }
  ex.inline_data = ex.local.ok() && TravelsInline(op);
}

absl::StatusOr<std::byte*> NodesCommunicator::Reserve(Outbox& outbox, size_t bytes) {
  if (!outbox.messages.empty() && !outbox.messages.back().sent &&
      outbox.messages.back().bytes + bytes > static_cast<size_t>(tuning_.stream_message_bytes)) {
    GRADSYNC_RETURN_IF_ERROR(Flush(outbox));
  }
  if (outbox.messages.empty() || outbox.messages.back().sent) {
    outbox.messages.emplace_back().memory = TakeSendMemory();
  }
  Outbox::Message& m = outbox.messages.back();
  return m.memory.get() + m.bytes;
}

absl::Status NodesCommunicator::Commit(Outbox& outbox, const std::byte* record) {
  RecordHeader header;
  std::memcpy(&header, record, sizeof(header));
  Outbox::Message& m = outbox.messages.back();
  m.bytes += sizeof(RecordHeader) + RecordLinks::Padded(header.payload_bytes);
  ++m.records;
  if (m.bytes >= static_cast<size_t>(tuning_.stream_flush_bytes)) return Flush(outbox);
  return absl::OkStatus();
}

void NodesCommunicator::Own(const core::Collective& op, Exchange& ex, std::byte* record) {
  int64_t payload = ex.inline_data ? SubtreeBytes(op, my_node_, my_node_ + 1) : 0;
  if (ex.inline_data) {
    // A contribution this node cannot pack fails the op by its verdict, on every node.
    if (absl::Status packed = Pack(op, record + sizeof(RecordHeader)); !packed.ok()) {
      ex.local = Labeled(op, packed);
      ex.inline_data = false;
      payload = 0;
    }
  }
  RecordHeader header{};
  header.seq = op.seq;
  header.code = static_cast<int32_t>(ex.local.code());
  header.payload_bytes = static_cast<uint32_t>(payload);
  header.fingerprint_hash = HashOf(op.fingerprint);
  std::snprintf(header.fingerprint, sizeof(header.fingerprint), "%s", op.fingerprint.c_str());
  std::snprintf(header.message, sizeof(header.message), "%s",
                std::string(ex.local.message()).c_str());
  header.failed_node = ex.local.ok() ? -1 : my_node_;
  header.first_node = my_node_;
  header.other_node = -1;
  header.late = ex.late ? 1 : 0;
  std::memcpy(record, &header, sizeof(header));
}

namespace {

bool SameFingerprint(uint64_t hash_a, const char* a, uint64_t hash_b, const char* b, size_t n) {
  return hash_a == hash_b && std::strncmp(a, b, n) == 0;
}

}  // namespace

void NodesCommunicator::Fold(RecordHeader& into, const RecordHeader& next) const {
  // The first failure: a node's own before a deadline's (a peer's own failure says more than
  // "we waited for the peers"), then node order (`into`'s nodes come first).
  if (next.code != 0 && (into.code == 0 || (into.late != 0 && next.late == 0))) {
    into.code = next.code;
    into.failed_node = next.failed_node;
    into.late = next.late;
    std::memcpy(into.message, next.message, sizeof(into.message));
  }
  if (into.other_node >= 0) return;
  if (!SameFingerprint(into.fingerprint_hash, into.fingerprint, next.fingerprint_hash,
                       next.fingerprint, sizeof(into.fingerprint))) {
    into.other_node = next.first_node;
    into.other_hash = next.fingerprint_hash;
    std::memcpy(into.other, next.fingerprint, sizeof(into.other));
  } else if (next.other_node >= 0) {
    into.other_node = next.other_node;
    into.other_hash = next.other_hash;
    std::memcpy(into.other, next.other, sizeof(into.other));
  }
}

void NodesCommunicator::FoldIn(const core::Collective& op, RecordHeader& folded,
                               const std::byte* record, int first, int end) const {
  RecordHeader h;
  std::memcpy(&h, record, sizeof(h));
  // Nodes that failed or disagree carry no data; those that agree with the ones before, and
  // so with this node's view of the op, which sizes the part, carry exactly their part.
  char mine[sizeof(h.fingerprint)] = {};
  std::snprintf(mine, sizeof(mine), "%s", op.fingerprint.c_str());
  const bool agrees = h.code == 0 && h.other_node < 0 &&
                      SameFingerprint(h.fingerprint_hash, h.fingerprint, folded.fingerprint_hash,
                                      folded.fingerprint, sizeof(h.fingerprint)) &&
                      SameFingerprint(h.fingerprint_hash, h.fingerprint, HashOf(op.fingerprint),
                                      mine, sizeof(mine));
  const int64_t want = agrees && TravelsInline(op) ? SubtreeBytes(op, first, end) : 0;
  if (agrees && h.payload_bytes != static_cast<uint64_t>(want)) {
    const std::string text = absl::StrCat(op.label, ": node ", nodes_[first], " sent ",
                                          h.payload_bytes, " bytes, not ", want);
    h.code = static_cast<int32_t>(absl::StatusCode::kInternal);
    h.failed_node = first;
    h.late = 0;
    std::snprintf(h.message, sizeof(h.message), "%s", text.c_str());
  }
  Fold(folded, h);
}

absl::Status NodesCommunicator::Post(const core::Collective& op, Exchange& ex, Outbox& outbox) {
  const int64_t most =
      ex.inline_data
          ? SubtreeBytes(op, my_node_, SubtreeEnd(static_cast<int>(nodes_.size()), my_node_))
          : 0;
  if (children_.empty()) {  // a leaf (or all-to-all): its own record goes out as it is
    GRADSYNC_ASSIGN_OR_RETURN(
        std::byte* const record,
        Reserve(outbox, sizeof(RecordHeader) + RecordLinks::Padded(static_cast<size_t>(most))));
    Own(op, ex, record);
    ex.up = record;
    return Commit(outbox, record);
  }
  ex.own.resize(sizeof(RecordHeader) +
                RecordLinks::Padded(static_cast<size_t>(SubtreeBytes(op, my_node_, my_node_ + 1))));
  Own(op, ex, ex.own.data());
  // This node's record, then its children's in node order (each child's subtree follows the one
  // before).
  const absl::Time wait_until = std::max(op.deadline, absl::Now() + tuning_.peer_grace);
  std::vector<const std::byte*> records = {ex.own.data()};
  std::vector<int> firsts = {my_node_};
  for (int child : children_) {
    // What this node holds goes out before it waits: a node may run its ops one by one, waiting
    // for each one's decision before it sends the next op's record.
    if (streams_[child].next == streams_[child].end) GRADSYNC_RETURN_IF_ERROR(Flush(outbox));
    GRADSYNC_ASSIGN_OR_RETURN(const std::byte* const record, NextRecord(child, op.seq, wait_until));
    records.push_back(record);
    firsts.push_back(child);
  }
  const int end = SubtreeEnd(static_cast<int>(nodes_.size()), my_node_);
  RecordHeader folded = FoldAll(op, records, firsts, end);
  GRADSYNC_ASSIGN_OR_RETURN(
      std::byte* const record,
      Reserve(outbox, sizeof(RecordHeader) + RecordLinks::Padded(static_cast<size_t>(
                                                 Carries(op, folded) ? most : 0))));
  if (absl::Status combined = CombineInto(op, folded, records, firsts, end, record);
      !combined.ok()) {
    ex.local = combined;
  }
  ex.up = record;
  return Commit(outbox, record);
}

NodesCommunicator::RecordHeader NodesCommunicator::FoldAll(
    const core::Collective& op, absl::Span<const std::byte* const> records,
    absl::Span<const int> firsts, int end) const {
  RecordHeader folded;
  std::memcpy(&folded, records[0], sizeof(folded));
  for (size_t i = 1; i < records.size(); ++i) {
    FoldIn(op, folded, records[i], firsts[i], i + 1 < firsts.size() ? firsts[i + 1] : end);
  }
  return folded;
}

bool NodesCommunicator::Carries(const core::Collective& op, const RecordHeader& folded) const {
  return folded.code == 0 && folded.other_node < 0 && TravelsInline(op);
}

absl::Status NodesCommunicator::CombineInto(const core::Collective& op, RecordHeader& folded,
                                            absl::Span<const std::byte* const> records,
                                            absl::Span<const int> firsts, int end,
                                            std::byte* record) const {
  folded.payload_bytes = 0;
  absl::Status combined;
  if (Carries(op, folded)) {
    std::vector<const std::byte*> payloads;
    for (const std::byte* r : records) payloads.push_back(r + sizeof(RecordHeader));
    combined = Combine(op, firsts, end, payloads, record + sizeof(RecordHeader));
    if (combined.ok()) {
      folded.payload_bytes = static_cast<uint32_t>(SubtreeBytes(op, firsts[0], end));
    } else {
      // Every node combining the same bytes fails alike.
      combined = Labeled(op, combined);
      folded.code = static_cast<int32_t>(combined.code());
      folded.failed_node = my_node_;
      folded.late = 0;
      std::snprintf(folded.message, sizeof(folded.message), "%s",
                    std::string(combined.message()).c_str());
    }
  }
  std::memcpy(record, &folded, sizeof(folded));
  return combined;
}

absl::Status NodesCommunicator::Verdict(const core::Collective& op, const Exchange& ex,
                                        const RecordHeader& decision) const {
  if (!op.local_failure.ok()) return op.local_failure;
  if (decision.code != 0) {
    if (decision.failed_node == my_node_ && !ex.local.ok()) return ex.local;
    return absl::Status(
        static_cast<absl::StatusCode>(decision.code),
        absl::StrCat(
            op.label, " failed on node ", nodes_[decision.failed_node], ": ",
            std::string(decision.message, strnlen(decision.message, sizeof(decision.message)))));
  }
  if (!ex.local.ok()) return ex.local;
  const auto text = [](const char* s, size_t n) { return std::string(s, strnlen(s, n)); };
  const uint64_t mine = HashOf(op.fingerprint);
  char own[sizeof(decision.fingerprint)] = {};
  std::snprintf(own, sizeof(own), "%s", op.fingerprint.c_str());
  int other = -1;
  std::string theirs;
  if (!SameFingerprint(mine, own, decision.fingerprint_hash, decision.fingerprint, sizeof(own))) {
    other = 0;
    theirs = text(decision.fingerprint, sizeof(decision.fingerprint));
  } else if (decision.other_node >= 0) {
    other = decision.other_node;
    theirs = text(decision.other, sizeof(decision.other));
  }
  if (other >= 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("desync across nodes in ", op.label, ": node ", spec_.node, " has ",
                     op.fingerprint, " but node ", nodes_[other], " has ", theirs));
  }
  return absl::OkStatus();
}

absl::StatusOr<const std::byte*> NodesCommunicator::Decide(const core::Collective& op, Exchange& ex,
                                                           absl::Time wait_until) {
  // Every node folds the same records in node order: every node decides alike, bit for bit.
  const int n = static_cast<int>(nodes_.size());
  std::vector<const std::byte*> records(n);
  for (int node = 0; node < n; ++node) {
    if (node == my_node_) {
      records[node] = ex.up;
    } else {
      GRADSYNC_ASSIGN_OR_RETURN(records[node], NextRecord(node, op.seq, wait_until));
    }
  }
  // Node 0's record is taken as it is (NextRecord checked whose it is); every later one is
  // checked against it. The decision goes to ex.own (unused here: no node has children).
  std::vector<int> firsts(n);
  for (int node = 0; node < n; ++node) firsts[node] = node;
  RecordHeader folded = FoldAll(op, records, firsts, n);
  const int64_t bytes = Carries(op, folded) ? SubtreeBytes(op, 0, n) : 0;
  ex.own.resize(sizeof(RecordHeader) + RecordLinks::Padded(static_cast<size_t>(bytes)));
  (void)CombineInto(op, folded, records, firsts, n, ex.own.data());
  return ex.own.data();
}

absl::Status NodesCommunicator::Finish(const core::Collective& op, Exchange& ex) {
  GRADSYNC_RETURN_IF_ERROR(Aborted());
  // Peers whose op failed at their own deadline (a rank missing there) come a moment later.
  // One absolute time, however deep the tree: waiting for N nodes cannot stretch it.
  const absl::Time wait_until = std::max(op.deadline, absl::Now() + tuning_.peer_grace);
  const std::byte* decision = ex.up;
  if (all_to_all_) {
    GRADSYNC_ASSIGN_OR_RETURN(decision, Decide(op, ex, wait_until));
  } else if (parent_ >= 0) {
    GRADSYNC_ASSIGN_OR_RETURN(decision, NextRecord(parent_, op.seq, wait_until));
  }
  RecordHeader header;
  std::memcpy(&header, decision, sizeof(header));
  ex.result = Verdict(op, ex, header);
  if (!ex.result.ok()) return absl::OkStatus();
  if (!ex.inline_data) {
    // The collective's segments follow the op's record on the streams: a record left after it
    // in a peer's message means the peer is out of step (an honest one ends its stage here). Its
    // messages are about to be read past, so this is checked before, never after.
    for (size_t node = 0; node < nodes_.size(); ++node) {
      if (static_cast<int>(node) != my_node_ && streams_[node].next != streams_[node].end) {
        return absl::InternalError(absl::StrCat("node ", nodes_[node], " sent records after ",
                                                op.label, "'s: the nodes are out of step"));
      }
    }
    if (op.kind == v1::BROADCAST &&
        (op.root < 0 || op.root >= static_cast<int>(node_of_group_rank_.size()))) {
      // Every node that agreed on the op ends here, before the links carry anything of it.
      ex.result = absl::InvalidArgumentError(absl::StrCat(op.label, ": no rank ", op.root));
      return absl::OkStatus();
    }
    return RunLarge(op);  // ex.result stays OK: a failure there fails the link
  }
  const int64_t want = SubtreeBytes(op, 0, static_cast<int>(nodes_.size()));
  if (header.payload_bytes != static_cast<uint64_t>(want)) {
    ex.result = absl::InternalError(absl::StrCat(
        op.label, ": the decision from node ", nodes_[parent_ >= 0 ? parent_ : my_node_],
        " carries ", header.payload_bytes, " bytes, not ", want));
    return absl::OkStatus();
  }
  ex.result = Labeled(op, Unpack(op, decision + sizeof(RecordHeader)));
  return absl::OkStatus();
}

}  // namespace gradsync::backend::cpu
