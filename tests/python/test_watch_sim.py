"""tools/sim/watch_sim.py, the peer watch's simulator: its plan is the daemon's
(daemon/backend/cpu/link_plan.h, whose unit test pins the same figures), a frozen node reaches
every survivor near the timeout, and a lossy link alone makes a suspicion, not a loss."""
import argparse
import importlib.util
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "sim", "watch_sim.py")
_spec = importlib.util.spec_from_file_location("watch_sim", _PATH)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def _args(**kw):
    a = argparse.Namespace(ring=2, interval=0.25, timeout=1.5, tick=0.05, delay=0.0002,
                           per_message=0.00002, rto_min=0.2, seed=3, quorum=2, loss=0.0,
                           events=5_000_000)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_the_plan_is_the_daemons():
    assert len(sim.linked_nodes(256, 7, 2)) == 15
    assert sim.ring_neighbours(256, 7, 2) == [5, 6, 8, 9]
    assert sim.ring_neighbours(256, 0, 1) == [1, 255]
    assert sim.linked_nodes(9, 0, 1) == [1, 2, 4, 5, 7, 8]
    assert sim.linked_nodes(5, 4, 2) == [0, 1, 2, 3]
    for n in (2, 7, 100):
        for i in range(n):
            for j in sim.linked_nodes(n, i, 2):
                assert i in sim.linked_nodes(n, j, 2), (n, i, j)


def test_a_frozen_node_reaches_every_survivor_within_the_timeout_and_a_few_hops():
    s = sim.Sim(200, _args())
    s.run(40.0, freeze_at=5.0)
    assert len(s.knows) == 199
    took = max(s.knows.values()) - 5.0
    assert 1.5 - 0.25 - 0.05 <= took <= 1.5 + 0.25 + 0.1, took
    assert s.false_positives == 0


def test_one_watchers_lossy_link_is_a_suspicion_and_never_a_loss_with_the_quorum():
    # Every message of one link lost often: its watcher suspects, the other watchers hear.
    for quorum, lost in ((2, 0), (1, None)):
        s = sim.Sim(50, _args(quorum=quorum))
        original = s.send

        def lossy(t, src, dst, what, original=original, s=s):
            if (src, dst) == (10, 11) and what[0] == "beat":
                t += 2.0  # this link's heartbeats arrive 2 s late (retransmitted)
            original(t, src, dst, what)

        s.send = lossy
        s.run(10.0)
        assert s.suspicions >= 1, quorum
        if lost is not None:
            assert s.false_positives == lost, (quorum, s.false_positives)
        else:
            assert s.false_positives > 0  # the first suspicion is a loss: node 10 lost
