#pragma once

// The handshake that opens a record link (record_links.h) between two nodes of a group, both
// ends proving they hold the listener's key without sending it, and the marks that resume a
// connection kept from an earlier epoch.
//
// The connector is the later node: Hello (its nonce), then the listener's Challenge (its nonce
// and an HMAC-SHA256 under the key over both), then the connector's Proof (its own HMAC), then
// the listener's Accept (without it the connector tries again). The key is published in the
// job's store, which only holders of the cluster token can read; a fresh nonce on each side
// makes a recorded handshake worthless. The listener runs many handshakes side by side, each
// by a short deadline, and past a few per source address (or the total limit) drops the oldest
// for the newcomer: silent or garbage connections cannot keep a peer out.

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/unique_fd.h"

namespace gradsync::backend::cpu::link {

/// The listener's key (random, published in the store as 2 * kKeyBytes hex digits).
inline constexpr size_t kKeyBytes = 16;
/// A resume mark's size (ResumeMark).
inline constexpr size_t kMarkBytes = 64;

/// TCP_NODELAY, and a large send buffer where the system allows it.
absl::Status SetLinkOptions(int fd);

/// A connection made by a handshake, and its id (the same at both ends: halves of both sides'
/// nonces, in hex).
struct Link {
  UniqueFd fd;
  std::string id;
};

/// Node `me` connects to node `to`, whose listener is at `host`:`port` holding `key` (hex),
/// and runs the handshake; one that fails for a reason that passes (dropped among a stranger's
/// flood, a stranger on a reused port) is tried again until `deadline`. Failures name the
/// attempts and the last reason: UNAVAILABLE (refused, not proven), DEADLINE_EXCEEDED,
/// CANCELLED (cancel_fd fired), INTERNAL (OpenSSL). `source`: this node's own host, which the
/// connection comes from when both are loopback addresses (sock::Connect).
absl::StatusOr<Link> Dial(const std::string& host, const std::string& port, const std::string& key,
                          int me, int to, absl::Time deadline, int cancel_fd,
                          const std::string& source = "");

/// On `listener`, runs the handshakes of the nodes marked in `wanted` (by index; each later
/// than `me`, holding `key`) until each of them connected, by `deadline`: the links by node.
/// DEADLINE_EXCEEDED names the nodes (`nodes`, by index) that did not connect (`partial`: OK,
/// their links left empty); CANCELLED once `cancel_fd` or `stop_fd` (either may be -1) is
/// readable.
absl::StatusOr<std::vector<Link>> AcceptPeers(int listener, const std::string& key, int me,
                                              const std::vector<std::string>& nodes,
                                              std::vector<bool> wanted, absl::Time deadline,
                                              int cancel_fd, int stop_fd = -1,
                                              bool partial = false);

/// The mark a node sends on a connection taken over, after whatever its earlier epoch sent: a
/// magic number, zeros, then an HMAC under the sender's key of this epoch (fresh, so no earlier
/// byte of the stream can equal it) over (from, to, the connection's id). `out`: kMarkBytes.
absl::Status ResumeMark(const std::string& sender_key, int from, int to, const std::string& id,
                        unsigned char* out);

}  // namespace gradsync::backend::cpu::link
