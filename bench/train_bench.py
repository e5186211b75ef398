#!/usr/bin/python3
"""Training steps per second of the example trainer: gradsync vs torch DDP (gloo), same run.

For each model size, rank count and daemon count, runs client/python/examples/train.py as W
separate processes four ways, one after another on this machine:
  gradsync_pack   DistributedOptimizer, param_pack on (one fused all-reduce per pack)
  gradsync        DistributedOptimizer, one all-reduce per gradient
  ddp_gradsync    torch DistributedDataParallel on torch.distributed's backend "gradsync"
  ddp_gloo        torch DistributedDataParallel over gloo (its default buckets)
and prints each one's steps/s (the slowest rank's, timed after the warm-up steps) and the
ratios to DDP over gloo. Every rank trains on its 1/W shard of a fixed global batch. With
--daemons 2 the ranks are split over two daemons on loopback standing for two nodes (gloo's
ranks are unaffected). The trainers run under this interpreter: run it with .venv/bin/python
for torch 2.x, /usr/bin/python3 for Debian's torch 1.13.

  .venv/bin/python bench/train_bench.py --build build --ranks 2,4 --daemons 1,2 --json /tmp/tb.json
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
EXAMPLE = os.path.join(ROOT, "client", "python", "examples", "train.py")
PYTHON = sys.executable
MODELS = {  # name: (layer widths, global batch)
    "small": ("32,64,64,8", 64),         # 6.8k parameters: per-op latency dominates
    "large": ("512,1024,1024,1024,512", 64),  # 2.6M parameters (10.5 MB of gradients)
}
MODES = ("gradsync_pack", "gradsync", "ddp_gradsync", "ddp_gloo")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def start_daemon(build, tmp, name, tcp_port=None, token=None):
    """A gradsyncd on a private socket; with tcp_port, on that loopback port too (another node
    of the job)."""
    sock = os.path.join(tmp, f"{name}.sock")
    err = open(os.path.join(tmp, f"{name}.log"), "w")
    args = [os.path.join(build, "daemon", "gradsyncd"), f"--socket={sock}",
            "--log_sink=stderr", "--log_level=warning"]
    args += [f"--port={tcp_port}", f"--token_file={token}"] if tcp_port else ["--port=-1"]
    proc = subprocess.Popen(args, stderr=err)
    ctl = os.path.join(build, "client", "gradsyncctl")
    deadline = time.monotonic() + 20
    while subprocess.run([ctl, f"--socket={sock}", "--timeout=1s", "health"],
                         capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("gradsyncd did not start")
        time.sleep(0.05)
    return proc, sock


def start_daemons(build, tmp, n, port):
    """n daemons: [(process, socket)], and the root's address (None for one)."""
    if n == 1:
        return [start_daemon(build, tmp, "one")], None
    token = os.path.join(tmp, "cluster.token")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("train-bench-token\n")
    return ([start_daemon(build, tmp, f"node{i}", port + i, token) for i in range(n)],
            f"127.0.0.1:{port}")


def run(mode, world, model, steps, warmup, socks, root, build, port, timeout):
    dims, batch = MODELS[model]
    procs = []
    local = world // len(socks)
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r % local),
                   LOCAL_WORLD_SIZE=str(local), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   GRADSYNC_SOCKET=socks[r // local],
                   GRADSYNC_JOB=f"tb-{mode}-{world}-{model}-{port}",
                   PYTHONPATH=os.path.join(build, "python"), OMP_NUM_THREADS="1")
        if root:
            env["GRADSYNC_ROOT_ADDRESS"] = root
        args = [PYTHON, EXAMPLE, "--dims", dims, "--batch", str(batch), "--steps", str(steps),
                "--warmup", str(warmup)]
        if mode == "ddp_gloo":
            args += ["--mode", "ddp"]
        elif mode == "ddp_gradsync":
            args += ["--mode", "ddp", "--backend", "gradsync"]
        elif mode == "gradsync_pack":
            args += ["--param_pack"]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    rates = []
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{mode} with {world} ranks took over {timeout} s")
        if p.returncode != 0:
            raise RuntimeError(f"{mode}: exit {p.returncode}: {err[-1500:]}")
        rates.append(json.loads(out.strip().splitlines()[-1])["steps_per_s"])
    return min(rates)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--daemons", default="1", help="daemon counts to run each rank count on")
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (0: by model)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    import torch  # noqa: PLC0415 - only to say which torch the trainers run
    results = []
    port = 29600 + os.getpid() % 1000
    print(f"training steps/s, example trainer, torch {torch.__version__}, {os.cpu_count()} "
          f"cores, each rank a process; load average {os.getloadavg()[0]:.2f} before the run")
    for n in (int(d) for d in args.daemons.split(",")):
        tmp = tempfile.mkdtemp(prefix="gradsync-tb-")
        port += 10
        daemons, root = start_daemons(build, tmp, n, port)
        try:
            for model in args.models.split(","):
                steps = args.steps or (300 if model == "small" else 40)
                for world in (int(w) for w in args.ranks.split(",")):
                    if world % n:
                        continue
                    row = {"model": model, "ranks": world, "daemons": n, "steps": steps,
                           "torch": torch.__version__}
                    for mode in MODES:
                        port += 1
                        log(f"{model} {world} ranks {n} daemon(s) {mode} ...")
                        row[mode] = run(mode, world, model, steps, max(3, steps // 10),
                                        [s for _, s in daemons], root, build, port, args.timeout)
                    results.append(row)
        finally:
            for proc, _ in daemons:
                proc.send_signal(signal.SIGTERM)
                proc.wait(30)
    print(f"\n{'model':<7}{'ranks':>6}{'daemons':>8}{'gs+pack':>9}{'gradsync':>10}"
          f"{'ddp/gs':>8}{'ddp/gloo':>10}{'pack/gloo':>11}{'gs/gloo':>9}{'ddp gs/gloo':>13}")
    for row in results:
        gloo = row["ddp_gloo"]
        print(f"{row['model']:<7}{row['ranks']:>6}{row['daemons']:>8}{row['gradsync_pack']:>9.1f}"
              f"{row['gradsync']:>10.1f}{row['ddp_gradsync']:>8.1f}{gloo:>10.1f}"
              f"{row['gradsync_pack'] / gloo:>10.2f}x{row['gradsync'] / gloo:>8.2f}x"
              f"{row['ddp_gradsync'] / gloo:>12.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
