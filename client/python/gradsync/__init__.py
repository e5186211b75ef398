"""gradsync for Python trainers: collectives on tensors through the node's gradsyncd.

    import gradsync
    gradsync.init()                      # torchrun's RANK/WORLD_SIZE/LOCAL_* from the environment
    gradsync.all_reduce(t, op="mean")    # in place, like torch.distributed
    work = gradsync.all_reduce(t, async_op=True); ...; work.wait()

Tensors that live in gradsync's shared memory (gradsync.empty, and the gradients of
gradsync.torch.DistributedOptimizer) go to the daemon as they are; any other CPU tensor is
copied into a staging buffer and back. Every wait releases the GIL. Failures raise
gradsync.Error, whose `code` is the status name ("FAILED_PRECONDITION", "DEADLINE_EXCEEDED").
"""
import bisect
import os
import threading

import torch as _torch  # not "torch": the submodule gradsync.torch takes that name here

from . import _gradsync
from ._gradsync import Error, plan_packs

__all__ = [
    "Error", "Group", "WORLD", "Work", "init", "is_initialized", "shutdown", "get_rank",
    "get_world_size", "new_group", "empty", "all_reduce", "broadcast", "barrier", "all_gather",
    "reduce_scatter", "plan_packs", "set_pack_list", "get_pack_list", "client",
]

DEFAULT_SOCKET = "/run/gradsync/gradsyncd.sock"
DEFAULT_DAEMON_PORT = 7451

_DTYPES = {
    _torch.float32: "float32", _torch.float64: "float64", _torch.float16: "float16",
    _torch.bfloat16: "bfloat16", _torch.int32: "int32", _torch.int64: "int64",
    _torch.uint8: "uint8", _torch.int8: "int8",
}


def dtype_name(dtype):
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise TypeError(f"gradsync has no collective for {dtype}") from None


class Group:
    """Ranks that run collectives together. WORLD is every rank of the job."""

    def __init__(self, ranks=None):
        self._ranks = None if ranks is None else tuple(sorted(set(int(r) for r in ranks)))
        if self._ranks is not None and not self._ranks:
            raise ValueError("a group needs at least one rank")

    @property
    def ranks(self):
        return self._ranks if self._ranks is not None else tuple(range(_ctx().world_size))

    @property
    def key(self):
        """The group's name on the wire: 'world', or its ranks ascending joined by ','."""
        return "world" if self._ranks is None else ",".join(map(str, self._ranks))

    @property
    def size(self):
        return len(self.ranks)

    @property
    def rank(self):
        """This process's rank within the group (-1 if it is not a member)."""
        me = _ctx().rank
        return self.ranks.index(me) if me in self.ranks else -1

    def __eq__(self, other):
        return isinstance(other, Group) and self.key == other.key

    def __hash__(self):
        return hash(self.key)

    def __repr__(self):
        return f"Group({self.key})"


WORLD = Group()


class _Context:
    def __init__(self, client, job, rank, world_size, local_rank, local_world_size):
        self.client = client
        self.job = job
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.lock = threading.Lock()
        self.starts = []   # sorted start addresses of registered buffers
        self.buffers = []  # parallel: the Buffer objects
        self.free = {}     # staging buffers by size class


_context = None


def _ctx():
    if _context is None:
        raise RuntimeError("gradsync.init() has not been called")
    return _context


def _env_int(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init(job=None, rank=None, world_size=None, local_rank=None, local_world_size=None,
         root_address=None, socket=None, token_file=None, rpc_timeout=None):
    """Connects to this node's gradsyncd and registers the rank.

    Omitted arguments come from the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE. A job spanning nodes also needs the TCP address of the daemon on rank 0's
    node: `root_address`, else GRADSYNC_ROOT_ADDRESS, else MASTER_ADDR with GRADSYNC_DAEMON_PORT
    (default 7451). MASTER_PORT is not used: it is torch's own store, not the daemon.
    The job id: `job`, else GRADSYNC_JOB, else "torchrun-" + TORCHELASTIC_RUN_ID. The socket:
    `socket`, else GRADSYNC_SOCKET, else /run/gradsync/gradsyncd.sock. The cluster token (only
    for a root daemon on another node): `token_file`, else GRADSYNC_TOKEN_FILE.
    """
    global _context
    if _context is not None:
        raise RuntimeError("gradsync.init() was already called in this process")
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    if local_world_size is None:
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if job is None:
        job = os.environ.get("GRADSYNC_JOB") or (
            "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "default"))
    if root_address is None:
        root_address = os.environ.get("GRADSYNC_ROOT_ADDRESS", "")
        if not root_address and local_world_size < world_size and os.environ.get("MASTER_ADDR"):
            port = _env_int("GRADSYNC_DAEMON_PORT", DEFAULT_DAEMON_PORT)
            root_address = f"{os.environ['MASTER_ADDR']}:{port}"
    socket = socket or os.environ.get("GRADSYNC_SOCKET") or DEFAULT_SOCKET
    token_file = token_file or os.environ.get("GRADSYNC_TOKEN_FILE")
    token = ""
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    client = _gradsync.Client(socket, job, world_size, rank, local_rank, local_world_size,
                              root_address=root_address, token=token,
                              rpc_timeout_s=float(rpc_timeout or 0))
    _context = _Context(client, job, rank, world_size, local_rank, local_world_size)
    return _context


def is_initialized():
    return _context is not None


def shutdown():
    """Ends the session (the daemon fails this rank's pending ops in its groups)."""
    global _context
    _context = None


def get_rank():
    return _ctx().rank


def get_world_size():
    return _ctx().world_size


def client():
    """The underlying _gradsync.Client (store access, raw segment ops)."""
    return _ctx().client


def new_group(ranks):
    """A group of these ranks (each member must create it too; ops name it by its ranks)."""
    group = Group(ranks)
    for r in group.ranks:
        if not 0 <= r < _ctx().world_size:
            raise ValueError(f"rank {r} is outside the job (world size {_ctx().world_size})")
    return group


def _register(buf):
    ctx = _ctx()
    with ctx.lock:
        i = bisect.bisect(ctx.starts, buf.address)
        ctx.starts.insert(i, buf.address)
        ctx.buffers.insert(i, buf)


def _unregister(buf):
    ctx = _ctx()
    with ctx.lock:
        i = bisect.bisect_left(ctx.starts, buf.address)
        if i < len(ctx.buffers) and ctx.buffers[i] is buf:
            del ctx.starts[i]
            del ctx.buffers[i]


def _new_buffer(nbytes):
    buf = _ctx().client.create_buffer(max(int(nbytes), 1))
    _register(buf)
    return buf


def _release_buffer(buf):
    """Deregisters a buffer from the daemon; the mapping lives while tensors view it."""
    _unregister(buf)
    _ctx().client.destroy_buffer(buf)


def _view(buf, dtype, count, byte_offset=0):
    return _torch.frombuffer(buf, dtype=dtype, count=count, offset=byte_offset)


def empty(shape, dtype=_torch.float32):
    """A tensor in gradsync shared memory: collectives on it copy nothing."""
    shape = _torch.Size(shape if isinstance(shape, (tuple, list, _torch.Size)) else (shape,))
    count = shape.numel()
    buf = _new_buffer(count * _torch.empty((), dtype=dtype).element_size())
    return _view(buf, dtype, count).view(shape)


def _segment(tensor):
    """(buffer_id, byte_offset, count) if `tensor` is contiguous in a registered buffer."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return None
    ctx = _ctx()
    ptr = tensor.data_ptr()
    with ctx.lock:
        i = bisect.bisect(ctx.starts, ptr) - 1
        if i < 0:
            return None
        buf = ctx.buffers[i]
    end = ptr + tensor.numel() * tensor.element_size()
    if end > buf.address + buf.nbytes:
        return None
    return (buf.id, ptr - buf.address, tensor.numel())


def _size_class(nbytes):
    return max(1 << 16, 1 << (max(int(nbytes), 1) - 1).bit_length())


def _staging(nbytes):
    ctx = _ctx()
    size = _size_class(nbytes)
    with ctx.lock:
        free = ctx.free.get(size)
        if free:
            return free.pop()
    return _new_buffer(size)


def _unstage(buf):
    ctx = _ctx()
    with ctx.lock:
        ctx.free.setdefault(buf.nbytes, []).append(buf)


class Work:
    """An op in flight. wait() blocks (GIL released), copies staged results back, and returns."""

    def __init__(self, handle, finish=None, result=None, release=None):
        self._handle = handle
        self._finish = finish    # on success: copy staged results out
        self._release = release  # always, once: return staging buffers
        self._result = result
        self._lock = threading.Lock()

    def wait(self):
        with self._lock:
            try:
                self._handle.wait()  # a failed op raises the same error on every wait
                if self._finish:
                    finish, self._finish = self._finish, None
                    finish()
            finally:
                if self._handle.done() and self._release:
                    release, self._release = self._release, None
                    release()
        return self._result

    def is_completed(self):
        return self._handle.done()


def _in_place(tensors, submit, result, async_op):
    """Runs `submit(segments)` on `tensors` in place, staging those not in shared memory."""
    segments, copies, staged = [], [], []
    for t in tensors:
        seg = _segment(t)
        if seg is None:
            if t.device.type != "cpu":
                raise ValueError("gradsync collectives take CPU tensors here (GPU: NCCL plane)")
            buf = _staging(t.numel() * t.element_size())
            staged.append(buf)
            view = _view(buf, t.dtype, t.numel())
            view.copy_(t.reshape(-1))
            copies.append((t, view))
            seg = (buf.id, 0, t.numel())
        segments.append(seg)

    def finish():
        for t, view in copies:
            t.copy_(view.view_as(t))

    def release():
        for buf in staged:
            _unstage(buf)

    return _start(lambda: submit(segments), finish if copies else None, result, release,
                  async_op)


def _start(submit, finish, result, release, async_op):
    """Submits an op. Its Work copies staged results out (`finish`) and hands the staging back
    (`release`), which also happens at once if the submission itself fails."""
    try:
        handle = submit()
    except BaseException:
        release()
        raise
    work = Work(handle, finish, result, release)
    return work if async_op else work.wait()


def _timeout(timeout):
    return float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else (timeout or 0))


def all_reduce(tensor, op="sum", group=WORLD, async_op=False, name="", timeout=None):
    """In-place all-reduce of a CPU tensor: op is sum, mean (divides by the group size), min, max."""
    c = _ctx().client
    return _in_place(
        [tensor], lambda segs: c.all_reduce(dtype_name(tensor.dtype), op, segs, group.key, name,
                                            _timeout(timeout)), tensor, async_op)


def broadcast(tensor, src=0, group=WORLD, async_op=False, name="", timeout=None):
    """In-place broadcast from global rank `src` to every member of `group`."""
    ranks = group.ranks
    if src not in ranks:
        raise ValueError(f"broadcast source rank {src} is not in {group}")
    c = _ctx().client
    return _in_place(
        [tensor], lambda segs: c.broadcast(dtype_name(tensor.dtype), ranks.index(src), segs,
                                           group.key, name, _timeout(timeout)), tensor, async_op)


def barrier(group=WORLD, async_op=False, name="", timeout=None):
    work = Work(_ctx().client.barrier(group.key, name, _timeout(timeout)))
    return work if async_op else work.wait()


def _flat_staging(tensors):
    """One staging buffer holding `tensors` back to back; returns (buffer, views)."""
    total = sum(t.numel() for t in tensors)
    dtype = tensors[0].dtype
    buf = _staging(total * tensors[0].element_size())
    views, at = [], 0
    for t in tensors:
        views.append(_view(buf, dtype, t.numel(), at * t.element_size()))
        at += t.numel()
    return buf, views


def all_gather(tensor_list, tensor, group=WORLD, async_op=False, name="", timeout=None):
    """tensor_list[i] receives group member i's `tensor` (torch.distributed's argument order)."""
    if len(tensor_list) != group.size:
        raise ValueError(f"all_gather needs {group.size} output tensors, got {len(tensor_list)}")
    c = _ctx().client
    buf, views = _flat_staging([tensor] + list(tensor_list))
    views[0].copy_(tensor.reshape(-1))
    esize = tensor.element_size()
    n = tensor.numel()

    def finish():
        for out, view in zip(tensor_list, views[1:]):
            out.copy_(view.view_as(out))

    return _start(
        lambda: c.all_gather(dtype_name(tensor.dtype), [(buf.id, 0, n)],
                             [(buf.id, n * esize, n * group.size)], group.key, name,
                             _timeout(timeout)),
        finish, tensor_list, lambda: _unstage(buf), async_op)


def reduce_scatter(output, input_list, op="sum", group=WORLD, async_op=False, name="",
                   timeout=None):
    """output receives the reduction of every member's input_list[this member's group rank]."""
    if len(input_list) != group.size:
        raise ValueError(f"reduce_scatter needs {group.size} input tensors, got {len(input_list)}")
    c = _ctx().client
    buf, views = _flat_staging(list(input_list) + [output])
    for t, view in zip(input_list, views):
        view.copy_(t.reshape(-1))
    esize = output.element_size()
    n = output.numel()

    def finish():
        output.copy_(views[-1].view_as(output))

    return _start(
        lambda: c.reduce_scatter(dtype_name(output.dtype), op, [(buf.id, 0, n * group.size)],
                                 [(buf.id, n * group.size * esize, n)], group.key, name,
                                 _timeout(timeout)),
        finish, output, lambda: _unstage(buf), async_op)


def set_pack_list(plan, group=WORLD):
    """Stores a pack plan (as plan_packs returns it) for `group` in the job's store."""
    _ctx().client.set_pack_list(group.key, plan)


def get_pack_list(group=WORLD, timeout=60.0):
    """Waits for `group`'s pack plan in the job's store (gradsync.Error at the deadline)."""
    return _ctx().client.get_pack_list(group.key, _timeout(timeout))
