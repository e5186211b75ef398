"""No client edits a job's state that only the daemons keep: the attacks of a local user or a
trainer on a job spanning two real daemons (loopback TCP), each refused with the job unharmed.

A client is a caller of a daemon's unix socket, or a TCP caller with the client credential a
daemon hands out there; a daemon is a TCP caller with the cluster token (docs/security.md)."""
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import BUILD, PYTHON, env_for, tcp_daemons

sys.path.insert(0, os.path.join(BUILD, "python"))
from gradsync._native import Client, Error  # noqa: E402

# A rank that sums ones with the other rank, waits for the test's go, and sums again: the job
# is formed and idle while the test attacks it.
TRAINER = r"""
import json, os, sys, time
import torch
import gradsync
gradsync.init()
t = torch.ones(4)
gradsync.all_reduce(t, op="sum")
print(json.dumps({"first": t.tolist()}), flush=True)
deadline = time.monotonic() + 90
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.05)
t = torch.ones(4)
gradsync.all_reduce(t, op="sum")
print(json.dumps({"second": t.tolist()}), flush=True)
"""


@pytest.fixture
def job_across_two_nodes(tmp, monkeypatch):
    """Two daemons, one rank on each, the job formed; yields (daemons, job, go file, ranks)."""
    ds = tcp_daemons(tmp, monkeypatch, 2)
    job, go = "victim", os.path.join(tmp, "go")
    procs = []
    for r, d in enumerate(ds):
        out = open(os.path.join(tmp, f"victim{r}.out"), "w")
        procs.append((subprocess.Popen([PYTHON, "-c", TRAINER, go],
                                       env=env_for(d, job, r, 2, 0, 1, ds[0].tcp),
                                       stdout=out, stderr=subprocess.STDOUT), out.name))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if all('"first"' in open(name).read() for _, name in procs):
            break
        if any(p.poll() is not None for p, _ in procs):
            break
        time.sleep(0.05)
    for p, name in procs:
        assert '"first": [2.0, 2.0, 2.0, 2.0]' in open(name).read(), open(name).read()[-2000:]
    yield ds, job, go, procs
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    for d in ds:
        d.stop()


def finish_unharmed(go, procs):
    """The job goes on after the attacks: its next all-reduce is right on both ranks."""
    open(go, "w").close()
    for p, name in procs:
        p.wait(60)
        text = open(name).read()
        assert p.returncode == 0, text[-2000:]
        assert '"second": [2.0, 2.0, 2.0, 2.0]' in text, text[-2000:]


def daemon_keys(d, job):
    """The daemons' own keys of `job` as the root's store lists them to an operator (names only,
    through Inspect)."""
    listed = d.ctl(f"--job={job}", "store", "list")
    assert listed.returncode == 0, listed.stderr
    return re.findall(r"^\s*((?:daemon|records|watch)/\S+)", listed.stdout, re.M)


def refused(call):
    with pytest.raises(Error) as e:
        call()
    assert e.value.code == "PERMISSION_DENIED", e.value
    return str(e.value)


def test_a_local_user_reads_and_writes_no_daemon_key_of_another_job(job_across_two_nodes):
    ds, job, go, procs = job_across_two_nodes
    root = ds[0]
    keys = daemon_keys(root, job)
    record = next(k for k in keys if k.startswith("records/"))
    watch = next(k for k in keys if k.startswith("watch/"))
    assert "daemon/run" in keys and "daemon/rank/0" in keys
    before = {k: root.ctl(f"--job={job}", "store", "list", k).stdout for k in keys}
    # The attacks of the report: the run token rewritten, node 0's link and watch addresses
    # (and their HMAC keys) read and replaced, a decision forged, all on the root's socket.
    for args in (["get", "daemon/run"], ["get", record], ["get", watch],
                 ["set", "daemon/run", "0000000000000000"],
                 ["set", record, "127.0.0.1 1 " + "ab" * 16],
                 ["set", watch, "127.0.0.1 1 " + "ab" * 16],
                 ["set", "daemon/rank/0", "127.0.0.1:1"], ["delete", "daemon/rank/1"],
                 ["add", "daemon/formation", "1"],
                 ["set", "_gradsync_elastic/decision", "epoch=1 world=1 lost_ranks=1 "
                  "lost_nodes= at=0 why=forged"]):
        r = root.ctl(f"--job={job}", "store", *args)
        assert r.returncode != 0, (args, r.stdout)
        assert "PERMISSION_DENIED" in r.stderr, (args, r.stderr)
    # The same through a trainer's client of the socket, the way the Python package calls.
    local = Client(root.socket, job, 1, 0, 0, 1, store_only=True)
    refused(lambda: local.store_get("daemon/run", 0))
    refused(lambda: local.store_compare_set(record, None, b"x"))
    msg = refused(lambda: local.store_compare_set("_gradsync_elastic/decision", None, b"x"))
    assert "DecideJoin" in msg
    # Nothing changed: the same keys, the same sizes.
    assert {k: root.ctl(f"--job={job}", "store", "list", k).stdout for k in keys} == before
    finish_unharmed(go, procs)


def test_a_trainer_credential_over_tcp_is_not_a_daemons_key(job_across_two_nodes, tmp):
    ds, job, go, procs = job_across_two_nodes
    root, other = ds
    record = next(k for k in daemon_keys(root, job) if k.startswith("records/"))
    # A trainer on the other node, as gradsync.init() makes it: no token, the credential its
    # daemon hands out.
    trainer = Client(other.socket, job, 1, 0, 0, 1, root_address=root.tcp, store_only=True)
    trainer.store_set("mine", b"ok")  # a client's own keys: fine
    assert trainer.store_get("mine", 1) == b"ok"
    refused(lambda: trainer.store_get(record, 0))
    refused(lambda: trainer.store_set(record, b"127.0.0.1 1 " + b"ab" * 16))
    refused(lambda: trainer.store_set("daemon/run", b"0"))
    refused(lambda: trainer.store_compare_set("_gradsync_elastic/decision", None, b"x"))
    # A daemon (the cluster token) reads them: the line between the two is the token.
    with open(root.token_file) as f:
        token = f.read().strip()
    daemon = Client(other.socket, job, 1, 0, 0, 1, root_address=root.tcp, token=token,
                    store_only=True)
    assert re.fullmatch(rb"[0-9a-f]{16}", daemon.store_get("daemon/run", 1))
    # Over TCP the credential is not handed out, and a wrong one is no credential.
    r = subprocess.run(
        [os.path.join(BUILD, "client", "gradsyncctl"), f"--address={root.tcp}",
         f"--token_file={root.token_file}", "store", "get", "x"],
        capture_output=True, text=True, timeout=30)
    assert "NOT_FOUND" in r.stderr or "DEADLINE" in r.stderr, r.stderr  # the token works
    wrong = os.path.join(tmp, "wrong.token")
    with open(os.open(wrong, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("gsc1." + "0" * 64 + "\n")
    r = subprocess.run(
        [os.path.join(BUILD, "client", "gradsyncctl"), f"--address={root.tcp}",
         f"--token_file={wrong}", "store", "get", "x"],
        capture_output=True, text=True, timeout=30)
    assert "UNAUTHENTICATED" in r.stderr, r.stderr
    finish_unharmed(go, procs)


def test_a_join_decision_is_checked_and_written_by_the_daemon(job_across_two_nodes):
    ds, job, go, procs = job_across_two_nodes
    trainer = Client(ds[1].socket, job, 1, 0, 0, 1, root_address=ds[0].tcp, store_only=True)
    with pytest.raises(Error) as e:  # the job is not elastic: no join, whatever the caller says
        trainer.store_decide_join(1, 1, "one node joining")
    assert e.value.code == "FAILED_PRECONDITION" and "not elastic" in str(e.value)
    for epoch, joined, why, code in ((0, 1, "x", "INVALID_ARGUMENT"),
                                     (2, 1, "x", "INVALID_ARGUMENT"),  # not this epoch's next
                                     (1, 0, "x", "INVALID_ARGUMENT"),
                                     (1, 1025, "x", "INVALID_ARGUMENT"),
                                     (1, 1, "x" * 257, "INVALID_ARGUMENT"),
                                     (1, 1, "line\nforged=1", "INVALID_ARGUMENT")):
        with pytest.raises(Error) as e:
            trainer.store_decide_join(epoch, joined, why)
        assert e.value.code == code, (epoch, joined, e.value)
    with pytest.raises(Error) as e:  # nothing was written
        trainer.store_get("_gradsync_elastic/decision", 0)
    assert e.value.code == "DEADLINE_EXCEEDED"
    finish_unharmed(go, procs)
