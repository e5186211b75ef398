"""Collectives on CUDA tensors: registrations cached per allocation, and the stream protocol
around each op. Every CUDA call goes through the seam (_cuda.api()).

Registration follows how PyTorch shares caching-allocator blocks: a tensor's memory is named by
the allocation it lies in (its IPC handle, taken at the allocation's base) and its offset there.
The whole allocation is registered once, on first use, and the daemon maps it once; every later
op on any tensor in it costs a driver query (which allocation is this?) and a dict lookup.
The cache is keyed by the driver's allocation id, unique over the process's life, so memory the
allocator freed and handed out again is never mistaken for what was registered: an entry whose
allocation is gone is deregistered when the next allocation is registered (and at the latest
when the session ends, when the daemon drops them all). An allocation must not be freed while
the daemon maps it (CUDA leaves that undefined), so torch.cuda.empty_cache, the way torch's
allocator gives memory back, first deregisters every entry nobody pins (pinned: buckets
gradsync holds, whose allocation cannot be freed); they register again on their next use. (The
allocator's own release on an out-of-memory retry bypasses that; it is rare, and the entries it
leaves are swept as above.)

The stream protocol of an op (no host synchronisation anywhere):
  1. "ready" is recorded on the current stream for every registration the op reads or writes,
     then the op is submitted: the daemon's stream waits for it before touching the memory.
  2. When the op completes (a synchronous call before it returns, Work.wait() for async ones),
     the current stream waits on "done" of every registration the op wrote: later work on the
     stream sees the result. Results staged in temporaries are copied out after that, on the
     same stream.
An event stands for its latest record only (cudaEventRecord replaces what it marked, and
cudaStreamWaitEvent waits for the record it holds when called). So an op leases its
registrations: each allocation an op names is registered once per op in flight on it (the
daemon maps the allocation once whatever the count), an op takes an idle registration of it, or
registers another, and gives it back once "done" was waited on (or the op failed). Two ops in
flight over one allocation, on two groups or from two threads, never share a "ready" or a
"done". A registration's "ready" recorded on another stream than last time first makes that
stream wait for the previous one, so the latest record covers the work of both.
The tensors an op names (the caller's, and temporaries) live until it completed: the Run keeps
them, and a waiter on another stream than the op's marks them used there (record_stream), so
torch's allocator hands their memory out again only after the daemon's write. A Work dropped
unwaited is adopted by the registry and settled at its next op.
"""
import threading
import weakref

from . import _cuda
from ._native import Error


class _Allocation:
    """One CUDA allocation's registrations: idle ones, leased ones (an op in flight holds
    each), and pinned ones (a holder such as an optimizer bucket owns each)."""

    def __init__(self, alloc_id, base, size):
        self.id, self.base, self.size = alloc_id, base, size
        self.idle = []
        self.leased = set()  # registration ids
        self.pinned = set()  # registration ids
        self.all = {}        # registration id -> registration


class Registry:
    """The session's registrations of CUDA allocations: per allocation, one per op in flight on
    it (leased) and one per pinned holder. Thread-safe."""

    def __init__(self, client):
        self._client = client
        self._lock = threading.Lock()
        self._by_alloc = {}      # allocation id -> _Allocation
        self._ready_stream = {}  # registration id -> the stream "ready" was last recorded on
        self._orphans = []       # (handle, Run) of async ops whose Work went unwaited
        self.registrations = 0   # registered so far (tests count them)
        _registries.add(self)

    def _allocation(self, address, nbytes):
        api = _cuda.api()
        alloc_id, base, size, ipc_capable = api.allocation(address)
        if alloc_id == 0:
            raise Error("INVALID_ARGUMENT", f"address {address:#x} is not CUDA device memory")
        if address + nbytes > base + size:
            raise Error("INVALID_ARGUMENT", f"[{address:#x}, +{nbytes}) runs past its CUDA "
                        f"allocation [{base:#x}, +{size})")
        return alloc_id, base, size, ipc_capable

    def lease(self, address, nbytes):
        """(registration, byte offset, allocation id) of device memory [address, address +
        nbytes) for one op: a registration of its allocation no other op in flight holds.
        give_back() it once the op's "done" was waited on, or the op failed."""
        alloc_id, base, size, ipc_capable = self._allocation(address, nbytes)
        with self._lock:
            entry = self._by_alloc.get(alloc_id)
            if entry is not None and entry.idle:
                reg = entry.idle.pop()
                entry.leased.add(reg.id)
                return reg, address - base, alloc_id
        reg = self._register(alloc_id, base, size, ipc_capable, leased=True)
        return reg, address - base, alloc_id

    def give_back(self, alloc_id, reg):
        """An op's lease ends: the registration serves the allocation's next op."""
        with self._lock:
            entry = self._by_alloc.get(alloc_id)
            if entry is not None and entry.all.get(reg.id) is reg and reg.id in entry.leased:
                entry.leased.discard(reg.id)
                entry.idle.append(reg)
                return
        # Its allocation was swept meanwhile: the registration went with it.

    def locate(self, address, nbytes, pin=False):
        """(registration, byte offset) of device memory [address, address + nbytes) that the
        caller owns (pin=True: a registration of its own, until unpin(registration)), or, with
        pin=False, an idle one of its allocation (for a look only: ops lease theirs)."""
        alloc_id, base, size, ipc_capable = self._allocation(address, nbytes)
        if not pin:
            with self._lock:
                entry = self._by_alloc.get(alloc_id)
                if entry is not None and entry.all:
                    reg = entry.idle[-1] if entry.idle else next(iter(entry.all.values()))
                    return reg, address - base
            reg = self._register(alloc_id, base, size, ipc_capable)
            return reg, address - base
        reg = self._register(alloc_id, base, size, ipc_capable, pinned=True)
        reg.alloc_id = alloc_id
        return reg, address - base

    def unpin(self, reg):
        with self._lock:
            entry = self._by_alloc.get(getattr(reg, "alloc_id", None))
            if entry is not None and reg.id in entry.pinned:
                entry.pinned.discard(reg.id)
                entry.idle.append(reg)

    def release_unpinned(self):
        """Deregisters every allocation nobody pins and no op in flight holds (before the
        allocator frees memory)."""
        api = _cuda.api()
        with self._lock:
            gone = [e for e in self._by_alloc.values() if not e.pinned and not e.leased]
            for entry in gone:
                del self._by_alloc[entry.id]
                for reg in entry.all.values():
                    self._ready_stream.pop(reg.id, None)
        for entry in gone:
            for reg in entry.all.values():
                self._deregister(api, reg)

    def _register(self, alloc_id, base, size, ipc_capable, leased=False, pinned=False):
        if not ipc_capable:
            raise Error("FAILED_PRECONDITION", "this CUDA memory cannot be shared with the "
                        "daemon (cudaIpcGetMemHandle refuses it: cuMemCreate memory, such as "
                        "PyTorch's expandable segments; unset expandable_segments in "
                        "PYTORCH_CUDA_ALLOC_CONF)")
        api = _cuda.api()
        _guard_empty_cache()
        self._sweep(api)
        reg = api.register(self._client, base, size)
        with self._lock:
            entry = self._by_alloc.get(alloc_id)
            if entry is None:
                entry = self._by_alloc[alloc_id] = _Allocation(alloc_id, base, size)
            entry.all[reg.id] = reg
            if leased:
                entry.leased.add(reg.id)
            elif pinned:
                entry.pinned.add(reg.id)
            else:
                entry.idle.append(reg)
            self.registrations += 1
        return reg

    def _sweep(self, api):
        """Deregisters the registrations whose allocation is gone (freed, or its address
        reused)."""
        with self._lock:
            entries = list(self._by_alloc.values())
        for entry in entries:
            if api.allocation(entry.base)[0] == entry.id:
                continue
            with self._lock:
                if self._by_alloc.get(entry.id) is not entry:
                    continue
                del self._by_alloc[entry.id]
                for reg in entry.all.values():
                    self._ready_stream.pop(reg.id, None)
            for reg in entry.all.values():
                self._deregister(api, reg)

    def _deregister(self, api, reg):
        try:
            api.deregister(self._client, reg)
        except Error:
            pass  # the session is gone: the daemon dropped it with the session

    def cached(self):
        """Allocations registered now."""
        with self._lock:
            return len(self._by_alloc)

    def leases(self):
        """Registrations held by ops in flight now."""
        with self._lock:
            return sum(len(e.leased) for e in self._by_alloc.values())

    def ready(self, regs, stream):
        """Records "ready" on `stream` for each registration (once each)."""
        api = _cuda.api()
        for reg in _unique(regs):
            with self._lock:
                last = self._ready_stream.get(reg.id)
                self._ready_stream[reg.id] = stream
            if last is not None and last != stream:
                api.join_streams(stream, last)
            api.record_ready(reg, stream)

    def adopt(self, handle, run):
        """An async op's Work went unwaited: its Run (leases, tensors) is kept until the op
        has an outcome, then settled on the current stream of the next op's caller."""
        if run.released:
            return
        with self._lock:
            self._orphans.append((handle, run))

    def settle_orphans(self):
        with self._lock:
            if not self._orphans:
                return
            ready, waiting = [], []
            for h, r in self._orphans:  # done() asked once: an op may finish meanwhile
                (ready if h.done() else waiting).append((h, r))
            self._orphans = waiting
        for handle, run in ready:
            run.settle_orphan(handle)

    def drop(self):
        """At session end: forgets every registration (the daemon drops them with the session;
        the events go with the last reference)."""
        with self._lock:
            self._by_alloc.clear()
            self._ready_stream.clear()
            self._orphans = []


_guard_lock = threading.Lock()
_guarded = False
_registries = weakref.WeakSet()  # every Registry made, one per session (live or ended)


def _guard_empty_cache():
    """Wraps torch.cuda.empty_cache (once) so that the session's unpinned registrations are let
    go before torch frees cached allocations."""
    global _guarded
    import sys
    torch = sys.modules.get("torch")
    with _guard_lock:
        if _guarded or torch is None:
            return
        _guarded = True
        empty_cache = torch.cuda.empty_cache

        def guarded_empty_cache(*args, **kwargs):
            for registry in list(_registries):
                if not registry._client.closed:  # the open session's
                    registry.release_unpinned()
            return empty_cache(*args, **kwargs)

        guarded_empty_cache.__doc__ = empty_cache.__doc__
        torch.cuda.empty_cache = guarded_empty_cache


def _unique(regs):
    seen, out = set(), []
    for r in regs:
        if r.id not in seen:
            seen.add(r.id)
            out.append(r)
    return out


class Operand:
    """A CUDA tensor a collective reads or writes."""

    def __init__(self, tensor, device, dtype):
        self.obj = tensor
        self.device = device
        self.dtype = dtype
        self.count = tensor.numel()
        self.nbytes = self.count * tensor.element_size()


class Run:
    """One op's device side: the segments it names, the registrations it leases (to make
    ready and to wait on), the tensors that must live until it completed, and the staged
    temporaries whose results go back to the caller's tensors."""

    def __init__(self, registry, device):
        self.registry = registry
        self.device = device
        self.stream = _cuda.api().current_stream(device)
        self.reads = []    # registrations the op reads
        self.writes = []   # registrations the op writes
        self.copies = []   # (the caller's tensor, the temporary holding its result)
        self.keep = []     # tensors the op names, and temporaries: alive until it completed
        self.leased = {}   # allocation id -> the registration this op leased
        self.waiters = []  # streams other than the op's that waited on its "done"
        self.released = False

    def _lease(self, address, nbytes):
        alloc_id = _cuda.api().allocation(address)[0]
        reg = self.leased.get(alloc_id)
        if reg is not None:
            return reg, address - reg.base
        reg, offset, alloc_id = self.registry.lease(address, nbytes)
        self.leased[alloc_id] = reg
        return reg, offset

    def segment(self, tensor, count, written):
        """(buffer id, byte offset, count) of a contiguous device tensor."""
        nbytes = count * tensor.element_size()
        if nbytes == 0:  # nothing to name: a byte of scratch memory, zero elements
            tensor = _cuda.api().empty(1, self.device)
        self.keep.append(tensor)
        reg, offset = self._lease(tensor.data_ptr(), nbytes)
        (self.writes if written else self.reads).append(reg)
        return reg.id, offset, count

    def contiguous(self, x, written):
        """The operand's segment, through a contiguous temporary if it is not contiguous."""
        t = x.obj
        if not t.is_contiguous():
            self.keep.append(t)
            tmp = self.scratch(x.count, t.dtype).view(t.shape)
            tmp.copy_(t)  # on the current stream, before "ready"
            if written:
                self.copies.append((t, tmp))
            t = tmp
        return self.segment(t, x.count, written)

    def adjacent(self, tensors, count, written):
        """One segment for tensors of `count` elements each lying back to back in one
        allocation (as views of one tensor do); None if they do not."""
        if not tensors or count == 0:
            return None
        first = tensors[0].data_ptr()
        step = count * tensors[0].element_size()
        if any(not t.is_contiguous() or t.data_ptr() != first + k * step
               for k, t in enumerate(tensors)):
            return None
        try:
            reg, offset = self._lease(first, step * len(tensors))
        except Error:
            return None  # e.g. they run past one allocation
        self.keep.extend(tensors)
        (self.writes if written else self.reads).append(reg)
        return reg.id, offset, count * len(tensors)

    def in_place(self, x):
        """[x's segment] for an op that reads and writes x."""
        return [self.contiguous(x, written=True)]

    def one(self, x, written):
        """[x's segment] for an op that writes x (written) or reads it."""
        return [self.contiguous(x, written)]

    def joined(self, operands, count, written):
        """[One segment over operands of `count` elements each, back to back]: where they lie
        when they are one run of memory, else a temporary (filled now when the op reads it,
        copied out at the end when it writes it)."""
        tensors = [x.obj for x in operands]
        seg = self.adjacent(tensors, count, written)
        if seg is None:  # not one run of memory: one temporary holds them
            n = count * len(tensors)
            flat = self.scratch(n, tensors[0].dtype)
            for k, t in enumerate(tensors):
                part = flat[k * count:(k + 1) * count]
                if written:
                    self.copies.append((t, part.view_as(t)))
                else:
                    part.copy_(t.reshape(-1))  # on the current stream
            seg = self.segment(flat, n, written)
        return [seg]

    def scratch(self, count, dtype):
        """A temporary of `count` elements on the device (the caller fills or reads it)."""
        import torch
        elsize = torch.empty((), dtype=dtype).element_size()
        t = _cuda.api().empty(max(count, 1) * elsize, self.device).view(dtype)[:count]
        self.keep.append(t)
        return t

    # ---- around the op (the operations' one path calls these, as on the host) ----
    def ready(self):
        """Before the op is submitted: its memory is made ready on the op's stream."""
        self.registry.settle_orphans()
        self.registry.ready(self.reads + self.writes, self.stream)

    def on_complete(self):
        """On each successful wait: the waiter's current stream waits for the daemon."""
        self._wait_done()

    def adopt(self, work, handle):
        """An async op's `work` was handed out: if it goes unwaited, the registry keeps this
        Run until the op has its outcome."""
        weakref.finalize(work, self.registry.adopt, handle, self)

    def waited(self):
        """A synchronous op has its outcome: unwaited ops answered before it (its group's
        answers come in order) are settled now, not only at the next op's start."""
        self.registry.settle_orphans()

    def _wait_done(self, stream=None):
        """The current stream (of whoever waits) waits for the daemon's writes; the op's
        tensors are marked used there when it is not the op's stream."""
        api = _cuda.api()
        stream = stream if stream is not None else api.current_stream(self.device)
        for reg in _unique(self.writes):
            api.wait_done(reg, stream)
        if stream != self.stream and stream not in self.waiters:
            self.waiters.append(stream)
            for t in self.keep:
                api.record_stream(t, stream)
        return stream

    def finish(self):
        """The op succeeded: results staged in temporaries go to the caller's tensors."""
        for t, tmp in self.copies:
            t.copy_(tmp)  # on the current stream, which waits for "done"

    def release(self):
        """The op has its outcome and, if it succeeded, a stream waited on its "done": its
        leases end and its tensors go back to their owners (or torch's allocator)."""
        if self.released:
            return
        self.released = True
        for alloc_id, reg in self.leased.items():
            self.registry.give_back(alloc_id, reg)
        self.leased = {}
        self.keep = []
        self.copies = []

    def settle_orphan(self, handle):
        """The op of a Work dropped unwaited has its outcome: the current stream waits on its
        "done" (device side) before its tensors and leases go."""
        if self.released:
            return
        try:
            handle.wait()
            self._wait_done()
        except Error:
            pass  # failed: nothing was written that anyone waits for
        finally:
            self.release()
