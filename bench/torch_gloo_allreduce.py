#!/usr/bin/python3
"""torch.distributed gloo peer for bench/collective_bench.py: CPU allreduce latency.

Spawns --ranks worker processes on this machine (gloo over 127.0.0.1, one intra-op thread
each) and measures, like bench/mpi_allreduce.c:
  allreduce      dist.all_reduce(SUM) of one float32 tensor of each --sizes bytes
  grads200_each  200 separate all_reduce calls of 40 KiB tensors (8192000 bytes in all), timed
                 as one sample: a trainer syncing unfused gradients
Per case: 2 warm-ups, the result verified once against the exact expected sum (small integers,
exact in float32; a mismatch fails the run), then each call (or batch of 200) timed on rank 0
with no barrier in between. The iteration count is fixed up front by rank 0 from the second
warm-up (about --seconds, clamped to [--min-iters, --max-iters]) and broadcast, so all ranks
make the same calls. Rank 0 prints one JSON line per case:
  {"impl":"torch_gloo","case":"allreduce","ranks":N,"bytes":B,"iters":I,
   "median_us":x,"p10_us":x,"p90_us":x}
The run is bounded by --timeout; any failing rank ends it with a nonzero exit.

Run with Debian's interpreter (where torch lives):
  /usr/bin/python3 bench/torch_gloo_allreduce.py --ranks 4 --sizes 4096,67108864 --seconds 2
"""
import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import time
from datetime import timedelta

WARMUPS = 2
GRAD_TENSORS = 200
GRAD_BYTES = 40 * 1024


def percentile(sorted_v, p):
    """Linear interpolation between closest ranks (numpy's default), as mpi_allreduce.c does."""
    pos = p * (len(sorted_v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_v) - 1)
    return sorted_v[lo] + (sorted_v[hi] - sorted_v[lo]) * (pos - lo)


def run_case(args, rank, world, name, nbufs, bytes_each):
    import torch
    import torch.distributed as dist

    count = bytes_each // 4
    pattern = (torch.arange(count, dtype=torch.int64) % 7).to(torch.float32)
    expected = pattern * world + world * (world + 1) // 2
    bufs = [pattern + (rank + 1) for _ in range(nbufs)]

    def once():
        t0 = time.perf_counter()
        for b in bufs:
            dist.all_reduce(b, op=dist.ReduceOp.SUM)
        return time.perf_counter() - t0

    warm = 0.0
    for _ in range(WARMUPS):
        warm = once()
    for b in bufs:
        b.copy_(pattern).add_(rank + 1)
    once()
    for i, b in enumerate(bufs):
        if not torch.equal(b, expected):
            bad = int((b != expected).nonzero()[0])
            raise RuntimeError(f"{name} {bytes_each} B buffer {i}: wrong sum at element {bad}: "
                               f"got {float(b[bad])} want {float(expected[bad])}")
    del pattern, expected

    iters = args.max_iters
    if warm > 0 and args.seconds / warm < iters:
        iters = int(args.seconds / warm)
    iters = torch.tensor([max(iters, args.min_iters)], dtype=torch.int64)
    dist.broadcast(iters, src=0)
    iters = int(iters[0])

    samples = sorted(once() for _ in range(iters))
    if rank == 0:
        print(json.dumps({"impl": "torch_gloo", "case": name, "ranks": world,
                          "bytes": bytes_each * nbufs, "iters": iters,
                          "median_us": round(percentile(samples, 0.5) * 1e6, 3),
                          "p10_us": round(percentile(samples, 0.1) * 1e6, 3),
                          "p90_us": round(percentile(samples, 0.9) * 1e6, 3)},
                         separators=(",", ":")), flush=True)


def worker(args, rank, port):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.ranks, timeout=timedelta(seconds=args.init_timeout))
    for size in args.sizes:
        run_case(args, rank, args.ranks, "allreduce", 1, size)
    run_case(args, rank, args.ranks, "grads200_each", GRAD_TENSORS, GRAD_BYTES)
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--sizes", default="4096,65536,1048576,16777216,67108864,268435456",
                    help="comma-separated bytes of float32 data")
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument("--max-iters", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=2.0, help="target time per case")
    ap.add_argument("--init-timeout", type=float, default=60.0,
                    help="seconds for rendezvous and for any one collective")
    ap.add_argument("--timeout", type=float, default=600.0, help="bound on the whole run")
    args = ap.parse_args()
    try:
        args.sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        ap.error("--sizes: comma-separated integers")
    if not 1 <= args.ranks <= 64:
        ap.error("--ranks must be 1..64")
    if any(s < 4 or s % 4 for s in args.sizes):
        ap.error("--sizes must be positive multiples of 4")
    if not 1 <= args.min_iters <= args.max_iters <= 1000000:
        ap.error("need 1 <= --min-iters <= --max-iters <= 1000000")
    if not 0 < args.seconds <= 600 or not 0 < args.timeout or not 0 < args.init_timeout:
        ap.error("--seconds must be in (0, 600]; timeouts positive")
    return args


def main():
    args = parse_args()
    # gloo picks its interface from the hostname; keep it (and the rendezvous) on loopback.
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(args, r, port), daemon=True)
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    failed = None
    while any(p.exitcode is None for p in procs):
        bad = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if bad:
            failed = f"rank {bad[0]} exited with {procs[bad[0]].exitcode}"
            break
        if time.monotonic() > deadline:
            failed = f"timed out after {args.timeout:g} s"
            break
        time.sleep(0.05)
    else:
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            failed = f"rank {bad[0]} exited with {procs[bad[0]].exitcode}"
    if failed:
        for p in procs:
            if p.exitcode is None:
                p.kill()
        for p in procs:
            p.join(10)
        sys.exit(f"torch_gloo_allreduce: {failed}")


if __name__ == "__main__":
    main()
