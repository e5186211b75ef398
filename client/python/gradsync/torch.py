"""PyTorch integration: DistributedOptimizer and a DDP communication hook.

DistributedOptimizer gives PyTorch what MegEngine's DistributedOptimizer gave its users:

    opt = gradsync.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              reduce_method="mean", param_pack=True)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # gradients are reduced as backward produces them
        opt.step()                        # waits for the reductions, then steps

Every gradient lives in gradsync shared memory (param.grad is a view into a registered buffer),
so the daemon reduces it where it is: nothing is copied in or out.
"""
import contextlib
import threading

import torch

import gradsync
from gradsync import Error, WORLD

__all__ = ["DistributedOptimizer", "allreduce_hook"]


class _Layout:
    """Gradients of the parameters laid out back to back, in a given order, one registered
    buffer per dtype; place[i] = (buffer, byte offset, element count) of parameter i."""

    def __init__(self, params, order):
        self.buffers = {}
        self.place = {}
        sizes = {}
        for i in order:
            p = params[i]
            sizes[p.dtype] = sizes.get(p.dtype, 0) + p.numel() * p.element_size()
        for dtype, nbytes in sizes.items():
            self.buffers[dtype] = gradsync._new_buffer(nbytes)
        at = {dtype: 0 for dtype in sizes}
        for i in order:
            p = params[i]
            self.place[i] = (self.buffers[p.dtype], at[p.dtype], p.numel())
            at[p.dtype] += p.numel() * p.element_size()

    def view(self, params, i):
        buf, offset, count = self.place[i]
        return gradsync._view(buf, params[i].dtype, count, offset).view_as(params[i])

    def release(self):
        for buf in self.buffers.values():
            gradsync._release_buffer(buf)


class DistributedOptimizer:
    """Wraps a torch.optim.Optimizer (or builds one: DistributedOptimizer(params, reduce_method=
    ..., optimizer_class=torch.optim.SGD, lr=0.1)) and all-reduces the gradients through gradsync.

    reduce_method: "sum" or "mean" (required when the group has more than one rank).
    dist_group:    the gradsync.Group the gradients are reduced over (None: not distributed).
    bcast_period:  0 broadcasts the parameters from the group's rank 0 once, at construction;
                   N > 0 also every N steps (before the step); -1 never.
    param_pack:    after the first iteration, gradients travel in packs of about
                   param_pack_thd bytes, one collective each, on a plan rank 0 computes from
                   the order its gradients became ready and shares through the job's store.
                   The first param_pack_first_alone gradients in that order go alone, so the
                   first reductions start while backward is still running.
    timeout:       seconds each reduction may wait for the other ranks (None: the daemon's).
    """

    def __init__(self, optimizer, reduce_method=None, dist_group=WORLD, bcast_period=0,
                 param_pack=False, param_pack_thd=10 * 1024 * 1024, param_pack_first_alone=0,
                 optimizer_class=None, timeout=None, **optimizer_kwargs):
        if not isinstance(optimizer, torch.optim.Optimizer):
            if optimizer_class is None:
                raise TypeError("pass a torch.optim.Optimizer, or params and optimizer_class=")
            optimizer = optimizer_class(optimizer, **optimizer_kwargs)
        elif optimizer_class is not None or optimizer_kwargs:
            raise TypeError("optimizer_class and its arguments go with params, not an optimizer")
        self._opt = optimizer
        self._group = dist_group
        self._distributed = dist_group is not None and dist_group.size > 1
        if self._distributed and reduce_method not in ("sum", "mean"):
            raise ValueError("reduce_method must be 'sum' or 'mean' when distributed")
        if dist_group is not None and dist_group.rank < 0:
            raise ValueError(f"this rank ({gradsync.get_rank()}) is not in {dist_group}")
        if bcast_period < -1:
            raise ValueError("bcast_period is -1 (never), 0 (once) or a period")
        self._reduce_method = reduce_method
        self._bcast_period = bcast_period
        self._param_pack = param_pack
        self._param_pack_thd = int(param_pack_thd)
        self._param_pack_first_alone = int(param_pack_first_alone)
        self._timeout = timeout
        self._params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if self._distributed and any(p.device.type != "cpu" for p in self._params):
            raise ValueError("DistributedOptimizer reduces CPU parameters; GPU parameters need "
                             "the CUDA IPC path, which the Python package does not have yet")
        self._iteration = 0
        self._lock = threading.Lock()
        self._works = []           # this iteration's reductions in flight
        self._fired = set()        # parameters whose gradient is ready this iteration
        self._order = []           # first iteration: the order gradients became ready
        self._plan = None          # the pack plan (param_pack, from the second iteration on)
        self._pack_of = {}         # parameter -> pack index
        self._pending = []         # per pack: gradients still to come this iteration
        self._layout = None
        self._hooks = []
        self._no_sync = False
        if not self._distributed:
            return
        self._layout = _Layout(self._params, range(len(self._params)))
        self._attach_grads(copy=False)
        for i, p in enumerate(self._params):
            acc = p.expand_as(p).grad_fn.next_functions[0][0]  # the gradient's accumulator
            acc.register_hook(self._make_hook(i))
            self._hooks.append(acc)
        if bcast_period != -1:
            self.bcast_param()

    # ---- the wrapped optimizer ----
    @property
    def optimizer(self):
        return self._opt

    @property
    def param_groups(self):
        return self._opt.param_groups

    @property
    def state(self):
        return self._opt.state

    @property
    def defaults(self):
        return self._opt.defaults

    @property
    def pack_plan(self):
        """The pack plan in use (None before it exists or without param_pack)."""
        return self._plan

    def state_dict(self):
        """The wrapped optimizer's state only: nothing of the distribution (plans, buffers)."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        self._opt.load_state_dict(state_dict)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation: backward passes inside accumulate locally and start no
        reduction; the first backward after the block reduces the accumulated gradients.

            with opt.no_sync():
                loss_fn(model(x1), y1).backward()
            loss_fn(model(x2), y2).backward()   # reduces the sum of both
            opt.step()
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def zero_grad(self, set_to_none=False):
        """Zeroes the gradients in place: they live in shared memory, so never None."""
        if not self._distributed:
            return self._opt.zero_grad(set_to_none=set_to_none)
        for buf in self._layout.buffers.values():
            torch.frombuffer(buf, dtype=torch.uint8).zero_()
        self._attach_grads(copy=False)

    # ---- reduction ----
    def _attach_grads(self, copy):
        for i, p in enumerate(self._params):
            view = self._layout.view(self._params, i)
            if copy and p.grad is not None:
                view.copy_(p.grad)
            p.grad = view

    def _make_hook(self, i):
        def hook(*unused):
            self._grad_ready(i)
        return hook

    def _grad_ready(self, i):
        if self._no_sync:
            return  # accumulating: the backward after no_sync() reduces
        p = self._params[i]
        buf, offset, _ = self._layout.place[i]
        if p.grad is None or p.grad.data_ptr() != buf.address + offset:
            # The gradient was replaced (zero_grad(set_to_none=True) elsewhere): take it back in.
            view = self._layout.view(self._params, i)
            view.copy_(p.grad if p.grad is not None else torch.zeros_like(view))
            p.grad = view
        with self._lock:
            if i in self._fired:
                return  # accumulated twice in one iteration: its op is already on its way
            self._fired.add(i)
            if self._plan is None:
                self._order.append(i)
                self._submit([i], f"grad{i}")
            else:
                k = self._pack_of[i]
                self._pending[k] -= 1
                if self._pending[k] == 0:
                    self._submit(self._plan["packs"][k]["indices"], f"pack{k}")

    def _submit(self, indices, name):
        # Members of a pack are adjacent in the layout: one segment.
        buf, offset, _ = self._layout.place[indices[0]]
        count = sum(self._layout.place[i][2] for i in indices)
        handle = gradsync.client().all_reduce(
            gradsync.dtype_name(self._params[indices[0]].dtype), self._reduce_method,
            [(buf.id, offset, count)], self._group.key, name, gradsync._timeout(self._timeout))
        self._works.append(handle)

    def _finish_reduction(self):
        with self._lock:
            # Gradients backward never produced (unused parameters) still take part, as zeros
            # or as they were, in parameter order: every rank submits the same ops.
            missing = [i for i in range(len(self._params)) if i not in self._fired]
        for i in missing:
            self._grad_ready(i)
        with self._lock:
            works, self._works = self._works, []
            self._fired = set()
            if self._plan is not None:
                self._pending = [len(p["indices"]) for p in self._plan["packs"]]
        first_error = None
        for h in works:
            try:
                h.wait()
            except Error as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error

    def _make_plan(self):
        group = self._group
        if group.rank == 0:
            grads = [(i, gradsync.dtype_name(self._params[i].dtype), list(self._params[i].shape))
                     for i in self._order]
            plan = gradsync.plan_packs(grads, self._param_pack_thd, self._param_pack_first_alone)
            gradsync.set_pack_list(plan, group)
        else:
            plan = gradsync.get_pack_list(group, self._timeout or 300.0)
        planned = sorted(i for p in plan["packs"] for i in p["indices"])
        if planned != list(range(len(self._params))):
            raise Error(f"FAILED_PRECONDITION: the pack plan of {group} covers parameters "
                        f"{planned}, this rank has {len(self._params)}")
        order = [i for p in plan["packs"] for i in p["indices"]]
        old = self._layout
        self._layout = _Layout(self._params, order)
        self._attach_grads(copy=True)
        old.release()
        self._plan = plan
        self._pack_of = {i: k for k, p in enumerate(plan["packs"]) for i in p["indices"]}
        self._pending = [len(p["indices"]) for p in plan["packs"]]

    def step(self, closure=None):
        """Waits for this iteration's reductions, re-broadcasts on schedule, then steps."""
        if self._distributed:
            self._finish_reduction()
            if self._param_pack and self._plan is None:
                self._make_plan()
            self._iteration += 1
            if self._bcast_period > 0 and self._iteration % self._bcast_period == 0:
                self.bcast_param()
        return self._opt.step(closure)

    def bcast_param(self):
        """Broadcasts every parameter from the group's rank 0 (one op per dtype)."""
        if not self._distributed:
            return
        by_dtype = {}
        for p in self._params:
            by_dtype.setdefault(p.dtype, []).append(p)
        root = self._group.ranks[0]
        for dtype, params in by_dtype.items():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            gradsync.broadcast(flat, src=root, group=self._group, name="bcast_param",
                               timeout=self._timeout)
            at = 0
            with torch.no_grad():
                for p in params:
                    p.copy_(flat[at:at + p.numel()].view_as(p))
                    at += p.numel()

    def __repr__(self):
        return (f"DistributedOptimizer({self._opt.__class__.__name__}, group={self._group}, "
                f"reduce_method={self._reduce_method}, param_pack={self._param_pack})")


class _Completer:
    """Completes DDP's futures as gradsync's ops finish, on one background thread."""

    def __init__(self):
        self._cv = threading.Condition()
        self._queue = []
        self._thread = None

    def add(self, work, future):
        with self._cv:
            self._queue.append((work, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gradsync-ddp",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self):
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                work, future = self._queue.pop(0)
            try:
                future.set_result(work.wait())
            except Exception as e:  # noqa: BLE001 - handed to DDP, which raises it in backward
                future.set_exception(e)


_completer = _Completer()


def allreduce_hook(state, bucket):
    """A DDP communication hook: each bucket is averaged through gradsync.

        ddp.register_comm_hook(state=None, hook=gradsync.torch.allreduce_hook)

    `state` may be a gradsync.Group (None: WORLD).
    """
    group = state if isinstance(state, gradsync.Group) else WORLD
    tensor = bucket.buffer()
    work = gradsync.all_reduce(tensor, op="mean", group=group, async_op=True,
                               name=f"ddp{bucket.index()}")
    future = torch.futures.Future()
    _completer.add(work, future)
    return future
