"""gradsync's CUDA code paths without a GPU: the package's real code over the fake CUDA seam
(fake_cuda.py), against a real gradsyncd, two real trainer processes. What only a GPU can prove
(the IPC export, the events, NCCL) runs in tests/gpu/test_python_gpu.py (tests/gpu/run.sh).

Checked here: CUDA operands reach the daemon where they are (values reduced in place, views and
temporaries); "ready" is recorded before every op is submitted; the current stream waits on
"done" before a synchronous call or backward() returns (and Work.wait() for async ops, on the
waiter's stream); a change of stream joins the previous one; the host never synchronises (no
synchronize call, no host read unless parameters went unused); registrations are cached per
allocation (a hot loop registers nothing), an allocation freed and handed out again is
registered anew with the old registration deregistered, and torch.cuda.empty_cache lets go of
every registration but the optimizer's buckets first.
"""
import ctypes
import os

import pytest

from conftest import BUILD, launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cuda_worker.py")
SCENARIOS = ["detector", "collectives", "realloc", "empty_cache", "hook", "optimizer",
             "optimizer_pack", "optimizer_unused", "two_groups", "temporaries",
             "lifetime_detector"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from conftest import Daemon
    tmp = str(tmp_path_factory.mktemp("cuda-seam"))
    daemon = Daemon(tmp, "gradsyncd")
    try:
        ranks = launch(tmp, [daemon] * 2, "fakecuda", lambda r: [WORKER, *SCENARIOS])
        out = {}
        for res in ranks.wait():
            for line in res["json"]:
                out.setdefault(line["scenario"], {})[line["rank"]] = line
        yield out
    finally:
        daemon.stop()


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_cuda_paths_on_the_fake_seam(results, scenario):
    got = results[scenario]
    assert sorted(got) == [0, 1]
    for rank, line in got.items():
        failed = [name for name, ok in line["checks"].items() if not ok]
        assert line["checks"] and not failed, f"rank {rank}: {failed}\n{line['info']}"


def test_optimizer_ranks_agree(results):
    for name in ("optimizer", "optimizer_pack", "optimizer_unused", "empty_cache"):
        a, b = (results[name][r]["info"] for r in (0, 1))
        assert a.get("params") == b.get("params"), name  # bit for bit
        assert a["grad_sums"] == b["grad_sums"], name  # reduced gradients read after backward


def test_cuda_calls_of_the_c_abi_refuse_clearly_without_a_gpu():
    """libgradsync_c's CUDA functions on a machine without a driver: FAILED_PRECONDITION with
    the reason, never a crash (the package's real seam calls them)."""
    import sys
    sys.path.insert(0, os.path.join(BUILD, "python"))
    import gradsync._native as native
    import torch
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: tests/gpu/test_python_gpu.py covers it")
    buf = ctypes.create_string_buffer(64)
    with pytest.raises(native.Error) as e:
        native.cuda_allocation_of(ctypes.addressof(buf))
    assert e.value.code == "FAILED_PRECONDITION", e.value
    import gradsync._cuda as cuda
    # The real seam sees host tensors as host tensors (the CPU path runs, torch without CUDA).
    assert cuda.TorchCuda().device_of(torch.zeros(3)) is None
