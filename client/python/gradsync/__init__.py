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
from . import _ops, elastic  # noqa: F401 - gradsync.elastic comes with the package
from ._native import Error, plan_packs
from .elastic import MembershipChanged
from ._ops import (DEFAULT_DAEMON_PORT, DEFAULT_SOCKET, WORLD, Group, Work, all_gather,
                   all_reduce, barrier, broadcast, client, dtype_name, empty, get_pack_list,
                   get_rank, get_world_size, init, is_initialized, new_group, reduce_scatter,
                   set_pack_list, shared_buffer, shutdown)
from ._ops import context as _ctx  # noqa: F401 - the session's context (tests read it)

__all__ = [
    "Error", "Group", "WORLD", "Work", "init", "is_initialized", "shutdown", "get_rank",
    "get_world_size", "new_group", "empty", "shared_buffer", "dtype_name", "all_reduce",
    "broadcast", "barrier", "all_gather", "reduce_scatter", "plan_packs", "set_pack_list",
    "get_pack_list", "client", "MembershipChanged",
]

# The operations are gradsync's to its users (repr, pickle, help), as elastic's names are
# gradsync.elastic's; Error and plan_packs keep their module, _native.
for _name in __all__:
    _obj = globals()[_name]
    if callable(_obj) and _obj.__module__ == _ops.__name__:
        _obj.__module__ = __name__
del _name, _obj
