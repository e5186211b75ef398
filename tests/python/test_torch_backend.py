"""torch.distributed's backend "gradsync": real daemons, real trainer processes, torch's own
collectives, DDP and FSDP2 unchanged but for the backend string, compared with gloo."""
import os
import re
import subprocess

import pytest
import torch

from conftest import BUILD, PYTHON, launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_backend_worker.py")
TORCH2 = int(torch.__version__.split(".")[0]) >= 2
needs_torch2 = pytest.mark.skipif(not TORCH2, reason=f"torch {torch.__version__}: torch 2's")


def _run(tmp, daemons, world, mode, backend, extra=(), env=None, expect_ok=True):
    """`world` ranks, spread over `daemons` in blocks (ranks 0..k-1 on the first, ...)."""
    per = world // len(daemons)
    of_rank = [daemons[r // per] for r in range(world)]
    root = daemons[0].tcp if len(daemons) > 1 else None
    tag = re.sub(r"[^a-z0-9]+", "-", f"{mode}-{backend}-{world}-{len(daemons)}")
    store = os.path.join(tmp, "store-" + tag)
    job = "tb-" + tag
    return launch(tmp, of_rank, job,
                  lambda r: [WORKER, mode, backend, store, *[a.format(rank=r) for a in extra]],
                  local=per, root=root, extra_env=env).wait(expect_ok=expect_ok)


def _expected(rank, world):
    s = world * (world - 1) // 2  # sum of the ranks
    odd = [r for r in range(world) if r % 2 == 1]
    e = {
        "all_reduce_SUM": [world * (world + 1) / 2, 10.0 * s, -s],
        "all_reduce_AVG": [(world + 1) / 2, 10.0 * s / world, -s / world],
        "all_reduce_MIN": [1.0, 0.0, -(world - 1.0)],
        "all_reduce_MAX": [float(world), 10.0 * (world - 1), 0.0],
        "all_reduce_int64": [i * world * (world + 1) // 2 for i in range(4)],
        "all_reduce_strided": [[float(s), float(rank)] * 2] * 2,
        "broadcast": [world - 1.0] * 3,
        "broadcast_bool": [False, True],
        "all_gather": [[r, r + 0.5] for r in range(world)],
        "all_gather_into_tensor": [v for r in range(world) for v in (r, -r)],
        "reduce_scatter": [world * s + world * rank * 1.0] * 2,
        "reduce_scatter_tensor_avg": [2 * rank + (world - 1) / 2, 2 * rank + 1 + (world - 1) / 2],
        "all_reduce_coalesced": [[float(s)] * 3, [[float(s)], [2.0 * s]]],
        "reduce": [float(s) if rank == 0 else float(rank)],
        "gather": [[2.0 * r] for r in range(world)] if rank == 0 else None,
        "scatter": [float(rank), -float(rank)],
        "async": [world * (world + 1) / 2] * 2,
        "future": [[world * (world + 1) / 2] * 2],
        "objects": [{"rank": r} for r in range(world)],
    }
    if rank % 2 == 1:
        e["odd_group"] = [float(sum(odd))]
    return e


@pytest.mark.parametrize("backend", ["gradsync", "cpu:gradsync,cuda:gradsync", "gloo"])
def test_every_collective_of_torch_distributed_gives_what_gloo_gives(tmp, two_daemons, backend):
    """4 ranks on 2 daemons; the same script on gloo checks the expectations themselves (but for
    the strided all_reduce: torch 2.15's gloo reduces the storage's first elements instead)."""
    if backend == "gloo" and not TORCH2:
        pytest.skip(f"torch {torch.__version__}'s gloo has no ReduceOp.AVG")
    if ":" in backend and not TORCH2:
        pytest.skip(f"torch {torch.__version__} takes no backend per device")
    results = _run(tmp, two_daemons, 4, "collectives", backend)
    for rank, r in enumerate(results):
        got = r["json"][-1]
        assert got["backend"] == backend
        for key, want in _expected(rank, 4).items():  # every value exact in binary
            if backend == "gloo" and (key == "all_reduce_strided" or
                                       key == "reduce" and rank != 0):
                continue  # gloo also writes the sum into reduce's other ranks' tensors
            assert got.get(key) == want, (rank, key, got.get(key), want)
        assert set(got) - set(_expected(rank, 4)) == {"backend", "rank", "world"}


def _params(tmp, name, world):
    return [torch.load(os.path.join(tmp, f"{name}-{r}.pt")) for r in range(world)]


@pytest.mark.parametrize("kind,world,ndaemons", [
    ("ddp", 2, 2), ("ddp", 4, 2), ("fsdp", 2, 2), ("fsdp", 4, 2), ("ddp", 4, 1)])
def test_unmodified_training_ends_with_the_parameters_gloo_gives(tmp, two_daemons, kind, world, ndaemons):
    """DDP and FSDP2, the backend string the only change: every rank ends with the parameters
    gloo gives. Bitwise at 2 ranks (a + b is the same sum in either order); at 4 within float32
    rounding (gloo's ring adds each chunk starting at another rank, gradsync in rank order, so
    the last bits differ), and bitwise the same on every rank."""
    if kind == "fsdp" and not TORCH2:
        pytest.skip(f"torch {torch.__version__} has no FSDP2 (fully_shard)")
    daemons = two_daemons[:ndaemons]
    for backend in ("gradsync", "gloo"):
        _run(tmp, daemons, world, "train", backend, [os.path.join(tmp, backend + "-{rank}.pt")],
             env={"TRAIN_KIND": kind, "TRAIN_STEPS": "6"})
    ours, gloo = _params(tmp, "gradsync", world), _params(tmp, "gloo", world)
    for r in range(world):
        assert len(ours[r]) == 4
        for a, b in zip(ours[r], gloo[r]):
            if world == 2:
                assert torch.equal(a, b), (kind, r, float((a - b).abs().max()))
            else:
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (kind, r, (a - b).abs().max())
        for a, b in zip(ours[r], ours[0]):
            assert torch.equal(a, b)


def test_ops_gradsync_does_not_run_raise_at_once_naming_the_op_and_what_to_use(tmp, daemon):
    results = _run(tmp, [daemon], 2, "unsupported", "gradsync")
    for r in results:
        got = r["json"][-1]
        errors = got["errors"]
        assert errors["send"].startswith("RuntimeError: gradsync: send is not supported"), errors
        assert "gloo" in errors["send"]
        assert "gradsync: recv is not supported" in errors["recv"]
        # (torch 1.13 calls the op alltoall_base)
        assert " is not supported: use all_gather and keep your share" in \
            errors["all_to_all_single"], errors
        assert errors["all_reduce_product"] == \
            "ValueError: gradsync reduces with SUM, AVG, MIN or MAX, not PRODUCT", errors
        assert got["after"] == [2.0]


def test_a_failed_op_raises_the_daemons_error_from_work_wait(tmp, daemon):
    results = _run(tmp, [daemon], 2, "mismatch", "gradsync", expect_ok=True)
    for r in results:
        got = r["json"][-1]
        assert got["is_gradsync_error"], got
        assert got["code"] == "FAILED_PRECONDITION", got
        assert "desync in job=" in got["error"], got
        assert "rank 0 submitted all_reduce(sum, float32, count=4" in got["error"], got
        assert "count=5" in got["error"], got


@needs_torch2  # 1.13's torchrun cannot parse its own defaults on Python 3.11
def test_init_process_group_under_torchrun_with_only_the_backend_string(tmp, daemon):
    """torchrun's environment (env://, MASTER_ADDR/PORT for torch's store) and gradsync's
    (GRADSYNC_SOCKET, GRADSYNC_JOB): nothing else."""
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"),
               GRADSYNC_SOCKET=daemon.socket, GRADSYNC_JOB="tb-torchrun", OMP_NUM_THREADS="1")
    out = os.path.join(tmp, "p-{rank}.pt")
    p = subprocess.run([PYTHON, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", WORKER, "train", "gradsync", "env", out],
                       env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    a, b = (torch.load(out.format(rank=r)) for r in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_session_of_another_rank_is_refused_with_what_to_do(tmp, daemon):
    code = f"""
import os, datetime, torch.distributed as dist, gradsync, gradsync.torch
gradsync.init(job="tb-mismatch", rank=0, world_size=1, socket={daemon.socket!r})
try:
    dist.init_process_group("gradsync", init_method="file://{tmp}/st", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=20))
except ValueError as e:
    print("refused:", e)
"""
    p = subprocess.run([PYTHON, "-c", code], env=dict(os.environ, PYTHONPATH=os.path.join(
        BUILD, "python")), capture_output=True, text=True, timeout=60)
    assert "refused: gradsync: torch.distributed's rank 1 of 2 is not this process's gradsync " \
           "session's rank 0 of 1" in p.stdout, p.stdout + p.stderr[-2000:]
    assert "rank=gradsync.get_rank()" in p.stdout


@needs_torch2
def test_the_backend_string_alone_finds_gradsync_through_its_entry_point(tmp, daemon):
    """No import of gradsync in the script: torch 2 finds the backend through the package's
    entry point (group torch.distributed.backends), laid out beside the package in the build."""
    code = f"""
import sys, torch, torch.distributed as dist
assert "gradsync" not in sys.modules
dist.init_process_group("gradsync", init_method="file://{tmp}/st-entry", rank=0, world_size=1)
t = torch.full((3,), 2.0)
dist.all_reduce(t)
print("reduced", t.tolist(), dist.get_backend(), "gradsync.torch" in sys.modules)
dist.destroy_process_group()
"""
    env = dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"),
               GRADSYNC_SOCKET=daemon.socket, GRADSYNC_JOB="tb-entry-point")
    p = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    assert "reduced [2.0, 2.0, 2.0] gradsync True" in p.stdout, p.stdout

