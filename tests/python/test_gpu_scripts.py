"""The GPU stage's Python scripts on a machine without a GPU: the Python GPU tests and the torch
benchmark refuse with their reason (so the GPU tests skip here, never pass), and the results
table is what run.sh prints last. On a machine with a GPU the tests run for real."""
import json
import shutil
import os
import subprocess
import sys

import pytest

from conftest import BUILD, PYTHON, ROOT

GPU_TESTS = os.path.join(ROOT, "tests", "gpu", "test_python_gpu.py")
BENCH = os.path.join(ROOT, "bench", "torch_gpu_allreduce.py")
RESULTS = os.path.join(ROOT, "tests", "gpu", "results.py")


def _env():
    return dict(os.environ, PYTHONPATH=os.path.join(BUILD, "python"),
                GRADSYNC_DAEMON_PATH=os.path.join(BUILD, "daemon", "gradsyncd"))


def test_python_gpu_tests_run_on_a_gpu_and_skip_without_one():
    p = subprocess.run([PYTHON, GPU_TESTS], env=_env(), capture_output=True, text=True,
                       timeout=600)
    if p.returncode == 0:
        # A GPU is here: every test ran and passed.
        assert p.stdout.count("PASS ") == 7 and "FAIL " not in p.stdout, p.stdout
        return
    assert p.returncode == 77, p.stdout + p.stderr
    lines = p.stdout.splitlines()
    for name in ("cuda_tensors", "optimizer_one_rank", "ddp_hook_one_rank", "backend_ddp_one_rank",
                 "two_jobs_one_gpu"):
        assert any(line.startswith(f"SKIP {name}: ") for line in lines), p.stdout
    assert not any(line.startswith("PASS") for line in lines)
    pytest.skip(f"no GPU here: {lines[0].split(': ', 1)[1]}")


def test_torch_benchmark_refuses_without_a_gpu():
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: tests/gpu/run.sh runs the benchmark")
    p = subprocess.run([PYTHON, BENCH, "--socket", "/nonexistent.sock"], env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 77, p.stdout + p.stderr
    assert "sees no CUDA device" in p.stdout


def test_results_table_joins_both_benchmarks_and_marks_the_goals(tmp_path):
    cpp = {"device": "NVIDIA H200", "cuda_runtime": 13000, "cuda_driver": 13000,
           "nccl": 22703, "complete": True,
           "results": [{"mode": "mean", "bytes": 4096, "iters": 20, "direct_us": 10.0,
                        "gradsync_us": 30.0, "ratio": 3.0, "overhead_us": 20.0},
                       {"mode": "mean", "bytes": 64 << 20, "iters": 20, "direct_us": 100.0,
                        "gradsync_us": 102.0, "ratio": 1.02, "overhead_us": 2.0}]}
    tor = {"device": "NVIDIA H200", "torch": "2.11.0", "torch_cuda": "13.0",
           "torch_nccl": "2.27.3", "python": "3.12.3", "complete": False,
           "skipped_sizes": [1 << 30],
           "results": [{"bytes": 4096, "iters": 20, "torch_us": 20.0, "gradsync_us": 31.0,
                        "ratio": 1.55, "overhead_us": 11.0}]}
    (tmp_path / "c.json").write_text(json.dumps(cpp))
    (tmp_path / "t.json").write_text(json.dumps(tor))
    out, copy = tmp_path / "results.json", tmp_path / "bench" / "results-gpu.json"
    p = subprocess.run([sys.executable, RESULTS, "--out", str(out), "--cpp",
                        str(tmp_path / "c.json"), "--torch", str(tmp_path / "t.json"),
                        "--driver", "580.65", "--copy", str(copy)],
                       capture_output=True, text=True, timeout=60, check=True)
    lines = p.stdout.splitlines()
    assert "NVIDIA H200, driver 580.65, CUDA runtime 13.0, NCCL 2.27.3; torch 2.11.0" in lines[0]
    rows = [line for line in lines if line.startswith(("daemon", "gradsync"))]
    assert len(rows) == 3
    assert rows[0].endswith("MISSED (>15us)") and rows[1].endswith("ok (<=3%)")
    assert rows[2].startswith("gradsync.all_reduce vs torch.distributed") and \
        rows[2].endswith("ok (<=15us)")
    assert any("partial" in line and str(1 << 30) in line for line in lines)
    saved = json.loads(out.read_text())
    assert saved == json.loads(copy.read_text())
    assert saved["machine"]["driver"] == "580.65" and len(saved["rows"]) == 3


RUN_SH = os.path.join(ROOT, "tests", "gpu", "run.sh")
SANDBOX_SH = os.path.join(ROOT, "tests", "gpu", "sandbox.sh")


def _bare_env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRADSYNC_") and k != "LD_LIBRARY_PATH"}
    env.update(extra)
    return env


def test_run_sh_without_the_bundle_says_how_to_bring_it(tmp_path):
    # run.sh in a tree of its own (no build-gpu-bundle/, no build dir given): it stops at once.
    tree = tmp_path / "tree"
    shutil.copytree(os.path.join(ROOT, "tests", "gpu"), tree / "tests" / "gpu")
    p = subprocess.run([str(tree / "tests" / "gpu" / "run.sh")], capture_output=True, text=True,
                       env=_bare_env(OUT=str(tmp_path / "out")), timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "build-gpu-bundle/ did not come along" in p.stdout
    assert "tests/gpu/bundle.sh" in p.stdout and "carry" in p.stdout
    assert "did not come along" in (tmp_path / "out" / "summary.txt").read_text()
    assert not (tree / "build-gpu").exists()  # nothing built


@pytest.mark.parametrize("kernel,dmesg,kind", [
    ("Linux 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016 x86_64", "", "gvisor"),
    ("Linux 6.8.0-1015-gcp #17-Ubuntu SMP x86_64", "sandbox: gVisor", "gvisor"),
    ("Linux 6.8.0-1015-gcp #17-Ubuntu SMP x86_64", "", "vm"),
    ("Linux 4.4.02 #1 SMP x86_64", "", "vm"),
    ("Linux 5.15.0-105-generic #115-Ubuntu SMP x86_64", "sandbox: firecracker", "vm"),
])
def test_sandbox_detection_on_fake_probe_lines(kernel, dmesg, kind):
    p = subprocess.run(["bash", "-c", f'. "{SANDBOX_SH}"; gpu_sandbox "$1" "$2"; '
                        'gpu_sandbox_limits "$(gpu_sandbox "$1" "$2")"', "x", kernel, dmesg],
                       capture_output=True, text=True, timeout=30, check=True)
    lines = p.stdout.splitlines()
    assert lines[0] == kind
    if kind == "gvisor":
        assert any(line.startswith("MPS: ") for line in lines[1:])
        assert any(line.startswith("MIG: ") for line in lines[1:])
    else:
        assert lines[1:] == []


def test_run_sh_gives_the_library_path_to_binaries_never_to_python(tmp_path):
    # Stub binaries and a stub python3 that record the LD_LIBRARY_PATH they were started with.
    stubs, rec = tmp_path / "bin", tmp_path / "rec"
    stubs.mkdir()
    rec.mkdir()
    record = f'echo "$(basename "$0") ${{LD_LIBRARY_PATH-unset}}" >>"{rec}/env"\n'
    first = "OneRankNcclOpsThroughTheDaemonWriteTheirOutputsInStreamOrder"
    scripts = {
        "gradsync_gpu_tests": '#!/bin/sh\n' + record +
        'name=${1#--gtest_filter=GpuTest.}\necho "[ RUN      ] GpuTest.$name"\n'
        'echo "[       OK ] GpuTest.$name (1 ms)"\n',
        "gradsyncd": '#!/bin/sh\n' + record + 'exec sleep 30\n',
        "gpu_bench": '#!/bin/sh\n' + record,
        "gradsyncctl": '#!/bin/sh\n' + record,
        "gpu_worker": '#!/bin/sh\n',
        "python3": '#!/bin/sh\n' + record,
    }
    for name, text in scripts.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = _bare_env(OUT=str(tmp_path / "out"), GRADSYNC_GPU_BIN_DIR=str(stubs),
                    GRADSYNC_GPU_BUDGET_S="90", GRADSYNC_GPU_STAGE_S="10",
                    PATH=f"{stubs}:{os.environ['PATH']}")
    p = subprocess.run([RUN_SH], capture_output=True, text=True, env=env, timeout=180)
    assert f"GpuTest.{first}: passed" in p.stdout, p.stdout + p.stderr
    seen = [line.split(" ", 1) for line in (rec / "env").read_text().splitlines()]
    pythons = [v for name, v in seen if name == "python3"]
    binaries = [v for name, v in seen if name in ("gradsync_gpu_tests", "gradsyncd", "gpu_bench")]
    assert len(pythons) >= 3 and set(pythons) == {"unset"}, seen  # the probe, benches, tests
    assert binaries and all("/usr/local/cuda/lib64" in v for v in binaries), seen
    assert {"gradsync_gpu_tests", "gradsyncd", "gpu_bench"} <= {name for name, _ in seen}
