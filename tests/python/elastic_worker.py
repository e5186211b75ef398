"""A trainer of an elastic job (test_elastic.py): a small model trained with
gradsync.torch.DistributedOptimizer under gradsync.elastic.run, one JSON line per step and one
at the end. The test kills a node under it; the survivors go on with the new membership. With
GRADSYNC_JOIN=1 it joins the running job instead (its rank and world size come from the job).

    elastic_worker.py STEPS PAUSE_S
"""
import json
import os
import sys
import time

import torch

import gradsync
import gradsync.elastic
import gradsync.torch as gt


def emit(**kw):
    print(json.dumps(kw), flush=True)


def run_batch(batches):
    """Three async ops queued at once, then waited: on a change, every wait raises it and no
    operand is written (the record goes to `batches`, the first change is raised)."""
    g = torch.Generator().manual_seed(gradsync.get_rank())
    a, b, c = (torch.randn(1000, generator=g) for _ in range(3))
    before = [t.clone() for t in (a, b, c)]
    works = [gradsync.all_reduce(a, async_op=True),
             gradsync.all_reduce(b, op="max", async_op=True),
             gradsync.broadcast(c, src=0, async_op=True)]
    raised = []
    for w in works:
        try:
            w.wait()
        except gradsync.Error as e:
            raised.append(e)
    if raised:
        batches.append({
            "waits": len(works),
            "changed": [type(e).__name__ for e in raised],
            "epochs": [getattr(e, "epoch", None) for e in raised],
            "unchanged": all(bool(torch.equal(t, u)) for t, u in zip((a, b, c), before))})
        raise raised[0]


def main(steps, pause_s):
    emit(imported=time.time())  # Python, torch and gradsync loaded
    gradsync.init()  # elastic, job, ranks from the environment
    if os.environ.get("ELASTIC_PLAN_STALL") == "1" and gradsync.get_rank() == 0:
        # Rank 0 of epoch 0 stops as it would store its first pack plan (the test kills it):
        # the other ranks are left waiting for that plan.
        from gradsync import _ops  # where DistributedOptimizer stores its plan through
        set_pack_list = _ops.set_pack_list

        def stalling_set_pack_list(plan, group=gradsync.WORLD):
            if gradsync._ctx().epoch == 0:
                emit(plan_stalled=True)
                time.sleep(3600)
            set_pack_list(plan, group)
        _ops.set_pack_list = stalling_set_pack_list
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    # ELASTIC_PARAM_PACK=1: packed reductions, whose pack plan rank 0 makes after the first
    # step and makes again after each change.
    net = model
    # ELASTIC_TORCH_BACKEND=1: torch DDP on the backend "gradsync", its process group made
    # again for each membership at the top of train().
    torch_backend = os.environ.get("ELASTIC_TORCH_BACKEND") == "1"
    if torch_backend:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    elif os.environ.get("ELASTIC_DDP_PG"):
        # torch DDP with gradsync's comm hook (a gloo process group for DDP's construction
        # only: a model without buffers needs none afterwards) and a plain optimizer.
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method="file://" + os.environ["ELASTIC_DDP_PG"],
                                rank=gradsync.get_rank(), world_size=gradsync.get_world_size())
        net = torch.nn.parallel.DistributedDataParallel(model)
        net.register_comm_hook(state=None, hook=gt.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
    else:
        opt = gt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                      reduce_method="mean", timeout=30,
                                      param_pack=os.environ.get("ELASTIC_PARAM_PACK") == "1",
                                      param_pack_thd=256)
    state = gradsync.elastic.TorchState(model=model, optimizer=opt, step=0)
    changes = []
    resets = []
    batches = []
    # ELASTIC_BATCH=1: each step also queues a batch of async ops; ELASTIC_STALL_AT=N: this
    # rank stops before step N's batch.
    batch = os.environ.get("ELASTIC_BATCH") == "1"
    stall_at = int(os.environ.get("ELASTIC_STALL_AT", "-1"))
    state.register_reset_callbacks([lambda: resets.append(gradsync.get_world_size())])
    # ELASTIC_GROUP=a,b,...: a group of those ranks, made once; each step its members
    # all-reduce their rank there (the group follows each change: its ranks are renumbered).
    group = None
    group_sums = []
    if os.environ.get("ELASTIC_GROUP"):
        group = gradsync.new_group(int(r) for r in os.environ["ELASTIC_GROUP"].split(","))

    @gradsync.elastic.run
    def train(state):
        ddp = net
        if torch_backend:
            gt.init_process_group()
            ddp = torch.nn.parallel.DistributedDataParallel(model)
        while state.step < steps:
            # Each rank's data depends on its rank and the step: a mean over the world.
            g = torch.Generator().manual_seed(1000 * state.step + gradsync.get_rank())
            x = torch.randn(4, 8, generator=g)
            opt.zero_grad()
            try:
                ddp(x).pow(2).mean().backward()
                opt.step()
                if state.step == stall_at:  # this rank stops coming (the test kills it)
                    emit(stalled=state.step)
                    time.sleep(3600)
                if batch:
                    run_batch(batches)
                if group is not None and group.rank >= 0:
                    t = torch.tensor([float(gradsync.get_rank())])
                    gradsync.all_reduce(t, group=group)
                    group_sums.append([list(group.ranks), t.item()])
                state.step += 1
                state.commit()  # where joining nodes are admitted
            except Exception as raised:
                # DDP raises its comm hook's MembershipChanged as a RuntimeError: the change
                # is the one the session saw.
                change = gradsync._ctx().membership_change
                if isinstance(change, gradsync.elastic.MembershipChanged):
                    changes.append({"message": str(change), "rank": change.rank,
                                    "world": change.world_size, "epoch": change.epoch,
                                    "lost_ranks": list(change.lost_ranks),
                                    "lost_nodes": list(change.lost_nodes),
                                    "joined": change.joined,
                                    "raised": type(raised).__name__})
                raise
            emit(step=state.step, rank=gradsync.get_rank(), world=gradsync.get_world_size(),
                 t=time.time())
            time.sleep(pause_s)

    try:
        train(state)
    except gradsync.Error as e:
        emit(error=type(e).__name__, code=e.code, message=str(e))
        return 3
    digest = float(sum(p.detach().double().sum() for p in model.parameters()))
    params = [p.detach().tolist() for p in model.parameters()]
    emit(done=True, rank=gradsync.get_rank(), world=gradsync.get_world_size(), changes=changes,
         epoch=gradsync._ctx().epoch,
         resets=resets, digest=digest, params=params, step=state.step, batches=batches,
         group=list(group.ranks) if group is not None else None, group_sums=group_sums)
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), float(sys.argv[2])))
