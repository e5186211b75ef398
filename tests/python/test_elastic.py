"""Elastic jobs across real daemons on loopback: a node is lost mid-training (its daemon and
trainer killed, or its daemon frozen), the survivors' op fails with MembershipChanged naming the
lost rank and node, they reset to the new membership (contiguous ranks, the new world size) with
their state restored and synced, and train on; their parameters end identical."""
import json
import os
import re
import signal
import socket
import sys
import time
import urllib.request

import pytest

from conftest import BUILD, Ranks, env_for, launch, tcp_daemons

sys.path.insert(0, os.path.join(BUILD, "python"))  # the package, for the tests without daemons

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "elastic_worker.py")


@pytest.fixture
def three_daemons(tmp, monkeypatch):
    ds = tcp_daemons(tmp, monkeypatch, 3)
    yield ds
    for d in ds:
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGCONT)
        d.stop()


def _lines(ranks, i):
    return [json.loads(l) for l in ranks.output(i).splitlines() if l.startswith("{")]


def _wait_steps(ranks, step, timeout_s=60):
    """Until every trainer has reported `step` (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(any(l.get("step", 0) >= step for l in _lines(ranks, i))
               for i in range(len(ranks.procs))):
            return
        for i, p in enumerate(ranks.procs):
            if p.poll() is not None:
                pytest.fail(f"rank {i} exited {p.returncode}:\n{ranks.output(i)[-3000:]}")
        time.sleep(0.02)
    pytest.fail("no step %d in %d s:\n%s" % (step, timeout_s, "\n".join(
        ranks.output(i)[-1500:] for i in range(len(ranks.procs)))))


def _finish(ranks, survivors, timeout_s=90):
    deadline = time.monotonic() + timeout_s
    out = {}
    for i in survivors:
        try:
            ranks.procs[i].wait(max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - reported below
            for p in ranks.procs:
                p.kill()
            pytest.fail(f"rank {i} still running:\n{ranks.output(i)[-3000:]}")
        assert ranks.procs[i].returncode == 0, ranks.output(i)[-3000:]
        out[i] = [l for l in _lines(ranks, i) if l.get("done")][0]
    return out


def _stop(daemons, *groups):
    """Kills what is left of the trainer groups (None: not started), then stops the daemons."""
    for group in groups:
        for p in (group.procs if group else []):
            if p.poll() is None:
                p.kill()
    for d in daemons:
        d.stop()


def _lose_node(ranks, daemon, k, survivors, at_step):
    """Once every trainer has reported `at_step`: node k's daemon and trainer killed; the
    survivors' results (each trainer's "done" line)."""
    try:
        _wait_steps(ranks, at_step)
        daemon.proc.kill()
        ranks.procs[k].kill()
        return _finish(ranks, survivors)
    finally:
        _stop([], ranks)


def _relinked(log, job, group="world"):
    """(links taken over, links of the group) that the daemon's log says `job`'s group took
    over from an earlier epoch; None when it logged none."""
    found = re.findall(r"job=%s group=%s: (\d+) of (\d+) links taken over"
                       % (re.escape(job), re.escape(group)), log)
    assert len(found) <= 1, found
    return tuple(int(x) for x in found[0]) if found else None


def _wait_job_gone(daemon, job):
    """Until the daemon's store holds no key of `job` (bounded), then asserts it."""
    deadline = time.monotonic() + 20
    while job in daemon.ctl("jobs").stdout and time.monotonic() < deadline:
        time.sleep(0.1)
    jobs = daemon.ctl("jobs")
    assert jobs.returncode == 0 and job not in jobs.stdout, jobs


@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_node_lost_mid_training_the_survivors_go_on_with_the_new_membership(
        tmp, three_daemons, fault):
    d0, d1, d2 = three_daemons
    steps = 40
    ranks = launch(tmp, [d0, d1, d2], "elastic-" + fault, lambda r: [WORKER, str(steps), "0.05"],
                   local=1, root=d0.tcp, extra_env={"GRADSYNC_ELASTIC": "1"})
    try:
        _wait_steps(ranks, 5)
        lost_node = d2.tcp
        if fault == "kill":
            d2.proc.kill()
            ranks.procs[2].kill()
        else:
            d2.proc.send_signal(signal.SIGSTOP)  # the kernel still ACKs; the daemon says nothing
        done = _finish(ranks, [0, 1])
    finally:
        _stop([], ranks)
    for old_rank, result in done.items():
        assert result["world"] == 2, result
        assert result["rank"] == old_rank, result  # ranks 0 and 1 keep theirs: rank 2 went
        assert result["step"] == steps, result
        assert result["resets"] == [2], result
        assert len(result["changes"]) == 1, result
        change = result["changes"][0]
        assert change["lost_ranks"] == [2] and change["lost_nodes"] == [lost_node], change
        assert change["world"] == 2 and change["epoch"] == 1, change
        assert f"rank(s) 2 on node(s) {lost_node} lost" in change["message"], change
        assert "goes on as epoch 1 with 2 rank(s)" in change["message"], change
    # The survivors' models are the same, bit for bit: same reduced gradients, same state.
    assert done[0]["params"] == done[1]["params"]
    # The survivors' daemons decide (the root in its own store, node 1 through the root's store
    # service): one records the change; the other finds it, unless its trainers had already
    # moved on; both formed epoch 1.
    logs = [open(d.log).read() for d in (d0, d1)]
    for log in logs:
        assert "job=elastic-%s.e1" % fault in log, log[-3000:]
        assert "could not be recorded" not in log, log[-3000:]
        # The survivors' world group took their link over: only the lost node's pairs went.
        assert _relinked(log, "elastic-%s.e1" % fault) == (1, 1), log[-3000:]
    assert sum("membership changed, epoch 0 -> 1: world 3 -> 2" in log for log in logs) == 1, logs
    assert sum("decision recorded by another daemon stands" in log for log in logs) <= 1, logs


def test_a_group_of_some_ranks_follows_the_change(tmp, three_daemons):
    """Group {0,2} of a three-rank job: rank 1's node is lost, the group becomes {0,1} (old
    rank 2 is now 1) on both its members, and its all-reduces go on over the new ranks."""
    d0, d1, d2 = three_daemons
    steps = 12
    ranks = launch(tmp, [d0, d1, d2], "elastic-group", lambda r: [WORKER, str(steps), "0.05"],
                   local=1, root=d0.tcp,
                   extra_env={"GRADSYNC_ELASTIC": "1", "ELASTIC_GROUP": "0,2"})
    done = _lose_node(ranks, d1, 1, [0, 2], at_step=4)
    for old_rank, result in done.items():
        assert result["world"] == 2 and result["step"] == steps, result
        assert result["group"] == [0, 1], result
        sums = result["group_sums"]
        before = [s for s in sums if s[0] == [0, 2]]
        after = [s for s in sums if s[0] == [0, 1]]
        assert len(before) + len(after) == len(sums), sums
        assert len(before) >= 3 and len(after) >= steps - len(before), sums
        assert all(s[1] == 2.0 for s in before), sums  # ranks 0 + 2
        assert all(s[1] == 1.0 for s in after), sums   # ranks 0 + 1
    assert done[0]["params"] == done[2]["params"]
    # Nodes 0 and 2 kept both their connections (the world's and the group's): the world group
    # of epoch 1 took one over, the group the other.
    for d in (d0, d2):
        log = open(d.log).read()
        assert _relinked(log, "elastic-group.e1") == (1, 1), log[-3000:]
        assert _relinked(log, "elastic-group.e1", "0,1") == (1, 1), log[-3000:]


def test_a_node_of_two_ranks_lost_with_packed_reductions(tmp, three_daemons):
    """Two ranks per node: node 1 (ranks 2, 3) is killed; ranks 4 and 5 become 2 and 3, local
    ranks stay; the pack plan is made again by the new rank 0."""
    d0, d1, d2 = three_daemons
    ranks = launch(tmp, [d0, d0, d1, d1, d2, d2], "elastic-pairs",
                   lambda r: [WORKER, "30", "0.05"], local=2, root=d0.tcp,
                   extra_env={"GRADSYNC_ELASTIC": "1", "ELASTIC_PARAM_PACK": "1"})
    try:
        _wait_steps(ranks, 5)
        d1.proc.kill()
        ranks.procs[2].kill()
        ranks.procs[3].kill()
        done = _finish(ranks, [0, 1, 4, 5])
    finally:
        _stop([], ranks)
    for old_rank, new_rank in ((0, 0), (1, 1), (4, 2), (5, 3)):
        result = done[old_rank]
        assert (result["rank"], result["world"], result["step"]) == (new_rank, 4, 30), result
        change = result["changes"][0]
        assert change["lost_ranks"] == [2, 3] and change["lost_nodes"] == [d1.tcp], change
    assert all(done[r]["params"] == done[0]["params"] for r in (1, 4, 5))


def test_two_changes_in_a_row(tmp, monkeypatch):
    """Four nodes; one is killed, and once the survivors train on as epoch 1, another: epoch 2
    with two ranks, every survivor through both changes."""
    ds = tcp_daemons(tmp, monkeypatch, 4)
    ranks = launch(tmp, ds, "elastic-twice", lambda r: [WORKER, "60", "0.05"], local=1,
                   root=ds[0].tcp, extra_env={"GRADSYNC_ELASTIC": "1"})
    try:
        _wait_steps(ranks, 5)
        ds[3].proc.kill()
        ranks.procs[3].kill()
        deadline = time.monotonic() + 60
        while not all(any(l.get("world") == 3 for l in _lines(ranks, i)) for i in range(3)):
            assert time.monotonic() < deadline, ranks.output(0)[-3000:]
            time.sleep(0.02)
        ds[2].proc.kill()
        ranks.procs[2].kill()
        done = _finish(ranks, [0, 1])
        # Every epoch's namespace leaves the root's store: epoch 0's and 1's (kept for their
        # decisions) when the epoch after ended, epoch 2's when the job ended.
        _wait_job_gone(ds[0], "elastic-twice")
    finally:
        _stop(ds, ranks)
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"]) == (r, 2, 60), result
        assert [c["epoch"] for c in result["changes"]] == [1, 2], result
        assert [c["lost_ranks"] for c in result["changes"]] == [[3], [2]], result
        assert result["resets"] == [3, 2], result
    assert done[0]["params"] == done[1]["params"]
    for d in ds[:2]:  # each change re-linked only the lost node's pairs
        log = open(d.log).read()
        assert _relinked(log, "elastic-twice.e1") == (2, 2), log[-3000:]
        assert _relinked(log, "elastic-twice.e2") == (1, 1), log[-3000:]


def _survivors_stop(tmp, daemons, job, victim, env, want):
    """One rank per daemon; node `victim` (daemon and trainer) is killed at step 3: the others
    end with exit 3 and an error saying `want`."""
    ranks = launch(tmp, daemons, job, lambda r: [WORKER, "200", "0.05"], local=1,
                   root=daemons[0].tcp, extra_env={"GRADSYNC_ELASTIC": "1", **env})
    others = [i for i in range(len(daemons)) if i != victim]
    try:
        _wait_steps(ranks, 3)
        daemons[victim].proc.kill()
        ranks.procs[victim].kill()
        for i in others:
            ranks.procs[i].wait(60)
    finally:
        _stop([], ranks)
    for i in others:
        assert ranks.procs[i].returncode == 3, ranks.output(i)[-3000:]
        err = [l for l in _lines(ranks, i) if l.get("error")][0]
        assert want in err["message"], err


def test_an_elastic_job_that_loses_its_root_node_says_why_it_cannot_go_on(tmp, three_daemons):
    _survivors_stop(tmp, three_daemons, "elastic-root", 0, {},
                    "survives the loss of its root's node only with its store on etcd")


def test_below_min_world_size_the_survivors_wait_then_stop_with_a_clear_error(
        tmp, three_daemons):
    _survivors_stop(tmp, three_daemons, "elastic-min", 2,
                    {"GRADSYNC_MIN_WORLD_SIZE": "3", "GRADSYNC_ELASTIC_TIMEOUT": "2"},
                    "2 rank(s) left, fewer than min_world_size=3, and not enough nodes joined "
                    "within 2 s")


def test_below_min_world_size_the_survivors_wait_for_a_replacement(tmp, monkeypatch):
    """min_world_size=3 and node 2 is killed: the survivors reset to 2 ranks and wait there
    (no step) until a replacement joins; then all three train on and end identical."""
    ds = tcp_daemons(tmp, monkeypatch, 4)
    steps = 60
    env = {"GRADSYNC_ELASTIC": "1", "GRADSYNC_MIN_WORLD_SIZE": "3",
           "GRADSYNC_ELASTIC_TIMEOUT": "60"}
    ranks = launch(tmp, ds[:3], "elastic-wait", lambda r: [WORKER, str(steps), "0.05"],
                   local=1, root=ds[0].tcp, extra_env=env)
    joiner = None
    try:
        _wait_steps(ranks, 5)
        ds[2].proc.kill()
        ranks.procs[2].kill()
        deadline = time.monotonic() + 60
        while not any("membership changed, epoch 0 -> 1" in open(d.log).read()
                      for d in ds[:2]):
            assert time.monotonic() < deadline, open(ds[0].log).read()[-3000:]
            time.sleep(0.01)
        time.sleep(1.0)  # they wait: no step with 2 ranks
        joiner = launch(tmp, [ds[3]], "elastic-wait", lambda r: [WORKER, str(steps), "0.05"],
                        local=1, root=ds[0].tcp, extra_env={**JOIN_ENV, **env})
        done = _finish(ranks, [0, 1], timeout_s=120)
        joined = _finish(joiner, [0], timeout_s=60)[0]
    finally:
        _stop(ds, ranks, joiner)
    for r in (0, 1):
        assert not any(l.get("world") == 2 for l in _lines(ranks, r)), _lines(ranks, r)
        result = done[r]
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            r, 3, steps, 2), result
        assert result["resets"] == [3], result  # reset callbacks run once the world is whole
        assert [(c["world"], c["joined"]) for c in result["changes"]] == [(2, 0)], result
    assert (joined["rank"], joined["world"], joined["epoch"]) == (2, 3, 2), joined
    assert done[0]["params"] == done[1]["params"] == joined["params"]


def _wait_world(ranks, indices, world, timeout_s=60):
    """Until trainers `indices` report a step with `world` ranks (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not all(any(l.get("world") == world for l in _lines(ranks, i)) for i in indices):
        for i in indices:
            assert ranks.procs[i].poll() is None, ranks.output(i)[-3000:]
        assert time.monotonic() < deadline, ranks.output(indices[0])[-3000:]
        time.sleep(0.02)


JOIN_ENV = {"GRADSYNC_ELASTIC": "1", "GRADSYNC_JOIN": "1", "GRADSYNC_JOIN_TIMEOUT": "60"}


@pytest.mark.parametrize("when", ["after", "during"])
def test_a_replacement_node_joins_and_the_world_grows_back(tmp, monkeypatch, when):
    """Node 2 is killed; the survivors go on as epoch 1; a new node (its own daemon) starts a
    trainer with join=True: it is admitted at the survivors' next commit, receives their state
    and trains on as rank 2 of epoch 2; every rank's parameters end identical. `during`: the
    replacement starts as soon as the loss is decided, while the survivors reset."""
    with socket.socket() as s:  # a free port for the root's metrics
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    ds = tcp_daemons(tmp, monkeypatch, 4, root_flags=[f"--metrics_port={metrics_port}"])
    steps = 200
    job = "elastic-replace-" + when
    ranks = launch(tmp, ds[:3], job, lambda r: [WORKER, str(steps), "0.05"],
                   local=1, root=ds[0].tcp, extra_env={"GRADSYNC_ELASTIC": "1"})
    joiner = None
    try:
        _wait_steps(ranks, 5)
        ds[2].proc.kill()
        ranks.procs[2].kill()
        if when == "after":
            _wait_world(ranks, [0, 1], 2)
        else:
            deadline = time.monotonic() + 60
            while not any("membership changed, epoch 0 -> 1" in open(d.log).read()
                          for d in ds[:2]):
                assert time.monotonic() < deadline, open(ds[0].log).read()[-3000:]
                time.sleep(0.01)
        # Its RANK and WORLD_SIZE say nothing: the job gives them.
        joiner = launch(tmp, [ds[3]], job, lambda r: [WORKER, str(steps), "0.05"],
                        local=1, root=ds[0].tcp, extra_env=JOIN_ENV)
        done = _finish(ranks, [0, 1], timeout_s=120)
        joined = _finish(joiner, [0], timeout_s=60)[0]
        # The root's daemon shows the three memberships it formed, and the change to each.
        epochs = ds[0].ctl("epochs", job)
        assert epochs.returncode == 0, epochs
        rows = [l.split() for l in epochs.stdout.splitlines()[1:]]
        assert [(r[0], r[1], r[2]) for r in rows] == [
            (job, "0", "3"), (job, "1", "2"), (job, "2", "3")], epochs.stdout
        assert "(first)" in rows[0] and "lost_ranks=2" in rows[1] and "joined=1" in rows[2], rows
        assert all(r[5].endswith("s") for r in rows[1:]), rows  # how long each change took
        # Its metrics count both changes, the loss and the join.
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "\ngradsync_membership_changes_total 2\n" in metrics, metrics[-2000:]
        # The job's keys (its home's tickets included) leave the root's store with its end.
        _wait_job_gone(ds[0], job)
    finally:
        _stop(ds, ranks, joiner)
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            r, 3, steps, 2), result
        assert result["resets"] == [2, 3], result
        loss, join = result["changes"]
        assert (loss["epoch"], loss["world"], loss["lost_ranks"], loss["joined"]) == (
            1, 2, [2], 0), loss
        assert (join["epoch"], join["world"], join["lost_ranks"], join["joined"]) == (
            2, 3, [], 1), join
        assert "1 rank(s) joining" in join["message"], join
    assert (joined["rank"], joined["world"], joined["step"], joined["epoch"]) == (
        2, 3, steps, 2), joined
    assert joined["changes"] == [] and joined["resets"] == [], joined
    # The survivors kept their pair through both changes; the joiner's pairs were made.
    for d in ds[:2]:
        log = open(d.log).read()
        assert _relinked(log, job + ".e1") == (1, 1), log[-3000:]
        assert _relinked(log, job + ".e2") == (1, 2), log[-3000:]
    assert _relinked(open(ds[3].log).read(), job + ".e2") is None
    assert done[0]["params"] == done[1]["params"] == joined["params"]


def test_an_extra_node_of_two_ranks_joins_a_running_job(tmp, monkeypatch):
    """Two nodes train; a third with two trainers joins (its ranks learn their ticket from their
    daemon): the world grows from 2 to 4 at one commit, the joiners taking ranks 2 and 3. Junk
    a client tries to put in the job's home before (a ticket counter pushed ahead, a record that
    is not a ticket) is refused: tickets are the daemons' to write."""
    ds = tcp_daemons(tmp, monkeypatch, 3)
    steps = 200
    ranks = launch(tmp, ds[:2], "elastic-extra", lambda r: [WORKER, str(steps), "0.05"],
                   local=1, root=ds[0].tcp, extra_env={"GRADSYNC_ELASTIC": "1"})
    joiner = None
    try:
        _wait_steps(ranks, 5)
        for cmd in (["add", "_gradsync_elastic/tickets", "2"],
                    ["set", "_gradsync_elastic/ticket/2", "ranks=two"]):
            out = ds[0].ctl("--job=elastic-extra", "store", *cmd)
            assert out.returncode != 0 and "PERMISSION_DENIED" in out.stderr, out
        _wait_steps(ranks, 10)
        joiner = launch(tmp, [ds[2], ds[2]], "elastic-extra",
                        lambda r: [WORKER, str(steps), "0.05"], local=2, root=ds[0].tcp,
                        extra_env=JOIN_ENV)
        _wait_world(ranks, [0, 1], 4)
        # The joiners' ticket (the first: nothing else was taken) claimed, and their place.
        home = {}
        for key in ("ticket/1", "admit/1", "handled"):
            out = ds[0].ctl("--job=elastic-extra", "store", "get", "_gradsync_elastic/" + key)
            assert out.returncode == 0, out
            home[key] = out.stdout.strip()
        # (gradsyncctl shows the daemons' records as JSON.)
        assert (json.loads(home["ticket/1"]), json.loads(home["admit/1"]), home["handled"]) == (
            {"state": "CLAIMED", "ranks": 0},
            {"epoch": 1, "world": 4, "rank": 2, "min_world_size": 1}, "1"), home
        done = _finish(ranks, [0, 1], timeout_s=120)
        joined = _finish(joiner, [0, 1], timeout_s=60)
    finally:
        _stop(ds, ranks, joiner)
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            r, 4, steps, 1), result
        assert result["resets"] == [4], result
        assert [(c["joined"], c["world"]) for c in result["changes"]] == [(2, 4)], result
    assert sorted(j["rank"] for j in joined.values()) == [2, 3], joined
    for j in joined.values():
        assert (j["world"], j["step"], j["epoch"]) == (4, steps, 1), j
        assert j["params"] == done[0]["params"]
    assert done[0]["params"] == done[1]["params"]


def _ticket(daemon, job, ticket):
    """Ticket `ticket`'s state in `job`'s home on `daemon` ("WAITING", ...), or None."""
    out = daemon.ctl(f"--job={job}", "store", "get", f"_gradsync_elastic/ticket/{ticket}")
    return json.loads(out.stdout)["state"] if out.returncode == 0 else None


def _until_ticket(daemon, job, ticket, state, timeout_s=30):
    deadline = time.monotonic() + timeout_s
    while _ticket(daemon, job, ticket) != state:
        assert time.monotonic() < deadline, (ticket, _ticket(daemon, job, ticket))
        time.sleep(0.05)


def test_a_node_not_admitted_in_time_or_gone_has_its_ticket_withdrawn(tmp, monkeypatch):
    """No rank of the job commits, so nobody is admitted. A joining node of two ranks waits its
    GRADSYNC_JOIN_TIMEOUT (1 s): both ranks fail with DEADLINE_EXCEEDED and its daemon has
    withdrawn its ticket. A second joiner killed while it waits: its ticket is withdrawn too
    (the daemon saw its call go)."""
    ds = tcp_daemons(tmp, monkeypatch, 2)
    job = "elastic-unadmitted"
    late = launch(tmp, [ds[1], ds[1]], job, lambda r: [WORKER, "10", "0.05"], local=2,
                  root=ds[0].tcp, extra_env=dict(JOIN_ENV, GRADSYNC_JOIN_TIMEOUT="1"))
    gone = None
    try:
        for i in (0, 1):
            late.procs[i].wait(60)
            out = late.output(i)
            assert late.procs[i].returncode != 0 and "DEADLINE_EXCEEDED" in out, out[-3000:]
            assert "its ticket 1 is withdrawn" in out, out[-3000:]
        assert "this node's local rank 0 asked to join" in late.output(1), late.output(1)[-3000:]
        assert _ticket(ds[0], job, 1) == "WITHDRAWN"
        gone = launch(tmp, [ds[1]], job, lambda r: [WORKER, "10", "0.05"], local=1,
                      root=ds[0].tcp, extra_env=dict(JOIN_ENV, GRADSYNC_JOIN_TIMEOUT="120"))
        _until_ticket(ds[0], job, 2, "WAITING")
        gone.procs[0].kill()
        _until_ticket(ds[0], job, 2, "WITHDRAWN")
        log = open(ds[0].log).read()
        assert "join: not admitted job=%s ticket=2 why=" % job in log, log[-3000:]
    finally:
        _stop(ds, late, gone)


def test_a_rank_that_never_joins_the_next_epoch_is_left_behind(tmp, monkeypatch):
    """Four nodes; node 2's trainer is frozen (its daemon lives) and node 3 is killed: the
    decision of epoch 1 still counts rank 2, which never registers. Epoch 1 does not form by
    its first op's deadline (--op_timeout=15s here), its daemons decide rank 2 lost, and ranks 0
    and 1 go on as epoch 2: a node lost during a change does not end the job."""
    ds = tcp_daemons(tmp, monkeypatch, 4, flags=["--op_timeout=15s"])
    ranks = launch(tmp, ds, "elastic-unformed", lambda r: [WORKER, "100", "0.05"], local=1,
                   root=ds[0].tcp, extra_env={"GRADSYNC_ELASTIC": "1"})
    try:
        _wait_steps(ranks, 5)
        ranks.procs[2].send_signal(signal.SIGSTOP)
        ds[3].proc.kill()
        ranks.procs[3].kill()
        done = _finish(ranks, [0, 1], timeout_s=120)
    finally:
        _stop(ds, ranks)
    logs = "".join(open(d.log).read() for d in ds[:2])
    assert "membership changed, epoch 1 -> 2: it did not form, rank(s) 2 did not join epoch 1" \
        in logs, logs[-3000:]
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            r, 2, 100, 2), result
        assert result["resets"] == [2], result  # epoch 1 never formed: no sync, no callback
        assert [c["lost_ranks"] for c in result["changes"]] == [[3]], result
    assert done[0]["params"] == done[1]["params"]



def test_a_change_during_a_batch_of_queued_ops_fails_each_of_them_and_writes_nothing(
        tmp, three_daemons):
    """Every rank queues three async ops per step; node 2's trainer stops before step 8's, so
    the others' batch waits for it; then node 2 is killed. Each of the survivors' three waits
    raises MembershipChanged of epoch 1, none of their operands is written, and they go on."""
    ds = three_daemons
    envs = [env_for(d, "elastic-batch", r, 3, 0, 1, ds[0].tcp) for r, d in enumerate(ds)]
    for env in envs:
        env.update({"GRADSYNC_ELASTIC": "1", "ELASTIC_BATCH": "1"})
    envs[2]["ELASTIC_STALL_AT"] = "8"
    ranks = Ranks(tmp, [[WORKER, "30", "0.02"]] * 3, envs)
    try:
        deadline = time.monotonic() + 60
        while not any(l.get("stalled") == 8 for l in _lines(ranks, 2)):
            assert time.monotonic() < deadline, ranks.output(2)[-3000:]
            assert ranks.procs[2].poll() is None, ranks.output(2)[-3000:]
            time.sleep(0.02)
        time.sleep(0.5)  # the others' batch of step 8 is queued, waiting for rank 2
        ds[2].proc.kill()
        ranks.procs[2].kill()
        done = _finish(ranks, [0, 1])
    finally:
        _stop([], ranks)
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"]) == (r, 2, 30), result
        assert result["batches"] == [{"waits": 3, "changed": ["MembershipChanged"] * 3,
                                      "epochs": [1, 1, 1], "unchanged": True}], result
    assert done[0]["params"] == done[1]["params"]


def test_a_node_whose_trainers_all_die_is_lost_while_its_daemon_lives(tmp, three_daemons):
    """Node 2's trainer is killed (SIGKILL: its connection is lost, not closed) and its daemon
    lives: that daemon records the node lost, and ranks 0 and 1 go on as epoch 1."""
    d0, d1, d2 = three_daemons
    ranks = launch(tmp, [d0, d1, d2], "elastic-trainer-dies", lambda r: [WORKER, "40", "0.05"],
                   local=1, root=d0.tcp, extra_env={"GRADSYNC_ELASTIC": "1"})
    try:
        _wait_steps(ranks, 5)
        ranks.procs[2].kill()
        done = _finish(ranks, [0, 1])
    finally:
        _stop([], ranks)
    assert d2.proc.poll() is None  # the daemon lived through it
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            r, 2, 40, 1), result
        change = result["changes"][0]
        assert change["lost_ranks"] == [2] and change["lost_nodes"] == [d2.tcp], change
        assert "its trainer of rank 2 is gone: connection lost" in change["message"], change
    assert done[0]["params"] == done[1]["params"]


def test_a_change_during_a_pack_plan_exchange(tmp, three_daemons):
    """Packed reductions: ranks 1 and 2 wait in the store for rank 0's first pack plan when rank
    0's trainer is killed (its daemon, the job's root, lives). A store wait is no op, so the
    loss does not fail it: the waiters look for a decision between slices of their wait (not
    at the plan's timeout, DEADLINE_EXCEEDED) and go on as ranks 0 and 1, the new rank 0
    making the plan."""
    d0, d1, d2 = three_daemons
    steps = 10
    ranks = launch(tmp, [d0, d1, d2], "elastic-plan", lambda r: [WORKER, str(steps), "0.05"],
                   local=1, root=d0.tcp,
                   extra_env={"GRADSYNC_ELASTIC": "1", "ELASTIC_PARAM_PACK": "1",
                              "ELASTIC_PLAN_STALL": "1"})
    try:
        deadline = time.monotonic() + 60
        while (not any(l.get("plan_stalled") for l in _lines(ranks, 0))
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert any(l.get("plan_stalled") for l in _lines(ranks, 0)), ranks.output(0)[-3000:]
        time.sleep(1.0)  # ranks 1 and 2 are in get_pack_list by now
        ranks.procs[0].kill()
        done = _finish(ranks, [1, 2])  # waiting the plan out (30 s) would fail them
    finally:
        _stop([], ranks)
    for old_rank, result in done.items():
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            old_rank - 1, 2, steps, 1), result
        assert [c["lost_ranks"] for c in result["changes"]] == [[0]], result
    assert done[1]["params"] == done[2]["params"]


@pytest.mark.parametrize("how", ["comm_hook", "backend"])
def test_torch_ddp_follows_the_change(tmp, three_daemons, how):
    """torch's DistributedDataParallel with a plain optimizer, over gloo with
    gradsync.torch.allreduce_hook, or on the backend "gradsync" (its group made again at the top
    of the run decorator's function by gradsync.torch.init_process_group): node 2 is killed;
    the failure reaches the run decorator wrapped by DDP, which still resets, and the
    survivors' means are over 2 ranks from then on."""
    d0, d1, d2 = three_daemons
    steps = 20
    env = {"GRADSYNC_ELASTIC": "1"}
    if how == "comm_hook":
        env["ELASTIC_DDP_PG"] = os.path.join(str(tmp), "ddp-pg")
    else:
        env["ELASTIC_TORCH_BACKEND"] = "1"
    ranks = launch(tmp, [d0, d1, d2], "elastic-ddp-" + how,
                   lambda r: [WORKER, str(steps), "0.05"], local=1, root=d0.tcp, extra_env=env)
    done = _lose_node(ranks, d2, 2, [0, 1], at_step=5)
    for r in (0, 1):
        result = done[r]
        assert (result["rank"], result["world"], result["step"], result["epoch"]) == (
            r, 2, steps, 1), result
        assert [c["lost_ranks"] for c in result["changes"]] == [[2]], result
        assert result["resets"] == [2], result
    assert done[0]["params"] == done[1]["params"]


def test_groups_follow_each_change_in_turn_and_a_group_left_with_no_member_says_so():
    """Group._follow alone (no daemon): two changes in a row renumber explicit groups as the
    survivors' ranks are renumbered; WORLD stays the world; an emptied group fails each use."""
    import gradsync
    from gradsync.elastic import MembershipChanged

    def change(epoch, lost):
        return MembershipChanged("ABORTED", "test", epoch=epoch, lost_ranks=lost)

    a, b, c = gradsync.Group([0, 2, 5]), gradsync.Group([3]), gradsync.Group([1, 4, 5])
    twin = gradsync.Group([5, 2, 0])  # equal to a, followed all the same
    gradsync.Group._follow(change(1, (1, 3)))  # 0,2,4,5 -> 0,1,2,3
    assert (a.ranks, c.ranks, twin.ranks) == ((0, 1, 3), (2, 3), (0, 1, 3))
    same = gradsync.Group([0, 1, 3])
    assert a.key == "0,1,3" and a == same and hash(a) == hash(same)
    gradsync.Group._follow(change(2, (0,)))
    assert (a.ranks, c.ranks) == ((0, 2), (1, 2))
    assert gradsync.WORLD.key == "world"
    assert repr(b) == "Group(no members left)"
    assert (b.rank, b.size) == (-1, 0)  # "am I a member" works as for any group
    for use in (lambda: b.ranks, lambda: b.key):
        with pytest.raises(gradsync.Error) as e:
            use()
        assert e.value.code == "FAILED_PRECONDITION"
        assert str(e.value) == ("FAILED_PRECONDITION: group 3 has no members left: membership "
                                "change to epoch 1 lost rank(s) 1,3")
