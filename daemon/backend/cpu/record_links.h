#pragma once

// The record streams of one group between its nodes: one TCP connection per pair of nodes,
// read and written by the group's own thread (no transport thread, no hand-off).

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/store.h"
#include "common/unique_fd.h"
#include "daemon/backend/cpu/link_park.h"

namespace gradsync::backend::cpu {

/// One TCP connection per pair of the group's nodes, each carrying a stream of messages both
/// ways (a message: a 64-byte frame header holding its length, then its bytes; a message whose
/// size is a multiple of 64 bytes is returned 64-byte aligned). The thread that sends and receives
/// is the caller's: a message leaves in one system call when the socket has room, and a node
/// waiting for a peer's message sleeps in poll(2) on that peer's socket, woken by the kernel when
/// the bytes arrive. (Gloo's unbound buffers cost three messages per send, a receive-ready notice,
/// a send-ready notice and the data, and hand every receive from Gloo's device thread to the
/// waiting one; on a small op across two nodes that was most of the daemon's time.)
///
/// Connecting: every node listens on an ephemeral port of its address and publishes
/// "host port key" in the job's store under `prefix` (the key: 128 random bits); the node
/// later in `nodes` connects to the earlier one, and both prove they hold the earlier node's key
/// without sending it (link_handshake.h). A passive observer learns nothing that lets it join,
/// and a host that cannot read the job's store (the cluster token protects it) cannot take a
/// peer's place; silent or garbage connections cannot keep a peer out. (The records themselves
/// are not encrypted.)
///
/// Taking over (Spec::park): a node takes the connections kept for this job to the group's
/// nodes (LinkPark), publishes their ids with its address, and reads the publication of every
/// node it took one for; a pair takes over the connection of least id that both its ends
/// published and skips the handshake, any other pair connects afresh; the connections taken
/// and not used go back to the park (for the epoch's other groups). Both ends see the same two
/// lists, so they always decide alike. On a connection taken over, each end sends a resume mark (an
/// HMAC under its fresh key of this epoch, so no byte of an earlier epoch can equal it) and reads,
/// discarding, up to the peer's: whatever the old epoch left in the stream, even a message cut in
/// half, is skipped. Park sends each peer an end mark first, so a peer still in the old epoch fails
/// its wait on this node at once (UNAVAILABLE), as it did when the connection closed.
///
/// Sending never waits on a peer that is itself sending: while a peer's socket is full, Send
/// reads whatever any peer sent into that peer's receive buffer, so two nodes sending each
/// other a stage's records at once both progress (the buffer grows to what the peer sent ahead,
/// at most its stage; it shrinks back once drained).
///
/// Not thread-safe: one thread (the group's) calls it. Failures are statuses naming the peer:
/// UNAVAILABLE for a closed or broken connection, DEADLINE_EXCEEDED when the deadline passed,
/// CANCELLED when Spec::cancel_fd fired.
class RecordLinks {
 public:
  struct Spec {
    gradsync::Store* store = nullptr;  // the job's store
    std::string job;
    std::string prefix;              // keys of this group's links (run and group in it)
    std::vector<std::string> nodes;  // the group's nodes ("host:port"), sorted
    int me = -1;                     // this node's index in `nodes`
    // The nodes (indices) this node links to; empty: every other node. Both ends of a link must
    // list each other (link_plan.h's plans do). Sends to "every peer" go to these.
    std::vector<int> peers;
    // Connect succeeds with the peers that connected by the deadline; the link to each other
    // one is failed (UNAVAILABLE or DEADLINE_EXCEEDED naming it; Connected says which).
    bool partial = false;
    size_t max_message_bytes = 1 << 20;  // a longer incoming message fails the link
    // An eventfd (or -1): once readable, every wait here (connecting included) returns
    // CANCELLED at once; the links stay as they were (the owner decides what follows).
    int cancel_fd = -1;
    // An elastic job's group: Connect takes over one of the connections to each of this
    // group's nodes that `park` keeps for `home` (the job's id) where the peer kept the same
    // one, and Park leaves them there for the next epoch (`epoch`: this group's).
    LinkPark* park = nullptr;
    std::string home;
    int epoch = 0;
  };

  /// Connects to every other node of the group (or Spec::peers), by `deadline`: dials the
  /// earlier ones while it accepts the later ones, so no node waits for another's dialing.
  static absl::StatusOr<std::unique_ptr<RecordLinks>> Connect(Spec spec, absl::Time deadline);
  /// Closes every connection after what was sent (the peers read it before they see the end).
  ~RecordLinks();
  RecordLinks(const RecordLinks&) = delete;
  RecordLinks& operator=(const RecordLinks&) = delete;

  /// Sends one message to every peer, after the earlier ones. Returns once the kernel holds all
  /// of it (so `message` may be reused), or fails by `deadline`.
  absl::Status Send(absl::Span<const std::byte> message, absl::Time deadline);
  /// Sends one message, the concatenation of `parts` (at most kMaxParts), to `node` only, or
  /// to every peer when `node` is kEveryPeer; as Send otherwise (while a socket is full, every
  /// peer is read).
  static constexpr size_t kMaxParts = 3;
  static constexpr int kEveryPeer = -1;

  /// A message whose size is a multiple of kAlign is returned kAlign-aligned (so is every one
  /// after it); Padded rounds a size up to that.
  static constexpr size_t kAlign = 64;
  static constexpr size_t Padded(size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }
  absl::Status SendTo(int node, absl::Span<const absl::Span<const std::byte>> parts,
                      absl::Time deadline);

  /// The next message from `node`, whole. Stays valid until the next Receive from that node
  /// (Sends in between may read more from it, but never move this one).
  absl::StatusOr<absl::Span<const std::byte>> Receive(int node, absl::Time deadline);

  int nodes() const { return static_cast<int>(spec_.nodes.size()); }
  /// Whether this node has a link to `node` (Spec::peers).
  bool Linked(int node) const;
  /// Whether the link to `node` connected (Spec::partial: a linked node may not have); its
  /// failure when not (OK when it did).
  absl::Status ConnectError(int node) const;
  /// The connection to `node` (-1 when not linked), for a caller that polls several links at
  /// once; only to wait for it to be readable (BufferedFrom first: bytes may wait here).
  int PollFd(int node) const;
  int me() const { return spec_.me; }
  const std::string& node(int i) const { return spec_.nodes[i]; }

  /// Fails the link to `node` with `status` for good and shuts its connection down (the peer
  /// sees its end at once); what was received from it before stays readable.
  void Drop(int node, absl::Status status);
  /// Ends what this node sends to `node` (a FIN after what was sent); reading goes on.
  void CloseWrite(int node);

  /// Whether `node` closed its end (an orderly close: what it sent before stays readable).
  bool PeerClosed(int node) const;
  /// Bytes received from `node` and not yet returned by Receive (for tests).
  size_t BufferedFrom(int node) const;

  /// Leaves each sound connection in Spec::park (when set) after an end mark: one that did not
  /// fail, was not closed by either end, and carries no message cut in half; the others close
  /// when this is destroyed. Nothing may be sent or received after.
  void Park();
  /// Connections taken over from an earlier epoch at Connect.
  int adopted() const;
  bool Adopted(int node) const;

 private:
  struct Peer;
  explicit RecordLinks(Spec spec);
  struct Resuming;
  class Accepting;
  absl::Status Fail(int node, absl::Status status);
  // Dials every linked earlier node not taken over (`addresses`: ReadAddresses'; Spec::partial:
  // those empty are waited for), from `host`.
  absl::Status DialEarlier(std::vector<std::vector<std::string>> addresses, const std::string& host,
                           absl::Time deadline);
  static absl::Status EndedError();
  // Looks at the frames `p` received past those looked at before, up to its end mark if it
  // came (Peer::ended): a Send blocked on a peer that parked its end fails at once.
  void Walk(Peer& p) const;
  // The published "host port key [ids]" of the nodes `published`, split, by node index.
  absl::StatusOr<std::vector<std::vector<std::string>>> ReadAddresses(
      const std::vector<int>& published, absl::Time deadline);
  // Takes over the connections `kept` from an earlier epoch that the peer kept too (`parts_of`:
  // ReadAddresses'), the rest back to the park; resumes them. `key`: this node's of this epoch.
  absl::Status TakeOver(std::map<int, std::vector<LinkPark::Link>>& kept,
                        const std::vector<std::vector<std::string>>& parts_of,
                        const std::string& key, absl::Time deadline);
  // The resume marks on the connections taken over, both ways, by `deadline`.
  absl::Status Resume(std::vector<Resuming>& resuming, absl::Time deadline);
  // Reads what `node`'s socket holds into its buffer, without waiting. OK when nothing is there.
  absl::Status ReadAvailable(int node);
  std::string Name(int node) const;  // "node host:port"

  const Spec spec_;
  std::vector<Peer> peers_;  // by node index; peers_[me] unused
};

}  // namespace gradsync::backend::cpu
