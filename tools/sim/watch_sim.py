#!/usr/bin/env python3
"""A discrete-event simulator of gradsync's peer watch at 1,000 to 10,000 nodes.

What it models (daemon/backend/cpu/link_peer_watch.h, link_plan.h):
- the link plan: node i links to i +- 1..ring and i +- 2, 4, 8, ... (mod N); it exchanges
  heartbeats every --interval with its ring neighbours only, checks each for silence every
  --tick, and declares one lost after --timeout without a word;
- a watcher that finds a neighbour silent suspects it and passes the suspicion on (once per
  renewal; a suspicion lasts two timeouts); a node is lost once suspicions from two of its
  watchers are live (one when only one watches it);
- a node that finds (or is told of) a loss sends a notice on every link but the one it came on,
  once; a node reported lost is not believed;
- every link is a TCP stream: each message is lost with probability --loss and retransmitted
  after an RTO (--rto_min, doubling on each loss of the same message), and nothing behind it on
  that stream is delivered before it (head-of-line blocking); one-way delay --delay plus
  --per_message of the receiver's time (calibrated on this machine: see bench/README.md).
What it does not model: CPU contention between daemons, TCP's congestion window, a node's
process being slow (only whole freezes), the data plane.

Scenarios per N: (1) steady state for --steady seconds at --loss: false positives (a live node
declared lost by anyone); (2) one node frozen at a random time: time until every survivor
knows, and how many notices were sent.

Run:  python3 tools/sim/watch_sim.py --nodes 1000,10000 --loss 0,0.01
"""
import argparse
import heapq
import random
import statistics
import sys


def ring_neighbours(n, me, ring):
    out = set()
    for d in range(1, min(ring, n) + 1):
        out.add((me + d) % n)
        out.add((me - d) % n)
    out.discard(me)
    return sorted(out)


def linked_nodes(n, me, ring):
    out = set(ring_neighbours(n, me, ring))
    d = 2
    while d < n:
        out.add((me + d) % n)
        out.add((me - d) % n)
        d *= 2
    out.discard(me)
    return sorted(out)


class Sim:
    def __init__(self, n, a):
        self.n, self.a = n, a
        self.rng = random.Random(a.seed * 1000003 + n)
        self.events = []  # (time, seq, kind, payload)
        self.seq = 0
        self.links = [linked_nodes(n, i, a.ring) for i in range(n)]
        self.watched = [ring_neighbours(n, i, a.ring) for i in range(n)]
        self.stream_free = {}  # (src, dst) -> the time the stream delivers its next message
        self.heard = {}  # (watcher, peer) -> last time heard
        self.lost = [set() for _ in range(n)]  # what each node holds lost
        self.frozen = None
        self.knows = {}  # node -> the time it learned of the frozen node
        self.false_positives = 0
        self.suspicions = 0  # raised by a watcher (passed on or not)
        self.susp = {}  # (node, about) -> {origin: time}
        self.quorum = [min(a.quorum, len(ring_neighbours(n, i, a.ring))) for i in range(n)]
        self.notices = 0
        self.messages = 0

    def at(self, t, kind, payload):
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def send(self, t, src, dst, what):
        """A message on the stream src->dst: losses and head-of-line blocking."""
        self.messages += 1
        delay, rto = self.a.delay, self.a.rto_min
        while self.rng.random() < self.a.loss:
            delay += rto
            rto = min(2 * rto, 60.0)
        arrive = max(t + delay, self.stream_free.get((src, dst), 0.0)) + self.a.per_message
        self.stream_free[(src, dst)] = arrive
        self.at(arrive, "msg", (src, dst, what))

    def declare(self, t, node, about, origin, came_from):
        if about in self.lost[node] or about == node:
            return
        self.lost[node].add(about)
        if about == self.frozen:
            self.knows.setdefault(node, t)
        else:
            self.false_positives += 1
        for j in self.links[node]:
            if j != came_from and j != about and j not in self.lost[node]:
                self.notices += 1
                self.send(t, node, j, ("lost", about, origin))

    def suspect(self, t, node, about, origin, came_from):
        if about in self.lost[node] or about == node:
            return
        by = self.susp.setdefault((node, about), {})
        for o in [o for o, when in by.items() if t - when > 2 * self.a.timeout]:
            del by[o]
        if origin in by:
            return
        by[origin] = t
        if origin == node:
            self.suspicions += 1
        if len(by) >= self.quorum[about]:
            self.declare(t, node, about, origin, came_from)
            return
        for j in self.links[node]:
            if j != came_from and j != about and j not in self.lost[node]:
                self.notices += 1
                self.send(t, node, j, ("suspect", about, origin))

    def run(self, until, freeze_at=None):
        a = self.a
        for i in range(self.n):
            for j in self.watched[i]:
                self.heard[(i, j)] = 0.0
            self.at(self.rng.random() * a.interval, "beat", i)
            self.at(self.rng.random() * a.tick, "check", i)
        if freeze_at is not None:
            self.at(freeze_at, "freeze", self.rng.randrange(self.n))
        for _ in range(a.events):
            if not self.events:
                break
            t, _, kind, p = heapq.heappop(self.events)
            if t > until:
                break
            if kind == "freeze":
                self.frozen = p
                continue
            node = p if kind != "msg" else p[1]
            if node == self.frozen:
                continue  # a frozen node does nothing (what reaches it waits)
            if kind == "beat":
                for j in self.watched[node]:
                    if j not in self.lost[node]:
                        self.send(t, node, j, ("beat",))
                self.at(t + a.interval, "beat", node)
            elif kind == "check":
                for j in self.watched[node]:
                    if j not in self.lost[node] and t - self.heard[(node, j)] > a.timeout:
                        self.suspect(t, node, j, node, None)
                self.at(t + a.tick, "check", node)
            else:
                src, dst, what = p
                if src in self.lost[dst]:
                    continue
                if (dst, src) in self.heard:
                    self.heard[(dst, src)] = t
                if what[0] == "lost" and what[2] not in self.lost[dst]:
                    self.declare(t, dst, what[1], what[2], src)
                elif what[0] == "suspect" and what[2] not in self.lost[dst]:
                    self.suspect(t, dst, what[1], what[2], src)
            if self.frozen is not None and len(self.knows) == self.n - 1:
                break
        return t


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", default="1000,10000")
    ap.add_argument("--loss", default="0,0.01", help="message loss probabilities to run")
    ap.add_argument("--ring", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--timeout", type=float, default=1.5)
    ap.add_argument("--tick", type=float, default=0.05)
    ap.add_argument("--delay", type=float, default=0.0002, help="one-way delay, s")
    ap.add_argument("--per_message", type=float, default=0.00002,
                    help="a receiving daemon's time per message, s")
    ap.add_argument("--rto_min", type=float, default=0.2)
    ap.add_argument("--steady", type=float, default=30.0, help="simulated seconds of scenario 1")
    ap.add_argument("--freezes", type=int, default=3, help="runs of scenario 2 per cell")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--events", type=int, default=50_000_000, help="bound on events per run")
    ap.add_argument("--quorum", type=int, default=2,
                    help="watchers whose suspicions make a node lost (1: the first suspicion)")
    a = ap.parse_args()
    counts = [int(c) for c in a.nodes.split(",")]
    losses = [float(p) for p in a.loss.split(",")]
    if any(c < 3 or c > 20000 for c in counts) or any(not 0 <= p < 0.5 for p in losses) or \
            not 1 <= a.freezes <= 20 or not 1 <= a.steady <= 600:
        sys.exit("nodes 3..20000, loss in [0, 0.5), freezes 1..20, steady 1..600 s")
    print(f"peer watch: ring {a.ring}, heartbeat {a.interval}s, timeout {a.timeout}s, tick "
          f"{a.tick}s, delay {a.delay * 1e3:.1f}ms, RTO min {a.rto_min}s")
    print(f"quorum {a.quorum}, steady state {a.steady:.0f} s, {a.freezes} freezes per cell")
    print(f"{'N':>6} {'loss':>5} {'links':>5} {'suspicions':>10} {'false pos':>9} "
          f"{'msgs/node/s':>11} {'detect med s':>12} {'detect max s':>12} {'notices/loss':>12}")
    for n in counts:
        for p in losses:
            a.loss = p
            steady = Sim(n, a)
            steady.run(a.steady)
            rate = steady.messages / n / a.steady
            detect, notices, missed = [], [], 0
            for k in range(a.freezes):
                a.seed += 1
                s = Sim(n, a)
                freeze_at = 5.0 + s.rng.random()
                end = s.run(freeze_at + 30, freeze_at)
                # A survivor that never learns of the loss was itself declared lost (a false
                # positive): it counts as never (infinite).
                detect.append(max(s.knows.values()) - freeze_at if len(s.knows) == n - 1
                              else float("inf"))
                missed += n - 1 - len(s.knows)
                notices.append(s.notices)
            print(f"{n:>6} {p:>5.2f} {len(steady.links[0]):>5} {steady.suspicions:>10} "
                  f"{steady.false_positives:>9} "
                  f"{rate:>11.1f} {statistics.median(detect):>12.2f} {max(detect):>12.2f} "
                  f"{statistics.median(notices):>12,.0f}"
                  + (f"  ({missed} survivors never learned of a loss)" if missed else ""),
                  flush=True)


if __name__ == "__main__":
    main()
