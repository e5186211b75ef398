"""One trainer process of the lifecycle tests (tests/python/test_lifecycle.py): how a trainer
starts, forks, is interrupted and exits. Placement comes from the environment (RANK,
WORLD_SIZE, GRADSYNC_SOCKET, ...); results go to stdout as JSON lines.

    lifecycle_worker.py hook          DDP (gloo) with gradsync's comm hook: one backward, return
    lifecycle_worker.py optimizer     DistributedOptimizer: one step, return
    lifecycle_worker.py plain         plain collectives on an array.array (no torch), return
    lifecycle_worker.py interrupt DIR ranks 0 and 1 all-reduce; rank 2 never does: rank 0 is
                                      sent SIGINT while it waits, rank 1 reports its error
    lifecycle_worker.py dataloader    a fork-based DataLoader next to a live session
    lifecycle_worker.py reinit N      N rounds of init, all_reduce, shutdown in one process
"""
import array
import json
import os
import signal
import sys
import time


def emit(**kv):
    print(json.dumps(kv), flush=True)


def hook():
    import torch
    import torch.distributed as dist

    import gradsync
    import gradsync.torch as gt
    torch.set_num_threads(1)
    gradsync.init()
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(state=None, hook=gt.allreduce_hook)
    x = torch.full((4, 8), float(dist.get_rank() + 1))
    ddp(x).sum().backward()
    grad = model[0].bias.grad.clone()
    emit(rank=dist.get_rank(), grad=grad.tolist())
    # Returns without destroy_process_group or gradsync.shutdown(), as scripts do.


def optimizer():
    import torch

    import gradsync
    import gradsync.torch as gt
    torch.set_num_threads(1)
    gradsync.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  reduce_method="mean", dist_group=gradsync.WORLD)
    opt.zero_grad()
    model(torch.full((3, 4), float(gradsync.get_rank()))).sum().backward()
    opt.step()
    emit(rank=gradsync.get_rank(), weight=model.weight.detach().flatten().tolist())


def plain():
    import gradsync
    gradsync.init()
    r = gradsync.get_rank()
    a = array.array("d", [float(r + 1)] * 4)
    gradsync.all_reduce(a)
    gradsync.barrier()
    emit(rank=r, value=list(a), torch_loaded="torch" in sys.modules)


def interrupt(folder, where="all_reduce"):
    import gradsync
    # Python's own Ctrl-C handler, even when started from a background job of a shell without
    # job control (which starts it with SIGINT ignored, so Python would install none).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    gradsync.init()
    r = gradsync.get_rank()
    gradsync.barrier(name="ready")
    if r == 2:
        # Never submits the op; stays attached until the test is done with the others.
        for _ in range(600):
            if os.path.exists(os.path.join(folder, "release")):
                break
            time.sleep(0.05)
        emit(rank=r, released=True)
        return
    a = array.array("f", [1.0] * 4)
    if where == "backward":
        # The optimizer's one wait, at the end of backward, is what gets interrupted.
        import torch

        import gradsync.torch as gt
        model = torch.nn.Linear(4, 1)
        opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      reduce_method="mean", dist_group=gradsync.new_group([0, 1]),
                                      bcast_period=-1, timeout=120)
    if r == 0:
        emit(rank=r, waiting=True)
    elif where == "backward":
        # Rank 1 comes only once rank 0 was interrupted, then submits and is told.
        for _ in range(600):
            if os.path.exists(os.path.join(folder, "interrupted")):
                break
            time.sleep(0.05)
    started = time.monotonic()
    try:
        if where == "backward":
            model(torch.ones(3, 4)).sum().backward()
            opt.step()
        else:
            gradsync.all_reduce(a, name="stuck", timeout=120)
        emit(rank=r, outcome="ok")
    except KeyboardInterrupt:
        emit(rank=r, outcome="KeyboardInterrupt", after_s=time.monotonic() - started,
             initialized=gradsync.is_initialized())
    except gradsync.Error as e:
        emit(rank=r, outcome="error", code=e.code, message=str(e),
             after_s=time.monotonic() - started)


def dataloader():
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import gradsync
    torch.set_num_threads(1)
    gradsync.init()
    r = gradsync.get_rank()
    t = torch.full((3,), float(r + 1))
    gradsync.all_reduce(t)
    data = TensorDataset(torch.arange(64, dtype=torch.float32).reshape(32, 2))
    loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="fork")
    total = 0.0
    for epoch in range(2):
        for (batch,) in loader:
            total += float(batch.sum())
    u = torch.full((3,), float(r + 1))
    gradsync.all_reduce(u)  # the session still works after the workers came and went
    emit(rank=r, total=total, before=t.tolist(), after=u.tolist())


def reinit(rounds):
    import gradsync
    values = []
    for k in range(rounds):
        # The job starts again only once every rank of the previous round has left it.
        for attempt in range(200):
            try:
                gradsync.init()
                break
            except gradsync.Error as e:
                if e.code != "FAILED_PRECONDITION" or attempt == 199:
                    raise
                time.sleep(0.05)
        r = gradsync.get_rank()
        a = array.array("d", [float(r + k)])
        gradsync.all_reduce(a)
        values.append(a[0])
        gradsync.shutdown()
        assert not gradsync.is_initialized()
    emit(rank=r, values=values)


if __name__ == "__main__":
    scenario, rest = sys.argv[1], sys.argv[2:]
    if scenario == "interrupt":
        interrupt(*rest)
    elif scenario == "reinit":
        reinit(int(rest[0]))
    else:
        globals()[scenario]()
