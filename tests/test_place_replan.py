"""Issue 12, defect 4: a plan applied and planned again moves nothing (docs/placement.md).

Before the fix, keep mode compared the fresh partition only with a *sticky* approximation of
the current layout (small slivers sent to their main holder, overloaded children rebalanced),
never with the current layout itself, so an applied plan whose cuts left slivers was moved
again, sometimes less balanced (with keep_tol=None the plan was already a fixed point). Property tests over random topologies, layouts and tolerances.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpiutil import ROOT, check, mpirun

from semzo.place import place


@st.composite
def layouts(draw):
    """(centroids, where, rank_node, node_switch, keep_tol, balance_tol) of a random case."""
    n_ranks = draw(st.integers(2, 8))
    n_nodes = draw(st.integers(1, n_ranks))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    rank_node = rng.permutation(np.concatenate(
        [np.arange(n_nodes), rng.integers(0, n_nodes, n_ranks - n_nodes)]))
    node_switch = rng.integers(0, draw(st.integers(1, 3)), n_nodes)
    k = draw(st.integers(1, 14))
    if draw(st.booleans()):
        sizes = rng.integers(0, 800, k)
    else:
        sizes = rng.lognormal(4.0, 1.5, k).astype(np.int64)
    kind = draw(st.sampled_from(["scattered", "rank0", "one_rank_each"]))
    where = np.zeros((n_ranks, k), dtype=np.int64)
    for c in range(k):
        if kind == "scattered":
            where[:, c] = np.bincount(rng.integers(0, n_ranks, sizes[c]), minlength=n_ranks)
        elif kind == "rank0":
            where[0, c] = sizes[c]
        else:
            where[rng.integers(n_ranks), c] = sizes[c]
    cent = rng.normal(size=(k, draw(st.integers(1, 6))))
    keep_tol = draw(st.sampled_from([0.1, None, 0.0, 0.5]))
    balance_tol = draw(st.sampled_from([0.05, 0.01, 0.2]))
    return cent, where, rank_node, node_switch, keep_tol, balance_tol


def _worst(quota, n_ranks):
    loads = quota.sum(0)
    mean = loads.sum() / n_ranks
    return float(np.abs(loads / mean - 1).max()) if mean else 0.0


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts())
def test_applied_plan_is_a_fixed_point(case):
    cent, where, rank_node, node_switch, keep_tol, balance_tol = case
    kw = {"keep_tol": keep_tol, "balance_tol": balance_tol, "figures": False}
    first = place(cent, where, rank_node, node_switch, **kw)
    again = place(cent, first.quota.T.copy(), rank_node, node_switch, **kw)
    assert np.array_equal(again.quota, first.quota), (first.quota.sum(0), again.quota.sum(0))
    assert _worst(again.quota, rank_node.size) <= _worst(first.quota, rank_node.size)
    # and it keeps being one (a third plan from the second)
    third = place(cent, again.quota.T.copy(), rank_node, node_switch, **kw)
    assert np.array_equal(third.quota, first.quota)


def test_issue_examples():
    """The issue's shapes: 3 ranks on nodes [0, 1, 2], switches [0, 1, 1], scattered rows;
    4 ranks (2 nodes of 2 on 2 switches), 6 clusters, all rows first on rank 0. The old code
    moved rows in 27 of these 300 cases (measured before the fix)."""
    for seed in range(150):
        rng = np.random.default_rng(seed)
        for rank_node, node_switch, k in (([0, 1, 2], [0, 1, 1], int(rng.integers(2, 12))),
                                          ([0, 0, 1, 1], [0, 1], 6)):
            rank_node, node_switch = np.array(rank_node), np.array(node_switch)
            n_ranks = rank_node.size
            sizes = rng.integers(1, 600, k)
            where = np.zeros((n_ranks, k), dtype=np.int64)
            if n_ranks == 3:
                for c in range(k):
                    where[:, c] = np.bincount(rng.integers(0, 3, sizes[c]), minlength=3)
            else:
                where[0] = sizes
            cent = rng.normal(size=(k, 4))
            first = place(cent, where, rank_node, node_switch)
            again = place(cent, first.quota.T.copy(), rank_node, node_switch)
            assert np.array_equal(again.quota, first.quota), seed
            assert again.figures["moved_fraction"] == 0.0
            assert again.figures["load_max_over_mean"] == first.figures["load_max_over_mean"]


def test_replan_under_mpi():
    """Plan, redistribute, count again and re-plan at 3 and 4 ranks: nothing moves."""
    for n in (3, 4):
        proc = check(mpirun(n, [str(ROOT / "tests" / "mpi" / "place_replan.py")], timeout=120))
        assert f"ok: re-plan on {n} ranks moved nothing" in proc.stdout
