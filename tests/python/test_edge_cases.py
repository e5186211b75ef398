"""What trainers do off the happy path, against real gradsyncd processes and real trainer
processes (tests/python/edge_worker.py): empty tensors and parameters in every op and through
gradsync.torch, a pack plan that does not fit the model, a daemon stopped (SIGSTOP) and resumed
under a trainer."""
import json
import os
import signal
import sys
import time

import pytest

from conftest import BUILD, PROCESS_TIMEOUT, launch

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "edge_worker.py")


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last(results, rank):
    return results[rank]["json"][-1]


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_takes_operands_without_elements(tmp, daemon, world):
    results = launch(tmp, [daemon] * world, f"empty{world}",
                     lambda r: [WORKER, "empty_ops"]).wait()
    for r in range(world):
        checks = last(results, r)["checks"]
        failed = [name for name, ok in checks.items() if not ok]
        assert checks and not failed, f"rank {r}: {failed}"
    assert len({tuple(last(results, r)["seqs"]) for r in range(world)}) == 1


def test_operands_without_elements_across_two_daemons(tmp, two_daemons):
    d0, d1 = two_daemons
    results = launch(tmp, [d0, d0, d1, d1], "emptynodes", lambda r: [WORKER, "empty_ops"],
                     local=2, root=d0.tcp).wait()
    for r in range(4):
        checks = last(results, r)["checks"]
        failed = [name for name, ok in checks.items() if not ok]
        assert checks and not failed, f"rank {r}: {failed}"


def test_empty_and_non_empty_operands_of_one_op_are_a_desync_on_both_ranks(tmp, daemon):
    results = launch(tmp, [daemon] * 2, "emptydesync",
                     lambda r: [WORKER, "empty_desync"]).wait(timeout=90)
    for r in range(2):
        error, after = results[r]["json"][-2], results[r]["json"][-1]
        assert error["error"] == "FAILED_PRECONDITION", error
        assert "desync" in error["message"] and "uneven" in error["message"], error
        assert after["after"] == [2.0, 2.0]  # the session goes on


@pytest.mark.parametrize("pack", ["0", "1"])
@pytest.mark.parametrize("where", ["host", "fake_cuda"])
def test_distributed_optimizer_reduces_models_with_empty_parameters(tmp, daemon, pack, where):
    scenario = "empty_params" if where == "host" else "empty_params_cuda"
    results = launch(tmp, [daemon] * 2, f"emptyp{pack}{where[0]}",
                     lambda r: [WORKER, scenario, pack]).wait()
    outs = [last(results, r) for r in range(2)]
    for out in outs:
        assert out["diff"] <= 1e-6, out  # one process on the whole batch
        assert out["shapes_ok"], out
        assert [3, 0] in out["shapes"] and [0] in out["shapes"] and [0, 4] in out["shapes"]
        assert out["lone"] == [0, 3]
        assert out["violations"] == [], out
        if pack == "1":
            assert sorted(i for p in out["plan"] for i in p) == list(range(len(out["shapes"])))
        if where == "fake_cuda":
            ops = out["device_ops"]
            assert ops["device_of"] == 0  # the empty tensor is a device tensor here
            assert ops["registrations"] == 0 and ops["settled"] == [], ops
            assert "different devices" in ops["mixed"], ops
    assert outs[0]["params"] == outs[1]["params"]  # bit for bit


def test_ddp_hook_reduces_empty_buckets(tmp, daemon):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    results = launch(tmp, [daemon] * 2, "emptyhook", lambda r: [WORKER, "empty_hook"],
                     extra_env=env).wait()
    outs = [last(results, r) for r in range(2)]
    for out in outs:
        assert out["diff"] <= 1e-6, out
        assert out["empty_buckets"] > 0, out  # the hook saw 0-element buckets
    assert outs[0]["params"] == outs[1]["params"]


def test_a_pack_plan_that_does_not_fit_raises_gradsync_error_on_every_rank(tmp, daemon):
    results = launch(tmp, [daemon] * 2, "badplan", lambda r: [WORKER, "bad_plan"]).wait()
    for r in range(2):
        out = last(results, r)
        assert out["error"] == "Error" and out["is_gradsync_error"], out
        assert out["code"] == "FAILED_PRECONDITION", out
        # Rank 0's plan left out the gradient backward produced last: parameter 0.
        assert out["message"] == (
            "FAILED_PRECONDITION: the pack plan of Group(world) covers parameters [1, 2, 3]; "
            "this rank has 4 (every rank must have the same parameters)"), out


def _lines(ranks):
    return [json.loads(l) for l in ranks.output(0).splitlines() if l.startswith("{")]


def _wait_line(ranks, key, timeout_s):
    """The trainer's JSON line carrying `key`; fails if it exits or takes longer."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [l for l in _lines(ranks) if key in l]
        if found:
            return found[0]
        if ranks.procs[0].poll() is not None:
            pytest.fail(f"trainer exited {ranks.procs[0].returncode} before '{key}':\n"
                        f"{ranks.output(0)[-3000:]}")
        time.sleep(0.02)
    pytest.fail(f"no '{key}' from the trainer in {timeout_s} s:\n{ranks.output(0)[-3000:]}")


def test_trainer_survives_a_daemon_stopped_and_resumed_under_its_op_and_its_shutdown(tmp, daemon):
    """SIGSTOP on the daemon while an op waits, SIGCONT once the client gave up, SIGSTOP again
    while the session ends: the trainer gets DEADLINE_EXCEEDED, keeps working, ends its session
    within its RPC timeout and exits 0 (it used to die of SIGABRT in the client library: a
    stream operation started on a shut-down completion queue)."""
    # Rank 0 of a world of 2: rank 1 never comes, so no op can complete.
    ranks = launch(tmp, [daemon], "frozen", lambda r: [WORKER, "frozen", tmp],
                   extra_env={"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"})
    stopped = False
    try:
        _wait_line(ranks, "ready", 60)
        daemon.proc.send_signal(signal.SIGSTOP)
        stopped = True
        first = _wait_line(ranks, "first", 60)  # the op's 5 s deadline plus the 10 s margin
        daemon.proc.send_signal(signal.SIGCONT)
        stopped = False
        open(os.path.join(tmp, "resumed"), "w").close()
        _wait_line(ranks, "closing", 60)
        daemon.proc.send_signal(signal.SIGSTOP)
        stopped = True
        open(os.path.join(tmp, "frozen_again"), "w").close()
        try:
            ranks.procs[0].wait(30)  # shutdown() waits its 2 s RPC timeout, then cancels
        except Exception:  # noqa: BLE001 - reported below with the output
            pass
    finally:
        if stopped:
            daemon.proc.send_signal(signal.SIGCONT)
        if ranks.procs[0].poll() is None:
            ranks.procs[0].kill()
            ranks.procs[0].wait(10)
    text = ranks.output(0)
    assert ranks.procs[0].returncode == 0, text[-3000:]
    assert "assertion failed" not in text, text[-3000:]
    assert first["first"] == "DEADLINE_EXCEEDED", first
    assert "no answer from gradsyncd" in first["message"], first
    assert 15 <= first["took"] < 35, first
    lines = {k: v for l in _lines(ranks) for k, v in l.items()}
    # The resumed daemon answers a new op itself: its deadline passed without rank 1.
    assert lines["second"] == "DEADLINE_EXCEEDED", lines
    assert "rank(s) 1 never submitted it" in lines["second_message"], lines
    assert lines["again"] == "DEADLINE_EXCEEDED", lines  # the first op's outcome stands
    assert lines["closed"] is True and lines["close_took"] < 10, lines
    # The daemon serves on.
    assert daemon.ctl("health").returncode == 0


def test_the_daemons_records_are_read_by_one_parser_and_anything_else_is_refused():
    """The elastic protocol's records (protobuf messages the daemons write) reach Python as
    dicts through the C ABI's one parser; bytes that are no such record, or an unknown kind,
    are INVALID_ARGUMENT, not a crash or a half-read dict."""
    sys.path.insert(0, os.path.join(BUILD, "python"))
    import gradsync
    from gradsync import _native
    # A JoinAdmission {epoch: 1, world: 4, rank: 2, min_world_size: 1}, as protobuf's wire
    # format has it (field 1..4, varints).
    admission = bytes([0x08, 1, 0x10, 4, 0x18, 2, 0x20, 1])
    assert _native.record("admission", admission) == {
        "epoch": 1, "world": 4, "rank": 2, "min_world_size": 1}
    assert _native.record("ticket", bytes([0x08, 1, 0x10, 3])) == {"state": "WAITING", "ranks": 3}
    for kind, raw in (("decision", b""), ("decision", b"epoch=1 world=2 at=1 why=x"),
                      ("admission", b"\xff\xff\xff"), ("ticket", b""), ("nonsense", admission)):
        with pytest.raises(gradsync.Error) as e:
            _native.record(kind, raw)
        assert e.value.code == "INVALID_ARGUMENT", (kind, raw, e.value)
