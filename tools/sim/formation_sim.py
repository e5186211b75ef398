#!/usr/bin/env python3
"""A discrete-event model of a job's formation and of a small op across 1,000 to 10,000 nodes.

What it models (daemon/core/formation.cc, record_links.h, nodes_communicator.h, link_plan.h):
- formation through the job's store on the root daemon: each daemon starts at a random time in
  [0, --spread] and makes --store_calls calls, one after the other, each a round trip to the
  root, whose store serves calls --store_threads at a time for --store_call seconds each (FIFO);
  the last call is the wait for every rank's key, answered once every daemon has published its
  ranks: the root then sends the list (--ranks_per_node entries of --entry_bytes per node) to
  every daemon, one after the other at --root_bandwidth;
- the group's links at its first op: each daemon connects to its ring neighbours and tree
  partners (link_plan.h GroupLinks), dialling the lower-numbered ones while accepting the others;
  each handshake costs --handshake seconds of each end's time (one at a time per daemon) and
  two round trips;
- the first barrier, and a small all-reduce of --op_bytes: records up the binomial tree (a node
  sends once its own and every child's record came and it has reduced them: --per_message per
  record received, --reduce_bandwidth for the data), the decision back down (each node passes
  it on to its children one after another at --link_bandwidth, --per_message each);
- for comparison, the same op as a ring all-reduce (what gloo runs at these sizes: 2(N - 1)
  steps, each a message of op_bytes / N, --per_message and the delay each).
One-way delay --delay everywhere. Each node's --per_message is drawn from an exponential around
its mean (jitter). What it does not model: CPU contention between daemons, packet loss (the
watch's simulator does: watch_sim.py), TCP slow start, the trainers' side.

Defaults: --per_message 20 us and --delay 0.2 ms as watch_sim.py (calibrated on this machine,
bench/README.md); the store's --store_call 100 us a call on --store_threads 8 and --handshake
1 ms are assumptions (a loopback gRPC call and an authenticated handshake here take about that
much CPU); --root_bandwidth and --link_bandwidth 10 Gb/s (1.25 GB/s).

Run:  python3 tools/sim/formation_sim.py --nodes 1000,10000
"""
import argparse
import heapq
import math
import random
import sys


def tree_parent(i):
    return -1 if i <= 0 else i & (i - 1)


def subtree_end(n, i):
    return n if i <= 0 else min(n, i + (i & -i))


def tree_children(n, i):
    out, d, end = [], 1, subtree_end(n, i)
    while i + d < end:
        out.append(i + d)
        d *= 2
    return out


def group_links(n, i):
    out = {(i + 1) % n, (i - 1) % n}
    if i > 0:
        out.add(tree_parent(i))
    out.update(tree_children(n, i))
    out.discard(i)
    return sorted(out)


class Model:
    def __init__(self, n, a, seed):
        self.n, self.a = n, a
        self.rng = random.Random(seed * 1000003 + n)
        self.cost = [self.rng.expovariate(1.0 / a.per_message) for _ in range(n)]

    def store_phase(self):
        """Every daemon's time when it holds the rank list (discrete events at the root)."""
        a, n = self.a, self.n
        start = [self.rng.random() * a.spread for _ in range(n)]
        events = [(start[i] + a.delay, i, 1) for i in range(n)]  # (arrival at root, node, call)
        heapq.heapify(events)
        threads = [0.0] * a.store_threads
        published = [None] * n
        waiting = []
        while events:
            t, i, call = heapq.heappop(events)
            free = heapq.heappop(threads)
            done = max(t, free) + a.store_call
            heapq.heappush(threads, done)
            if call < a.store_calls - 1:
                if call == a.store_calls - 2:
                    published[i] = done  # the ranks' keys are in
                heapq.heappush(events, (done + 2 * a.delay, i, call + 1))
            else:
                waiting.append(i)
        # The wait is answered when the last rank published; the root sends the list to each.
        ready = max(published)
        list_bytes = n * a.ranks_per_node * a.entry_bytes
        has = [0.0] * n
        t = ready
        for i in sorted(waiting, key=lambda i: self.rng.random()):
            t += list_bytes / a.root_bandwidth
            has[i] = t + a.delay
        return has

    def link_phase(self, start):
        """Every daemon's time when all of its group links are up (handshakes one at a time at
        each end, both ends busy)."""
        a, n = self.a, self.n
        busy = list(start)
        up = list(start)
        pairs = sorted({(min(i, j), max(i, j)) for i in range(n) for j in group_links(n, i)},
                       key=lambda p: max(start[p[0]], start[p[1]]))
        for i, j in pairs:
            begin = max(busy[i], busy[j], start[i], start[j])
            end = begin + a.handshake + 4 * a.delay
            busy[i] = busy[j] = begin + a.handshake
            up[i] = max(up[i], end)
            up[j] = max(up[j], end)
        return up

    def tree_op(self, start, nbytes):
        """Every node's completion of a small op (records up the tree, the decision down)."""
        a, n = self.a, self.n
        sent_up = [0.0] * n
        for i in range(n - 1, -1, -1):  # children before parents: a child's index is larger
            t = start[i]
            for c in tree_children(n, i):
                arrive = sent_up[c] + a.delay + nbytes / a.link_bandwidth
                t = max(t, arrive) + self.cost[i] + nbytes / a.reduce_bandwidth
            sent_up[i] = t + self.cost[i]
        done = [0.0] * n
        done[0] = sent_up[0]
        for i in range(n):  # parents before children
            t = done[i]
            for c in tree_children(n, i):
                t += self.cost[i] + nbytes / a.link_bandwidth
                done[c] = t + a.delay + self.cost[c]
        return done

    def ring_op(self, nbytes):
        a, n = self.a, self.n
        step = a.delay + a.per_message + nbytes / n / a.link_bandwidth
        return 2 * (n - 1) * step


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--spread", type=float, default=0.5, help="daemons start within this, s")
    ap.add_argument("--store_calls", type=int, default=8)
    ap.add_argument("--store_call", type=float, default=100e-6)
    ap.add_argument("--store_threads", type=int, default=8)
    ap.add_argument("--ranks_per_node", type=int, default=1)
    ap.add_argument("--entry_bytes", type=int, default=48, help="one rank's key and value")
    ap.add_argument("--root_bandwidth", type=float, default=1.25e9, help="bytes/s")
    ap.add_argument("--link_bandwidth", type=float, default=1.25e9, help="bytes/s")
    ap.add_argument("--reduce_bandwidth", type=float, default=5e9, help="bytes/s")
    ap.add_argument("--handshake", type=float, default=1e-3)
    ap.add_argument("--per_message", type=float, default=20e-6)
    ap.add_argument("--delay", type=float, default=0.2e-3)
    ap.add_argument("--op_bytes", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    counts = [int(c) for c in a.nodes.split(",")]
    if any(c < 2 or c > 100000 for c in counts) or not 1 <= a.runs <= 20 or \
            not 1 <= a.store_threads <= 1024 or not 2 <= a.store_calls <= 100:
        sys.exit("nodes 2..100000, runs 1..20, store_threads 1..1024, store_calls 2..100")
    print(f"store {a.store_calls} calls x {a.store_call * 1e6:.0f} us on {a.store_threads} "
          f"threads, list {a.ranks_per_node} x {a.entry_bytes} B per node at "
          f"{a.root_bandwidth / 1e9:.2f} GB/s; handshake {a.handshake * 1e3:.1f} ms; per message "
          f"{a.per_message * 1e6:.0f} us, delay {a.delay * 1e3:.2f} ms; op {a.op_bytes} B")
    print(f"{'N':>6} {'links max':>9} {'depth':>5} {'store s':>8} {'links s':>8} "
          f"{'formed s':>9} {'op ms':>8} {'ring op ms':>10} {'ring/tree':>9}")
    for n in counts:
        store, links, formed, op = [], [], [], []
        for run in range(a.runs):
            m = Model(n, a, a.seed + run)
            has = m.store_phase()
            up = m.link_phase(has)
            barrier = m.tree_op(up, 0)
            store.append(max(has))
            links.append(max(up) - max(has))
            formed.append(max(barrier))
            zero = [0.0] * n
            op.append(max(m.tree_op(zero, a.op_bytes)))
        ring = Model(n, a, a.seed).ring_op(a.op_bytes)
        degree = max(len(group_links(n, i)) for i in range(n))
        depth = math.ceil(math.log2(n))
        med = sorted(op)[len(op) // 2]
        print(f"{n:>6} {degree:>9} {depth:>5} {max(store):>8.2f} {max(links):>8.3f} "
              f"{max(formed):>9.2f} {med * 1e3:>8.2f} {ring * 1e3:>10.1f} {ring / med:>8.0f}x",
              flush=True)


if __name__ == "__main__":
    main()
