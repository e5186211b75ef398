#!/usr/bin/python3
"""Training steps per second of the example trainer: gradsync vs torch DDP (gloo), same run.

For each model size and rank count, runs client/python/examples/train.py as W separate
processes three ways, one after another on this machine:
  gradsync_pack   DistributedOptimizer, param_pack on (one fused all-reduce per pack)
  gradsync        DistributedOptimizer, one all-reduce per gradient
  ddp_gloo        torch.nn.parallel.DistributedDataParallel over gloo (its default buckets)
and prints each one's steps/s (the slowest rank's, timed after the warm-up steps) and the
ratio of gradsync to DDP. Every rank trains on its 1/W shard of a fixed global batch.

  /usr/bin/python3 bench/train_bench.py --build build --ranks 2,4 --json /tmp/tb.json
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
PYTHON = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) else sys.executable
MODELS = {  # name: (layer widths, global batch)
    "small": ("32,64,64,8", 64),         # 6.8k parameters: per-op latency dominates
    "large": ("512,1024,1024,1024,512", 64),  # 2.6M parameters (10.5 MB of gradients)
}
MODES = ("gradsync_pack", "gradsync", "ddp_gloo")


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def start_daemon(build, tmp):
    sock = os.path.join(tmp, "gradsyncd.sock")
    err = open(os.path.join(tmp, "gradsyncd.log"), "w")
    proc = subprocess.Popen([os.path.join(build, "daemon", "gradsyncd"), f"--socket={sock}",
                             "--port=-1", "--log_sink=stderr", "--log_level=warning"], stderr=err)
    ctl = os.path.join(build, "client", "gradsyncctl")
    deadline = time.monotonic() + 20
    while subprocess.run([ctl, f"--socket={sock}", "--timeout=1s", "health"],
                         capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("gradsyncd did not start")
        time.sleep(0.05)
    return proc, sock


def run(mode, world, model, steps, warmup, sock, build, port, timeout):
    dims, batch = MODELS[model]
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   GRADSYNC_SOCKET=sock, GRADSYNC_JOB=f"tb-{mode}-{world}-{model}-{port}",
                   PYTHONPATH=os.path.join(build, "python"), OMP_NUM_THREADS="1")
        args = [PYTHON, EXAMPLE, "--dims", dims, "--batch", str(batch), "--steps", str(steps),
                "--warmup", str(warmup)]
        if mode == "ddp_gloo":
            args += ["--mode", "ddp"]
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
    ap.add_argument("--models", default="small,large")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (0: by model)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    tmp = tempfile.mkdtemp(prefix="gradsync-tb-")
    daemon, sock = start_daemon(build, tmp)
    results = []
    try:
        print(f"training steps/s, example trainer, {os.cpu_count()} cores, each rank a process; "
              f"load average {os.getloadavg()[0]:.2f} before the run")
        port = 29600 + os.getpid() % 1000
        for model in args.models.split(","):
            steps = args.steps or (300 if model == "small" else 40)
            for world in (int(w) for w in args.ranks.split(",")):
                row = {"model": model, "ranks": world, "steps": steps}
                for mode in MODES:
                    port += 1
                    log(f"{model} {world} ranks {mode} ...")
                    row[mode] = run(mode, world, model, steps, max(3, steps // 10), sock, build,
                                    port, args.timeout)
                results.append(row)
        print(f"\n{'model':<7}{'ranks':>6}{'gradsync+pack':>15}{'gradsync':>10}{'ddp gloo':>10}"
              f"{'pack/ddp':>10}{'gs/ddp':>8}")
        for row in results:
            print(f"{row['model']:<7}{row['ranks']:>6}{row['gradsync_pack']:>15.1f}"
                  f"{row['gradsync']:>10.1f}{row['ddp_gloo']:>10.1f}"
                  f"{row['gradsync_pack'] / row['ddp_gloo']:>9.2f}x"
                  f"{row['gradsync'] / row['ddp_gloo']:>7.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


if __name__ == "__main__":
    main()
