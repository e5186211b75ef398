"""What the torch GPU benchmarks (torch_gpu_allreduce.py, gpu_overlap.py) share: the refusal
without a usable GPU, one rank's torch.distributed NCCL and gradsync set-up, what the machine's
torch is, a gradsyncd of their own, and how they write their JSON. Standard library only at
import (torch and gradsync are imported by the functions that need them).
"""
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

DAEMON_START_S = 20  # a gradsyncd that has no socket by then did not start


def need_cuda(name):
    """torch, when it sees a CUDA device; otherwise prints `name: why` and exits 77 (the GPU
    checks' "skipped"): no figure is ever made up without a GPU."""
    try:
        import torch
    except ImportError as e:
        print(f"{name}: no torch here ({e})")
        sys.exit(77)
    if not torch.cuda.is_available():
        print(f"{name}: torch {torch.__version__} sees no CUDA device")
        sys.exit(77)
    return torch


def torch_info(torch, device=0):
    """The device and the torch build the figures come from."""
    return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda,
            "torch_nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "python": sys.version.split()[0]}


def init_collectives(job, rank, world_size, socket, store=None, timeout_s=None):
    """torch.distributed over NCCL and gradsync (through the gradsyncd on `socket`) for rank
    `rank` of a job whose ranks all run on this node, one GPU each (local rank = rank). `store`:
    the file torch's ranks meet at (a fresh one when None: one rank). `timeout_s` bounds
    torch's collectives (None: torch's default). Returns (torch.distributed, gradsync)."""
    import torch.distributed as dist
    import gradsync
    if store is None:
        store = os.path.join(tempfile.mkdtemp(prefix="gradsync-bench-"), "store")
    extra = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank,
                            world_size=world_size, **extra)
    gradsync.init(job=job, rank=rank, world_size=world_size, local_rank=rank,
                  local_world_size=world_size, socket=socket)
    return dist, gradsync


def write_json(path, data):
    """Writes `data` to `path` whole or not at all (a reader never sees half a file)."""
    if not path:
        return
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def start_daemon(path, folder, env=None, log_level="warning"):
    """A gradsyncd of the caller's own: unix socket `folder`/d.sock, no TCP port, its log in
    `folder`/gradsyncd.log; `env` added to its environment. Its libraries come from
    GRADSYNC_DAEMON_LD_LIBRARY_PATH (tests/gpu/run.sh's; never this Python's own, which keeps
    torch's). Returns (process, socket, log path); raises RuntimeError with the log's tail when
    it has no socket within DAEMON_START_S."""
    sock = os.path.join(folder, "d.sock")
    log_path = os.path.join(folder, "gradsyncd.log")
    full_env = dict(os.environ, **(env or {}))
    if os.environ.get("GRADSYNC_DAEMON_LD_LIBRARY_PATH"):
        full_env["LD_LIBRARY_PATH"] = os.environ["GRADSYNC_DAEMON_LD_LIBRARY_PATH"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([path, f"--socket={sock}", "--port=-1", "--log_sink=stderr",
                                 f"--log_level={log_level}", "--op_timeout=30s"], stderr=log,
                                env=full_env)
    deadline = time.monotonic() + DAEMON_START_S
    while not (os.path.exists(sock) and os.path.exists(sock + ".fd")):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_daemon(proc)
            with open(log_path) as f:
                raise RuntimeError(f"gradsyncd did not start: {f.read()[-1500:]}")
        time.sleep(0.05)
    return proc, sock, log_path


def stop_daemon(proc, grace_s=5.0):
    """SIGTERM, then SIGKILL after `grace_s`; returns its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
