#!/usr/bin/python3
"""The torchrun peer of elastic_bench.py: the same small MLP trained with torch DDP over gloo,
one step every DELAY seconds, appending one JSON line per step ({"t", "step", "world"}) to the
file BENCH_OUT names, as the gradsync worker prints them (Debian's torchrun 1.13 cannot leave
its workers' output on the console under Python 3.11: --redirects=0 fails). torchrun restarts
it from its first line after a failure (no checkpoint is loaded: the restart measured is the
least torchrun's costs)."""
import json
import os
import sys
import time

START = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main():
    steps, delay = int(sys.argv[1]), float(sys.argv[2])
    out = open(os.environ["BENCH_OUT"], "a")
    imported = time.time()
    dist.init_process_group("gloo")
    print(json.dumps({"started": START, "imported": imported, "formed": time.time()}), file=out,
          flush=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, steps + 1):
        x = torch.randn(16, 32)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(json.dumps({"t": time.time(), "step": step, "world": world, "rank": rank}),
              file=out, flush=True)
        time.sleep(delay)


if __name__ == "__main__":
    main()
