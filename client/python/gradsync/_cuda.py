"""Every CUDA call of the package, in one place: the seam between gradsync's device logic
(_device.py, gradsync.torch) and CUDA. The real implementation goes through torch.cuda and the
C ABI (libgradsync_c.so exports the memory, creates the interprocess events and records/waits on
them with the CUDA runtime); tests install a fake with use() and see every call, in order.

Nothing here synchronises the host with a device except to_host(), which the package calls only
off the hot path (and says where). Streams are opaque objects to the package: it gets them from
current_stream() and hands them back.
"""
import threading

from . import _native

_lock = threading.Lock()
_api = None


class TorchCuda:
    """The real CUDA calls (torch.cuda, and libgradsync_c.so for what torch does not expose)."""

    def __init__(self):
        import torch
        self._torch = torch

    def device_of(self, tensor):
        """The CUDA device index of a tensor; None for host memory."""
        return tensor.device.index if tensor.is_cuda else None

    def empty(self, nbytes, device):
        """`nbytes` of device memory from torch's caching allocator (a uint8 tensor)."""
        return self._torch.empty(int(nbytes), dtype=self._torch.uint8,
                                 device=self._torch.device("cuda", device))

    def allocation(self, address):
        """(id, base, bytes, ipc_capable) of the allocation `address` lies in. id is unique over
        the process's life (0: not CUDA memory, or freed). Driver queries only, no sync."""
        alloc_id, base, nbytes, _, ipc = _native.cuda_allocation_of(address)
        return alloc_id, base, nbytes, ipc

    def register(self, client, base, nbytes):
        """Exports [base, base + nbytes) (the IPC handle of its allocation, the offset there,
        two interprocess events) and registers it with the daemon: a registration with `.id`."""
        return client.register_cuda(base, nbytes)

    def deregister(self, client, registration):
        client.deregister_cuda(registration)

    def current_stream(self, device):
        return self._torch.cuda.current_stream(device)

    def join_streams(self, later, earlier):
        """`later`'s next work waits for `earlier`'s work so far (device side)."""
        later.wait_stream(earlier)

    def record_ready(self, registration, stream):
        """The daemon's next op on the registration starts after `stream`'s work so far."""
        registration.ready(stream.cuda_stream)

    def wait_done(self, registration, stream):
        """`stream`'s later work waits for the daemon's last write of the registration."""
        registration.wait_done(stream.cuda_stream)

    def record_stream(self, tensor, stream):
        """torch's allocator hands `tensor`'s memory out again only after `stream`'s work so far
        (Tensor.record_stream): for a tensor freed after another stream than its own waited."""
        tensor.record_stream(stream)

    def use_stream(self, stream):
        """A context in which `stream` is the current stream of this thread."""
        return self._torch.cuda.stream(stream)

    def to_host(self, tensor):
        """A host copy: SYNCHRONISES the host with the tensor's stream (never on the hot path)."""
        return tensor.cpu()

    def future(self, device):
        """A torch future whose waiters' streams wait for the stream that completes it."""
        return self._torch.futures.Future(devices=[self._torch.device("cuda", device)])


def api():
    """The CUDA calls in use (the real ones unless a test installed a fake)."""
    global _api
    with _lock:
        if _api is None:
            _api = TorchCuda()
        return _api


def use(fake):
    """Installs `fake` (None: back to the real calls); returns the previous one. For tests."""
    global _api
    with _lock:
        previous, _api = _api, fake
        return previous


def installed():
    """The installed calls without creating the real ones (None before first use)."""
    return _api
