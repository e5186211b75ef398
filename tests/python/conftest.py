"""Fixtures for the Python package's tests: real gradsyncd processes, real trainer processes.

Run after building, under Debian's interpreter (torch 1.13) or the virtual environment that
./setup.sh makes (torch 2.x); trainer processes run under the same interpreter:
    GRADSYNC_BUILD_DIR=$PWD/build /usr/bin/python3 -m pytest -q tests/python
    GRADSYNC_BUILD_DIR=$PWD/build .venv/bin/python -m pytest -q tests/python
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.abspath(os.environ.get("GRADSYNC_BUILD_DIR", os.path.join(ROOT, "build")))
PYTHON = sys.executable  # the trainers' interpreter: the one running the tests
EXAMPLE = os.path.join(ROOT, "client", "python", "examples", "train.py")
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
PROCESS_TIMEOUT = 120  # seconds any trainer process may take


def _need(path, how="build first (./setup.sh build)"):
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: {how}")
    return path


class Daemon:
    """One real gradsyncd on a private unix socket (and a loopback TCP port when tcp=True)."""

    def __init__(self, tmp, name, tcp=False, flags=()):
        self.dir = tmp
        self.socket = os.path.join(tmp, f"{name}.sock")
        self.log = os.path.join(tmp, f"{name}.log")
        self.tcp = None
        self.token_file = None
        args = [_need(os.path.join(BUILD, "daemon", "gradsyncd")), f"--socket={self.socket}",
                "--port=0" if tcp else "--port=-1", "--log_sink=stderr", "--log_level=info"]
        if tcp:
            # TCP (for the other daemons of a job) needs the cluster token, shared by all of them.
            self.token_file = os.path.join(tmp, "cluster.token")
            with open(os.open(self.token_file, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write("gradsync-test-token\n")
            args.append(f"--token_file={self.token_file}")
        args += list(flags)
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(args, stderr=err)
        deadline = time.monotonic() + 20
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"gradsyncd exited: {open(self.log).read()[-2000:]}")
            if os.path.exists(self.socket) and self.ctl("health").returncode == 0:
                break
            if time.monotonic() > deadline:
                pytest.fail(f"gradsyncd not healthy in 20 s: {open(self.log).read()[-2000:]}")
            time.sleep(0.05)
        if tcp:
            m = re.search(r"tcp=(\S+:\d+)", open(self.log).read())
            assert m, open(self.log).read()
            self.tcp = m.group(1)

    def ctl(self, *args):
        return subprocess.run([_need(os.path.join(BUILD, "client", "gradsyncctl")),
                               f"--socket={self.socket}", "--timeout=5s", *args],
                              capture_output=True, text=True, timeout=30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="gradsync-py-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(tmp):
    d = Daemon(tmp, "gradsyncd")
    yield d
    d.stop()


def tcp_daemons(tmp, monkeypatch, n, root_flags=(), flags=()):
    """n daemons with TCP on loopback standing for n nodes (node<i>), with `flags`; node0 (the
    root) also gets `root_flags`."""
    ds = [Daemon(tmp, f"node{i}", tcp=True,
                 flags=[*flags, *(root_flags if i == 0 else ())]) for i in range(n)]
    # Trainers reach the root daemon's store over TCP (GRADSYNC_ROOT_ADDRESS) without the
    # token: with the client credential their own daemon hands them.
    monkeypatch.delenv("GRADSYNC_TOKEN_FILE", raising=False)
    return ds


@pytest.fixture
def two_daemons(tmp, monkeypatch):
    ds = tcp_daemons(tmp, monkeypatch, 2)
    yield ds
    for d in ds:
        d.stop()


def env_for(daemon, job, rank, world, local_rank=None, local_world=None, root=None):
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": os.path.join(BUILD, "python"),
        "GRADSYNC_SOCKET": daemon.socket, "GRADSYNC_JOB": job,
        "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank if local_rank is None else local_rank),
        "LOCAL_WORLD_SIZE": str(world if local_world is None else local_world),
        "OMP_NUM_THREADS": "1",
    })
    if root:
        env["GRADSYNC_ROOT_ADDRESS"] = root
    return env


class Ranks:
    """W real trainer processes; wait() returns their parsed JSON summary lines."""

    def __init__(self, tmp, commands, envs):
        self.outs, self.procs = [], []
        for i, (cmd, env) in enumerate(zip(commands, envs)):
            out = os.path.join(tmp, f"rank{i}-{time.monotonic_ns()}.out")
            self.outs.append(out)
            with open(out, "w") as f:
                self.procs.append(subprocess.Popen([PYTHON, *cmd], env=env, stdout=f,
                                                   stderr=subprocess.STDOUT))

    def output(self, i):
        with open(self.outs[i]) as f:
            return f.read()

    def wait(self, expect_ok=True, timeout=PROCESS_TIMEOUT):
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                pytest.fail("trainers still running after %d s:\n%s" % (
                    timeout, "\n".join(self.output(i)[-1500:] for i in range(len(self.procs)))))
        results = []
        for i, p in enumerate(self.procs):
            text = self.output(i)
            if expect_ok:
                assert p.returncode == 0, f"rank {i} exited {p.returncode}:\n{text[-3000:]}"
            lines = [json.loads(l) for l in text.splitlines() if l.startswith("{")]
            results.append({"rc": p.returncode, "json": lines, "text": text})
        return results


def launch(tmp, daemon_of_rank, job, args_of_rank, local=None, root=None, extra_env=None):
    """Starts len(daemon_of_rank) ranks; rank r talks to daemon_of_rank[r]."""
    world = len(daemon_of_rank)
    envs, cmds = [], []
    for r, d in enumerate(daemon_of_rank):
        lw = world if local is None else local
        envs.append(env_for(d, job, r, world, r % lw, lw, root))
        envs[-1].update(extra_env or {})
        cmds.append(args_of_rank(r))
    return Ranks(tmp, cmds, envs)


def max_diff(a, b):
    import torch
    return max(float((x - y).abs().max()) for x, y in zip(a, b))
