"""The package loads and runs collectives in every CPython 3.9+ on the machine from one build
(pure Python over libgradsync_c.so), without torch, from the build tree and installed from the
wheel into a fresh venv. Real gradsyncd, real trainer processes."""
import glob
import os
import subprocess
import sys

import pytest

from conftest import BUILD, env_for

SCRIPT = r"""
import array, json, sys
import gradsync
gradsync.init()
r = gradsync.get_rank()
a = array.array("f", [float(r + 1)] * 5)
gradsync.all_reduce(a)
m = memoryview(bytearray(8)).cast("q")
m[0] = 10 * (r + 1)
gradsync.all_reduce(m, op="max")
print(json.dumps({"rank": r, "sum": list(a), "max": m[0], "python": sys.version_info[:2],
                  "torch": "torch" in sys.modules, "file": gradsync.__file__}))
"""


def interpreters():
    """Every CPython 3.9+ here: pyenv's, and Debian's /usr/bin/python3."""
    found = {}
    for path in sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3"))) + [
            "/usr/bin/python3"]:
        if not os.access(path, os.X_OK):
            continue
        out = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
        version = out.stdout.strip()
        if out.returncode == 0 and tuple(map(int, version.split("."))) >= (3, 9):
            found.setdefault(version, path)
    return found


PYTHONS = interpreters()


def run_two_ranks(tmp, daemon, python, job, pythonpath=True):
    procs = []
    for r in range(2):
        env = env_for(daemon, job, r, 2)
        if not pythonpath:
            del env["PYTHONPATH"]
        procs.append(subprocess.Popen([python, "-c", SCRIPT], env=env, cwd=tmp,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{python}: a rank did not finish in 120 s")
        assert p.returncode == 0, f"{python}:\n{text}"
        outs.append(__import__("json").loads(text.strip().splitlines()[-1]))
    return outs


@pytest.mark.parametrize("version", sorted(PYTHONS) or ["none"])
def test_every_python_all_reduces_an_array_through_the_daemon(tmp, daemon, version):
    if version == "none":
        pytest.skip("no CPython 3.9+ found")
    outs = run_two_ranks(tmp, daemon, PYTHONS[version], "py" + version.replace(".", ""))
    for out in outs:
        assert out["sum"] == [3.0] * 5 and out["max"] == 20
        assert "%d.%d" % tuple(out["python"]) == version
        assert out["torch"] is False  # the core never imports torch


def test_the_wheel_installs_into_a_fresh_venv(tmp, daemon):
    wheels = glob.glob(os.path.join(BUILD, "python", "dist", "gradsync-*.whl"))
    assert len(wheels) == 1, f"build the wheel first: {wheels}"
    candidates = [v for v in sorted(PYTHONS) if v != "%d.%d" % sys.version_info[:2]]
    venv_python = None
    for version in candidates + sorted(PYTHONS):
        venv = os.path.join(tmp, "venv" + version)
        made = subprocess.run([PYTHONS[version], "-m", "venv", venv], capture_output=True,
                              text=True, timeout=180)
        if made.returncode == 0 and os.path.exists(os.path.join(venv, "bin", "pip")):
            venv_python = os.path.join(venv, "bin", "python")
            break
    if venv_python is None:
        pytest.skip("no interpreter here can make a venv with pip")
    pip = subprocess.run([venv_python, "-m", "pip", "install", "--no-index", "--no-deps",
                          wheels[0]], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    outs = run_two_ranks(tmp, daemon, venv_python, "venv", pythonpath=False)
    for out in outs:
        assert out["sum"] == [3.0] * 5 and out["max"] == 20
        assert out["file"].startswith(os.path.dirname(os.path.dirname(venv_python)))
