#!/usr/bin/env python3
"""The torchft peer of elastic_bench.py: one replica group of one rank, the same small MLP as
tests/python/elastic_worker.py, trained with torchft's Manager, its DistributedDataParallel and
OptimizerWrapper over its ProcessGroupGloo, a step every DELAY seconds; prints one JSON line per
step ({"t", "step", "world"}, world: the replica groups in the step's quorum) as the gradsync
worker does. The replica group's own store is a TCPStore this process hosts; the Lighthouse is
TORCHFT_LIGHTHOUSE, the replica id TORCHFT_REPLICA, the fewest replica groups a step may run
with TORCHFT_MIN_REPLICAS.

    torchft_worker.py STEPS DELAY
"""
import json
import os
import sys
import time

START = time.time()
from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchft.ddp import DistributedDataParallel  # noqa: E402
from torchft.manager import Manager  # noqa: E402
from torchft.optim import OptimizerWrapper  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402


def main():
    steps, delay = int(sys.argv[1]), float(sys.argv[2])
    imported = time.time()
    print(json.dumps({"started": START, "imported": imported}), flush=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.05)

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        min_replica_size=int(os.environ["TORCHFT_MIN_REPLICAS"]),
        load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=os.environ["TORCHFT_REPLICA"], store_addr="127.0.0.1", store_port=store.port,
        rank=0, world_size=1, lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], port=0,
        timeout=timedelta(seconds=10), quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=10))
    ddp = DistributedDataParallel(manager, model)
    opt = OptimizerWrapper(manager, inner)
    gen = torch.Generator().manual_seed(1000 + os.getpid())
    while manager.current_step() < steps:
        opt.zero_grad()
        ddp(torch.randn(4, 8, generator=gen)).pow(2).mean().backward()
        before = manager.current_step()
        opt.step()
        if manager.current_step() > before:  # committed: the quorum's replica groups took it
            print(json.dumps({"t": time.time(), "step": manager.current_step(),
                              "world": manager.num_participants()}), flush=True)
        time.sleep(delay)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
