#!/usr/bin/env python3
"""Job formation across daemons: the embedded store against gradsync on etcd, same run.

For each daemon count (4, 8, 16, 32 by default) N gradsyncd run on this machine (own sockets
and TCP ports), and a job of N ranks, one per daemon, forms across them: each rank registers,
then runs one barrier, which waits for the job to form (every daemon publishes its ranks in the
job's store and reads everyone's), for the daemons' liveness links and for the barrier's own
record links between the daemons. Formation time: from the moment the last rank registered to
the moment the last rank's barrier returned (median of --repeats jobs, min and max beside it).

Embedded: daemon 0 is the job's root and holds its store; the others reach it over TCP. Etcd:
every daemon has --store=etcd on one etcd member on loopback (data on disk unless --etcd_dir
says otherwise), and no rank names a root.

The peer (--torch, on by default): the same N ranks as a torch.distributed job of this
interpreter's torch, gloo over torch's TCPStore (rank 0 hosts it; libuv in torch 2.x), formed by
init_process_group and one barrier (bench/torch_formation_worker.py), timed the same way: from
the moment the last rank called init_process_group to the moment the last barrier returned.

Store calls per daemon: the Store calls (Set, Wait, Add, CompareSet, Delete, List) a job costs,
from the daemons' gradsync_store_calls_total (the embedded store counts every daemon's calls at
the root: their sum over N is the mean per daemon; on etcd each daemon counts its own, so the
largest is shown too). They must not grow with N.

Run:  .venv/bin/python bench/formation_bench.py --build build
"""
import argparse
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from etcd_local import LocalEtcd  # noqa: E402

TIMEOUT_S = 180  # bound on any one job


class Daemon:
    def __init__(self, build, tmp, name, token_file, extra):
        self.sock = os.path.join(tmp, f"{name}.sock")
        self.log_path = os.path.join(tmp, f"{name}.log")
        self.proc = subprocess.Popen(
            [os.path.join(build, "daemon", "gradsyncd"), f"--socket={self.sock}", "--port=0",
             f"--token_file={token_file}", "--log_sink=stderr", "--metrics_port=0",
             "--op_timeout=120s", *extra],
            stderr=open(self.log_path, "w"))
        self.port = self.metrics = None

    def wait_ready(self, deadline):
        while time.time() < deadline:
            with open(self.log_path) as f:
                log = f.read()
            tcp = re.search(r"tcp=[0-9.]+:(\d+)", log)
            metrics = re.search(r"metrics serving http://127\.0\.0\.1:(\d+)/", log)
            if tcp and metrics:
                self.port, self.metrics = int(tcp.group(1)), int(metrics.group(1))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        raise RuntimeError(f"gradsyncd did not start; see {self.log_path}")

    def metric(self, name):
        """The value of the unlabelled metric `name` (0 when absent)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=30) as r:
            m = re.search(rb"^" + name.encode() + rb" ([0-9.e+]+)$", r.read(), re.M)
        return float(m.group(1)) if m else 0.0

    def store_calls(self):
        return self.metric("gradsync_store_calls_total")

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)


def formation_ms(what, ranks):
    """The ranks' formation time in ms, from each one's "registered NS barrier NS" line: the
    last registration to the last barrier's return."""
    registered, done = [], []
    for r in ranks:
        out, err = r.communicate(timeout=TIMEOUT_S)
        m = re.search(r"registered (\d+) barrier (\d+)", out)
        if r.returncode != 0 or not m:
            raise RuntimeError(f"{what}: a rank failed: {err.strip()[-1500:]}")
        registered.append(int(m.group(1)))
        done.append(int(m.group(2)))
    return (max(done) - max(registered)) / 1e6


def run_torch_job(n):
    """One torch.distributed job of n ranks: its formation time in ms."""
    import socket  # noqa: PLC0415
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_formation_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return formation_ms(f"torch job of {n}", [
        subprocess.Popen([sys.executable, worker, str(port), str(n), str(r)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(n)])


def run_job(build, daemons, job, root):
    workers = [subprocess.Popen([os.path.join(build, "bench", "formation_bench_worker"),
                                 "unix:" + d.sock, job, str(len(daemons)), str(rank), root],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank, d in enumerate(daemons)]
    return formation_ms(f"job {job}", workers)


def measure(build, tmp, token_file, backend, n, repeats, etcd):
    extra = []
    if backend == "etcd":
        extra = ["--store=etcd", f"--etcd_endpoints={etcd.endpoint}",
                 f"--etcd_prefix=/gradsync-formation/{os.getpid()}/"]
    daemons = [Daemon(build, tmp, f"{backend}-{n}-{i}", token_file, extra) for i in range(n)]
    try:
        deadline = time.time() + 60
        for d in daemons:
            d.wait_ready(deadline)
        root = f"127.0.0.1:{daemons[0].port}" if backend == "embedded" else "-"
        times, mean_calls, max_calls = [], [], []
        for rep in range(repeats):
            before = [d.store_calls() for d in daemons]
            times.append(run_job(build, daemons, f"form-{backend}-{n}-{rep}", root))
            time.sleep(0.3)  # the job's end reaches every daemon
            calls = [d.store_calls() - b for d, b in zip(daemons, before)]
            mean_calls.append(sum(calls) / n)
            max_calls.append(max(calls))
        return times, statistics.median(mean_calls), statistics.median(max_calls)
    finally:
        for d in daemons:
            d.stop()
        for d in daemons:
            try:
                d.proc.wait(30)
            except subprocess.TimeoutExpired:
                d.proc.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build")
    ap.add_argument("--daemons", default="4,8,16,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--torch", type=int, default=1, help="1: measure the torch peer too")
    ap.add_argument("--etcd_dir", default=None,
                    help="parent directory of etcd's data (default: the temporary directory)")
    args = ap.parse_args()
    counts = [int(c) for c in args.daemons.split(",")]
    if any(c < 2 or c > 64 for c in counts) or not 1 <= args.repeats <= 50:
        sys.exit("daemons must be 2..64 and repeats 1..50")
    tmp = tempfile.mkdtemp(prefix="gradsync-formation-")
    token_file = os.path.join(tmp, "cluster.token")
    with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("formation-bench\n")
    etcd = LocalEtcd(args.etcd_dir)
    print(f"job formation, one rank per daemon, {args.repeats} jobs per cell, {os.cpu_count()} "
          f"cores, every daemon and rank on this machine; etcd: one member on loopback"
          + (f", data in {args.etcd_dir}" if args.etcd_dir else ", data on disk"))
    if args.torch:
        import torch  # noqa: PLC0415 - only to say which torch the peer runs
        print(f"peer: torch {torch.__version__} gloo over TCPStore, one process per rank")
    header = (f"{'daemons':>7} {'embedded ms (min..max)':>24} {'etcd ms (min..max)':>22} "
              f"{'etcd/embedded':>14} {'calls/daemon embedded':>22} "
              f"{'calls/daemon etcd (max)':>24}"
              + (f" {'torch ms (min..max)':>22} {'torch/embedded':>15}" if args.torch else ""))
    print(header)
    print("-" * len(header))
    failed = True
    try:
        for n in counts:
            cells = {}
            for backend in ("embedded", "etcd"):
                cells[backend] = measure(args.build, tmp, token_file, backend, n, args.repeats,
                                         etcd)
            (et, ecalls, _), (ot, ocalls, omax) = cells["embedded"], cells["etcd"]
            med_e, med_o = statistics.median(et), statistics.median(ot)
            peer = ""
            if args.torch:
                tt = [run_torch_job(n) for _ in range(args.repeats)]
                med_t = statistics.median(tt)
                peer = (f" {f'{med_t:,.0f} ({min(tt):,.0f}..{max(tt):,.0f})':>22} "
                        f"{med_t / med_e:>14.2f}x")
            print(f"{n:>7} {f'{med_e:,.0f} ({min(et):,.0f}..{max(et):,.0f})':>24} "
                  f"{f'{med_o:,.0f} ({min(ot):,.0f}..{max(ot):,.0f})':>22} "
                  f"{med_o / med_e:>13.2f}x {ecalls:>22.1f} {f'{ocalls:.1f} ({omax:.0f})':>24}"
                  + peer, flush=True)
        failed = False
    finally:
        etcd.stop()
        if failed:
            print(f"daemons' logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
