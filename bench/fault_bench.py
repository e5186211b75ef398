#!/usr/bin/python3
"""How fast the survivors of a job spanning nodes hear of a lost node, and what the daemons'
keepalives cost in steady state. Real gradsyncd processes in network namespaces (the fault
suite's lab: tests/faults/netlab.py), default liveness flags; needs root (namespaces).

    sudo /usr/bin/python3 bench/fault_bench.py --build build [--sizes 3,8] [--reps 5]
         [--faults kill,freeze,cut] [--mode mid] [--keepalive] [--json out.json]

Fault timing: one rank per daemon; per repetition a fresh job runs small all-reduces (20 ms
apart), the last node's rank stops submitting, the other ranks block in their op (mid-op; with
--mode large every rank runs 16 MiB all-reduces back to back instead), and the last node is
killed (SIGKILL), frozen (SIGSTOP) or cut off (its switch port down). Two figures per
survivor, both from the moment of the fault:
  detect  the survivor daemon's "peer lost" log line (its timestamp against the wall clock
          read just before the fault)
  error   the survivor trainer's all-reduce raising (CLOCK_MONOTONIC in both processes)
A survivor whose op has not failed within --bound seconds counts as "none" (and the rep's
trainers are stopped). Then the node comes back (restart, SIGCONT, link up).

Keepalive cost (--keepalive): 3 daemons, one rank each; all-reduce latency at 4 KiB and
64 MiB with the default --peer_heartbeat (250ms) against --peer_heartbeat=10s
--peer_timeout=60s, alternating A B A B in the same run; medians of rank 0's op times, and
B/A ratios.
"""
import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "faults"))
import netlab  # noqa: E402
from netlab import Lab, Trainers  # noqa: E402

LOST = re.compile(r"^(\S+)Z W watch: peer lost job=(\S+) node=(\S+) cause=(.*)$")


def wall(ts):
    return datetime.datetime.strptime(ts, "%Y-%m-%dT%H:%M:%S.%f").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def detect_times(daemon, offset, job, victim_target, t_wall):
    """Seconds from t_wall to the daemon's first "peer lost" line for job/victim after offset."""
    for line in daemon.log_since(offset).splitlines():
        m = LOST.match(line)
        if m and m.group(2) == job and m.group(3) == victim_target:
            return wall(m.group(1)) - t_wall, m.group(4)
    return None, None


def fault_rep(lab, fault, mode, rep, bound):
    n = lab.n
    victim = n - 1
    job = f"fb{n}-{fault}-{mode}-{rep}-{os.getpid()}"
    placement = list(range(n))
    large = mode == "large"
    tr = Trainers(lab, job, placement, args=[
        "--count", str(4 << 20 if large else 1024), "--gap", "0" if large else "0.02",
        "--max-seconds", "60", "--op-timeout", str(bound + 3), "--release-wait", "20"])
    out = {"job": job, "detect": [], "error": [], "none": 0, "messages": []}
    try:
        if tr.wait_until(lambda s: all(x and x["op"] >= 3 for x in s), 60) is None:
            out["setup_error"] = "the job did not run"
            return out
        if not large:
            at = max(x["op"] for x in tr.states() if x) + 5
            tr.touch("pause", json.dumps({"at": at, "nodes": [victim]}))
            ok = tr.wait_until(lambda s: all(
                x and x["op"] == s[0]["op"] and x["op"] >= at and
                x["phase"] == ("held" if r == victim else "in") for r, x in enumerate(s)), 20)
            if ok is None:
                out["setup_error"] = f"ranks not laid out: {tr.states()}"
                return out
            time.sleep(0.3)
        else:
            time.sleep(0.4)
        offsets = [d.log_size() for d in lab.daemons]
        t_wall, t_fault = time.time(), time.monotonic()
        if fault == "kill":
            lab.daemons[victim].kill()
        elif fault == "freeze":
            lab.daemons[victim].signal(signal.SIGSTOP)
        else:
            lab.cut(victim)
        survivors = [r for r in placement if r != victim]
        tr.wait_until(lambda s: all(s[r] and s[r]["phase"] == "failed" for r in survivors),
                      bound)
        time.sleep(0.2)  # the last log lines
        for r in survivors:
            res = tr.result(r)
            err = res and res["first_error"]
            if err:
                out["error"].append(err["t"] - t_fault)
                out["messages"].append(err["message"][:300])
            else:
                out["none"] += 1
            d, cause = detect_times(lab.daemons[r], offsets[r], job,
                                    lab.daemons[victim].target, t_wall)
            if d is not None:
                out["detect"].append(d)
                out.setdefault("causes", []).append(cause)
    finally:
        for k in range(n):
            lab.uncut(k)
        if lab.daemons[victim].alive():
            lab.daemons[victim].signal(signal.SIGCONT)
        tr.touch("resume")
        tr.touch("release")
        tr.wait(bound + 10)
        for d in lab.daemons:
            if not d.alive():
                out.setdefault("restarted", []).append(d.k)
                d.start()
    return out


def stats(xs):
    return (statistics.median(xs), max(xs)) if xs else (None, None)


def fmt(x):
    return "-" if x is None else f"{x:.3f}"


def keepalive(build, rounds, log):
    configs = {"A": [], "B": ["--peer_heartbeat=10s", "--peer_timeout=60s"]}
    sizes = "4096:300,67108864:8"
    times = {c: {} for c in configs}
    per_round = []
    lab = Lab(build, 3, log=log)
    try:
        lab.up()
        for i in range(rounds):
            order = ["A", "B"] if i % 2 == 0 else ["B", "A"]  # neither always first
            for c in order:
                flags = configs[c]
                for d in lab.daemons:
                    d.stop()
                lab.daemons = []
                lab.start_daemons(flags=flags)
                tr = Trainers(lab, f"ka-{c}-{i}-{os.getpid()}", [0, 1, 2],
                              args=["--bench", sizes, "--op-timeout", "60", "--max-seconds",
                                    "120"])
                results = tr.wait(180)
                for r, (rc, res) in enumerate(results):
                    if rc != 0 or not res or "bench" not in res:
                        raise RuntimeError(f"keepalive round {c}{i} rank {r}: exit {rc} "
                                           f"{tr.output(r)}")
                    for size, v in res["bench"].items():
                        if not v["values_right"]:
                            raise RuntimeError(f"keepalive {c}{i}: wrong values at {size}")
                for size, v in results[0][1]["bench"].items():
                    times[c].setdefault(size, []).extend(v["times"])
                    per_round.append({"round": i, "config": c, "bytes": int(size),
                                      "median_ms": statistics.median(v["times"]) * 1e3})
                log(f"keepalive round {i} {c}: " + ", ".join(
                    f"{s} B median {statistics.median(t) * 1e3:.3f} ms"
                    for s, t in results[0][1]["bench"].items() for t in [t["times"]]))
    finally:
        lab.cleanup()
        shutil.rmtree(lab.tmp, ignore_errors=True)
    out = {}
    for size in times["A"]:
        a, b = statistics.median(times["A"][size]), statistics.median(times["B"][size])
        # Each round runs A and B back to back: their ratio drifts less with the machine's load.
        paired = [x["median_ms"] / y["median_ms"] for x in per_round for y in per_round
                  if x["round"] == y["round"] and x["bytes"] == y["bytes"] == int(size)
                  and x["config"] == "A" and y["config"] == "B"]
        out[size] = {"default_ms": a * 1e3, "heartbeat_10s_ms": b * 1e3,
                     "ratio_default_over_10s": a / b, "n": len(times["A"][size]),
                     "paired_ratios": paired, "paired_ratio_median": statistics.median(paired)}
    return out, per_round


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(netlab.ROOT, "build"))
    ap.add_argument("--sizes", default="3,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--faults", default="kill,freeze,cut")
    ap.add_argument("--mode", default="mid", choices=("mid", "large"))
    ap.add_argument("--bound", type=float, default=8.0,
                    help="longest wait for the survivors' errors per repetition (s)")
    ap.add_argument("--keepalive", action="store_true")
    ap.add_argument("--keepalive-rounds", type=int, default=4)
    ap.add_argument("--no-faults", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args()
    permitted, why = netlab.namespaces_permitted()
    if not permitted:
        print(f"SKIPPED: {why}")
        return 77
    netlab.sweep_stale()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # cleanup runs in finally
    result = {"mode": a.mode, "reps": a.reps, "bound_s": a.bound, "cases": []}
    started = time.monotonic()
    if not a.no_faults:
        for n in (int(x) for x in a.sizes.split(",")):
            lab = Lab(a.build, n)
            try:
                lab.up()
                lab.start_daemons()
                for fault in a.faults.split(","):
                    case = {"nodes": n, "fault": fault, "detect": [], "error": [], "none": 0,
                            "reps": []}
                    for rep in range(a.reps):
                        r = fault_rep(lab, fault, a.mode, rep, a.bound)
                        case["reps"].append(r)
                        case["detect"] += r["detect"]
                        case["error"] += r["error"]
                        case["none"] += r["none"]
                        print(f"n={n} {fault} rep {rep}: error {[round(x, 3) for x in r['error']]}"
                              f" none {r['none']} detect {[round(x, 3) for x in r['detect']]}"
                              f"{' ' + r['setup_error'] if 'setup_error' in r else ''}",
                              flush=True)
                    result["cases"].append(case)
            finally:
                lab.cleanup()
                shutil.rmtree(lab.tmp, ignore_errors=True)
        print(f"\nmode {a.mode}, {a.reps} reps, one rank per daemon, victim the last node; "
              "seconds from the fault")
        print(f"{'nodes':>5} {'fault':<7} {'error median':>12} {'error max':>10} {'no error':>9} "
              f"{'detect median':>13} {'detect max':>10}")
        for c in result["cases"]:
            em, ex = stats(c["error"])
            dm, dx = stats(c["detect"])
            print(f"{c['nodes']:>5} {c['fault']:<7} {fmt(em):>12} {fmt(ex):>10} "
                  f"{c['none']:>4}/{len(c['error']) + c['none']:<4} {fmt(dm):>13} {fmt(dx):>10}")
            c["summary"] = {"error_median": em, "error_max": ex, "detect_median": dm,
                            "detect_max": dx}
    if a.keepalive:
        ka, rounds = keepalive(a.build, a.keepalive_rounds, print)
        result["keepalive"] = ka
        result["keepalive_rounds"] = rounds
        print("\nkeepalive cost (3 daemons x 1 rank, median of rank 0's ops)")
        print(f"{'bytes':>9} {'default 250ms':>14} {'heartbeat 10s':>14} {'ratio':>7} "
              f"{'paired ratios (per round)':>26}")
        for size, v in ka.items():
            print(f"{size:>9} {v['default_ms']:>11.3f} ms {v['heartbeat_10s_ms']:>11.3f} ms "
                  f"{v['ratio_default_over_10s']:>7.3f}   median {v['paired_ratio_median']:.3f} of "
                  + " ".join(f"{x:.2f}" for x in v["paired_ratios"]))
    result["seconds"] = round(time.monotonic() - started, 1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
