"""Placement plans (pure numpy, every rank simulated in one process)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from semzo.place import destinations, movement, place
from semzo.place import plan as planmod


def scatter(sizes, n_ranks, rng):
    """where (P, k): each cluster's samples spread uniformly at random over ranks."""
    return np.stack([np.bincount(rng.integers(0, n_ranks, s), minlength=n_ranks)
                     for s in sizes], axis=1).astype(np.int64)


def blobs(n_blobs, per_blob, d, rng, spread=8.0):
    centres = rng.normal(size=(n_blobs, d)) * spread
    return np.concatenate([c + rng.normal(size=(per_blob, d)) for c in centres]).astype(
        np.float32)


def simulate(plan, rng):
    """Run destinations() for every rank; return moved (cluster, src, dst) counts."""
    k, n_ranks = plan.quota.shape
    got = np.zeros((k, n_ranks), dtype=np.int64)
    crossings = {"moved": 0, "cross_node": 0, "cross_switch": 0}
    sw = plan.node_switch[plan.rank_node]
    for p in range(n_ranks):
        labels = np.repeat(np.arange(k), plan.where[p])
        rng.shuffle(labels)
        dest = destinations(labels, plan, p)
        assert dest.dtype == np.int64 and dest.shape == labels.shape
        np.add.at(got, (labels, dest), 1)
        crossings["moved"] += int((dest != p).sum())
        crossings["cross_node"] += int((plan.rank_node[dest] != plan.rank_node[p]).sum())
        crossings["cross_switch"] += int((sw[dest] != sw[p]).sum())
    return got, crossings


TOPOLOGIES = {
    "flat": (np.zeros(6, dtype=np.int64), np.array([0])),
    "contiguous": (np.arange(16) // 4, np.array([0, 0, 1, 1])),
    "interleaved": (np.arange(12) % 3, np.array([5, 9, 5])),      # ranks of a node not adjacent
    "uneven": (np.array([0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 1, 0, 4]), np.array([0, 1, 1, 0, 2])),
}


@pytest.mark.parametrize("mode", ["semantic", "random"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quota_exact_balanced_and_destinations_meet_it(mode, topo, seed):
    rng = np.random.default_rng(seed)
    rank_node, node_switch = TOPOLOGIES[topo]
    n_ranks, k = rank_node.size, int(rng.integers(3, 60))
    sizes = rng.lognormal(5.5, 1.3, k).astype(np.int64)
    sizes[rng.integers(k)] = sizes.sum() // 3                     # one huge cluster
    where = scatter(sizes, n_ranks, rng)
    plan = place(rng.normal(size=(k, 5)), where, rank_node, node_switch, mode=mode, seed=seed)
    assert plan.quota.shape == (k, n_ranks) and plan.quota.dtype == np.int64
    assert np.array_equal(plan.quota.sum(1), sizes)
    loads = plan.quota.sum(0)
    mean = sizes.sum() / n_ranks
    assert loads.max() <= 1.05 * mean and loads.min() >= 0.95 * mean, loads / mean
    f = plan.figures
    assert f["load_max_over_mean"] == pytest.approx(loads.max() / mean)
    got, crossings = simulate(plan, rng)
    assert np.array_equal(got, plan.quota)
    keep = np.minimum(where, plan.quota.T).sum()
    assert crossings["moved"] == sizes.sum() - keep                # nothing moves needlessly
    assert crossings["moved"] == round(f["moved_fraction"] * sizes.sum())
    assert crossings["cross_node"] == f["rows_cross_node"]
    assert crossings["cross_switch"] == f["rows_cross_switch"]
    assert plan.cluster_rank.shape == (k,)
    assert all(plan.quota[c, plan.cluster_rank[c]] == plan.quota[c].max() for c in range(k))


def test_deterministic_and_idempotent():
    rng = np.random.default_rng(5)
    rank_node, node_switch = TOPOLOGIES["interleaved"]
    cent = blobs(4, 10, 16, rng)
    where = scatter(rng.integers(10, 900, 40), rank_node.size, rng)
    a = place(cent, where, rank_node, node_switch)
    b = place(cent.copy(), where.copy(), rank_node, node_switch)
    assert np.array_equal(a.quota, b.quota) and a.figures == b.figures
    again = place(cent, a.quota.T.copy(), rank_node, node_switch)   # data now where planned
    assert np.array_equal(again.quota, a.quota)
    assert again.figures["moved_fraction"] == 0.0


def test_small_reclustering_moves_little():
    """Data already placed; k-means re-run shifts centroids a bit and relabels 3% of samples."""
    rng = np.random.default_rng(11)
    rank_node, node_switch = np.arange(32) // 4, np.arange(8) // 2
    cent = blobs(8, 16, 32, rng)
    sizes = rng.integers(200, 3000, cent.shape[0])
    first = place(cent, scatter(sizes, 32, rng), rank_node, node_switch)
    where = first.quota.T.copy()
    for p in range(32):                                # 3% of each rank's samples relabelled
        for c in np.flatnonzero(where[p]):
            m = where[p, c] * 3 // 100
            where[p, c] -= m
            where[p, rng.integers(cent.shape[0])] += m
    cent2 = cent + 0.01 * rng.normal(size=cent.shape)
    kept = place(cent2, where, rank_node, node_switch)
    fresh = place(cent2, where, rank_node, node_switch, keep_tol=None)
    assert kept.figures["moved_fraction"] < 0.06, kept.figures        # 3% relabelled
    assert kept.figures["moved_fraction"] < fresh.figures["moved_fraction"]
    assert kept.figures["random_moved_fraction"] > 0.8
    assert kept.figures["centroid_dist"] < 1.05 * fresh.figures["centroid_dist"]
    assert kept.figures["load_max_over_mean"] <= 1.05
    assert kept.figures["load_min_over_mean"] >= 0.95


@pytest.mark.parametrize("seed", [12, 13])
def test_keep_mode_on_scattered_data_stays_compact(seed):
    """A scattered (file-order) layout is not worth keeping: keep mode may trade at most
    about keep_tol of compactness for less movement, never keep the scatter."""
    rng = np.random.default_rng(seed)
    rank_node, node_switch = np.arange(16) // 4, np.arange(4) // 2
    cent = blobs(4, 8, 32, rng)
    where = scatter(rng.integers(500, 2000, 32), 16, rng)
    a = place(cent, where, rank_node, node_switch).figures
    b = place(cent, where, rank_node, node_switch, keep_tol=None).figures
    assert a["centroid_dist"] <= 1.1 * b["centroid_dist"], (a, b)
    assert a["clusters_split_switches"] == b["clusters_split_switches"] == 0
    assert a["moved_fraction"] <= b["moved_fraction"]
    assert a["centroid_dist"] < 0.3 * a["random_centroid_dist"]


def test_close_clusters_share_nodes_and_switches():
    rng = np.random.default_rng(3)
    n_blobs, per_blob = 4, 12
    cent = blobs(n_blobs, per_blob, 24, rng, spread=20.0)
    blob_of = np.repeat(np.arange(n_blobs), per_blob)
    sizes = np.full(n_blobs * per_blob, 500)                       # one blob = one node
    rank_node, node_switch = np.arange(16) // 4, np.array([0, 0, 1, 1])
    plan = place(cent, scatter(sizes, 16, rng), rank_node, node_switch)
    node_of_cluster = plan.cluster_node
    for b in range(n_blobs):
        assert np.unique(node_of_cluster[blob_of == b]).size == 1, node_of_cluster
    # each cluster on one node, and each node holds one blob
    assert plan.figures["clusters_split_nodes"] == 0
    assert np.unique(node_of_cluster).size == n_blobs
    f = plan.figures
    assert f["centroid_dist"] < 0.5 * f["random_centroid_dist"], f


def test_switch_groups_are_close_blobs():
    rng = np.random.default_rng(8)
    d = 16
    # two far-apart super-groups, each of two nearby blobs
    supers = [rng.normal(size=d) * 50 for _ in range(2)]
    cent = np.concatenate([s + rng.normal(size=d) * 6 + rng.normal(size=(10, d))
                           for s in supers for _ in range(2)])
    super_of = np.repeat([0, 0, 1, 1], 10)
    rank_node, node_switch = np.arange(16) // 4, np.array([0, 0, 1, 1])
    plan = place(cent, scatter(np.full(40, 400), 16, rng), rank_node, node_switch)
    for s in range(2):
        assert np.unique(plan.cluster_switch[super_of == s]).size == 1, plan.cluster_switch


def test_large_cluster_split_within_one_node():
    rng = np.random.default_rng(4)
    k = 20
    sizes = np.full(k, 100)
    sizes[7] = int(3.5 * 1900 / (16 - 3.5))              # 3.5 ranks' worth: fits one node
    rank_node, node_switch = np.arange(16) // 4, np.array([0, 0, 1, 1])
    plan = place(rng.normal(size=(k, 8)), scatter(sizes, 16, rng), rank_node, node_switch)
    ranks = np.flatnonzero(plan.quota[7])
    assert ranks.size >= 3 and np.unique(rank_node[ranks]).size == 1, plan.quota[7]


def test_crossings_prefer_the_current_switch():
    """Two equal switches; the data of blob A sits on switch 1: A must be placed there."""
    rng = np.random.default_rng(2)
    cent = blobs(2, 6, 8, rng, spread=30.0)
    rank_node, node_switch = np.arange(8) // 2, np.array([0, 0, 1, 1])
    where = np.zeros((8, 12), dtype=np.int64)
    where[4:, :6] = 100                                           # blob A on switch 1
    where[:4, 6:] = 100                                           # blob B on switch 0
    plan = place(cent, where, rank_node, node_switch)
    assert plan.figures["rows_cross_switch"] == 0
    assert list(plan.cluster_switch) == [1] * 6 + [0] * 6
    # compacting each blob inside its switch moves data, but never across switches
    assert plan.figures["random_rows_cross_switch"] > 0


def test_random_mode_is_seeded():
    rng = np.random.default_rng(1)
    where = scatter(rng.integers(1, 500, 30), 8, rng)
    args = (rng.normal(size=(30, 4)), where, np.arange(8) // 2, np.zeros(4, dtype=np.int64))
    a, b = place(*args, mode="random", seed=3), place(*args, mode="random", seed=3)
    c = place(*args, mode="random", seed=4)
    assert np.array_equal(a.quota, b.quota) and not np.array_equal(a.quota, c.quota)
    assert a.quota.sum(0).max() - a.quota.sum(0).min() <= 1


def test_assignment_solvers():
    rng = np.random.default_rng(0)
    for _ in range(20):
        score = rng.integers(0, 50, (4, 4))
        best = max(sum(score[i, p[i]] for i in range(4))
                   for p in itertools.permutations(range(4)))
        perm = planmod._assign(score)
        assert sorted(perm) == [0, 1, 2, 3]
        assert sum(score[i, perm[i]] for i in range(4)) == best
    assert list(planmod._assign(np.zeros((3, 3)))) == [0, 1, 2]      # ties: identity
    assert list(planmod._assign(np.array([[5, 6], [5, 5]]))) == [1, 0]


def test_empty_clusters_and_no_samples():
    rank_node, node_switch = np.arange(4) // 2, np.array([0, 0])
    where = np.zeros((4, 3), dtype=np.int64)
    where[:, 1] = 10
    plan = place(np.eye(3), where, rank_node, node_switch)
    assert list(plan.cluster_rank[[0, 2]]) == [-1, -1]
    assert list(plan.quota.sum(0)) == [10, 10, 10, 10]
    zero = place(np.eye(3), np.zeros((4, 3), dtype=np.int64), rank_node, node_switch)
    assert zero.quota.sum() == 0 and zero.figures["moved_fraction"] == 0.0


def test_bad_inputs():
    with pytest.raises(ValueError, match="where must be"):
        place(np.eye(3), np.zeros((2, 3), dtype=np.int64), np.zeros(3), np.zeros(1))
    with pytest.raises(ValueError, match="rank_node"):
        place(np.eye(3), np.zeros((2, 3), dtype=np.int64), np.array([0, 2]), np.zeros(2))
    with pytest.raises(ValueError, match="mode"):
        place(np.eye(3), np.zeros((1, 3), dtype=np.int64), np.zeros(1), np.zeros(1), mode="x")
    plan = place(np.eye(2), np.array([[3, 0], [0, 3]]), np.zeros(2), np.zeros(1))
    with pytest.raises(ValueError, match="counts differ"):
        destinations(np.array([0, 0]), plan, 0)
    assert movement(plan.where, plan.quota, plan.rank_node, plan.node_switch)["moved"] == 0
