"""The README's examples, run for real (and docs/python.md's, which go on from them).

Every code block of README.md, then of docs/python.md, with an HTML comment
`<!-- example: NAME -->` on the line just above its opening fence is run, in order, in one
scratch directory:

- `sh`/`bash` blocks run with `bash -e -o pipefail`, in the scratch directory, where `build`
  links to the build tree (GRADSYNC_BUILD_DIR) and `.venv` to the checkout's virtual
  environment with torch 2.x (GRADSYNC_VENV; ./setup.sh makes it). The directory `/tmp/gradsync` the blocks use is
  replaced by a private one, and the ports 7451, 7452 and 29500 by free ones, so that runs do
  not collide; nothing else in a block changes. Daemons a block starts in the background are
  stopped at the end (each block runs in its own process group).
- `python` blocks are saved as NAME.py in the scratch directory (later blocks may run them) and
  run under torchrun with 2 ranks, as a trainer, against a real gradsyncd this test starts
  (GRADSYNC_SOCKET, PYTHONPATH=<build>/python).

The test fails when a block fails or outlasts BLOCK_TIMEOUT_S, and when the README has no marked
block (or a marker without a fence under it).
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid

import pytest

from conftest import BUILD, PYTHON, ROOT, Daemon, _need

README = os.path.join(ROOT, "README.md")
MORE = [os.path.join(ROOT, "docs", "python.md")]  # run after the README's, in the same place
VENV = os.path.abspath(os.environ.get("GRADSYNC_VENV", os.path.join(ROOT, ".venv")))
BLOCK_TIMEOUT_S = 240  # any one block, torchrun with its ranks included
STOP_TIMEOUT_S = 20    # background processes of the blocks, after SIGTERM
MARKER = re.compile(r"<!--\s*example:\s*(\S*)\s*-->")
BLOCK = re.compile(r"<!-- example: ([A-Za-z0-9_-]+) -->\n```([A-Za-z0-9]+)\n(.*?)^```[ \t]*$",
                   re.M | re.S)
SHELL, PYTHON_BLOCK = ("sh", "bash", "shell"), ("python", "py")
SCRATCH_DIR = "/tmp/gradsync"  # the directory the blocks name
PORTS = ("7451", "7452", "29500")  # the ports the blocks name


def marked_blocks(text):
    """[(name, language, code)] of the README's marked blocks, in order."""
    blocks = [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(text)]
    markers = MARKER.findall(text)
    assert len(markers) == len(blocks), (
        f"{len(markers)} example markers but {len(blocks)} marked blocks: every "
        "'<!-- example: NAME -->' must sit on the line just above a ``` fence, NAME made of "
        f"letters, digits, '-' and '_' (markers: {markers})")
    names = [name for name, _, _ in blocks]
    assert len(set(names)) == len(names), f"example names repeat: {names}"
    for name, lang, _ in blocks:
        assert lang in SHELL + PYTHON_BLOCK, f"example {name}: cannot run a '{lang}' block"
    return blocks


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env():
    """The environment of a user's fresh shell: nothing of gradsync's or torchrun's."""
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRADSYNC_") and k not in drop}
    env["OMP_NUM_THREADS"] = "1"
    return env


class Runner:
    """Runs blocks in a scratch directory; every process group it started is stopped at the end."""

    def __init__(self, scratch, daemon):
        self.scratch = scratch
        self.daemon = daemon
        self.dir = os.path.join(scratch, "gradsync")  # stands for /tmp/gradsync
        os.mkdir(self.dir)
        os.symlink(BUILD, os.path.join(scratch, "build"))
        os.symlink(_need(VENV, "./setup.sh makes it"), os.path.join(scratch, ".venv"))
        self.ports = {p: str(free_port()) for p in PORTS}
        self.groups = []

    def substitute(self, code):
        code = code.replace(SCRATCH_DIR, self.dir)
        for port, free in self.ports.items():
            code = re.sub(rf"\b{port}\b", free, code)
        return code

    def run(self, name, lang, code):
        log = os.path.join(self.scratch, f"{name}.log")
        if lang in PYTHON_BLOCK:
            script = os.path.join(self.scratch, f"{name}.py")
            with open(script, "w") as f:
                f.write(code)
            env = clean_env()
            env.update(GRADSYNC_SOCKET=self.daemon.socket,
                       PYTHONPATH=os.path.join(BUILD, "python"))
            # An explicit rendezvous on a free port (--standalone's is fixed: 29400).
            cmd = [PYTHON, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                   "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{free_port()}",
                   f"--rdzv_id={uuid.uuid4()}", "--redirects", "1", "--tee", "1", script]
        else:
            script = os.path.join(self.scratch, f"{name}.sh")
            with open(script, "w") as f:
                f.write(self.substitute(code))
            env = clean_env()
            cmd = ["bash", "-e", "-o", "pipefail", script]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=self.scratch, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.groups.append(proc.pid)
        try:
            rc = proc.wait(BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.stop_group(proc.pid)
            proc.wait(STOP_TIMEOUT_S)
            pytest.fail(f"README example '{name}' still running after {BLOCK_TIMEOUT_S} s:\n"
                        f"{self.tail(log)}")
        if rc != 0:
            pytest.fail(f"README example '{name}' ({lang}) exited {rc}:\n{self.tail(log)}"
                        f"{self.daemon_logs()}")
        return open(log).read()

    def tail(self, path, n=4000):
        with open(path, errors="replace") as f:
            return f.read()[-n:]

    def daemon_logs(self):
        """The logs the blocks' daemons wrote (into the scratch /tmp/gradsync)."""
        text = ""
        for entry in sorted(os.listdir(self.dir)):
            if entry.endswith(".log"):
                text += f"\n--- {entry} (last lines) ---\n{self.tail(os.path.join(self.dir, entry), 1500)}"
        return text

    @staticmethod
    def alive(pgid):
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True

    def stop_group(self, pgid):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while self.alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self.alive(pgid):
                return

    def stop_all(self):
        for pgid in reversed(self.groups):
            self.stop_group(pgid)


@pytest.fixture
def runner(tmp):
    daemon = Daemon(tmp, "readme")
    r = Runner(tempfile.mkdtemp(prefix="gs-readme-"), daemon)
    yield r
    r.stop_all()
    daemon.stop()
    shutil.rmtree(r.scratch, ignore_errors=True)


def test_readme_has_marked_examples():
    with open(README) as f:
        blocks = marked_blocks(f.read())
    assert blocks, "README.md has no block marked <!-- example: NAME -->: nothing to run"
    assert any(lang in PYTHON_BLOCK for _, lang, _ in blocks), "no Python example is marked"


def test_readme_examples_run(runner):
    _need(os.path.join(BUILD, "daemon", "gradsyncd"))
    _need(os.path.join(BUILD, "client", "gradsyncctl"))
    with open(README) as f:
        blocks = marked_blocks(f.read())
    assert blocks, "README.md has no block marked <!-- example: NAME -->: nothing to run"
    for path in MORE:
        with open(path) as f:
            more = marked_blocks(f.read())
        assert more, f"{path} has no block marked <!-- example: NAME -->: nothing to run"
        blocks += more
    names = [name for name, _, _ in blocks]
    assert len(set(names)) == len(names), f"example names repeat across the files: {names}"
    for name, lang, code in blocks:
        runner.run(name, lang, code)
