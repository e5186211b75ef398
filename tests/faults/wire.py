"""A lossy link in user space, where the kernel has no netem: a tap in a node's namespace (its
eth0) and a tap in the switch's namespace (its bridge port), and this process between them.
Frames from the node are delayed by --delay-ms and dropped with probability --loss (the node's
egress, as netem on the node's eth0 would do); frames to the node pass at once. Order is kept
(one delay for all). The taps vanish when this process exits. Bounded by --seconds.

    wire.py --inner NS --inner-if eth0 --outer SW --outer-if p0 --delay-ms 5 --loss 0.01 \
            --ready FILE --seconds 600
"""
import argparse
import ctypes
import errno
import fcntl
import heapq
import os
import random
import select
import struct
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def enter(ns):
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {ns}")
    finally:
        os.close(fd)


def open_tap(name):
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--inner", required=True)
    ap.add_argument("--inner-if", required=True)
    ap.add_argument("--outer", required=True)
    ap.add_argument("--outer-if", required=True)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--loss", type=float, default=0.01)
    ap.add_argument("--ready", required=True)
    ap.add_argument("--seconds", type=float, default=600.0)
    a = ap.parse_args()
    enter(a.inner)
    inner = open_tap(a.inner_if)
    enter(a.outer)
    outer = open_tap(a.outer_if)
    with open(a.ready, "w") as f:
        f.write("ready\n")
    delay = a.delay_ms / 1000.0
    rng = random.Random()
    queue = []  # (due, seq, frame) from the node, in order
    seq = 0
    counts = {"in": 0, "dropped": 0, "out": 0}
    end = time.monotonic() + a.seconds
    while True:
        now = time.monotonic()
        if now > end:
            break
        timeout = max(0.0, queue[0][0] - now) if queue else 0.2
        readable, _, _ = select.select([inner, outer], [], [], timeout)
        for fd in readable:
            for _ in range(256):
                try:
                    frame = os.read(fd, 65536)
                except BlockingIOError:
                    break
                except OSError as e:
                    if e.errno in (errno.EAGAIN, errno.EIO):
                        break
                    raise
                if fd == inner:
                    counts["in"] += 1
                    if rng.random() < a.loss:
                        counts["dropped"] += 1
                        continue
                    seq += 1
                    heapq.heappush(queue, (time.monotonic() + delay, seq, frame))
                else:
                    try:
                        os.write(inner, frame)
                    except OSError:
                        pass  # the node's side is down: the frame is lost, as on a wire
        now = time.monotonic()
        while queue and queue[0][0] <= now:
            _, _, frame = heapq.heappop(queue)
            counts["out"] += 1
            try:
                os.write(outer, frame)
            except OSError:
                pass
    print(counts, flush=True)


if __name__ == "__main__":
    main()
