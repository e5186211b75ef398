"""gradsync.init() under Slurm: a trainer that srun started (no torchrun) takes its rank, world
size, local rank, this node's task count, the job id and the root daemon's host from Slurm's
environment. Two real daemons on loopback stand for two nodes, one task each."""
import json
import os
import subprocess

from conftest import BUILD, PYTHON

TRAINER = """
import json, gradsync, torch
gradsync.init()
ctx = gradsync._ctx()
t = torch.tensor([float(gradsync.get_rank() + 1)])
gradsync.all_reduce(t)
print(json.dumps({"rank": gradsync.get_rank(), "world": gradsync.get_world_size(),
                  "local_rank": ctx.local_rank, "local_world": ctx.local_world_size,
                  "job": ctx.job, "root": ctx.root_address, "sum": t.item()}), flush=True)
gradsync.shutdown()
"""


def _slurm_env(daemon, procid, port):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("GRADSYNC_", "SLURM_")) and k not in (
               "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "TORCHELASTIC_RUN_ID")}
    env.update(PYTHONPATH=os.path.join(BUILD, "python"), OMP_NUM_THREADS="1",
               GRADSYNC_SOCKET=daemon.socket, GRADSYNC_DAEMON_PORT=str(port),
               SLURM_JOB_ID="4242", SLURM_STEP_ID="0", SLURM_PROCID=str(procid),
               SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_NODEID=str(procid),
               SLURM_TASKS_PER_NODE="1(x2)", SLURM_JOB_NODELIST="127.0.0.[1-2]",
               SLURM_STEP_NODELIST="127.0.0.[1-2]")
    return env


def test_init_takes_ranks_job_and_root_from_slurms_environment(two_daemons):
    d0, d1 = two_daemons
    host, port = d0.tcp.rsplit(":", 1)
    assert host == "127.0.0.1", d0.tcp  # the first node of the node list
    procs = [subprocess.Popen([PYTHON, "-c", TRAINER], env=_slurm_env(d, r, port),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r, d in enumerate((d0, d1))]
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        assert got == {"rank": r, "world": 2, "local_rank": 0, "local_world": 1,
                       "job": "slurm-4242.0", "root": f"127.0.0.1:{port}", "sum": 3.0}, got
