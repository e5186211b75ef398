#!/usr/bin/python3
"""CPU allreduce: gradsync vs Open MPI vs torch.distributed gloo, same run, same machine.

Runs, one after another:
  membw                      <build>/bench/membw: this machine's copy and read bandwidth
  gradsync                   a private gradsyncd plus N <build>/bench/collective_bench_worker
  gradsync_elastic           the same as an elastic job (only when asked with --only): across
                             nodes its large all-reduces run the ring in the daemon's scratch
                             buffer, copied to the members once done (a change writes nothing)
  torch_gloo                 bench/torch_gloo_allreduce.py under this interpreter and its torch
  openmpi                    mpirun -np N <build>/bench/mpi_allreduce (shared memory, unbound)
and prints, per rank count:
  * per size: median latency and bus bandwidth of each, and gradsync's busbw relative to each
    peer and to the bound below. nccl-tests convention: algbw = bytes / time,
    busbw = algbw * 2(n-1)/n (the per-rank link traffic of a ring allreduce), GB = 1e9 bytes.
  * 200 gradients of 40 KiB: gradsync one call each (grads200_each) and fused (grads200_fused),
    one flat 8192000-byte allreduce, and the peers' one call each.
  * the memory-bandwidth bound of gradsync's in-daemon local reduce: for N ranks and S bytes
    the daemon reads N*S and writes N*S, so time >= 2*N*S / copyBW (membw's copy GB/s counts
    bytes read + written), and busbw <= (S / time) * 2(N-1)/N = copyBW * (N-1) / N^2.
    It is a DRAM bound: sizes whose N*S fits in the last-level cache can beat it.
Each client is a separate process; with more ranks than cores the machine is oversubscribed
and the numbers show it. An implementation whose binary is missing is reported as skipped.

Run with the interpreter whose torch is the peer (the driver itself only uses the stdlib):
  .venv/bin/python bench/collective_bench.py --build build --ranks 2,4 --json /tmp/cb.json
(torch 2.x; /usr/bin/python3 for Debian's torch 1.13).
"""
import argparse
import json
import os
import re
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time

IMPLS = ("gradsync", "gradsync_elastic", "torch_gloo", "openmpi")
DEFAULT_IMPLS = ("gradsync", "torch_gloo", "openmpi")
DEFAULT_SIZES = "4096,65536,1048576,16777216,67108864,268435456"
FLAT_GRADS_BYTES = 200 * 40 * 1024  # the 200 x 40 KiB gradients as one flat buffer
HERE = os.path.dirname(os.path.abspath(__file__))


class Skip(Exception):
    """An implementation that cannot run here (missing binary); reported, not fatal."""


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def parse_lines(text, impl):
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("impl") == impl:
            out.append(rec)
    return out


def tail(text, lines=8):
    return "\n".join(text.strip().splitlines()[-lines:])


def tail_file(path, lines=8):
    with open(path, errors="replace") as f:
        return tail(f.read(), lines)


def need(path):
    if not os.access(path, os.X_OK):
        raise Skip(f"{path} not found (build it first)")
    return path


def kill_group(p):
    """Ends p and everything it started (its own session): SIGTERM, then SIGKILL after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            break
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
    p.wait()


def run(cmd, timeout):
    """Runs cmd in its own session; returns stdout or raises RuntimeError with stderr's tail."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except BaseException as e:  # the deadline, or ^C (which the new session does not get)
        kill_group(p)
        if isinstance(e, subprocess.TimeoutExpired):
            raise RuntimeError(f"timed out after {timeout:g} s: {' '.join(cmd)}")
        raise
    if p.returncode != 0:
        raise RuntimeError(f"exit {p.returncode}: {' '.join(cmd)}\n{tail(err or out)}")
    return out


def wait_all(procs, timeout):
    """Waits for every Popen in procs; kills the rest at the first failure or at the deadline."""
    deadline = time.monotonic() + timeout
    failed = None
    while failed is None:
        codes = [p.poll() for p in procs]
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            failed = f"rank {bad[0]} exited with {codes[bad[0]]}"
        elif None not in codes:
            return
        elif time.monotonic() > deadline:
            failed = f"timed out after {timeout:g} s"
        else:
            time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait(10)
    raise RuntimeError(failed)


def run_membw(args):
    cpus = os.cpu_count() or 1
    threads = "1" if cpus == 1 else f"1,{cpus}"
    out = run([need(os.path.join(args.build, "bench", "membw")), f"--bytes={args.membw_bytes}",
               f"--threads={threads}", f"--seconds={args.seconds:g}"], args.timeout)
    return parse_lines(out, "membw")


def run_gradsync(args, n, tmp, impl="gradsync"):
    build = args.build
    daemon_bin = need(os.path.join(build, "daemon", "gradsyncd"))
    ctl_bin = need(os.path.join(build, "client", "gradsyncctl"))
    worker_bin = need(os.path.join(build, "bench", "collective_bench_worker"))
    sizes = sorted(set(args.sizes) | {FLAT_GRADS_BYTES})
    job = f"cbench-{os.getpid()}-{n}-{time.time_ns()}"
    nodes = args.nodes
    if n % nodes:
        raise Skip(f"{n} ranks do not split evenly over {nodes} nodes")
    socks = [os.path.join(tmp, f"{job}-{i}.sock") for i in range(nodes)]
    logs = [os.path.join(tmp, f"{job}-gradsyncd{i}.log") for i in range(nodes)]
    daemon_log = logs[0]
    daemons, addresses = [], []
    # Several nodes: TCP between the daemons, which needs the cluster token they share.
    token_file = os.path.join(tmp, "cluster.token")
    if nodes > 1:
        with open(os.open(token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("collective-bench\n")
    for sock, path in zip(socks, logs):
        with open(path, "w") as err:
            # One node: no TCP. Several: each daemon on its own loopback port (logged at info).
            tcp = ["--port=-1"] if nodes == 1 else ["--port=0", f"--token_file={token_file}"]
            daemons.append(subprocess.Popen(
                [daemon_bin, f"--socket={sock}", *tcp,
                 "--log_sink=stderr", "--log_level=warning" if nodes == 1 else "--log_level=info",
                 *args.daemon_flags.split()],
                stderr=err))
    daemon = daemons[0]
    try:
        for sock, path, d in zip(socks, logs, daemons):
            deadline = time.monotonic() + 10
            while not os.path.exists(sock):
                if d.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gradsyncd did not create {sock}:\n{tail_file(path)}")
                time.sleep(0.02)
            while True:
                try:
                    h = subprocess.run([ctl_bin, f"--socket={sock}", "--timeout=2s", "health"],
                                       capture_output=True, text=True, timeout=10)
                    rc, why = h.returncode, tail(h.stderr or h.stdout)
                except subprocess.TimeoutExpired:
                    rc, why = None, "gradsyncctl hung"
                if rc == 0:
                    break
                if d.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"gradsyncctl health: exit {rc}: {why}\n"
                                       f"{tail_file(path)}")
                time.sleep(0.1)
            if nodes > 1:
                with open(path) as f:
                    m = re.search(r"tcp=(\S+:\d+)", f.read())
                if not m:
                    raise RuntimeError(f"no tcp address in {path}")
                addresses.append(m.group(1))

        procs, outs = [], []
        local = n // nodes
        for r in range(n):
            out_path = os.path.join(tmp, f"{job}-rank{r}.out")
            outs.append(out_path)
            extra = [] if nodes == 1 else [f"--local_world_size={local}",
                                           f"--root_address={addresses[0]}"]
            with open(out_path, "w") as out, open(out_path[:-4] + ".err", "w") as err:
                procs.append(subprocess.Popen(
                    [worker_bin, f"--socket={socks[r // local]}", f"--job={job}",
                     f"--world_size={n}", f"--rank={r}", "--sizes=" + ",".join(map(str, sizes)),
                     f"--min_iters={args.min_iters}", f"--max_iters={args.max_iters}",
                     f"--seconds={args.seconds:g}",
                     "--elastic=" + ("true" if impl == "gradsync_elastic" else "false")] + extra,
                    stdout=out, stderr=err))
        try:
            wait_all(procs, args.timeout)
        except RuntimeError as e:
            errs = [f"rank {r} stderr: {tail_file(o[:-4] + '.err', 4)}" for r, o in enumerate(outs)
                    if os.path.getsize(o[:-4] + ".err")]
            if os.path.getsize(daemon_log):
                errs.append("gradsyncd: " + tail_file(daemon_log, 4))
            raise RuntimeError("\n    ".join([f"collective_bench_worker: {e}", *errs]))
        with open(outs[0]) as f:
            recs = parse_lines(f.read(), "gradsync")  # the worker's records name "gradsync"
            for rec in recs:
                rec["impl"] = impl
            return recs
    finally:
        for daemon in daemons:
            if daemon.poll() is None:
                daemon.send_signal(signal.SIGTERM)
                try:
                    daemon.wait(30)
                except subprocess.TimeoutExpired:
                    log("gradsyncd did not exit 30 s after SIGTERM; killed")
                    daemon.kill()
                    daemon.wait(10)


def run_torch_gloo(args, n):
    script = os.path.join(HERE, "torch_gloo_allreduce.py")
    python = sys.executable
    if not os.path.isfile(script):
        raise Skip(f"{script} not found")
    out = run([python, script, f"--ranks={n}", "--sizes=" + ",".join(map(str, args.sizes)),
               f"--min-iters={args.min_iters}", f"--max-iters={args.max_iters}",
               f"--seconds={args.seconds:g}", f"--timeout={max(1.0, args.timeout - 10):g}"],
              args.timeout)
    return parse_lines(out, "torch_gloo")


def run_openmpi(args, n):
    binary = need(os.path.join(args.build, "bench", "mpi_allreduce"))
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise Skip("mpirun not on PATH")
    # Shared memory only (btl self,vader), the launcher's own channel on loopback, no binding
    # (like the other peers), more ranks than cores allowed; root needs explicit permission.
    # With --nodes > 1 the byte path is TCP on loopback (btl self,tcp), as between nodes.
    btl = "self,vader" if args.nodes == 1 else "self,tcp"
    cmd = [mpirun, "--oversubscribe", "--bind-to", "none", "-np", str(n),
           "--mca", "btl", btl, "--mca", "oob_tcp_if_include", "lo"]
    if args.nodes > 1:
        cmd += ["--mca", "btl_tcp_if_include", "lo"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    cmd += [binary, "--sizes", ",".join(map(str, args.sizes)), "--min-iters",
            str(args.min_iters), "--max-iters", str(args.max_iters), "--seconds",
            f"{args.seconds:g}"]
    return parse_lines(run(cmd, args.timeout), "openmpi")


def busbw(rec):
    """nccl-tests bus bandwidth in GB/s of one JSON record (0 for a single rank)."""
    n, t = rec["ranks"], rec["median_us"] * 1e-6
    return rec["bytes"] / t / 1e9 * 2 * (n - 1) / n if t > 0 else 0.0


def find(results, impl, case, n, nbytes):
    for rec in results:
        if (rec.get("impl"), rec.get("case"), rec.get("ranks"), rec.get("bytes")) == \
                (impl, case, n, nbytes):
            return rec
    return None


def human(nbytes):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "-"


def copy_bw(results):
    """Best copy GB/s over thread counts (the machine's limit), with its thread count."""
    recs = [r for r in results if r.get("impl") == "membw" and r.get("case") == "copy"]
    best = max(recs, key=lambda r: r["GBps"], default=None)
    return (best["GBps"], best["threads"]) if best else (None, None)


def print_tables(args, n, results, notes):
    impls = [i for i in IMPLS if i in args.only]
    bw, _ = copy_bw(results)
    bound = bw * (n - 1) / (n * n) if bw and n > 1 else None
    print(f"\n== {n} ranks: allreduce, in-place float32 sum; median us and busbw GB/s ==")
    for impl in impls:
        if impl in notes.get(n, {}):
            print(f"  {impl}: {notes[n][impl]}")
    cols = [f"{'size':>9}"]
    for impl in impls:
        cols += [f"{impl + ' us':>15}", f"{'busbw':>7}"]
    if "gradsync" in impls:
        cols += [f"{'gs/' + i:>14}" for i in impls if i != "gradsync"]
        cols.append(f"{'gs/bound':>9}")
    header = " ".join(cols)
    print(header)
    print("-" * len(header))
    for size in args.sizes:
        recs = {i: find(results, i, "allreduce", n, size) for i in impls}
        row = [f"{human(size):>9}"]
        for impl in impls:
            rec = recs[impl]
            row += [f"{rec['median_us']:>15,.1f}", f"{busbw(rec):>7.3f}"] if rec else \
                [f"{'-':>15}", f"{'-':>7}"]
        if "gradsync" in impls:
            gs = recs["gradsync"] and busbw(recs["gradsync"])
            row += [f"{ratio(gs, recs[i] and busbw(recs[i])):>14}" for i in impls
                    if i != "gradsync"]
            row.append(f"{ratio(gs, bound):>9}")
        print(" ".join(row))

    print(f"\n== {n} ranks: 200 gradients of 40 KiB (8192000 bytes in all) ==")
    rows = [("gradsync", "grads200_each", "gradsync, one allreduce each"),
            ("gradsync", "grads200_fused", "gradsync, fused"),
            ("gradsync", "allreduce", "gradsync, one flat 8192000 B buffer"),
            ("torch_gloo", "grads200_each", "torch gloo, one all_reduce each"),
            ("openmpi", "grads200_each", "Open MPI, one MPI_Allreduce each")]
    header = f"{'':<38} {'median ms':>10} {'p10 ms':>9} {'p90 ms':>9} {'busbw':>7}"
    print(header)
    print("-" * len(header))
    for impl, case, label in rows:
        if impl not in impls:
            continue
        rec = find(results, impl, case, n, FLAT_GRADS_BYTES)
        if rec:
            print(f"{label:<38} {rec['median_us'] / 1e3:>10.2f} {rec['p10_us'] / 1e3:>9.2f} "
                  f"{rec['p90_us'] / 1e3:>9.2f} {busbw(rec):>7.3f}")
        else:
            print(f"{label:<38} {'-':>10} {'-':>9} {'-':>9} {'-':>7}")

    if bound:
        line = (f"\nmemory bound of the in-daemon reduce: copy {bw:.1f} GB/s -> busbw <= "
                f"copyBW*(N-1)/N^2 = {bound:.3f} GB/s at {n} ranks")
        big = find(results, "gradsync", "allreduce", n, max(args.sizes))
        if big:
            line += f"; gradsync at {human(big['bytes'])}: {busbw(big) / bound:.0%} of it"
        print(line)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def torch_version():
    """The torch the gloo peer runs (this interpreter's), or None."""
    try:
        import torch  # noqa: PLC0415 - the driver needs no torch itself
    except ImportError:
        return None
    return torch.__version__


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default="build", help="CMake build directory")
    ap.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated bytes of float32")
    ap.add_argument("--seconds", type=float, default=2.0, help="target time per case")
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--only", default=",".join(DEFAULT_IMPLS), help="subset of " + ",".join(IMPLS))
    ap.add_argument("--membw-bytes", type=int, default=1 << 30,
                    help="membw buffer size; keep it well above the last-level cache")
    ap.add_argument("--timeout", type=float, default=0,
                    help="bound on each subprocess in seconds (default: from sizes and seconds)")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--nodes", type=int, default=1,
                    help="gradsync daemons to spread the ranks over (loopback TCP between them, "
                         "Gloo); Open MPI then uses btl tcp instead of shared memory")
    ap.add_argument("--daemon-flags", default="",
                    help="extra gradsyncd flags, space-separated (e.g. '--history_size=0 "
                         "--stall_warn=0' against '--metrics_port=0' for the observability cost)")
    args = ap.parse_args()
    try:
        ranks = list(dict.fromkeys(int(r) for r in args.ranks.split(",")))
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error("--ranks and --sizes: comma-separated integers")
    args.only = [i.strip() for i in args.only.split(",") if i.strip()]
    if any(i not in IMPLS for i in args.only):
        ap.error("--only: choose from " + ",".join(IMPLS))
    if any(not 1 <= r <= 64 for r in ranks) or any(s < 4 or s % 4 for s in args.sizes):
        ap.error("ranks must be 1..64, sizes positive multiples of 4")
    if not 0 < args.seconds <= 60 or not 1 <= args.min_iters <= args.max_iters:
        ap.error("need 0 < --seconds <= 60 and 1 <= --min-iters <= --max-iters")
    if args.timeout <= 0:  # cases run about --seconds each, plus start-up and verification
        args.timeout = 120 + 5 * (len(args.sizes) + 3) * (args.seconds + 2)

    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.2f} before the run; other work skews these numbers")
    results, notes, failures = [], {}, []
    tmp = tempfile.mkdtemp(prefix="gradsync-cbench-")
    try:
        log("membw ...")
        try:
            results += run_membw(args)
        except Skip as e:
            notes[0] = {"membw": f"skipped: {e}"}
        except RuntimeError as e:
            notes[0] = {"membw": f"failed: {e}"}
        for n in ranks:
            for impl in args.only:
                log(f"{impl}, {n} ranks ...")
                t0 = time.monotonic()
                try:
                    if impl.startswith("gradsync"):
                        results += run_gradsync(args, n, tmp, impl)
                    elif impl == "torch_gloo":
                        results += run_torch_gloo(args, n)
                    else:
                        results += run_openmpi(args, n)
                except Skip as e:
                    notes.setdefault(n, {})[impl] = f"skipped: {e}"
                except RuntimeError as e:
                    notes.setdefault(n, {})[impl] = f"failed: {e}"
                    failures.append(f"{impl} at {n} ranks")
                log(f"  {time.monotonic() - t0:.1f} s")
    finally:
        if failures and os.listdir(tmp):
            log(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    print(f"CPU allreduce, {os.cpu_count()} cores ({cpu_model()}), ~{args.seconds:g} s per case, "
          f"each rank a separate process; torch {torch_version()} for gloo; load average "
          f"{load:.2f} before the run")
    for rec in results:
        if rec.get("impl") == "membw":
            print(f"membw {rec['case']:<4} {rec['threads']} thread(s): {rec['GBps']:.1f} GB/s"
                  + (" (read+written bytes)" if rec["case"] == "copy" else " (bytes read)"))
    if 0 in notes:
        print("membw " + notes[0]["membw"])
    for n in ranks:
        print_tables(args, n, results, notes)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "cpu": cpu_model(), "load_before": load,
                       "python": sys.executable, "torch": torch_version(),
                       "args": vars(args), "ranks": ranks, "results": results,
                       "notes": {str(k): v for k, v in notes.items()}}, f, indent=1)
    if failures:
        sys.exit("failed: " + ", ".join(failures))


if __name__ == "__main__":
    main()
