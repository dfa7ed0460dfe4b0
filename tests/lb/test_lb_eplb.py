"""EPLB: DeepSeek's contract (shapes, invariants), never worse than the greedy, dead GPUs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lb.eplb import balancedness, gpu_loads, rebalance_experts
from lb.eplb_greedy import rebalance_experts_greedy
from lb.types import LBInputError

README_W = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
                     [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])


def corpus():
    """(name, weight, num_replicas, groups, nodes, gpus, skewed) — seeded."""
    rng = np.random.default_rng(1234)
    out = []
    for kind in ("uniform", "zipf", "lognormal", "one_hot"):
        for (layers, experts, reps, groups, nodes, gpus) in [(3, 16, 24, 4, 2, 8), (3, 32, 48, 4, 4, 16),
                                                             (2, 24, 32, 3, 2, 8), (2, 64, 80, 8, 2, 16)]:
            if kind == "uniform":
                w = rng.uniform(90, 110, (layers, experts))
            elif kind == "zipf":
                w = rng.pareto(1.1, (layers, experts)) * 100 + 1
            elif kind == "lognormal":
                w = rng.lognormal(0, 1.5, (layers, experts))
            else:
                w = rng.uniform(1, 2, (layers, experts))
                w[:, rng.integers(experts)] = 50 * experts
            out.append((f"{kind}-{experts}x{gpus}-g{groups}n{nodes}", w, reps, groups, nodes, gpus, kind != "uniform"))
    return out


CORPUS = corpus()


def check_contract(w, phy2log, log2phy, logcnt, reps, gpus, dead=()):
    layers, n_log = w.shape
    assert phy2log.shape == (layers, reps) and logcnt.shape == (layers, n_log)
    assert log2phy.shape[:2] == (layers, n_log) and log2phy.shape[2] == logcnt.max()
    per_gpu = reps // gpus
    dead_slots = np.zeros(reps, bool)
    for g in dead:
        dead_slots[g * per_gpu:(g + 1) * per_gpu] = True
    assert (phy2log[:, dead_slots] == -1).all()
    assert (phy2log[:, ~dead_slots] >= 0).all() and (phy2log < n_log).all()
    assert (logcnt >= 1).all()  # every logical expert has a live replica
    for li in range(layers):
        # logcnt matches phy2log
        np.testing.assert_array_equal(np.bincount(phy2log[li][phy2log[li] >= 0], minlength=n_log), logcnt[li])
        for e in range(n_log):
            slots = log2phy[li, e]
            live = slots[slots >= 0]
            assert len(live) == logcnt[li, e] and (slots[logcnt[li, e]:] == -1).all()
            assert (phy2log[li, live] == e).all()  # log2phy and phy2log agree
            assert not dead_slots[live].any()
    # replicas per GPU equal: fixed slot layout, every live GPU's slots are all filled
    filled = (phy2log >= 0).reshape(layers, gpus, per_gpu).sum(-1)
    live_gpus = [g for g in range(gpus) if g not in dead]
    assert (filled[:, live_gpus] == per_gpu).all()


def test_greedy_matches_deepseek_readme():
    phy2log, log2phy, logcnt = rebalance_experts_greedy(README_W, 16, 4, 2, 8)
    assert phy2log.tolist() == [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    check_contract(README_W, phy2log, log2phy, logcnt, 16, 8)


@pytest.mark.parametrize("name,w,reps,groups,nodes,gpus,skewed", CORPUS, ids=[c[0] for c in CORPUS])
def test_contract_and_never_worse_than_greedy(name, w, reps, groups, nodes, gpus, skewed):
    g_p2l, g_l2p, g_cnt = rebalance_experts_greedy(w, reps, groups, nodes, gpus)
    check_contract(w, g_p2l, g_l2p, g_cnt, reps, gpus)
    phy2log, log2phy, logcnt = rebalance_experts(w, reps, groups, nodes, gpus)
    check_contract(w, phy2log, log2phy, logcnt, reps, gpus)
    ours = balancedness(w, phy2log, gpus, per_layer=True)
    base = balancedness(w, g_p2l, gpus, per_layer=True)
    assert (ours >= base - 1e-12).all(), (ours, base)
    if groups % nodes == 0:  # hierarchical: all replicas of a group's experts sit on one node
        per_node, group_size = reps // nodes, w.shape[1] // groups
        for li in range(w.shape[0]):
            nodes_of_group: dict[int, set] = {}
            for s, e in enumerate(phy2log[li]):
                nodes_of_group.setdefault(int(e) // group_size, set()).add(s // per_node)
            assert all(len(v) == 1 for v in nodes_of_group.values()), nodes_of_group


def test_strictly_better_on_skewed_loads():
    skewed = [c for c in CORPUS if c[6]]
    better = 0
    for name, w, reps, groups, nodes, gpus, _ in skewed:
        g, _, _ = rebalance_experts_greedy(w, reps, groups, nodes, gpus)
        p, _, _ = rebalance_experts(w, reps, groups, nodes, gpus)
        better += balancedness(w, p, gpus) > balancedness(w, g, gpus) + 1e-9
    # strictly better (mean balancedness over layers) on every skewed input of the corpus
    assert better == len(skewed), f"strictly better on {better}/{len(skewed)}"


def test_global_mode_when_groups_do_not_divide_nodes():
    rng = np.random.default_rng(7)
    w = rng.pareto(1.2, (2, 30)) * 10 + 1
    p, l2p, cnt = rebalance_experts(w, 40, 3, 2, 8)  # 3 groups over 2 nodes: global
    check_contract(w, p, l2p, cnt, 40, 8)
    g, _, _ = rebalance_experts_greedy(w, 40, 3, 2, 8)
    assert balancedness(w, p, 8) > balancedness(w, g, 8)


@pytest.mark.parametrize("dead", [{3}, {0, 5}, {4, 5, 6, 7}])
def test_dead_gpus_get_no_experts(dead):
    rng = np.random.default_rng(3)
    w = rng.lognormal(0, 1, (3, 16))
    p, l2p, cnt = rebalance_experts(w, 32, 4, 2, 8, dead_gpus=dead)
    check_contract(w, p, l2p, cnt, 32, 8, dead=dead)
    loads = gpu_loads(w, p, 8)
    assert np.isnan(loads[:, sorted(dead)]).all()
    assert 0 < balancedness(w, p, 8) <= 1


def test_dead_nodes_expand_to_their_gpus():
    w = np.random.default_rng(5).uniform(1, 10, (2, 16))
    p, l2p, cnt = rebalance_experts(w, 32, 4, 2, 8, dead_nodes={1})
    check_contract(w, p, l2p, cnt, 32, 8, dead={4, 5, 6, 7})


def test_not_enough_live_slots_is_actionable():
    w = np.ones((1, 16))
    with pytest.raises(ValueError, match="bring back at least 1 GPU"):
        rebalance_experts(w, 16, 4, 2, 8, dead_gpus={0})


@pytest.mark.parametrize("args,msg", [
    ((np.ones(4), 4, 1, 1, 1), "layers"),
    ((np.ones((1, 8)), 4, 1, 1, 1), ">= num_logical_experts"),
    ((np.ones((1, 8)), 10, 1, 1, 4), "multiple of num_gpus"),
    ((np.ones((1, 8)), 8, 3, 1, 4), "multiple of num_groups"),
    ((-np.ones((1, 8)), 8, 1, 1, 4), ">= 0"),
])
def test_bad_input_raises_value_error(args, msg):
    with pytest.raises(ValueError, match=msg):
        rebalance_experts(*args)
    with pytest.raises(ValueError):
        rebalance_experts(np.ones((1, 8)), 8, 1, 1, 4, dead_gpus={9})


@pytest.mark.parametrize("shape", [(0, 8), (2, 0), (0, 0)])
@pytest.mark.parametrize("fn", [rebalance_experts, rebalance_experts_greedy])
def test_empty_weight_is_typed_misuse(fn, shape):
    with pytest.raises(LBInputError, match="at least one layer and one logical expert"):
        fn(np.zeros(shape), 16, 2, 2, 4)


def test_accepts_torch_and_lists():
    torch = pytest.importorskip("torch")
    p1, _, _ = rebalance_experts(torch.tensor(README_W, dtype=torch.float32), 16, 4, 2, 8)
    p2, _, _ = rebalance_experts(README_W.tolist(), 16, 4, 2, 8)
    assert isinstance(p1, np.ndarray) and (p1 == p2).all()


def test_lb_does_not_import_torch():
    code = ("import sys; import lb.registry, lb.eplb, lb.sim, lb.cost_model; "
            "assert 'torch' not in sys.modules, 'lb imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("dead", [np.array([3, 4]), [np.int64(3), 4], range(3, 5), (3, 4), {3, 4}])
def test_dead_gpus_as_an_array_or_any_collection(dead):
    """A numpy array (or torch tensor) crashed on its truth value; every form gives the same plan."""
    ref = rebalance_experts(README_W, 16, 4, 2, 8, dead_gpus={3, 4})[0]
    p, l2p, cnt = rebalance_experts(README_W, 16, 4, 2, 8, dead_gpus=dead)
    assert (p == ref).all()
    check_contract(README_W, p, l2p, cnt, 16, 8, dead={3, 4})
    p, _, _ = rebalance_experts(README_W, 24, 4, 2, 8, dead_nodes=np.array([1]))
    assert (p[:, 12:] == -1).all() and (p[:, :12] >= 0).all()


def test_dead_gpus_as_a_torch_tensor():
    torch = pytest.importorskip("torch")
    p, _, _ = rebalance_experts(README_W, 16, 4, 2, 8, dead_gpus=torch.tensor([3, 4]))
    assert (p == rebalance_experts(README_W, 16, 4, 2, 8, dead_gpus={3, 4})[0]).all()


@pytest.mark.parametrize("kw,match", [
    ({"dead_gpus": [float("nan")]}, r"dead_gpus: index nan"),
    ({"dead_gpus": [3.0]}, r"dead_gpus: index 3.0"),
    ({"dead_gpus": np.array([True, False])}, r"dead_gpus: index True"),
    ({"dead_gpus": [8]}, r"dead_gpus: index 8 is not an integer in \[0, 8\)"),
    ({"dead_gpus": "3"}, "collection of integer indices"),
    ({"dead_gpus": 3.5}, "collection of integer indices"),
    ({"dead_nodes": [-1]}, r"dead_nodes: index -1 is not an integer in \[0, 2\)"),
    ({"dead_nodes": [[0], [1, 1]]}, "collection of integer indices"),
    ({"max_moves_per_layer": -5}, "max_moves_per_layer must be an integer >= 0"),
])
def test_bad_dead_indices_are_typed_misuse(kw, match):
    with pytest.raises(LBInputError, match=match):
        rebalance_experts(README_W, 16, 4, 2, 8, **kw)


@pytest.mark.parametrize("fn", [rebalance_experts, rebalance_experts_greedy])
@pytest.mark.parametrize("pos,bad", [(1, 16.0), (4, float("nan")), (4, float("inf")), (2, True), (3, "2"), (4, 0)])
def test_counts_must_be_integers(fn, pos, bad):
    """16.0 passed and crashed deep in numpy; NaN / inf raised ValueError / OverflowError."""
    args = [README_W, 16, 4, 2, 8]
    args[pos] = bad
    name = ["weight", "num_replicas", "num_groups", "num_nodes", "num_gpus"][pos]
    with pytest.raises(LBInputError, match=f"{name} must be an integer >= 1"):
        fn(*args)
    ok = fn(README_W, np.int64(16), np.int32(4), 2, 8)[0]
    assert (ok == fn(README_W, 16, 4, 2, 8)[0]).all()


@pytest.mark.parametrize("fn", [rebalance_experts, rebalance_experts_greedy])
def test_loads_whose_sum_overflows_are_refused(fn):
    """Finite loads of 1e308 sum to inf: every pack looked full and the plan read uninitialised memory."""
    with pytest.raises(LBInputError, match="layer 2's expert loads sum to more than a float64"):
        fn(np.vstack([README_W, np.full((1, 12), 1e308)]), 16, 4, 2, 8)
    big = rebalance_experts(README_W * 1e300, 16, 4, 2, 8)[0]  # large but summable: the same plan
    assert (big == rebalance_experts(README_W, 16, 4, 2, 8)[0]).all()


def test_packers_never_pick_a_full_pack_when_loads_are_inf():
    """Full packs were marked with an inf load; once open packs reached inf too, argmin took a full one."""
    from lb.eplb import _repack_distinct
    from lb.eplb_greedy import balanced_packing

    with np.errstate(over="ignore"):
        pack, rank = balanced_packing(np.full((1, 6), 1e308), 2)
        out = _repack_distinct(np.full(6, 1e308), np.arange(6), 2, np.zeros(2, dtype=np.int64))
    assert np.bincount(pack[0]).tolist() == [3, 3] and sorted(rank[0].tolist()) == [0, 0, 1, 1, 2, 2]
    assert sorted(out.tolist()) == list(range(6))
