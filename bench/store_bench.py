#!/usr/bin/env python3
"""Rendezvous-store throughput: gradsync vs torch.distributed.TCPStore, same run, same machine.

For each op (set, get, add) and client count (1, 16, 64 by default) N client processes run the op
back to back for --seconds after a common start barrier; the table shows total ops/s and the
ratio of gradsync to TCPStore. gradsync is measured over its unix socket (the trainer path) and
over TCP (the daemon-to-daemon path); TCPStore only speaks TCP.

Note: TCPStore's set() does not wait for an acknowledgement (it only writes to the socket);
gradsync's Set returns after the daemon applied it.

Run with Debian's interpreter (where torch lives):  /usr/bin/python3 bench/store_bench.py --build build
"""
import argparse
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

TIMEOUT_S = 180  # bound on any one cell


def ctl(build, sock, job, *args):
    out = subprocess.run([os.path.join(build, "client", "gradsyncctl"), f"--socket={sock}",
                          f"--job={job}", "--timeout=5s", *args],
                         capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout.strip()


def run_gradsync(build, sock, target, op, clients, seconds, job):
    procs = [subprocess.Popen([os.path.join(build, "bench", "store_bench_worker"), target, job, op,
                               str(seconds), str(clients)], stdout=subprocess.PIPE, text=True)
             for _ in range(clients)]
    deadline = time.time() + TIMEOUT_S
    while time.time() < deadline:
        rc, out = ctl(build, sock, job, "store", "get", "ready")
        if rc == 0 and out == str(clients):
            break
        time.sleep(0.05)
    else:
        raise RuntimeError(f"gradsync workers did not all start ({op} x{clients})")
    ctl(build, sock, job, "store", "set", "go", "1")
    return collect(procs)


def collect(procs):
    total = 0.0
    for p in procs:
        out, _ = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed: {out}")
        m = re.search(r"ops (\d+) seconds ([0-9.]+)", out)
        total += int(m.group(1)) / float(m.group(2))
    return total


def tcpstore_worker(port, op, seconds, conn):
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    key = f"bench/{os.getpid()}"
    store.set(key, "value")
    store.add("ready", 1)
    store.wait(["go"])
    start = time.time()
    end = start + seconds
    ops = 0
    if op == "set":
        while time.time() < end:
            store.set(key, "value")
            ops += 1
    elif op == "get":
        while time.time() < end:
            store.get(key)
            ops += 1
    else:
        while time.time() < end:
            store.add(key + "/n", 1)
            ops += 1
    conn.send(f"ops {ops} seconds {time.time() - start}")


def run_tcpstore(op, clients, seconds):
    import torch.distributed as dist
    master = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120),
                           wait_for_workers=False)
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for _ in range(clients):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=tcpstore_worker, args=(master.port, op, seconds, child))
        p.start()
        pipes.append(parent)
        procs.append(p)
    deadline = time.time() + TIMEOUT_S
    while master.add("ready", 0) != clients:
        if time.time() > deadline:
            raise RuntimeError("TCPStore workers did not all start")
        time.sleep(0.05)
    master.set("go", "1")
    total = 0.0
    for parent, p in zip(pipes, procs):
        if not parent.poll(TIMEOUT_S):
            raise RuntimeError("TCPStore worker hung")
        m = re.search(r"ops (\d+) seconds ([0-9.]+)", parent.recv())
        total += int(m.group(1)) / float(m.group(2))
        p.join(10)
    del master
    return total


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--ops", default="set,get,add")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    ops = args.ops.split(",")
    if any(c < 1 or c > 128 for c in clients) or not 0 < args.seconds <= 30:
        sys.exit("clients must be 1..128 and seconds 0..30")

    import torch  # noqa: F401  (imported once, before forking TCPStore workers)

    tmp = tempfile.mkdtemp(prefix="gradsync-bench-")
    sock = os.path.join(tmp, "gradsyncd.sock")
    log_path = os.path.join(tmp, "gradsyncd.log")
    # TCP needs the cluster token; the TCP workers carry it (GRADSYNC_TOKEN_FILE).
    token_file = os.path.join(tmp, "cluster.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("store-bench\n")
    os.environ["GRADSYNC_TOKEN_FILE"] = token_file
    daemon = subprocess.Popen([os.path.join(args.build, "daemon", "gradsyncd"), f"--socket={sock}",
                               "--port=0", f"--token_file={token_file}", "--log_sink=stderr",
                               "--store_max_jobs=4096"],
                              stderr=open(log_path, "w"))
    port = None
    deadline = time.time() + 20
    while time.time() < deadline and port is None:
        m = re.search(r"tcp=127\.0\.0\.1:(\d+)", open(log_path).read())
        port = m and int(m.group(1))
        time.sleep(0.02)
    if port is None:
        daemon.kill()
        sys.exit("gradsyncd did not start; see " + log_path)

    print(f"store throughput, ops/s: {args.seconds:g} s per cell, {os.cpu_count()} cores, "
          f"each client a separate process")
    header = f"{'op':<4} {'clients':>7} {'gradsync unix':>14} {'gradsync tcp':>13} " \
             f"{'TCPStore':>10} {'unix/TCPStore':>14} {'tcp/TCPStore':>13}"
    print(header)
    print("-" * len(header))
    try:
        for op in ops:
            for n in clients:
                unix = run_gradsync(args.build, sock, "unix:" + sock, op, n, args.seconds,
                                    f"u-{op}-{n}")
                tcp = run_gradsync(args.build, sock, f"127.0.0.1:{port}", op, n, args.seconds,
                                   f"t-{op}-{n}")
                ref = run_tcpstore(op, n, args.seconds)
                print(f"{op:<4} {n:>7} {unix:>14,.0f} {tcp:>13,.0f} {ref:>10,.0f} "
                      f"{unix / ref:>13.2f}x {tcp / ref:>12.2f}x", flush=True)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


if __name__ == "__main__":
    main()
