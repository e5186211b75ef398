"""gradsync.all_reduce on CUDA tensors against torch.distributed's NCCL all_reduce, one rank, one
GPU: the Python trainer's whole path (ctypes, the registration cache, ready/done events, the
daemon's NCCL) against torch's own. Both average in place (ReduceOp.AVG / op="mean": NCCL reads
and writes every byte even on one rank). Each op is timed from the call to the stream having
finished it (torch.cuda.synchronize after the call: the benchmark synchronises, the package
does not); the two paths alternate so that drift hits both alike; medians.

    torch_gpu_allreduce.py --socket DAEMON.sock [--json out.json] [--budget_s 60]
                           [--sizes 4096,65536,...] [--iters 20]
"""
import argparse
import statistics
import sys
import time

import torch_gpu_common

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20, 1 << 30]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True)
    ap.add_argument("--json", default="")
    ap.add_argument("--budget_s", type=float, default=60.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    args = ap.parse_args()
    start = time.monotonic()
    torch = torch_gpu_common.need_cuda("torch_gpu_allreduce")
    dist, gradsync = torch_gpu_common.init_collectives("torchbench", 0, 1, args.socket)
    info = {"bench": "torch_gpu_allreduce", "ranks": 1, **torch_gpu_common.torch_info(torch),
            "complete": True, "skipped_sizes": [], "results": []}
    nccl = info["torch_nccl"]

    def timed(fn, x):
        t0 = time.perf_counter()
        fn(x)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e6

    def torch_op(x):
        dist.all_reduce(x, op=dist.ReduceOp.AVG)

    def gradsync_op(x):
        gradsync.all_reduce(x, op="mean")

    def write():
        torch_gpu_common.write_json(args.json, info)

    print(f"# torch_gpu_allreduce, one rank: {info['device']}, torch {torch.__version__} "
          f"(CUDA {torch.version.cuda}, NCCL {nccl}), Python {info['python']}")
    print(f"{'bytes':>12} {'iters':>6} {'torch_us':>12} {'gradsync_us':>12} {'ratio':>8} "
          f"{'overhead_us':>12}")
    sys.stdout.flush()
    for nbytes in [int(s) for s in args.sizes.split(",")]:
        left = args.budget_s - (time.monotonic() - start)
        if left < 5:
            info["skipped_sizes"].append(nbytes)
            info["complete"] = False
            continue
        x = torch.ones(nbytes // 4, device="cuda")
        for fn in (torch_op, gradsync_op, torch_op, gradsync_op):  # warm: comms, registration
            timed(fn, x)
        pair = timed(torch_op, x) + timed(gradsync_op, x)
        iters = max(3, min(args.iters, int(left / len(SIZES) * 1e6 / max(pair, 1.0))))
        t, g = [], []
        for _ in range(iters):
            t.append(timed(torch_op, x))
            g.append(timed(gradsync_op, x))
        row = {"bytes": nbytes, "iters": iters, "torch_us": statistics.median(t),
               "gradsync_us": statistics.median(g), "torch_min_us": min(t),
               "gradsync_min_us": min(g)}
        row["ratio"] = row["gradsync_us"] / row["torch_us"]
        row["overhead_us"] = row["gradsync_us"] - row["torch_us"]
        info["results"].append(row)
        print(f"{nbytes:>12} {iters:>6} {row['torch_us']:>12.1f} {row['gradsync_us']:>12.1f} "
              f"{row['ratio']:>7.3f}x {row['overhead_us']:>12.1f}")
        sys.stdout.flush()
        del x
        write()
    if info["skipped_sizes"]:
        print(f"# skipped (past --budget_s={args.budget_s:g}): {info['skipped_sizes']}")
    write()
    gradsync.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
