#pragma once

// Which nodes of a job link to which, so that a daemon's links and heartbeats do not grow with
// the job: ring neighbours, and fingers at every power of two around the ring.

#include <vector>

namespace gradsync::backend::cpu {

/// The nodes that node `me` of `n` (indices into the job's sorted node list) links to: those
/// within `ring` places of it each way around the ring, and those 2, 4, 8, ... places away each
/// way. Symmetric (j is among i's exactly when i is among j's), so both ends of every link agree
/// without a word; at most 2 * (ring + log2 n) of them, and every node reaches every other in at
/// most about log2 n hops over them (a distance is a sum of distinct powers of two). `ring` 0:
/// every other node (the mesh). Ascending, without `me`; empty when n < 2 or `me` is not in [0, n).
std::vector<int> LinkedNodes(int n, int me, int ring);

/// The nodes within `ring` places of `me` each way around the ring of `n` (every other node
/// when `ring` is 0 or reaches around): those whose heartbeats `me` checks and that check its
/// own. A subset of LinkedNodes; ascending, without `me`.
std::vector<int> RingNeighbours(int n, int me, int ring);

}  // namespace gradsync::backend::cpu
