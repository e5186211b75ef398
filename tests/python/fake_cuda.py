"""A fake of gradsync's CUDA calls (client/python/gradsync/_cuda.py), for tests without a GPU.

Only the CUDA calls are fake: the package's device code paths run unchanged, against a real
gradsyncd that really reduces the data. Fake "device memory" is host memory the daemon can map:
each fake allocation is a sealed memfd mapped here, sub-allocated the way torch's caching
allocator hands out blocks of a segment, and registering it (what cudaIpcGetMemHandle and the
CUDA importer do on a GPU) hands its fd to the daemon over its fd channel, so the daemon's buffer
id names the allocation from its base, as a CUDA registration does. Tensors in it are CPU
tensors to torch; the fake tells the package they live on device 0.

Every call is logged in order, with every op the package submits (a spy on
_native.Client._submit that reads the buffer ids the op names), and the fake checks the stream
protocol as it goes:
  - an op that names a registration is submitted only after "ready" was recorded for it since
    its previous op (else "submit without ready" is recorded in `violations`);
  - settled() says which registrations an op wrote whose "done" the given stream has not waited
    for since (a synchronous call, or backward(), must leave none);
  - events behave as CUDA's: "done" stands for the latest op that recorded it (the daemon
    records it as it launches each op, on its group's stream) and a stream that waits on it
    waits for that op and the earlier ops of its group only, so op_settled(n, stream) says
    whether the stream waited for op n, not for another group's op through a shared event; using the events of a deregistered registration is a violation;
  - fake device memory is handed out in blocks that know when torch frees them: a block freed
    while an op naming it is not settled on the stream it was allocated on, nor on a stream it
    was marked used on (record_stream), is a violation (torch's caching allocator would hand
    it out again while the daemon still reads or writes it);
  - torch.cuda.synchronize and the streams' and events' synchronize are replaced by functions
    that record a violation (the package must never call them); to_host(), the one synchronous
    read the seam offers, is logged.
What a fake cannot see: a device-to-host read hidden in a tensor call (.item(), float()) on real
device memory. The package routes its only read through to_host() for that reason.
"""
import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
import weakref

import torch

import gradsync
from gradsync import _cuda, _native

ALIGN = 512            # torch's caching allocator rounds blocks to 512 bytes
SEGMENT = 1 << 20      # small blocks share 1 MiB segments; larger ones get their own


class FakeStream:
    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, FakeStream) and other.name == self.name

    def __hash__(self):
        return hash(self.name)

    def __repr__(self):
        return f"stream:{self.name}"


class FakeAllocation:
    def __init__(self, alloc_id, size):
        self.id = alloc_id
        self.size = size
        self.fd = os.memfd_create("gradsync-fake-cuda", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, size)
        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        self.map = mmap.mmap(self.fd, size)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.used = 0
        self.alive = True

    def take(self, nbytes, on_free=None):
        at = self.used
        self.used += -(-max(nbytes, 1) // ALIGN) * ALIGN
        # The block's own buffer object: it lives as long as any tensor viewing the block, so
        # its finalizer is torch freeing the block.
        block = (ctypes.c_char * max(nbytes, 1)).from_buffer(self.map, at)
        if on_free is not None:
            on_free(block, self.base + at, self.base + at + max(nbytes, 1))
        # No byte: an empty view at the block's address (torch's allocator gives empty CUDA
        # tensors a device too; device_of must see it there).
        return torch.frombuffer(block, dtype=torch.uint8, count=max(nbytes, 1))[:nbytes]


class FakeRegistration:
    def __init__(self, buffer_id, base, nbytes, alloc):
        self.id = buffer_id
        self.base = base
        self.nbytes = nbytes
        self.alloc = alloc


class FakeCuda:
    """Install with `with FakeCuda() as fake:` (or install()/uninstall())."""

    def __init__(self):
        self._lock = threading.RLock()
        self._next_id = 1
        self._allocs = []
        self._small = None
        self._local = threading.local()
        self.log = []         # the calls, in order
        self.violations = []  # what broke the stream protocol
        self._registered = {}  # daemon buffer id -> FakeRegistration
        self._gone = set()     # buffer ids deregistered: their events are not to be used
        self._ready_on = {}    # buffer id -> the stream its "ready" was last recorded on
        self._ready_since_submit = {}  # buffer id -> "ready" recorded since its last op
        self._saved = None
        self.ops = []          # per op submitted: {"fn", "read", "written", "starts"}
        self._last_write = {}  # buffer id -> the last op that wrote it
        self._done_for = {}    # buffer id -> the op its "done" event stands for now
        self._waited = {}      # stream name -> {group: the last op of it the stream waited for}
        self._blocks = {}      # block start -> (end, allocation stream, streams marked used)

    # ---- test helpers ----
    def install(self):
        self._saved = (_cuda.use(self), _native.Client._submit, torch.cuda.synchronize,
                       torch.cuda.Stream.synchronize, torch.cuda.Event.synchronize)
        fake, submit = self, _native.Client._submit

        def spy(client, fn, *args):
            fake._submitted(fn.__name__, args)
            return submit(client, fn, *args)

        def host_sync(*a, **k):
            fake._violate("host synchronisation: torch.cuda.synchronize or a "
                          "stream's/event's synchronize()")
            raise RuntimeError("the package synchronised the host with a device")

        _native.Client._submit = spy
        torch.cuda.synchronize = host_sync
        torch.cuda.Stream.synchronize = host_sync
        torch.cuda.Event.synchronize = host_sync
        return self

    def uninstall(self):
        if self._saved is not None:
            previous, submit, sync, ssync, esync = self._saved
            _cuda.use(previous)
            _native.Client._submit = submit
            torch.cuda.synchronize = sync
            torch.cuda.Stream.synchronize = ssync
            torch.cuda.Event.synchronize = esync
            self._saved = None

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.uninstall()

    def to_device(self, t):
        """A copy of CPU tensor `t` in fake device memory."""
        out = self.empty(t.numel() * t.element_size(), 0).view(t.dtype)[:t.numel()]
        out.copy_(t.reshape(-1))
        return out.view(t.shape)

    @contextlib.contextmanager
    def stream(self, name):
        """Makes stream `name` current on this thread (torch.cuda.stream(...))."""
        previous = getattr(self._local, "stream", None)
        self._local.stream = FakeStream(name)
        try:
            yield self._local.stream
        finally:
            self._local.stream = previous

    def free(self, alloc, reuse=False):
        """The allocator gives `alloc` back to the driver (torch.cuda.empty_cache); with
        reuse, a new allocation gets the same address (a new id, as the driver's is)."""
        with self._lock:
            alloc.alive = False
            if reuse:
                new = FakeAllocation.__new__(FakeAllocation)
                new.__dict__.update(alloc.__dict__)
                new.id, new.alive = self._next_id, True
                self._next_id += 1
                self._allocs.append(new)
                return new
        return None

    def allocation_of(self, tensor):
        with self._lock:
            for a in reversed(self._allocs):
                if a.alive and a.base <= tensor.data_ptr() < a.base + a.size:
                    return a
        return None

    def calls(self, *kinds):
        with self._lock:
            return [e for e in self.log if not kinds or e[0] in kinds]

    def settled(self, stream=None):
        """Registrations an op wrote whose "done" `stream` (default: this thread's current
        one) has not waited for since: [] after a synchronous call or backward()."""
        name = (stream or self.current_stream(0)).name
        with self._lock:
            return sorted(b for b, n in self._last_write.items() if not self._waited_for(name, n))

    def op_settled(self, n, stream=None):
        """Whether `stream` waited for op n's own "done" of every registration it wrote."""
        name = (stream or self.current_stream(0)).name
        with self._lock:
            return self._waited_for(name, n)

    def _waited_for(self, stream_name, n):
        return self._waited.get(stream_name, {}).get(self.ops[n]["group"], -1) >= n

    def last_op(self):
        """The index of the last op submitted (op_settled's n)."""
        with self._lock:
            return len(self.ops) - 1

    def stats(self):
        with self._lock:
            return {"registrations": len(self.calls("register")),
                    "deregistrations": len(self.calls("deregister")),
                    "to_host": len(self.calls("to_host")),
                    "submits": len(self.calls("submit")),
                    "violations": list(self.violations)}

    # ---- the seam (gradsync/_cuda.py's calls) ----
    def device_of(self, tensor):
        if tensor.device.type != "cpu":
            return None
        # torch gives a tensor without elements the address 0: its storage's says where it is.
        address = tensor.data_ptr() if tensor.numel() else _storage_address(tensor)
        with self._lock:
            for a in self._allocs:
                if a.base <= address < a.base + a.size:
                    return 0
        return None

    def empty(self, nbytes, device):
        assert device == 0, device
        nbytes = int(nbytes)
        with self._lock:
            self._log("empty", nbytes)
            if nbytes > SEGMENT // 2:
                return self._new_alloc(-(-nbytes // ALIGN) * ALIGN).take(nbytes, self._block)
            rounded = -(-max(nbytes, 1) // ALIGN) * ALIGN
            if self._small is None or not self._small.alive or \
                    self._small.used + rounded > self._small.size:
                self._small = self._new_alloc(SEGMENT)
            return self._small.take(nbytes, self._block)

    def allocation(self, address):
        with self._lock:
            for a in reversed(self._allocs):
                if a.alive and a.base <= address < a.base + a.size:
                    return a.id, a.base, a.size, True
        return 0, 0, 0, False

    def register(self, client, base, nbytes):
        with self._lock:
            alloc = next(a for a in reversed(self._allocs) if a.alive and a.base == base)
        buffer_id = client.register_fd(alloc.fd, alloc.size)
        reg = FakeRegistration(buffer_id, base, nbytes, alloc)
        with self._lock:
            self._registered[buffer_id] = reg
            self._log("register", alloc.id, buffer_id)
        return reg

    def deregister(self, client, registration):
        with self._lock:
            self._log("deregister", registration.id)
            self._registered.pop(registration.id, None)
            self._gone.add(registration.id)
        client.deregister(registration.id)

    def current_stream(self, device):
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = FakeStream("default")
        return stream

    @contextlib.contextmanager
    def use_stream(self, stream):
        previous = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            yield stream
        finally:
            self._local.stream = previous

    def join_streams(self, later, earlier):
        self._log("join", later.name, earlier.name)

    def record_ready(self, registration, stream):
        with self._lock:
            self._log("ready", registration.id, stream.name)
            self._check_events(registration, "record_ready")
            self._ready_since_submit[registration.id] = True
            self._ready_on[registration.id] = stream.name  # replaces the earlier record

    def wait_done(self, registration, stream):
        with self._lock:
            self._log("wait_done", registration.id, stream.name)
            self._check_events(registration, "wait_done")
            n = self._done_for.get(registration.id)
            if n is not None:  # the stream waits for the op "done" stands for now and, in the
                # order of its group's stream in the daemon, the group's earlier ops
                upto = self._waited.setdefault(stream.name, {})
                g = self.ops[n]["group"]
                upto[g] = max(upto.get(g, -1), n)

    def record_stream(self, tensor, stream):
        address = tensor.data_ptr() if tensor.numel() else _storage_address(tensor)
        with self._lock:
            self._log("record_stream", stream.name)
            for start, (end, _, used) in self._blocks.items():
                if start <= address < end:
                    used.add(stream.name)

    def to_host(self, tensor):
        self._log("to_host", tensor.numel())
        return tensor.clone()

    def future(self, device):
        return torch.futures.Future()

    # ---- bookkeeping ----
    def _log(self, *entry):
        with self._lock:
            self.log.append(entry)

    def _check_events(self, registration, call):
        if registration.id in self._gone:
            self._violate(f"{call} on the events of deregistered buffer {registration.id}")

    def _block(self, holder, start, end):
        """A block handed out: known until torch frees it (then checked)."""
        self._blocks[start] = (end, self.current_stream(0).name, set())
        weakref.finalize(holder, self._freed, start)

    def _freed(self, start):
        with self._lock:
            end, stream, used = self._blocks.pop(start)
            for n, op in enumerate(self.ops):
                if not any(start <= a < end for a in op["starts"]):
                    continue
                safe = [s for s in {stream} | used if self._waited_for(s, n)]
                if not safe:
                    self._violate(f"a block op {n} ({op['fn']}) names was freed before a stream "
                                  f"it was allocated or marked used on waited for the op")

    def _violate(self, what):
        with self._lock:
            self.violations.append(what)

    def _new_alloc(self, size):
        a = FakeAllocation(self._next_id, size)
        self._next_id += 1
        self._allocs.append(a)
        return a

    def _submitted(self, fn_name, args):
        """An op leaves for the daemon: which registered buffers does it read and write?"""
        def ids(segs, n):
            return [segs[k].buffer_id for k in range(n)]

        def starts(segs, n):
            out = []
            for k in range(n):
                reg = self._registered.get(segs[k].buffer_id)
                if reg is not None:
                    out.append(reg.base + segs[k].byte_offset)
            return out
        if fn_name in ("gs_all_reduce_async", "gs_broadcast_async"):
            read = written = ids(args[2], args[3])
            at = starts(args[2], args[3])
        elif fn_name == "gs_all_gather_async":
            read, written = ids(args[1], args[2]), ids(args[3], args[4])
            at = starts(args[1], args[2]) + starts(args[3], args[4])
        elif fn_name == "gs_reduce_scatter_async":
            read, written = ids(args[2], args[3]), ids(args[4], args[5])
            at = starts(args[2], args[3]) + starts(args[4], args[5])
        else:
            read = written = at = []
        with self._lock:
            n = len(self.ops)
            options = getattr(args[-1], "_obj", None)  # ctypes.byref(_OpOptions)
            self.ops.append({"fn": fn_name[3:-6], "read": sorted(set(read)),
                             "group": getattr(options, "group", None),
                             "thread": threading.current_thread().name,
                             "ready": {b: self._ready_on.get(b) for b in set(read) | set(written)
                                       if b in self._registered},
                             "written": sorted(b for b in set(written) if b in self._registered),
                             "starts": at})
            self._log("submit", fn_name[3:-6], tuple(sorted(set(read) | set(written))))
            for b in set(read) | set(written):
                if b not in self._registered:
                    continue  # shared memory (a host operand), not fake device memory
                if not self._ready_since_submit.get(b):
                    self._violate(f"op {fn_name} submitted on buffer {b} without \"ready\" "
                                  "recorded since its previous op")
                self._ready_since_submit[b] = False
            for b in written:
                if b in self._registered:
                    self._last_write[b] = n
                    self._done_for[b] = n  # the daemon records "done" as it launches the op


def _storage_address(tensor):
    storage = tensor.untyped_storage() if hasattr(tensor, "untyped_storage") else \
        tensor.storage()
    return storage.data_ptr()


def registry():
    """The session's registry of CUDA registrations (gradsync's own)."""
    return gradsync._ctx().device
