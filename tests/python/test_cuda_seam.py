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
every registration but the optimizer's buckets first. torch.distributed's backend on CUDA
tensors: Work.wait() and the Work's future (DDP's reducer takes it) keep that stream order.
"""
import ctypes
import os

import pytest

from conftest import BUILD, launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cuda_worker.py")
SCENARIOS = ["detector", "collectives", "realloc", "empty_cache", "hook", "process_group",
             "optimizer",
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


def test_a_cuda_buffer_is_destroyed_only_once_the_daemon_let_its_events_go(monkeypatch):
    """A CudaBuffer's events are destroyed with the object only after its deregistration
    succeeded (the daemon answers once every op that named it has settled on the device); when
    the daemon never said so, they are kept to the process's end, since destroying an event
    under the daemon's pending record of it is undefined."""
    import sys
    sys.path.insert(0, os.path.join(BUILD, "python"))
    import gradsync._native as native

    class Lib:  # libgradsync_c's CUDA buffer calls, seen
        def __init__(self):
            self.freed, self.rc = [], 0

        def gs_cuda_buffer_id(self, ptr):
            return ptr

        def gs_cuda_buffer_deregister(self, client, ptr):
            return self.rc

        def gs_cuda_buffer_free(self, ptr):
            self.freed.append(ptr)

        def gs_last_error(self):
            return b"the call's deadline passed"

    lib = Lib()
    monkeypatch.setattr(native, "_lib", lib)
    client = object.__new__(native.Client)  # no session: its calls go straight to the lib
    client._call = lambda fn, *args: fn(None, *args)
    answered = native.CudaBuffer(7, 0x1000, 64)
    client.deregister_cuda(answered)
    del answered
    assert lib.freed == [7]
    lib.rc = native._CODES.index("DEADLINE_EXCEEDED")
    unanswered = native.CudaBuffer(8, 0x2000, 64)
    with pytest.raises(native.Error) as e:
        client.deregister_cuda(unanswered)
    assert e.value.code == "DEADLINE_EXCEEDED"
    del unanswered
    assert lib.freed == [7], "events destroyed though the daemon never let them go"
