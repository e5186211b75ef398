"""gradsync's operations (the package's face, gradsync/__init__.py, re-exports them): the
session (init, shutdown, the process's context), groups, shared memory, the collectives and
their Work, the job's store. What a collective takes is resolved once per operand (_operand)
and placed for the daemon by one of two runs, _Staging on the host or _device.Run on a CUDA
device; one path (_start) submits, waits and finishes every op. See gradsync's doc.
"""
import atexit
import bisect
import ctypes
import os
import sys
import threading

from . import _cuda, _device, _membership, _native
from ._native import Error

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
        return self._ranks if self._ranks is not None else tuple(range(context().world_size))

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
        me = context().rank
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


def context():
    """The session's context (RuntimeError before init())."""
    if _context is None:
        raise RuntimeError("gradsync.init() has not been called")
    return _context


def current():
    """The session's context, or None (before init(), after shutdown())."""
    return _context


def on_shutdown(hook):
    """hook() runs at every shutdown(), once the session is closed."""
    _shutdown_hooks.append(hook)


def _env_int(name, default):
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def _slurm_job():
    """The job id under Slurm (None outside it, and under torchrun, which names its own)."""
    if "TORCHELASTIC_RUN_ID" in os.environ or not os.environ.get("SLURM_JOB_ID"):
        return None
    step = os.environ.get("SLURM_STEP_ID")
    return f"slurm-{os.environ['SLURM_JOB_ID']}" + (f".{step}" if step else "")


def _slurm_tasks_here():
    """This node's task count from SLURM_TASKS_PER_NODE ("2(x3),1": 2 on each of the first 3
    nodes, 1 on the 4th) and SLURM_NODEID; None when Slurm does not say."""
    spec, node = os.environ.get("SLURM_TASKS_PER_NODE"), os.environ.get("SLURM_NODEID")
    if not spec or node is None:
        return None
    counts = []
    for part in spec.split(","):
        n, _, times = part.partition("(x")
        counts += [int(n)] * (int(times.rstrip(")")) if times else 1)
    return counts[int(node)] if int(node) < len(counts) else None


def _slurm_first_node():
    """The first host of Slurm's node list ("gpu[07-09,12],cpu3" -> "gpu07"; every bracket of
    the first host at its first value), or None."""
    nodelist = os.environ.get("SLURM_STEP_NODELIST") or os.environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return None
    host, depth = "", 0
    for ch in nodelist:  # the first host: up to the first comma outside brackets
        if ch == "," and depth == 0:
            break
        depth += (ch == "[") - (ch == "]")
        host += ch
    first = ""
    while "[" in host:
        head, _, rest = host.partition("[")
        ranges, _, host = rest.partition("]")
        first += head + ranges.split(",")[0].split("-")[0]
    return first + host


def init(job=None, rank=None, world_size=None, local_rank=None, local_world_size=None,
         root_address=None, socket=None, token_file=None, rpc_timeout=None, tls=None,
         elastic=None, min_world_size=None, join=None, _epoch=0):
    """Connects to this node's gradsyncd and registers the rank.

    Omitted arguments come from the environment torchrun sets: RANK, WORLD_SIZE, LOCAL_RANK,
    LOCAL_WORLD_SIZE; without them, from Slurm's (a trainer srun started): SLURM_PROCID,
    SLURM_NTASKS, SLURM_LOCALID, and this node's count in SLURM_TASKS_PER_NODE. A job spanning
    nodes also needs the TCP address of the daemon on rank 0's node: `root_address`, else
    GRADSYNC_ROOT_ADDRESS, else MASTER_ADDR, else the first node of Slurm's
    SLURM_STEP_NODELIST (or SLURM_JOB_NODELIST), with GRADSYNC_DAEMON_PORT (default 7451).
    MASTER_PORT is not used: it is torch's own store, not the daemon.
    The job id: `job`, else GRADSYNC_JOB, else "torchrun-" + TORCHELASTIC_RUN_ID under torchrun,
    else "slurm-" + SLURM_JOB_ID (and "." + SLURM_STEP_ID) under Slurm. The socket:
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
    slurm = "RANK" not in os.environ and "SLURM_PROCID" in os.environ
    if rank is None:
        rank = _env_int("SLURM_PROCID" if slurm else "RANK", 0)
    if world_size is None:
        world_size = _env_int("SLURM_NTASKS" if slurm else "WORLD_SIZE", 1)
    if local_rank is None:
        local_rank = _env_int("SLURM_LOCALID" if slurm else "LOCAL_RANK", rank)
    if local_world_size is None:
        local_world_size = _slurm_tasks_here() if slurm else None
        if local_world_size is None:
            local_world_size = _env_int("LOCAL_WORLD_SIZE", world_size)
    if job is None:
        job = os.environ.get("GRADSYNC_JOB") or _slurm_job() or (
            "torchrun-" + os.environ.get("TORCHELASTIC_RUN_ID", "default"))
    if join is None:
        join = os.environ.get("GRADSYNC_JOIN", "") not in ("", "0")
    if root_address is None:
        root_address = os.environ.get("GRADSYNC_ROOT_ADDRESS", "")
        host = os.environ.get("MASTER_ADDR") or _slurm_first_node()
        if not root_address and (local_world_size < world_size or join) and host:
            port = _env_int("GRADSYNC_DAEMON_PORT", DEFAULT_DAEMON_PORT)
            root_address = f"{host}:{port}"
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
        _epoch, rank, world_size, min_world_size = _membership.join(
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


def reinit(change):
    """An elastic job's next epoch (gradsync.elastic.reset): this session ends, the rank
    registers again as `change` says."""
    ctx = context()
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
    return context().rank


def get_world_size():
    """The number of ranks in the job (RuntimeError before init())."""
    return context().world_size


def client():
    """The underlying session (gradsync._native.Client: store access, raw segment ops)."""
    return context().client


def new_group(ranks):
    """A group of these ranks (each member must create it too; ops name it by its ranks)."""
    group = Group(ranks)
    for r in group.ranks:
        if not 0 <= r < context().world_size:
            raise ValueError(f"rank {r} is outside the job (world size {context().world_size})")
    return group


def _register(buf):
    ctx = context()
    with ctx.lock:
        i = bisect.bisect(ctx.starts, buf.address)
        ctx.starts.insert(i, buf.address)
        ctx.buffers.insert(i, buf)


def _unregister(buf):
    ctx = context()
    with ctx.lock:
        i = bisect.bisect_left(ctx.starts, buf.address)
        if i < len(ctx.buffers) and ctx.buffers[i] is buf:
            del ctx.starts[i]
            del ctx.buffers[i]


def new_buffer(nbytes):
    """A buffer of gradsync shared memory the session registered (collectives find it)."""
    buf = context().client.create_buffer(max(int(nbytes), 1))
    _register(buf)
    return buf


def release_buffer(buf):
    """Deregisters a buffer from the daemon; the mapping lives while tensors view it."""
    _unregister(buf)
    context().client.destroy_buffer(buf)


def shared_view(buf, dtype, count, byte_offset=0):
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
    buf = new_buffer(count * torch.empty((), dtype=dtype).element_size())
    return shared_view(buf, dtype, count).view(shape)


def shared_buffer(nbytes):
    """`nbytes` of gradsync shared memory as a writable buffer (memoryview(...), numpy.frombuffer
    and array views of it reach the daemon without a copy). No torch needed."""
    return new_buffer(nbytes)


def _find(address, nbytes):
    """(buffer_id, byte_offset) if [address, address + nbytes) lies in a registered buffer."""
    ctx = context()
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
        shared_view(buf, self.obj.dtype, self.count, offset).copy_(self.obj.reshape(-1))

    def copy_from(self, buf, offset):
        self.obj.copy_(shared_view(buf, self.obj.dtype, self.count, offset).view_as(self.obj))


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
    """What a collective takes, resolved once: a buffer-protocol object (_Bytes), a CPU tensor
    (_Tensor) or a CUDA tensor (_device.Operand)."""
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


def _run(operands):
    """What places an op's operands for the daemon: a _device.Run on their CUDA device, else
    _Staging (also for device operands without elements, which name no memory). Both offer
    in_place, one and joined (lists of segments, empty for an operand without elements) and
    what _start calls around the op."""
    device = _on_device(operands)
    if device is not None and any(x.count for x in operands):
        return _device.Run(context().device, device)
    return _Staging(operands)


def _size_class(nbytes):
    return max(1 << 16, 1 << (max(int(nbytes), 1) - 1).bit_length())


def _staging(nbytes):
    ctx = context()
    size = _size_class(nbytes)
    with ctx.lock:
        free = ctx.free.get(size)
        if free:
            return free.pop()
    return new_buffer(size)


def _unstage(buf):
    ctx = _context
    if ctx is None or ctx.client.closed:
        return
    with ctx.lock:
        ctx.free.setdefault(buf.nbytes, []).append(buf)


class _Staging:
    """An op's operands on the host. An operand in gradsync's shared memory that the op reads
    and writes goes to the daemon where it is; the others lie back to back in one staging
    buffer (taken at the first, sized for them all), copied in before the op when it reads
    them and out once it succeeded when it writes them."""

    device = None  # the host

    def __init__(self, operands):
        self._nbytes = sum(x.nbytes for x in operands)
        self._buf = None
        self._at = 0        # the next free byte of the staging buffer
        self._copies = []   # (operand, byte offset) the op writes: copied out at the end

    def _stage(self, x, read, written):
        """x's segment in the staging buffer."""
        if self._buf is None:
            self._buf = _staging(self._nbytes)
        at, self._at = self._at, self._at + x.nbytes
        if read:
            x.copy_to(self._buf, at)
        if written:
            self._copies.append((x, at))
        return self._buf.id, at, x.count

    def in_place(self, x):
        """[x's segment] for an op that reads and writes x."""
        if x.count == 0:
            return []
        seg = x.segment()
        return [seg if seg is not None else self._stage(x, read=True, written=True)]

    def one(self, x, written):
        """[x's segment] for an op that writes x (written) or reads it."""
        if x.count == 0:
            return []
        return [self._stage(x, not written, written)]

    def joined(self, operands, count, written):
        """[One segment over operands of `count` elements each, back to back]."""
        if count == 0:
            return []
        buf_id, first, _ = [self._stage(x, not written, written) for x in operands][0]
        return [(buf_id, first, count * len(operands))]

    def ready(self):
        """Before the op is submitted: nothing to do on the host."""

    def finish(self):
        """The op succeeded: its results go back to the operands it wrote."""
        for x, at in self._copies:
            x.copy_from(self._buf, at)

    def release(self):
        """The op has its outcome: the staging buffer goes back."""
        buf, self._buf = self._buf, None
        if buf is not None:
            _unstage(buf)

    on_complete = None  # nothing waits on the host's side of an op

    def adopt(self, work, handle):
        """An async op's Work is the caller's: nothing of it is kept on the host."""

    def waited(self):
        """A synchronous op has its outcome: nothing to do on the host."""


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
                    seen = _membership.classify(_context, e)
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


def _start(submit, run, result, async_op):
    """Submits an op on the operands `run` placed: the one path of every collective. Its Work
    copies results out (run.finish) and gives back what the op held (run.release), which also
    happens at once if the submission itself fails."""
    run.ready()
    try:
        handle = submit()
    except Error as e:
        run.release()
        if run.device is not None:
            raise  # on a device, as it is: a device op's wait classifies its errors
        seen = _membership.classify(_context, e)
        if seen is e:
            raise
        raise seen from e
    except BaseException:
        run.release()
        raise
    work = Work(handle, run.finish, result, run.release, run.on_complete)
    if async_op:
        run.adopt(work, handle)
        return work
    out = work.wait()
    run.waited()
    return out


def seconds(timeout):
    """A timeout in seconds from a number, a timedelta or None (0: the daemon's default)."""
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
    c = context().client
    x = _operand(tensor)
    run = _run([x])
    segs = run.in_place(x)
    return _start(lambda: c.all_reduce(x.dtype, op, segs, group.key, name, seconds(timeout)),
                  run, tensor, async_op)


def broadcast(tensor, src=0, group=WORLD, async_op=False, name="", timeout=None):
    """In-place broadcast: every member of `group` gets global rank `src`'s `tensor` (src must
    be a member: ValueError otherwise). Takes what all_reduce takes, returns and raises as it
    does."""
    ranks = group.ranks
    if src not in ranks:
        raise ValueError(f"broadcast source rank {src} is not in {group}")
    c = context().client
    x = _operand(tensor)
    run = _run([x])
    segs = run.in_place(x)
    return _start(lambda: c.broadcast(x.dtype, ranks.index(src), segs, group.key, name,
                                      seconds(timeout)),
                  run, tensor, async_op)


def barrier(group=WORLD, async_op=False, name="", timeout=None):
    """Returns once every member of `group` has called barrier() (with async_op: a Work whose
    wait() does). gradsync.Error as all_reduce raises them."""
    work = Work(context().client.barrier(group.key, name, seconds(timeout)))
    return work if async_op else work.wait()


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
    c = context().client
    x = _operand(tensor)
    outs = [_operand(t) for t in tensor_list]
    dtype = _same_dtype([x] + outs)
    if any(o.count != x.count for o in outs):
        raise ValueError("all_gather outputs must each have the input's element count")
    run = _run([x] + outs)
    seg_in = run.one(x, written=False)
    seg_out = run.joined(outs, x.count, written=True)
    return _start(lambda: c.all_gather(dtype, seg_in, seg_out, group.key, name,
                                       seconds(timeout)),
                  run, tensor_list, async_op)


def reduce_scatter(output, input_list, op="sum", group=WORLD, async_op=False, name="",
                   timeout=None):
    """output receives the reduction (op as all_reduce's) of every member's
    input_list[this member's group rank]. One input per member, each with the output's element
    count and dtype, all of them on the host or all on one CUDA device; operands as all_reduce
    takes them. Returns output (with async_op: a Work whose wait() does); raises as all_reduce
    does."""
    if len(input_list) != group.size:
        raise ValueError(f"reduce_scatter needs {group.size} input tensors, got {len(input_list)}")
    c = context().client
    out = _operand(output)
    ins = [_operand(t) for t in input_list]
    dtype = _same_dtype(ins + [out])
    if any(i.count != out.count for i in ins):
        raise ValueError("reduce_scatter inputs must each have the output's element count")
    run = _run(ins + [out])
    seg_in = run.joined(ins, out.count, written=False)
    seg_out = run.one(out, written=True)
    return _start(lambda: c.reduce_scatter(dtype, op, seg_in, seg_out, group.key, name,
                                           seconds(timeout)),
                  run, output, async_op)


def set_pack_list(plan, group=WORLD):
    """Stores a pack plan (as plan_packs returns it) for `group` in the job's store."""
    context().client.set_pack_list(group.key, plan)


def get_pack_list(group=WORLD, timeout=60.0):
    """Waits for `group`'s pack plan in the job's store (gradsync.Error at the deadline; in an
    elastic job, MembershipChanged as soon as the membership changes meanwhile)."""
    ctx = context()
    if not ctx.elastic:
        return ctx.client.get_pack_list(group.key, seconds(timeout))
    return _membership.until_changed(ctx, lambda t: ctx.client.get_pack_list(group.key, t),
                                     seconds(timeout))
