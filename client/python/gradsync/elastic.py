"""Elastic jobs: training goes on when a node of the job is lost.

A job opts in with gradsync.init(..., elastic=True, min_world_size=N) (or GRADSYNC_ELASTIC=1,
GRADSYNC_MIN_WORLD_SIZE). When a node is lost (its daemon killed, frozen or cut off) its peers'
daemons notice it within --peer_timeout and record one decision of
the new membership in the job's store. An op that fails because of the loss then raises
MembershipChanged on every survivor, naming the ranks and nodes lost and the new world size.
The survivors keep their order and take
contiguous new ranks once they reset (reset(), or the run decorator below, which also restores
the last committed state and broadcasts it from the new rank 0). What the failed op left in a
buffer is not to be used: the run decorator's restore() puts the committed state back (a CPU
ring all-reduce that stopped midway may have added part of the sum).

    state = gradsync.elastic.TorchState(model=model, optimizer=opt, step=0)

    @gradsync.elastic.run
    def train(state):
        while state.step < steps:
            ...  # forward, backward, opt.step()
            state.step += 1
            state.commit()

    train(state)

A replacement (or an extra) node joins a running job: its daemon starts as the others did, and
its trainers call gradsync.init(job=..., elastic=True, join=True) (or GRADSYNC_JOIN=1; their
rank and world size are given to them). Each joining node takes a ticket in the job's home keys
(the store namespace of the job's own id); the ranks admit the waiting nodes at their next
state.commit(): rank 0 records the decision (the world grows, the joiners take the ranks after
the others'), commit() raises MembershipChanged on every rank, and the run decorator resets and
syncs the state from rank 0, which the joiners receive in their first sync(). A joiner not
admitted within its join timeout withdraws its ticket and fails.

Each membership is an epoch: epoch E of job J runs as job "J.eE" in the daemons (E = 0: "J").
Below min_world_size the survivors reset to their smaller world and wait there (at most
GRADSYNC_ELASTIC_TIMEOUT seconds, default 600, then DEADLINE_EXCEEDED) until joining nodes
bring it back to min_world_size, as Horovod does.

A node whose trainers die (their connections lost) while its daemon lives is lost too: its
daemon decides so. Groups made by new_group follow each change (gradsync.Group): lost ranks
leave them, the others take their new ranks.
"""
import copy
import functools
import io
import os
import time
import weakref

from ._native import Error

__all__ = ["MembershipChanged", "State", "TorchState", "run", "reset", "classify",
           "parse_decision"]

# How long a trainer waits for its daemons' decision after an op failed on a lost node: their
# settle time (300 ms) plus a store round trip, with room for a loaded machine.
DECISION_WAIT_S = 5.0
# How often a store wait of an elastic job looks for a membership decision (_until_changed).
CHECK_S = 0.5
# The most membership changes one run() call goes through before it gives up.
MAX_RESETS = 64
_DECISION_KEY = "_gradsync_elastic/decision"
# How long ranks below min_world_size wait for nodes to join (GRADSYNC_ELASTIC_TIMEOUT).
ELASTIC_TIMEOUT_S = 600.0
# How many times a joining node's ranks look for their admission before they give up, and how
# long they wait for each other.
MAX_TICKET_TRIES = 5
LOBBY_WAIT_S = 60.0
# The most ranks one commit admits (the daemons' kMaxJoinedPerDecision).
MAX_JOINED_PER_COMMIT = 1024
# How long a joiner waits to be admitted (GRADSYNC_JOIN_TIMEOUT): until the job's next commit().
JOIN_TIMEOUT_S = 300.0


def _admit_key(ticket):
    """Where the daemons write a joining node's place ("epoch=E world=W rank=R min=M", R the
    rank of the node's local rank 0), in the job's home namespace."""
    return f"_gradsync_elastic/admit/{ticket}"


# Codes an op fails with when a peer node is lost (the peer watch's word, a link that broke,
# an aborted device group): only these make a trainer look for a decision.
_LOSS_CODES = ("UNAVAILABLE", "ABORTED", "CANCELLED")

_reset_hooks = weakref.WeakSet()  # objects with _reset_membership() (DistributedOptimizer)


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


def _fields(text):
    """The key=value fields of a record of the job's store ("epoch=E world=N ...")."""
    return dict(part.split("=", 1) for part in text.split() if "=" in part)


def parse_decision(text):
    """The fields of a decision as the daemons record it: "epoch=E
    world=N lost_ranks=a,b lost_nodes=x,y [joined=K] at=MS why=..." (why last: it may hold
    spaces)."""
    head, _, why = text.partition(" why=")
    fields = _fields(head)
    try:
        return {
            "epoch": int(fields["epoch"]),
            "world_size": int(fields["world"]),
            "lost_ranks": [int(r) for r in fields.get("lost_ranks", "").split(",") if r],
            "lost_nodes": [n for n in fields.get("lost_nodes", "").split(",") if n],
            "joined": int(fields.get("joined", "0")),
            "why": why,
        }
    except (KeyError, ValueError) as e:
        raise Error("INTERNAL", f"unreadable membership decision {text!r}: {e}") from None


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
        raw = ctx.client.store_get(_DECISION_KEY, DECISION_WAIT_S)
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
    return _seen(ctx, raw)


def _until_changed(ctx, wait, timeout_s):
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
            raw = ctx.client.store_get(_DECISION_KEY, 0)
        except Error as e:
            if e.code != "DEADLINE_EXCEEDED":
                raise classify(ctx, e) from None
            continue
        raise _seen(ctx, raw)


def _seen(ctx, raw):
    """What the decision `raw` (its bytes in the store) means to this rank, kept as the change
    this session saw."""
    ctx.membership_change = _change_of(ctx, parse_decision(raw.decode(errors="replace")))
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


def reset(change=None):
    """Joins the new membership: ends this rank's session of the old one and registers as
    its new rank in the next epoch (the daemons form it as they did the first), then lets the
    package's objects (DistributedOptimizer) follow it. `change`: the MembershipChanged raised
    (default: the one this session saw)."""
    from . import _ctx, _reinit  # noqa: PLC0415 - the package imports this module
    ctx = _ctx()
    change = change or ctx.membership_change
    if not isinstance(change, MembershipChanged):
        raise Error("FAILED_PRECONDITION", "no membership change to reset to")
    _reinit(change)
    for obj in list(_reset_hooks):
        obj._reset_membership()
    if change.world_size < ctx.min_world_size:
        _wait_for_joiners()


def _wait_for_joiners():
    """Fewer ranks than min_world_size: rank 0 admits joining nodes once they bring the world
    back to it (or a loss is decided meanwhile), and every rank raises that change; Error
    DEADLINE_EXCEEDED after GRADSYNC_ELASTIC_TIMEOUT seconds (default 600) without."""
    from . import _context  # noqa: PLC0415
    ctx = _context
    timeout_s = float(os.environ.get("GRADSYNC_ELASTIC_TIMEOUT") or ELASTIC_TIMEOUT_S)
    need = min(ctx.min_world_size - ctx.world_size, MAX_JOINED_PER_COMMIT)
    deadline = time.monotonic() + timeout_s
    late = Error("DEADLINE_EXCEEDED",
                 f"elastic job {ctx.base_job}: {ctx.world_size} rank(s) left, fewer than "
                 f"min_world_size={ctx.min_world_size}, and not enough nodes joined within "
                 f"{timeout_s:g} s (GRADSYNC_ELASTIC_TIMEOUT)")
    if ctx.rank == 0:
        while True:
            try:
                decided, _ = ctx.client.store_admit_joiners(ctx.epoch + 1, ctx.min_world_size,
                                                            need)
            except Error as e:
                if e.code not in ("FAILED_PRECONDITION", "UNAVAILABLE"):
                    raise
                decided = False  # the epoch is still forming, or the store is away: again
            if decided:
                break
            if time.monotonic() >= deadline:
                raise late
            try:  # a pause, which also ends when a loss is decided meanwhile
                ctx.client.store_get(_DECISION_KEY, 0.2)
                break
            except Error as e:
                if e.code != "DEADLINE_EXCEEDED":
                    raise
    try:
        # Past the deadline, rank 0 has given up first.
        raw = ctx.client.store_get(_DECISION_KEY,
                                   max(0.1, deadline - time.monotonic()) + DECISION_WAIT_S)
    except Error as e:
        if e.code == "DEADLINE_EXCEEDED":
            raise late from None
        raise
    raise _seen(ctx, raw)


class State:
    """State kept in memory across membership changes: commit() keeps a copy, restore() goes
    back to it, sync() makes every rank's state rank 0's. Scalars passed as keywords are read
    and written as attributes (state.step += 1) and committed with the rest."""

    def __init__(self, **scalars):
        object.__setattr__(self, "_scalars", dict(scalars))
        object.__setattr__(self, "_saved_scalars", dict(scalars))
        object.__setattr__(self, "_reset_callbacks", [])

    def __getattr__(self, name):
        scalars = self.__dict__.get("_scalars", {})
        if name in scalars:
            return scalars[name]
        raise AttributeError(name)

    def __setattr__(self, name, value):
        if name in self._scalars:
            self._scalars[name] = value
        else:
            object.__setattr__(self, name, value)

    def register_reset_callbacks(self, callbacks):
        """Functions called (no arguments) after each reset, once the state is synced: rescale
        the learning rate, re-shard the data."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        """Calls the reset callbacks (run() does, after each reset)."""
        for callback in self._reset_callbacks:
            callback()

    def commit(self):
        """Keeps a copy of the state in memory (what restore() goes back to), then admits the
        nodes waiting to join an elastic job: if there are, the membership changes here, and
        MembershipChanged is raised on every rank (the run decorator resets and syncs)."""
        self._save()
        _admit_joiners()

    def _save(self):
        self._saved_scalars = copy.deepcopy(self._scalars)

    def restore(self):
        """Goes back to the last commit()."""
        self._scalars.clear()
        self._scalars.update(copy.deepcopy(self._saved_scalars))

    def sync(self):
        """Every rank's state becomes rank 0's (a broadcast over the world)."""
        synced = _broadcast_object(dict(self._scalars))
        self._scalars.clear()
        self._scalars.update(synced)


class TorchState(State):
    """A model's and an optimizer's state (state_dict()), and scalars. The optimizer may be a
    gradsync.torch.DistributedOptimizer."""

    def __init__(self, model=None, optimizer=None, **scalars):
        super().__init__(**scalars)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "optimizer", optimizer)
        object.__setattr__(self, "_saved", None)
        self._save()

    def _save(self):
        """Keeps a copy of the model's and optimizer's state_dict() and the scalars."""
        super()._save()
        self._saved = (
            copy.deepcopy(self.model.state_dict()) if self.model is not None else None,
            copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None)

    def restore(self):
        """Loads the last commit() into the model and the optimizer."""
        super().restore()
        model_state, optimizer_state = self._saved
        if self.model is not None:
            self.model.load_state_dict(model_state)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(optimizer_state)

    def sync(self):
        """Rank 0's model, optimizer and scalars on every rank (one broadcast of their bytes)."""
        import torch  # noqa: PLC0415 - torch only where a TorchState is used
        snapshot = None
        from . import get_rank  # noqa: PLC0415
        if get_rank() == 0:
            buf = io.BytesIO()
            torch.save({
                "model": self.model.state_dict() if self.model is not None else None,
                "optimizer": (self.optimizer.state_dict() if self.optimizer is not None
                              else None),
                "scalars": dict(self._scalars)}, buf)
            snapshot = buf.getvalue()
        data = _broadcast_bytes(snapshot)
        if get_rank() != 0:
            # Onto the host (rank 0's device index means nothing here); load_state_dict copies
            # into the model's own tensors, wherever they are.
            try:
                state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
            except TypeError:  # torch before 1.13 has no weights_only
                state = torch.load(io.BytesIO(data), map_location="cpu")
            if self.model is not None:
                self.model.load_state_dict(state["model"])
            if self.optimizer is not None:
                self.optimizer.load_state_dict(state["optimizer"])
            self._scalars.clear()
            self._scalars.update(state["scalars"])


def _broadcast_bytes(data):
    """rank 0's `data` (bytes) on every rank of the world."""
    import array  # noqa: PLC0415
    from . import broadcast, get_rank  # noqa: PLC0415
    size = array.array("q", [len(data) if get_rank() == 0 else 0])
    broadcast(size, src=0)
    payload = bytearray(data if get_rank() == 0 else bytes(size[0]))
    if size[0]:
        broadcast(payload, src=0)
    return bytes(payload)


def _broadcast_object(obj):
    import pickle  # noqa: PLC0415
    from . import get_rank  # noqa: PLC0415
    data = pickle.dumps(obj) if get_rank() == 0 else b""
    return pickle.loads(_broadcast_bytes(data))


def _admit_joiners():
    """commit()'s part in an elastic job: rank 0 admits the joining nodes waiting (it records
    the decision), every rank learns whether it did (a broadcast), and if so every rank raises
    MembershipChanged."""
    from . import _context  # noqa: PLC0415 - the package imports this module
    ctx = _context
    if ctx is None or not ctx.elastic or ctx.client.closed:
        return
    if not ctx.root_address and ctx.local_world_size == ctx.world_size:
        return  # one node on its daemon's own store: no node can join it (alike on every rank)
    decided, failure = 0, None
    if ctx.rank == 0:
        try:
            # The daemon admits the waiting nodes and records the decision (its one writer).
            decided = 1 if ctx.client.store_admit_joiners(ctx.epoch + 1,
                                                          ctx.min_world_size)[0] else 0
        except Error:
            decided = 1 if _decided(ctx) else 0  # the store failed: the joiners wait
        except Exception as e:  # noqa: BLE001 - raised after the others are told
            failure = e
            decided = 1 if _decided(ctx) else 0
    import array  # noqa: PLC0415
    from . import broadcast  # noqa: PLC0415
    flag = array.array("q", [decided])
    broadcast(flag, src=0)  # a loss meanwhile raises MembershipChanged here
    if failure is not None:
        raise failure
    if flag[0] == 0:
        return
    raw = ctx.client.store_get(_DECISION_KEY, DECISION_WAIT_S)  # there: rank 0 saw it
    raise _seen(ctx, raw)


def _decided(ctx):
    """The decision recorded in this epoch's namespace, or None (none, or unreadable)."""
    try:
        return ctx.client.store_get(_DECISION_KEY, 0.5)
    except Error:
        return None


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


def _join(job, local_rank, local_world_size, socket, connect, timeout_s=None):
    """A joining node's rank: takes this node's ticket (local rank 0, once every local rank has
    come; the others learn it from their daemon), waits to be admitted at the job's next
    commit() and returns (epoch, rank, world_size, min_world_size) to register as. Called by
    gradsync.init(join=True)."""
    from . import _native, _open_store  # noqa: PLC0415
    if timeout_s is None:
        timeout_s = float(os.environ.get("GRADSYNC_JOIN_TIMEOUT") or JOIN_TIMEOUT_S)
    home = _open_store(job, connect)
    lobby = None
    ticket = None
    try:
        if local_world_size > 1:  # the node's ranks, on this daemon alone
            lobby = _native.Client(socket, _lobby_id(job, socket), local_world_size, local_rank,
                                   local_rank, local_world_size,
                                   rpc_timeout_s=float(connect.get("rpc_timeout") or 0))
            lobby.barrier(timeout_s=LOBBY_WAIT_S).wait()  # every local rank has come
        if local_rank == 0:
            ticket = home.store_take_ticket(local_world_size)
            if lobby is not None:
                lobby.store_set("ticket", str(ticket).encode())
        if lobby is not None:
            # Read only once rank 0 has written it: the lobby's namespace is this node's ranks'
            # since they registered (no other user's process may write it), but a value put
            # there before is overwritten only by rank 0's.
            lobby.barrier(timeout_s=LOBBY_WAIT_S).wait()
        if local_rank != 0:
            ticket = int(lobby.store_get("ticket", LOBBY_WAIT_S))
        if lobby is not None:
            lobby.close()
            lobby = None
        raw = _wait_admission(home, job, ticket, local_rank == 0, timeout_s)
    except BaseException:
        if local_rank == 0 and ticket is not None:  # not admitted: nobody waits for it
            try:
                home.store_withdraw_ticket(ticket)
            except Error:
                pass
        raise
    finally:
        if lobby is not None:
            lobby.close()
        home.close()
    fields = _fields(raw.decode(errors="replace"))
    try:
        return (int(fields["epoch"]), int(fields["rank"]) + local_rank, int(fields["world"]),
                int(fields["min"]))
    except (KeyError, ValueError):
        raise Error("INTERNAL", f"elastic job {job}: unreadable admission {raw!r}") from None


def _wait_admission(home, job, ticket, withdraws, timeout_s):
    """The admission of `ticket`, waited for at most timeout_s; then the node's local rank 0
    (`withdraws`) withdraws it, unless rank 0 of the job claimed it meanwhile (then its answer
    comes at once, or the claim is undone and it withdraws)."""
    late = Error("DEADLINE_EXCEEDED",
                 f"elastic job {job}: not admitted within {timeout_s:g} s (the job's ranks "
                 "admit joining nodes at state.commit()); this node's ticket is withdrawn")
    wait = timeout_s
    for _ in range(MAX_TICKET_TRIES):
        try:
            return home.store_get(_admit_key(ticket), wait)
        except Error as e:
            if e.code != "DEADLINE_EXCEEDED":
                raise
        if withdraws:
            withdrawn, state = home.store_withdraw_ticket(ticket)
            if withdrawn or state != b"claimed":
                raise late
        wait = DECISION_WAIT_S  # claimed: being admitted (or the claim undone) now
    raise late


def run(func):
    """Runs func(state, ...) and, when the membership changes under it, restores the state's
    last commit, resets to the new membership, syncs the state from the new rank 0, calls the
    state's reset callbacks and calls func again. The state is synced once before the first
    call too (every rank starts from rank 0's)."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        change, changes = None, 0
        while True:
            try:
                if change is not None:
                    state.restore()
                    reset(change)
                state.sync()  # a change during it (another node lost) is handled as any other
                if change is not None:
                    change = None
                    state.on_reset()
                return func(state, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a change may come wrapped (below)
                seen = _change_behind(e)
                if seen is None:
                    raise
                if not isinstance(seen, MembershipChanged):
                    raise seen from e  # this rank is out of the job
                changes += 1
                if changes > MAX_RESETS:
                    raise Error("RESOURCE_EXHAUSTED", f"the membership changed {MAX_RESETS} "
                                                      "times in one run; giving up") from e
                change = seen
    return wrapper


def _change_behind(err):
    """The membership change `err` stands for: itself when it is one; else the change this
    session saw, when there is one (torch's DDP raises a comm hook's MembershipChanged as a
    RuntimeError of its own); else None."""
    if isinstance(err, MembershipChanged):
        return err
    from . import _context  # noqa: PLC0415 - the package imports this module
    if _context is None or not _context.elastic:
        return None
    return _context.membership_change
