#!/usr/bin/python3
"""Example trainer: a small MLP on synthetic regression data, data-parallel through gradsync.

Run it with torchrun next to a running gradsyncd (`./setup.sh demo` does; README, "Quick start"):

    GRADSYNC_SOCKET=/run/gradsync/gradsyncd.sock PYTHONPATH=build/python \
      /usr/bin/python3 -m torch.distributed.run --standalone --nproc_per_node=4 \
      client/python/examples/train.py --steps 50 --param_pack

Every step draws one global batch (the same on every rank, from the step's seed); rank r
trains on its contiguous 1/W shard, and the gradients are averaged across ranks, so W ranks
end with the parameters one process reaches on the whole batch. --mode ddp runs the same
training with torch DistributedDataParallel over gloo (--backend gradsync: over the daemon, as
torch.distributed's backend "gradsync"); --mode single runs one process on the whole batch. --out writes the final parameters (torch.save) for comparison; the last line on
stdout is a JSON summary (steps/s measured after --warmup steps).
"""
import argparse
import json
import os
import sys
import time

import torch


def build_model(dims, seed):
    torch.manual_seed(seed)
    layers = []
    for a, b in zip(dims[:-1], dims[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def batch(step, size, dims, seed):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randn(size, dims[0], generator=g)
    w = torch.linspace(-1, 1, dims[0] * dims[-1]).view(dims[0], dims[-1])
    y = torch.sin(x @ w) + 0.01 * torch.randn(size, dims[-1], generator=g)
    return x, y


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("gradsync", "ddp", "single"), default="gradsync")
    ap.add_argument("--backend", default="gloo", help="--mode ddp's torch.distributed backend")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing starts")
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    ap.add_argument("--dims", default="32,64,64,8", help="layer widths")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reduce_method", default="mean", choices=("mean", "sum"))
    ap.add_argument("--param_pack", action="store_true")
    ap.add_argument("--param_pack_thd", type=int, default=10 * 1024 * 1024)
    ap.add_argument("--bcast_period", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--out", help="write the final parameters here (torch.save; {rank} expands)")
    ap.add_argument("--hold", metavar="KEY",
                    help="after training, add 1 to 'done' in the job's store and stay attached "
                         "until KEY is set there (at most 120 s), so an operator can look")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dims = [int(d) for d in args.dims.split(",")]

    rank, world = 0, 1
    if args.mode != "single":
        rank = int(os.environ.get("RANK", 0))
        world = int(os.environ.get("WORLD_SIZE", 1))
    if args.batch % world:
        sys.exit(f"--batch {args.batch} does not split evenly over {world} ranks")
    model = build_model(dims, args.seed)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.MSELoss()
    scale = 1.0
    if args.mode == "gradsync":
        import gradsync
        import gradsync.torch
        gradsync.init()
        opt = gradsync.torch.DistributedOptimizer(
            sgd, reduce_method=args.reduce_method, bcast_period=args.bcast_period,
            param_pack=args.param_pack, param_pack_thd=args.param_pack_thd)
        net = model
        if args.reduce_method == "sum":
            scale = 1.0 / world  # a sum of per-shard means: scale the loss to match the mean
    elif args.mode == "ddp":
        import torch.distributed as dist
        if args.backend == "gradsync":
            import gradsync.torch  # noqa: F401 - registers the backend
        dist.init_process_group(args.backend)
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = sgd
    else:
        net, opt = model, sgd

    shard = args.batch // world
    t0 = None
    for step in range(args.steps):
        if step == args.warmup:
            t0 = time.perf_counter()
        x, y = batch(step, args.batch, dims, args.seed)
        x, y = x[rank * shard:(rank + 1) * shard], y[rank * shard:(rank + 1) * shard]
        opt.zero_grad()
        loss = loss_fn(net(x), y) * scale
        loss.backward()
        opt.step()
    elapsed = time.perf_counter() - t0 if t0 is not None else float("nan")
    timed = args.steps - args.warmup
    if args.out:
        torch.save([p.detach().clone() for p in model.parameters()], args.out.format(rank=rank))
    summary = {"mode": args.mode, "rank": rank, "world": world, "steps": args.steps,
               "loss": float(loss.detach()) / scale,
               "steps_per_s": timed / elapsed if timed > 0 and elapsed > 0 else None,
               "params": sum(p.numel() for p in model.parameters())}
    if args.mode == "gradsync" and opt.pack_plan is not None:
        summary["packs"] = len(opt.pack_plan["packs"])
    print(json.dumps(summary), flush=True)
    if args.hold and args.mode == "gradsync":
        gradsync.client().store_add("done", 1)
        gradsync.client().store_get(args.hold, 120.0)
    if args.mode == "ddp":
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
