"""PyTorch integration: DistributedOptimizer and a DDP communication hook.

DistributedOptimizer gives PyTorch what MegEngine's DistributedOptimizer gave its users, with
torch DDP's contract:

    opt = gradsync.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                              reduce_method="mean", param_pack=True)
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # reductions start as backward produces gradients;
                                          # when it returns, every gradient is reduced
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # sees the reduced gradients
        opt.step()

Every gradient lives in memory the daemon has mapped once (param.grad is a view into a
registered bucket: shared memory for CPU parameters, a CUDA allocation shared over CUDA IPC for
GPU parameters), so the daemon reduces it where it is: nothing is copied in or out. On GPUs the
contract holds for the current stream, without host synchronisation: each reduction starts on
the device after the stream that produced its gradient ("ready"), and when backward() returns
the caller's current stream waits for every reduction ("done").
"""
import contextlib
import inspect
import os
import threading

import torch

from . import _cuda, _membership, _native, _ops, _process_group
from ._native import Error
from ._ops import WORLD
from ._process_group import ProcessGroupGradsync

__all__ = ["DistributedOptimizer", "allreduce_hook", "ProcessGroupGradsync",
           "init_process_group", "register_backend"]

# torch >= 2.1 runs a hook once a parameter's gradient is accumulated; before, the hook goes on
# the gradient's accumulator node (the same moment).
_POST_ACCUMULATE = hasattr(torch.Tensor, "register_post_accumulate_grad_hook")
# torch.optim's own default for zero_grad (False in 1.x, True in 2.x).
_SET_TO_NONE_DEFAULT = bool(
    inspect.signature(torch.optim.Optimizer.zero_grad).parameters["set_to_none"].default)


def _queue_end_of_backward(fn):
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class _HostBucket:
    """A bucket in gradsync shared memory (CPU parameters), registered on its own."""

    registration = None

    def __init__(self, nbytes):
        self._buf = _ops.new_buffer(nbytes)
        self._ctx = _ops.context()  # the session it is registered with
        self.buffer_id = self._buf.id
        self.offset = 0  # of the bucket in the registered buffer

    def view(self, dtype, count, byte_offset):
        return _ops.shared_view(self._buf, dtype, count, byte_offset)

    def zero_(self):
        torch.frombuffer(self._buf, dtype=torch.uint8).zero_()

    def release(self):
        if self._ctx is _ops.current():
            _ops.release_buffer(self._buf)
        # Else its session has ended (an elastic reset): the daemon dropped it with the session.


class _DeviceBucket:
    """A bucket in CUDA memory (GPU parameters): torch's caching allocator hands it out, and the
    allocation it lies in is registered with the daemon once (gradsync's registry, shared with
    every collective on tensors of that allocation). Held here, the allocation stays."""

    def __init__(self, nbytes, device):
        self._mem = _cuda.api().empty(nbytes, device)
        self._registry = _ops.context().device
        self.registration, self.offset = self._registry.locate(self._mem.data_ptr(), nbytes,
                                                               pin=True)
        self.buffer_id = self.registration.id

    def view(self, dtype, count, byte_offset):
        size = torch.empty((), dtype=dtype).element_size()
        return self._mem[byte_offset:byte_offset + count * size].view(dtype)

    def zero_(self):
        self._mem.zero_()  # on the current stream, after "done" of the last reduction

    def release(self):
        self._registry.unpin(self.registration)
        self._mem = None  # back to torch's allocator; the registry keeps the registration


class _Layout:
    """Gradients of the parameters laid out back to back, in a given order, one bucket per
    dtype; place[i] = (bucket, byte offset, element count) of parameter i.

    Each gradient is followed by one element, its flag: before a reduction, 1 if this rank
    contributes a gradient to it and 0 if not; reduced with the gradient, it says whether any
    rank did (DDP's "globally unused" parameters keep grad None, as in one process)."""

    def __init__(self, params, order, device=None):
        self.buffers = {}
        self.place = {}
        sizes = {}
        for i in order:
            p = params[i]
            sizes[p.dtype] = sizes.get(p.dtype, 0) + (p.numel() + 1) * p.element_size()
        for dtype, nbytes in sizes.items():
            self.buffers[dtype] = (_HostBucket(nbytes) if device is None
                                   else _DeviceBucket(nbytes, device))
        at = {dtype: 0 for dtype in sizes}
        for i in order:
            p = params[i]
            self.place[i] = (self.buffers[p.dtype], at[p.dtype], p.numel())
            at[p.dtype] += (p.numel() + 1) * p.element_size()
        self.views, self.flags, self.ptrs = {}, {}, {}
        for i in order:
            bucket, offset, count = self.place[i]
            both = bucket.view(params[i].dtype, count + 1, offset)
            self.views[i] = both[:count].view_as(params[i])
            self.flags[i] = both[count:]
            self.ptrs[i] = self.views[i].data_ptr()

    def registrations(self):
        """The CUDA registrations of the buckets (none on the host)."""
        regs = {}
        for bucket in self.buffers.values():
            if bucket.registration is not None:
                regs[bucket.registration.id] = bucket.registration
        return list(regs.values())

    def release(self):
        for bucket in self.buffers.values():
            bucket.release()


class DistributedOptimizer:
    """Wraps a torch.optim.Optimizer (or builds one: DistributedOptimizer(params, reduce_method=
    ..., optimizer_class=torch.optim.SGD, lr=0.1)) and all-reduces the gradients through gradsync,
    with torch DDP's contract: when backward() returns, every gradient is reduced and the same
    on every rank (clipping, logging and reading gradients see the reduced values); several
    backward passes before one step(), with or without no_sync(), give the gradients one
    process gets on the whole batch; a parameter no rank's backward produced keeps grad None.

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

    CUDA parameters (all on one device) get their gradient buckets in CUDA memory the daemon
    maps once; the contract then holds for the current stream (see the module's doc).
    """

    def __init__(self, optimizer, reduce_method=None, dist_group=WORLD, bcast_period=0,
                 param_pack=False, param_pack_thd=10 * 1024 * 1024, param_pack_first_alone=0,
                 optimizer_class=None, timeout=None, _reduce_alone=False, **optimizer_kwargs):
        # _reduce_alone (tests only): a group of one rank still reduces through the daemon.
        if not isinstance(optimizer, torch.optim.Optimizer):
            if optimizer_class is None:
                raise TypeError("pass a torch.optim.Optimizer, or params and optimizer_class=")
            optimizer = optimizer_class(optimizer, **optimizer_kwargs)
        elif optimizer_class is not None or optimizer_kwargs:
            raise TypeError("optimizer_class and its arguments go with params, not an optimizer")
        self._opt = optimizer
        self._group = dist_group
        self._distributed = dist_group is not None and (dist_group.size > 1 or _reduce_alone)
        if self._distributed and reduce_method not in ("sum", "mean"):
            raise ValueError("reduce_method must be 'sum' or 'mean' when distributed")
        if dist_group is not None and dist_group.rank < 0:
            raise ValueError(f"this rank ({_ops.get_rank()}) is not in {dist_group}")
        if bcast_period < -1:
            raise ValueError("bcast_period is -1 (never), 0 (once) or a period")
        self._reduce_method = reduce_method
        self._bcast_period = bcast_period
        self._param_pack = param_pack
        self._param_pack_thd = int(param_pack_thd)
        self._param_pack_first_alone = int(param_pack_first_alone)
        self._timeout = timeout
        self._params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._device = None  # the CUDA device of the parameters (None: the host)
        if self._distributed:
            self._device = self._device_of_params()
        n = len(self._params)
        self._iteration = 0
        self._lock = threading.Lock()
        self._works = []           # this backward's reductions in flight
        self._fired = set()        # parameters whose gradient is ready in this backward
        self._order = []           # first synchronised backward: the order gradients became ready
        self._order_done = False
        self._plan = None          # the pack plan (param_pack, from the second iteration on)
        self._pack_of = {}         # parameter -> pack index
        self._pending = []         # per pack: gradients still to come in this backward
        self._pack_streams = {}    # per pack: the CUDA streams its gradients came from so far
        self._layout = None
        self._hooks = []
        self._no_sync = False
        self._queued = False       # the end-of-backward callback is queued for this backward
        # Accumulation over several backward passes (the reduction is linear, so reducing only
        # what each backward adds and adding the earlier reduced value back is exact):
        self._reduced = [False] * n  # the gradient holds a reduced value (until zero_grad)
        self._stash = {}             # i -> reduced value set aside while a new one accumulates
        self._local = {}             # i -> local part while grad shows stash + local (no_sync)
        self._has_grad = [p.grad is not None for p in self._params]  # grad is not None
        if not self._distributed:
            return
        self._layout = _Layout(self._params, range(n), self._device)
        self._attach_grads()
        for i, p in enumerate(self._params):
            self._hooks.append(p.register_hook(self._make_pre_hook(i)))
            if _POST_ACCUMULATE:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))
            else:
                acc = p.expand_as(p).grad_fn.next_functions[0][0]  # the gradient's accumulator
                acc.register_hook(self._make_hook(i))
                self._hooks.append(acc)  # the node lives as long as we hold it
        _membership.follow(self)  # follows an elastic job's membership changes
        # A rank joining a running elastic job gets its parameters from the state's sync().
        if bcast_period != -1 and not (self._distributed and _ops.context().joined):
            self.bcast_param()

    def _reset_membership(self):
        """The job's membership changed (gradsync.elastic.reset): the buckets registered with
        the old session are left, new ones registered with the new; the pack plan is made again
        by the new rank 0 (from the gradient order already known); reductions in flight are
        dropped (they failed with the change). The gradients are zeroed: the step is redone."""
        if not self._distributed:
            return
        with self._lock:
            self._works, self._fired, self._pack_streams = [], set(), {}
            self._plan, self._pack_of, self._pending = None, {}, []
        self._queued = False
        self._iteration = 0  # as on a rank joining now: bcast_period counts from here on all
        n = len(self._params)
        self._reduced = [False] * n
        self._stash, self._local = {}, {}
        old = self._layout
        self._layout = _Layout(self._params, range(n), self._device)
        for p in self._params:
            p.grad = None
        self._has_grad = [False] * n
        old.release()

    def _device_of_params(self):
        api = _cuda.api()
        devices = set()
        for p in self._params:
            if p.device.type not in ("cpu", "cuda"):
                raise ValueError(f"DistributedOptimizer reduces CPU or CUDA parameters, not "
                                 f"{p.device}")
            devices.add(api.device_of(p))
        if len(devices) > 1:
            names = sorted("cpu" if d is None else f"cuda:{d}" for d in devices)
            raise ValueError(f"DistributedOptimizer's parameters lie on {', '.join(names)}: "
                             "one device per rank")
        return devices.pop() if devices else None

    # ---- the wrapped optimizer ----
    @property
    def optimizer(self):
        """The wrapped torch.optim.Optimizer."""
        return self._opt

    @property
    def param_groups(self):
        """The wrapped optimizer's param_groups (the same list: changes reach it)."""
        return self._opt.param_groups

    @property
    def state(self):
        """The wrapped optimizer's state."""
        return self._opt.state

    @property
    def defaults(self):
        """The wrapped optimizer's defaults."""
        return self._opt.defaults

    @property
    def pack_plan(self):
        """The pack plan in use (None before it exists or without param_pack)."""
        return self._plan

    def state_dict(self):
        """The wrapped optimizer's state only: nothing of the distribution (plans, buffers)."""
        return self._opt.state_dict()

    def load_state_dict(self, state_dict):
        """Loads a state_dict() into the wrapped optimizer."""
        self._opt.load_state_dict(state_dict)

    @contextlib.contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: backward passes inside accumulate
        locally and start no reduction; the next backward outside reduces the sum.

            with opt.no_sync():
                loss_fn(model(x1), y1).backward()
            loss_fn(model(x2), y2).backward()   # reduces the sum of both
            opt.step()

        (Accumulating without no_sync gives the same gradients, with a reduction per backward.)
        """
        previous, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = previous

    def zero_grad(self, set_to_none=None):
        """Zeroes the gradients in place (they live in memory the daemon maps). With set_to_none
        (torch's default for its version when None), a parameter the next backward does not
        produce on any rank ends it with grad None, as it would in one process."""
        if set_to_none is None:
            set_to_none = _SET_TO_NONE_DEFAULT
        if not self._distributed:
            return self._opt.zero_grad(set_to_none=set_to_none)
        self._drain()
        for bucket in self._layout.buffers.values():
            bucket.zero_()
        views = self._layout.views
        for i, p in enumerate(self._params):
            p.grad = views[i]
        n = len(self._params)
        self._reduced = [False] * n
        self._stash, self._local = {}, {}
        if set_to_none:
            self._has_grad = [False] * n

    # ---- reduction ----
    def _attach_grads(self):
        """Points every gradient that is not None at its view in the (new) layout."""
        views = self._layout.views
        for i, p in enumerate(self._params):
            if p.grad is not None:
                views[i].copy_(p.grad)
                p.grad = views[i]

    def _ours(self, i):
        g = self._params[i].grad
        return g is not None and g.data_ptr() == self._layout.ptrs[i]

    def _make_pre_hook(self, i):
        def pre_hook(grad):  # before autograd accumulates `grad` into param.grad
            if self._reduced[i] or self._local:
                self._before_new_gradient(i)
        return pre_hook

    def _make_hook(self, i):
        def hook(*unused):  # param.grad now holds the accumulated gradient
            self._grad_ready(i)
        return hook

    def _before_new_gradient(self, i):
        """A new gradient is about to land on param i's: if it holds a reduced value (an earlier
        backward of this step), set that aside so that only the new part is reduced."""
        if self._reduced[i]:
            self._reduced[i] = False
            if self._ours(i):
                view = self._layout.views[i]
                self._stash[i] = view.clone()
                view.zero_()
            # else: the user replaced or cleared the gradient; the reduced value went with it.
        elif i in self._local:
            local = self._local.pop(i)
            if self._ours(i):
                self._layout.views[i].copy_(local)  # back to the local part alone
            else:
                self._stash.pop(i, None)

    def _take_back(self, i):
        """Makes param.grad our view again if the user replaced it (or set it to None)."""
        if self._ours(i):
            return True
        p = self._params[i]
        view = self._layout.views[i]
        self._stash.pop(i, None)
        self._local.pop(i, None)
        self._reduced[i] = False
        if p.grad is None:
            view.zero_()
            self._layout.flags[i].zero_()
            self._has_grad[i] = False
            p.grad = view
            return False
        view.copy_(p.grad)
        self._layout.flags[i].fill_(1)
        p.grad = view
        return True

    def _grad_ready(self, i):
        if not self._queued:
            self._queued = True
            _queue_end_of_backward(self._backward_end)
        self._take_back(i)
        self._layout.flags[i].fill_(1)  # this rank contributes a gradient
        if self._no_sync:
            return  # accumulating: the next backward outside no_sync() reduces
        self._ready(i)

    def _ready(self, i):
        with self._lock:
            if i in self._fired:
                return
            self._fired.add(i)
            if self._plan is None:
                if not self._order_done:
                    self._order.append(i)
                self._submit([i], f"grad{i}")
            else:
                k = self._pack_of[i]
                self._pending[k] -= 1
                if self._device is not None:  # the streams that produced the pack's gradients
                    stream = _cuda.api().current_stream(self._device)
                    seen = self._pack_streams.setdefault(k, [])
                    if stream not in seen:
                        seen.append(stream)
                if self._pending[k] == 0:
                    self._submit(self._plan["packs"][k]["indices"], f"pack{k}",
                                 self._pack_streams.pop(k, []))

    def _submit(self, indices, name, streams=()):
        # Members of a pack are adjacent in the layout (each gradient and its flag): one segment.
        bucket, offset, _ = self._layout.place[indices[0]]
        count = sum(self._layout.place[i][2] + 1 for i in indices)
        if bucket.registration is not None:
            # The daemon starts once the stream that produced these gradients got here (and
            # the other streams that produced some of them, when backward used several).
            api = _cuda.api()
            stream = api.current_stream(self._device)
            for other in streams:
                if other != stream:
                    api.join_streams(stream, other)
            _ops.context().device.ready([bucket.registration], stream)
        handle = _ops.client().all_reduce(
            _ops.dtype_name(self._params[indices[0]].dtype), self._reduce_method,
            [(bucket.buffer_id, bucket.offset + offset, count)], self._group.key, name,
            _ops.seconds(self._timeout))
        self._works.append(handle)

    def _wait_done(self):
        """The current stream waits for the daemon's writes of the buckets (GPU; no-op else)."""
        regs = self._layout.registrations()
        if regs:
            api = _cuda.api()
            stream = api.current_stream(self._device)
            for reg in regs:
                api.wait_done(reg, stream)

    def _to_host(self, tensors):
        """Values of small tensors as a list: on a GPU a synchronous read (off the hot path)."""
        flat = torch.cat([t.reshape(-1) for t in tensors])
        if self._device is not None:
            flat = _cuda.api().to_host(flat)
        return flat.tolist()

    def _backward_end(self):
        """Autograd's end-of-backward callback: the one wait of a backward pass."""
        self._queued = False
        if self._no_sync:
            # Show what DDP would: the reduced value of earlier passes plus the local sum.
            for i, reduced in self._stash.items():
                if i not in self._local and self._ours(i):
                    view = self._layout.views[i]
                    self._local[i] = view.clone()
                    view.add_(reduced)
            return
        self._finish_reduction()

    def _finish_reduction(self):
        n = len(self._params)
        with self._lock:
            produced = set(self._fired)  # this backward's gradients (so flag 1 here)
            missing = [i for i in range(n) if i not in self._fired]
        # Gradients this backward did not produce (unused parameters) still take part, so that
        # every rank submits the same ops, in parameter order; they contribute what they hold
        # locally, and nothing (flag 0) if they hold nothing or an already reduced value.
        flags = self._layout.flags
        for i in missing:
            if self._take_back(i):  # else it was None: now zeros, flag 0
                if self._reduced[i]:
                    self._before_new_gradient(i)  # its reduced value waits aside
                    flags[i].zero_()
                elif i in self._local:
                    self._before_new_gradient(i)
            self._ready(i)
        with self._lock:
            works, self._works = self._works, []
            self._fired = set()
            if self._plan is not None:
                self._pending = [len(p["indices"]) for p in self._plan["packs"]]
            self._pack_streams = {}
            self._order_done = True
        first_error = None
        for h in works:
            try:
                h.wait()
            except Error as e:
                first_error = first_error or e
        self._wait_done()  # from here the current stream sees the reduced gradients
        views = self._layout.views
        for i, reduced in self._stash.items():
            if self._ours(i):
                views[i].add_(reduced)
        self._stash, self._local = {}, {}
        self._reduced = [True] * n
        if not all(self._has_grad):
            # A gradient this rank produced has a reduced flag above 0: only the others need
            # the flags read (on a GPU, one synchronous read, and only with unused parameters).
            unknown = [i for i in range(n) if not self._has_grad[i] and i not in produced]
            values = dict(zip(unknown, self._to_host([flags[i] for i in unknown]))) if unknown \
                else {}
            for i, p in enumerate(self._params):
                if self._has_grad[i]:
                    continue
                if i in produced or values[i] != 0:
                    self._has_grad[i] = True  # some rank produced it
                else:
                    p.grad = None  # no rank did: as in one process
                    self._reduced[i] = False
        if first_error is not None:
            seen = _membership.classify(_ops.current(), first_error)
            if seen is first_error:
                raise first_error
            raise seen from first_error

    def _drain(self):
        """Waits out reductions a backward left in flight (it failed before its end)."""
        with self._lock:
            works, self._works = self._works, []
            self._fired = set()
            if self._plan is not None:
                self._pending = [len(p["indices"]) for p in self._plan["packs"]]
            self._pack_streams = {}
        self._queued = False
        for h in works:
            try:
                h.wait()
            except Error:
                pass
        if works:
            self._wait_done()

    def _make_plan(self):
        group = self._group
        if group.rank == 0:
            grads = [(i, _ops.dtype_name(self._params[i].dtype), list(self._params[i].shape))
                     for i in self._order]
            plan = _native.plan_packs(grads, self._param_pack_thd, self._param_pack_first_alone)
            _ops.set_pack_list(plan, group)
        else:
            plan = _ops.get_pack_list(group, self._timeout or 300.0)
        planned = sorted(i for p in plan["packs"] for i in p["indices"])
        if planned != list(range(len(self._params))):
            raise Error("FAILED_PRECONDITION",
                        f"the pack plan of {group} covers parameters {planned}; this rank "
                        f"has {len(self._params)} (every rank must have the same parameters)")
        order = [i for p in plan["packs"] for i in p["indices"]]
        old = self._layout
        self._layout = _Layout(self._params, order, self._device)
        self._attach_grads()
        old.release()
        self._plan = plan
        self._pack_of = {i: k for k, p in enumerate(plan["packs"]) for i in p["indices"]}
        self._pending = [len(p["indices"]) for p in plan["packs"]]

    def step(self, closure=None):
        """Steps the wrapped optimizer: the gradients are already reduced (by the end of
        backward); re-broadcasts the parameters first when bcast_period says so."""
        if self._distributed:
            if self._works or self._fired:
                self._finish_reduction()  # a backward whose end callback never ran
            if self._stash:
                # Accumulated under no_sync() after a synchronised backward, and not reduced
                # since: grad already shows reduced + local, as with DDP.
                self._stash, self._local = {}, {}
            if self._param_pack and self._plan is None and self._order_done:
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
            parts = [p.detach().reshape(-1) for p in params]
            if self._device is None:
                flat = torch.cat(parts)
            else:  # in CUDA memory, so the broadcast goes to the daemon where it is
                numel = sum(p.numel() for p in params)
                size = torch.empty((), dtype=dtype).element_size()
                flat = _cuda.api().empty(numel * size, self._device).view(dtype)
                torch.cat(parts, out=flat)
            _ops.broadcast(flat, src=root, group=self._group, name="bcast_param",
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
    """Completes DDP's futures as gradsync's ops finish, on one background thread.

    The thread never outlives the session: gradsync.shutdown() (also at interpreter exit) ends
    the session, which fails the op it waits on within a few tens of milliseconds, then stops
    and joins it; futures still queued fail with gradsync.Error. A forked child starts with
    none (the parent's thread does not exist there)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._queue = []
        self._thread = None
        self._stopping = False

    def add(self, work, future, stream=None):
        """Completes `future` with `work`'s outcome; on CUDA with `stream` (the stream the hook
        ran on, backward's) current, so that its waiters wait on backward's stream, as with
        torch's NCCL backend, not on a thread's default stream."""
        with self._cv:
            self._queue.append((work, future, stream))
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="gradsync-ddp",
                                                daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self):
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if not self._queue:
                    return
                work, future, stream = self._queue.pop(0)
            try:
                if stream is None:
                    future.set_result(work.wait())
                else:
                    with _cuda.api().use_stream(stream):
                        future.set_result(work.wait())
            except Exception as e:  # noqa: BLE001 - handed to DDP, which raises it in backward
                future.set_exception(e)

    def stop(self, timeout_s=10.0):
        """Lets the thread finish what is queued (the session is closed by now, so every wait
        returns at once) and joins it."""
        with self._cv:
            thread, self._thread = self._thread, None
            self._stopping = True
            self._cv.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def forget(self):
        with self._cv:
            self._thread = None
            self._queue = []
            self._stopping = False


_completer = _Completer()
_ops.on_shutdown(_completer.stop)
os.register_at_fork(after_in_child=_completer.forget)
_process_group.register(_completer)  # torch.distributed's backend "gradsync"


def register_backend():
    """Registers torch.distributed's backend "gradsync" (importing this module does). The
    package's entry point (group torch.distributed.backends): torch 2.x calls it when a script
    names the backend without importing gradsync.torch."""
    _process_group.register(_completer)


def allreduce_hook(state, bucket):
    """A DDP communication hook: each bucket is averaged through gradsync.

        ddp.register_comm_hook(state=None, hook=gradsync.torch.allreduce_hook)

    `state` may be a gradsync.Group (None: WORLD).
    On CUDA buckets the reduction is stream ordered: it starts after the stream that filled the
    bucket (the hook's current stream, backward's), and the future is a CUDA-aware one completed
    with that stream current, so its waiters' streams wait for the daemon's write through it
    (no host synchronisation), as with torch's NCCL backend.
    """
    group = state if isinstance(state, _ops.Group) else WORLD
    tensor = bucket.buffer()
    work = _ops.all_reduce(tensor, op="mean", group=group, async_op=True,
                           name=f"ddp{bucket.index()}")
    device = _cuda.api().device_of(tensor)
    if device is None:
        future = torch.futures.Future()
        _completer.add(work, future)
        return future
    future = _cuda.api().future(device)
    _completer.add(work, future, _cuda.api().current_stream(device))
    return future


def init_process_group(**kwargs):
    """torch.distributed's default group on the backend "gradsync", over this process's gradsync
    session as it is now (gradsync.init() first, when it is not open): its rank and world size
    are gradsync.get_rank() and gradsync.get_world_size(). A default group already there is
    destroyed first. In an elastic job, call it at the top of the function gradsync.elastic.run
    runs (and build DDP or FSDP2 there): after a membership change the run decorator calls that
    function again, and the group is made again for the new membership. kwargs go to
    torch.distributed.init_process_group (timeout, device_id, ...).

    No rendezvous of torch's is needed (the session's ranks are the job's already): torch's
    store is the job's store in gradsync (a SessionStore; torch's keys under "torch/")."""
    import torch.distributed as dist  # noqa: PLC0415 - only where a process group is made
    if not _ops.is_initialized():
        _ops.init()
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(_process_group.NAME, store=_process_group.SessionStore(),
                            rank=_ops.get_rank(), world_size=_ops.get_world_size(),
                            **kwargs)
