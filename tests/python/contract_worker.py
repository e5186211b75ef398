"""Training loops written against torch DDP's contract, run three ways (tests/python/
test_ddp_contract.py): through gradsync.torch.DistributedOptimizer, through torch DDP over gloo,
and as one process on the whole batch. Every scenario trains a small float64 MLP a few steps;
the final parameters and what the loop read along the way (gradient norms) must agree.

    contract_worker.py gs PACK SCENARIO...    one rank of gradsync (placement from RANK etc.)
    contract_worker.py gsdev PACK SCENARIO... the same with the parameters in fake CUDA memory
                                              (fake_cuda.py): the package's GPU code paths
    contract_worker.py ddp SCENARIO...        one rank of torch DDP (gloo, MASTER_ADDR/PORT)

Each scenario prints one JSON line {"scenario", "rank", "params", "trace"} (gsdev adds "fake":
what the fake CUDA seam saw); run() also serves the single-process reference (imported by the
test).
"""
import gc
import json
import os
import sys

import torch

DTYPE = torch.float64
DIMS = (6, 8, 8, 3)
BATCH = 24       # global batch; 2 and 4 ranks split it evenly, and so do 2 or 3 micro-batches
STEPS = 4
LR = 0.05


class Net(torch.nn.Module):
    """An MLP; `odd` adds a layer used twice, a layer forward never uses, and a branch used
    only for the samples that carry a marker (so only on some ranks, and in some steps none)."""

    def __init__(self, seed, odd=False):
        super().__init__()
        torch.manual_seed(seed)
        self.odd = odd
        self.l1 = torch.nn.Linear(DIMS[0], DIMS[1])
        self.l2 = torch.nn.Linear(DIMS[1], DIMS[2])
        self.out = torch.nn.Linear(DIMS[2], DIMS[3])
        if odd:
            self.branch = torch.nn.Linear(DIMS[0], DIMS[3], bias=False)
            self.unused = torch.nn.Linear(DIMS[2], DIMS[2])
        self.to(DTYPE)

    def forward(self, x):
        extra = None
        if self.odd:
            # First in forward, so last in backward: a rank that does not use it submits its
            # reduction (among the unused, in parameter order) where the others do.
            idx = (x[:, 0] != 0).nonzero().view(-1)
            if idx.numel():  # the branch's parameters get a gradient only here
                extra = self.branch(x[idx])
        h = torch.tanh(self.l1(x))
        h = torch.tanh(self.l2(h))
        if self.odd:
            h = torch.tanh(self.l2(h))  # the same parameters a second time
        y = self.out(h)
        if extra is not None:
            y = y + torch.zeros_like(y).index_add(0, idx, extra)
        return y


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, DIMS[0], generator=g, dtype=DTYPE)
    y = torch.randn(BATCH, DIMS[-1], generator=g, dtype=DTYPE)
    x[:, 0] = 0
    if step % 3 == 0:
        x[1, 0] = 1.0           # a sample of rank 0's shard
    elif step % 3 == 1:
        x[2, 0] = 1.0           # rank 0's and the last rank's
        x[BATCH - 1, 0] = -1.0
    return x, y                 # step % 3 == 2: no rank uses the branch


# Each scenario: (model options, optimizer factory, the loop). `ctx` hides the three ways.
def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def sgd_wd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=0.1)


def adam_groups(model):
    return torch.optim.Adam([
        {"params": list(model.l1.parameters()) + list(model.out.parameters())},
        {"params": model.l2.parameters(), "lr": 0.003, "betas": (0.8, 0.95)},
    ], lr=0.01)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.01)


def grad_norm(model):
    return float(torch.sqrt(sum((p.grad ** 2).sum() for p in model.parameters()
                                if p.grad is not None)))


class Ctx:
    """The pieces a scenario needs, for one of the three ways."""

    def __init__(self, mode, rank, world, pack, reduce_method, bcast_period, job):
        self.mode, self.rank, self.world, self.pack = mode, rank, world, pack
        self.reduce_method, self.bcast_period, self.job = reduce_method, bcast_period, job
        self.trace = []
        self.fake = None  # the fake CUDA seam (gsdev), installed by main()

    def build(self, make_opt, odd=False, seed=1, again=False):
        # gradsync: every rank starts from other weights; the broadcast at construction (or
        # the state_dict round trip) must make them rank 0's.
        self.model = Net(seed + (self.rank if self.mode == "gs" else 0), odd)
        if self.fake is not None:  # the parameters live in (fake) CUDA memory
            for p in self.model.parameters():
                p.data = self.fake.to_device(p.data)
        self.net = self.model
        opt = make_opt(self.model)
        if self.mode == "gs":
            import gradsync
            import gradsync.torch as gt
            # A second optimizer in one job gets its own group name, so its own pack plan.
            group = gradsync.new_group(range(self.world)) if again else gradsync.WORLD
            opt = gt.DistributedOptimizer(opt, reduce_method=self.reduce_method,
                                          dist_group=group, param_pack=self.pack,
                                          param_pack_thd=256, bcast_period=self.bcast_period,
                                          timeout=60)
        elif self.mode == "ddp":
            self.net = torch.nn.parallel.DistributedDataParallel(
                self.model, find_unused_parameters=odd, bucket_cap_mb=0.001)
        self.opt = opt
        return opt

    def shard(self, x, parts=1):
        """This rank's shard of a global batch, cut into `parts` micro-batches."""
        n = BATCH // self.world
        x = x[self.rank * n:(self.rank + 1) * n]
        m = n // parts
        return [x[k * m:(k + 1) * m] for k in range(parts)]

    def loss(self, xs, ys):
        """Loss of a micro-batch, scaled so that the reduced gradients are the whole batch's."""
        scale = len(xs) / (BATCH // self.world)
        if self.mode == "gs" and self.reduce_method == "sum":
            scale /= self.world
        return torch.nn.functional.mse_loss(self.net(xs), ys) * scale

    def no_sync(self):
        import contextlib
        if self.mode == "gs":
            return self.opt.no_sync()
        if self.mode == "ddp":
            return self.net.no_sync()
        return contextlib.nullcontext()


def plain_steps(c):
    """STEPS steps of the ordinary loop: zero_grad, backward on this rank's shard, step."""
    for step in range(STEPS):
        x, y = batch(step)
        c.opt.zero_grad()
        c.loss(c.shard(x)[0], c.shard(y)[0]).backward()
        c.opt.step()


def s_plain(c):
    c.build(sgd)
    plain_steps(c)


def s_clip(c):
    c.build(sgd)
    for step in range(STEPS):
        x, y = batch(step)
        c.opt.zero_grad()
        c.loss(c.shard(x)[0], c.shard(y)[0]).backward()
        total = torch.nn.utils.clip_grad_norm_(c.model.parameters(), max_norm=0.05)
        c.trace.append(float(total))
        c.opt.step()


def s_read(c):
    """Reads the gradients after backward: their norm sets this step's learning rate."""
    c.build(sgd)
    for step in range(STEPS):
        x, y = batch(step)
        c.opt.zero_grad()
        c.loss(c.shard(x)[0], c.shard(y)[0]).backward()
        norm = grad_norm(c.model)
        c.trace.append(norm)
        c.trace.append(float(c.model.l1.weight.grad[0, 0]))
        for g in c.opt.param_groups:
            g["lr"] = LR / (1 + norm)
        c.opt.step()


def accumulate(c, syncs):
    """One backward per micro-batch before each step; syncs[k] False: under no_sync()."""
    import contextlib
    c.build(sgd)
    for step in range(STEPS):
        x, y = batch(step)
        xs, ys = c.shard(x, len(syncs)), c.shard(y, len(syncs))
        c.opt.zero_grad()
        for k, sync in enumerate(syncs):
            with (contextlib.nullcontext() if sync else c.no_sync()):
                c.loss(xs[k], ys[k]).backward()
            if c.mode != "single":  # what this rank reads after each backward
                c.trace.append(grad_norm(c.model))
        c.opt.step()


def s_accum(c):
    accumulate(c, [True, True])


def s_accum_nosync(c):
    accumulate(c, [False, True])


def s_accum_mixed(c):
    accumulate(c, [True, False, True])


def s_odd(c, zero, make_opt=sgd_wd):
    """Unused, twice-used and sometimes-used parameters, and a zero_grad flavour."""
    c.build(make_opt, odd=True)
    for step in range(STEPS):
        x, y = batch(step)
        if zero == "model_none":
            c.model.zero_grad(set_to_none=True)
        else:
            c.opt.zero_grad(set_to_none=(zero == "opt_none"))
        c.loss(c.shard(x)[0], c.shard(y)[0]).backward()
        c.trace.append([p.grad is None for p in c.model.parameters()])
        c.opt.step()


def s_odd_zero(c):
    s_odd(c, "opt")


def s_odd_opt_none(c):
    s_odd(c, "opt_none")


def s_odd_model_none(c):
    s_odd(c, "model_none", adam)


def s_adam_groups(c):
    c.build(adam_groups)
    plain_steps(c)


def s_state_dict(c):
    """Two steps, a state_dict round trip into a fresh model and optimizer, two more steps."""
    opt = c.build(adam)
    for step in range(STEPS):
        if step == STEPS // 2:
            params, state = c.model.state_dict(), opt.state_dict()
            c.build(adam, seed=7, again=True)  # other weights: the round trip restores them
            c.model.load_state_dict(params)
            c.opt.load_state_dict(state)
        x, y = batch(step)
        c.opt.zero_grad()
        c.loss(c.shard(x)[0], c.shard(y)[0]).backward()
        c.opt.step()


SCENARIOS = {name[2:]: fn for name, fn in globals().items() if name.startswith("s_")}
# Options per scenario (gradsync only): reduce_method, bcast_period.
OPTIONS = {"accum_sum": ("sum", 0), "bcast": ("mean", 2)}
SCENARIOS["accum_sum"] = s_accum
SCENARIOS["bcast"] = s_plain  # ranks start from different weights; rank 0's win


def run(scenario, mode, rank=0, world=1, pack=False, job="", fake=None):
    reduce_method, bcast_period = OPTIONS.get(scenario, ("mean", 0))
    if mode != "gs":
        bcast_period = -1
    c = Ctx(mode, rank, world, pack, reduce_method, bcast_period, job)
    c.fake = fake
    SCENARIOS[scenario](c)
    out = {"scenario": scenario, "rank": rank,
           "params": [p.detach().reshape(-1).tolist() for p in c.model.parameters()],
           "trace": c.trace}
    if fake is not None:
        out["fake"] = fake.stats()
        out["fake"]["on_device"] = all(fake.device_of(p) == 0 for p in c.model.parameters())
    return out


def run_on_fake_cuda(scenario, rank, world, pack):
    """run() with the parameters in fake CUDA memory; after every backward() the current stream
    must have waited on "done" of everything reduced (else a violation is recorded)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import fake_cuda
    backward = torch.Tensor.backward
    with fake_cuda.FakeCuda() as fake:
        def checked(self, *args, **kwargs):
            backward(self, *args, **kwargs)
            if fake.settled():
                fake.violations.append(f"backward() returned unsettled: {fake.settled()}")
        torch.Tensor.backward = checked
        try:
            return run(scenario, "gs", rank, world, pack, fake=fake)
        finally:
            torch.Tensor.backward = backward


def main():
    torch.set_num_threads(1)
    mode = sys.argv[1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if mode in ("gs", "gsdev"):
        import gradsync
        pack = sys.argv[2] == "1"
        job = os.environ["GRADSYNC_JOB"]
        for scenario in sys.argv[3:]:
            # One job per scenario: its own store, so each pack plan is its own.
            gradsync.init(job=f"{job}-{scenario}")
            out = run(scenario, mode, rank, world, pack) if mode == "gs" else \
                run_on_fake_cuda(scenario, rank, world, pack)
            print(json.dumps(out), flush=True)
            gc.collect()
            gradsync.shutdown()
    else:
        import torch.distributed as dist
        dist.init_process_group("gloo", rank=rank, world_size=world)
        for scenario in sys.argv[2:]:
            print(json.dumps(run(scenario, mode, rank, world)), flush=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
