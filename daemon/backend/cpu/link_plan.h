#pragma once

// Which nodes of a job link to which, so that a daemon's links and heartbeats do not grow with
// the job: the peer watch's ring neighbours and fingers at every power of two around the ring;
// a group's ring neighbours and binomial tree.

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

/// The binomial tree over nodes 0..n-1 rooted at 0: node i > 0's parent is i with its lowest set
/// bit cleared; its children are i + 1, i + 2, i + 4, ... below i's lowest set bit (every power
/// of two for the root) and below n. The subtree of i is the contiguous range
/// [i, SubtreeEnd(n, i)), and its children's subtrees follow each other in that order, so
/// gathering up the tree keeps node order. Depth and degree at most ceil(log2 n).
int TreeParent(int me);                        // -1 for the root
std::vector<int> TreeChildren(int n, int me);  // ascending
int SubtreeEnd(int n, int me);

/// The nodes a group's node `me` of `n` links to: its ring neighbours (me ± 1, for the ring
/// collectives) and its tree parent and children (for each op's verdict and inline data).
/// Symmetric; at most 2 + ceil(log2 n) + 1 of them. Ascending, without `me`.
std::vector<int> GroupLinks(int n, int me);

}  // namespace gradsync::backend::cpu
