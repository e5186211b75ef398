#!/usr/bin/env python3
"""The torch peer of formation_bench.py: one rank of a torch.distributed job, gloo over torch's
TCPStore (rank 0 hosts it; libuv in torch 2.x), formed by init_process_group and one barrier.
Prints "registered NS barrier NS" (unix nanoseconds: just before init_process_group, once the
barrier returned), as bench/formation_bench_worker does for gradsync; with ALLREDUCE 1, then
"allreduce 4096 US" (median microseconds of 20 all-reduces of 4 KiB of float32, sums checked).

    torch_formation_worker.py PORT WORLD RANK [ALLREDUCE]
"""
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main():
    port, world, rank = (int(a) for a in sys.argv[1:4])
    registered = time.time_ns()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    dist.barrier()
    print(f"registered {registered} barrier {time.time_ns()}", flush=True)
    if len(sys.argv) > 4 and sys.argv[4] == "1":
        x = torch.ones(1024)
        us = []
        for _ in range(20):
            x.fill_(1.0)
            t0 = time.perf_counter_ns()
            dist.all_reduce(x)
            us.append((time.perf_counter_ns() - t0) / 1e3)
            if x[0].item() != world or x[-1].item() != world:
                sys.exit(f"rank {rank}: all-reduce summed {x[0].item()}, not {world}")
        print(f"allreduce 4096 {sorted(us)[len(us) // 2]:.0f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
