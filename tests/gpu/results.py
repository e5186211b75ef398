"""The last stage of tests/gpu/run.sh: one table of every GPU benchmark of the run, and one
results file with it and what the machine is (GPU, driver, CUDA, NCCL, torch).

    results.py --out RESULTS.json [--cpp gpu_bench.json] [--torch torch_bench.json]
               [--driver VERSION] [--copy bench/results-DATE-gpu.json]

Rows: the daemon path against direct ncclAllReduce on the same buffers (bench/gpu_bench.cc), and
gradsync.all_reduce on CUDA tensors against torch.distributed NCCL (bench/
torch_gpu_allreduce.py); median microseconds per op. The goals of the GPU plane are marked where
they apply: at 64 MiB and above within 3% of the baseline, at 4 KiB at most 15 us over it.
A missing or partial input is said, not hidden. Standard library only.
"""
import argparse
import json
import os
import time


def load(path):
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        return {"error": f"{path}: {e}"}


def goal(nbytes, ratio, overhead_us):
    if nbytes >= 64 << 20:
        return "ok (<=3%)" if ratio <= 1.03 else "MISSED (>3%)"
    if nbytes == 4 << 10:
        return "ok (<=15us)" if overhead_us <= 15 else "MISSED (>15us)"
    return ""


def version(v):
    return f"{v // 1000}.{(v % 1000) // 10}" if isinstance(v, int) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpp")
    ap.add_argument("--torch")
    ap.add_argument("--driver", default="")
    ap.add_argument("--copy", default="")
    args = ap.parse_args()
    cpp, tor = load(args.cpp), load(args.torch)
    rows = []
    for r in (cpp or {}).get("results", []):
        rows.append({"path": f"daemon vs ncclAllReduce ({r['mode']})", "bytes": r["bytes"],
                     "iters": r["iters"], "baseline_us": r["direct_us"],
                     "gradsync_us": r["gradsync_us"], "ratio": r["ratio"],
                     "overhead_us": r["overhead_us"]})
    for r in (tor or {}).get("results", []):
        rows.append({"path": "gradsync.all_reduce vs torch.distributed", "bytes": r["bytes"],
                     "iters": r["iters"], "baseline_us": r["torch_us"],
                     "gradsync_us": r["gradsync_us"], "ratio": r["ratio"],
                     "overhead_us": r["overhead_us"]})
    for r in rows:
        r["goal"] = goal(r["bytes"], r["ratio"], r["overhead_us"])
    machine = {
        "date": time.strftime("%Y-%m-%d"),
        "device": (cpp or tor or {}).get("device", "unknown"),
        "driver": args.driver or (version(cpp["cuda_driver"]) if cpp and "cuda_driver" in cpp
                                  else "unknown"),
        "cuda_runtime": version(cpp["cuda_runtime"]) if cpp and "cuda_runtime" in cpp else None,
        "nccl": (f"{cpp['nccl'] // 10000}.{(cpp['nccl'] % 10000) // 100}.{cpp['nccl'] % 100}"
                 if cpp and isinstance(cpp.get("nccl"), int) else None),
        "torch": tor.get("torch") if tor else None,
        "torch_cuda": tor.get("torch_cuda") if tor else None,
        "torch_nccl": tor.get("torch_nccl") if tor else None,
        "python": tor.get("python") if tor else None,
    }
    notes = []
    for name, data in (("gpu_bench", cpp), ("torch_gpu_allreduce", tor)):
        if data is None:
            notes.append(f"{name}: no results")
        elif "error" in data:
            notes.append(data["error"])
        elif not data.get("complete", False):
            notes.append(f"{name}: partial, sizes skipped {data.get('skipped_sizes')}")
    result = {"machine": machine, "rows": rows, "notes": notes,
              "gpu_bench": cpp, "torch_gpu_allreduce": tor}
    for path in filter(None, (args.out, args.copy)):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    m = machine
    print(f"== GPU results {m['date']}: {m['device']}, driver {m['driver']}, CUDA runtime "
          f"{m['cuda_runtime']}, NCCL {m['nccl']}; torch {m['torch']} (CUDA {m['torch_cuda']}, "
          f"NCCL {m['torch_nccl']}), Python {m['python']} ==")
    print(f"{'path':<42} {'bytes':>11} {'iters':>5} {'baseline_us':>11} {'gradsync_us':>11} "
          f"{'ratio':>7} {'overhead_us':>11}  goal")
    for r in rows:
        print(f"{r['path']:<42} {r['bytes']:>11} {r['iters']:>5} {r['baseline_us']:>11.1f} "
              f"{r['gradsync_us']:>11.1f} {r['ratio']:>6.3f}x {r['overhead_us']:>11.1f}  "
              f"{r['goal']}")
    for n in notes:
        print(f"# {n}")
    print(f"# written to {args.out}" + (f" and {args.copy}" if args.copy else ""))


if __name__ == "__main__":
    main()
