"""One trainer process of tests/python/test_edge_cases.py: what trainers do that the happy path
does not (empty tensors and parameters, a model the pack plan does not fit, a daemon that stops
answering). Placement from the environment (RANK, WORLD_SIZE, GRADSYNC_SOCKET, ...); results
go to stdout as JSON lines.

    edge_worker.py empty_ops            every collective on operands without elements
    edge_worker.py empty_desync         rank 0 reduces 0 elements, rank 1 one: a desync
    edge_worker.py empty_params PACK    DistributedOptimizer over a model with empty parameters
    edge_worker.py empty_params_cuda P  the same with its parameters in fake CUDA memory
    edge_worker.py empty_hook           DDP (gloo) with gradsync's hook, empty parameters
    edge_worker.py bad_plan             rank 0's pack plan leaves out a parameter
    edge_worker.py frozen DIR           one rank of two, against a daemon the test stops (SIGSTOP)
"""
import array
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def emit(**kv):
    print(json.dumps(kv), flush=True)


def wait_for_file(path, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"{path} never appeared")
        time.sleep(0.02)


def empty_ops():
    """Every op on operands without elements: each one runs on the daemon (its sequence
    number is taken, in order with the ops around it), writes nothing, and the op after it
    gets the right values."""
    import torch

    import gradsync
    gradsync.init()
    r, w = gradsync.get_rank(), gradsync.get_world_size()
    checks = {}
    first = gradsync.client().all_reduce("float32", "sum", [])  # no segment: 0 elements
    first.wait()
    for shape in ((0,), (3, 0), (0, 4, 2)):
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            t = torch.empty(shape, dtype=dtype)
            out = gradsync.all_reduce(t, op="sum")
            checks[f"all_reduce {shape} {dtype}"] = out is t and t.shape == shape
    for op in ("mean", "min", "max"):
        t = torch.empty(0)
        gradsync.all_reduce(t, op=op)
        checks[f"all_reduce {op}"] = t.numel() == 0
    t = torch.empty(0, 5)
    checks["broadcast"] = gradsync.broadcast(t, src=w - 1) is t and t.shape == (0, 5)
    outs = [torch.empty(0) for _ in range(w)]
    got = gradsync.all_gather(outs, torch.empty(0))
    checks["all_gather"] = got is outs and all(o.numel() == 0 for o in outs)
    o = torch.empty(0, 3)
    got = gradsync.reduce_scatter(o, [torch.empty(0, 3) for _ in range(w)], op="max")
    checks["reduce_scatter"] = got is o and o.shape == (0, 3)
    # Asynchronous, and several in flight with non-empty ops between them.
    full = torch.full((4,), float(r + 1))
    works = [gradsync.all_reduce(torch.empty(0), async_op=True, name="e0"),
             gradsync.all_reduce(full, async_op=True, name="full"),
             gradsync.broadcast(torch.empty(0, dtype=torch.int32), src=0, async_op=True),
             gradsync.all_gather([torch.empty(0) for _ in range(w)], torch.empty(0),
                                 async_op=True),
             gradsync.reduce_scatter(torch.empty(0), [torch.empty(0)] * w, async_op=True)]
    for work in reversed(works):
        work.wait()
    checks["async, in order with a full op"] = full.tolist() == [float(sum(range(1, w + 1)))] * 4
    # Buffer-protocol objects without elements.
    checks["bytearray"] = gradsync.all_reduce(bytearray()) == bytearray()
    a = array.array("d")
    gradsync.all_reduce(a, op="max")
    checks["array"] = len(a) == 0
    gradsync.broadcast(memoryview(bytearray()).cast("f"), src=0)
    # gradsync.empty of a shape without elements, and a 0-element view of shared memory.
    e = gradsync.empty((0, 7), dtype=torch.float64)
    checks["gradsync.empty((0, 7))"] = e.shape == (0, 7) and e.dtype == torch.float64
    gradsync.all_reduce(e)
    shm = gradsync.empty(6)
    shm.fill_(float(r))
    gradsync.all_reduce(shm[2:2])
    checks["0-element view of shared memory: nothing written"] = shm.tolist() == [float(r)] * 6
    # Refused as non-empty operands are: a bad op name, a read-only buffer.
    try:
        gradsync.all_reduce(torch.empty(0), op="median")
        checks["bad op on no element refused"] = False
    except gradsync.Error as e:
        checks["bad op on no element refused"] = e.code == "INVALID_ARGUMENT"
    try:
        gradsync.all_reduce(b"")
        checks["read-only empty buffer refused"] = False
    except ValueError as e:
        checks["read-only empty buffer refused"] = "writable" in str(e)
    # Each op above took a sequence number on the daemon, in order: the raw handles' seqs
    # count them (the refused ones took none).
    last = gradsync.client().all_reduce("float32", "sum", [])
    last.wait()
    ops_between = 9 + 3 + 1 + 1 + 1 + 5 + 3 + 1 + 1  # every collective call above
    checks["the daemon ran every empty op"] = last.seq - first.seq == ops_between + 1
    after = torch.full((3,), float(r))
    gradsync.all_reduce(after)
    checks["an op after them"] = after.tolist() == [float(sum(range(w)))] * 3
    gradsync.barrier()
    emit(rank=r, checks=checks, seqs=[first.seq, last.seq])


def empty_desync():
    """Empty and non-empty operands on the same op: the daemon reports a desync on both."""
    import torch

    import gradsync
    gradsync.init()
    r = gradsync.get_rank()
    try:
        gradsync.all_reduce(torch.ones(r), name="uneven", timeout=20)
        emit(rank=r, error=None)
    except gradsync.Error as e:
        emit(rank=r, error=e.code, message=str(e))
    t = torch.ones(2)
    gradsync.all_reduce(t)
    emit(rank=r, after=t.tolist())


class EmptyParamsModel:
    """A model with parameters of 0 elements next to ordinary ones: a pruned input layer
    (Linear(0, 3): weight of shape (3, 0)), an empty bias, and with `table` a (0, 4) embedding
    table (torch 1.13's DDP cannot broadcast that shape at its start: not for the hook test)."""

    def __new__(cls, torch, table=True):
        torch.manual_seed(3)
        with_table = table

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.front = torch.nn.Parameter(torch.empty(0))  # its gradient comes last
                self.dense = torch.nn.Linear(4, 3)
                self.pruned = torch.nn.Linear(0, 3)
                self.empty_bias = torch.nn.Parameter(torch.empty(0))
                self.table = torch.nn.Parameter(torch.empty(0, 4)) if with_table else None
                self.head = torch.nn.Linear(3, 2)

            def forward(self, x):
                h = self.dense(x + self.front.sum()) + self.pruned(x[:, :0]) + self.empty_bias.sum()
                if self.table is not None:
                    h = h + (self.table.t() @ torch.ones(0)).sum()
                return self.head(torch.tanh(h))

        return Model()


def batch(torch, step, n=16):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 4, generator=g), torch.randn(n, 2, generator=g)


def reference(torch, steps, n=16, table=True):
    """One process on the whole batch: the parameters every rank must end with."""
    model = EmptyParamsModel(torch, table)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = batch(torch, step, n)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def empty_params(pack, cuda=False):
    import torch

    import gradsync
    import gradsync.torch as gt
    torch.set_num_threads(1)
    fake = None
    if cuda:
        sys.path.insert(0, HERE)
        import fake_cuda
        fake = fake_cuda.FakeCuda().install()
    gradsync.init()
    r, w = gradsync.get_rank(), gradsync.get_world_size()
    device_ops = {}
    if fake is not None:  # empty operands in device memory: nothing registered, all settled
        regs = fake.stats()["registrations"]
        e = fake.to_device(torch.empty(0, 3))
        device_ops["device_of"] = fake.device_of(e)
        gradsync.all_reduce(e)
        gradsync.broadcast(e, src=1)
        gradsync.all_gather([fake.to_device(torch.empty(0)) for _ in range(w)],
                            fake.to_device(torch.empty(0)))
        gradsync.reduce_scatter(fake.to_device(torch.empty(0)),
                                [fake.to_device(torch.empty(0)) for _ in range(w)])
        device_ops["registrations"] = fake.stats()["registrations"] - regs
        device_ops["settled"] = fake.settled()
        try:
            gradsync.all_gather([torch.empty(0) for _ in range(w)], e[:, :0].reshape(0))
            device_ops["mixed"] = "accepted"
        except TypeError as err:
            device_ops["mixed"] = str(err)
    steps, n = 6, 16
    model = EmptyParamsModel(torch)
    if fake is not None:  # the parameters in fake device memory
        with torch.no_grad():
            for p in model.parameters():
                p.data = fake.to_device(p.data)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  reduce_method="mean", param_pack=bool(int(pack)),
                                  param_pack_thd=64)
    shard = n // w
    shapes_ok = True
    for step in range(steps):
        x, y = batch(torch, step, n)
        x, y = x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        shapes_ok &= all(p.grad is not None and p.grad.shape == p.shape
                         for p in model.parameters())
        opt.step()
    want = reference(torch, steps, n)
    got = [p.detach().cpu().clone() for p in model.parameters()]
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(got, want))
    # The whole model empty: bcast_param's broadcast and the reductions carry no element.
    lone = torch.nn.Parameter(torch.empty(0, 3))
    lone_opt = gt.DistributedOptimizer(torch.optim.SGD([lone], lr=0.1), reduce_method="sum")
    lone_opt.zero_grad()
    (lone.sum() * 2).backward()
    lone_opt.step()
    info = {"stats": fake.stats()} if fake is not None else {}
    emit(rank=r, diff=diff, shapes_ok=bool(shapes_ok), params=[p.tolist() for p in got],
         shapes=[list(p.shape) for p in got], lone=list(lone.grad.shape),
         plan=None if opt.pack_plan is None else [p["indices"] for p in opt.pack_plan["packs"]],
         violations=[] if fake is None else fake.violations, info=info, device_ops=device_ops)


def empty_hook():
    import torch
    import torch.distributed as dist

    import gradsync
    import gradsync.torch as gt
    torch.set_num_threads(1)
    gradsync.init()
    dist.init_process_group("gloo")
    r, w = dist.get_rank(), dist.get_world_size()
    model = EmptyParamsModel(torch, table=False)
    # Tiny buckets (the first one too: torch 1.13 gives it 1 MiB, with no argument to say
    # otherwise): the gradient backward produces last, of 0 elements, is a bucket of its own.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=1e-6)
    sizes = []

    def hook(state, bucket):
        sizes.append(bucket.buffer().numel())
        return gt.allreduce_hook(state, bucket)

    ddp.register_comm_hook(state=None, hook=hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    steps, n = 6, 16
    shard = n // w
    for step in range(steps):
        x, y = batch(torch, step, n)
        x, y = x[r * shard:(r + 1) * shard], y[r * shard:(r + 1) * shard]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    want = reference(torch, steps, n, table=False)
    got = [p.detach().clone() for p in model.parameters()]
    diff = max(float((a - b).abs().max()) if a.numel() else 0.0 for a, b in zip(got, want))
    emit(rank=r, diff=diff, empty_buckets=sizes.count(0), buckets=len(sizes),
         params=[p.tolist() for p in got])
    dist.destroy_process_group()


def bad_plan():
    """Rank 0 stores a pack plan that leaves out its last parameter (as a rank with another
    model would): every rank must get gradsync.Error FAILED_PRECONDITION naming the plan."""
    import torch

    import gradsync
    import gradsync.torch as gt
    torch.set_num_threads(1)
    gradsync.init()
    r = gradsync.get_rank()
    if r == 0:
        from gradsync import _native  # where DistributedOptimizer takes its plan from
        plan_packs = _native.plan_packs

        def short_plan(grads, *args, **kwargs):
            return plan_packs(grads[:-1], *args, **kwargs)

        _native.plan_packs = short_plan
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  reduce_method="mean", param_pack=True, timeout=30)
    outcome = {"rank": r}
    try:
        for step in range(2):
            opt.zero_grad()
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
        outcome["error"] = None
    except Exception as e:  # noqa: BLE001 - the type is what the test checks
        outcome.update(error=type(e).__name__, module=type(e).__module__,
                       is_gradsync_error=isinstance(e, gradsync.Error),
                       code=getattr(e, "code", None), message=str(e))
    emit(**outcome)


def frozen(directory):
    """Rank 0 of a world of 2 (rank 1 never comes) against a daemon the test freezes."""
    import gradsync
    gradsync.init(rpc_timeout=2.0)
    # 1. The daemon is stopped (once "ready" is out) while this op waits: no answer, the client
    #    gives up at the op's deadline plus its margin. The op is submitted before "ready", so
    #    every call it needs is answered before the stop; its deadline (5 s) leaves the test
    #    time to stop the daemon before the daemon could answer it.
    t0 = time.monotonic()
    a = array.array("f", [1.0] * 4)
    work = gradsync.all_reduce(a, timeout=5.0, async_op=True)
    emit(ready=True)
    try:
        work.wait()
        emit(first="ok")
    except gradsync.Error as e:
        emit(first=e.code, message=str(e), took=time.monotonic() - t0)
    wait_for_file(os.path.join(directory, "resumed"))
    # 2. The daemon runs again: the session still works (the daemon's own verdict on a new op
    #    names the missing rank), and its late answer to the first op changes nothing.
    try:
        gradsync.all_reduce(array.array("f", [1.0]), timeout=1.0)
        emit(second="ok")
    except gradsync.Error as e:
        emit(second=e.code, second_message=str(e))
    try:
        work.wait()
        emit(again="ok")
    except gradsync.Error as e:
        emit(again=e.code, again_message=str(e))
    emit(closing=True)
    # 3. Frozen again while the session ends: shutdown() returns once rpc_timeout has passed.
    wait_for_file(os.path.join(directory, "frozen_again"))
    t0 = time.monotonic()
    gradsync.shutdown()
    emit(closed=True, close_took=time.monotonic() - t0)


if __name__ == "__main__":
    scenario, rest = sys.argv[1], sys.argv[2:]
    if scenario == "empty_params_cuda":
        empty_params(rest[0], cuda=True)
    else:
        globals()[scenario](*rest)
