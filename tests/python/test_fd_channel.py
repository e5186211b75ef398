"""How trainers reach the daemon, attacked from outside as a hostile local process would: the fd
channel (`<socket>.fd`) with wrong requests, wrong descriptor counts, many idle connections, a
flood of descriptors; and a trainer session over loopback TCP. The daemon answers each clearly,
closes what it does not keep, stays up, and other trainers go on. Real gradsyncd, raw sockets,
a second user through setpriv."""
import os
import socket
import subprocess
import time

import pytest

from conftest import PYTHON, env_for

LIFECYCLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lifecycle_worker.py")


def request(sock, data, fds):
    socket.send_fds(sock, [data], fds)
    head = sock.recv(2)
    assert len(head) == 2
    body = b""
    while len(body) < head[1]:
        chunk = sock.recv(head[1] - len(body))
        assert chunk
        body += chunk
    return head[0], body.decode()


def channel(daemon):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(daemon.socket + ".fd")  # blocking, as clients connect: waits for the backlog
    s.settimeout(20)
    return s


def daemon_fds(daemon, expect=None):
    """The daemon's open descriptors; with `expect`, waits (bounded) while gRPC's own come and
    go until the count is that."""
    for _ in range(40):
        n = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
        if expect is None or n == expect:
            return n
        time.sleep(0.05)
    return n


def memfd(sealed=True):
    fd = os.memfd_create("attack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    return fd


def trainer_works(daemon, job, user=None):
    env = env_for(daemon, job, 0, 1)
    cmd = [PYTHON, LIFECYCLE, "plain"]
    if user:
        cmd = ["/usr/bin/setpriv", "--reuid=65534", "--regid=0", "--clear-groups"] + cmd
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert '"value": [1.0, 1.0, 1.0, 1.0]' in out.stdout, out.stdout


def test_wrong_requests_get_clear_answers_and_nothing_is_kept(tmp, daemon):
    s = channel(daemon)
    a, b, c = memfd(), memfd(), memfd()
    try:
        assert request(s, b"F", [])[0] == 3         # no descriptor: INVALID_ARGUMENT
        before = daemon_fds(daemon)                 # the connection is accepted by now
        assert request(s, b"X", [a])[0] == 3        # not the request byte
        code, text = request(s, b"F", [a, b, c])   # more than one
        assert code == 3 and "exactly one" in text, text
        assert daemon_fds(daemon, before) == before  # every descriptor sent was closed
        code, token = request(s, b"F", [a])
        assert code == 0 and len(token) == 32 and int(token, 16) >= 0
        assert daemon_fds(daemon, before + 1) == before + 1  # kept until redeemed (or 60 s)
    finally:
        for fd in (a, b, c):
            os.close(fd)
        s.close()
    trainer_works(daemon, "after-wrong")
    assert daemon.ctl("health").returncode == 0


def test_many_idle_connections_do_not_stop_trainers(tmp, daemon):
    held = [channel(daemon) for _ in range(300)]
    try:
        trainer_works(daemon, "idle-conns")
    finally:
        for s in held:
            s.close()
    assert daemon.ctl("health").returncode == 0


def test_one_user_flooding_descriptors_cannot_lock_out_another(tmp, daemon):
    if os.geteuid() != 0 or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("needs root and setpriv to act as another user")
    s = channel(daemon)
    codes = []
    try:
        for _ in range(1100):  # root's share is 1,024 waiting descriptors
            fd = memfd()
            try:
                code, text = request(s, b"F", [fd])
            finally:
                os.close(fd)
            codes.append(code)
            if code != 0:
                break
        assert codes.count(0) == 1024, codes[-3:]
        assert codes[-1] == 8 and "this user" in text, text  # RESOURCE_EXHAUSTED
        # Another user of the socket's group still registers memory and reduces.
        os.chmod(tmp, 0o755)
        trainer_works(daemon, "other-user", user="nobody")
    finally:
        s.close()
    assert daemon.ctl("health").returncode == 0


SESSION_OVER_TCP = r"""
import json, sys
import grpc

def field(number, kind, value):  # protobuf wire format, by hand: no generated code needed
    key = bytes([number << 3 | kind])
    if kind == 0:
        return key + bytes([value])
    return key + bytes([len(value)]) + value

# TrainerRequest{tag: 1, register_session: RegisterRequest{job: "tcp", world_size: 1,
# local_world_size: 1}}: what our client library would send, spoken raw as an attacker would.
register = field(1, 2, b"tcp") + field(2, 0, 1) + field(5, 0, 1)
request = field(1, 0, 1) + field(2, 2, register)
metadata = []
if len(sys.argv) > 2:
    metadata = [("authorization", "Bearer " + open(sys.argv[2]).read().strip())]
channel = grpc.insecure_channel(sys.argv[1])
call = channel.stream_stream("/gradsync.v1.GradSync/Session",
                             request_serializer=lambda b: b, response_deserializer=lambda b: b)
try:
    for reply in call(iter([request]), metadata=metadata, timeout=20):
        print(json.dumps({"outcome": "session", "reply": reply.hex()}))
        break
    print(json.dumps({"outcome": "no reply"}))
except grpc.RpcError as e:
    print(json.dumps({"outcome": e.code().name, "message": e.details()}))
"""


def test_no_session_over_tcp_for_another_user_or_with_the_token(tmp):
    """A user the unix socket refuses tries loopback TCP: no session, so no memory of anyone's
    reachable; with the cluster token (a daemon's credential) it is refused all the same."""
    from conftest import Daemon
    if os.geteuid() != 0 or not os.access("/usr/bin/setpriv", os.X_OK):
        pytest.skip("needs root and setpriv to act as another user")
    d = Daemon(tmp, "tcpnode", tcp=True)
    try:
        env = dict(os.environ, PYTHONPATH=env_for(d, "tcp", 0, 1)["PYTHONPATH"])
        os.chmod(tmp, 0o755)
        runs = {
            "nobody": ["/usr/bin/setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                       PYTHON, "-c", SESSION_OVER_TCP, d.tcp],
            "token": [PYTHON, "-c", SESSION_OVER_TCP, d.tcp, d.token_file],
        }
        for who, cmd in runs.items():
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stdout + out.stderr
            result = __import__("json").loads(out.stdout.strip().splitlines()[-1])
            assert result["outcome"] in ("PERMISSION_DENIED", "UNAUTHENTICATED"), (who, result)
        assert d.ctl("health").returncode == 0
        trainer_works(d, "after-tcp")
    finally:
        d.stop()


def test_a_descriptor_the_daemon_has_no_room_for_is_resource_exhausted(tmp, daemon):
    """A trainer's descriptor arrives while the daemon is out of descriptors (its limit lowered
    to what it holds): the kernel drops it, and the trainer is told
    RESOURCE_EXHAUSTED naming the cause, not that its request was wrong; with room again, the
    same request gets its token."""
    if not os.access("/usr/bin/prlimit", os.X_OK):
        pytest.skip("prlimit (util-linux) is not installed")
    s = channel(daemon)  # accepted while there is room
    request(s, b"F", [])  # a first answer: the connection is the channel's now
    pid = daemon.proc.pid
    soft = subprocess.run(["/usr/bin/prlimit", f"--pid={pid}", "--nofile", "--output=SOFT",
                           "--noheadings"], capture_output=True, text=True,
                          check=True).stdout.strip()
    try:
        # The limit bounds descriptor numbers: at the lowest one free, no new one fits.
        taken = {int(n) for n in os.listdir(f"/proc/{pid}/fd")}
        lowest_free = min(set(range(max(taken) + 2)) - taken)
        subprocess.run(["/usr/bin/prlimit", f"--pid={pid}", f"--nofile={lowest_free}:"],
                       check=True)
        fd = memfd()
        try:
            code, text = request(s, b"F", [fd])
        finally:
            os.close(fd)
        assert code == 8, (code, text)  # RESOURCE_EXHAUSTED
        assert "out of file descriptors" in text, text
    finally:
        subprocess.run(["/usr/bin/prlimit", f"--pid={pid}", f"--nofile={soft}:"], check=True)
    fd = memfd()
    try:
        code, text = request(s, b"F", [fd])
    finally:
        os.close(fd)
    assert code == 0 and len(text) == 32, (code, text)
    s.close()
