#!/usr/bin/env python3
"""The torch peer of formation_bench.py: one rank of a torch.distributed job, gloo over torch's
TCPStore (rank 0 hosts it; libuv in torch 2.x), formed by init_process_group and one barrier.
Prints "registered NS barrier NS" (unix nanoseconds: just before init_process_group, once the
barrier returned), as bench/formation_bench_worker does for gradsync.

    torch_formation_worker.py PORT WORLD RANK
"""
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def main():
    port, world, rank = (int(a) for a in sys.argv[1:4])
    registered = time.time_ns()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    dist.barrier()
    print(f"registered {registered} barrier {time.time_ns()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
