"""torch.distributed's backend "gradsync": the daemon's collectives under torch.distributed.

`import gradsync.torch` registers it (Backend.register_backend, CPU and CUDA tensors); torch 2.x
also finds it, unimported, through the package's entry point (torch.distributed.backends):

    dist.init_process_group("gradsync")        # under torchrun; or "cpu:gradsync,cuda:gradsync"
    model = DistributedDataParallel(model)     # or fully_shard(model), dist.all_reduce(t), ...

The default group opens this process's gradsync session (gradsync.init() with torch's rank and
world size; the job, socket and root address from the environment as gradsync.init() reads it)
or uses the one already open (its rank and world size must be torch's). dist.new_group(ranks,
backend="gradsync") is a gradsync.Group of those ranks. Each op is one gradsync op, named by its
kind; failures raise the daemon's gradsync.Error (MembershipChanged in an elastic job) from
Work.wait(), and from the op itself when it could not be submitted.

torch >= 2: a c10d Backend of torch's own ProcessGroup, so everything that reaches a process group
from C++ (DDP's reducer, functional collectives, FSDP2) reaches the daemon. torch 1.13: the
process group itself (a Python subclass of torch's ProcessGroup), as that torch's API allows;
there every op completes before it returns (see _work), so nothing overlaps the ops.
"""
import inspect
import threading

import torch
import torch.distributed as dist

from . import _cuda, _native, _ops

NAME = "gradsync"
_c10d = torch._C._distributed_c10d
# torch >= 2: Backend (the ProcessGroup is torch's); 1.13: the ProcessGroup itself.
_BASE = getattr(_c10d, "Backend", None) or dist.ProcessGroup
_UNSET_TIMEOUT_S = 0  # torch's "unset" op timeout is negative: the group's own applies
_RANK_KEY = "gradsync/global_rank/"
_completer = None  # gradsync.torch's, which completes futures (register())

_REDUCE_OPS = (("SUM", "sum"), ("AVG", "mean"), ("MIN", "min"), ("MAX", "max"))

# Ops the daemon does not run, and what to use instead.
_UNSUPPORTED = {
    "send": "gradsync runs collectives only; for point-to-point make a gloo or nccl group "
            "beside it (dist.new_group(ranks, backend=\"gloo\"))",
    "alltoall": "use all_gather and keep your share, or a gloo or nccl group for all-to-all",
    "monitored_barrier": "use barrier (its failure names the ranks that did not come)",
    "allreduce_sparse": "densify the tensor (tensor.to_dense()) before all_reduce",
}
_UNSUPPORTED.update({
    "recv": _UNSUPPORTED["send"], "recv_anysource": _UNSUPPORTED["send"],
    "all_to_all_single": _UNSUPPORTED["alltoall"], "alltoall_base": _UNSUPPORTED["alltoall"],
})


def _not_supported(op):
    def refuse(self, *args, **kwargs):
        raise RuntimeError(f"gradsync: {op} is not supported: {_UNSUPPORTED[op]}")
    refuse.__name__ = op
    return refuse


def _reduce_name(opts):
    """gradsync's name of the reduction torch's options ask for (SUM without options)."""
    op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
    for torch_name, name in _REDUCE_OPS:
        if op == getattr(dist.ReduceOp, torch_name, None):
            return name
    name = str(getattr(op, "op", op)).rsplit(".", 1)[-1]  # RedOpType.PRODUCT -> PRODUCT
    raise ValueError(f"gradsync reduces with SUM, AVG, MIN or MAX, not {name}")


def _root(opts):
    """The group rank torch's options name as the root (0 without options)."""
    return opts.rootRank if opts is not None else 0


def _one(tensors, op):
    if len(tensors) != 1:
        raise ValueError(f"gradsync: {op} takes one tensor per process, got {len(tensors)}")
    return tensors[0]


def _movable(t):
    """`t` as gradsync moves it: its own dtype, or its bytes for a dtype gradsync does not
    reduce (bool, complex), which ops that only move data (broadcast, all_gather) still carry."""
    if t.dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32,
                   torch.int64, torch.uint8, torch.int8):
        return t
    if not t.is_contiguous():
        raise TypeError(f"gradsync moves {t.dtype} tensors as bytes: they must be contiguous")
    return t.view(torch.uint8)


class _Work(dist._Work):
    """A c10d Work over gradsync ops: wait() waits for them all (raising the first failure, on
    every wait), then runs `finish` once (copies out of a temporary, on the current stream);
    a wait that returns finds it done, also while another thread (the future's) waits."""

    def __init__(self, works, result, finish=None, device=None):
        super().__init__()
        self._works = works
        self._result = result
        self._finish = finish
        self._finish_lock = threading.Lock()
        self._device = device  # a CUDA device index, or None

    def wait(self, timeout=None):  # noqa: ARG002 - each gradsync op has its own deadline
        for w in self._works:
            w.wait()
        with self._finish_lock:
            if self._finish is not None:
                self._finish()
                self._finish = None
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    def is_success(self):
        return self.exception() is None if self.is_completed() else False

    def exception(self):
        if not self.is_completed():
            return None
        try:
            self.wait()
        except Exception as e:  # noqa: BLE001 - handed back as the op's outcome
            return e
        return None

    def result(self):
        return self._result

    def get_future(self):
        """A torch future of the op's output tensors, or of its error; on CUDA a CUDA-aware one
        whose waiters' streams wait for the op (as with torch's NCCL backend). gradsync.torch's
        completer thread completes an inner future; what torch gets is a then() of it, because
        Future.set_exception only stores the exception as the value (which C++, DDP's reducer
        among them, would take for the tensors), while an exception raised in a then() callback
        is a real error of the future it makes."""
        work = self

        class _Outcome:
            @staticmethod
            def wait():
                work.wait()
                return work._result

        if self._device is None:
            inner = torch.futures.Future()
            _completer.add(_Outcome, inner)
        else:
            inner = _cuda.api().future(self._device)
            _completer.add(_Outcome, inner, _cuda.api().current_stream(self._device))
        return inner.then(_value)


def _value(future):
    return future.value()  # raises the op's error


def _work(works, result, finish, device):
    """The Work torch gets. torch 1.13's C++ waits on a Work's own state, which a Python
    subclass cannot set, and its Work over a future drops the future's error: there each op
    completes (or raises its error) before it returns, and torch gets a completed Work."""
    work = _Work(works, result, finish, device)
    if _BASE is not dist.ProcessGroup:
        return work
    work.wait()
    done = torch.futures.Future()
    done.set_result(result)
    return _c10d._create_work_from_future(done)


def _joined(works, result, tensors):
    """One Work over the Works of a coalesced op's parts (on `tensors`' device)."""
    return _work(works, result, None, _cuda.api().device_of(tensors[0]) if tensors else None)


class ProcessGroupGradsync(_BASE):
    """gradsync's c10d backend (see the module's doc). Made by torch.distributed when a group's
    backend is "gradsync"; not constructed directly."""

    def __init__(self, rank, size, group, timeout_s):
        super().__init__(rank, size)
        self._group = group        # the gradsync.Group of the process group's ranks
        self._timeout_s = timeout_s

    def getBackendName(self):
        return NAME

    def __repr__(self):
        return f"ProcessGroupGradsync(rank={self.rank()}, size={self.size()}, {self._group!r})"

    # ---- helpers ----
    def _timeout(self, opts):
        t = getattr(opts, "timeout", None)
        s = t.total_seconds() if t is not None else -1
        return s if s > _UNSET_TIMEOUT_S else self._timeout_s

    def _start(self, call, result, tensor, finish=None):
        return _work([call()], result, finish, _cuda.api().device_of(tensor))

    # ---- collectives ----
    def allreduce(self, tensors, opts=None):
        t = _one(tensors, "allreduce")
        op = _reduce_name(opts)
        return self._start(lambda: _ops.all_reduce(
            t, op=op, group=self._group, async_op=True, name="allreduce",
            timeout=self._timeout(opts)), tensors, t)

    def allreduce_coalesced(self, tensors, opts=None):
        """One op on a flat copy of the tensors (torch checks they share a dtype)."""
        if not tensors:
            raise ValueError("gradsync: allreduce_coalesced needs at least one tensor")
        op = _reduce_name(opts)
        flat = torch.cat([t.reshape(-1) for t in tensors])

        def finish():
            at = 0
            for t in tensors:
                t.copy_(flat[at:at + t.numel()].view_as(t))
                at += t.numel()

        return self._start(lambda: _ops.all_reduce(
            flat, op=op, group=self._group, async_op=True, name="allreduce_coalesced",
            timeout=self._timeout(opts)), tensors, flat, finish)

    def broadcast(self, tensors, opts=None):
        t = _one(tensors, "broadcast")
        src = self._group.ranks[_root(opts)]
        return self._start(lambda: _ops.broadcast(
            _movable(t), src=src, group=self._group, async_op=True, name="broadcast",
            timeout=self._timeout(opts)), tensors, t)

    def allgather(self, output_tensors, input_tensors, opts=None):
        t = _one(input_tensors, "allgather")
        outs = _one(output_tensors, "allgather")
        return self._start(lambda: _ops.all_gather(
            [_movable(o) for o in outs], _movable(t), group=self._group, async_op=True,
            name="allgather", timeout=self._timeout(opts)), output_tensors, t)

    def all_gather_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        """all_gather_into_tensor: member i's input into the i-th slice of `output`."""
        if output.numel() != input.numel() * self.size():
            raise ValueError(f"gradsync: all_gather_into_tensor needs an output of "
                             f"{self.size()} x {input.numel()} elements, got {output.numel()}")
        outs = list(_movable(output).reshape(-1).chunk(self.size())) if output.numel() else \
            [output.reshape(-1)] * self.size()
        return self._start(lambda: _ops.all_gather(
            outs, _movable(input), group=self._group, async_op=True,
            name="all_gather_into_tensor", timeout=self._timeout(opts)), [output], input)

    _allgather_base = all_gather_single  # its name in torch 1.13

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """all_gather_coalesced: output_lists[i][j] receives member i's input_list[j]."""
        works = [self.allgather([[outs[j] for outs in output_lists]], [t], opts)
                 for j, t in enumerate(input_list)]
        return _joined(works, output_lists, input_list)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined(works, outputs, inputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        out = _one(output_tensors, "reduce_scatter")
        ins = _one(input_tensors, "reduce_scatter")
        op = _reduce_name(opts)
        return self._start(lambda: _ops.reduce_scatter(
            out, list(ins), op=op, group=self._group, async_op=True, name="reduce_scatter",
            timeout=self._timeout(opts)), output_tensors, out)

    def reduce_scatter_single(self, output, input, opts=None):  # noqa: A002 - torch's names
        """reduce_scatter_tensor: the reduction of every member's i-th slice of `input` into
        member i's `output`."""
        if input.numel() != output.numel() * self.size():
            raise ValueError(f"gradsync: reduce_scatter_tensor needs an input of "
                             f"{self.size()} x {output.numel()} elements, got {input.numel()}")
        op = _reduce_name(opts)
        ins = list(input.reshape(-1).chunk(self.size())) if input.numel() else \
            [input.reshape(-1)] * self.size()
        return self._start(lambda: _ops.reduce_scatter(
            output, ins, op=op, group=self._group, async_op=True,
            name="reduce_scatter_tensor", timeout=self._timeout(opts)), [output], output)

    _reduce_scatter_base = reduce_scatter_single  # its name in torch 1.13

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return _joined(works, outputs, outputs)

    def reduce(self, tensors, opts=None):
        """The reduction into the root's tensor; the others' tensors are left as they were."""
        t = _one(tensors, "reduce")
        root = _root(opts)
        mine = t if self.rank() == root else t.clone()
        op = _reduce_name(opts)
        return self._start(lambda: _ops.all_reduce(
            mine, op=op, group=self._group, async_op=True, name="reduce",
            timeout=self._timeout(opts)), tensors, t)

    def gather(self, output_tensors, input_tensors, opts=None):
        """Every member's input into the root's outputs (an all_gather: the others gather into a
        temporary they drop)."""
        t = _one(input_tensors, "gather")
        root = _root(opts)
        outs = _one(output_tensors, "gather") if self.rank() == root else \
            [torch.empty_like(t) for _ in range(self.size())]
        return self._start(lambda: _ops.all_gather(
            [_movable(o) for o in outs], _movable(t), group=self._group, async_op=True,
            name="gather", timeout=self._timeout(opts)), output_tensors, t)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """The root's i-th input into member i's output (a broadcast of the root's inputs, each
        member keeping its slice)."""
        out = _one(output_tensors, "scatter")
        root = _root(opts)
        n = out.numel()
        if self.rank() == root:
            flat = torch.cat([i.reshape(-1) for i in _one(input_tensors, "scatter")])
        else:
            flat = torch.empty(n * self.size(), dtype=out.dtype, device=out.device)
        me = self.rank()

        def finish():
            out.copy_(flat[me * n:(me + 1) * n].view_as(out))

        return self._start(lambda: _ops.broadcast(
            flat, src=self._group.ranks[root], group=self._group, async_op=True, name="scatter",
            timeout=self._timeout(opts)), output_tensors, out, finish)

    def barrier(self, opts=None):
        return _work([_ops.barrier(group=self._group, async_op=True, name="barrier",
                                       timeout=self._timeout(opts))], [], None, None)


for _op in _UNSUPPORTED:
    setattr(ProcessGroupGradsync, _op, _not_supported(_op))


class SessionStore(dist.Store):
    """A torch.distributed Store over this process's gradsync session: the job's store in its
    root daemon, keys under "torch/" (each elastic epoch is a job of its own, so its keys start
    empty). What init_process_group and new_group ask of a store: set, get, add, wait, check.
    Waits end at `timeout_s` (gradsync.Error DEADLINE_EXCEEDED)."""

    _PREFIX = "torch/"

    def __init__(self, timeout_s=300.0):
        super().__init__()
        self._client = _ops.client()
        self._timeout_s = float(timeout_s)

    def set(self, key, value):
        self._client.store_set(self._PREFIX + key,
                               value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key):
        return self._client.store_get(self._PREFIX + key, self._timeout_s)

    def add(self, key, value):
        return self._client.store_add(self._PREFIX + key, value)

    def wait(self, keys, timeout=None):
        t = self._timeout_s if timeout is None else timeout.total_seconds()
        for key in keys:
            self._client.store_get(self._PREFIX + key, t)

    def check(self, keys):
        try:
            for key in keys:
                self._client.store_get(self._PREFIX + key, 0.001)
        except _native.Error as e:
            if e.code == "DEADLINE_EXCEEDED":
                return False
            raise
        return True


def _global_ranks(store, rank, size, ranks):
    """The process group's members' global ranks, in group-rank order. torch >= 2 says them;
    torch 1.13 does not, so its members tell each other through the group's store."""
    if ranks:
        return list(ranks)
    if not dist.is_initialized():  # the default group: every rank
        return list(range(size))
    store.set(f"{_RANK_KEY}{rank}", str(dist.get_rank()))
    return [int(store.get(f"{_RANK_KEY}{r}")) for r in range(size)]


def _create(*args):
    """torch's creator: (store, rank, size, timeout) on torch 1.13; (DistributedBackendOptions,
    backend options) on torch >= 2 (extended_api)."""
    if len(args) == 2:
        o = args[0]
        store, rank, size, timeout = o.store, o.group_rank, o.group_size, o.timeout
        ranks = list(o.global_ranks_in_group)
    else:
        store, rank, size, timeout = args
        ranks = None
    ranks = _global_ranks(store, rank, size, ranks)
    timeout_s = timeout.total_seconds() if timeout is not None else 0
    if not dist.is_initialized() and not _ops.is_initialized():
        _ops.init(rank=rank, world_size=size)  # the rest from the environment
    world = _ops.get_world_size()
    if not dist.is_initialized() and (_ops.get_rank(), world) != (rank, size):
        raise ValueError(
            f"gradsync: torch.distributed's rank {rank} of {size} is not this process's gradsync "
            f"session's rank {_ops.get_rank()} of {world}: init_process_group with "
            f"rank=gradsync.get_rank(), world_size=gradsync.get_world_size()")
    if ranks != sorted(ranks) or ranks[rank] != _ops.get_rank():
        raise ValueError(f"gradsync: a group's ranks must be in ascending order with this "
                         f"process at its group rank ({ranks}, group rank {rank})")
    group = _ops.WORLD if ranks == list(range(world)) else _ops.new_group(ranks)
    return ProcessGroupGradsync(rank, size, group, timeout_s)


def register(completer):
    """Registers "gradsync" with torch.distributed (once; import gradsync.torch does it, with
    its completer of futures)."""
    global _completer
    _completer = completer
    if NAME.upper() in getattr(dist.Backend, "_plugins", {}):
        return
    params = inspect.signature(dist.Backend.register_backend).parameters
    if "devices" in params:  # torch >= 2
        dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])
    else:
        dist.Backend.register_backend(NAME, _create)
