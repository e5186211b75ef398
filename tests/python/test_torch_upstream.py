"""torch's own distributed tests (torch/testing/_internal/distributed/distributed_test.py, from
torch 2's wheel) against the backend "gradsync", 3 ranks on a real daemon, as torch runs them
against gloo (tests/python/torch_upstream_runner.py). The test runs SELECTION (torch's
collectives and DDP on CPU, about 2 minutes here) and wants each to pass; GRADSYNC_UPSTREAM_ALL=1
runs every case (docs/testing.md records such a run)."""
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch

from conftest import BUILD

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_upstream_runner.py")
SELECTION = (  # exact names: each spawns its ranks, so a case skipped there costs as much
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_min", "test_all_reduce_sum_async",
    "test_all_reduce_sum_complex", "test_all_reduce_full_group_sum",
    "test_all_reduce_complex_unsupported_ops", "test_broadcast", "test_broadcast_full_group",
    "test_all_gather", "test_all_gather_complex", "test_all_gather_coalesced_simple",
    "test_all_gather_coalesced_with_empty", "test_barrier", "test_gather", "test_scatter",
    "test_reduce_sum", "test_reduce_max", "test_reduce_sum_twice",
    "test_DistributedDataParallelCPU", "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad", "test_ddp_create_graph",
    "test_static_graph_api_cpu", "test_destroy_group", "test_get_rank_size_group")
MIN_PASSED = len(SELECTION)  # each must pass, not skip


@pytest.mark.skipif(int(torch.__version__.split(".")[0]) < 2,
                    reason=f"torch {torch.__version__}: the suite run is torch 2's")
def test_torchs_own_distributed_tests_pass_against_the_backend(daemon):
    every = os.environ.get("GRADSYNC_UPSTREAM_ALL") == "1"
    with tempfile.TemporaryDirectory(prefix="gradsync-upstream-") as temp:
        env = dict(os.environ, BACKEND="gradsync", WORLD_SIZE="3", TEMP_DIR=temp,
                   GRADSYNC_SOCKET=daemon.socket, PYTHONPATH=os.path.join(BUILD, "python"),
                   OMP_NUM_THREADS="1", PYTORCH_PRINT_REPRO_ON_FAILURE="0")
        selection = [] if every else [a for name in SELECTION for a in ("-k", f"*.{name}")]
        p = subprocess.run([sys.executable, RUNNER, "-v", *selection], env=env,
                           capture_output=True, text=True, timeout=3600 if every else 900)
    out = p.stdout + p.stderr
    failed = sorted(set(re.findall(r"^(?:FAIL|ERROR): (test_\w+)", out, re.M)))
    ran = re.search(r"^Ran (\d+) tests? in", out, re.M)
    verdict = re.search(r"^(OK|FAILED)(?: \((.*)\))?$", out, re.M)
    assert ran and verdict, out[-5000:]
    assert p.returncode == 0 and verdict.group(1) == "OK" and not failed, (
        f"failed: {failed}\n{out[-8000:]}")
    skipped = re.search(r"skipped=(\d+)", verdict.group(2) or "")
    passed = int(ran.group(1)) - (int(skipped.group(1)) if skipped else 0)
    assert passed >= MIN_PASSED, f"{passed} passed:\n{out[-5000:]}"
