"""One trainer process for the torch.distributed backend's tests (test_torch_backend.py).

    torch_backend_worker.py MODE BACKEND STORE_FILE [OUT]

RANK/WORLD_SIZE (and gradsync's GRADSYNC_*) come from the environment; torch's own store is a
FileStore at STORE_FILE ("env": init_process_group(BACKEND) alone, as under torchrun). MODE:
  collectives  every collective through torch.distributed; prints one JSON line of results
  train        DDP or FSDP2 (TRAIN_KIND) training, unchanged but for the backend string; saves
               the parameters to OUT
  unsupported  the ops gradsync refuses: prints each one's error
  mismatch     ranks submit different shapes: prints the error Work.wait() raised
"""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import gradsync.torch  # noqa: F401 - registers the backend


def init(backend, store_file):
    if store_file == "env":  # torchrun's: the script as users write it
        dist.init_process_group(backend)
        return
    dist.init_process_group(backend, init_method=f"file://{store_file}",
                            rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))


def values(t):
    return t.tolist()


def collectives():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"backend": dist.get_backend(), "rank": rank, "world": world}
    for op in ("SUM", "AVG", "MIN", "MAX"):
        t = torch.tensor([rank + 1.0, 10.0 * rank, -rank], dtype=torch.float32)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        out[f"all_reduce_{op}"] = values(t)
    t = torch.arange(4, dtype=torch.int64) * (rank + 1)
    dist.all_reduce(t)
    out["all_reduce_int64"] = values(t)
    # Not contiguous: every other element of a row.
    m = torch.full((2, 4), float(rank))
    dist.all_reduce(m[:, ::2])
    out["all_reduce_strided"] = values(m)
    t = torch.full((3,), float(rank))
    dist.broadcast(t, src=world - 1)
    out["broadcast"] = values(t)
    b = torch.tensor([rank % 2 == 0, True])
    dist.broadcast(b, src=1)
    out["broadcast_bool"] = values(b)
    outs = [torch.empty(2) for _ in range(world)]
    dist.all_gather(outs, torch.tensor([rank, rank + 0.5]))
    out["all_gather"] = [values(o) for o in outs]
    flat = torch.empty(2 * world, dtype=torch.int32)
    dist.all_gather_into_tensor(flat, torch.tensor([rank, -rank], dtype=torch.int32))
    out["all_gather_into_tensor"] = values(flat)
    o = torch.empty(2)
    dist.reduce_scatter(o, [torch.full((2,), float(rank * world + i)) for i in range(world)])
    out["reduce_scatter"] = values(o)
    o = torch.empty(2)
    dist.reduce_scatter_tensor(o, torch.arange(2.0 * world) + rank, op=dist.ReduceOp.AVG)
    out["reduce_scatter_tensor_avg"] = values(o)
    a, c = torch.ones(3) * rank, torch.tensor([[rank], [2.0 * rank]])
    dist.all_reduce_coalesced([a, c])
    out["all_reduce_coalesced"] = [values(a), values(c)]
    t = torch.tensor([float(rank)])
    dist.reduce(t, dst=0)
    out["reduce"] = values(t)
    g = [torch.empty(1) for _ in range(world)] if rank == 0 else None
    dist.gather(torch.tensor([rank * 2.0]), g, dst=0)
    out["gather"] = [values(x) for x in g] if g else None
    s = torch.empty(2)
    dist.scatter(s, [torch.tensor([i, -i], dtype=torch.float32) for i in range(world)]
                 if rank == 0 else None, src=0)
    out["scatter"] = values(s)
    # Async: Work.wait() and the future both give the result.
    t = torch.ones(2) * (rank + 1)
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future()
    work.wait()
    out["async"] = values(t)
    out["future"] = [values(x) for x in fut.wait()]
    out["objects"] = [None] * world
    dist.all_gather_object(out["objects"], {"rank": rank})
    dist.barrier()
    # A subgroup of the odd ranks.
    odd = dist.new_group([r for r in range(world) if r % 2 == 1], backend="gradsync") \
        if "gradsync" in dist.get_backend() else \
        dist.new_group([r for r in range(world) if r % 2 == 1])
    if rank % 2 == 1:
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=odd)
        out["odd_group"] = values(t)
    print(json.dumps(out), flush=True)


def train(out_path):
    kind = os.environ.get("TRAIN_KIND", "ddp")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    if kind == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    steps = int(os.environ.get("TRAIN_STEPS", "8"))
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        y = torch.randn(8, 4, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    params = [p.detach().clone() for p in params]
    torch.save(params, out_path.format(rank=rank))
    print(json.dumps({"rank": rank, "steps": steps, "kind": kind}), flush=True)


def unsupported():
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = {}
    calls = {
        "send": lambda: dist.send(torch.ones(1), dst=(rank + 1) % world),
        "recv": lambda: dist.recv(torch.ones(1), src=(rank + 1) % world),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world)),
        "all_reduce_product": lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.PRODUCT),
    }
    for name, call in calls.items():
        try:
            call()
            errors[name] = None
        except Exception as e:  # noqa: BLE001 - what torch.distributed raised is the result
            errors[name] = f"{type(e).__name__}: {e}"
    # The group still works after refusals.
    t = torch.ones(1)
    dist.all_reduce(t)
    print(json.dumps({"rank": rank, "errors": errors, "after": values(t)}), flush=True)


def mismatch():
    rank = dist.get_rank()
    t = torch.ones(4 if rank == 0 else 5)
    result = {"rank": rank}
    try:
        dist.all_reduce(t, async_op=True).wait()
        result["error"] = None
    except Exception as e:  # noqa: BLE001 - what torch.distributed raised is the result
        result["error"] = f"{type(e).__name__}: {e}"
        result["is_gradsync_error"] = isinstance(e, gradsync.Error)
        result["code"] = getattr(e, "code", None)
    print(json.dumps(result), flush=True)


def main():
    mode, backend, store_file = sys.argv[1:4]
    init(backend, store_file)
    if mode == "collectives":
        collectives()
    elif mode == "train":
        train(sys.argv[4])
    elif mode == "unsupported":
        unsupported()
    elif mode == "mismatch":
        mismatch()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
