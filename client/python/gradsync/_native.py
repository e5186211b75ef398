"""The C ABI (client/gradsync.h, libgradsync_c.so) through ctypes: sessions, shared-memory
buffers, CUDA buffers, ops, the job's store and the pack planner. No torch here and nothing compiled per
interpreter, so the package loads in any CPython 3.9+.

Every call that can wait does so in slices of at most WAKE_S seconds (ctypes releases the GIL
during each), so Python handles signals between them: Ctrl-C raises KeyboardInterrupt within
about WAKE_S, whatever the op's deadline.
"""
import ctypes
import json
import os
import threading
import time

WAKE_S = 0.05  # longest a wait stays in C before Python may handle a signal
# Called when KeyboardInterrupt (or another exception from a signal handler) interrupts an op's
# wait: the package ends the session there, so the daemon fails the op on the other ranks.
on_interrupt = None

_CODES = ["OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
          "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
          "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
          "UNAUTHENTICATED"]
DTYPES = {"float32": 1, "float64": 2, "float16": 3, "bfloat16": 4, "int32": 5, "int64": 6,
          "uint8": 7, "int8": 8}
REDUCE_OPS = {"sum": 1, "mean": 2, "min": 3, "max": 4}


class Error(RuntimeError):
    """A failed gradsync call. `code` is the status name ("DEADLINE_EXCEEDED"), `detail` the
    daemon's message."""

    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail

    def __reduce__(self):
        # Pickled and copied (multiprocessing, copy.copy) as it was built: from code and detail.
        return type(self), (self.code, self.detail)


class _Segment(ctypes.Structure):
    _fields_ = [("buffer_id", ctypes.c_uint64), ("byte_offset", ctypes.c_int64),
                ("count", ctypes.c_int64)]


class _OpOptions(ctypes.Structure):
    _fields_ = [("group", ctypes.c_char_p), ("name", ctypes.c_char_p),
                ("timeout_ms", ctypes.c_int64)]


class _ConnectOptions(ctypes.Structure):
    _fields_ = [("root_address", ctypes.c_char_p), ("token", ctypes.c_char_p),
                ("rpc_timeout_ms", ctypes.c_int64), ("tls_cert_file", ctypes.c_char_p),
                ("tls_key_file", ctypes.c_char_p), ("tls_ca_file", ctypes.c_char_p),
                ("elastic", ctypes.c_int32), ("epoch", ctypes.c_int32)]


class _CudaAllocation(ctypes.Structure):
    _fields_ = [("id", ctypes.c_uint64), ("base", ctypes.c_uint64), ("bytes", ctypes.c_int64),
                ("device", ctypes.c_int32), ("ipc_capable", ctypes.c_int32)]


def _load():
    path = os.environ.get("GRADSYNC_LIBRARY") or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "libgradsync_c.so")
    lib = ctypes.CDLL(path)
    P, I, I64, U64, SZ = (ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_uint64,
                          ctypes.c_size_t)
    pp, ip, i64p = ctypes.POINTER(P), ctypes.POINTER(I), ctypes.POINTER(I64)
    seg = ctypes.POINTER(_Segment)
    opt = ctypes.POINTER(_OpOptions)
    cs = ctypes.c_char_p
    sigs = {
        "gs_last_error": ([], cs),
        "gs_connect_ex": ([cs, cs, I, I, I, I, ctypes.POINTER(_ConnectOptions), pp], I),
        "gs_store_connect": ([cs, cs, ctypes.POINTER(_ConnectOptions), pp], I),
        "gs_close": ([P], None),
        "gs_default_op_timeout_ms": ([P], I64),
        "gs_buffer_create": ([P, I64, I, pp], I),
        "gs_buffer_data": ([P], P),
        "gs_buffer_id": ([P], U64),
        "gs_buffer_size": ([P], I64),
        "gs_buffer_deregister": ([P, P], I),
        "gs_buffer_free": ([P], None),
        "gs_buffer_register_fd": ([P, I, I64, I, ctypes.POINTER(U64)], I),
        "gs_buffer_deregister_id": ([P, U64], I),
        "gs_cuda_allocation_of": ([P, ctypes.POINTER(_CudaAllocation)], I),
        "gs_cuda_buffer_register": ([P, P, I64, I, pp], I),
        "gs_cuda_buffer_id": ([P], U64),
        "gs_cuda_buffer_ready": ([P, P], I),
        "gs_cuda_buffer_wait_done": ([P, P], I),
        "gs_cuda_buffer_deregister": ([P, P], I),
        "gs_cuda_buffer_free": ([P], None),
        "gs_all_reduce_async": ([P, I, I, seg, SZ, opt, pp], I),
        "gs_broadcast_async": ([P, I, I, seg, SZ, opt, pp], I),
        "gs_barrier_async": ([P, opt, pp], I),
        "gs_all_gather_async": ([P, I, seg, SZ, seg, SZ, opt, pp], I),
        "gs_reduce_scatter_async": ([P, I, I, seg, SZ, seg, SZ, opt, pp], I),
        "gs_op_wait_for": ([P, I64, ip], I),
        "gs_op_test": ([P, ip], I),
        "gs_op_seq": ([P], U64),
        "gs_op_free": ([P], None),
        "gs_store_set": ([P, cs, ctypes.c_char_p, SZ], I),
        "gs_store_add": ([P, cs, I64, i64p], I),
        "gs_store_get": ([P, cs, I64, pp, ctypes.POINTER(SZ)], I),
        "gs_store_compare_set": ([P, cs, ctypes.c_char_p, SZ, ctypes.c_char_p, SZ, ip, pp,
                                  ctypes.POINTER(SZ)], I),
        "gs_store_join": ([P, I, I64, i64p, pp, ctypes.POINTER(SZ)], I),
        "gs_store_admit_joiners": ([P, I, I, I, ip, pp, ctypes.POINTER(SZ)], I),
        "gs_settle": ([P], I),
        "gs_free": ([P], None),
        "gs_set_pack_list": ([P, cs, cs], I),
        "gs_get_pack_list": ([P, cs, I64, pp], I),
        "gs_plan_packs": ([cs, I64, ctypes.c_int32, pp], I),
        "gs_dtype_size": ([I], I64),
        "gs_record_json": ([cs, cs, SZ, pp], I),
    }
    for name, (args, res) in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
    return lib


_lib = _load()


def _error(rc):
    code = _CODES[rc] if 0 <= rc < len(_CODES) else f"CODE_{rc}"
    return Error(code, _lib.gs_last_error().decode("utf-8", "replace"))


def _check(rc):
    if rc != 0:
        raise _error(rc)


def _closed():
    return Error("FAILED_PRECONDITION", "the gradsync session is closed (gradsync.shutdown(), "
                 "an interrupted wait, or a forked child); call gradsync.init() again")


def _take_string(ptr):
    try:
        return ctypes.string_at(ptr).decode()
    finally:
        _lib.gs_free(ptr)


def dtype_code(name):
    """The wire value of a dtype name ("float32" -> 1); Error INVALID_ARGUMENT if unknown."""
    try:
        return DTYPES[name]
    except KeyError:
        raise Error("INVALID_ARGUMENT", f"dtype '{name}' is not one of {', '.join(DTYPES)}") from None


def _reduce_code(name):
    try:
        return REDUCE_OPS[name]
    except KeyError:
        raise Error("INVALID_ARGUMENT",
                    f"reduce op '{name}' is not one of sum, mean, min, max") from None


def dtype_size(name):
    """Bytes per element of a dtype name."""
    return _lib.gs_dtype_size(dtype_code(name))


# ---- pack plans: the dict form the package uses <-> the JSON of gradsync.v1.PackList ----
def _plan_from_json(text):
    d = json.loads(text)
    packs = []
    for p in d.get("packs", []):
        dtype = p.get("dtype", "DTYPE_UNSPECIFIED").lower()
        packs.append({"dtype": dtype, "indices": [int(i) for i in p.get("indices", [])],
                      "shapes": [[int(x) for x in s.get("shape", [])] for s in p.get("shapes", [])],
                      "bytes": int(p.get("bytes", 0))})
    return {"packs": packs, "threshold_bytes": int(d.get("threshold_bytes", 0)),
            "first_alone": int(d.get("first_alone", 0))}


def _plan_to_json(plan):
    packs = []
    for p in plan["packs"]:
        dtype = str(p["dtype"]).upper()
        dtype_code(dtype.lower())
        packs.append({"dtype": dtype, "indices": [int(i) for i in p["indices"]],
                      "shapes": [{"dtype": dtype, "shape": [int(x) for x in s]}
                                 for s in p["shapes"]],
                      "bytes": int(p["bytes"])})
    return json.dumps({"packs": packs, "threshold_bytes": int(plan["threshold_bytes"]),
                       "first_alone": int(plan["first_alone"])})


def record(kind, raw):
    """A record of an elastic job's store that daemons write, read by the C ABI's one parser:
    kind "decision" (gradsync.v1.MembershipDecision), "ticket" (gradsync.v1.JoinTicket) or
    "admission" (gradsync.v1.JoinAdmission), as a dict of its fields (proto names; int64 fields
    as strings, as JSON has them). Error INVALID_ARGUMENT when `raw` is not such a record."""
    raw = bytes(raw)
    out = ctypes.c_void_p()
    _check(_lib.gs_record_json(kind.encode(), raw, len(raw), ctypes.byref(out)))
    return json.loads(_take_string(out))


def plan_packs(grads, threshold_bytes, first_alone=0):
    """The pack planner of common/: grads are (index, dtype name, shape) in backward order.
    Returns the plan as a dict: {"packs": [{"dtype", "indices", "shapes", "bytes"}, ...],
    "threshold_bytes", "first_alone"}."""
    for _, d, _ in grads:
        dtype_code(str(d))  # a clear error for an unknown dtype
    spec = {"indices": [int(i) for i, _, _ in grads],
            "shapes": [{"dtype": str(d).upper(), "shape": [int(x) for x in shape]}
                       for _, d, shape in grads]}
    out = ctypes.c_void_p()
    _check(_lib.gs_plan_packs(json.dumps(spec).encode(), int(threshold_bytes), int(first_alone),
                              ctypes.byref(out)))
    return _plan_from_json(_take_string(out))


# ---- buffers ----
class _BufferBase:
    """Shared memory registered with the daemon: a writable buffer of bytes (the buffer
    protocol, so torch.frombuffer, numpy.frombuffer and memoryview see it without a copy).
    The mapping lives as long as this object and every view of it."""

    @property
    def id(self):
        return self._gs_id

    @property
    def nbytes(self):
        return self._gs_nbytes

    @property
    def address(self):
        return self._gs_address

    def __del__(self):
        ptr, self._gs_ptr = getattr(self, "_gs_ptr", None), None
        if ptr and _lib is not None:
            _lib.gs_buffer_free(ptr)


_buffer_classes = {}


def _buffer_of(ptr):
    n = _lib.gs_buffer_size(ptr)
    cls = _buffer_classes.get(n)
    if cls is None:
        cls = _buffer_classes[n] = type("Buffer", (_BufferBase, ctypes.c_ubyte * n), {})
    address = _lib.gs_buffer_data(ptr)
    buf = cls.from_address(address)
    buf._gs_ptr = ptr
    buf._gs_id = _lib.gs_buffer_id(ptr)
    buf._gs_nbytes = n
    buf._gs_address = address
    return buf


# ---- CUDA device memory ----
def cuda_allocation_of(address):
    """(id, base, bytes, device, ipc_capable) of the CUDA allocation `address` lies in; id 0:
    not CUDA memory (or freed). Driver queries only: no daemon call, no synchronisation."""
    out = _CudaAllocation()
    _check(_lib.gs_cuda_allocation_of(ctypes.c_void_p(int(address)), ctypes.byref(out)))
    return out.id, out.base, out.bytes, out.device, bool(out.ipc_capable)


class CudaBuffer:
    """Device memory registered with the daemon (gs_cuda_buffer): its id and its two events.
    ready()/wait_done() take a cudaStream_t as an int (0: the legacy default stream). The
    events live as long as this object, also after deregistration (an op's Work may still make
    a stream wait on "done")."""

    def __init__(self, ptr, base, nbytes):
        self._ptr = ptr
        self.id = _lib.gs_cuda_buffer_id(ptr)
        self.base = base
        self.nbytes = nbytes
        self._keep = False  # the daemon never said it let the events go: never destroyed

    def keep_events(self):
        """Never destroys the events (left to the process's end): the daemon may still record
        "done" on them, and destroying an event under a pending record of an importing process
        is undefined."""
        self._keep = True

    def ready(self, stream):
        _check(_lib.gs_cuda_buffer_ready(self._ptr, ctypes.c_void_p(int(stream) or None)))

    def wait_done(self, stream):
        _check(_lib.gs_cuda_buffer_wait_done(self._ptr, ctypes.c_void_p(int(stream) or None)))

    def __del__(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr and _lib is not None and not getattr(self, "_keep", False):
            _lib.gs_cuda_buffer_free(ptr)


def _segments(data):
    arr = (_Segment * max(len(data), 1))()
    for k, (bid, offset, count) in enumerate(data):
        arr[k] = _Segment(int(bid), int(offset), int(count))
    return arr, len(data)


# ---- the session ----
class Client:
    """A trainer's session with its node's gradsyncd, and the job's store.

    Thread-safe. close() (also at gradsync.shutdown() and interpreter exit) ends the session:
    waits in other threads return within WAKE_S with a FAILED_PRECONDITION error. In a forked
    child the parent's session is never touched: every call there raises instead."""

    def __init__(self, target, job, world_size, rank, local_rank, local_world_size,
                 root_address="", token="", rpc_timeout_s=0.0, tls=None, elastic=False,
                 epoch=0, store_only=False):
        """`store_only`: no session (rank and sizes unused), only the job's store calls."""
        self.job = job
        self._pid = os.getpid()
        self._cv = threading.Condition()
        self._active = 0
        self._ptr = None
        cert, key, ca = (tls or (None, None, None))
        enc = lambda s: s.encode() if s else None  # noqa: E731
        opts = _ConnectOptions(enc(root_address), enc(token), int(rpc_timeout_s * 1000),
                               enc(cert), enc(key), enc(ca), 1 if elastic else 0, int(epoch))
        ptr = ctypes.c_void_p()
        if store_only:
            _check(_lib.gs_store_connect(target.encode(), job.encode(), ctypes.byref(opts),
                                         ctypes.byref(ptr)))
        else:
            _check(_lib.gs_connect_ex(target.encode(), job.encode(), int(world_size), int(rank),
                                      int(local_rank), int(local_world_size), ctypes.byref(opts),
                                      ctypes.byref(ptr)))
        self._ptr = ptr
        self.default_op_timeout_s = _lib.gs_default_op_timeout_ms(ptr) / 1000.0

    # Every call holds the session open while it runs (at most one wait slice for waits).
    def _enter(self):
        with self._cv:
            if self._ptr is None or os.getpid() != self._pid:
                raise _closed()
            self._active += 1
            return self._ptr

    def _leave(self):
        with self._cv:
            self._active -= 1
            if self._active == 0:
                self._cv.notify_all()

    def _call(self, fn, *args):
        ptr = self._enter()
        try:
            return fn(ptr, *args)
        finally:
            self._leave()

    def _use(self, fn, *args):
        """fn(*args) (an op's function) while the session is held open."""
        self._enter()
        try:
            return fn(*args)
        finally:
            self._leave()

    @property
    def closed(self):
        return self._ptr is None or os.getpid() != self._pid

    def close(self, timeout_s=30.0):
        """Ends the session once the calls in flight have returned (they do within WAKE_S,
        or an RPC timeout for calls that do not wait)."""
        with self._cv:
            ptr, self._ptr = self._ptr, None
            if ptr is None or os.getpid() != self._pid:
                return
            deadline = time.monotonic() + timeout_s
            while self._active > 0 and time.monotonic() < deadline:
                self._cv.wait(max(0.0, deadline - time.monotonic()))
            if self._active > 0:
                return  # a call is stuck in C: leak the session rather than free it under it
        _lib.gs_close(ptr)

    def forget(self):
        """In a forked child: drop the parent's session without closing it."""
        with self._cv:
            self._ptr = None

    def __del__(self):
        try:
            self.close(timeout_s=0.0)
        except Exception:  # noqa: BLE001 - at interpreter teardown
            pass

    # ---- buffers ----
    def create_buffer(self, nbytes):
        out = ctypes.c_void_p()
        _check(self._call(_lib.gs_buffer_create, int(nbytes), 0, ctypes.byref(out)))
        return _buffer_of(out.value)

    def destroy_buffer(self, buf):
        """Deregisters the buffer; the mapping stays while the Buffer object (or a view) lives."""
        if getattr(buf, "_gs_ptr", None):
            _check(self._call(_lib.gs_buffer_deregister, buf._gs_ptr))

    def register_fd(self, fd, nbytes):
        """Registers memory the caller manages: a memfd sealed against shrinking. Returns the
        buffer id."""
        out = ctypes.c_uint64()
        _check(self._call(_lib.gs_buffer_register_fd, int(fd), int(nbytes), 0, ctypes.byref(out)))
        return out.value

    def deregister(self, buffer_id):
        """Deregisters any buffer by id (ops already submitted keep it until they finish)."""
        _check(self._call(_lib.gs_buffer_deregister_id, int(buffer_id)))

    def register_cuda(self, address, nbytes):
        """Registers `nbytes` of device memory at `address` (IPC handle of its allocation, the
        offset there, two interprocess events): a CudaBuffer."""
        out = ctypes.c_void_p()
        _check(self._call(_lib.gs_cuda_buffer_register, ctypes.c_void_p(int(address)),
                          int(nbytes), 0, ctypes.byref(out)))
        return CudaBuffer(out.value, int(address), int(nbytes))

    def deregister_cuda(self, buf):
        """Deregisters a CudaBuffer. Returns once the daemon no longer uses its events (every op
        that named it has settled on the device); they live on with the object. When the daemon
        does not say so (an error: the session is gone, the answer came too late), the events
        are kept to the process's end rather than destroyed under a record it may still run."""
        try:
            _check(self._call(_lib.gs_cuda_buffer_deregister, buf._ptr))
        except Error:
            buf.keep_events()
            raise

    def settle(self):
        """Waits until every device op of this session has settled on the device; raises the
        failure of one answered OK that failed there afterwards (ABORTED: its results are not
        valid), reported once."""
        _check(self._call(_lib.gs_settle))

    # ---- ops ----
    def _submit(self, fn, *args):
        out = ctypes.c_void_p()
        _check(self._call(fn, *args, ctypes.byref(out)))
        return Handle(self, out.value)

    @staticmethod
    def _options(group, name, timeout_s):
        return ctypes.byref(_OpOptions(group.encode(), name.encode() if name else None,
                                       int(timeout_s * 1000) if timeout_s and timeout_s > 0
                                       else 0))

    # The ops: `data`, `input` and `output` are lists of (buffer id, byte offset, element
    # count) segments in registered buffers (an empty list: no element); dtype and op by name.
    # Each returns a Handle; a refused submission raises Error.
    def all_reduce(self, dtype, op, data, group="world", name="", timeout_s=0.0):
        """All-reduce of the segments `data`, in place."""
        segs, n = _segments(data)
        return self._submit(_lib.gs_all_reduce_async, dtype_code(dtype), _reduce_code(op), segs,
                            n, self._options(group, name, timeout_s))

    def broadcast(self, dtype, root, data, group="world", name="", timeout_s=0.0):
        """Broadcast from group rank `root` into the segments `data`."""
        segs, n = _segments(data)
        return self._submit(_lib.gs_broadcast_async, dtype_code(dtype), int(root), segs, n,
                            self._options(group, name, timeout_s))

    def barrier(self, group="world", name="", timeout_s=0.0):
        """A barrier of the group's members."""
        return self._submit(_lib.gs_barrier_async, self._options(group, name, timeout_s))

    def all_gather(self, dtype, input, output, group="world", name="", timeout_s=0.0):
        """`input` (n elements) of every member into `output` (n x group size, by group rank)."""
        si, ni = _segments(input)
        so, no = _segments(output)
        return self._submit(_lib.gs_all_gather_async, dtype_code(dtype), si, ni, so, no,
                            self._options(group, name, timeout_s))

    def reduce_scatter(self, dtype, op, input, output, group="world", name="", timeout_s=0.0):
        """`input` (n x group size elements) reduced; `output` (n) gets this rank's block."""
        si, ni = _segments(input)
        so, no = _segments(output)
        return self._submit(_lib.gs_reduce_scatter_async, dtype_code(dtype), _reduce_code(op),
                            si, ni, so, no, self._options(group, name, timeout_s))

    # ---- the job's store (waits in slices, so signals are handled) ----
    def _sliced(self, timeout_s, attempt):
        deadline = time.monotonic() + max(float(timeout_s), 0.0)
        while True:
            left = deadline - time.monotonic()
            try:
                return attempt(max(1, int(min(left, WAKE_S * 4) * 1000)))
            except Error as e:
                if e.code != "DEADLINE_EXCEEDED" or time.monotonic() >= deadline:
                    raise

    def store_set(self, key, value):
        """Sets `key` of the job's store to the bytes `value`."""
        value = bytes(value)
        _check(self._call(_lib.gs_store_set, key.encode(), value, len(value)))

    def store_add(self, key, delta):
        """Adds `delta` to the integer at `key` (0 if absent); returns the new value."""
        out = ctypes.c_int64()
        _check(self._call(_lib.gs_store_add, key.encode(), int(delta), ctypes.byref(out)))
        return out.value

    def store_get(self, key, timeout_s):
        """The bytes at `key`, waiting for it at most timeout_s (then Error DEADLINE_EXCEEDED)."""
        def attempt(ms):
            out, n = ctypes.c_void_p(), ctypes.c_size_t()
            _check(self._call(_lib.gs_store_get, key.encode(), ms, ctypes.byref(out),
                              ctypes.byref(n)))
            try:
                return ctypes.string_at(out, n.value)
            finally:
                _lib.gs_free(out)
        return self._sliced(timeout_s, attempt)

    def store_compare_set(self, key, expected, desired):
        """Sets `key` to the bytes `desired` if its value is `expected` (None: if it has none).
        Returns (swapped, the key's value after the call)."""
        desired = bytes(desired)
        exp = None if expected is None else bytes(expected)
        swapped, out, n = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(self._call(_lib.gs_store_compare_set, key.encode(), exp,
                          0 if exp is None else len(exp), desired, len(desired),
                          ctypes.byref(swapped), ctypes.byref(out), ctypes.byref(n)))
        try:
            return bool(swapped.value), ctypes.string_at(out, n.value)
        finally:
            _lib.gs_free(out)

    def store_join(self, ranks, timeout_s):
        """Elastic jobs: this node of `ranks` ranks asks to join the job of this store client
        (its home: epoch 0's id) and waits at most timeout_s to be admitted at the job's next
        commit; the daemon takes the node's ticket and withdraws it when the wait ends
        unadmitted (Error DEADLINE_EXCEEDED) or this call goes away. Returns the admission's
        record (gs_record_json's "admission"). Blocks in C for the whole wait."""
        ticket, out, n = ctypes.c_int64(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(self._call(_lib.gs_store_join, int(ranks), max(1, int(float(timeout_s) * 1000)),
                          ctypes.byref(ticket), ctypes.byref(out), ctypes.byref(n)))
        try:
            return ctypes.string_at(out, n.value)
        finally:
            _lib.gs_free(out)

    def store_admit_joiners(self, epoch, min_world_size, min_joined=1):
        """Rank 0 of an elastic job at a commit: the daemon admits the nodes waiting (none
        unless they bring `min_joined` ranks) and records the decision that epoch `epoch` has
        them. Returns (decided, the decision): decided when the epoch has a decision now (these
        joins, or a loss recorded first)."""
        done, out, n = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_size_t()
        _check(self._call(_lib.gs_store_admit_joiners, int(epoch), int(min_world_size),
                          int(min_joined),
                          ctypes.byref(done), ctypes.byref(out), ctypes.byref(n)))
        try:
            return bool(done.value), ctypes.string_at(out, n.value)
        finally:
            _lib.gs_free(out)

    def set_pack_list(self, group, plan):
        """Stores the pack plan (plan_packs' dict) of the group named `group`."""
        _check(self._call(_lib.gs_set_pack_list, group.encode(), _plan_to_json(plan).encode()))

    def get_pack_list(self, group, timeout_s):
        """The group's pack plan, waiting for it at most timeout_s."""
        def attempt(ms):
            out = ctypes.c_void_p()
            _check(self._call(_lib.gs_get_pack_list, group.encode(), ms, ctypes.byref(out)))
            return _plan_from_json(_take_string(out))
        return self._sliced(timeout_s, attempt)


class Handle:
    """An op in flight. wait() blocks in slices of WAKE_S (signals are handled between) until
    the daemon answers; a failed op raises the same Error on every wait."""

    def __init__(self, client, ptr):
        self._client = client
        self._ptr = ptr
        self._status = None  # None while pending; then 0 or the Error
        self._seq = 0

    def _finish(self, rc):
        self._status = _error(rc) if rc != 0 else 0
        self._seq = _lib.gs_op_seq(self._ptr)

    def wait(self):
        try:
            while self._status is None:
                done = ctypes.c_int(0)
                try:
                    rc = self._client._use(_lib.gs_op_wait_for, self._ptr, int(WAKE_S * 1000),
                                           ctypes.byref(done))
                except Error:
                    self._status = _closed()  # the session ended while the op was pending
                    break
                if done.value:
                    self._finish(rc)
        except KeyboardInterrupt:
            if on_interrupt is not None:
                on_interrupt()
            raise
        if self._status != 0:
            raise self._status

    def done(self):
        """True once the op has an outcome (also when the session ended before it did)."""
        if self._status is None and self._client.closed:
            self._status = _closed()
        if self._status is None:
            done = ctypes.c_int(0)
            _check(self._client._use(_lib.gs_op_test, self._ptr, ctypes.byref(done)))
            if done.value:
                rc = self._client._use(_lib.gs_op_wait_for, self._ptr, 0, ctypes.byref(done))
                self._finish(rc)
        return self._status is not None

    @property
    def seq(self):
        """This rank's sequence number of the op on its group (0 until it completed)."""
        return self._seq

    def __del__(self):
        ptr, self._ptr = getattr(self, "_ptr", None), None
        if ptr and _lib is not None:
            _lib.gs_op_free(ptr)
