"""The last stage of tests/gpu/run.sh: one table of every GPU benchmark of the run, and one
results file with it and what the machine is (GPU, driver, CUDA, NCCL, torch).

    results.py --out RESULTS.json [--cpp gpu_bench.json] [--torch torch_bench.json]
               [--overlap gpu_overlap.json ...] [--driver VERSION]
               [--copy bench/results-DATE-gpu.json]

Rows: the daemon path against direct ncclAllReduce on the same buffers (bench/gpu_bench.cc),
gradsync.all_reduce on CUDA tensors against torch.distributed NCCL (bench/
torch_gpu_allreduce.py), median microseconds per op; and the overlap case (bench/gpu_overlap.py,
once per --overlap file: without MPS, with MPS), median step time reducing buckets through the
daemon against in-process torch NCCL, bytes being a step's buckets. The goals of the GPU plane
are marked where they apply: at 64 MiB and above within 3% of the baseline, at 4 KiB at most
15 us over it, an overlap step with MPS at most 1.10 times torch NCCL's. A missing or partial
input is said, not hidden. Standard library only.
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


def overlap_rows(data):
    """The overlap case's rows: one per run (ranks), step times in microseconds."""
    cfg = data.get("config", {})
    nbytes = cfg.get("buckets", 0) * (cfg.get("bucket_mib", 0) << 20)
    rows = []
    for r in data.get("runs", []):
        ms = r["ms"]
        ranks = r["ranks"]
        rows.append({"path": f"overlap step ({ranks} rank{'s' if ranks > 1 else ''}, MPS "
                             f"{r['mps']})", "bytes": nbytes, "iters": r["steps"],
                     "baseline_us": ms["nccl"]["median"] * 1e3,
                     "gradsync_us": ms["gradsync"]["median"] * 1e3,
                     "compute_us": ms["compute"]["median"] * 1e3, "ratio": r["ratio"],
                     "overhead_us": (ms["gradsync"]["median"] - ms["nccl"]["median"]) * 1e3,
                     "goal": (("ok (<=1.10)" if r["ratio"] <= 1.10 else "MISSED (>1.10)")
                              if r["mps"] == "on" else "")})
    return rows


def overlap_notes(path, data):
    """What the table does not show of one overlap result: errors, MPS not had, cut runs."""
    if data is None:
        return [f"gpu_overlap: no results ({path})"]
    if "error" in data:
        return [data["error"]]
    name = "gpu_overlap --mps" if data.get("mps", {}).get("requested") else "gpu_overlap"
    notes = [f"{name}: {e}" for e in data.get("errors", [])]
    if data.get("mps", {}).get("reason"):
        notes.append(f"{name}: {data['mps']['reason']}")
    for r in data.get("runs", []):
        if r["steps"] < data.get("config", {}).get("steps", 0):
            notes.append(f"{name}: {r['ranks']} rank(s): {r['steps']} timed steps of "
                         f"{data['config']['steps']} (budget)")
        if r.get("mps_reason"):
            notes.append(f"{name}: {r['ranks']} rank(s): MPS partial: {r['mps_reason']}")
        notes += [f"{name}: value check FAILED: {k}" for k, ok in r.get("checks", {}).items()
                  if not ok]
    return notes


def version(v):
    return f"{v // 1000}.{(v % 1000) // 10}" if isinstance(v, int) else str(v)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpp")
    ap.add_argument("--torch")
    ap.add_argument("--overlap", action="append", default=[],
                    help="a bench/gpu_overlap.py result (once per run of it)")
    ap.add_argument("--driver", default="")
    ap.add_argument("--copy", default="")
    args = ap.parse_args()
    cpp, tor = load(args.cpp), load(args.torch)
    overlaps = [(path, load(path)) for path in args.overlap]
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
    for _, data in overlaps:
        if data and "error" not in data:
            rows += overlap_rows(data)
    ran = [data for _, data in overlaps if data and "error" not in data]
    tor_like = tor or (ran[0] if ran else None)
    machine = {
        "date": time.strftime("%Y-%m-%d"),
        "device": (cpp or tor_like or {}).get("device", "unknown"),
        "driver": args.driver or (version(cpp["cuda_driver"]) if cpp and "cuda_driver" in cpp
                                  else "unknown"),
        "cuda_runtime": version(cpp["cuda_runtime"]) if cpp and "cuda_runtime" in cpp else None,
        "nccl": (f"{cpp['nccl'] // 10000}.{(cpp['nccl'] % 10000) // 100}.{cpp['nccl'] % 100}"
                 if cpp and isinstance(cpp.get("nccl"), int) else None),
        "torch": tor_like.get("torch") if tor_like else None,
        "torch_cuda": tor_like.get("torch_cuda") if tor_like else None,
        "torch_nccl": tor_like.get("torch_nccl") if tor_like else None,
        "python": tor_like.get("python") if tor_like else None,
    }
    notes = []
    for name, data in (("gpu_bench", cpp), ("torch_gpu_allreduce", tor)):
        if data is None:
            notes.append(f"{name}: no results")
        elif "error" in data:
            notes.append(data["error"])
        elif not data.get("complete", False):
            notes.append(f"{name}: partial, sizes skipped {data.get('skipped_sizes')}")
    for path, data in overlaps:
        notes += overlap_notes(path, data)
    result = {"machine": machine, "rows": rows, "notes": notes,
              "gpu_bench": cpp, "torch_gpu_allreduce": tor,
              "gpu_overlap": [data for _, data in overlaps]}
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
