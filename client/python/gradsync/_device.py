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
A registration has one "ready" event: when it is recorded on another stream than last time,
that stream first waits for the previous one, so the latest record covers the work of both.
"""
import threading

from . import _cuda
from ._native import Error


class Registry:
    """The session's registrations of CUDA allocations, one per allocation. Thread-safe."""

    def __init__(self, client):
        self._client = client
        self._lock = threading.Lock()
        self._by_alloc = {}      # allocation id -> registration
        self._ready_stream = {}  # registration id -> the stream "ready" was last recorded on
        self._pins = {}          # allocation id -> holders that keep it allocated
        self.registrations = 0   # registered so far (tests count them)

    def locate(self, address, nbytes, pin=False):
        """(registration, byte offset) of device memory [address, address + nbytes). pin: the
        caller holds the memory allocated until unpin(registration)."""
        api = _cuda.api()
        alloc_id, base, size, ipc_capable = api.allocation(address)
        if alloc_id == 0:
            raise Error("INVALID_ARGUMENT", f"address {address:#x} is not CUDA device memory")
        if address + nbytes > base + size:
            raise Error("INVALID_ARGUMENT", f"[{address:#x}, +{nbytes}) runs past its CUDA "
                        f"allocation [{base:#x}, +{size})")
        with self._lock:
            reg = self._by_alloc.get(alloc_id)
        if reg is None:
            if not ipc_capable:
                raise Error("FAILED_PRECONDITION", "this CUDA memory cannot be shared with the "
                            "daemon (cudaIpcGetMemHandle refuses it: cuMemCreate memory, such as "
                            "PyTorch's expandable segments; unset expandable_segments in "
                            "PYTORCH_CUDA_ALLOC_CONF)")
            reg = self._register(alloc_id, base, size)
        if pin:
            with self._lock:
                self._pins[alloc_id] = self._pins.get(alloc_id, 0) + 1
                reg.alloc_id = alloc_id
        return reg, address - base

    def unpin(self, reg):
        with self._lock:
            alloc_id = getattr(reg, "alloc_id", None)
            if self._pins.get(alloc_id, 0) > 1:
                self._pins[alloc_id] -= 1
            else:
                self._pins.pop(alloc_id, None)

    def release_unpinned(self):
        """Deregisters every entry nobody pins (before the allocator frees memory)."""
        api = _cuda.api()
        with self._lock:
            gone = [(a, r) for a, r in self._by_alloc.items() if a not in self._pins]
            for alloc_id, reg in gone:
                del self._by_alloc[alloc_id]
                self._ready_stream.pop(reg.id, None)
        for _, reg in gone:
            self._deregister(api, reg)

    def _register(self, alloc_id, base, size):
        api = _cuda.api()
        _guard_empty_cache()
        self._sweep(api)
        reg = api.register(self._client, base, size)
        with self._lock:
            other = self._by_alloc.get(alloc_id)
            if other is None:
                self._by_alloc[alloc_id] = reg
                self.registrations += 1
                return reg
        # Another thread registered the same allocation meanwhile: keep one.
        self._deregister(api, reg)
        return other

    def _sweep(self, api):
        """Deregisters the entries whose allocation is gone (freed, or its address reused)."""
        with self._lock:
            entries = list(self._by_alloc.items())
        for alloc_id, reg in entries:
            if api.allocation(reg.base)[0] == alloc_id:
                continue
            with self._lock:
                if self._by_alloc.get(alloc_id) is not reg:
                    continue
                del self._by_alloc[alloc_id]
                self._ready_stream.pop(reg.id, None)
            self._deregister(api, reg)

    def _deregister(self, api, reg):
        try:
            api.deregister(self._client, reg)
        except Error:
            pass  # the session is gone: the daemon dropped it with the session

    def cached(self):
        with self._lock:
            return len(self._by_alloc)

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

    def drop(self):
        """At session end: forgets every registration (the daemon drops them with the session;
        the events go with the last reference)."""
        with self._lock:
            self._by_alloc.clear()
            self._ready_stream.clear()


_guard_lock = threading.Lock()
_guarded = False


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
            from . import _context
            if _context is not None and not _context.client.closed:
                _context.device.release_unpinned()
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
    """One op's device side: the segments it names, the registrations to make ready and to
    wait on, and the staged temporaries whose results go back to the caller's tensors."""

    def __init__(self, registry, device):
        self.registry = registry
        self.device = device
        self.stream = _cuda.api().current_stream(device)
        self.reads = []    # registrations the op reads
        self.writes = []   # registrations the op writes
        self.copies = []   # (the caller's tensor, the temporary holding its result)
        self.keep = []     # temporaries that must live until the op completed

    def segment(self, tensor, count, written):
        """(buffer id, byte offset, count) of a contiguous device tensor."""
        nbytes = count * tensor.element_size()
        if nbytes == 0:  # nothing to name: a byte of scratch memory, zero elements
            tensor = _cuda.api().empty(1, self.device)
            self.keep.append(tensor)
        reg, offset = self.registry.locate(tensor.data_ptr(), nbytes)
        (self.writes if written else self.reads).append(reg)
        return reg.id, offset, count

    def contiguous(self, x, written):
        """The operand's segment, through a contiguous temporary if it is not contiguous."""
        t = x.obj
        if not t.is_contiguous():
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
            reg, offset = self.registry.locate(first, step * len(tensors))
        except Error:
            return None  # e.g. they run past one allocation
        (self.writes if written else self.reads).append(reg)
        return reg.id, offset, count * len(tensors)

    def scratch(self, count, dtype):
        """A temporary of `count` elements on the device (the caller fills or reads it)."""
        import torch
        elsize = torch.empty((), dtype=dtype).element_size()
        t = _cuda.api().empty(max(count, 1) * elsize, self.device).view(dtype)[:count]
        self.keep.append(t)
        return t

    def start(self, submit, result, async_op, finish=None):
        """Makes the memory ready, submits the op; a Work (async) or the result."""
        from . import Work
        self.registry.ready(self.reads + self.writes, self.stream)
        handle = submit()
        work = Work(handle, finish=lambda: self._finish(finish), result=result,
                    on_complete=self._wait_done)
        return work if async_op else work.wait()

    def _wait_done(self):
        """The current stream (of whoever waits) waits for the daemon's writes."""
        api = _cuda.api()
        stream = api.current_stream(self.device)
        for reg in _unique(self.writes):
            api.wait_done(reg, stream)
        return stream

    def _finish(self, finish):
        for t, tmp in self.copies:
            t.copy_(tmp)  # on the current stream, which waits for "done"
        if finish is not None:
            finish()
        self.keep = []
