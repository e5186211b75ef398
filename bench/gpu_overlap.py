#!/usr/bin/env python3
"""Overlap of gradient reduction with compute: step time through gradsyncd against torch NCCL.

A step is a fixed compute loop on the current stream, cut into one chunk per bucket (like
backward): after chunk i, bucket i (25 MiB of float32 by default) is written (its gradient is
ready) and its all-reduce (mean) is started asynchronously, as DDP's hooks do; after the last
chunk the step waits for every bucket's Work and synchronises the device. Variants, interleaved
round by round in the same processes so that drift hits all alike:
  compute   the loop alone, no communication (the floor)
  gradsync  gradsync.all_reduce(bucket, op="mean", async_op=True): the daemon's NCCL
  nccl      torch.distributed.all_reduce(bucket, ReduceOp.AVG, async_op=True), in process
with one rank, then (--all_gpus auto, on a machine with several GPUs) one rank per GPU.
Reported: each variant's median step time (per round the slowest rank's), the overlap
efficiency gradsync/nccl (goal: at most 1.10 with MPS, deploy/mps.md) and each against compute;
after the timed rounds one step of each collective has its values checked.

--mps starts a private MPS control daemon (nvidia-cuda-mps-control -d, its pipe and log folders
in a temporary folder), makes gradsyncd and the trainers its clients, says what each got (the
daemon's "gpu: mps=..." line; the trainers' CU_DEVICE_ATTRIBUTE_MPS_ENABLED) and always quits
the control daemon at the end. Where MPS cannot start or its clients cannot use it, it says why
and measures without MPS. Without a usable GPU: one line why, exit 77.

    gpu_overlap.py [--daemon GRADSYNCD] [--mps] [--json out.json] [--budget_s 100] ...
Exit 0: measured (and every value check held); 77: no usable GPU; 1: a failure (said).
"""
import argparse
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch_gpu_common

VARIANTS = ("compute", "gradsync", "nccl")
CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133  # cuda.h; the daemon asks cudaDevAttrMpsEnabled (= 133)
STOP_MARGIN_S = 8    # kept at the end of the budget for stopping gradsyncd and MPS
RANK_GRACE_S = 10    # ranks still running this long past their deadline are killed
MIN_RUN_S = 15       # a run of ranks starts only with this much of the budget left
MPS_PROBE_S = 40     # CUDA that did not connect to MPS within this (at most) never will
MPS_QUIT_S = 10


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemon", default=os.environ.get("GRADSYNC_DAEMON_PATH", ""),
                    help="gradsyncd to start (default: $GRADSYNC_DAEMON_PATH)")
    ap.add_argument("--mps", action="store_true",
                    help="run daemon and trainers as clients of an MPS control daemon of this "
                         "run's own (stopped at the end)")
    ap.add_argument("--json", default="", help="write the results here")
    ap.add_argument("--budget_s", type=float, default=100.0,
                    help="the whole run, stopping daemon and MPS included (%(default)s)")
    ap.add_argument("--buckets", type=int, default=8,
                    help="buckets, and compute chunks, per step (%(default)s)")
    ap.add_argument("--bucket_mib", type=int, default=25,
                    help="MiB of float32 per bucket (%(default)s)")
    ap.add_argument("--matmul_n", type=int, default=4096,
                    help="compute: N x N matmuls (%(default)s)")
    ap.add_argument("--matmuls", type=int, default=8, help="matmuls per chunk (%(default)s)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                    help="the matmuls' (%(default)s)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="untimed rounds of every variant (%(default)s)")
    ap.add_argument("--steps", type=int, default=20,
                    help="timed rounds of every variant, at most (%(default)s)")
    ap.add_argument("--all_gpus", default="auto", choices=("auto", "off"),
                    help="auto: then one rank per GPU too, where there are several (%(default)s)")
    ap.add_argument("--op_timeout_s", type=float, default=20.0,
                    help="deadline of every collective, gradsync's and torch's (%(default)s)")
    ap.add_argument("--mps_probe", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.buckets < 1 or args.bucket_mib < 1 or args.matmul_n < 1 or args.matmuls < 0 or \
            args.warmup < 1 or args.steps < 1 or args.budget_s <= 0:
        ap.error("--buckets, --bucket_mib, --matmul_n, --warmup, --steps and --budget_s must be "
                 "positive, --matmuls at least 0")
    return args


# ---- what CUDA says of this process ----
def mps_enabled(ordinal):
    """CUDA's own answer whether this process's contexts on device `ordinal` are MPS clients
    (CU_DEVICE_ATTRIBUTE_MPS_ENABLED through the driver API, after torch initialised CUDA);
    None when the driver cannot say."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, value = ctypes.c_int(0), ctypes.c_int(0)
        if cuda.cuDeviceGet(ctypes.byref(device), ordinal) != 0:
            return None
        if cuda.cuDeviceGetAttribute(ctypes.byref(value), CU_DEVICE_ATTRIBUTE_MPS_ENABLED,
                                     device) != 0:
            return None
    except (OSError, AttributeError):
        return None
    return bool(value.value)


def mps_probe():
    """A fresh process's CUDA on every device, and whether each context is an MPS client."""
    import torch
    n = torch.cuda.device_count()
    for d in range(n):
        torch.zeros(1, device=f"cuda:{d}")
        torch.cuda.synchronize(d)
    print(json.dumps({"devices": n, "mps": [mps_enabled(d) for d in range(n)]}), flush=True)


# ---- one rank (a spawned process) ----
def worker(rank, world, cfg, socket, store, out, deadline):
    """Rank `rank` of `world` on GPU `rank`: warm-up, then the timed rounds (their count agreed
    by every rank, sized to end before `deadline`, a time.time()), then one checked step of each
    collective; writes out/rank{rank}.json."""
    import torch
    torch.cuda.set_device(rank)
    dist, gradsync = torch_gpu_common.init_collectives(f"overlap-{world}", rank, world, socket,
                                                       store, timeout_s=cfg["op_timeout_s"])
    dtype = getattr(torch, cfg["dtype"])
    n = cfg["matmul_n"]
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    c = torch.empty(n, n, device="cuda", dtype=dtype)
    # One allocation per bucket, as DDP's buckets are.
    buckets = [torch.zeros((cfg["bucket_mib"] << 20) // 4, device="cuda")
               for _ in range(cfg["buckets"])]
    flag = torch.zeros(1, device="cuda")
    counter = [0]

    def reduce_gradsync(x):
        return gradsync.all_reduce(x, op="mean", async_op=True, timeout=cfg["op_timeout_s"])

    def reduce_nccl(x):
        return dist.all_reduce(x, op=dist.ReduceOp.AVG, async_op=True)

    reduce = {"compute": None, "gradsync": reduce_gradsync, "nccl": reduce_nccl}

    def step(variant):
        """One step; (seconds, the step's base value). Each step writes its own values (base +
        rank + 1), so a reduction that read a bucket before its write shows in the check."""
        counter[0] += 1
        base = float(counter[0] % 1000)
        fn = reduce[variant]
        if world > 1:
            dist.all_reduce(flag)  # the ranks start the step together
        works = []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x in buckets:
            for _ in range(cfg["matmuls"]):
                torch.matmul(a, b, out=c)
            x.fill_(base + rank + 1)  # the bucket's gradients are ready
            if fn is not None:
                works.append(fn(x))
        for w in works:
            w.wait()
        torch.cuda.synchronize()
        return time.perf_counter() - t0, base

    for _ in range(cfg["warmup"]):
        last = [step(v)[0] for v in VARIANTS]
    left = deadline - time.time() - 2 * sum(last) - 5
    rounds = torch.tensor([max(1, min(cfg["steps"], int(left / max(sum(last), 1e-4))))],
                          device="cuda")
    dist.all_reduce(rounds, op=dist.ReduceOp.MIN)  # every rank runs the same collectives
    rounds = int(rounds.item())
    times = {v: [] for v in VARIANTS}
    for r in range(rounds):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            times[v].append(step(v)[0])
    checks = {}
    for v in ("gradsync", "nccl"):
        _, base = step(v)
        want = base + (world + 1) / 2  # the mean of base + rank + 1 over the ranks
        got = [float(t) for x in buckets for t in torch.stack([x.min(), x.max()]).tolist()]
        checks[f"{v}: every bucket holds the mean {want:g}"] = all(
            abs(g - want) <= 1e-3 for g in got)
    torch_gpu_common.write_json(os.path.join(out, f"rank{rank}.json"), {
        "rank": rank, "rounds": rounds, "times": times, "checks": checks,
        "mps_enabled": mps_enabled(rank)})
    gradsync.shutdown()
    dist.destroy_process_group()


def run_ranks(world, cfg, socket, folder, deadline):
    """`world` spawned ranks, one per GPU, running worker(); killed at `deadline` (plus a grace).
    Returns their rank files; raises RuntimeError saying why when any failed."""
    import torch.multiprocessing as mp
    out = tempfile.mkdtemp(dir=folder, prefix=f"ranks{world}-")
    ctx = mp.start_processes(worker, args=(world, cfg, socket, os.path.join(out, "store"), out,
                                           deadline),
                             nprocs=world, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=0.5):
            if time.time() > deadline + RANK_GRACE_S:
                raise RuntimeError(f"still running {RANK_GRACE_S} s past the budget: stopped")
    except RuntimeError:
        raise
    except Exception as e:  # a rank raised or died: torch stopped the others
        raise RuntimeError(" ".join(str(e).split())[-1500:]) from None
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    ranks = []
    for r in range(world):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return ranks


def summarise(world, ranks):
    """One result row from the ranks' files: per round the slowest rank's step, medians."""
    rounds = min(r["rounds"] for r in ranks)
    row = {"ranks": world, "steps": rounds, "ms": {},
           "trainer_mps": [r["mps_enabled"] for r in ranks], "checks": {}}
    for v in VARIANTS:
        per_round = sorted(max(r["times"][v][i] for r in ranks) * 1e3 for i in range(rounds))
        row["ms"][v] = {"median": statistics.median(per_round), "min": per_round[0],
                        "p90": per_round[min(len(per_round) - 1, int(0.9 * len(per_round)))]}
    for r in ranks:
        for what, ok in r["checks"].items():
            row["checks"][f"rank {r['rank']}: {what}"] = ok
    med = {v: row["ms"][v]["median"] for v in VARIANTS}
    row["ratio"] = med["gradsync"] / med["nccl"]
    row["gradsync_vs_compute"] = med["gradsync"] / med["compute"]
    row["nccl_vs_compute"] = med["nccl"] / med["compute"]
    return row


# ---- MPS ----
class Mps:
    """A private MPS control daemon (nvidia-cuda-mps-control -d), its pipe and log folders in
    `folder`: clients are the processes given `env`. stop() quits it (and, should quit not end
    it, kills the MPS processes that carry this pipe folder, and only those)."""

    def __init__(self, folder):
        self.pipe = os.path.join(folder, "mps-pipe")
        self.log = os.path.join(folder, "mps-log")
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": self.pipe, "CUDA_MPS_LOG_DIRECTORY": self.log}
        self.exe = shutil.which("nvidia-cuda-mps-control")
        self.started = False

    def start(self):
        """None once the control daemon listens; otherwise why not."""
        if not self.exe:
            return "nvidia-cuda-mps-control is not on PATH"
        os.makedirs(self.pipe, exist_ok=True)
        os.makedirs(self.log, exist_ok=True)
        said = os.path.join(self.log, "start.txt")
        try:
            # Its output to a file, not a pipe: the daemon it forks could hold a pipe open.
            with open(said, "w") as f:
                rc = subprocess.run([self.exe, "-d"], env=dict(os.environ, **self.env),
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                    timeout=15).returncode
        except subprocess.TimeoutExpired:
            self.started = True
            return "nvidia-cuda-mps-control -d did not return within 15 s"
        except OSError as e:
            return f"nvidia-cuda-mps-control -d: {e}"
        if rc != 0:
            with open(said) as f:
                return (f"nvidia-cuda-mps-control -d exited {rc}: "
                        f"{' '.join(f.read().split())[-300:]}{self.log_tail()}")
        self.started = True
        until = time.monotonic() + 5
        while not os.path.exists(os.path.join(self.pipe, "control")):
            if time.monotonic() > until:
                return f"no control pipe in {self.pipe} 5 s after the start{self.log_tail()}"
            time.sleep(0.05)
        return None

    def log_tail(self):
        lines = []
        for name in ("control.log", "server.log"):
            try:
                with open(os.path.join(self.log, name)) as f:
                    lines += [f"{name}: {x.strip()}" for x in f.readlines()[-3:]]
            except OSError:
                pass
        return ("; " + " | ".join(lines)) if lines else ""

    def processes(self):
        """PIDs of the MPS control daemon and servers with this pipe folder."""
        mark = f"CUDA_MPS_PIPE_DIRECTORY={self.pipe}".encode()
        pids = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if not f.read().startswith("nvidia-cuda-mps"):
                        continue
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        pids.append(int(pid))
            except OSError:
                continue
        return pids

    def stop(self):
        """Quits the control daemon (its clients must be gone); says how it went."""
        if not self.started:
            return "not started"
        said = "quit"
        try:
            subprocess.run([self.exe], input="quit\n", env=dict(os.environ, **self.env),
                           text=True, capture_output=True, timeout=MPS_QUIT_S)
        except (subprocess.TimeoutExpired, OSError) as e:
            said = f"quit failed ({e})"
        until = time.monotonic() + 5
        while self.processes() and time.monotonic() < until:
            time.sleep(0.1)
        left = self.processes()
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        self.started = False
        return said + (f"; killed MPS processes {left} still running after it" if left else
                       ": stopped")


def start_mps(mps, timeout_s):
    """Starts `mps` and checks that a fresh process's CUDA contexts on every device are its
    clients (within `timeout_s`): None then; otherwise why not, `mps` stopped again."""
    why = mps.start()
    if why is None:
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--mps_probe"],
                               env=dict(os.environ, **mps.env), text=True, capture_output=True,
                               timeout=timeout_s)
            lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
            try:
                probe = json.loads(lines[-1]) if lines else None
            except ValueError:
                probe = None
            if p.returncode != 0 or probe is None:
                why = (f"CUDA under MPS failed (exit {p.returncode}): "
                       f"{' '.join(p.stderr.split())[-300:]}{mps.log_tail()}")
            elif not probe["mps"] or not all(probe["mps"]):
                why = (f"CUDA did not make this process an MPS client (MPS_ENABLED per device: "
                       f"{probe['mps']}){mps.log_tail()}")
        except subprocess.TimeoutExpired:
            why = f"CUDA under MPS did not initialise within {timeout_s:.0f} s{mps.log_tail()}"
    if why is not None and mps.started:
        print(f"# mps: stopping the control daemon: {mps.stop()}", flush=True)
    return why


def daemon_mps_line(log_path, wait_s=3.0):
    """The daemon's own "gpu: mps=MODE reason=..." line (logged at its start), as (mode,
    reason); it is looked for during `wait_s`."""
    until = time.monotonic() + wait_s
    while True:
        try:
            with open(log_path) as f:
                for line in f:
                    m = re.search(r"gpu: mps=(\S+) reason=(.*)", line)
                    if m:
                        return m.group(1), m.group(2).strip()
        except OSError:
            pass
        if time.monotonic() > until:
            return "unknown", "no 'gpu: mps=' line in gradsyncd's log"
        time.sleep(0.1)


# ---- the run ----
def print_run(row, mps_mode):
    print(f"{'ranks':>5} {'variant':<9} {'steps':>5} {'median_ms':>10} {'min_ms':>9} "
          f"{'p90_ms':>9} {'vs_compute':>10}")
    for v in VARIANTS:
        ms = row["ms"][v]
        print(f"{row['ranks']:>5} {v:<9} {row['steps']:>5} {ms['median']:>10.3f} "
              f"{ms['min']:>9.3f} {ms['p90']:>9.3f} "
              f"{ms['median'] / row['ms']['compute']['median']:>9.3f}x")
    if mps_mode == "on":
        goal = "goal <= 1.10 with MPS: " + ("ok" if row["ratio"] <= 1.10 else "MISSED")
    else:
        goal = "the goal (<= 1.10) is with MPS"
    print(f"overlap efficiency, {row['ranks']} rank(s), MPS {mps_mode}: gradsync/nccl = "
          f"{row['ratio']:.3f}x ({goal}); gradsync/compute = {row['gradsync_vs_compute']:.3f}x, "
          f"nccl/compute = {row['nccl_vs_compute']:.3f}x")
    for what, ok in row["checks"].items():
        if not ok:
            print(f"# value check FAILED: {what}")
    sys.stdout.flush()


def main():
    args = parse_args()
    if args.mps_probe:
        return mps_probe()
    start = time.time()
    torch = torch_gpu_common.need_cuda("gpu_overlap")
    gpus = torch.cuda.device_count()
    if not os.access(args.daemon, os.X_OK):
        print(f"gpu_overlap: no gradsyncd at '{args.daemon}' (--daemon or GRADSYNC_DAEMON_PATH)")
        return 1
    deadline = start + args.budget_s - STOP_MARGIN_S
    cfg = {k: getattr(args, k) for k in ("buckets", "bucket_mib", "matmul_n", "matmuls", "dtype",
                                         "warmup", "steps", "op_timeout_s")}
    info = {"bench": "gpu_overlap", **torch_gpu_common.torch_info(torch), "gpus": gpus,
            "config": cfg, "mps": {"requested": args.mps, "mode": "off", "reason": "",
                                   "daemon": None, "daemon_reason": None, "trainer": None,
                                   "stop": None},
            "complete": False, "runs": [], "errors": []}
    folder = tempfile.mkdtemp(prefix="gradsync-overlap-")
    mps, daemon, failed = None, None, False

    def on_term(signum, _frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop; the cleanup runs to its end
        info["errors"].append(f"stopped by signal {signum}")
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_term)
    print(f"# gpu_overlap: {info['device']} x{gpus}, torch {info['torch']} (CUDA "
          f"{info['torch_cuda']}, NCCL {info['torch_nccl']}), Python {info['python']}")
    print(f"# a step: {args.buckets} chunks of {args.matmuls} {args.dtype} matmuls "
          f"{args.matmul_n}x{args.matmul_n}, each followed by an async all-reduce (mean) of a "
          f"{args.bucket_mib} MiB float32 bucket; {args.warmup} warm-up and at most "
          f"{args.steps} timed rounds of every variant, interleaved", flush=True)
    try:
        env = {}
        if args.mps:
            mps = Mps(folder)  # set before it starts: the cleanup below stops it whatever comes
            why = start_mps(mps, min(MPS_PROBE_S, max(5, deadline - time.time() - MIN_RUN_S)))
            if why is not None:
                info["mps"]["reason"] = f"MPS requested, not used: {why}"
                print(f"# mps: not used, measuring without it: {why}", flush=True)
            else:
                env = mps.env
        daemon, sock, log_path = torch_gpu_common.start_daemon(args.daemon, folder, env=env,
                                                               log_level="info")
        mode, reason = daemon_mps_line(log_path)
        info["mps"]["daemon"], info["mps"]["daemon_reason"] = mode, reason
        print(f"# gradsyncd: gpu: mps={mode} reason={reason}", flush=True)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the spawned ranks are MPS clients too
        try:
            worlds = [1] + ([gpus] if gpus > 1 and args.all_gpus == "auto" else [])
            for k, world in enumerate(worlds):
                left = deadline - time.time()
                if left < MIN_RUN_S:
                    info["errors"].append(f"{world} rank(s): not run, {left:.0f} s left")
                    failed = True
                    continue
                until = time.time() + (left * 0.55 if k + 1 < len(worlds) else left)
                try:
                    row = summarise(world, run_ranks(world, cfg, sock, folder, until))
                except (RuntimeError, OSError, ValueError, KeyError) as e:
                    info["errors"].append(f"{world} rank(s): {e}")
                    print(f"# {world} rank(s) FAILED: {e}", flush=True)
                    failed = True
                    continue
                trainer_on = all(row["trainer_mps"])
                if not env:
                    row["mps"] = "off"
                elif trainer_on and mode == "on":
                    row["mps"] = "on"
                else:
                    row["mps"] = "partial"
                    row["mps_reason"] = (f"gradsyncd mps={mode}, trainers' MPS_ENABLED "
                                         f"{row['trainer_mps']}")
                info["mps"]["mode"] = row["mps"]
                info["mps"]["trainer"] = row["trainer_mps"]
                failed |= not all(row["checks"].values())
                info["runs"].append(row)
                print_run(row, row["mps"])
                torch_gpu_common.write_json(args.json, info)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        info["complete"] = not info["errors"]
    except (RuntimeError, OSError) as e:
        info["errors"].append(str(e))
        print(f"gpu_overlap: {e}")
        failed = True
    finally:
        if daemon is not None:
            torch_gpu_common.stop_daemon(daemon)
        if mps is not None and mps.started:
            info["mps"]["stop"] = mps.stop()
            print(f"# mps: control daemon {info['mps']['stop']}", flush=True)
        torch_gpu_common.write_json(args.json, info)
        shutil.rmtree(folder, ignore_errors=True)
    if info["mps"]["reason"]:
        print(f"# {info['mps']['reason']}")
    return 1 if failed or not info["runs"] else 0


if __name__ == "__main__":
    sys.exit(main())
