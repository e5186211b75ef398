#!/usr/bin/env python3
"""Rendezvous-store throughput and latency: gradsync's embedded store, gradsync on etcd, and
torch.distributed.TCPStore, same run, same machine.

For each op (set, get, add) and client count (1, 16, 64 by default) N client processes run the op
back to back for --seconds after a common start barrier; the first table shows total ops/s and
the ratios, the second the latency of one call with one client (median and 99th percentile).
gradsync's embedded store is measured over its unix socket (the trainer path) and over TCP (the
daemon-to-daemon path); gradsync on etcd (a second daemon with --store=etcd and a one-member etcd
on loopback, its data on disk unless --etcd_dir says otherwise) over its unix socket, the path
trainers and formation take; TCPStore only speaks TCP.

Note: TCPStore's set() does not wait for an acknowledgement (it only writes to the socket);
gradsync's Set returns after the daemon applied it (on etcd: after etcd committed it). TCPStore's
latencies are measured in Python (a microsecond or two of interpreter per call included).

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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from etcd_local import LocalEtcd  # noqa: E402

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
    """(total ops/s, latency of the first client: (p50 us, p99 us))"""
    total, latency = 0.0, None
    for p in procs:
        out, _ = p.communicate(timeout=TIMEOUT_S)
        if p.returncode != 0:
            raise RuntimeError(f"worker failed: {out}")
        m = re.search(r"ops (\d+) seconds ([0-9.]+) p50_us ([0-9.]+) p99_us ([0-9.]+)", out)
        total += int(m.group(1)) / float(m.group(2))
        latency = latency or (float(m.group(3)), float(m.group(4)))
    return total, latency


def tcpstore_worker(port, op, seconds, conn):
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120))
    key = f"bench/{os.getpid()}"
    store.set(key, "value")
    store.add("ready", 1)
    store.wait(["go"])
    start = time.time()
    end = start + seconds
    lat = []
    clock = time.perf_counter_ns
    if op == "set":
        while time.time() < end:
            t = clock()
            store.set(key, "value")
            lat.append(clock() - t)
    elif op == "get":
        while time.time() < end:
            t = clock()
            store.get(key)
            lat.append(clock() - t)
    else:
        while time.time() < end:
            t = clock()
            store.add(key + "/n", 1)
            lat.append(clock() - t)
    took = time.time() - start
    lat.sort()
    p50, p99 = lat[(len(lat) - 1) // 2] / 1000, lat[int(0.99 * (len(lat) - 1))] / 1000
    conn.send(f"ops {len(lat)} seconds {took} p50_us {p50} p99_us {p99}")


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
    total, latency = 0.0, None
    for parent, p in zip(pipes, procs):
        if not parent.poll(TIMEOUT_S):
            raise RuntimeError("TCPStore worker hung")
        m = re.search(r"ops (\d+) seconds ([0-9.]+) p50_us ([0-9.]+) p99_us ([0-9.]+)",
                      parent.recv())
        total += int(m.group(1)) / float(m.group(2))
        latency = latency or (float(m.group(3)), float(m.group(4)))
        p.join(10)
    del master
    return total, latency


def start_daemon(build, tmp, name, token_file, extra):
    """A gradsyncd with its own socket and a free TCP port: (process, socket path, port)."""
    sock = os.path.join(tmp, f"{name}.sock")
    log_path = os.path.join(tmp, f"{name}.log")
    daemon = subprocess.Popen([os.path.join(build, "daemon", "gradsyncd"), f"--socket={sock}",
                               "--port=0", f"--token_file={token_file}", "--log_sink=stderr",
                               "--store_max_jobs=4096", *extra],
                              stderr=open(log_path, "w"))
    deadline = time.time() + 20
    while time.time() < deadline:
        m = re.search(r"tcp=127\.0\.0\.1:(\d+)", open(log_path).read())
        if m:
            return daemon, sock, int(m.group(1))
        time.sleep(0.02)
    daemon.kill()
    sys.exit(f"gradsyncd ({name}) did not start; see {log_path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--ops", default="set,get,add")
    ap.add_argument("--etcd_dir", default=None,
                    help="parent directory of etcd's data (default: the temporary directory)")
    ap.add_argument("--no_etcd", action="store_true", help="leave gradsync on etcd out")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    ops = args.ops.split(",")
    if any(c < 1 or c > 128 for c in clients) or not 0 < args.seconds <= 30:
        sys.exit("clients must be 1..128 and seconds 0..30")

    import torch  # noqa: F401  (imported once, before forking TCPStore workers)

    tmp = tempfile.mkdtemp(prefix="gradsync-bench-")
    # TCP needs the cluster token; the TCP workers carry it (GRADSYNC_TOKEN_FILE).
    token_file = os.path.join(tmp, "cluster.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("store-bench\n")
    os.environ["GRADSYNC_TOKEN_FILE"] = token_file
    etcd = None if args.no_etcd else LocalEtcd(args.etcd_dir)
    daemons = []
    try:
        embedded, sock, port = start_daemon(args.build, tmp, "embedded", token_file, [])
        daemons.append(embedded)
        if etcd:
            on_etcd, etcd_sock, _ = start_daemon(
                args.build, tmp, "etcd", token_file,
                ["--store=etcd", f"--etcd_endpoints={etcd.endpoint}",
                 "--etcd_prefix=/gradsync-bench/"])
            daemons.append(on_etcd)

        print(f"store throughput, ops/s: {args.seconds:g} s per cell, {os.cpu_count()} cores, "
              f"each client a separate process; etcd: one member on loopback"
              + (f", data in {args.etcd_dir}" if args.etcd_dir else ", data on disk"))
        header = f"{'op':<4} {'clients':>7} {'embedded unix':>14} {'embedded tcp':>13} " \
                 f"{'etcd unix':>10} {'TCPStore':>10} {'embedded/TCPStore':>18} " \
                 f"{'etcd/TCPStore':>14} {'etcd/embedded':>14}"
        print(header)
        print("-" * len(header))
        latencies = []
        for op in ops:
            for n in clients:
                unix, unix_lat = run_gradsync(args.build, sock, "unix:" + sock, op, n,
                                              args.seconds, f"u-{op}-{n}")
                tcp, tcp_lat = run_gradsync(args.build, sock, f"127.0.0.1:{port}", op, n,
                                            args.seconds, f"t-{op}-{n}")
                if etcd:
                    on, on_lat = run_gradsync(args.build, etcd_sock, "unix:" + etcd_sock, op, n,
                                              args.seconds, f"e-{op}-{n}")
                else:
                    on, on_lat = float("nan"), (float("nan"), float("nan"))
                ref, ref_lat = run_tcpstore(op, n, args.seconds)
                print(f"{op:<4} {n:>7} {unix:>14,.0f} {tcp:>13,.0f} {on:>10,.0f} {ref:>10,.0f} "
                      f"{unix / ref:>17.2f}x {on / ref:>13.2f}x {on / unix:>13.2f}x", flush=True)
                if n == 1:
                    latencies.append((op, unix_lat, tcp_lat, on_lat, ref_lat))
        if latencies:
            print(f"\nstore latency of one call, one client, microseconds (p50 / p99)")
            header = f"{'op':<4} {'embedded unix':>16} {'embedded tcp':>16} {'etcd unix':>16} " \
                     f"{'TCPStore':>16}"
            print(header)
            print("-" * len(header))
            for op, *cells in latencies:
                print(f"{op:<4} " + " ".join(f"{f'{a:,.0f} / {b:,.0f}':>16}" for a, b in cells))
    finally:
        for d in daemons:
            d.send_signal(signal.SIGTERM)
        for d in daemons:
            d.wait(30)
        if etcd:
            etcd.stop()


if __name__ == "__main__":
    main()
