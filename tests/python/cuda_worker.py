"""One trainer rank exercising gradsync's CUDA code paths on the fake CUDA seam
(tests/python/fake_cuda.py) against a real gradsyncd: the package code is the real one, only the
CUDA calls are fake. Prints one JSON line per scenario: {"scenario", "rank", "checks": {name:
bool}, "info": {...}}.

    cuda_worker.py SCENARIO...      (placement from RANK, WORLD_SIZE, GRADSYNC_SOCKET, ...)
"""
import gc
import json
import os
import sys
import threading

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_cuda  # noqa: E402
import gradsync  # noqa: E402
import gradsync.torch as gt  # noqa: E402


def index_of(log, entry, start=0):
    for k in range(start, len(log)):
        if log[k] == entry:
            return k
    return -1


def s_collectives(fake, rank, world):
    checks, info = {}, {}
    t = fake.to_device(torch.full((1000,), float(rank + 1)))
    reg, _ = fake_cuda.registry().locate(t.data_ptr(), 4)
    start = len(fake.log)
    gradsync.all_reduce(t)
    log = fake.log[start:]
    want = float(sum(range(1, world + 1)))
    checks["all_reduce reduced in place"] = bool((t == want).all())
    ready = index_of(log, ("ready", reg.id, "default"))
    submit = index_of(log, ("submit", "all_reduce", (reg.id,)))
    done = index_of(log, ("wait_done", reg.id, "default"))
    checks["ready, then submit, then the stream waits on done"] = 0 <= ready < submit < done
    checks["a synchronous call returns settled"] = fake.settled() == []

    # A hot loop over tensors of one allocation registers it once.
    before = fake.stats()["registrations"]
    xs = [fake.to_device(torch.full((64,), float(k + rank))) for k in range(8)]
    for _ in range(3):
        for x in xs:
            gradsync.all_reduce(x, op="max")
    checks["hot loop: no registration after the first"] = \
        fake.stats()["registrations"] - before <= 1
    checks["hot loop values"] = all(bool((x == k + world - 1).all()) for k, x in enumerate(xs))

    # Async: unsettled until wait(); wait() makes the waiter's current stream wait on done.
    a = fake.to_device(torch.full((10,), float(rank)))
    work = gradsync.all_reduce(a, async_op=True)
    reg_a, _ = fake_cuda.registry().locate(a.data_ptr(), 4)
    checks["async op unsettled before wait"] = reg_a.id in fake.settled()
    with fake.stream("waiter") as s:
        work.wait()
        checks["wait() settles the waiter's stream"] = reg_a.id not in fake.settled(s)
    checks["async value"] = bool((a == float(sum(range(world)))).all())

    # Another stream on the same allocation: it first waits for the previous one.
    with fake.stream("side"):
        start = len(fake.log)
        gradsync.all_reduce(a)
        log = fake.log[start:]
    checks["a new stream joins the previous one before ready"] = \
        0 <= index_of(log, ("join", "side", "default")) < index_of(log, ("ready", reg_a.id, "side"))

    # Non-contiguous: staged in a contiguous temporary, copied back after "done".
    m = fake.to_device(torch.arange(12, dtype=torch.float64).view(3, 4) * (rank + 1)).t()
    gradsync.all_reduce(m)
    want_m = torch.arange(12, dtype=torch.float64).view(3, 4).t() * sum(range(1, world + 1))
    checks["non-contiguous tensor reduced"] = bool(torch.equal(m, want_m))

    # broadcast
    b = fake.to_device(torch.full((7,), float(rank * 10 + 3)))
    gradsync.broadcast(b, src=world - 1)
    checks["broadcast"] = bool((b == float((world - 1) * 10 + 3)).all())

    # all_gather into views of one tensor: no temporary; into separate tensors: staged.
    x = fake.to_device(torch.full((5,), float(rank)))
    out = fake.to_device(torch.full((world * 5,), -1.0))
    views = list(out.split(5))
    empties = len(fake.calls("empty"))
    gradsync.all_gather(views, x)
    checks["all_gather into adjacent views, no temporary"] = \
        len(fake.calls("empty")) == empties
    checks["all_gather values"] = all(bool((v == float(r)).all()) for r, v in enumerate(views))
    outs = [fake.to_device(torch.full((5,), -1.0)) for _ in range(world)]
    for o in outs:  # separate blocks, not back to back: a temporary
        fake.to_device(torch.zeros(3))
    gradsync.all_gather(outs[::-1], x)
    checks["all_gather into separate tensors"] = \
        all(bool((o == float(world - 1 - r)).all()) for r, o in enumerate(outs))
    checks["all_gather settles"] = fake.settled() == []

    # reduce_scatter: inputs as views of one tensor, and as separate tensors.
    inp = fake.to_device(torch.arange(world * 4, dtype=torch.float32) + rank)
    o = fake.to_device(torch.zeros(4))
    gradsync.reduce_scatter(o, list(inp.split(4)))
    base = torch.arange(world * 4, dtype=torch.float32)[rank * 4:(rank + 1) * 4]
    checks["reduce_scatter from views"] = bool(torch.equal(o, base * world + sum(range(world))))
    ins = [fake.to_device(torch.full((4,), float(rank + k))) for k in range(world)]
    gradsync.reduce_scatter(o, ins, op="max")
    checks["reduce_scatter from separate tensors"] = bool((o == float(world - 1 + rank)).all())

    # Host and device operands in one op are refused.
    try:
        gradsync.all_gather([torch.zeros(5) for _ in range(world)], x)
        checks["mixed host and device refused"] = False
    except TypeError as e:
        checks["mixed host and device refused"] = "different devices" in str(e)
    info["stats"] = fake.stats()
    checks["no violation"] = fake.violations == []
    checks["no host read"] = fake.stats()["to_host"] == 0
    return checks, info


def s_realloc(fake, rank, world):
    """An allocation the allocator freed and handed out again is registered anew, and the old
    registration is deregistered: the daemon never writes memory that changed hands."""
    checks = {}
    t = fake.to_device(torch.full((300000,), 1.0))  # its own allocation
    gradsync.all_reduce(t)
    old, _ = fake_cuda.registry().locate(t.data_ptr(), 4)
    alloc = fake.allocation_of(t)
    fake.free(alloc, reuse=True)  # same address, new allocation id
    t.fill_(2.0)
    regs = fake.stats()["registrations"]
    gradsync.all_reduce(t)
    new, _ = fake_cuda.registry().locate(t.data_ptr(), 4)
    checks["registered again"] = fake.stats()["registrations"] == regs + 1 and new.id != old.id
    checks["the old registration was deregistered"] = ("deregister", old.id) in fake.log
    checks["values"] = bool((t == 2.0 * world).all())
    try:  # the daemon no longer knows the old buffer
        gradsync.client().all_reduce("float32", "sum", [(old.id, 0, 1)]).wait()
        checks["old buffer id refused by the daemon"] = False
    except gradsync.Error as e:
        checks["old buffer id refused by the daemon"] = e.code in ("NOT_FOUND", "INVALID_ARGUMENT")
    checks["no violation"] = fake.violations == []
    return checks, {"stats": fake.stats()}


class Bucket:
    """What DDP hands a comm hook (torch.distributed.GradBucket's two methods the hook uses)."""

    def __init__(self, tensor, index):
        self._t, self._i = tensor, index

    def buffer(self):
        return self._t

    def index(self):
        return self._i


def s_hook(fake, rank, world):
    checks = {}
    t = fake.to_device(torch.full((33,), float(rank)))
    with fake.stream("backward"):  # autograd runs the hook on backward's stream
        fut = gt.allreduce_hook(None, Bucket(t, 0))
    n = fake.last_op()
    got = fut.wait()
    checks["hook averaged the bucket"] = bool((got == sum(range(world)) / world).all())
    reg, _ = fake_cuda.registry().locate(t.data_ptr(), 4)
    waits = [e for e in fake.calls("wait_done") if e[1] == reg.id]
    checks["the completer's stream waited on done"] = len(waits) >= 1
    checks["the future completes on backward's stream"] = \
        fake.op_settled(n, fake_cuda.FakeStream("backward")) and \
        all(e[2] == "backward" for e in waits)
    checks["no violation"] = fake.violations == []
    return checks, {}


def s_process_group(fake, rank, world):
    """torch.distributed's backend on CUDA tensors (the c10d calls DDP and FSDP2 make, made on
    the backend itself): stream ordered as torch's NCCL backend is, no host synchronisation."""
    import torch.distributed as dist
    c10d = torch._C._distributed_c10d
    asynchronous = hasattr(c10d, "Backend")  # torch 1.13: each op completes in its call
    checks = {}
    pg = gt.ProcessGroupGradsync(rank, world, gradsync.WORLD, 30.0)
    t = fake.to_device(torch.full((16,), float(rank + 1)))
    reg, _ = fake_cuda.registry().locate(t.data_ptr(), 4)
    opts = c10d.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    start = len(fake.log)
    work = pg.allreduce([t], opts)
    n = fake.last_op()
    log = fake.log[start:]
    checks["ready before the op is submitted"] = \
        0 <= index_of(log, ("ready", reg.id, "default")) < \
        index_of(log, ("submit", "all_reduce", (reg.id,)))
    if asynchronous:
        checks["unsettled before wait"] = reg.id in fake.settled()
        with fake.stream("waiter") as s:
            work.wait()
            checks["wait() makes the waiter's stream wait on done"] = fake.op_settled(n, s)
    else:
        checks["settled on the calling stream when the call returns"] = fake.op_settled(n)
    checks["allreduce AVG value"] = bool((t == (world + 1) / 2).all())
    # DDP's reducer takes the op's future: it completes with the output tensors, on the stream
    # the op was issued from.
    g = fake.to_device(torch.full((8,), float(rank)))
    with fake.stream("backward"):
        work = pg.allreduce([g], c10d.AllreduceOptions())
        n = fake.last_op()
        fut = work.get_future()
    got = fut.wait()
    checks["the future's value is the output tensors"] = \
        len(got) == 1 and bool((got[0] == float(sum(range(world)))).all())
    checks["the future completes on the issuing stream"] = \
        fake.op_settled(n, fake_cuda.FakeStream("backward"))
    # all_gather_into_tensor and reduce_scatter_tensor, as FSDP2 calls them.
    x = fake.to_device(torch.full((4,), float(rank)))
    out = fake.to_device(torch.full((4 * world,), -1.0))
    pg.all_gather_single(out, x, c10d.AllgatherOptions()).wait()
    checks["all_gather_into_tensor"] = bool(torch.equal(
        out, torch.arange(world, dtype=torch.float32).repeat_interleave(4)))
    inp = fake.to_device(torch.arange(4.0 * world) + rank)
    o = fake.to_device(torch.zeros(4))
    ropts = c10d.ReduceScatterOptions()
    ropts.reduceOp = dist.ReduceOp.SUM
    pg.reduce_scatter_single(o, inp, ropts).wait()
    checks["reduce_scatter_tensor"] = bool(torch.equal(
        o, (torch.arange(4.0 * world) * world + sum(range(world)))[rank * 4:(rank + 1) * 4]))
    b = fake.to_device(torch.full((3,), float(rank)))
    bopts = c10d.BroadcastOptions()
    bopts.rootRank = world - 1
    pg.broadcast([b], bopts).wait()
    checks["broadcast"] = bool((b == float(world - 1)).all())
    checks["settled once waited"] = fake.settled() == []
    checks["no violation"] = fake.violations == []
    checks["no host read"] = fake.stats()["to_host"] == 0
    return checks, {}


def s_two_groups(fake, rank, world):
    """Async ops of two groups over tensors of one allocation: each op's "done" is its own, so
    a wait after the other op launched still waits for its op; the same from two threads on two
    streams, for "ready" too."""
    checks = {}
    g2 = gradsync.new_group(list(range(world)))
    t = fake.to_device(torch.zeros(64))
    a, b = t[:32], t[32:]
    a.fill_(rank + 1)
    b.fill_(10.0 * (rank + 1))
    wa = gradsync.all_reduce(a, async_op=True)
    na = fake.last_op()
    wb = gradsync.all_reduce(b, group=g2, async_op=True)
    nb = fake.last_op()
    checks["the two ops name registrations of their own"] = \
        not set(fake.ops[na]["written"]) & set(fake.ops[nb]["written"])
    wb.wait()
    wa.wait()  # after B's "done" was recorded
    checks["A's wait waited for A, not for B through a shared event"] = fake.op_settled(na)
    checks["B's wait waited for B"] = fake.op_settled(nb)
    total = sum(range(1, world + 1))
    checks["values"] = bool((a == total).all()) and bool((b == 10.0 * total).all())

    # Two threads write parts of one allocation on their streams, then each submits an op.
    u = fake.to_device(torch.zeros(64))
    parts, ops, errors = [u[:32], u[32:]], [None, None], []
    go = threading.Barrier(2, timeout=30)

    def member(k):
        try:
            with fake.stream(f"s{k}"):
                parts[k].fill_(float(k + rank))
                go.wait()
                w = gradsync.all_reduce(parts[k], group=gradsync.WORLD if k == 0 else g2,
                                        async_op=True)
                ops[k] = [n for n, op in enumerate(fake.ops)
                          if op["thread"] == threading.current_thread().name][-1]
                go.wait()
                w.wait()
        except Exception as e:  # noqa: BLE001 - reported as a check
            errors.append(repr(e))
    threads = [threading.Thread(target=member, args=(k,), name=f"member{k}") for k in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    checks["both threads done"] = not errors and all(not th.is_alive() for th in threads)
    if checks["both threads done"]:
        w0 = fake.ops[ops[0]]["written"]
        w1 = fake.ops[ops[1]]["written"]
        checks["each thread's op has its own ready and done"] = not set(w0) & set(w1)
        checks["each thread's op was ready on its own stream"] = \
            fake.ops[ops[0]]["ready"] == {b: "s0" for b in w0} and \
            fake.ops[ops[1]]["ready"] == {b: "s1" for b in w1}
        checks["thread values"] = all(bool((parts[k] == float(k * world + sum(range(world))))
                                           .all()) for k in range(2))
    checks["every lease given back"] = getattr(fake_cuda.registry(), "leases", lambda: -1)() == 0
    checks["no violation"] = fake.violations == []
    return checks, {"violations": fake.violations}


def s_temporaries(fake, rank, world):
    """The tensors an async op names live until it completed, whatever the caller keeps:
    torch's NCCL backend's contract (all_gather(outs, t.float(), async_op=True))."""
    checks = {}
    outs = fake.to_device(torch.zeros(world * 5))
    views = list(outs.split(5))
    tmp = fake.to_device(torch.full((5,), float(rank)))  # what t.float() hands the call
    work = gradsync.all_gather(views, tmp, async_op=True)
    del tmp
    gc.collect()
    checks["a temporary input outlives its op"] = fake.violations == []
    work.wait()
    checks["values"] = all(bool((v == float(r)).all()) for r, v in enumerate(views))

    # Waited on another stream than the one it was allocated on: marked used there.
    tmp = fake.to_device(torch.full((5,), float(rank + 1)))
    work = gradsync.all_gather(views, tmp, async_op=True)
    del tmp
    with fake.stream("other"):
        work.wait()
    del work
    gc.collect()
    checks["released after a wait on another stream, marked used there"] = \
        fake.violations == [] and ("record_stream", "other") in fake.log

    # A Work dropped unwaited: its op's tensors and leases are kept until it settles.
    x = fake.to_device(torch.full((7,), 1.0))
    work = gradsync.all_reduce(x, async_op=True)
    del work, x
    gc.collect()
    checks["an unwaited op's tensor outlives it"] = fake.violations == []
    y = fake.to_device(torch.full((3,), 1.0))
    gradsync.all_reduce(y)  # the next op settles the orphan
    gc.collect()
    checks["the orphan settled at the next op"] = getattr(fake_cuda.registry(), "leases", lambda: -1)() == 0
    checks["no violation"] = fake.violations == []
    return checks, {"violations": fake.violations}


def s_lifetime_detector(fake, rank, world):
    """The fake's lifetime check is not vacuous: a Run that keeps nothing is caught."""
    from gradsync import _device
    checks = {}
    segment = _device.Run.segment

    def forgetful(self, tensor, count, written):
        out = segment(self, tensor, count, written)
        self.keep = [k for k in self.keep if k is not tensor]
        return out
    _device.Run.segment = forgetful
    try:
        outs = fake.to_device(torch.zeros(world * 5))
        tmp = fake.to_device(torch.full((5,), float(rank)))
        work = gradsync.all_gather(list(outs.split(5)), tmp, async_op=True)
        del tmp
        gc.collect()
        work.wait()
    finally:
        _device.Run.segment = segment
    checks["a temporary freed while its op runs is a violation"] = \
        any("was freed before" in v for v in fake.violations)
    return checks, {}


class Net(torch.nn.Module):
    def __init__(self, unused):
        super().__init__()
        torch.manual_seed(3)
        self.a = torch.nn.Linear(5, 6)
        self.b = torch.nn.Linear(6, 2)
        self.unused = torch.nn.Linear(2, 2) if unused else None

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def s_optimizer(fake, rank, world, pack=False, unused=False):
    checks, info = {}, {}
    model = Net(unused)
    for p in model.parameters():
        p.data = fake.to_device(p.data)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  reduce_method="mean", param_pack=pack, param_pack_thd=64,
                                  bcast_period=2)
    regs_after = []
    settled, grads_same, host_reads = True, True, []
    for step in range(4):
        g = torch.Generator().manual_seed(step * 10 + rank)
        x, y = torch.randn(8, 5, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad(set_to_none=True)
        reads = fake.stats()["to_host"]
        torch.nn.functional.mse_loss(model(x), y).backward()
        host_reads.append(fake.stats()["to_host"] - reads)
        settled = settled and fake.settled() == []
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        # Every gradient is a view into fake device memory the daemon mapped (no copy).
        grads_same = grads_same and all(fake.device_of(gr) == 0 for gr in grads)
        info.setdefault("grad_sums", []).append([float(gr.sum()) for gr in grads])
        opt.step()
        regs_after.append(fake.stats()["registrations"])
    checks["backward returns settled on the current stream"] = settled
    checks["gradients live in device memory the daemon mapped"] = grads_same
    # The buckets are registered once (a new layout with param_pack, once).
    checks["no registration after the second step"] = regs_after[1] == regs_after[-1]
    if unused:
        checks["unused parameter: grad None"] = model.unused.weight.grad is None
        checks["unused parameters cost one host read per backward"] = host_reads == [1] * 4
    else:
        checks["no host read with every parameter used"] = host_reads == [0] * 4
    checks["no violation"] = fake.violations == []
    info["params"] = [p.detach().reshape(-1).tolist() for p in model.parameters()]
    info["stats"] = fake.stats()
    return checks, info


def s_detector(fake, rank, world):
    """The fake's checks are not vacuous: a package that skipped "ready" or "done" is caught."""
    from gradsync import _device
    checks = {}
    t = fake.to_device(torch.ones(16))
    ready, wait_done = _device.Registry.ready, _device.Run._wait_done
    _device.Registry.ready = lambda self, regs, stream: None
    try:
        gradsync.all_reduce(t)
    finally:
        _device.Registry.ready = ready
    checks["an op without ready is a violation"] = \
        any("without \"ready\"" in v for v in fake.violations)
    _device.Run._wait_done = lambda self: None
    try:
        gradsync.all_reduce(t)
    finally:
        _device.Run._wait_done = wait_done
    reg, _ = fake_cuda.registry().locate(t.data_ptr(), 4)
    checks["a call returning without waiting on done is unsettled"] = fake.settled() == [reg.id]
    try:
        torch.cuda.synchronize()
        checks["a host synchronisation is caught"] = False
    except RuntimeError:
        checks["a host synchronisation is caught"] = any("host synchronisation" in v
                                                         for v in fake.violations)
    return checks, {}


def s_empty_cache(fake, rank, world):
    """torch.cuda.empty_cache first lets go of the registrations nobody pins (the daemon must not
    map memory the allocator frees); the optimizer's buckets stay registered and keep working."""
    checks = {}
    model = Net(False)
    for p in model.parameters():
        p.data = fake.to_device(p.data)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  reduce_method="mean")
    big = fake.to_device(torch.full((300000,), float(rank)))  # an allocation of its own
    gradsync.all_reduce(big)
    user, _ = fake_cuda.registry().locate(big.data_ptr(), 4)
    bucket = opt._layout.registrations()[0]
    torch.cuda.empty_cache()
    checks["empty_cache deregistered the unpinned allocation"] = ("deregister", user.id) in fake.log
    checks["the optimizer's bucket stayed registered"] = ("deregister", bucket.id) not in fake.log
    gradsync.all_reduce(big)
    checks["the allocation registers again on its next use"] = \
        fake_cuda.registry().locate(big.data_ptr(), 4)[0].id != user.id
    checks["values"] = bool((big == float(sum(range(world)) * world)).all())
    x, y = torch.randn(4, 5), torch.randn(4, 2)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x + rank), y).backward()
    checks["backward still reduces into the bucket"] = fake.settled() == [] and \
        all(fake.device_of(p.grad) == 0 for p in model.parameters())
    opt.step()
    checks["no violation"] = fake.violations == []
    return checks, {"grad_sums": [float(p.grad.sum()) for p in model.parameters()]}


SCENARIOS = {
    "empty_cache": s_empty_cache,
    "detector": s_detector,
    "collectives": s_collectives,
    "realloc": s_realloc,
    "hook": s_hook,
    "process_group": s_process_group,
    "two_groups": s_two_groups,
    "temporaries": s_temporaries,
    "lifetime_detector": s_lifetime_detector,
    "optimizer": s_optimizer,
    "optimizer_pack": lambda f, r, w: s_optimizer(f, r, w, pack=True),
    "optimizer_unused": lambda f, r, w: s_optimizer(f, r, w, unused=True),
}


def main():
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    job = os.environ["GRADSYNC_JOB"]
    for name in sys.argv[1:]:
        with fake_cuda.FakeCuda() as fake:
            gradsync.init(job=f"{job}-{name}")
            try:
                checks, info = SCENARIOS[name](fake, rank, world)
            finally:
                gradsync.shutdown()
        print(json.dumps({"scenario": name, "rank": rank, "checks": checks, "info": info}),
              flush=True)


if __name__ == "__main__":
    main()
