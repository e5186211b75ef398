"""The Python package on a real GPU, with the machine's own Python and torch (tests/gpu/run.sh
runs it; no pytest needed). Each test runs in its own process under a timeout, against one
gradsyncd this script starts:

  cuda_tensors          CUDA tensors through the daemon: out-of-place all_gather and
                        reduce_scatter whose inputs are written after a long kernel and whose
                        outputs are read right after the call (values right only if the daemon
                        waited for "ready" and the stream for "done"), in-place all_reduce,
                        broadcast, a non-contiguous tensor, async ops; a hot loop that
                        registers nothing and, under torch.cuda.set_sync_debug_mode("error"),
                        never synchronises the host; torch.cuda.empty_cache in between.
  optimizer_one_rank    DistributedOptimizer on CUDA parameters with one rank that still
                        reduces through the daemon (_reduce_alone), param_pack and bcast_period
                        on, matches a plain optimizer; gradients are views into the registered
                        bucket; backward() never synchronises the host.
  ddp_hook_one_rank     torch DDP (NCCL, one rank) with gradsync.torch.allreduce_hook on CUDA
                        buckets matches a plain model.
  backend_ddp_one_rank  torch DDP on torch.distributed's backend "gradsync" (one rank, CUDA
                        parameters) matches a plain model, its buckets reduced through the
                        daemon; dist.all_reduce's Work.wait() and get_future() on CUDA.
  two_jobs_one_gpu      two one-rank jobs on one GPU through one daemon at once.
  two_groups_one_alloc  async all_gathers on two groups over tensors of one allocation, from
                        two streams, the first input written after a long kernel and waited
                        on after the second completed: each output exact (a shared "done"
                        event would let the first be read before the daemon wrote it).
  reregister_1000       1,000 rounds of allocate, op, free and empty_cache (the allocator hands
                        the same address out again): every op right, none refused.

    test_python_gpu.py [--daemon PATH] [TEST...]
Prints "PASS name", "FAIL name: why" or "SKIP name: why" per test. Exit 0: all passed; 77: no
usable GPU here (every test skipped, with the reason); 1: something failed.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD_TIMEOUT_S = 60  # a hung test leaves time for the others within run.sh's 150 s


def skip_reason():
    try:
        import torch
    except ImportError as e:
        return f"no torch here ({e})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


# ---- the tests (each in a child process) ----
def _init(job):
    import gradsync
    gradsync.init(job=job, rank=0, world_size=1, local_rank=0, local_world_size=1,
                  socket=os.environ["GRADSYNC_SOCKET"])
    return gradsync


def _count_submits():
    """Counts the ops the package submits (a spy on the C ABI call)."""
    from gradsync import _native
    counter = {"n": 0}
    submit = _native.Client._submit

    def spy(client, fn, *args):
        counter["n"] += 1
        return submit(client, fn, *args)
    _native.Client._submit = spy
    return counter


def t_cuda_tensors(job="pygpu-tensors", rounds=1):
    import torch
    gradsync = _init(job)
    checks = {}
    n = 1 << 20
    for k in range(rounds):
        x = torch.zeros(n, device="cuda")
        out = torch.full((n,), -1.0, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the input is written
        x.fill_(3.0 + k)
        gradsync.all_gather([out], x)
        out.add_(1.0)  # queued right after the call: must see the daemon's write
        checks[f"all_gather waited for ready and done ({k})"] = bool((out == 4.0 + k).all())
        y = torch.zeros(n, device="cuda")
        torch.cuda._sleep(200_000_000)
        x.fill_(5.0 + k)
        gradsync.reduce_scatter(y, [x], op="sum")
        y.mul_(2.0)
        checks[f"reduce_scatter waited for ready and done ({k})"] = bool((y == 10.0 + 2 * k).all())
    a = torch.arange(1000, device="cuda", dtype=torch.float32)
    gradsync.all_reduce(a, op="mean")
    checks["all_reduce mean, one rank"] = bool(torch.equal(a, torch.arange(1000, device="cuda",
                                                                             dtype=torch.float32)))
    b = torch.full((77,), 2.5, device="cuda", dtype=torch.float64)
    gradsync.broadcast(b, src=0)
    checks["broadcast"] = bool((b == 2.5).all())
    m = torch.arange(12, device="cuda", dtype=torch.float32).view(3, 4).t()
    gradsync.all_reduce(m, op="max")
    checks["non-contiguous"] = bool(torch.equal(m, torch.arange(12, device="cuda",
                                                                dtype=torch.float32).view(3, 4).t()))
    w = gradsync.all_reduce(a, op="sum", async_op=True)
    w.wait()
    checks["async all_reduce"] = bool(a[999].item() == 999.0)
    # The hot loop: tensors of one allocation, no registration, no host synchronisation.
    pool = torch.zeros(64, 1024, device="cuda")
    outs = torch.zeros(64, 1024, device="cuda")
    gradsync.all_gather([outs[0]], pool[0])  # registers the allocations (cold)
    regs = gradsync._ctx().device.registrations
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(1, 64):
            pool[i].fill_(float(i))
            gradsync.all_gather([outs[i]], pool[i])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    checks["hot loop registers nothing"] = gradsync._ctx().device.registrations == regs
    checks["hot loop values"] = bool(torch.equal(outs[1:, 0].cpu(), torch.arange(1, 64).float()))
    # empty_cache: the daemon lets go of the cached allocations before torch frees them.
    big = torch.ones(8 << 20, device="cuda")  # 32 MiB, an allocation of its own
    gradsync.all_reduce(big, op="max")
    del big
    torch.cuda.empty_cache()
    again = torch.full((8 << 20,), 2.0, device="cuda")
    out2 = torch.zeros_like(again)
    gradsync.all_gather([out2], again)
    checks["after empty_cache, allocations register again and work"] = bool((out2 == 2.0).all())
    gradsync.shutdown()
    return checks


class _Net:
    @staticmethod
    def make(seed):
        import torch
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                   torch.nn.Linear(64, 8)).cuda()


def _data(step):
    import torch
    g = torch.Generator(device="cuda").manual_seed(100 + step)
    return (torch.randn(16, 32, device="cuda", generator=g),
            torch.randn(16, 8, device="cuda", generator=g))


def t_optimizer_one_rank():
    import torch
    gradsync = _init("pygpu-opt")
    import gradsync.torch as gt
    counter = _count_submits()
    plain, ours = _Net.make(1), _Net.make(1)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9)
    opt = gt.DistributedOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9),
                                  reduce_method="mean", param_pack=True, param_pack_thd=4096,
                                  bcast_period=2, _reduce_alone=True)
    checks = {}
    views = True
    for step in range(8):
        x, y = _data(step)
        for model, o in ((plain, plain_opt), (ours, opt)):
            o.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if model is ours and step >= 2:  # past the first registrations and the pack plan
                torch.cuda.set_sync_debug_mode("error")
            try:
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            if model is ours:
                views = views and all(p.grad.data_ptr() == opt._layout.ptrs[i]
                                      for i, p in enumerate(opt._params))
            o.step()
    diff = max(float((a - b).abs().max()) for a, b in zip(plain.parameters(), ours.parameters()))
    checks[f"matches the plain optimizer (max diff {diff:.2e})"] = diff <= 1e-6
    checks[f"reductions went through the daemon ({counter['n']} ops)"] = counter["n"] >= 8
    checks["gradients are views into the registered bucket"] = views
    checks["a pack plan was made"] = opt.pack_plan is not None
    gradsync.shutdown()
    return checks


def _train_beside_plain(plain, ddp, model, steps=5):
    """`steps` SGD steps of a plain model and of a DDP one on the same data: the largest
    difference of their parameters (`model`: the module the DDP wraps)."""
    import torch
    opts = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (plain, ddp)]
    for step in range(steps):
        x, y = _data(step)
        for m, o in zip((plain, ddp), opts):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    return max(float((a - b).abs().max()) for a, b in zip(plain.parameters(), model.parameters()))


def t_ddp_hook_one_rank():
    import torch
    import torch.distributed as dist
    gradsync = _init("pygpu-ddp")
    import gradsync.torch as gt
    counter = _count_submits()
    store = os.path.join(os.environ["GRADSYNC_TMP"], "ddp-store")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    plain, model = _Net.make(2), _Net.make(2)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.01)
    ddp.register_comm_hook(None, gt.allreduce_hook)
    diff = _train_beside_plain(plain, ddp, model)
    dist.destroy_process_group()
    gradsync.shutdown()
    return {f"matches the plain model (max diff {diff:.2e})": diff <= 1e-6,
            f"the hook reduced through the daemon ({counter['n']} ops)": counter["n"] >= 5}


def t_backend_ddp_one_rank():
    import torch
    import torch.distributed as dist
    gradsync = _init("pygpu-backend")
    import gradsync.torch  # noqa: F401 - registers the backend
    counter = _count_submits()
    store = os.path.join(os.environ["GRADSYNC_TMP"], "backend-store")
    dist.init_process_group("gradsync", init_method=f"file://{store}", rank=0, world_size=1)
    plain, model = _Net.make(3), _Net.make(3)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0], bucket_cap_mb=0.01)
    diff = _train_beside_plain(plain, ddp, model)
    ops = counter["n"]
    # A long kernel writes the input; the op must start after it, the reads after the op.
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)
    t.fill_(3.0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    waited = bool((t == 3.0).all())
    u = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)
    u.fill_(5.0)
    got = dist.all_reduce(u, op=dist.ReduceOp.MAX, async_op=True).get_future().wait()
    future = len(got) == 1 and bool((got[0] == 5.0).all())
    dist.destroy_process_group()
    gradsync.shutdown()
    return {f"matches the plain model (max diff {diff:.2e})": diff <= 1e-6,
            f"DDP's buckets went through the daemon ({ops} ops)": ops >= 5,
            "Work.wait() orders the stream after the op": waited,
            "the future's value is the output, after the op": future}


def t_two_jobs_one_gpu():
    """Two children, each a one-rank job, at once on one GPU through one daemon."""
    procs = [subprocess.Popen([sys.executable, __file__, "--child", "cuda_tensors_job",
                               "--job", f"pygpu-two-{k}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for k in range(2)]
    checks = {}
    for k, p in enumerate(procs):
        try:
            out, _ = p.communicate(timeout=CHILD_TIMEOUT_S - 10)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {f"job {k} finished in time": False}
        lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        got = lines[-1]["checks"] if lines else {}
        checks[f"job {k} exit 0"] = p.returncode == 0
        checks[f"job {k} checks ({len(got)})"] = bool(got) and all(got.values())
        if not (got and all(got.values())):
            print(out[-2000:])
    return checks


def t_two_groups_one_allocation(rounds=20):
    import torch
    gradsync = _init("pygpu-two-groups")
    other = gradsync.new_group([0])  # a second group of the one rank: its own daemon stream
    n = 1 << 20
    whole = torch.zeros(4 * n, device="cuda")  # one allocation holds all four tensors
    in_a, out_a, in_b, out_b = whole.view(4, n)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    exact = 0
    for k in range(rounds):
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            torch.cuda._sleep(100_000_000)  # ~50 ms before A's input is written
            in_a.fill_(1.0 + k)
            out_a.fill_(-1.0)
            work_a = gradsync.all_gather([out_a], in_a, async_op=True)
        with torch.cuda.stream(s2):
            in_b.fill_(-2.0 - k)
            out_b.fill_(-1.0)
            gradsync.all_gather([out_b], in_b, group=other)  # B completes first
            ok_b = bool((out_b == -2.0 - k).all())
        with torch.cuda.stream(s1):
            work_a.wait()
            ok_a = bool((out_a == 1.0 + k).all())
        exact += ok_a and ok_b
    gradsync.shutdown()
    return {f"both outputs exact in every round ({exact}/{rounds})": exact == rounds}


def t_reregister_1000(rounds=1000):
    import torch
    gradsync = _init("pygpu-reregister")
    errors, wrong, addresses = [], 0, set()
    start = time.monotonic()
    for k in range(rounds):
        if time.monotonic() - start > CHILD_TIMEOUT_S - 15:
            break
        x = torch.full((4096,), float(k), device="cuda")
        addresses.add(x.data_ptr())
        try:
            gradsync.all_reduce(x, op="max")
            wrong += not bool((x == float(k)).all())
        except gradsync.Error as e:
            errors.append(str(e))
        del x
        torch.cuda.empty_cache()  # the allocation goes back to CUDA; the next one may reuse it
    done = k + 1
    gradsync.shutdown()
    return {f"{done} rounds of {rounds} in time": done == rounds,
            f"no op refused ({len(errors)}: {errors[:1]})": not errors,
            f"every value right ({wrong} wrong)": wrong == 0,
            f"addresses reused ({len(addresses)} distinct)": len(addresses) < done}


TESTS = {"cuda_tensors": t_cuda_tensors, "optimizer_one_rank": t_optimizer_one_rank,
         "ddp_hook_one_rank": t_ddp_hook_one_rank, "backend_ddp_one_rank": t_backend_ddp_one_rank,
         "two_jobs_one_gpu": t_two_jobs_one_gpu,
         "two_groups_one_alloc": t_two_groups_one_allocation,
         "reregister_1000": t_reregister_1000}


# ---- the parent ----
def start_daemon(path, tmp):
    sock = os.path.join(tmp, "d.sock")
    log = open(os.path.join(tmp, "gradsyncd.log"), "w")
    # run.sh gives the daemon its libraries here, never to this Python (torch keeps its own).
    env = dict(os.environ)
    if os.environ.get("GRADSYNC_DAEMON_LD_LIBRARY_PATH"):
        env["LD_LIBRARY_PATH"] = os.environ["GRADSYNC_DAEMON_LD_LIBRARY_PATH"]
    proc = subprocess.Popen([path, f"--socket={sock}", "--port=-1", "--log_sink=stderr",
                             "--log_level=warning", "--op_timeout=30s"], stderr=log, env=env)
    deadline = time.monotonic() + 20
    while not (os.path.exists(sock) and os.path.exists(sock + ".fd")):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"gradsyncd did not start: {open(log.name).read()[-1500:]}")
        time.sleep(0.05)
    return proc, sock


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--daemon", default=os.environ.get("GRADSYNC_DAEMON_PATH", ""))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--job", default="pygpu-tensors", help=argparse.SUPPRESS)
    ap.add_argument("tests", nargs="*")
    args = ap.parse_args()
    if args.child:
        fn = (lambda: t_cuda_tensors(args.job, rounds=3)) if args.child == "cuda_tensors_job" \
            else TESTS[args.child]
        checks = fn()
        print(json.dumps({"checks": checks}), flush=True)
        sys.exit(0 if checks and all(checks.values()) else 1)
    names = args.tests or list(TESTS)
    why = skip_reason()
    if why:
        for name in names:
            print(f"SKIP {name}: {why}")
        sys.exit(77)
    if not os.access(args.daemon, os.X_OK):
        sys.exit(print(f"FAIL setup: no gradsyncd at '{args.daemon}' (--daemon)") or 1)
    tmp = tempfile.mkdtemp(prefix="gradsync-pygpu-")
    daemon, sock = start_daemon(args.daemon, tmp)
    env = dict(os.environ, GRADSYNC_SOCKET=sock, GRADSYNC_TMP=tmp)
    failed = 0
    try:
        for name in names:
            start = time.monotonic()
            try:
                p = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                                   capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
                lines = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
                checks = lines[-1]["checks"] if lines else {}
                bad = [k for k, ok in checks.items() if not ok]
                ok = p.returncode == 0 and checks and not bad
                why = "" if ok else (f"exit {p.returncode}; failed checks {bad}"
                                     if checks else f"exit {p.returncode}")
                detail = p.stdout[-3000:] + p.stderr[-3000:]
            except subprocess.TimeoutExpired as e:
                ok, why, detail = False, f"timed out after {CHILD_TIMEOUT_S} s", str(e)
            took = time.monotonic() - start
            if ok:
                print(f"PASS {name} ({took:.1f} s): {len(checks)} checks: {', '.join(checks)}")
            else:
                failed += 1
                print(f"FAIL {name} ({took:.1f} s): {why}\n{detail}")
            sys.stdout.flush()
    finally:
        daemon.terminate()
        try:
            daemon.wait(10)
        except subprocess.TimeoutExpired:
            daemon.kill()
        log = open(os.path.join(tmp, "gradsyncd.log")).read()
        if failed and log:
            print("--- gradsyncd log (tail) ---\n" + log[-3000:])
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
