#!/usr/bin/env python3
"""Jobs of many nodes: formation, failure detection and what each daemon pays, as N grows.

For each daemon count N (32, 64, 128, 256 by default) and each liveness layout (--rings: the
default 2, two ring neighbours watched each way and losses passed on over O(log N) links; 0, the
mesh, every daemon watching every other), and each --cpu_all_to_all_max_nodes of --all_to_all
(4, the default: larger groups fold each op's records up a binomial tree; 1: always the tree;
1024: always all-to-all), N gradsyncd run on this machine, each on its own
loopback address (127.0.1.2, 127.0.1.3, ...: distinct hosts to each other, as nodes are), and a
job of N ranks, one per daemon (bench/formation_bench_worker, C++: Python's start-up would
dominate), forms and is measured:
  formation   the last rank's registration to the last rank's first barrier returned
  allreduce   median latency of a 4 KiB (20 times) and a 4 MiB (5 times) all-reduce, the worst
              rank's median
  sockets     open TCP sockets per daemon while the job is formed (mean over daemons, from
              /proc/PID/fd), every link, gRPC and the store's included
  links       liveness links per daemon (gradsync_peer_watch_links)
  beats/s     heartbeats each daemon sends a second (gradsync_peer_heartbeats_sent_total over
              --settle seconds)
  detection   SIGSTOP of one daemon (the last), then every other rank runs a barrier; the time
              from the SIGSTOP to the last survivor's barrier failing (its daemon learned of
              the loss), with default --peer_timeout (1.5 s)
The peers (N up to --torch_max): the same N ranks as a torch.distributed gloo job over TCPStore
(--torch; bench/torch_formation_worker.py): formation, and a 4 KiB all-reduce's median; and as
Open MPI processes (--mpi; bench/mpi_allreduce, TCP between the ranks on loopback, as between
nodes): a 4 KiB MPI_Allreduce's median.

Daemon 0 is the job's root and holds its store. Every daemon gets
--max_tcp_connections_per_source=4096: on one machine every daemon's gRPC channel to the root
comes from 127.0.0.1, which a real cluster's per-source limit would never see.

Run:  .venv/bin/python bench/scale_bench.py --build build [--daemons 32,64,128,256]
"""
import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import formation_bench  # noqa: E402 - the daemon process both benchmarks run

TIMEOUT_S = 300  # bound on any one wait of a job


class Daemon(formation_bench.Daemon):
    """Daemon i on its own loopback address, watching with --peer_watch_ring=RING, exchanging
    records all-to-all in groups of at most A2A nodes (--cpu_all_to_all_max_nodes)."""

    def __init__(self, build, tmp, i, token_file, ring, a2a):
        self.address = f"127.0.{1 + i // 250}.{2 + i % 250}"
        super().__init__(build, tmp, f"d{i}", token_file,
                         [f"--bind_address={self.address}",
                          "--max_tcp_connections_per_source=4096", f"--peer_watch_ring={ring}",
                          f"--cpu_all_to_all_max_nodes={a2a}"])

    def sockets(self, tcp_inodes):
        """Open TCP sockets of this daemon: its sockets in /proc/PID/fd that are in
        `tcp_inodes` (tcp_socket_inodes())."""
        inodes = set()
        fd_dir = f"/proc/{self.proc.pid}/fd"
        for fd in os.listdir(fd_dir):
            try:
                target = os.readlink(os.path.join(fd_dir, fd))
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        return len(inodes & tcp_inodes)


def tcp_socket_inodes():
    """The inodes of every TCP socket of this machine (/proc/net/tcp and tcp6)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                out.add(line.split()[9])
    return out


def read_line(proc, deadline, want):
    """The next stdout line of `proc` starting with `want` (others skipped), by `deadline`."""
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a rank ended early: {proc.stderr.read()[-1500:]}")
        if line.startswith(want):
            return line.split()
    raise RuntimeError(f"no '{want}' line in time")


def run_gradsync(build, tmp, token_file, n, ring, a2a, settle):
    daemons = [Daemon(build, tmp, i, token_file, ring, a2a) for i in range(n)]
    workers = []
    try:
        deadline = time.time() + 120
        for d in daemons:
            d.wait_ready(deadline)
        root = f"{daemons[0].address}:{daemons[0].port}"
        worker = os.path.join(build, "bench", "formation_bench_worker")
        workers = [subprocess.Popen([worker, "unix:" + d.sock, f"scale-{ring}-{n}", str(n),
                                     str(r), root, "1"], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                   for r, d in enumerate(daemons)]
        deadline = time.time() + TIMEOUT_S
        formed = [read_line(w, deadline, "registered") for w in workers]
        formation = (max(int(f[3]) for f in formed) - max(int(f[1]) for f in formed)) / 1e6
        reduced = [read_line(w, deadline, "allreduce") for w in workers]
        small = max(float(r[2]) for r in reduced)
        large = max(float(r[4]) for r in reduced)
        for w in workers:
            read_line(w, deadline, "ready")
        beats0 = [d.metric("gradsync_peer_heartbeats_sent_total") for d in daemons]
        t0 = time.time()
        time.sleep(settle)
        beats = [(d.metric("gradsync_peer_heartbeats_sent_total") - b) / (time.time() - t0)
                 for d, b in zip(daemons, beats0)]
        tcp = tcp_socket_inodes()
        sockets = statistics.mean(d.sockets(tcp) for d in daemons)
        links = statistics.mean(d.metric("gradsync_peer_watch_links") for d in daemons)
        frozen = daemons[-1]
        frozen.proc.send_signal(signal.SIGSTOP)
        stopped = time.time_ns()
        for w in workers[:-1]:
            w.stdin.write("go\n")
            w.stdin.flush()
        deadline = time.time() + TIMEOUT_S
        failed = [read_line(w, deadline, "failed") for w in workers[:-1]]
        detection = (max(int(f[1]) for f in failed) - stopped) / 1e6
        frozen.proc.send_signal(signal.SIGCONT)
        return dict(formation=formation, small=small, large=large, sockets=sockets, links=links,
                    beats=statistics.mean(beats), detection=detection)
    finally:
        for w in workers:
            w.kill()
        for d in daemons:
            d.proc.send_signal(signal.SIGCONT)
            d.proc.send_signal(signal.SIGTERM)
        for d in daemons:
            try:
                d.proc.wait(30)
            except subprocess.TimeoutExpired:
                d.proc.kill()


def run_torch(n):
    import socket  # noqa: PLC0415
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_formation_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    ranks = [subprocess.Popen([sys.executable, worker, str(port), str(n), str(r), "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(n)]
    try:
        deadline = time.time() + TIMEOUT_S
        formed = [read_line(r, deadline, "registered") for r in ranks]
        reduced = [read_line(r, deadline, "allreduce") for r in ranks]
        return ((max(int(f[3]) for f in formed) - max(int(f[1]) for f in formed)) / 1e6,
                max(float(r[2]) for r in reduced))
    finally:
        for r in ranks:
            r.kill()


def run_mpi(build, n):
    """Median microseconds of a 4 KiB MPI_Allreduce across n Open MPI ranks (TCP), or None."""
    mpirun = shutil.which("mpirun")
    binary = os.path.join(build, "bench", "mpi_allreduce")
    if mpirun is None or not os.path.exists(binary):
        return None
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(n), "--mca", "btl",
           "self,tcp", "--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [binary, "--sizes", "4096", "--min-iters", "20", "--max-iters", "200", "--seconds",
            "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    if out.returncode != 0:
        raise RuntimeError(f"mpirun failed: {out.stderr[-1500:]}")
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            if r.get("case") == "allreduce" and r.get("bytes") == 4096:
                return r["median_us"]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--daemons", default="32,64,128,256")
    ap.add_argument("--rings", default="2,0", help="--peer_watch_ring values to compare")
    ap.add_argument("--all_to_all", default="4",
                    help="--cpu_all_to_all_max_nodes values to compare (1: always the tree)")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds heartbeats are counted")
    ap.add_argument("--torch", type=int, default=1, help="1: measure the torch peer too")
    ap.add_argument("--mpi", type=int, default=1, help="1: measure Open MPI's all-reduce too")
    ap.add_argument("--torch_max", type=int, default=64,
                    help="largest N for the peers (a torch process is ~300 MB here)")
    args = ap.parse_args()
    counts = [int(c) for c in args.daemons.split(",")]
    rings = [int(r) for r in args.rings.split(",")]
    a2as = [int(x) for x in args.all_to_all.split(",")]
    if any(c < 2 or c > 1000 for c in counts) or not 0.5 <= args.settle <= 30 or \
            any(not 1 <= x <= 1024 for x in a2as):
        sys.exit("daemons must be 2..1000, settle 0.5..30 s and all_to_all 1..1024")
    tmp = tempfile.mkdtemp(prefix="gradsync-scale-")
    token_file = os.path.join(tmp, "cluster.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("scale-bench\n")
    print(f"jobs of N daemons, one rank each, {os.cpu_count()} cores, every daemon and rank on "
          f"this machine (daemon i on 127.0.1.{{i+2}})")
    header = (f"{'N':>4} {'ring':>4} {'a2a':>4} {'formation ms':>12} {'detect ms':>9} "
              f"{'sockets':>8} "
              f"{'links':>6} {'beats/s':>8} {'4KiB us':>9} {'4MiB us':>9}"
              f" {'torch form ms':>13} {'torch 4KiB us':>13} {'4KiB vs torch':>13}"
              f" {'MPI 4KiB us':>11}")
    print(header)
    print("-" * len(header))
    failed = True
    try:
        for n in counts:
            peer = mpi = None
            if args.torch and n <= args.torch_max:
                peer = run_torch(n)
            if args.mpi and n <= args.torch_max:
                mpi = run_mpi(args.build, n)
            for ring, a2a in [(ring, a2a) for ring in rings for a2a in a2as]:
                r = run_gradsync(args.build, tmp, token_file, n, ring, a2a, args.settle)
                tail = (f" {peer[0]:>13,.0f} {peer[1]:>13,.0f} {r['small'] / peer[1]:>12.2f}x"
                        if peer else f" {'-':>13} {'-':>13} {'-':>13}")
                tail += f" {mpi:>11,.0f}" if mpi else f" {'-':>11}"
                print(f"{n:>4} {ring:>4} {a2a:>4} {r['formation']:>12,.0f} {r['detection']:>9,.0f} "
                      f"{r['sockets']:>8.1f} {r['links']:>6.1f} {r['beats']:>8.1f} "
                      f"{r['small']:>9,.0f} {r['large']:>9,.0f}" + tail, flush=True)
        failed = False
    finally:
        if failed:
            print(f"daemons' logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
