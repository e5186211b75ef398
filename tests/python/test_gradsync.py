"""The gradsync Python package against real daemons and real trainer processes."""
import os
import re

import pytest
import torch

from conftest import BUILD, EXAMPLE, WORKER, PYTHON, launch, max_diff


def example(tmp, name, *flags):
    return [EXAMPLE, "--out", os.path.join(tmp, name), *flags]


def single(tmp, *flags):
    """The example trainer as one process on the whole batch."""
    import subprocess
    out = os.path.join(tmp, "single.pt")
    subprocess.run([PYTHON, EXAMPLE, "--mode", "single", "--out", out, *flags], check=True,
                   capture_output=True, timeout=120)
    return torch.load(out)


def ddp(tmp, world, port, *flags):
    import subprocess
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [PYTHON, EXAMPLE, "--mode", "ddp", "--out", os.path.join(tmp, f"ddp{r}.pt"), *flags],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    return [torch.load(os.path.join(tmp, f"ddp{r}.pt")) for r in range(world)]


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_collectives_on_tensors(tmp, daemon):
    ranks = launch(tmp, [daemon] * 4, "coll", lambda r: [WORKER, "collectives"])
    for res in ranks.wait():
        checks = res["json"][-1]["checks"]
        assert checks and all(checks.values()), checks


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_mean_matches_one_process_and_ddp(tmp, daemon, world):
    flags = ["--steps", "20", "--batch", "32"]
    want = single(tmp, *flags)
    ranks = launch(tmp, [daemon] * world, f"eq{world}",
                   lambda r: example(tmp, f"gs{r}.pt", *flags))
    ranks.wait()
    ddp_params = ddp(tmp, world, free_port(), *flags)
    for r in range(world):
        got = torch.load(os.path.join(tmp, f"gs{r}.pt"))
        assert max_diff(got, want) <= 1e-5
        assert max_diff(got, ddp_params[r]) <= 1e-5


def test_param_pack_on_and_off_give_the_same_parameters(tmp, daemon):
    flags = ["--steps", "15", "--batch", "32", "--reduce_method", "sum"]
    runs = {}
    for pack in (False, True):
        extra = ["--param_pack", "--param_pack_thd", "2048"] if pack else []
        name = "pack" if pack else "nopack"
        ranks = launch(tmp, [daemon] * 2, f"pk-{name}",
                       lambda r: example(tmp, f"{name}{r}.pt", *flags, *extra))
        results = ranks.wait()
        if pack:
            assert results[0]["json"][-1]["packs"] > 1  # several packs, not one
        runs[name] = [torch.load(os.path.join(tmp, f"{name}{r}.pt")) for r in range(2)]
    for r in range(2):
        assert max_diff(runs["pack"][r], runs["nopack"][r]) <= 1e-6
    assert max_diff(runs["pack"][0], single(tmp, *flags)) <= 1e-5


@pytest.mark.parametrize("period,expect", [
    (3, [True, False, False, True, False, False, True]),
    (0, [True, False, False, False, False, False, False]),
    (-1, [False, False, False, False, False, False, False]),
])
def test_bcast_period_resynchronises_at_its_steps_only(tmp, daemon, period, expect):
    ranks = launch(tmp, [daemon] * 2, f"bc{period + 1}",
                   lambda r: [WORKER, "bcast", str(period), "6"])
    for res in ranks.wait():
        assert res["json"][-1]["equal"] == expect


def test_pack_plan_in_the_store_equals_rank0s(tmp, daemon):
    release = os.path.join(tmp, "release")
    ranks = launch(tmp, [daemon] * 2, "plan", lambda r: [WORKER, "plan", release])
    try:
        import time
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and '"plan"' not in ranks.output(0):
            time.sleep(0.05)
        import json
        plan = next(json.loads(l) for l in ranks.output(0).splitlines()
                    if l.startswith("{"))["plan"]
        shown = daemon.ctl("--job=plan", "packlist", "show", "world")
        assert shown.returncode == 0, shown.stderr
        rows = [l.split() for l in shown.stdout.splitlines()[2:] if l.strip()]
        assert [(row[1], [int(i) for i in row[-1].split(",")]) for row in rows] == \
            [(p["dtype"], p["indices"]) for p in plan["packs"]]
        assert len(plan["packs"]) > 2 and len(plan["packs"][0]["indices"]) == 1  # first alone
        assert plan["first_alone"] == 1
        assert f"packs={len(plan['packs'])}" in shown.stdout
    finally:
        open(release, "w").close()
    results = ranks.wait()
    assert results[1]["json"][-1]["plan"] == plan  # fetched, not recomputed


def test_gradient_order_differs_is_a_desync_not_a_hang(tmp, daemon):
    ranks = launch(tmp, [daemon] * 2, "order", lambda r: [WORKER, "order"])
    for res in ranks.wait(timeout=90):
        out = res["json"][-1]
        assert out["error"] == "FAILED_PRECONDITION", out
        assert out["where"] == "backward", out  # raised by backward(), as DDP does
        assert "desync" in out["message"] and re.search(r"grad\d", out["message"]), out
        assert out["took"] < 25  # reported at once, well before the op's 30 s deadline


def test_no_sync_accumulates_micro_batches_like_one_process(tmp, daemon):
    ranks = launch(tmp, [daemon] * 2, "acc",
                   lambda r: [WORKER, "accumulate", os.path.join(tmp, f"acc{r}.pt")])
    ranks.wait()
    # One process, whole batch of 48 per step, the same model and optimizer.
    want = single(tmp, "--steps", "10", "--batch", "48", "--warmup", "0")
    for r in range(2):
        assert max_diff(torch.load(os.path.join(tmp, f"acc{r}.pt")), want) <= 1e-5


def test_state_dict_round_trips_the_wrapped_optimizer_only(tmp, daemon):
    ranks = launch(tmp, [daemon] * 2, "state", lambda r: [WORKER, "state"])
    for res in ranks.wait():
        out = res["json"][-1]
        assert out["keys"] == ["param_groups", "state"]
        assert "dist_group" not in out["group_keys"] and "pack_list" not in out["group_keys"]
        assert out["equal_inner"] and out["restored"]
        assert out["lr"] == 0.01 and out["fresh_lr"] == 0.01


def test_ddp_comm_hook_sends_buckets_through_gradsync(tmp, daemon):
    port = free_port()
    ranks = launch(tmp, [daemon] * 2, "ddph",
                   lambda r: [WORKER, "ddp_hook", os.path.join(tmp, f"hook{r}.pt")],
                   extra_env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    results = ranks.wait()
    for res in results:
        out = res["json"][-1]
        # Every gradient of every step went through the hook.
        assert out["done"] and out["hook_calls"] >= 30
        assert out["per_step"] == [out["params"]] * 30
    want = single(tmp, "--steps", "30", "--batch", "64")
    for r in range(2):
        assert max_diff(torch.load(os.path.join(tmp, f"hook{r}.pt")), want) <= 1e-5


def test_two_daemons_two_ranks_each_match_one_process(tmp, two_daemons):
    flags = ["--steps", "15", "--batch", "32", "--param_pack", "--param_pack_thd", "4096"]
    want = single(tmp, *flags)
    d0, d1 = two_daemons
    ranks = launch(tmp, [d0, d0, d1, d1], "nodes2",
                   lambda r: example(tmp, f"n{r}.pt", *flags), local=2, root=d0.tcp)
    ranks.wait()
    for r in range(4):
        assert max_diff(torch.load(os.path.join(tmp, f"n{r}.pt")), want) <= 1e-5


def torchrun(tmp, daemon, nnodes, node_rank, port, out, flags, root=None):
    import subprocess
    env = dict(os.environ, GRADSYNC_SOCKET=daemon.socket, GRADSYNC_JOB="trun",
               PYTHONPATH=os.path.join(BUILD, "python"),
               OMP_NUM_THREADS="1")
    if root:
        env["GRADSYNC_ROOT_ADDRESS"] = root
    env.pop("RANK", None)
    # --redirects 1 --tee 1: Debian's torchrun 1.13 cannot parse its default "0" on Python 3.11.
    cmd = [PYTHON, "-m", "torch.distributed.run", f"--nnodes={nnodes}", "--nproc_per_node=2",
           "--redirects", "1", "--tee", "1", "--log_dir", os.path.join(tmp, f"tr{node_rank}")]
    if nnodes == 1:
        cmd += ["--standalone"]
    else:
        cmd += [f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
    return subprocess.Popen(cmd + [EXAMPLE, "--out", out, *flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_torchrun_one_node_and_across_two_daemons(tmp, two_daemons):
    flags = ["--steps", "10", "--batch", "32", "--param_pack"]
    want = single(tmp, *flags)
    d0, d1 = two_daemons
    # One node: torchrun's environment is all gradsync.init() needs.
    p = torchrun(tmp, d0, 1, 0, 0, os.path.join(tmp, "one{rank}.pt"), flags)
    out, _ = p.communicate(timeout=180)
    assert p.returncode == 0, out[-3000:]
    for r in range(2):
        assert max_diff(torch.load(os.path.join(tmp, f"one{r}.pt")), want) <= 1e-5
    # Two "nodes": one torchrun per daemon, ranks 0,1 on d0 and 2,3 on d1.
    port = free_port()
    procs = [torchrun(tmp, d, 2, n, port, os.path.join(tmp, "two{rank}.pt"), flags, root=d0.tcp)
             for n, d in enumerate(two_daemons)]
    for p in procs:
        out, _ = p.communicate(timeout=180)
        assert p.returncode == 0, out[-3000:]
    for r in range(4):
        assert max_diff(torch.load(os.path.join(tmp, f"two{r}.pt")), want) <= 1e-5


def test_two_tls_daemons_two_ranks_each_match_one_process(tmp, monkeypatch):
    """Daemons with mutual TLS; trainers reach the root's store (pack plans) over TLS too."""
    import shutil
    import subprocess
    from conftest import ROOT, Daemon
    if shutil.which("openssl") is None:
        pytest.skip("openssl makes the test certificates")
    pki = os.path.join(tmp, "pki")
    os.makedirs(pki)
    subprocess.run(["bash", os.path.join(ROOT, "tests", "make_test_certs.sh")], cwd=pki,
                   check=True, capture_output=True, timeout=120)
    pem = lambda name, ext: os.path.join(pki, f"{name}.{ext}")  # noqa: E731
    ds = [Daemon(tmp, f"tls{i}", tcp=True,
                 flags=[f"--tls_cert={pem(f'node{i}', 'pem')}",
                        f"--tls_key={pem(f'node{i}', 'key')}", f"--tls_ca={pem('ca', 'pem')}"])
          for i in range(2)]
    try:
        flags = ["--steps", "8", "--batch", "32", "--param_pack", "--param_pack_thd", "4096"]
        want = single(tmp, *flags)
        env = {"GRADSYNC_TOKEN_FILE": ds[0].token_file, "GRADSYNC_TLS_CERT": pem("trainer", "pem"),
               "GRADSYNC_TLS_KEY": pem("trainer", "key"), "GRADSYNC_TLS_CA": pem("ca", "pem")}
        ranks = launch(tmp, [ds[0], ds[0], ds[1], ds[1]], "tls2",
                       lambda r: example(tmp, f"t{r}.pt", *flags), local=2, root=ds[0].tcp,
                       extra_env=env)
        ranks.wait()
        for r in range(4):
            assert max_diff(torch.load(os.path.join(tmp, f"t{r}.pt")), want) <= 1e-5
    finally:
        for d in ds:
            d.stop()
