"""No one edits another job's state: the attacks of a local user, another user's trainer or a
trainer of another node on a running job (real daemons, real uids through setpriv), each refused
with the job unharmed.

A client is a caller of a daemon's unix socket, or a TCP caller with the client credential a
daemon hands out there; a daemon is a TCP caller with the cluster token. On the unix socket a
caller reaches only the jobs its own user's trainers hold, or none holds (docs/security.md)."""
import hashlib
import hmac
import json
import os
import re
import socket
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


def as_daemon(d, *args):
    """gradsyncctl over TCP with the cluster token: a daemon's view."""
    return subprocess.run([os.path.join(BUILD, "client", "gradsyncctl"), f"--address={d.tcp}",
                           f"--token_file={d.token_file}", "--timeout=5s", *args],
                          capture_output=True, text=True, timeout=30)


def daemon_keys(d, job):
    """The daemons' own keys of `job` as the root's store lists them to a daemon (names only,
    through Inspect); a client is shown none of them."""
    listed = as_daemon(d, f"--job={job}", "store", "list")
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
    before = {k: as_daemon(root, f"--job={job}", "store", "list", k).stdout for k in keys}
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
    assert "AdmitJoiners" in msg
    # Nothing changed: the same keys, the same sizes.
    assert {k: as_daemon(root, f"--job={job}", "store", "list", k).stdout for k in keys} == before
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
    def ctl_with(credential, *args):
        path = os.path.join(tmp, "credential")
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(credential + "\n")
        return subprocess.run([os.path.join(BUILD, "client", "gradsyncctl"),
                               f"--address={root.tcp}", f"--token_file={path}", *args],
                              capture_output=True, text=True, timeout=30)

    def credential(job):  # as a daemon derives it (common/token.h)
        mac = hmac.new(token.encode(), b"gradsync client credential v1\0" + job.encode(),
                       hashlib.sha256).hexdigest()
        return f"gsc1.{job}.{mac}"

    assert "UNAUTHENTICATED" in ctl_with("gsc1." + "0" * 64, "store", "get", "x").stderr
    assert "UNAUTHENTICATED" in ctl_with("gsc1.victim." + "0" * 64, "store", "get", "x").stderr
    # A credential is one job's (and its elastic epochs'): another job's opens nothing of it.
    r = ctl_with(credential("other"), f"--job={job}", "store", "get", "mine")
    assert "PERMISSION_DENIED" in r.stderr and "is for job 'other'" in r.stderr, r.stderr
    r = ctl_with(credential("other"), "--job=other", "store", "get", "x")
    assert "NOT_FOUND" in r.stderr or "DEADLINE" in r.stderr, r.stderr
    assert ctl_with(credential(job), f"--job={job}", "store", "get", "mine").returncode == 0
    # A client is shown none of the daemons' keys, not even their names.
    listed = ctl_with(credential(job), f"--job={job}", "store", "list").stdout
    assert "mine" in listed and not re.search(r"daemon/|records/|watch/", listed), listed
    r = ctl_with(credential(job), f"--job={job}.e3", "store", "get", "x")
    assert "PERMISSION_DENIED" not in r.stderr, r.stderr
    finish_unharmed(go, procs)


def test_joins_are_checked_and_written_by_the_daemon(job_across_two_nodes):
    """The fake joins of the report: tickets written by hand, a counter pushed ahead, a ticket of
    a thousand ranks, an admission asked of a job that is not elastic; each refused."""
    ds, job, go, procs = job_across_two_nodes
    trainer = Client(ds[1].socket, job, 1, 0, 0, 1, root_address=ds[0].tcp, store_only=True)
    refused(lambda: trainer.store_add("_gradsync_elastic/tickets", 1000000))
    refused(lambda: trainer.store_set("_gradsync_elastic/ticket/1", b"ranks=1024"))
    refused(lambda: trainer.store_set("_gradsync_elastic/admit/1", b"epoch=1 world=9 rank=2 min=1"))
    with pytest.raises(Error) as e:
        trainer.store_join(1025, 1)
    assert e.value.code == "INVALID_ARGUMENT", e.value
    with pytest.raises(Error) as e:  # the job is not elastic: no join, whatever the caller says
        trainer.store_admit_joiners(1, 1)
    assert e.value.code == "FAILED_PRECONDITION" and "not elastic" in str(e.value)
    for epoch, min_world, min_joined in ((0, 1, 1), (2, 1, 1), (1, 0, 1), (1, 1, 1025)):
        with pytest.raises(Error) as e:
            trainer.store_admit_joiners(epoch, min_world, min_joined)
        assert e.value.code == "INVALID_ARGUMENT", (epoch, min_world, min_joined, e.value)
    with pytest.raises(Error) as e:  # nothing was decided
        trainer.store_get("_gradsync_elastic/decision", 0)
    assert e.value.code == "DEADLINE_EXCEEDED"
    finish_unharmed(go, procs)


# An attacker on the node: another user in the socket's group (setpriv), against a job whose
# trainers run as a user of their own.
VICTIM_UID, ATTACKER_UID = 65534, 65533

ATTACK = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
from gradsync._native import Client, Error
socket, job = sys.argv[1], sys.argv[3]
out = {}
if len(sys.argv) > 4:  # the job's credential for TCP, from this node's daemon
    try:
        Client(socket, job, 1, 0, 0, 1, root_address=sys.argv[4], store_only=True)
        out["credential"] = "OK"
    except Error as e:
        out["credential"] = e.code + " " + str(e)
c = Client(socket, job, 1, 0, 0, 1, store_only=True)
for name, call in (("set", lambda: c.store_set("mine", b"1")),
                   ("get", lambda: c.store_get("_gradsync/packlist/0,1", 0)),
                   ("add", lambda: c.store_add("counter", 1)),
                   ("plan", lambda: c.set_pack_list("0,1", {"packs": [], "threshold_bytes": 1,
                                                          "first_alone": 0}))):
    try:
        call()
        out[name] = "OK"
    except Error as e:
        out[name] = e.code + " " + str(e)
print(json.dumps(out))
"""


def as_user(uid, cmd):
    return ["/usr/bin/setpriv", f"--reuid={uid}", "--regid=0", "--clear-groups", *cmd]


@pytest.fixture
def job_of_another_user(tmp):
    """One daemon; job "victim" of two ranks run as VICTIM_UID, formed and idle."""
    if os.geteuid() != 0 or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("needs root and setpriv to act as other users")
    from conftest import Daemon
    os.chmod(tmp, 0o755)
    d = Daemon(tmp, "node", tcp=True)
    go = os.path.join(tmp, "go")
    procs = []
    for r in range(2):
        out = open(os.path.join(tmp, f"user{r}.out"), "w")
        procs.append((subprocess.Popen(as_user(VICTIM_UID, [PYTHON, "-c", TRAINER, go]),
                                       env=env_for(d, "victim", r, 2), stdout=out,
                                       stderr=subprocess.STDOUT), out.name))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not all(
            '"first"' in open(n).read() for _, n in procs):
        time.sleep(0.05)
    for p, name in procs:
        assert '"first": [2.0, 2.0, 2.0, 2.0]' in open(name).read(), open(name).read()[-2000:]
    yield d, go, procs
    for p, _ in procs:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    d.stop()


def attack(d, uid, job="victim"):
    r = subprocess.run(as_user(uid, [PYTHON, "-c", ATTACK, d.socket, os.path.join(BUILD, "python"),
                                     job] + ([d.tcp] if d.tcp else [])),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def ctl_as(d, uid, *args):
    return subprocess.run(as_user(uid, [os.path.join(BUILD, "client", "gradsyncctl"),
                                        f"--socket={d.socket}", "--timeout=5s", *args]),
                          capture_output=True, text=True, timeout=30)


def test_another_user_reaches_no_state_of_a_job_its_user_does_not_hold(job_of_another_user):
    d, go, procs = job_of_another_user
    got = attack(d, ATTACKER_UID)
    for name, outcome in got.items():
        assert outcome.startswith("PERMISSION_DENIED"), (name, outcome)
        assert "another user's trainers" in outcome, outcome
    for args in (["--job=victim", "store", "list"], ["--job=victim", "store", "set", "k", "v"],
                 ["--job=victim", "packlist", "groups"], ["ops", "victim"],
                 ["history", "victim"]):
        r = ctl_as(d, ATTACKER_UID, *args)
        assert r.returncode != 0 and "PERMISSION_DENIED" in r.stderr, (args, r.stdout, r.stderr)
    # The node-wide views leave the job out for that user, and show it to its own and to root.
    assert "victim" not in ctl_as(d, ATTACKER_UID, "sessions").stdout
    assert "victim" not in ctl_as(d, ATTACKER_UID, "jobs").stdout
    assert "victim" in ctl_as(d, VICTIM_UID, "sessions").stdout
    assert "victim" in d.ctl("sessions").stdout
    # A job no session holds is anyone's in the group: the attacker's own work goes on.
    assert attack(d, ATTACKER_UID, job="attackers-own")["set"] == "OK"
    # The job's own user, and root (an operator), reach it.
    assert attack(d, VICTIM_UID)["set"] == "OK"
    assert d.ctl("--job=victim", "store", "get", "mine").stdout.strip().endswith("1")
    finish_unharmed(go, procs)


def test_another_user_cannot_take_a_rank_of_a_job_its_user_does_not_hold(tmp):
    """Rank 0 of a job of two, run as one user, waits for rank 1; another user registering as
    rank 1 is refused, and the job's own user's rank 1 then completes it."""
    if os.geteuid() != 0 or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("needs root and setpriv to act as other users")
    from conftest import Daemon
    os.chmod(tmp, 0o755)
    d = Daemon(tmp, "node")
    go = os.path.join(tmp, "go")
    open(go, "w").close()
    try:
        outs = [os.path.join(tmp, f"r{i}.out") for i in range(3)]
        rank0 = subprocess.Popen(as_user(VICTIM_UID, [PYTHON, "-c", TRAINER, go]),
                                 env=env_for(d, "half", 0, 2), stdout=open(outs[0], "w"),
                                 stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "half" not in d.ctl("sessions").stdout:
            time.sleep(0.05)
        thief = subprocess.run(as_user(ATTACKER_UID, [PYTHON, "-c", TRAINER, go]),
                               env=env_for(d, "half", 1, 2), capture_output=True, text=True,
                               timeout=60)
        assert thief.returncode != 0
        assert "PERMISSION_DENIED" in thief.stdout + thief.stderr, thief.stdout + thief.stderr
        assert "held by another user's trainers" in thief.stdout + thief.stderr
        rank1 = subprocess.run(as_user(VICTIM_UID, [PYTHON, "-c", TRAINER, go]),
                               env=env_for(d, "half", 1, 2), capture_output=True, text=True,
                               timeout=60)
        assert rank1.returncode == 0, rank1.stdout + rank1.stderr
        assert '"second": [2.0, 2.0, 2.0, 2.0]' in rank1.stdout
        assert rank0.wait(60) == 0, open(outs[0]).read()
    finally:
        d.stop()


def hold_connections(path, n):
    """n raw connections to a unix socket, held open (no HTTP/2 spoken)."""
    held = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)
        held.append(s)
    return held


def test_one_user_holding_connections_cannot_lock_others_out(tmp):
    """A user that holds the socket's connections past its share is closed as it comes; another
    user's calls, and its own once it lets go, are served."""
    if os.geteuid() != 0 or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("needs root and setpriv to act as other users")
    from conftest import Daemon
    os.chmod(tmp, 0o755)
    d = Daemon(tmp, "node", flags=["--max_local_connections_per_user=8"])
    try:
        hog = subprocess.Popen(
            as_user(ATTACKER_UID, [PYTHON, "-c", HOG, d.socket, "20"]),
            stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
        assert hog.stdout.readline().strip() == "held"
        r = ctl_as(d, ATTACKER_UID, "health")
        assert r.returncode != 0, r.stdout  # its share is taken
        assert ctl_as(d, VICTIM_UID, "health").returncode == 0
        assert d.ctl("health").returncode == 0
        hog.communicate("done\n", timeout=30)
        deadline = time.monotonic() + 10
        while ctl_as(d, ATTACKER_UID, "health").returncode != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ctl_as(d, ATTACKER_UID, "health").returncode == 0
        assert "refused" in open(d.log).read()
    finally:
        d.stop()


HOG = r"""
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    held.append(s)
print("held", flush=True)
sys.stdin.readline()
"""


def test_a_daemon_out_of_descriptors_says_so_and_recovers(tmp):
    """Connections held until the daemon has no descriptor left (a low LimitNOFILE, set with
    prlimit): it logs that it cannot accept trainers, sheds the connections waiting, and its
    health (asked on a TCP connection made before) is NOT_SERVING until it accepts a trainer's
    connection again."""
    if not os.access("/usr/bin/prlimit", os.X_OK):
        pytest.skip("prlimit (util-linux) is not installed")
    grpc = pytest.importorskip("grpc")
    from conftest import Daemon
    d = Daemon(tmp, "node", tcp=True)
    channel = grpc.insecure_channel(d.tcp)
    # grpc.health.v1.Health/Check on raw bytes: an empty request; the answer's field 1 is the
    # status (1 SERVING, 2 NOT_SERVING).
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)

    def until(status, then=lambda: None):
        deadline = time.monotonic() + 20
        got = None
        while time.monotonic() < deadline:
            then()
            got = check(b"", timeout=5)
            if got == bytes([8, status]):
                break
            time.sleep(0.1)
        return got

    try:
        assert until(1) == b"\x08\x01"  # SERVING, and the TCP connection is made
        pid = d.proc.pid
        soft = subprocess.run(["/usr/bin/prlimit", f"--pid={pid}", "--nofile", "--output=SOFT",
                               "--noheadings"], capture_output=True, text=True,
                              check=True).stdout.strip()
        subprocess.run(["/usr/bin/prlimit", f"--pid={pid}", "--nofile=160:"], check=True)
        held = hold_connections(d.socket, 200)  # the listen backlog takes what is not accepted
        assert until(2) == b"\x08\x02"  # NOT_SERVING
        assert "cannot accept connections on its unix socket (trainers)" in open(d.log).read()
        for c in held:
            c.close()
        subprocess.run(["/usr/bin/prlimit", f"--pid={pid}", f"--nofile={soft}:"], check=True)
        assert until(1, then=lambda: d.ctl("health")) == b"\x08\x01"
        assert "unix socket: accepting connections again" in open(d.log).read()
        assert d.ctl("health").returncode == 0
    finally:
        channel.close()
        d.stop()


def test_one_remote_host_holding_tcp_connections_cannot_lock_others_out(tmp):
    """Raw TCP connections, no token, from 127.0.0.1 past its share: the next one from there is
    closed at once, one from 127.0.0.2 is served (the daemon speaks HTTP/2 first), and the
    unix socket is unharmed; once they close, 127.0.0.1 is served again."""
    from conftest import Daemon
    d = Daemon(tmp, "node", tcp=True, flags=["--max_tcp_connections_per_source=8"])
    host, port = d.tcp.rsplit(":", 1)

    def connect(source):
        s = socket.create_connection((host, int(port)), timeout=5,
                                     source_address=(source, 0))
        return s

    def served(source):
        """Whether a new connection from `source` is kept: the daemon sends its HTTP/2 settings
        on one it keeps, and closes one it refuses (an empty read)."""
        s = connect(source)
        try:
            s.settimeout(5)
            return len(s.recv(64)) > 0
        except ConnectionResetError:
            return False
        finally:
            s.close()

    try:
        held = [connect("127.0.0.1") for _ in range(8)]
        try:
            assert not served("127.0.0.1")
            assert served("127.0.0.2")
            assert d.ctl("health").returncode == 0
        finally:
            for s in held:
                s.close()
        deadline = time.monotonic() + 10
        while not served("127.0.0.1") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert served("127.0.0.1")
        assert "tcp: connection of 127.0.0.1 refused" in open(d.log).read()
    finally:
        d.stop()


def test_a_tcp_connection_that_makes_no_authenticated_call_is_cut_in_time(tmp):
    """A raw connection that never calls, and one that asks health only, are cut after
    --tcp_first_call_deadline; a client that calls with its credential keeps its connection."""
    from conftest import Daemon
    d = Daemon(tmp, "node", tcp=True, flags=["--tcp_first_call_deadline=1s"])
    host, port = d.tcp.rsplit(":", 1)
    try:
        raw = socket.create_connection((host, int(port)), timeout=10)
        raw.settimeout(10)
        data, t0 = b"", time.monotonic()
        while time.monotonic() - t0 < 10:
            chunk = raw.recv(4096)  # the daemon's HTTP/2 settings, then the end
            if not chunk:
                break
            data += chunk
        assert data and time.monotonic() - t0 < 10, "the silent connection was not cut"
        raw.close()
        # A trainer elsewhere with the client credential, calling now and then past the
        # deadline, on one connection.
        trainer = Client(d.socket, "kept", 1, 0, 0, 1, root_address=d.tcp, store_only=True)
        trainer.store_set("k", b"1")
        time.sleep(2.5)
        assert trainer.store_get("k", 1) == b"1"
        log = open(d.log).read()
        assert log.count("no authenticated call within 1s") == 1, log[-2000:]
    finally:
        d.stop()
