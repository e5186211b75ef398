"""A flood of strangers on a job's listeners while it forms, run inside the lab's switch
namespace (its connections come over the bridge from the lab's own flood addresses).

Per target it keeps --silent connections that send nothing and --garbage connections that send
random bytes open (a connection the daemon drops is replaced), up to 3x that many attempts, for
--seconds. Targets: each --target host:port from the start, and every TCP port that a --watch
PID:ADDRESS process listens on at ADDRESS once it appears (the data links' listeners, found in
/proc/PID/net/tcp: its namespace's sockets), except --skip ports. Writes a JSON summary.
Only the lab's namespace addresses are ever targets.
"""
import argparse
import errno
import json
import os
import random
import resource
import select
import socket
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from netlab import SUBNET, listening_ports  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", action="append", default=[])
    ap.add_argument("--watch", action="append", default=[], help="PID:ADDRESS")
    ap.add_argument("--skip", action="append", type=int, default=[])
    ap.add_argument("--sources", default="")
    ap.add_argument("--silent", type=int, default=100)
    ap.add_argument("--garbage", type=int, default=100)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sources = [s for s in a.sources.split(",") if s]
    rng = random.Random(7)
    t0 = time.monotonic()
    end = t0 + a.seconds
    targets = {}  # (host, port) -> stats
    conns = {}    # fd -> dict(sock, target, kind, connected, sent, next_send)

    def add_target(host, port, kind):
        if not host.startswith(SUBNET + "."):
            raise SystemExit(f"refusing target {host}: not a lab address")
        key = (host, port)
        if key not in targets:
            targets[key] = {"target": f"{host}:{port}", "kind": kind,
                            "first_seen_s": round(time.monotonic() - t0, 3), "attempts": 0,
                            "connected": 0, "closed_by_peer": 0, "refused": 0,
                            "refused_in_a_row": 0, "garbage_bytes": 0, "open": {"silent": 0,
                                                                                 "garbage": 0}}

    for t in a.target:
        host, port = t.rsplit(":", 1)
        add_target(host, int(port), "daemon")
    watches = []
    for w in a.watch:
        pid, addr = w.split(":")
        watches.append((int(pid), addr))

    def open_one(key, kind):
        st = targets[key]
        st["attempts"] += 1
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        if sources:
            try:
                s.bind((rng.choice(sources), 0))
            except OSError:
                pass
        rc = s.connect_ex(key)
        if rc not in (0, errno.EINPROGRESS):
            st["refused"] += 1
            st["refused_in_a_row"] += 1
            s.close()
            return
        st["open"][kind] += 1
        conns[s.fileno()] = {"sock": s, "key": key, "kind": kind, "connected": False, "sent": 0,
                             "next_send": 0.0}

    def close(fd, why):
        c = conns.pop(fd)
        st = targets[c["key"]]
        st["open"][c["kind"]] -= 1
        if why == "refused":
            st["refused"] += 1
            st["refused_in_a_row"] += 1
        elif why == "closed":
            st["closed_by_peer"] += 1
        c["sock"].close()

    last_scan = 0.0
    while time.monotonic() < end:
        now = time.monotonic()
        if now - last_scan > 0.005:
            last_scan = now
            for pid, addr in watches:
                for port in listening_ports(pid, addr):
                    if port not in a.skip:
                        add_target(addr, port, "listener")
        for key, st in targets.items():
            if st["refused_in_a_row"] >= 10:  # the listener is gone
                continue
            for kind, quota in (("silent", a.silent), ("garbage", a.garbage)):
                while (st["open"][kind] < quota and st["attempts"] < 3 * (a.silent + a.garbage)
                       and st["refused_in_a_row"] < 10):
                    open_one(key, kind)
        poller = select.poll()
        for fd, c in conns.items():
            ev = select.POLLIN
            if not c["connected"] or (c["kind"] == "garbage" and c["sent"] < 16384
                                      and now >= c["next_send"]):
                ev |= select.POLLOUT
            poller.register(fd, ev)
        for fd, ev in poller.poll(5):
            c = conns.get(fd)
            if c is None:
                continue
            s = c["sock"]
            if not c["connected"]:
                if ev & (select.POLLOUT | select.POLLERR | select.POLLHUP):
                    e = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if e != 0:
                        close(fd, "refused")
                        continue
                    c["connected"] = True
                    targets[c["key"]]["connected"] += 1
                    targets[c["key"]]["refused_in_a_row"] = 0
                continue
            if ev & (select.POLLIN | select.POLLHUP | select.POLLERR):
                try:
                    data = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    data = b"x"
                except OSError:
                    data = b""
                if not data:
                    close(fd, "closed")
                    continue
            if ev & select.POLLOUT and c["kind"] == "garbage":
                chunk = rng.randbytes(rng.randint(1, 4096))
                try:
                    n = s.send(chunk)
                    c["sent"] += n
                    targets[c["key"]]["garbage_bytes"] += n
                    c["next_send"] = time.monotonic() + 0.1
                except (BlockingIOError, InterruptedError):
                    pass
                except OSError:
                    close(fd, "closed")
    for fd in list(conns):
        conns[fd]["sock"].close()
    out = []
    for st in targets.values():
        st.pop("open")
        st.pop("refused_in_a_row")
        out.append(st)
    with open(a.out, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
