#!/usr/bin/python3
"""How long an elastic job's survivors take to go on after a node is lost, against restarting
the job's trainers (what torchrun does on a failure). Real gradsyncd processes on loopback, one
trainer rank per daemon (tests/python/elastic_worker.py: a small MLP, DistributedOptimizer,
gradsync.elastic.run, a commit every step, a step every 50 ms).

    .venv/bin/python bench/elastic_bench.py --build build [--sizes 4,8] [--reps 3]
         [--faults kill,freeze,cut,replace,torchrun,torchft,torchft_replace] [--json out.json]

The trainers run under this interpreter and its torch (torchft needs torch 2: the venv, with
`pip install torchft==0.2.0`).

Per repetition: N daemons, N trainers of a fresh elastic job; once every trainer has done 5
steps the last node is lost: its daemon and trainer killed (kill), its daemon stopped
(freeze: SIGSTOP, the kernel still ACKs its links), or its link cut (cut: each daemon in a
network namespace of its own, on a bridge, as tests/faults/netlab.py lays them out; the lost
node's switch port is set down, nothing tells either side; needs root). The figure, per
survivor: seconds from the fault to its first completed step on the new membership (world N-1),
read from the step lines the trainers print (time.time() on the same machine). `replace`: after
a kill, once the survivors train as N-1, a new daemon and a trainer started with
GRADSYNC_JOIN=1 (a replacement node): the figure is the seconds from that trainer's process
start until every rank has completed a step with N ranks again (the joiner having received rank
0's state), and, in brackets, the same from the moment its Python, torch and gradsync were
loaded. The peer: the same N-1 trainers started afresh as a new job (new processes: Python, torch, gradsync.init, formation, the first step),
the least a restart of the job's trainers costs before any checkpoint is loaded; torchrun
must first notice the failure too, which this does not count. Ratio: resume / restart.

`torchft`, `torchft_replace` (the peer measured whole): torchft's Lighthouse in this process
and N replica groups of one rank each (bench/torchft_worker.py: the same MLP under torchft's
Manager, DDP and OptimizerWrapper over its ProcessGroupGloo, a step every 50 ms), min_replicas
N-1, heartbeat timeout 1.5 s (gradsync's --peer_timeout), join timeout 1 s; once every group
has done 5 steps the last is killed: seconds from the kill to each survivor's first committed
step in a quorum of N-1; with `torchft_replace`, once they train so, a new replica group is
started: seconds from its start until every group has committed a step in a quorum of N.

`torchrun` (a fault of its own, the peer measured whole): N torchrun agents (this torch,
`--nnodes=N-1:N`, c10d rendezvous on loopback, `last_call_timeout=1`, `--max_restarts=3`,
`--monitor_interval=0.1`), one worker each (bench/torchrun_worker.py: the same MLP under DDP
over gloo, a step every 50 ms); once every worker has done 5 steps the last agent and its worker
are killed (SIGKILL of its process group); the figure per survivor: seconds from the kill to
its first step in the restarted world of N-1 (no checkpoint loaded).
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "faults"))
import netlab  # noqa: E402 - the fault suite's network namespaces, for a cut link
WORKER = os.path.join(ROOT, "tests", "python", "elastic_worker.py")
TORCHRUN_WORKER = os.path.join(ROOT, "bench", "torchrun_worker.py")
TORCHFT_WORKER = os.path.join(ROOT, "bench", "torchft_worker.py")
PYTHON = sys.executable
TOKEN = "elastic-bench-token\n"


class LabNode:
    """gradsyncd of node k of a netlab.Lab (its own network namespace)."""

    def __init__(self, lab, k):
        self.lab, self.k, self.daemon = lab, k, lab.daemons[k]
        self.socket, self.token, self.tcp = self.daemon.socket, lab.token_file, self.daemon.target
        self.prefix = (netlab.IP, "netns", "exec", self.daemon.ns)

    def lose(self, fault):
        self.lab.cut(self.k)

    def stop(self):
        pass  # the lab's cleanup stops it


class Daemon:
    """gradsyncd on loopback."""
    prefix = ()  # what a trainer's command line starts with to run on the daemon's node

    def __init__(self, build, tmp, name):
        self.socket = os.path.join(tmp, f"{name}.sock")
        self.log = os.path.join(tmp, f"{name}.log")
        token = os.path.join(tmp, "token")
        if not os.path.exists(token):
            with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(TOKEN)
        self.token = token
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [os.path.join(build, "daemon", "gradsyncd"), f"--socket={self.socket}",
                 "--port=0", f"--token_file={token}", "--log_sink=stderr", "--log_level=info"],
                stderr=err)
        deadline = time.monotonic() + 20
        self.tcp = None
        while time.monotonic() < deadline and self.tcp is None:
            m = re.search(r"tcp=(\S+:\d+)", open(self.log).read())
            if m and os.path.exists(self.socket):
                self.tcp = m.group(1)
            elif self.proc.poll() is not None:
                sys.exit(f"gradsyncd exited: {open(self.log).read()[-2000:]}")
            else:
                time.sleep(0.05)
        if self.tcp is None:
            sys.exit(f"gradsyncd not up in 20 s: {open(self.log).read()[-2000:]}")

    def lose(self, fault):
        if fault == "freeze":
            self.proc.send_signal(signal.SIGSTOP)
        else:
            self.proc.kill()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_trainers(build, tmp, daemons, job, ranks, steps, elastic, tag, join=False):
    procs, outs = [], []
    for r in ranks:
        d = daemons[r]
        env = dict(os.environ, PYTHONPATH=os.path.join(build, "python"), GRADSYNC_SOCKET=d.socket,
                   GRADSYNC_JOB=job, RANK=str(ranks.index(r)), WORLD_SIZE=str(len(ranks)),
                   LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1",
                   GRADSYNC_ROOT_ADDRESS=daemons[0 if join else ranks[0]].tcp,
                   GRADSYNC_TOKEN_FILE=d.token, GRADSYNC_ELASTIC="1" if elastic else "0",
                   GRADSYNC_JOIN="1" if join else "0")
        out = os.path.join(tmp, f"{tag}-{r}.out")
        outs.append(out)
        with open(out, "w") as f:
            procs.append(subprocess.Popen([*d.prefix, PYTHON, WORKER, str(steps), "0.05"], env=env,
                                          stdout=f, stderr=subprocess.STDOUT))
    return procs, outs


def lines(out):
    try:
        return [json.loads(l) for l in open(out).read().splitlines() if l.startswith("{")]
    except (OSError, ValueError):
        return []


def wait_for(pred, bound_s):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def rep(build, n, fault, index, bound):
    tmp = tempfile.mkdtemp(prefix="gradsync-elastic-bench-")
    lab = None
    if fault == "cut":
        lab = netlab.Lab(build, n, link="veth", log=lambda *a: None)
    procs, daemons = [], []
    try:
        if lab is not None:
            lab.up()
            lab.start_daemons()
            daemons = [LabNode(lab, k) for k in range(n)]
        else:
            daemons = [Daemon(build, tmp, f"node{i}") for i in range(n)]
        job = f"eb-{fault}-{n}-{index}"
        procs, outs = start_trainers(build, tmp, daemons, job, list(range(n)), 10_000, True, "e")
        if not wait_for(lambda: all(any(l.get("step", 0) >= 5 for l in lines(o)) for o in outs),
                        120):
            raise RuntimeError("trainers did not reach step 5: " + open(outs[0]).read()[-2000:])
        t_fault = time.time()
        daemons[-1].lose(fault)
        if fault in ("kill", "replace"):
            procs[-1].kill()

        def resumed(o, world=n - 1, since=t_fault):
            return [l["t"] - since for l in lines(o) if l.get("world") == world and "t" in l]
        wait_for(lambda: all(resumed(o) for o in outs[:-1]), bound)
        resume = [min(resumed(o)) if resumed(o) else None for o in outs[:-1]]
        joined = None
        if fault == "replace":
            daemons.append(Daemon(build, tmp, f"node{n}"))
            t_start = time.time()
            more, more_outs = start_trainers(build, tmp, daemons, job, [n], 10_000, True, "j",
                                             join=True)
            procs += more
            everyone = outs[:-1] + more_outs
            wait_for(lambda: all(resumed(o, n, t_start) for o in everyone), bound)
            if all(resumed(o, n, t_start) for o in everyone):
                full = max(min(resumed(o, n, t_start)) for o in everyone)
                imported = [l["imported"] for l in lines(more_outs[0]) if "imported" in l]
                joined = [full, full - (imported[0] - t_start) if imported else None]
        for p in procs:
            p.kill()
            p.wait()
        # The peer: the survivors' trainers (and the replacement's) started afresh as a new
        # job.
        t0 = time.time()
        again = list(range(n - 1)) + ([n] if fault == "replace" else [])
        procs, outs = start_trainers(build, tmp, daemons, job + "-restart", again, 10_000,
                                     False, "r")
        wait_for(lambda: all(any("t" in l for l in lines(o)) for o in outs), bound)
        restart = [min(l["t"] for l in lines(o) if "t" in l) - t0
                   if any("t" in l for l in lines(o)) else None for o in outs]
        return {"resume": resume, "restart": restart, "joined": joined}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            for d in daemons:
                d.stop()
        finally:
            if lab is not None:
                lab.cleanup()
                shutil.rmtree(lab.tmp, ignore_errors=True)


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(pid):
    """SIGKILL to `pid`'s process group and to every descendant (torch 2's torchrun starts its
    workers in sessions of their own)."""
    family, frontier = [pid], [pid]
    while frontier:
        children = subprocess.run(["ps", "-o", "pid=", "--ppid", ",".join(map(str, frontier))],
                                  capture_output=True, text=True).stdout.split()
        frontier = [int(c) for c in children]
        family += frontier
    for p in family:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def torchrun_rep(n, index, bound):
    """The torchrun peer: N agents, the last killed at step 5; seconds from the kill to each
    survivor's first step in the restarted world (None: none within `bound`)."""
    tmp = tempfile.mkdtemp(prefix="gradsync-torchrun-bench-")
    port, agents, outs = free_port(), [], []
    try:
        for i in range(n):
            out = os.path.join(tmp, f"steps-{i}.out")
            outs.append(out)
            env = dict(os.environ, BENCH_OUT=out, OMP_NUM_THREADS="1")
            with open(os.path.join(tmp, f"agent-{i}.log"), "w") as log:
                # --redirects/--tee 2: Debian's torch 1.13 under Python 3.11 reads 0 and 3 as
                # None and fails; the steps go to BENCH_OUT.
                agents.append(subprocess.Popen(
                    [PYTHON, "-m", "torch.distributed.run", f"--nnodes={n - 1}:{n}",
                     "--nproc_per_node=1", "--rdzv_backend=c10d",
                     f"--rdzv_endpoint=127.0.0.1:{port}", f"--rdzv_id=tb{index}",
                     "--rdzv_conf=last_call_timeout=1", "--max_restarts=3",
                     "--monitor_interval=0.1", "--redirects=2", "--tee=2",
                     f"--log_dir={os.path.join(tmp, f'logs-{i}')}", TORCHRUN_WORKER, "100000",
                     "0.05"], env=env, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True))
            time.sleep(0.2)  # the first agent hosts the rendezvous store
        if not wait_for(lambda: all(any(l.get("step", 0) >= 5 for l in lines(o)) for o in outs),
                        120):
            raise RuntimeError("torchrun workers did not reach step 5")
        t_kill = time.time()
        kill_tree(agents[-1].pid)

        def resumed(o):
            # Only restarted workers see N-1 (an agent restarted for the others' change counts
            # no restart of its own, so TORCHELASTIC_RESTART_COUNT cannot tell).
            return [l["t"] - t_kill for l in lines(o) if l.get("world") == n - 1 and "t" in l]
        wait_for(lambda: all(resumed(o) for o in outs[:-1]), bound)
        return [min(resumed(o)) if resumed(o) else None for o in outs[:-1]]
    finally:
        for a in agents:
            kill_tree(a.pid)
            a.wait()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def torchft_rep(n, index, bound, replace):
    """The torchft peer (see the module's doc): seconds from the kill to each survivor's first
    step in a quorum of N-1 and, with `replace`, from the new group's start until every group
    stepped in a quorum of N (None: not within `bound`)."""
    from torchft._torchft import LighthouseServer  # noqa: PLC0415 - only this peer needs it
    tmp = tempfile.mkdtemp(prefix="gradsync-torchft-bench-")
    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=n - 1, join_timeout_ms=1000,
                                  heartbeat_timeout_ms=1500)
    procs, outs = [], []

    def start(i):
        out = os.path.join(tmp, f"group-{i}.out")
        env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(),
                   TORCHFT_REPLICA=f"group{i}-{index}", TORCHFT_MIN_REPLICAS=str(n - 1),
                   OMP_NUM_THREADS="1")
        with open(out, "w") as f:
            procs.append(subprocess.Popen([PYTHON, TORCHFT_WORKER, "100000", "0.05"], env=env,
                                          stdout=f, stderr=subprocess.STDOUT))
        outs.append(out)

    def stepped(o, world, since):
        return [l["t"] - since for l in lines(o) if l.get("world") == world and l["t"] > since]
    try:
        for i in range(n):
            start(i)
        if not wait_for(lambda: all(any(l.get("world") == n and l.get("step", 0) >= 5
                                        for l in lines(o)) for o in outs), 120):
            raise RuntimeError("torchft groups did not reach step 5 together: "
                               + open(outs[0]).read()[-2000:])
        t_kill = time.time()
        procs[-1].kill()
        survivors = outs[:-1]
        wait_for(lambda: all(stepped(o, n - 1, t_kill) for o in survivors), bound)
        resume = [min(stepped(o, n - 1, t_kill)) if stepped(o, n - 1, t_kill) else None
                  for o in survivors]
        joined = None
        if replace:
            t_start = time.time()
            start(n)
            everyone = survivors + outs[-1:]
            if wait_for(lambda: all(stepped(o, n, t_start) for o in everyone), bound):
                full = max(min(stepped(o, n, t_start)) for o in everyone)
                imported = [l["imported"] for l in lines(outs[-1]) if "imported" in l]
                joined = [full, full - (imported[0] - t_start) if imported else None]
        return {"resume": resume, "joined": joined}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        lighthouse.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--sizes", default="4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--faults", default="kill,freeze,cut,replace,torchrun")
    ap.add_argument("--bound", type=float, default=60.0, help="seconds one wait may take")
    ap.add_argument("--json")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    faults = args.faults.split(",")
    if "cut" in faults:
        allowed, why = netlab.namespaces_permitted()
        if not allowed:
            print(f"skipping the cut link: {why}")
            faults.remove("cut")
        else:
            netlab.sweep_stale()  # namespaces a killed run left
    results = []
    print(f"{'nodes':>5} {'fault':>6} {'resume s (median, max)':>24} "
          f"{'restart s (median)':>19} {'resume/restart':>15}")
    for n in [int(s) for s in args.sizes.split(",")]:
        for fault in faults:
            if fault in ("torchft", "torchft_replace"):
                took, joins = [], []
                for i in range(args.reps):
                    r = torchft_rep(n, i, args.bound, fault == "torchft_replace")
                    results.append({"nodes": n, "fault": fault, "rep": i, **r})
                    took += [x for x in r["resume"] if x is not None]
                    if r["joined"]:
                        joins.append(r["joined"][0])
                        print(f"  rep {i}: torchft's quorum of {n} again {r['joined'][0]:.2f} s "
                              f"after the new group started ({r['joined'][1]:.2f} s after its "
                              "imports)")
                    if None in r["resume"]:
                        print(f"  rep {i}: {r['resume'].count(None)} group(s) gave no figure "
                              f"within {args.bound} s")
                figures = joins if fault == "torchft_replace" else took
                if figures:
                    print(f"{n:>5} {fault:>8} {statistics.median(figures):>11.2f} "
                          f"{max(figures):>10.2f}   (torchft's replica groups, killed group"
                          + (", then a new one)" if fault == "torchft_replace" else ")"))
                continue
            if fault == "torchrun":
                took = []
                for i in range(args.reps):
                    r = torchrun_rep(n, i, args.bound)
                    results.append({"nodes": n, "fault": fault, "rep": i, "resume": r})
                    took += [x for x in r if x is not None]
                    if None in r:
                        print(f"  rep {i}: {r.count(None)} rank(s) gave no figure within "
                              f"{args.bound} s")
                if took:
                    print(f"{n:>5} {'torchrun':>8} {statistics.median(took):>11.2f} "
                          f"{max(took):>10.2f}   (a torchrun job's survivors, killed node)")
                continue
            resume, restart = [], []
            for i in range(args.reps):
                r = rep(build, n, fault, i, args.bound)
                results.append({"nodes": n, "fault": fault, "rep": i, **r})
                if fault == "replace":  # the figure is the world's growing back
                    r["resume"] = [r["joined"][0] if r["joined"] else None]
                    if r["joined"] and r["joined"][1] is not None:
                        print(f"  rep {i}: world of {n} again {r['joined'][0]:.2f} s after "
                              f"the replacement started ({r['joined'][1]:.2f} s after its "
                              "imports)")
                resume += [x for x in r["resume"] if x is not None]
                restart += [x for x in r["restart"] if x is not None]
                missing = sum(x is None for x in r["resume"] + r["restart"])
                if missing:
                    print(f"  rep {i}: {missing} rank(s) gave no figure within {args.bound} s")
            if resume and restart:
                print(f"{n:>5} {fault:>6} {statistics.median(resume):>13.2f} "
                      f"{max(resume):>10.2f} {statistics.median(restart):>19.2f} "
                      f"{statistics.median(resume) / statistics.median(restart):>15.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"when": time.strftime("%Y-%m-%d %H:%M:%S"), "results": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
