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
rank and world size are given to them). Each joining node asks its daemon to join and is told
its place; the job's ranks admit the waiting nodes at their next state.commit(): rank 0's
daemon records the decision (the world grows, the joiners take the ranks after the others'),
commit() raises MembershipChanged on every rank, and the run decorator resets and syncs the
state from rank 0, which the joiners receive in their first sync(). A joiner not admitted
within its join timeout (GRADSYNC_JOIN_TIMEOUT, default 300 s) fails with DEADLINE_EXCEEDED;
its daemon withdraws its place in line, as it does when the joiner dies while it waits.

Each membership is an epoch: epoch E of job J runs as job "J.eE" in the daemons (E = 0: "J").
Below min_world_size the survivors reset to their smaller world and wait there (at most
GRADSYNC_ELASTIC_TIMEOUT seconds, default 600, then DEADLINE_EXCEEDED) until joining nodes
bring it back to min_world_size, as Horovod does.

A node whose trainers die (their connections lost) while its daemon lives is lost too: its
daemon decides so. Groups made by new_group follow each change (gradsync.Group): lost ranks
leave them, the others take their new ranks.
"""
import array
import copy
import functools
import gc
import io
import os
import pickle
import time

from . import _membership, _ops
from ._membership import (CHECK_S, DECISION_WAIT_S, JOIN_TIMEOUT_S, LOBBY_WAIT_S,  # noqa: F401
                          MembershipChanged, classify, parse_decision)
from ._native import Error

__all__ = ["MembershipChanged", "State", "TorchState", "run", "reset", "classify",
           "parse_decision"]

# Defined in _membership (the operations raise them), they are this module's to its users
# (repr, pickle, help).
for _name in ("MembershipChanged", "classify", "parse_decision"):
    globals()[_name].__module__ = __name__
del _name

# The most membership changes one run() call goes through before it gives up.
MAX_RESETS = 64
# How long ranks below min_world_size wait for nodes to join (GRADSYNC_ELASTIC_TIMEOUT).
ELASTIC_TIMEOUT_S = 600.0
# The most ranks one commit admits (the daemons' kMaxJoinedPerDecision).
MAX_JOINED_PER_COMMIT = 1024


def reset(change=None):
    """Joins the new membership: ends this rank's session of the old one and registers as
    its new rank in the next epoch (the daemons form it as they did the first), then lets the
    package's objects (DistributedOptimizer) follow it. `change`: the MembershipChanged raised
    (default: the one this session saw)."""
    ctx = _ops.context()
    change = change or ctx.membership_change
    if not isinstance(change, MembershipChanged):
        raise Error("FAILED_PRECONDITION", "no membership change to reset to")
    _ops.reinit(change)
    for obj in _membership.followers():
        obj._reset_membership()
    if change.world_size < ctx.min_world_size:
        _wait_for_joiners()


def _wait_for_joiners():
    """Fewer ranks than min_world_size: rank 0 admits joining nodes once they bring the world
    back to it (or a loss is decided meanwhile), and every rank raises that change; Error
    DEADLINE_EXCEEDED after GRADSYNC_ELASTIC_TIMEOUT seconds (default 600) without."""
    ctx = _ops.current()
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
                ctx.client.store_get(_membership.DECISION_KEY, 0.2)
                break
            except Error as e:
                if e.code != "DEADLINE_EXCEEDED":
                    raise
    try:
        # Past the deadline, rank 0 has given up first.
        raw = ctx.client.store_get(_membership.DECISION_KEY,
                                   max(0.1, deadline - time.monotonic()) + DECISION_WAIT_S)
    except Error as e:
        if e.code == "DEADLINE_EXCEEDED":
            raise late from None
        raise
    raise _membership.seen(ctx, raw)


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
        MembershipChanged is raised on every rank (the run decorator resets and syncs). First
        waits until this trainer's device ops have settled on the GPU: one that failed there
        after its answer raises instead (MembershipChanged in an elastic job that lost a
        node), so what commit() saves came from ops that succeeded."""
        _settle()
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
        if _ops.get_rank() == 0:
            buf = io.BytesIO()
            torch.save({
                "model": self.model.state_dict() if self.model is not None else None,
                "optimizer": (self.optimizer.state_dict() if self.optimizer is not None
                              else None),
                "scalars": dict(self._scalars)}, buf)
            snapshot = buf.getvalue()
        data = _broadcast_bytes(snapshot)
        if _ops.get_rank() != 0:
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
    size = array.array("q", [len(data) if _ops.get_rank() == 0 else 0])
    _ops.broadcast(size, src=0)
    payload = bytearray(data if _ops.get_rank() == 0 else bytes(size[0]))
    if size[0]:
        _ops.broadcast(payload, src=0)
    return bytes(payload)


def _broadcast_object(obj):
    data = pickle.dumps(obj) if _ops.get_rank() == 0 else b""
    return pickle.loads(_broadcast_bytes(data))


def _settle():
    """Waits until the device ops this trainer submitted have settled on the GPU (at once on the
    CPU path); raises the failure of one that failed there after its OK answer, as a failed op
    raises it."""
    ctx = _ops.current()
    if ctx is None or ctx.client.closed:
        return
    try:
        ctx.client.settle()
    except Error as e:
        seen = classify(ctx, e)
        if seen is e:
            raise
        raise seen from e


def _admit_joiners():
    """commit()'s part in an elastic job: rank 0 admits the joining nodes waiting (it records
    the decision), every rank learns whether it did (a broadcast), and if so every rank raises
    MembershipChanged."""
    ctx = _ops.current()
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
    flag = array.array("q", [decided])
    _ops.broadcast(flag, src=0)  # a loss meanwhile raises MembershipChanged here
    if failure is not None:
        raise failure
    if flag[0] == 0:
        return
    raw = ctx.client.store_get(_membership.DECISION_KEY, DECISION_WAIT_S)  # there: rank 0 saw it
    raise _membership.seen(ctx, raw)


def _decided(ctx):
    """The decision recorded in this epoch's namespace, or None (none, or unreadable)."""
    try:
        return ctx.client.store_get(_membership.DECISION_KEY, 0.5)
    except Error:
        return None


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
                    # What the last call built over the old membership (a torch DDP, whose
                    # hooks on the parameters would fire beside the new one's) goes before the
                    # next call builds it again: it sits in reference cycles.
                    gc.collect()
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
                change = _detached(seen)
    return wrapper


def _detached(change):
    """`change` holding no frame of the failed call, through its traceback or the errors it
    came from (whose frames hold what that call built: a torch DDP over the old membership)."""
    change.__cause__ = change.__context__ = None
    return change.with_traceback(None)


def _change_behind(err):
    """The membership change `err` stands for: itself when it is one; else the change this
    session saw, when there is one (torch's DDP raises a comm hook's MembershipChanged as a
    RuntimeError of its own); else None."""
    if isinstance(err, MembershipChanged):
        return err
    ctx = _ops.current()
    if ctx is None or not ctx.elastic:
        return None
    return ctx.membership_change
