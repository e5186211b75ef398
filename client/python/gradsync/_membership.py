"""An elastic job's membership as a rank learns it: the decision its daemons record in the
job's store when a node is lost or nodes join, what a failed op means then (classify:
MembershipChanged), and a joining node's admission. The operations raise what this module
decides; gradsync.elastic (reset, run, the state) builds on it and re-exports its public names.
"""
import os
import threading
import time
import weakref

from . import _native
from ._native import Error

# How long a trainer waits for its daemons' decision after an op failed on a lost node: their
# settle time (300 ms) plus a store round trip, with room for a loaded machine.
DECISION_WAIT_S = 5.0
# How often a store wait of an elastic job looks for a membership decision (until_changed).
CHECK_S = 0.5
# Where the daemons record a membership decision, in the namespace of the epoch it ends.
DECISION_KEY = "_gradsync_elastic/decision"
# How long a joining node's ranks wait for each other.
LOBBY_WAIT_S = 60.0
# How long a joiner waits to be admitted (GRADSYNC_JOIN_TIMEOUT): until the job's next commit().
JOIN_TIMEOUT_S = 300.0
# What a join's call leaves past its wait (the daemon's kJoinGrace, common/elastic_records.h).
JOIN_GRACE_S = 10.0


# Codes an op fails with when a peer node is lost (the peer watch's word, a link that broke,
# an aborted device group): only these make a trainer look for a decision.
_LOSS_CODES = ("UNAVAILABLE", "ABORTED", "CANCELLED")

_followers = weakref.WeakSet()  # objects with _reset_membership() (DistributedOptimizer)


def follow(obj):
    """obj._reset_membership() runs after each reset to a new membership (while obj lives)."""
    _followers.add(obj)


def followers():
    """The objects follow() was given that still live."""
    return list(_followers)


class MembershipChanged(Error):
    """The job's membership changed: the op that raised this (and every later op of the old
    membership) did not complete on this rank and wrote none of its operands on the CPU plane
    (a device op cut off may have; a survivor whose last bytes arrived before the loss may
    have completed the same op: run's restore() brings every rank back to the last commit).
    `lost_ranks` and `lost_nodes` say who went, `world_size` the new
    size, `rank` this rank's new rank, `epoch` the new membership's number. Call reset() (the
    run decorator does) before the next op."""

    def __init__(self, code, detail, epoch=0, world_size=0, rank=-1, lost_ranks=(),
                 lost_nodes=(), why="", joined=0):
        super().__init__(code, detail)
        self.epoch = epoch
        self.world_size = world_size
        self.rank = rank
        self.lost_ranks = tuple(lost_ranks)
        self.lost_nodes = tuple(lost_nodes)
        self.why = why
        self.joined = joined  # ranks joining (they take the ranks after the others')

    def __reduce__(self):
        return type(self), (self.code, self.detail, self.epoch, self.world_size, self.rank,
                            self.lost_ranks, self.lost_nodes, self.why, self.joined)


def parse_decision(raw):
    """The fields of a decision as the daemons record it (gradsync.v1.MembershipDecision, read
    by the C ABI): epoch, world_size, lost_ranks, lost_nodes, joined, why."""
    d = _native.record("decision", raw)
    return {
        "epoch": int(d["epoch"]),
        "world_size": int(d["world"]),
        "lost_ranks": [int(r) for r in d["lost_ranks"]],
        "lost_nodes": list(d["lost_nodes"]),
        "joined": int(d["joined"]),
        "why": d["why"],
    }


def classify(ctx, err):
    """`err` as the trainer should see it in an elastic job: MembershipChanged when the job's
    daemons recorded a new membership, an Error saying why when this rank is not part of it,
    else `err` itself."""
    if (ctx is None or not ctx.elastic or isinstance(err, MembershipChanged)
            or not isinstance(err, Error) or err.code not in _LOSS_CODES):
        return err
    if ctx.membership_change is not None:
        return ctx.membership_change
    try:
        raw = ctx.client.store_get(DECISION_KEY, DECISION_WAIT_S)
    except Error as e:
        if e.code == "DEADLINE_EXCEEDED":
            return err  # no node was lost: the op failed for its own reason
        where = (f"the daemon at {ctx.root_address} (the job's root)" if ctx.root_address
                 else "the job's store")
        code = e.code
        return Error(code, f"elastic job {ctx.base_job}: {err.detail}; its new membership "
                             f"cannot be read from {where}: {e.detail}. An elastic job "
                             "survives the loss of its root's node only with its store on "
                             "etcd (gradsyncd --store=etcd)")
    return seen(ctx, raw)


def until_changed(ctx, wait, timeout_s):
    """wait(slice_s) in slices of at most CHECK_S seconds until it returns (its result) or
    timeout_s passes (its DEADLINE_EXCEEDED). A store wait is no op on a group, so a node's loss
    does not wake it: between slices, a membership decision recorded for this epoch raises what
    it means to this rank (MembershipChanged)."""
    deadline = time.monotonic() + max(float(timeout_s), 0.0)
    while True:
        try:
            return wait(max(0.001, min(deadline - time.monotonic(), CHECK_S)))
        except Error as e:
            if e.code != "DEADLINE_EXCEEDED" or time.monotonic() >= deadline:
                raise classify(ctx, e) from None
        if ctx.membership_change is not None:
            raise ctx.membership_change
        try:
            raw = ctx.client.store_get(DECISION_KEY, 0)
        except Error as e:
            if e.code != "DEADLINE_EXCEEDED":
                raise classify(ctx, e) from None
            continue
        raise seen(ctx, raw)


def seen(ctx, raw):
    """What the decision `raw` (its bytes in the store) means to this rank, kept as the change
    this session saw."""
    ctx.membership_change = _change_of(ctx, parse_decision(raw))
    return ctx.membership_change


def _change_of(ctx, d):
    """What decision `d` means to this rank: MembershipChanged, or an Error when this rank is
    out of the job."""
    lost = d["lost_ranks"]
    if ctx.rank in lost:
        return Error("UNAVAILABLE", f"elastic job {ctx.base_job}: this rank ({ctx.rank}) is "
                                    f"out of the job: the other nodes lost its node "
                                    f"({d['why']}) and go on without it")
    rank = ctx.rank - sum(1 for r in lost if r < ctx.rank)
    what = []
    if lost:
        what.append(f"rank(s) {','.join(map(str, lost))} on node(s) "
                    f"{','.join(d['lost_nodes'])} lost")
    if d["joined"]:
        what.append(f"{d['joined']} rank(s) joining")
    if d["world_size"] < ctx.min_world_size:
        what.append(f"fewer than min_world_size={ctx.min_world_size}: after reset() it waits "
                    "for nodes to join")
    return MembershipChanged(
        "ABORTED",
        f"membership of elastic job {ctx.base_job} changed: {' and '.join(what)} "
        f"({d['why']}); it goes on as epoch {d['epoch']} with {d['world_size']} rank(s), "
        f"this rank becoming {rank} (was {ctx.rank})",
        epoch=d["epoch"], world_size=d["world_size"], rank=rank, lost_ranks=lost,
        lost_nodes=d["lost_nodes"], why=d["why"], joined=d["joined"])


def _lobby_id(job, socket):
    """The one-node job in which a joining node's ranks share its ticket: named after the node
    (its host and daemon socket), as with --store=etcd every node's daemon reaches one store."""
    import hashlib  # noqa: PLC0415
    import socket as sockets  # noqa: PLC0415
    node = hashlib.sha256(f"{sockets.gethostname()}:{socket}".encode()).hexdigest()[:16]
    lobby = f"{job}.join-{node}"
    if len(lobby) <= 128:
        return lobby
    return "gradsync-join-" + hashlib.sha256(f"{job}:{node}".encode()).hexdigest()[:32]


def open_store(job, connect):
    """A client of job `job`'s store alone (no session), reached as init()'s `connect` says."""
    token = ""
    if connect.get("token_file"):
        with open(connect["token_file"]) as f:
            token = f.read().strip()
    return _native.Client(connect["socket"], job, 0, 0, 0, 0,
                          root_address=connect.get("root_address") or "", token=token,
                          rpc_timeout_s=float(connect.get("rpc_timeout") or 0),
                          tls=connect.get("tls"), store_only=True)


def join(job, local_rank, local_world_size, socket, connect, timeout_s=None):
    """A joining node's rank: asks, once every local rank has come, to join (local rank 0, for
    the node's ranks: the daemon takes the node's ticket, waits for the job's next commit() to
    admit it, and withdraws it if that does not come in time), and returns (epoch, rank,
    world_size, min_world_size) to register as. The other local ranks learn the answer from
    local rank 0. Called by gradsync.init(join=True)."""
    if timeout_s is None:
        timeout_s = float(os.environ.get("GRADSYNC_JOIN_TIMEOUT") or JOIN_TIMEOUT_S)
    lobby = None
    try:
        if local_world_size > 1:  # the node's ranks, on this daemon alone
            lobby = _native.Client(socket, _lobby_id(job, socket), local_world_size, local_rank,
                                   local_rank, local_world_size,
                                   rpc_timeout_s=float(connect.get("rpc_timeout") or 0))
            lobby.barrier(timeout_s=LOBBY_WAIT_S).wait()  # every local rank has come
        if local_rank == 0:
            raw, failed = _ask_to_join(job, local_world_size, connect, timeout_s), None
            if isinstance(raw, BaseException):
                failed = raw
                code, detail = ((raw.code, raw.detail) if isinstance(raw, Error)
                                else ("INTERNAL", repr(raw)))
                raw = b"!" + f"{code}\n{detail}".encode()
            if lobby is not None:
                lobby.store_set("admission", raw)
        if lobby is not None:
            # Read only once rank 0 has written it: the lobby's namespace is this node's ranks'
            # since they registered (no other user's process may write it), but a value put
            # there before is overwritten only by rank 0's.
            lobby.barrier(timeout_s=timeout_s + JOIN_GRACE_S + LOBBY_WAIT_S).wait()
        if local_rank == 0:
            if failed is not None:
                raise failed
        else:
            raw = lobby.store_get("admission", LOBBY_WAIT_S)
            if raw.startswith(b"!"):
                code, detail = raw[1:].decode(errors="replace").split("\n", 1)
                raise Error(code, f"{detail} (this node's local rank 0 asked to join)")
    finally:
        if lobby is not None:
            lobby.close()
    a = _native.record("admission", raw)
    return (int(a["epoch"]), int(a["rank"]) + local_rank, int(a["world"]),
            int(a["min_world_size"]))


def _ask_to_join(job, ranks, connect, timeout_s):
    """The node's admission record, or the Error that ended its join. The call blocks in C
    for the whole wait: it runs on a thread of its own, so that this one handles signals
    (a process interrupted and gone, its daemon withdraws the ticket)."""
    home = open_store(job, connect)
    out = {}

    def call():
        try:
            out["raw"] = home.store_join(ranks, timeout_s)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            out["error"] = e

    asking = threading.Thread(target=call, name="gradsync-join", daemon=True)
    asking.start()
    while asking.is_alive():
        asking.join(CHECK_S)
    home.close()
    return out.get("raw", out.get("error"))
