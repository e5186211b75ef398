#!/usr/bin/python3
"""The fault suite: a job over three gradsyncd nodes in network namespaces (netlab.py), ranks
1+2+3 (node 0 holds rank 0 and so the job's store: the root), and what happens to it when a
node is killed, frozen or cut off, on a lossy link, and under a flood of strangers.

    sudo /usr/bin/python3 tests/faults/fault_suite.py --build build [--cases a,b] [--json out]

Exit 77 (skipped) only where network namespaces cannot be created (not root); 0 when every
case passed; 1 otherwise. The daemons run with their default liveness flags
(--peer_timeout=1.5s, --peer_heartbeat=250ms); LIMIT = peer_timeout + 1 s.

The fault cases (kill = SIGKILL the daemon, freeze = SIGSTOP it, later SIGCONT, cut = the
node's switch port down, later up), each on a fresh job:
  mid-op   the victim node's ranks stop submitting before op N (`pause`), the other ranks are
           blocked in op N in their daemons (checked from their state files, then 0.3 s) when
           the fault lands.
  large    every rank runs 16 MiB all-reduces back to back (the ring between nodes is moving
           data) when the fault lands.
  between  every rank is idle (held before op N, nothing pending) when the fault lands. What is
           asserted: the survivors' daemons are told within LIMIT (their
           gradsync_peer_losses_total for the cause has risen when read at fault + LIMIT);
           then the ranks go on, and each survivor's next op fails at once (within 0.5 s of
           its submission) naming the node and the cause.
For each survivor rank (a rank not on the victim node): an error is raised, UNAVAILABLE, within
LIMIT of the fault (mid-op, large), its message names the lost node (address:port), says
"lost" and the cause ("the connection was closed"/"reset" for kill, "no word for" for freeze and
cut); the group's next op fails the same way at once (within 1 s). Each surviving daemon is
alive and `gradsyncctl health` is SERVING, `gradsyncctl ops JOB` on it (its trainers still
attached) lists the victim as lost, its gradsync_peer_losses_total{cause} has risen. The victim's
own ranks get an error once they go on (after SIGCONT / link up), and no trainer dies by a
signal. Then the killed daemon is restarted and a fresh job (new id, same 1+2+3 ranks) forms
across all three daemons at once and completes three all-reduces of 70000 floats (280 KB: the
ring between nodes) with right values (where it does not, a second one 5 s later is noted).

flood: 100 silent and 100 garbage connections (replaced when dropped) from 16 addresses on each
daemon's port and on every data-link listener that appears (found in /proc/<pid>/net/tcp)
while the job forms; node 2's ranks join 2 s late and start 2 s after that, so the other
nodes' link listeners wait for it under the flood. The job must form and run five
all-reduces right; each daemon's port took >= 100 of the connections, and a data-link listener
of nodes 0 and 1 was flooded while it waited; the daemons stay alive and healthy.

elastic-cut-node2: an elastic job (tests/python/elastic_worker.py: a small MLP,
DistributedOptimizer, gradsync.elastic.run) on the same 1+2+3 ranks; once every rank has done 5
steps node 2 (ranks 3, 4, 5) is cut off. Ranks 0, 1 and 2 raise MembershipChanged naming ranks
3,4,5 and node 2, reset to a world of 3 (keeping their ranks), finish their steps and end with
the same parameters; node 2's ranks are stopped, its link comes back.

lossy: a fresh lab whose every node's egress has 5 ms delay and 1 % loss (tc netem; where the
kernel has no netem, wire.py applies the same in user space) runs small and 4 MiB
all-reduces with right values, and no daemon declares a peer lost.

Every wait is bounded; a watchdog (--budget) ends the run, and every namespace and process is
removed in all cases.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import netlab  # noqa: E402
from netlab import IP, PYTHON, FLOOD, FLOOD_SOURCES, PORT, Lab, Trainers  # noqa: E402

PEER_TIMEOUT = 1.5  # the daemon's default --peer_timeout
LIMIT = PEER_TIMEOUT + 1.0
PLACEMENT = [0, 1, 1, 2, 2, 2]  # rank -> node: 1 + 2 + 3 ranks; node 0 is the root
CAUSE_TEXT = {"kill": ("the connection was closed", "the connection was reset"),
              "freeze": ("no word for",), "cut": ("no word for",)}
CAUSE_METRIC = {"kill": ("closed", "reset"), "freeze": ("silent",), "cut": ("silent",)}

FAULT_CASES = [
    # name, fault, victim node, when
    ("kill-root-midop", "kill", 0, "mid"),
    ("kill-node2-midop", "kill", 2, "mid"),
    ("freeze-root-midop", "freeze", 0, "mid"),
    ("freeze-node1-midop", "freeze", 1, "mid"),
    ("cut-root-midop", "cut", 0, "mid"),
    ("cut-node2-midop", "cut", 2, "mid"),
    ("kill-node1-between", "kill", 1, "between"),
    ("freeze-node2-between", "freeze", 2, "between"),
    ("cut-root-between", "cut", 0, "between"),
    ("cut-node1-large", "cut", 1, "large"),
    ("freeze-root-large", "freeze", 0, "large"),
]
ALL_CASES = ["flood"] + [c[0] for c in FAULT_CASES] + ["elastic-cut-node2", "lossy"]
ELASTIC_WORKER = os.path.join(netlab.ROOT, "tests", "python", "elastic_worker.py")


class Timeout(Exception):
    pass


class Case:
    def __init__(self, name):
        self.name = name
        self.checks = []  # (name, ok, detail)
        self.notes = []
        self.t0 = time.monotonic()
        self.t1 = None
        self.skipped = None

    def check(self, name, ok, detail=""):
        self.checks.append((name, bool(ok), detail))
        mark = "ok  " if ok else "FAIL"
        line = f"  [{mark}] {name}"
        if detail and (not ok or len(detail) < 40):
            line += f": {detail}"
        print(line, flush=True)
        return ok

    def note(self, text):
        self.notes.append(text)
        print(f"  note: {text}", flush=True)

    @property
    def passed(self):
        return self.skipped is None and all(ok for _, ok, _ in self.checks)

    def to_json(self):
        return {"case": self.name, "passed": self.passed, "skipped": self.skipped,
                "seconds": round((self.t1 or time.monotonic()) - self.t0, 1),
                "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in self.checks],
                "notes": self.notes}


def short(text, n=600):
    text = text or ""
    return text if len(text) <= n else text[:n] + "..."


def survivors_of(victim):
    return [r for r, k in enumerate(PLACEMENT) if k != victim]


def apply_fault(lab, kind, victim):
    if kind == "kill":
        lab.daemons[victim].kill()
    elif kind == "freeze":
        lab.daemons[victim].signal(signal.SIGSTOP)
    elif kind == "cut":
        lab.cut(victim)


def undo_fault(lab, kind, victim):
    if kind == "freeze":
        lab.daemons[victim].signal(signal.SIGCONT)
    elif kind == "cut":
        lab.uncut(victim)


def check_daemons(lab, case, when, dead=()):
    """Every daemon not in `dead` is alive and healthy."""
    for d in lab.daemons:
        if d.k in dead:
            continue
        if not case.check(f"daemon {d.k} alive {when}", d.alive(),
                          f"exit {d.proc.returncode}; log:\n{d.log_tail(1500)}"):
            continue
        ok, text = d.healthy()
        case.check(f"daemon {d.k} health {when}", ok, text)


def restore(lab, case):
    """After a case: every daemon running (a dead one restarted) and healthy, no link cut,
    nothing frozen."""
    for k in range(lab.n):
        lab.uncut(k)
    for d in lab.daemons:
        if d.alive():
            d.signal(signal.SIGCONT)
        else:
            case.note(f"starting daemon {d.k} again")
            d.start()


def check_exits(case, tr, results):
    for r, (rc, res) in enumerate(results):
        crashed = rc == "timeout" or not isinstance(rc, int) or rc != 0
        case.check(f"rank {r} exited 0 with its JSON (no crash)", not crashed and res is not None,
                   f"exit {rc}; output:\n{tr.output(r)}")
        if res and res.get("wrong"):
            case.check(f"rank {r} values right", False, json.dumps(res["first_wrong"]))


def run_job(lab, job, count, ops):
    """Runs a job across every daemon, 1+2+3 ranks; [(rank, ok, detail)]."""
    tr = Trainers(lab, job, PLACEMENT, args=["--count", str(count), "--max-ops", str(ops),
                                              "--max-seconds", "40", "--op-timeout", "20",
                                              "--release-wait", "0"])
    out = []
    for r, (rc, res) in enumerate(tr.wait(45)):
        fine = (rc == 0 and res is not None and res["ops_ok"] == ops and not res["wrong"]
                and res["first_error"] is None and res["init_error"] is None)
        state = tr.state(r)
        out.append((r, fine, f"exit {rc} (last state {state}); {short(json.dumps(res))}\n"
                             f"{tr.output(r)}"))
    return out


def fresh_job(lab, case, job, count=70000, ops=3):
    """A fresh job across every daemon, 1+2+3 ranks: all of `ops` all-reduces right. Where it
    fails, a second job 5 s later says (as a note) whether the failure passes by itself."""
    results = run_job(lab, job, count, ops)
    for r, fine, detail in results:
        if not fine:
            case.check(f"fresh job {job}: rank {r}", False, detail)
    good = all(fine for _, fine, _ in results)
    case.check(f"fresh job {job} across all 3 daemons: {ops} all-reduces of {count} floats right",
               good)
    if not good:
        time.sleep(5)
        again = run_job(lab, job + "-again", count, ops)
        case.note(f"a second fresh job 5 s later: "
                  f"{'formed and ran right' if all(f for _, f, _ in again) else 'failed too'}: " +
                  "; ".join(f"rank {r}: {short(d, 200)}" for r, f, d in again if not f))
    return good


def message_checks(case, who, err, victim_target, kind, at_once_s=None):
    if not case.check(f"{who}: error raised", err is not None and err.get("code") is not None,
                      short(json.dumps(err))):
        return
    msg = err["message"]
    case.check(f"{who}: UNAVAILABLE", err["code"] == "UNAVAILABLE", short(msg))
    case.check(f"{who}: names the lost node {victim_target}", victim_target in msg, short(msg))
    case.check(f"{who}: says lost and the cause ({' | '.join(CAUSE_TEXT[kind])})",
               "lost" in msg and any(c in msg for c in CAUSE_TEXT[kind]), short(msg))
    if at_once_s is not None:
        took = err["t"] - err["t_submit"]
        case.check(f"{who}: fails at once (<= {at_once_s} s after submission)", took <= at_once_s,
                   f"{took:.3f} s")


def ctl_ops_check(lab, case, job, k, victim_target):
    p = lab.daemons[k].ctl("ops", job, timeout_s=5)
    out = p.stdout + p.stderr
    lines = [l for l in out.splitlines() if l.startswith(victim_target)]
    ok = p.returncode == 0 and any(" lost " in f" {l} " for l in lines)
    case.check(f"`gradsyncctl ops {job}` on node {k} shows {victim_target} lost", ok,
               f"exit {p.returncode}:\n{out}")
    return out


def fault_case(lab, case, kind, victim, when):
    job = f"{case.name}-{os.getpid()}"
    victim_target = lab.daemons[victim].target
    survivors = survivors_of(victim)
    surviving_nodes = [k for k in range(lab.n) if k != victim]
    large = when == "large"
    count = 4 << 20 if large else 1024
    tr = Trainers(lab, job, PLACEMENT, args=[
        "--count", str(count), "--gap", "0" if large else "0.02", "--max-seconds", "90",
        "--op-timeout", "20", "--release-wait", "60"])
    try:
        st = tr.wait_until(lambda s: all(x and x["op"] >= 3 for x in s), 40)
        if not case.check("job formed and ran 3 ops on every rank", st is not None,
                          "\n".join(f"rank {r}: {tr.state(r)} {tr.output(r, 800)}"
                                    for r in range(len(PLACEMENT)))):
            return
        before = {k: lab.daemons[k].losses() for k in surviving_nodes}
        if not large:
            at = max(x["op"] for x in tr.states() if x) + 5
            tr.touch("pause", json.dumps({"at": at, "nodes": [victim] if when == "mid" else "all"}))

            def laid_out(s):  # every rank at one op N >= at: held, or blocked in it
                for r, x in enumerate(s):
                    want = "in" if (when == "mid" and PLACEMENT[r] != victim) else "held"
                    if not x or x["phase"] != want or x["op"] < at or x["op"] != s[0]["op"]:
                        return False
                return True

            if not case.check(f"ranks laid out for the fault ({when}: op {at})",
                              tr.wait_until(laid_out, 20) is not None, json.dumps(tr.states())):
                return
            time.sleep(0.3)
        else:
            time.sleep(0.4)
            case.note("states at the fault: " + json.dumps(
                [(x["phase"], x["op"]) if x else None for x in tr.states()]))
        t_fault = time.monotonic()
        apply_fault(lab, kind, victim)
        print(f"  {kind} node {victim} ({victim_target}) at {t_fault:.3f}", flush=True)

        if when == "between":
            # Idle: nothing pending. The daemons must know within LIMIT.
            time.sleep(max(0.0, t_fault + LIMIT - time.monotonic()))
            for k in surviving_nodes:
                after = lab.daemons[k].losses()
                rose = (before[k] is not None and after is not None and
                        any(after[c] > before[k][c] for c in CAUSE_METRIC[kind]))
                case.check(f"node {k} told within {LIMIT} s while idle "
                           f"(peer_losses_total{{{'|'.join(CAUSE_METRIC[kind])}}} rose)", rose,
                           f"read {time.monotonic() - t_fault:.2f} s after the fault: "
                           f"before {before[k]} after {after}")
            tr.touch("resume")
        wait_for = t_fault + LIMIT + (20 if when == "between" else 8)
        tr.wait_until(lambda s: all(s[r] and s[r]["phase"] == "failed" for r in survivors),
                      max(0.1, wait_for - time.monotonic()))
        for r in survivors:
            res = tr.result(r)
            err = res and res["first_error"]
            who = f"rank {r} (node {PLACEMENT[r]})"
            if when == "between":
                message_checks(case, who, err, victim_target, kind, at_once_s=0.5)
            else:
                message_checks(case, who, err, victim_target, kind)
                if err:
                    took = err["t"] - t_fault
                    case.check(f"{who}: raised within {LIMIT} s of the fault", took <= LIMIT,
                               f"{took:.3f} s")
            second = res and res["second_error"]
            if err:
                if second and second.get("ok"):
                    case.check(f"{who}: the group's next op fails too", False,
                               "it succeeded")
                else:
                    message_checks(case, f"{who} next op", second, victim_target, kind,
                                   at_once_s=1.0)
        # The survivors' daemons: alive, healthy, the loss counted.
        # (a frozen victim answers nothing yet: it is checked once resumed)
        check_daemons(lab, case, "after the fault",
                      dead=(victim,) if kind in ("kill", "freeze") else ())
        for k in surviving_nodes:
            after = lab.daemons[k].losses()
            case.check(f"node {k}: gradsync_peer_losses_total{{{'|'.join(CAUSE_METRIC[kind])}}} "
                       "rose", before[k] is not None and after is not None and
                       any(after[c] > before[k][c] for c in CAUSE_METRIC[kind]),
                       f"before {before[k]} after {after}")
        # The victim comes back (SIGCONT, link up); its ranks go on and must get an error.
        undo_fault(lab, kind, victim)
        tr.touch("resume")
        victims = [r for r in range(len(PLACEMENT)) if r not in survivors]
        tr.wait_until(lambda s: all(s[r] and s[r]["phase"] in ("failed", "done")
                                    for r in victims), 40)
        for r in victims:
            res = tr.result(r)
            err = res and res["first_error"]
            detail = short(json.dumps(err)) if err else f"{short(json.dumps(res))}\n{tr.output(r)}"
            case.check(f"victim rank {r} (node {victim}) gets an error", err is not None, detail)
            if err:
                case.note(f"victim rank {r}: {err['code']} {err['t'] - err['t_submit']:.2f} s "
                          f"after its submission: {short(err['message'], 300)}")
        # Every trainer still attached (waiting for `release`): what the operator sees.
        for k in surviving_nodes:
            ctl_ops_check(lab, case, job, k, victim_target)
        tr.touch("release")
        check_exits(case, tr, tr.wait(40))
        check_daemons(lab, case, "at the case's end", dead=(victim,) if kind == "kill" else ())
    finally:
        tr.kill()
        for k in range(lab.n):
            lab.uncut(k)
        if lab.daemons[victim].alive():
            lab.daemons[victim].signal(signal.SIGCONT)
    restore(lab, case)
    check_daemons(lab, case, "before the fresh job")
    fresh_job(lab, case, f"{case.name}-after-{os.getpid()}")


def flood_case(lab, case):
    job = f"flood-{os.getpid()}"
    out = os.path.join(lab.tmp, "flood.json")
    cmd = [IP, "netns", "exec", lab.sw, PYTHON, FLOOD, "--sources", ",".join(FLOOD_SOURCES),
           "--silent", "100", "--garbage", "100", "--seconds", "9", "--out", out,
           "--skip", str(PORT)]
    for d in lab.daemons:
        cmd += ["--target", d.target, "--watch", f"{d.pid}:{d.address}"]
    with open(os.path.join(lab.tmp, "flood.log"), "w") as log:
        flood = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 preexec_fn=netlab.die_with_parent)
    try:
        time.sleep(1.0)  # the daemons' ports are under the flood before anyone joins
        tr = Trainers(lab, job, PLACEMENT,
                      args=["--count", "70000", "--max-ops", "5", "--max-seconds", "60",
                            "--op-timeout", "30"],
                      per_rank=lambda r, k: ["--start-delay", "2", "--first-op-delay", "2"]
                      if k == 2 else [])
        results = tr.wait(75)
        for r, (rc, res) in enumerate(results):
            case.check(f"rank {r}: formed and ran 5 all-reduces right under the flood",
                       rc == 0 and res is not None and res["ops_ok"] == 5 and not res["wrong"]
                       and res["first_error"] is None and res["init_error"] is None,
                       f"exit {rc}; {short(json.dumps(res))}\n{tr.output(r)}")
        try:
            flood.wait(30)
        except subprocess.TimeoutExpired:
            flood.kill()
            flood.wait(10)
        try:
            with open(out) as f:
                targets = json.load(f)
        except (OSError, ValueError):
            targets = []
        case.check("flood summary written", bool(targets),
                   open(os.path.join(lab.tmp, "flood.log")).read()[-2000:])
        for t in targets:
            case.note(f"flooded {t['target']} ({t['kind']}, from {t['first_seen_s']} s): "
                      f"{t['connected']} connected of {t['attempts']}, {t['closed_by_peer']} "
                      f"dropped by the daemon, {t['refused']} refused, {t['garbage_bytes']} "
                      "garbage bytes")
        for d in lab.daemons:
            own = [t for t in targets if t["target"] == d.target]
            case.check(f"node {d.k}: daemon port flooded (>= 100 connections)",
                       own and own[0]["connected"] >= 100, json.dumps(own))
        for k in (0, 1):  # the nodes whose link listeners wait for node 2
            links = [t for t in targets if t["kind"] == "listener" and
                     t["target"].startswith(lab.addr(k) + ":") and t["connected"] > 0]
            case.check(f"node {k}: a data-link listener was flooded while the job formed",
                       bool(links), json.dumps([t for t in targets if t["kind"] == "listener"]))
        check_daemons(lab, case, "after the flood")
    finally:
        if flood.poll() is None:
            flood.kill()
            flood.wait(10)
    fresh_job(lab, case, f"flood-after-{os.getpid()}")


def elastic_case(lab, case, steps=30, victim=2):
    job = f"elastic-{int(time.time() * 1000) % 10**8}"
    root = lab.daemons[PLACEMENT[0]].target
    world = len(PLACEMENT)
    outs, procs = [], []
    local = {}
    for r, k in enumerate(PLACEMENT):
        d = lab.daemons[k]
        lr = local.get(k, 0)
        local[k] = lr + 1
        env = {k2: v for k2, v in os.environ.items()
               if not k2.startswith(("NOTIFY_SOCKET", "WATCHDOG_"))}
        env.update({"PYTHONPATH": lab.python_dir, "GRADSYNC_SOCKET": d.socket,
                    "GRADSYNC_JOB": job, "RANK": str(r), "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(lr), "LOCAL_WORLD_SIZE": str(PLACEMENT.count(k)),
                    "GRADSYNC_ROOT_ADDRESS": root,
                    "OMP_NUM_THREADS": "1", "GRADSYNC_ELASTIC": "1"})
        out = os.path.join(lab.tmp, f"{job}-r{r}.log")
        outs.append(out)
        with open(out, "w") as f:
            procs.append(subprocess.Popen(
                [IP, "netns", "exec", d.ns, PYTHON, ELASTIC_WORKER, str(steps), "0.05"], env=env,
                stdout=f, stderr=subprocess.STDOUT, preexec_fn=netlab.die_with_parent))

    def lines(r):
        try:
            return [json.loads(x) for x in open(outs[r]).read().splitlines()
                    if x.startswith("{")]
        except (OSError, ValueError):
            return []

    survivors = survivors_of(victim)
    try:
        deadline = time.monotonic() + 120
        while not all(any(x.get("step", 0) >= 5 for x in lines(r)) for r in range(world)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                case.check("every rank trained 5 steps", False,
                           "\n".join(open(o).read()[-800:] for o in outs))
                return
            time.sleep(0.02)
        lab.cut(victim)
        deadline = time.monotonic() + 90
        for r in survivors:
            try:
                procs[r].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        done = {}
        for r in survivors:
            ended = [x for x in lines(r) if x.get("done")]
            ok = procs[r].returncode == 0 and ended
            case.check(f"rank {r} went on to its last step and exited 0", ok,
                       f"exit {procs[r].returncode}: {open(outs[r]).read()[-1500:]}")
            if ok:
                done[r] = ended[0]
        lost = [r for r, k in enumerate(PLACEMENT) if k == victim]
        for r, res in done.items():
            change = res["changes"][0] if res["changes"] else {}
            case.check(f"rank {r}: MembershipChanged named ranks {lost} and node {victim}",
                       change.get("lost_ranks") == lost and
                       change.get("lost_nodes") == [lab.daemons[victim].target], str(change))
            case.check(f"rank {r}: rank {res['rank']} of a world of {res['world']}, "
                       f"{res['step']} steps", (res["rank"], res["world"], res["step"]) ==
                       (survivors.index(r), len(survivors), steps), str(res)[:300])
        if len(done) == len(survivors):
            case.check("the survivors' parameters are identical",
                       all(done[r]["params"] == done[survivors[0]]["params"] for r in done))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        restore(lab, case)


def lossy_case(build, case):
    lab = Lab(build, 3, link="lossy", log=case.note)
    try:
        lab.up()
        case.note(f"link: {lab.link_kind}")
        lab.start_daemons()
        before = [d.losses() for d in lab.daemons]
        for job, count, ops in ((f"lossy-small-{os.getpid()}", 1024, 40),
                                (f"lossy-large-{os.getpid()}", 1 << 20, 4)):
            t0 = time.monotonic()
            tr = Trainers(lab, job, PLACEMENT, args=["--count", str(count), "--max-ops", str(ops),
                                                      "--max-seconds", "80", "--op-timeout", "40"])
            results = tr.wait(100)
            for r, (rc, res) in enumerate(results):
                case.check(f"{job} rank {r}: {ops} all-reduces of {count} floats right",
                           rc == 0 and res is not None and res["ops_ok"] == ops
                           and not res["wrong"] and res["first_error"] is None
                           and res["init_error"] is None,
                           f"exit {rc}; {short(json.dumps(res))}\n{tr.output(r)}")
            case.note(f"{job}: {time.monotonic() - t0:.1f} s")
        after = [d.losses() for d in lab.daemons]
        for k in range(lab.n):
            case.check(f"node {k}: no peer declared lost on the lossy link",
                       before[k] is not None and after[k] == before[k],
                       f"before {before[k]} after {after[k]}")
        check_daemons(lab, case, "after the lossy runs")
        for w, k in zip(lab.wires, range(lab.n)):
            case.check(f"wire {k} running", w.poll() is None)
    finally:
        lab.cleanup()
        if case.passed:
            subprocess.run(["rm", "-rf", lab.tmp])
        else:
            case.note(f"logs kept in {lab.tmp}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(netlab.ROOT, "build"))
    ap.add_argument("--cases", default=",".join(ALL_CASES),
                    help="comma-separated, from: " + ",".join(ALL_CASES))
    ap.add_argument("--json", default="")
    ap.add_argument("--budget", type=float, default=600, help="watchdog for the whole run (s)")
    ap.add_argument("--keep", action="store_true", help="keep the logs' folder")
    a = ap.parse_args()
    wanted = [c for c in a.cases.split(",") if c]
    unknown = [c for c in wanted if c not in ALL_CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {ALL_CASES}")
        return 2
    permitted, why = netlab.namespaces_permitted()
    if not permitted:
        print(f"SKIPPED: the fault suite needs network namespaces: {why}")
        return 77
    netlab.sweep_stale()

    def on_alarm(signo, frame):
        raise Timeout(f"the suite ran past its budget of {a.budget:.0f} s")

    def on_term(signo, frame):
        raise Timeout(f"stopped by signal {signo}")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.signal(signal.SIGTERM, on_term)
    signal.alarm(int(a.budget))
    started = time.monotonic()
    cases = []
    lab = None
    logs = None
    try:
        fault_names = [c for c in wanted if c not in ("lossy",)]
        if fault_names:
            lab = Lab(a.build, 3)
            logs = lab.tmp
            print(f"lab: namespaces {lab.sw}, {', '.join(lab.node_ns)}; logs in {lab.tmp}",
                  flush=True)
            lab.up()
            lab.start_daemons()
            for name in fault_names:
                case = Case(name)
                cases.append(case)
                print(f"== {name}", flush=True)
                try:
                    if name == "flood":
                        flood_case(lab, case)
                    elif name == "elastic-cut-node2":
                        elastic_case(lab, case)
                    else:
                        _, kind, victim, when = next(c for c in FAULT_CASES if c[0] == name)
                        fault_case(lab, case, kind, victim, when)
                except Timeout:
                    raise
                except Exception:  # noqa: BLE001 a case that broke is a failed case
                    case.check("case ran to its end", False, traceback.format_exc())
                    try:
                        restore(lab, case)
                    except Exception:  # noqa: BLE001
                        case.check("daemons restored", False, traceback.format_exc())
                case.t1 = time.monotonic()
                print(f"== {name}: {'passed' if case.passed else 'FAILED'} "
                      f"({time.monotonic() - case.t0:.1f} s)", flush=True)
            for d in lab.daemons:  # a clean stop: no crash at the end either
                rc = d.stop()
                if not (isinstance(rc, int) and rc >= 0):
                    print(f"daemon {d.k} stopped with {rc}:\n{d.log_tail(2000)}")
                    cases[-1].check(f"daemon {d.k} stops cleanly on SIGTERM", False, str(rc))
            lab.cleanup()
        if "lossy" in wanted:
            case = Case("lossy")
            cases.append(case)
            print("== lossy", flush=True)
            try:
                lossy_case(a.build, case)
            except Timeout:
                raise
            except Exception:  # noqa: BLE001
                case.check("case ran to its end", False, traceback.format_exc())
            case.t1 = time.monotonic()
            print(f"== lossy: {'passed' if case.passed else 'FAILED'} "
                  f"({time.monotonic() - case.t0:.1f} s)", flush=True)
    except Timeout as e:
        c = Case("watchdog")
        c.check("the suite finished within its budget", False, str(e))
        cases.append(c)
    finally:
        signal.alarm(0)
        if lab is not None:
            lab.cleanup()
            if not a.keep and logs and all(c.passed for c in cases):
                subprocess.run(["rm", "-rf", logs])
            elif logs:
                print(f"logs kept in {logs}")
    passed = sum(c.passed for c in cases)
    failed = len(cases) - passed
    print(f"\n{'case':<26} result   seconds")
    for c in cases:
        print(f"{c.name:<26} {'passed' if c.passed else 'FAILED':<8} "
              f"{c.to_json()['seconds']:>6}")
        for n, ok, d in c.checks:
            if not ok:
                print(f"    FAIL {n}: {short(d, 400)}")
    print(f"total {time.monotonic() - started:.0f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump([c.to_json() for c in cases], f, indent=1)
    print(f"faults: {passed} passed, {failed} failed")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
