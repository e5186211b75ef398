"""One trainer process of a Python test scenario (tests/python). Placement comes from the
environment (RANK, WORLD_SIZE, GRADSYNC_SOCKET, ...); results go to stdout as JSON lines.

    worker.py collectives        every collective on tensors, checked against expected values
    worker.py bcast PERIOD N     rank 1 diverges on purpose; per step: are the params equal?
    worker.py plan RELEASE       trains with param_pack, prints rank 0's plan, waits for RELEASE
    worker.py order              rank 1 runs its branches in the other order (a desync)
    worker.py state              state_dict round trip
    worker.py ddp_hook OUT       torch DDP (gloo) with gradsync's comm hook; final params to OUT
"""
import json
import os
import sys
import time

import torch

import gradsync
import gradsync.torch as gt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "client", "python", "examples"))
import train  # noqa: E402  the example trainer's model and data


def emit(**kv):
    print(json.dumps(kv), flush=True)


def collectives():
    gradsync.init()
    r, w = gradsync.get_rank(), gradsync.get_world_size()
    checks = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64):
        t = (torch.arange(7) * (r + 1)).to(dtype)
        gradsync.all_reduce(t, op="sum")
        checks[f"sum_{dtype}"] = t.tolist() == (torch.arange(7) * sum(range(1, w + 1))).to(
            dtype).tolist()
    for op, fn in (("min", min), ("max", max)):
        t = torch.full((5,), float(r + 3))
        gradsync.all_reduce(t, op=op)
        checks[op] = t.tolist() == [float(fn(range(3, w + 3)))] * 5
    t = torch.full((4,), float(r))
    gradsync.all_reduce(t, op="mean")
    checks["mean"] = t.tolist() == [sum(range(w)) / w] * 4
    # Shared-memory tensors (no staging), several async ops in flight, waited out of order.
    shm = [gradsync.empty((3, 5)) for _ in range(4)]
    works = []
    for k, s in enumerate(shm):
        s.fill_(float(r + k))
        works.append(gradsync.all_reduce(s, async_op=True, name=f"a{k}"))
    for work in reversed(works):
        work.wait()
    checks["async_shm"] = all(
        s.eq(float(sum(range(w)) + w * k)).all().item() for k, s in enumerate(shm))
    b = torch.full((6,), float(r))
    gradsync.broadcast(b, src=w - 1)
    checks["broadcast"] = b.tolist() == [float(w - 1)] * 6
    out = [torch.zeros(3) for _ in range(w)]
    gradsync.all_gather(out, torch.full((3,), float(r)))
    checks["all_gather"] = [o.tolist() for o in out] == [[float(q)] * 3 for q in range(w)]
    o = torch.zeros(2)
    gradsync.reduce_scatter(o, [torch.full((2,), float(q + 10 * r)) for q in range(w)])
    checks["reduce_scatter"] = o.tolist() == [float(w * r + 10 * sum(range(w)))] * 2
    # A group of the even ranks; the others do not take part.
    evens = gradsync.new_group(range(0, w, 2))
    if r % 2 == 0:
        t = torch.ones(3)
        gradsync.all_reduce(t, group=evens)
        checks["group"] = t.tolist() == [float(evens.size)] * 3
    gradsync.barrier()
    # Waits release the GIL: while rank 0 waits for a rank that comes 0.5 s late, another
    # Python thread of rank 0 keeps running.
    import threading
    ticks, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1

    if r == 0:
        th = threading.Thread(target=spin)
        th.start()
        time.sleep(0.05)
        before = ticks[0]
        gradsync.all_reduce(torch.ones(2), name="late")
        during = ticks[0] - before
        stop.set()
        th.join()
        checks["gil_released"] = during > 10000
    else:
        time.sleep(0.5)
        gradsync.all_reduce(torch.ones(2), name="late")
    # Bad input: a clear error, nothing changed, the next op still works.
    t = torch.ones(3)
    try:
        gradsync.all_reduce(t, op="median")
        checks["bad_op"] = False
    except gradsync.Error as e:
        checks["bad_op"] = e.code == "INVALID_ARGUMENT" and t.tolist() == [1.0] * 3
    try:
        gradsync.new_group([0, w + 5])
        checks["bad_group"] = False
    except ValueError:
        checks["bad_group"] = True
    t = torch.ones(2 + r)  # counts differ between ranks: a desync, reported on every rank
    try:
        gradsync.all_reduce(t, name="mismatch", timeout=20)
        checks["desync"] = False
    except gradsync.Error as e:
        checks["desync"] = e.code == "FAILED_PRECONDITION" and "desync" in str(e)
    t = torch.ones(4)
    gradsync.all_reduce(t)
    checks["after_errors"] = t.tolist() == [float(w)] * 4
    emit(rank=r, checks=checks)


def params_equal_across_ranks(model):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    w = gradsync.get_world_size()
    out = [torch.zeros_like(flat) for _ in range(w)]
    gradsync.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out[1:])


def bcast(period, steps):
    gradsync.init()
    r = gradsync.get_rank()
    dims = [8, 16, 4]
    model = train.build_model(dims, seed=1 + r)  # different initial weights on every rank
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  reduce_method="mean", bcast_period=period)
    equal = [params_equal_across_ranks(model)]  # after construction
    for step in range(steps):
        if r == 1:  # diverge on purpose before every step
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.25)
        x, y = train.batch(step, 8, dims, seed=1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        equal.append(params_equal_across_ranks(model))
    emit(rank=r, equal=equal)


def plan(release):
    gradsync.init()
    r = gradsync.get_rank()
    dims = [16, 32, 32, 32, 4]
    model = train.build_model(dims, seed=1)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  reduce_method="mean", param_pack=True, param_pack_thd=4096,
                                  param_pack_first_alone=1)
    for step in range(3):
        x, y = train.batch(step, 8, dims, seed=1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    emit(rank=r, plan=opt.pack_plan)
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    gradsync.barrier()


def order():
    gradsync.init()
    r = gradsync.get_rank()
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    params = list(a.parameters()) + list(b.parameters())
    opt = gt.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), reduce_method="sum",
                                  timeout=30)
    x = torch.randn(2, 4)
    # Autograd runs the branch built last first: the ranks' gradients arrive in other orders.
    out = (a(x) + b(x)) if r == 0 else (b(x) + a(x))
    t0 = time.monotonic()
    where = "backward"  # the reductions end with backward: their errors surface there
    try:
        out.sum().backward()
        where = "step"
        opt.step()
        emit(rank=r, error=None)
    except gradsync.Error as e:
        emit(rank=r, error=e.code, message=str(e), took=time.monotonic() - t0, where=where)


def accumulate(out):
    """Each step: two micro-batches under no_sync, then one more; compared with one process."""
    gradsync.init()
    r, w = gradsync.get_rank(), gradsync.get_world_size()
    dims = [32, 64, 64, 8]
    model = train.build_model(dims, seed=1)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  reduce_method="mean", param_pack=True, param_pack_thd=4096)
    shard = 48 // w
    for step in range(10):
        x, y = train.batch(step, 48, dims, seed=1)
        x, y = x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]
        micro = shard // 3
        opt.zero_grad()
        with opt.no_sync():
            for k in range(2):
                xs, ys = x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]
                (torch.nn.functional.mse_loss(model(xs), ys) / 3).backward()
        (torch.nn.functional.mse_loss(model(x[2 * micro:]), y[2 * micro:]) / 3).backward()
        opt.step()
    torch.save([p.detach().clone() for p in model.parameters()], out)
    emit(rank=r, done=True)


def state():
    gradsync.init()
    r = gradsync.get_rank()
    dims = [8, 16, 4]
    model = train.build_model(dims, seed=1)
    opt = gt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01),
                                  reduce_method="mean", param_pack=True, param_pack_thd=256)
    for step in range(2):
        x, y = train.batch(step, 8, dims, seed=1)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    sd = opt.state_dict()
    inner = opt.optimizer.state_dict()
    fresh = torch.optim.Adam(model.parameters(), lr=0.5)
    fresh.load_state_dict(sd)
    opt2 = gt.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.5),
                                   reduce_method="mean", bcast_period=-1)
    opt2.load_state_dict(sd)
    same = all(torch.equal(opt2.state[p]["exp_avg"], opt.state[p]["exp_avg"])
               for p in model.parameters())
    emit(rank=r, keys=sorted(sd.keys()), group_keys=sorted(sd["param_groups"][0].keys()),
         equal_inner=str(sd) == str(inner), restored=same,
         lr=opt2.param_groups[0]["lr"], fresh_lr=fresh.param_groups[0]["lr"])


def ddp_hook(out):
    import torch.distributed as dist
    gradsync.init()
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    dims = [32, 64, 64, 8]
    model = train.build_model(dims, seed=1)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.01)
    calls = []  # (step, bucket index, elements)
    step = 0

    def counting_hook(state, bucket):
        calls.append((step, bucket.index(), bucket.buffer().numel()))
        return gt.allreduce_hook(state, bucket)

    ddp.register_comm_hook(state=None, hook=counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    shard = 64 // w
    for step in range(30):
        x, y = train.batch(step, 64, dims, seed=1)
        x, y = x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    torch.save([p.detach().clone() for p in model.parameters()], out)
    # Elements reduced per step (torch 2 buckets the first step differently: it rebuilds its
    # buckets after it).
    per_step = [sum(n for s, _, n in calls if s == k) for k in range(30)]
    emit(rank=r, done=True, hook_calls=len(calls), buckets=len({b for _, b, _ in calls}),
         per_step=per_step, params=sum(p.numel() for p in model.parameters()))
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario, rest = sys.argv[1], sys.argv[2:]
    if scenario == "bcast":
        bcast(int(rest[0]), int(rest[1]))
    elif scenario in ("plan", "ddp_hook", "accumulate"):
        globals()[scenario](rest[0])
    else:
        globals()[scenario]()
