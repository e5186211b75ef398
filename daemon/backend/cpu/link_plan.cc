// Implementation of link_plan.h.

#include "daemon/backend/cpu/link_plan.h"

#include <algorithm>

namespace gradsync::backend::cpu {
namespace {

// The nodes `distance` places from `me` either way, into `out`.
void AddBothWays(int n, int me, int distance, std::vector<int>& out) {
  out.push_back((me + distance) % n);
  out.push_back(((me - distance) % n + n) % n);
}

std::vector<int> Sorted(std::vector<int> nodes, int me) {
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  nodes.erase(std::remove(nodes.begin(), nodes.end(), me), nodes.end());
  return nodes;
}

}  // namespace

std::vector<int> RingNeighbours(int n, int me, int ring) {
  std::vector<int> out;
  if (n < 2 || me < 0 || me >= n) return out;
  const int reach = ring <= 0 ? n : std::min(ring, n);
  for (int d = 1; d <= reach && d < n; ++d) AddBothWays(n, me, d, out);
  return Sorted(std::move(out), me);
}

std::vector<int> LinkedNodes(int n, int me, int ring) {
  std::vector<int> out = RingNeighbours(n, me, ring);
  if (out.empty() || ring <= 0) return out;
  for (long d = 2; d < n; d *= 2) AddBothWays(n, me, static_cast<int>(d), out);
  return Sorted(std::move(out), me);
}

int TreeParent(int me) { return me <= 0 ? -1 : me & (me - 1); }

int SubtreeEnd(int n, int me) {
  if (me <= 0) return n;
  return static_cast<int>(std::min<long>(n, static_cast<long>(me) + (me & -me)));
}

std::vector<int> TreeChildren(int n, int me) {
  std::vector<int> out;
  if (me < 0 || me >= n) return out;
  const long end = SubtreeEnd(n, me);
  for (long d = 1; me + d < end; d *= 2) out.push_back(static_cast<int>(me + d));
  return out;
}

std::vector<int> GroupLinks(int n, int me) {
  std::vector<int> out = RingNeighbours(n, me, 1);
  if (out.empty()) return out;
  if (me > 0) out.push_back(TreeParent(me));
  for (int child : TreeChildren(n, me)) out.push_back(child);
  return Sorted(std::move(out), me);
}

}  // namespace gradsync::backend::cpu
