"""Shuffle placement (semzo.place.shuffle): exact balance, exactness against a full sort,
determinism, seed dependence, layout independence (ranks simulated by threads), and the MPI
map check at 1, 2 and 4 ranks."""

from __future__ import annotations

import threading
from functools import reduce

import numpy as np
import pytest
from mpiutil import ROOT, check, mpirun

from semzo.place import movement_from_dest, place, placement_from_quota, shuffle_destinations
from semzo.place.shuffle import destinations_from_keys, shuffle_keys

SCRIPT = ROOT / "tests" / "mpi" / "place_shuffle.py"


class ThreadComm:
    """The collectives shuffle.py uses, for ranks simulated by threads of one process."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank

    def Get_size(self):
        return self.world["size"]

    def Get_rank(self):
        return self.rank

    def _exchange(self, x):
        w = self.world
        w["slots"][self.rank] = np.array(x, copy=True)
        w["barrier"].wait()
        out = list(w["slots"])
        w["barrier"].wait()
        return out

    def Allreduce(self, send, recv, op=None):
        assert op is None, "shuffle uses SUM (the default) only"
        recv[...] = reduce(np.add, self._exchange(send))

    def Allgather(self, send, recv):
        recv[...] = np.concatenate(self._exchange(send)).reshape(recv.shape)

    def Allgatherv(self, send, spec):
        recv, (counts, _displs) = spec
        parts = self._exchange(send)
        assert [p.size for p in parts] == list(counts)
        recv[...] = np.concatenate(parts)


def run_ranks(n, fn):
    """fn(comm, rank) on n threads; returns the results, or the exceptions if any raised."""
    # a rank that skips a collective leaves the others at the barrier until its timeout
    world = {"size": n, "slots": [None] * n, "barrier": threading.Barrier(n, timeout=20)}
    out, errors = [None] * n, [None] * n

    def body(r):
        try:
            out[r] = fn(ThreadComm(world, r), r)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return (None, errors) if any(e is not None for e in errors) else (out, None)


def serial(ids, n_ranks, seed, **kw):
    out, err = run_ranks(1, lambda comm, r: shuffle_destinations(ids, n_ranks, seed, comm, **kw))
    assert err is None, err
    return out[0]


def by_sort(keys, ids, n_ranks):
    """The definition: position in the sort by (key, id), scaled to [0, P)."""
    order = np.lexsort((ids, keys))
    ref = np.empty(ids.size, np.int64)
    ref[order] = np.arange(ids.size) * n_ranks // max(ids.size, 1)
    return ref


def unique_ids(n, rng):
    return rng.permutation(np.unique(rng.integers(-2**62, 2**62, n + n // 10 + 5))[:n])


@pytest.mark.parametrize("n", [0, 1, 3, 10, 257, 4000])
@pytest.mark.parametrize("n_ranks", [1, 2, 3, 8, 13])
@pytest.mark.parametrize("gather_limit", [0, 4, 1 << 16])
def test_exact_balance_and_equal_to_full_sort(n, n_ranks, gather_limit):
    rng = np.random.default_rng(n * 31 + n_ranks)
    ids = unique_ids(n, rng)
    dest = serial(ids, n_ranks, 7, gather_limit=gather_limit)
    assert dest.dtype == np.int64 and dest.shape == (n,)
    assert np.array_equal(dest, by_sort(shuffle_keys(ids, 7), ids, n_ranks))
    counts = np.bincount(dest, minlength=n_ranks)
    assert counts.size == n_ranks and counts.sum() == n           # no loss, no duplicate
    assert set(counts.tolist()) <= {n // n_ranks, n // n_ranks + 1}
    # rank p gets exactly ceil((p+1)N/P) - ceil(pN/P) samples
    bounds = -(-np.arange(n_ranks + 1) * n // n_ranks)
    assert np.array_equal(counts, np.diff(bounds))


def test_deterministic_pinned_and_seed_dependent():
    ids = np.arange(24)
    d0 = serial(ids, 4, 0)
    assert d0.tolist() == [0, 3, 3, 0, 1, 1, 1, 2, 1, 2, 3, 0, 2, 3, 0, 3, 1, 1, 0, 3, 2, 2, 0,
                           2], "the id -> rank map of seed 0 changed (reproducibility contract)"
    assert np.array_equal(serial(ids, 4, 0), d0)
    assert serial(ids, 4, 1).tolist() == [0, 2, 0, 0, 0, 3, 2, 1, 1, 3, 2, 3, 3, 2, 1, 1, 1, 3,
                                          3, 2, 1, 2, 0, 0]
    big = unique_ids(20000, np.random.default_rng(0))
    a, b = serial(big, 8, 0), serial(big, 8, 1)
    assert abs(np.mean(a == b) - 1 / 8) < 0.02           # seeds give independent maps
    # the map does not follow the id order: contiguous id blocks are spread evenly
    blocks = np.arange(20000) * 8 // 20000
    d = serial(np.arange(20000), 8, 0)
    assert abs(np.mean(d == blocks) - 1 / 8) < 0.02
    # nor a cluster: every rank gets about N/P of each id class
    table = np.zeros((4, 8), np.int64)
    np.add.at(table, (np.arange(20000) % 4, d), 1)
    assert np.abs(table - 20000 / 32).max() < 6 * np.sqrt(20000 / 32)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_layout_independent(size):
    rng = np.random.default_rng(size)
    ids = unique_ids(3001, rng)
    want = serial(ids, size, 11)
    perm = rng.permutation(ids.size)
    layouts = {
        "blocks": np.array_split(np.arange(ids.size), size),
        "uneven": np.split(perm, np.sort(rng.integers(0, ids.size, size - 1))),
        "one rank": [perm[:0]] * (size - 1) + [perm],
        "first empty": [perm[:0]] + np.array_split(perm, size - 1),
    }
    for name, parts in layouts.items():
        for limit in (0, 9, 1 << 16):
            out, err = run_ranks(size, lambda comm, r, parts=parts, limit=limit:
                                 shuffle_destinations(ids[parts[r]], size, 11, comm,
                                                      gather_limit=limit))
            assert err is None, err
            got = np.empty(ids.size, np.int64)
            for r in range(size):
                got[parts[r]] = out[r]
            assert np.array_equal(got, want), (name, limit)


@pytest.mark.parametrize("keyfn", ["three values", "all equal", "shared high bits"])
def test_ties_broken_by_id_any_layout(keyfn):
    rng = np.random.default_rng(3)
    ids = unique_ids(1500, rng)
    u = ids.astype(np.uint64)
    keys = {"three values": (u % np.uint64(3)) << np.uint64(62),
            "all equal": np.full(ids.size, 12345, np.uint64),
            "shared high bits": (np.uint64(0xABC) << np.uint64(52)) | (u & np.uint64(0xFF))}[keyfn]
    want = by_sort(keys, ids, 4)
    parts = np.split(rng.permutation(ids.size), [100, 100, 900])
    for limit in (0, 3, 1 << 16):
        out, err = run_ranks(4, lambda comm, r, limit=limit: destinations_from_keys(
            keys[parts[r]], ids[parts[r]], 4, comm, gather_limit=limit))
        assert err is None, err
        got = np.empty(ids.size, np.int64)
        for r in range(4):
            got[parts[r]] = out[r]
        assert np.array_equal(got, want), limit


def test_bad_ids_raise_on_every_rank():
    def fn(comm, r):
        ids = np.arange(10) + 10 * r
        return shuffle_destinations(ids.astype(np.float64) if r == 1 else ids, 3, 0, comm)
    out, err = run_ranks(3, fn)
    assert out is None and all(isinstance(e, ValueError) for e in err), err
    assert "integer" in str(err[0])
    out, err = run_ranks(1, lambda comm, r: shuffle_destinations(np.arange(5), 0, 0, comm))
    assert isinstance(err[0], ValueError) and "n_ranks" in str(err[0])


def test_movement_from_dest():
    rank_node, node_switch = np.array([0, 0, 1, 1]), np.array([0, 1])
    dests = [np.array([0, 1, 2, 3]), np.array([1, 1]), np.array([], np.int64), np.array([0])]
    out, err = run_ranks(4, lambda comm, r: movement_from_dest(dests[r], rank_node,
                                                               node_switch, comm))
    assert err is None, err
    # moved: rank0 -> 1, 2, 3; rank3 -> 0. cross node: 0->2, 0->3, 3->0 (also cross switch)
    assert out == [{"moved": 4, "cross_node": 3, "cross_switch": 3}] * 4


def test_place_refuses_shuffle_and_placement_from_quota():
    cent = np.eye(3, 4, dtype=np.float32)
    where = np.array([[5, 0, 2], [1, 4, 0]])
    rank_node, node_switch = np.array([0, 1]), np.array([0, 0])
    with pytest.raises(ValueError, match="shuffle_destinations"):
        place(cent, where, rank_node, node_switch, mode="shuffle")
    quota = np.array([[3, 3], [2, 2], [1, 1]])
    plan = placement_from_quota(cent, where, quota, rank_node, node_switch, mode="shuffle",
                                bytes_per_row=10, seed=0)
    assert plan.mode == "shuffle" and plan.cluster_rank.tolist() == [0, 0, 0]
    f = plan.figures
    assert f["load_max_over_mean"] == 1.0 and f["clusters_split_ranks"] == 3
    assert "random_centroid_dist" in f and f["centroid_dist_ratio"] >= 1.0
    with pytest.raises(ValueError, match="exactly once"):
        placement_from_quota(cent, where, quota + 1, rank_node, node_switch, mode="shuffle")


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_shuffle_map_mpi(nranks):
    proc = check(mpirun(nranks, [str(SCRIPT), "map"], timeout=90))
    assert f"ok: shuffle map on {nranks} ranks" in proc.stdout
