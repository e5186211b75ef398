"""Trainer processes behave like any Python program: they exit 0 when the job finished, Ctrl-C
stops a wait, forked DataLoader workers and repeated init/shutdown work. Real gradsyncd, real
trainer processes (tests/python/lifecycle_worker.py)."""
import json
import os
import signal
import socket
import time

import pytest

from conftest import PYTHON, launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifecycle_worker.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_exit(results):
    for r, res in enumerate(results):
        assert res["rc"] == 0, f"rank {r} exited {res['rc']}:\n{res['text'][-3000:]}"
        assert "terminate called" not in res["text"], res["text"][-3000:]
        assert "Traceback" not in res["text"], res["text"][-3000:]


def run_clean(tmp, daemon, job, *args, extra_env=None):
    """Two ranks of lifecycle_worker.py `args`; both must exit 0 without an abort."""
    results = launch(tmp, [daemon] * 2, job, lambda r: [WORKER, *args],
                     extra_env=extra_env).wait(expect_ok=False)
    clean_exit(results)
    return results


def test_ddp_hook_trainer_exits_zero_without_cleanup(tmp, daemon):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = run_clean(tmp, daemon, "hookexit", "hook", extra_env=env)
    grads = [res["json"][-1]["grad"] for res in results]
    assert grads[0] == grads[1]  # averaged through the daemon


def test_optimizer_trainer_exits_zero(tmp, daemon):
    results = run_clean(tmp, daemon, "optexit", "optimizer")
    assert results[0]["json"][-1]["weight"] == results[1]["json"][-1]["weight"]


def test_plain_collectives_exit_zero_without_torch(tmp, daemon):
    results = run_clean(tmp, daemon, "plainexit", "plain")
    for res in results:
        out = res["json"][-1]
        assert out["value"] == [3.0] * 4
        assert out["torch_loaded"] is False


def read_json(ranks, i):
    return [json.loads(l) for l in ranks.output(i).splitlines() if l.startswith("{")]


@pytest.mark.parametrize("where", ["all_reduce", "backward"])
def test_sigint_during_a_wait_raises_keyboard_interrupt_and_tells_the_other_rank(tmp, daemon,
                                                                                 where):
    ranks = launch(tmp, [daemon] * 3, "sigint" + where,
                   lambda r: [WORKER, "interrupt", tmp, where])
    try:
        for _ in range(600):  # rank 0 is about to wait for a rank that does not come
            if any(j.get("waiting") for j in read_json(ranks, 0)):
                break
            assert ranks.procs[0].poll() is None, ranks.output(0)
            time.sleep(0.05)
        else:
            pytest.fail("rank 0 never started its op:\n" + ranks.output(0))
        time.sleep(1.0)  # inside the wait (its deadline is 120 s)
        ranks.procs[0].send_signal(signal.SIGINT)
        ranks.procs[0].wait(60)  # a wait that ignored SIGINT would run to its 120 s deadline
        open(os.path.join(tmp, "interrupted"), "w").close()
        ranks.procs[1].wait(60)
    finally:
        open(os.path.join(tmp, "release"), "w").close()
    results = ranks.wait(expect_ok=False)
    clean_exit(results)
    out0, out1 = results[0]["json"][-1], results[1]["json"][-1]
    assert out0["outcome"] == "KeyboardInterrupt", out0
    assert out0["initialized"] is False  # the interrupted session was ended
    # The daemon failed the op on rank 1 (not at the deadline), naming rank 0.
    assert out1["outcome"] == "error", out1
    assert out1["code"] in ("UNAVAILABLE", "ABORTED"), out1
    assert "rank 0" in out1["message"], out1
    assert results[2]["json"][-1]["released"] is True


def test_fork_dataloader_workers_next_to_a_session(tmp, daemon):
    results = run_clean(tmp, daemon, "forkdl", "dataloader")
    for res in results:
        out = res["json"][-1]
        assert out["total"] == 2 * float(sum(range(64)))
        assert out["before"] == [3.0] * 3 and out["after"] == [3.0] * 3


def test_repeated_init_and_shutdown_in_one_process(tmp, daemon):
    results = run_clean(tmp, daemon, "reinit", "reinit", "3")
    for res in results:
        # Round k: ranks hold k and 1 + k.
        assert res["json"][-1]["values"] == [1.0, 3.0, 5.0]
    assert daemon.ctl("health").returncode == 0
