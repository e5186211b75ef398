"""tools/sim/formation_sim.py, the formation and small-op model: its tree and links are the
daemon's (daemon/backend/cpu/link_plan.h, whose unit test pins the same figures), and its
timings follow from its parameters as written (a test of the model, not of the daemon)."""
import argparse
import importlib.util
import math
import os

_PATH = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "sim", "formation_sim.py")
_spec = importlib.util.spec_from_file_location("formation_sim", _PATH)
sim = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sim)


def _args(**kw):
    a = argparse.Namespace(spread=0.0, store_calls=8, store_call=100e-6, store_threads=8,
                           ranks_per_node=1, entry_bytes=48, root_bandwidth=1.25e9,
                           link_bandwidth=1.25e9, reduce_bandwidth=5e9, handshake=1e-3,
                           per_message=20e-6, delay=0.2e-3, op_bytes=4096)
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_the_tree_and_links_are_the_daemons():
    assert sim.tree_children(13, 0) == [1, 2, 4, 8]
    assert sim.tree_children(13, 8) == [9, 10, 12]
    assert sim.tree_children(13, 12) == []
    assert sim.group_links(256, 0) == [1, 2, 4, 8, 16, 32, 64, 128, 255]
    assert sim.group_links(256, 7) == [6, 8]
    for n in (2, 11, 100):
        seen = [0] * n
        for i in range(n):
            for c in sim.tree_children(n, i):
                assert sim.tree_parent(c) == i
                seen[c] += 1
            for j in sim.group_links(n, i):
                assert i in sim.group_links(n, j), (n, i, j)
        assert seen[1:] == [1] * (n - 1)


def test_a_small_op_takes_about_two_hops_a_level_and_the_ring_grows_with_n():
    # Without jitter or data: each level up costs a delay and two messages, each level down a
    # delay and two messages per child passed before.
    a = _args(op_bytes=0)
    m = sim.Model(1024, a, 1)
    m.cost = [a.per_message] * 1024
    done = m.tree_op([0.0] * 1024, 0)
    levels = math.ceil(math.log2(1024))
    assert 2 * levels * a.delay <= max(done) <= 2 * levels * (a.delay + 12 * a.per_message)
    assert m.ring_op(4096) > 50 * max(done)  # 2(N - 1) steps against 2 log2 N hops


def test_the_root_sends_the_rank_list_once_per_daemon():
    # Past the store's calls, the root's egress of N lists of N entries dominates at scale.
    n = 2000
    a = _args(store_threads=1024)
    has = sim.Model(n, a, 1).store_phase()
    list_time = n * (n * a.entry_bytes) / a.root_bandwidth
    assert list_time <= max(has) <= list_time + 0.05
