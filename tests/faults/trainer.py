"""A trainer of the fault suite: all-reduces in a loop, each result checked, until its first
failure, which it records (time, code, exact message) with the next op's outcome on the same
group; then it stays attached until told to go, and exits 0 with its JSON. Placement comes
from the environment (RANK, WORLD_SIZE, LOCAL_*, GRADSYNC_SOCKET, GRADSYNC_ROOT_ADDRESS, ...).

Control files in --ctl (written by the suite, atomically):
    pause      {"at": N, "nodes": [k, ...] or "all"}: ranks of those nodes submit nothing from
               op N on ("held") until `resume` exists
    resume     held ranks go on
    release    a rank that failed (or finished with --wait-release) exits
    stop       end the loop before the next op
Each rank writes state.<rank>: {"op": i, "phase": "in"|"held"|"failed"|"done", "t": monotonic}
("in": op i was submitted and has not returned).

Times are time.monotonic() (CLOCK_MONOTONIC: one clock for every process of the machine).
Exit status: 0 whenever the trainer got as far as writing its JSON (a failed op is data, not a
trainer failure); a trainer that dies by a signal is what the suite treats as a crash.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

import gradsync


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctl", required=True)
    ap.add_argument("--node", type=int, required=True)
    ap.add_argument("--count", type=int, default=1024, help="float32 elements per op")
    ap.add_argument("--max-ops", type=int, default=100000)
    ap.add_argument("--max-seconds", type=float, default=60.0, help="the loop's own bound")
    ap.add_argument("--op-timeout", type=float, default=20.0, help="each op's deadline (s)")
    ap.add_argument("--gap", type=float, default=0.0, help="sleep between ops (s)")
    ap.add_argument("--start-delay", type=float, default=0.0, help="sleep before init (s)")
    ap.add_argument("--first-op-delay", type=float, default=0.0, help="sleep before op 0 (s)")
    ap.add_argument("--release-wait", type=float, default=60.0,
                    help="longest wait for `release` after a failure (s)")
    ap.add_argument("--wait-release", action="store_true",
                    help="also wait for `release` after the last op when nothing failed")
    ap.add_argument("--bench", default="",
                    help="timing mode: SIZE_BYTES:ITERS,... (5 warm-up ops each; times only)")
    a = ap.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    res = {"rank": rank, "node": a.node, "pid": os.getpid(), "ops_ok": 0, "wrong": 0,
           "first_wrong": None, "first_error": None, "second_error": None, "init_error": None,
           "t_start": time.monotonic()}

    def write():
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f)
        os.rename(tmp, a.out)

    def state(phase, op):
        path = os.path.join(a.ctl, f"state.{rank}")
        with open(path + ".tmp", "w") as f:
            json.dump({"op": op, "phase": phase, "t": time.monotonic()}, f)
        os.rename(path + ".tmp", path)

    def ctl(name):
        return os.path.join(a.ctl, name)

    def err(e, t_submit):
        return {"t": time.monotonic(), "t_submit": t_submit, "code": getattr(e, "code", None),
                "type": type(e).__name__, "message": str(e)}

    if a.start_delay:
        time.sleep(a.start_delay)
    try:
        gradsync.init()
    except Exception as e:  # noqa: BLE001 recorded: the suite judges it
        res["init_error"] = err(e, time.monotonic())
        write()
        state("failed", -1)
        return 0
    w = gradsync.get_world_size()
    res["t_init"] = time.monotonic()
    deadline = time.monotonic() + a.max_seconds

    if a.bench:
        res["bench"] = bench(a.bench, rank, w, a.op_timeout, err)
        write()
        state("done", 0)
        gradsync.shutdown()
        return 0

    buf = gradsync.shared_buffer(max(a.count, 1) * 4)
    x = np.frombuffer(buf, dtype=np.float32, count=a.count)
    base = (np.arange(a.count) % 3).astype(np.float32)
    if a.first_op_delay:
        time.sleep(a.first_op_delay)
    i = 0
    while i < a.max_ops and time.monotonic() < deadline:
        if os.path.exists(ctl("stop")):
            break
        if os.path.exists(ctl("pause")) and not os.path.exists(ctl("resume")):
            try:
                with open(ctl("pause")) as f:
                    pause = json.load(f)
            except (OSError, ValueError):
                pause = None
            if pause and i >= pause["at"] and (pause["nodes"] == "all" or
                                               a.node in pause["nodes"]):
                state("held", i)
                while (not os.path.exists(ctl("resume")) and time.monotonic() < deadline):
                    time.sleep(0.005)
                continue
        state("in", i)
        x[:] = base + (rank + 1) + 10 * (i % 5)
        t0 = time.monotonic()
        try:
            gradsync.all_reduce(x, op="sum", timeout=a.op_timeout)
        except gradsync.Error as e:
            res["first_error"] = err(e, t0)
            res["first_error"]["op"] = i
            # The group's next op: it must fail the same way, at once.
            t1 = time.monotonic()
            try:
                gradsync.all_reduce(x, op="sum", timeout=a.op_timeout)
                res["second_error"] = {"ok": True, "t_submit": t1, "t": time.monotonic()}
            except gradsync.Error as e2:
                res["second_error"] = err(e2, t1)
            break
        expected = w * base + w * (w + 1) / 2 + w * 10 * (i % 5)
        if not np.array_equal(x, expected):
            res["wrong"] += 1
            if res["first_wrong"] is None:
                bad = int(np.flatnonzero(x != expected)[0])
                res["first_wrong"] = {"op": i, "index": bad, "got": float(x[bad]),
                                      "want": float(expected[bad])}
        res["ops_ok"] += 1
        i += 1
        if a.gap:
            time.sleep(a.gap)
    res["t_end"] = time.monotonic()
    failed = res["first_error"] is not None
    write()  # before the state: a rank seen "failed" has its JSON
    state("failed" if failed else "done", i)
    if failed or a.wait_release:
        # Stay attached (the suite inspects the daemons meanwhile), bounded.
        until = time.monotonic() + a.release_wait
        while not os.path.exists(ctl("release")) and time.monotonic() < until:
            time.sleep(0.01)
        res["released"] = os.path.exists(ctl("release"))
    try:
        gradsync.shutdown()
    except Exception as e:  # noqa: BLE001
        res["shutdown_error"] = err(e, time.monotonic())
    res["t_exit"] = time.monotonic()
    write()
    return 0


def bench(spec, rank, w, op_timeout, err):
    """Per size: 5 warm-up ops, then ITERS timed ops (each op's own time, seconds)."""
    out = {}
    for item in spec.split(","):
        size, iters = (int(v) for v in item.split(":"))
        count = max(size // 4, 1)
        buf = gradsync.shared_buffer(count * 4)
        x = np.frombuffer(buf, dtype=np.float32, count=count)
        x[:] = rank + 1
        times = []
        for k in range(5 + iters):
            t0 = time.perf_counter()
            gradsync.all_reduce(x, op="max", timeout=op_timeout)
            if k >= 5:
                times.append(time.perf_counter() - t0)
        ok = bool(np.all(x == w))
        out[str(size)] = {"times": times, "values_right": ok}
    return out


if __name__ == "__main__":
    sys.exit(main())
