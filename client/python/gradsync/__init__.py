"""gradsync for Python trainers: collectives through the node's gradsyncd.

    import gradsync
    gradsync.init()                      # torchrun's RANK/WORLD_SIZE/LOCAL_* from the environment
    gradsync.all_reduce(t, op="mean")    # in place, like torch.distributed
    work = gradsync.all_reduce(t, async_op=True); ...; work.wait()

Collectives take torch tensors (CPU or CUDA) or any writable buffer-protocol object
(bytearray, array.array, memoryview, numpy arrays; the dtype comes from the buffer's format),
with or without elements (all_reduce's doc lists the dtypes).
torch is needed only for tensors and gradsync.torch: the package is pure Python over the C ABI
(libgradsync_c.so, with ctypes), so it loads in any CPython 3.9+ from one build.

CUDA tensors go to the daemon where they are (CUDA IPC), stream ordered like torch.distributed's
NCCL backend and without synchronising the host: the daemon starts after the work queued so far
on the current stream, and the current stream continues after the daemon's write once the call
returns (async_op: once Work.wait() returns). Each CUDA allocation is registered once, on first
use (see _device.py).

Tensors that live in gradsync's shared memory (gradsync.empty, views of
gradsync.shared_buffer, and the gradients of gradsync.torch.DistributedOptimizer) go to the daemon as they are; anything else is copied into
a staging buffer and back. Every wait releases the GIL and wakes up every few tens of
milliseconds, so Ctrl-C raises KeyboardInterrupt at once; an op interrupted that way ends the
session (the daemon fails the op on the other ranks, naming this one). Failures raise
gradsync.Error, whose `code` is the status name ("FAILED_PRECONDITION", "DEADLINE_EXCEEDED").
"""
import atexit
import bisect
import ctypes
import os
import sys
import threading

from . import _cuda, _device, _native, elastic
from ._native import Error, plan_packs
from .elastic import MembershipChanged
from .elastic import _join as _elastic_join

__all__ = [
    "Error", "Group", "WORLD", "Work", "init", "is_initialized", "shutdown", "get_rank",
    "get_world_size", "new_group", "empty", "shared_buffer", "dtype_name", "all_reduce",
    "broadcast", "barrier", "all_gather", "reduce_scatter", "plan_packs", "set_pack_list",
    "get_pack_list", "client", "MembershipChanged",
]

DEFAULT_SOCKET = "/run/gradsync/gradsyncd.sock"
DEFAULT_DAEMON_PORT = 7451


def _torch():
    import torch
    return torch


def _is_tensor(x):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


_TORCH_DTYPES = {}


def dtype_name(dtype):
    """gradsync's name of a torch dtype ("float32"), or a name already (checked). TypeError for
    a torch dtype gradsync has no collective for, gradsync.Error (INVALID_ARGUMENT) for an
    unknown name."""
    if isinstance(dtype, str):
        _native.dtype_code(dtype)
        return dtype
    if not _TORCH_DTYPES:
        t = _torch()
        _TORCH_DTYPES.update({
            t.float32: "float32", t.float64: "float64", t.float16: "float16",
            t.bfloat16: "bfloat16", t.int32: "int32", t.int64: "int64", t.uint8: "uint8",
            t.int8: "int8"})
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"gradsync has no collective for {dtype}") from None


_FORMATS = {"f": "float32", "d": "float64", "e": "float16", "b": "int8", "B": "uint8",
            "c": "uint8"}


def _format_dtype(fmt, itemsize):
    """gradsync's dtype of a buffer-protocol format ('f', '<d', 'q', ...)."""
    code = fmt.lstrip("@=<")
    if fmt[:1] in (">", "!") and sys.byteorder == "little":
        raise TypeError(f"gradsync takes native byte order, not buffer format '{fmt}'")
    if code in _FORMATS:
        return _FORMATS[code]
    if code in ("i", "l", "q", "n") and itemsize in (4, 8):
        return "int32" if itemsize == 4 else "int64"
    raise TypeError(f"gradsync has no collective for buffer format '{fmt}' "
                    "(float32/64, float16, int8/32/64, uint8)")


class Group:
    """Ranks that run collectives together. WORLD is every rank of the job.

    In an elastic job a group follows the membership: after a change (gradsync.elastic.reset)
    its ranks are its surviving members' new ranks, the same on every survivor; ranks joining
    enter WORLD only (a joiner, or code making a group after a change, names the ranks of the
    membership it runs in: get_rank(), get_world_size()). A group whose members were all lost
    has rank -1 and size 0 everywhere, and an op on it fails saying why. Its key (and hash)
    change with its ranks: do not keep groups as dict keys across a change."""

    _made = None  # the groups of explicit ranks by id (a WeakValueDictionary, once one is made)

    def __init__(self, ranks=None):
        self._ranks = None if ranks is None else tuple(sorted(set(int(r) for r in ranks)))
        self._gone = None  # why it has no members left (an elastic change lost them all)
        if self._ranks is not None and not self._ranks:
            raise ValueError("a group needs at least one rank")
        if self._ranks is not None:
            if Group._made is None:  # by identity: equal groups are each followed
                import weakref  # noqa: PLC0415 - only groups of explicit ranks need it
                Group._made = weakref.WeakValueDictionary()
            Group._made[id(self)] = self

    @classmethod
    def _follow(cls, change):
        """Every group of explicit ranks takes the membership `change` (a MembershipChanged)
        made: lost ranks leave, the others take their new ranks (survivors keep their order)."""
        lost = sorted(change.lost_ranks)
        for group in list((cls._made or {}).values()):
            if group._gone is not None:
                continue
            old = group._ranks
            group._ranks = tuple(r - bisect.bisect_left(lost, r) for r in old
                                 if r not in change.lost_ranks)
            if not group._ranks:
                group._gone = (f"group {','.join(map(str, old))} has no members left: membership "
                               f"change to epoch {change.epoch} lost rank(s) "
                               f"{','.join(map(str, lost))}")

    @property
    def ranks(self):
        """The members' global ranks, ascending."""
        if self._gone is not None:
            raise Error("FAILED_PRECONDITION", self._gone)
        return self._ranks if self._ranks is not None else tuple(range(_ctx().world_size))

    @property
    def key(self):
        """The group's name on the wire: 'world', or its ranks ascending joined by ','."""
        return "world" if self._ranks is None else ",".join(map(str, self.ranks))

    @property
    def size(self):
        """The number of members."""
        return 0 if self._gone is not None else len(self.ranks)

    @property
    def rank(self):
        """This process's rank within the group (-1 if it is not a member)."""
        if self._gone is not None:
            return -1
        me = _ctx().rank
        return self.ranks.index(me) if me in self.ranks else -1

    def __eq__(self, other):
        return (isinstance(other, Group) and self._ranks == other._ranks
                and self._gone == other._gone)

    def __hash__(self):
        return hash(self._ranks)

    def __repr__(self):
        if self._gone is not None:
            return "Group(no members left)"
        return f"Group({'world' if self._ranks is None else ','.join(map(str, self._ranks))})"


WORLD = Group()


class _Context:
    def __init__(self, client, job, rank, world_size, local_rank, local_world_size):
        self.client = client
        self.job = job
        # Elastic jobs (gradsync.elastic): the job's own id, this membership's epoch (the
        # session's job id is "<base_job>.e<epoch>" past 0), and the change it saw, once.
        self.base_job = job
        self.epoch = 0
        self.elastic = False
        self.min_world_size = 1
        self.root_address = ""
        self.connect = {}  # init()'s connection arguments, for a reset to the next epoch
        self.membership_change = None
        self.joined = False  # this session joined a running elastic job (init(join=True))
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.local_world_size = local_world_size
        self.lock = threading.Lock()
        self.device = _device.Registry(client)  # CUDA allocations registered so far
        self.starts = []   # sorted start addresses of registered buffers
        self.buffers = []  # parallel: the Buffer objects
        self.free = {}     # staging buffers by size class


_context = None
_shutdown_hooks = []  # called at shutdown once the session is closed (gradsync.torch's thread)


def _ctx():
    if _context is None:
        raise RuntimeError("gradsync.init() has not been called")
    return _context


def _env_int(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def init(job=None, rank=None, world_size=None, local_rank=None, local_world_size=None,
         root_address=None, socket=None, token_file=None, rpc_timeout=None, tls=None,
         elastic=None, min_world_size=None, join=None, _epoch=0):
    """Connects to this node's gradsyncd and registers the rank.

    Omitted arguments come from the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE. A job spanning nodes also needs the TCP address of the daemon on rank 0's
    node: `root_address`, else GRADSYNC_ROOT_ADDRESS, else MASTER_ADDR with GRADSYNC_DAEMON_PORT
    (default 7451). MASTER_PORT is not used: it is torch's own store, not the daemon.
    The job id: `job`, else GRADSYNC_JOB, else "torchrun-" + TORCHELASTIC_RUN_ID. The socket:
    `socket`, else GRADSYNC_SOCKET, else /run/gradsync/gradsyncd.sock. A root daemon on another
    node is reached with the client credential the local daemon hands out (no file needed);
    `token_file`, else GRADSYNC_TOKEN_FILE, sends the cluster token instead (a daemon's key:
    for tools of the cluster's operators, not trainers). Mutual TLS to a
    root daemon started with --tls_*: `tls` = (cert, key, ca) PEM file paths, else
    GRADSYNC_TLS_CERT, GRADSYNC_TLS_KEY and GRADSYNC_TLS_CA.
    `elastic` (else GRADSYNC_ELASTIC=1): the job goes on when one of its nodes is lost, with at
    least `min_world_size` ranks (else GRADSYNC_MIN_WORLD_SIZE, default 1): see gradsync.elastic.
    `join` (else GRADSYNC_JOIN=1): this node joins the running elastic job as a replacement or
    an extra node; `rank` and `world_size` are ignored (the job gives them, at its ranks' next
    state.commit(); waiting at most GRADSYNC_JOIN_TIMEOUT seconds, default 300).
    After shutdown() (or a session ended by Ctrl-C) init() may be called again.
    """
    global _context
    if _context is not None:
        if not _context.client.closed:
            raise RuntimeError("gradsync.init() was already called in this process")
        _context = None
    rank = _env_int("RANK", 0) if rank is None else rank
    world_size = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
    local_rank = _env_int("LOCAL_RANK", rank) if local_rank is None else local_rank
    if local_world_size is None:
        local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if job is None:
        job = os.environ.get("GRADSYNC_JOB") or (
            "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "default"))
    if join is None:
        join = os.environ.get("GRADSYNC_JOIN", "") not in ("", "0")
    if root_address is None:
        root_address = os.environ.get("GRADSYNC_ROOT_ADDRESS", "")
        if (not root_address and (local_world_size < world_size or join)
                and os.environ.get("MASTER_ADDR")):
            port = _env_int("GRADSYNC_DAEMON_PORT", DEFAULT_DAEMON_PORT)
            root_address = f"{os.environ['MASTER_ADDR']}:{port}"
    socket = socket or os.environ.get("GRADSYNC_SOCKET") or DEFAULT_SOCKET
    token_file = token_file or os.environ.get("GRADSYNC_TOKEN_FILE")
    token = ""
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    if tls is None:
        tls = tuple(os.environ.get(f"GRADSYNC_TLS_{k}") for k in ("CERT", "KEY", "CA"))
    if elastic is None:
        elastic = os.environ.get("GRADSYNC_ELASTIC", "") not in ("", "0")
    if min_world_size is None:
        min_world_size = _env_int("GRADSYNC_MIN_WORLD_SIZE", 1)
    connect = {"root_address": root_address, "socket": socket, "token_file": token_file,
               "rpc_timeout": rpc_timeout, "tls": tls}
    if join:
        if not elastic:
            raise Error("INVALID_ARGUMENT", f"job {job}: join=True needs elastic=True")
        # The job's own min_world_size: the joiners wait (or not) as its other ranks do.
        _epoch, rank, world_size, min_world_size = _elastic_join(
            job, local_rank, local_world_size, socket, connect)
    session_job = job if _epoch == 0 else f"{job}.e{_epoch}"
    client = _native.Client(socket, session_job, world_size, rank, local_rank, local_world_size,
                            root_address=root_address, token=token,
                            rpc_timeout_s=float(rpc_timeout or 0), tls=tls,
                            elastic=bool(elastic), epoch=_epoch)
    ctx = _Context(client, session_job, rank, world_size, local_rank, local_world_size)
    ctx.base_job, ctx.epoch, ctx.elastic = job, _epoch, bool(elastic)
    ctx.min_world_size, ctx.root_address = int(min_world_size), root_address
    ctx.connect, ctx.joined = connect, bool(join)
    _context = ctx
    return _context


def _open_store(job, connect):
    """A client of job `job`'s store alone (no session), reached as init()'s `connect` says."""
    token = ""
    if connect.get("token_file"):
        with open(connect["token_file"]) as f:
            token = f.read().strip()
    return _native.Client(connect["socket"], job, 0, 0, 0, 0,
                          root_address=connect.get("root_address") or "", token=token,
                          rpc_timeout_s=float(connect.get("rpc_timeout") or 0),
                          tls=connect.get("tls"), store_only=True)


def _reinit(change):
    """An elastic job's next epoch (gradsync.elastic.reset): this session ends, the rank
    registers again as `change` says."""
    ctx = _ctx()
    shutdown()
    Group._follow(change)
    init(job=ctx.base_job, rank=change.rank, world_size=change.world_size,
         local_rank=ctx.local_rank, local_world_size=ctx.local_world_size, elastic=True,
         min_world_size=ctx.min_world_size, join=False, _epoch=change.epoch, **ctx.connect)


def is_initialized():
    """True while this process has a session (after init(), before shutdown())."""
    return _context is not None and not _context.client.closed


def shutdown():
    """Ends the session: the daemon fails this rank's pending ops in its groups. Threads the
    package started are then stopped and joined; buffers stay mapped while tensors view them.
    Runs by itself at interpreter exit; init() may follow."""
    global _context
    ctx, _context = _context, None
    if ctx is not None:
        ctx.client.close()  # waits in other threads return within _native.WAKE_S
        ctx.device.drop()   # the daemon dropped the CUDA registrations with the session
    for hook in list(_shutdown_hooks):
        hook()


def _interrupted():
    """A wait was interrupted (KeyboardInterrupt): its op stays pending in the daemon, so end
    the session, which fails it on the other ranks naming this one."""
    shutdown()


def _after_fork_in_child():
    # The parent's session (its gRPC stream, its threads) is not ours: drop it untouched.
    global _context
    ctx, _context = _context, None
    if ctx is not None:
        ctx.client.forget()


_native.on_interrupt = _interrupted
atexit.register(shutdown)
os.register_at_fork(after_in_child=_after_fork_in_child)


def get_rank():
    """This process's rank in the job (RuntimeError before init())."""
    return _ctx().rank


def get_world_size():
    """The number of ranks in the job (RuntimeError before init())."""
    return _ctx().world_size


def client():
    """The underlying session (gradsync._native.Client: store access, raw segment ops)."""
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
    """`count` elements of `dtype` at `byte_offset` in `buf`, sharing its memory. No element:
    an empty tensor (torch.frombuffer refuses a count of 0; there is nothing to share)."""
    if count == 0:
        return _torch().empty(0, dtype=dtype)
    return _torch().frombuffer(buf, dtype=dtype, count=count, offset=byte_offset)


def empty(shape, dtype=None):
    """A tensor in gradsync shared memory (float32 by default): collectives on it copy nothing.
    A shape without elements gives a plain empty tensor (there is nothing to share)."""
    torch = _torch()
    dtype = torch.float32 if dtype is None else dtype
    shape = torch.Size(shape if isinstance(shape, (tuple, list, torch.Size)) else (shape,))
    count = shape.numel()
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    buf = _new_buffer(count * torch.empty((), dtype=dtype).element_size())
    return _view(buf, dtype, count).view(shape)


def shared_buffer(nbytes):
    """`nbytes` of gradsync shared memory as a writable buffer (memoryview(...), numpy.frombuffer
    and array views of it reach the daemon without a copy). No torch needed."""
    return _new_buffer(nbytes)


def _find(address, nbytes):
    """(buffer_id, byte_offset) if [address, address + nbytes) lies in a registered buffer."""
    ctx = _ctx()
    with ctx.lock:
        i = bisect.bisect(ctx.starts, address) - 1
        if i < 0:
            return None
        buf = ctx.buffers[i]
    if address + nbytes > buf.address + buf.nbytes:
        return None
    return buf.id, address - buf.address


# ---- what a collective takes: a torch tensor, or any buffer-protocol object ----
class _Tensor:
    def __init__(self, t):
        if t.device.type != "cpu":
            raise ValueError(f"gradsync collectives take CPU or CUDA tensors, not {t.device}")
        self.obj = t
        self.dtype = dtype_name(t.dtype)
        self.count = t.numel()
        self.nbytes = self.count * t.element_size()

    def segment(self):
        t = self.obj
        if not t.is_contiguous():
            return None
        found = _find(t.data_ptr(), self.nbytes)
        return None if found is None else (found[0], found[1], self.count)

    def copy_to(self, buf, offset):
        _view(buf, self.obj.dtype, self.count, offset).copy_(self.obj.reshape(-1))

    def copy_from(self, buf, offset):
        self.obj.copy_(_view(buf, self.obj.dtype, self.count, offset).view_as(self.obj))


class _Bytes:
    def __init__(self, obj):
        try:
            view = memoryview(obj)
        except TypeError:
            raise TypeError(f"gradsync collectives take torch tensors or buffer-protocol objects, "
                            f"not {type(obj).__name__}") from None
        if not view.c_contiguous:
            raise ValueError("gradsync collectives take C-contiguous buffers")
        if view.readonly:  # also without elements: the same call must not depend on the size
            raise ValueError("gradsync writes into the buffer: it must be writable")
        self.obj = obj
        self.view = view
        self.dtype = _format_dtype(view.format, view.itemsize)
        self.nbytes = view.nbytes
        self.count = view.nbytes // view.itemsize

    def _address(self):
        if self.nbytes == 0:
            return None
        return ctypes.addressof((ctypes.c_char * self.nbytes).from_buffer(self.view))

    def segment(self):
        address = self._address()
        found = None if address is None else _find(address, self.nbytes)
        return None if found is None else (found[0], found[1], self.count)

    def copy_to(self, buf, offset):
        if self.nbytes:
            ctypes.memmove(buf.address + offset, self.view.tobytes(), self.nbytes)

    def copy_from(self, buf, offset):
        address = self._address()
        if address is not None:
            ctypes.memmove(address, buf.address + offset, self.nbytes)


def _operand(x):
    if not _is_tensor(x):
        return _Bytes(x)
    device = _cuda.api().device_of(x)
    if device is None:
        return _Tensor(x)
    return _device.Operand(x, device, dtype_name(x.dtype))


def _on_device(objs):
    """The CUDA device of the operands (None: all on the host); mixing is refused."""
    devices = {x.device if isinstance(x, _device.Operand) else None for x in objs}
    if len(devices) > 1:
        raise TypeError(f"gradsync collective operands lie on different devices "
                        f"({', '.join('host' if d is None else f'cuda:{d}' for d in devices)})")
    return devices.pop()


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
    ctx = _context
    if ctx is None or ctx.client.closed:
        return
    with ctx.lock:
        ctx.free.setdefault(buf.nbytes, []).append(buf)


class Work:
    """An op in flight. wait() blocks (GIL released; Ctrl-C raises KeyboardInterrupt and ends
    the session), copies staged results back, and returns what the synchronous call would (the
    tensor, or the output list); a failed op raises its gradsync.Error on every wait. On CUDA
    tensors, wait() returns once
    the daemon has queued its write: the current stream then waits for it (as with NCCL's
    Work.wait()), and the host never waits for the device."""

    def __init__(self, handle, finish=None, result=None, release=None, on_complete=None):
        self._handle = handle
        self._finish = finish    # on success, once: copy staged results out
        self._release = release  # always, once: return staging buffers
        self._on_complete = on_complete  # on success, every wait: the current stream waits
        self._result = result
        self._lock = threading.Lock()

    def wait(self):
        """Blocks until the op completes; returns its result or raises its gradsync.Error."""
        with self._lock:
            try:
                try:
                    self._handle.wait()  # a failed op raises the same error on every wait
                except Error as e:
                    seen = elastic.classify(_context, e)
                    if seen is e:
                        raise
                    raise seen from e
                if self._on_complete:
                    self._on_complete()
                if self._finish:
                    finish, self._finish = self._finish, None
                    finish()
            finally:
                if self._release and self._handle.done():
                    release, self._release = self._release, None
                    release()
        return self._result

    def is_completed(self):
        """True once the op has an outcome (never blocks; wait() still copies results out)."""
        return self._handle.done()


def _in_place(objs, submit, result, async_op):
    """Runs `submit(segments)` on `objs` in place, staging those not in shared memory. An
    operand without elements names no segment (the op then counts 0 elements: the daemon still
    matches it on every rank, and writes nothing)."""
    segments, copies, staged = [], [], []
    for x in objs:
        if x.count == 0:
            continue
        seg = x.segment()
        if seg is None:
            buf = _staging(x.nbytes)
            staged.append(buf)
            x.copy_to(buf, 0)
            copies.append((x, buf))
            seg = (buf.id, 0, x.count)
        segments.append(seg)

    def finish():
        for x, buf in copies:
            x.copy_from(buf, 0)

    def release():
        for buf in staged:
            _unstage(buf)

    return _start(lambda: submit(segments), finish if copies else None, result, release,
                  async_op)


def _nothing():
    """A release with nothing to give back (an op on operands without elements)."""


def _start(submit, finish, result, release, async_op):
    """Submits an op. Its Work copies staged results out (`finish`) and hands the staging back
    (`release`), which also happens at once if the submission itself fails."""
    try:
        handle = submit()
    except Error as e:
        release()
        seen = elastic.classify(_context, e)
        if seen is e:
            raise
        raise seen from e
    except BaseException:
        release()
        raise
    work = Work(handle, finish, result, release)
    return work if async_op else work.wait()


def _timeout(timeout):
    return float(timeout.total_seconds() if hasattr(timeout, "total_seconds") else (timeout or 0))


def all_reduce(tensor, op="sum", group=WORLD, async_op=False, name="", timeout=None):
    """In-place all-reduce over `group`: afterwards every member's `tensor` holds the reduction
    of all members' values. op is "sum", "mean" (the sum divided by the group size; integers
    truncated toward zero), "min" or "max".

    `tensor` is a torch tensor on the CPU or on a CUDA device (contiguous or not; float32,
    float64, float16, bfloat16, int32, int64, uint8 or int8), or a writable C-contiguous
    buffer-protocol object (bytearray, array.array, memoryview, numpy array) whose format is
    float32/64, float16, int8/32/64 or uint8. It may have no elements (the op still runs, in
    order with the others, and changes nothing). CUDA tensors are reduced where they are (see
    the module's doc); tensors in gradsync's shared memory are reduced in place; anything else
    goes through a staging copy. `name` is part of the op's fingerprint (every member must pass
    the same); `timeout` is in seconds (or a timedelta; None: the daemon's default).

    Returns `tensor`, or with async_op a Work whose wait() returns it. Raises gradsync.Error
    (INVALID_ARGUMENT for a bad op name or group, FAILED_PRECONDITION when the members' ops
    differ, DEADLINE_EXCEEDED naming the ranks that did not come, ...), and TypeError or
    ValueError for an object it cannot take (another dtype, a read-only or non-contiguous
    buffer, a tensor on another kind of device)."""
    c = _ctx().client
    x = _operand(tensor)

    def submit(segs):
        return c.all_reduce(x.dtype, op, segs, group.key, name, _timeout(timeout))

    if isinstance(x, _device.Operand) and x.count:
        run = _device.Run(_ctx().device, x.device)
        segs = [run.contiguous(x, written=True)]
        return run.start(lambda: submit(segs), tensor, async_op)
    return _in_place([x], submit, tensor, async_op)


def broadcast(tensor, src=0, group=WORLD, async_op=False, name="", timeout=None):
    """In-place broadcast: every member of `group` gets global rank `src`'s `tensor` (src must
    be a member: ValueError otherwise). Takes what all_reduce takes, returns and raises as it
    does."""
    ranks = group.ranks
    if src not in ranks:
        raise ValueError(f"broadcast source rank {src} is not in {group}")
    c = _ctx().client
    x = _operand(tensor)

    def submit(segs):
        return c.broadcast(x.dtype, ranks.index(src), segs, group.key, name, _timeout(timeout))

    if isinstance(x, _device.Operand) and x.count:
        run = _device.Run(_ctx().device, x.device)
        segs = [run.contiguous(x, written=True)]
        return run.start(lambda: submit(segs), tensor, async_op)
    return _in_place([x], submit, tensor, async_op)


def barrier(group=WORLD, async_op=False, name="", timeout=None):
    """Returns once every member of `group` has called barrier() (with async_op: a Work whose
    wait() does). gradsync.Error as all_reduce raises them."""
    work = Work(_ctx().client.barrier(group.key, name, _timeout(timeout)))
    return work if async_op else work.wait()


def _flat_staging(objs):
    """One staging buffer holding `objs` back to back; returns (buffer, byte offsets)."""
    offsets, at = [], 0
    for x in objs:
        offsets.append(at)
        at += x.nbytes
    return _staging(at), offsets


def _same_dtype(objs):
    dtypes = {x.dtype for x in objs}
    if len(dtypes) != 1:
        raise TypeError(f"gradsync collective operands differ in dtype: {sorted(dtypes)}")
    return dtypes.pop()


def all_gather(tensor_list, tensor, group=WORLD, async_op=False, name="", timeout=None):
    """tensor_list[i] receives group member i's `tensor` (torch.distributed's argument order).
    One output per member, each with the input's element count and dtype, all of them on the
    host or all on one CUDA device; operands as all_reduce takes them. Returns tensor_list (with
    async_op: a Work whose wait() does); raises as all_reduce does."""
    if len(tensor_list) != group.size:
        raise ValueError(f"all_gather needs {group.size} output tensors, got {len(tensor_list)}")
    c = _ctx().client
    x = _operand(tensor)
    outs = [_operand(t) for t in tensor_list]
    dtype = _same_dtype([x] + outs)
    if any(o.count != x.count for o in outs):
        raise ValueError("all_gather outputs must each have the input's element count")
    on_device = _on_device([x] + outs)
    if x.count == 0:
        return _start(lambda: c.all_gather(dtype, [], [], group.key, name, _timeout(timeout)),
                      None, tensor_list, _nothing, async_op)
    if on_device is not None:
        return _all_gather_device(c, x, outs, tensor_list, group, async_op, name, timeout)
    buf, offsets = _flat_staging([x] + outs)
    x.copy_to(buf, 0)

    def finish():
        for o, at in zip(outs, offsets[1:]):
            o.copy_from(buf, at)

    return _start(
        lambda: c.all_gather(dtype, [(buf.id, 0, x.count)],
                             [(buf.id, offsets[1], x.count * group.size)], group.key, name,
                             _timeout(timeout)),
        finish, tensor_list, lambda: _unstage(buf), async_op)


def reduce_scatter(output, input_list, op="sum", group=WORLD, async_op=False, name="",
                   timeout=None):
    """output receives the reduction (op as all_reduce's) of every member's
    input_list[this member's group rank]. One input per member, each with the output's element
    count and dtype, all of them on the host or all on one CUDA device; operands as all_reduce
    takes them. Returns output (with async_op: a Work whose wait() does); raises as all_reduce
    does."""
    if len(input_list) != group.size:
        raise ValueError(f"reduce_scatter needs {group.size} input tensors, got {len(input_list)}")
    c = _ctx().client
    out = _operand(output)
    ins = [_operand(t) for t in input_list]
    dtype = _same_dtype(ins + [out])
    if any(i.count != out.count for i in ins):
        raise ValueError("reduce_scatter inputs must each have the output's element count")
    on_device = _on_device(ins + [out])
    if out.count == 0:
        return _start(lambda: c.reduce_scatter(dtype, op, [], [], group.key, name,
                                               _timeout(timeout)),
                      None, output, _nothing, async_op)
    if on_device is not None:
        return _reduce_scatter_device(c, op, out, ins, output, group, async_op, name, timeout)
    buf, offsets = _flat_staging(ins + [out])
    for i, at in zip(ins, offsets):
        i.copy_to(buf, at)
    n = out.count

    def finish():
        out.copy_from(buf, offsets[-1])

    return _start(
        lambda: c.reduce_scatter(dtype, op, [(buf.id, 0, n * group.size)],
                                 [(buf.id, offsets[-1], n)], group.key, name, _timeout(timeout)),
        finish, output, lambda: _unstage(buf), async_op)


def _all_gather_device(c, x, outs, tensor_list, group, async_op, name, timeout):
    run = _device.Run(_ctx().device, x.device)
    seg_in = run.contiguous(x, written=False)
    n = x.count
    seg_out = run.adjacent([o.obj for o in outs], n, written=True)
    finish = None
    if seg_out is None:  # the outputs are not one run of memory: gather into a temporary
        flat = run.scratch(n * group.size, x.obj.dtype)
        seg_out = run.segment(flat, n * group.size, written=True)

        def finish():
            for k, o in enumerate(outs):
                o.obj.copy_(flat[k * n:(k + 1) * n].view_as(o.obj))

    return run.start(lambda: c.all_gather(x.dtype, [seg_in], [seg_out], group.key, name,
                                          _timeout(timeout)), tensor_list, async_op, finish)


def _reduce_scatter_device(c, op, out, ins, output, group, async_op, name, timeout):
    run = _device.Run(_ctx().device, out.device)
    n = out.count
    seg_in = run.adjacent([i.obj for i in ins], n, written=False)
    if seg_in is None:  # the inputs are not one run of memory: one temporary holds them
        flat = run.scratch(n * group.size, out.obj.dtype)
        for k, i in enumerate(ins):
            flat[k * n:(k + 1) * n].copy_(i.obj.reshape(-1))  # on the current stream
        seg_in = run.segment(flat, n * group.size, written=False)
    seg_out = run.contiguous(out, written=True)
    return run.start(lambda: c.reduce_scatter(out.dtype, op, [seg_in], [seg_out], group.key,
                                              name, _timeout(timeout)), output, async_op)


def set_pack_list(plan, group=WORLD):
    """Stores a pack plan (as plan_packs returns it) for `group` in the job's store."""
    _ctx().client.set_pack_list(group.key, plan)


def get_pack_list(group=WORLD, timeout=60.0):
    """Waits for `group`'s pack plan in the job's store (gradsync.Error at the deadline; in an
    elastic job, MembershipChanged as soon as the membership changes meanwhile)."""
    ctx = _ctx()
    if not ctx.elastic:
        return ctx.client.get_pack_list(group.key, _timeout(timeout))
    return elastic._until_changed(ctx, lambda t: ctx.client.get_pack_list(group.key, t),
                                 _timeout(timeout))
