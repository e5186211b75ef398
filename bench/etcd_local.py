"""A one-member etcd on loopback for the benchmarks: Debian's etcd-server, started and removed
by them (bench/store_bench.py, bench/formation_bench.py)."""
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

ETCD = "/usr/bin/etcd"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalEtcd:
    """etcd with its data under `parent` (default: the system's temporary directory, on disk:
    etcd syncs every write to it, as in production)."""

    def __init__(self, parent=None):
        if not os.access(ETCD, os.X_OK):
            raise RuntimeError(f"{ETCD} is missing: apt install etcd-server (./setup.sh does)")
        self.dir = tempfile.mkdtemp(prefix="gradsync-etcd-", dir=parent)
        client, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{client}"
        self.log_path = os.path.join(self.dir, "etcd.log")
        self.proc = subprocess.Popen(
            [ETCD, "--name=bench", f"--data-dir={self.dir}/data",
             f"--listen-client-urls=http://{self.endpoint}",
             f"--advertise-client-urls=http://{self.endpoint}",
             f"--listen-peer-urls=http://127.0.0.1:{peer}",
             f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
             f"--initial-cluster=bench=http://127.0.0.1:{peer}"],
            stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1) as r:
                    if b'"health":"true"' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop(keep=True)
        raise RuntimeError(f"etcd did not become healthy; see {self.log_path}")

    def stop(self, keep=False):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if not keep:
            shutil.rmtree(self.dir, ignore_errors=True)
