"""Heterogeneous ranks (``place.rank_weights``): apportioned shares, weighted placement, the
deck key's validation, the slow-rank test hook, and the measured weights under MPI."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpiutil import ROOT, check, mpirun

from semzo.deck import DeckError, build, check_world
from semzo.place import place, shuffle_destinations
from semzo.place.weights import apportion, batch_shares, slow_factors, slowed

weights_st = st.lists(st.floats(min_value=1e-3, max_value=1e3, allow_nan=False), min_size=1,
                      max_size=12)


@settings(max_examples=200, deadline=None)
@given(total=st.integers(0, 10**7), w=weights_st)
def test_apportion_proportional(total, w):
    share = apportion(total, w)
    exact = total * np.asarray(w) / np.sum(w)
    assert share.dtype == np.int64 and share.sum() == total
    assert np.all(np.abs(share - exact) < 1.0 + 1e-6 * total), (share, exact)
    assert share.min() >= 0


@settings(max_examples=100, deadline=None)
@given(total=st.integers(0, 10**6), p=st.integers(1, 9), c=st.floats(0.01, 100))
def test_apportion_equal_weights_is_even(total, p, c):
    share = apportion(total, [c] * p)
    assert share.max() - share.min() <= 1 and share.sum() == total
    assert np.array_equal(share, np.sort(share)[::-1])        # extra ones on the low ranks


def test_batch_shares():
    assert batch_shares(8, None, 2).tolist() == [8, 8]
    assert batch_shares(8, [1.0, 1.0], 2).tolist() == [8, 8]
    assert batch_shares(8, [3, 1], 2).tolist() == [12, 4]
    got = batch_shares(2, [100, 1, 1, 1], 4)          # a tiny weight still gets one sample
    assert got.sum() == 8 and got.min() >= 1 and got[0] == got.max()
    with pytest.raises(ValueError, match="positive"):
        apportion(5, [1, 0])


def _where(P=4, k=30, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(k, 6)), rng.integers(0, 150, size=(P, k)).astype(np.int64)


@pytest.mark.parametrize("w", [[1, 0.5, 1, 1], [3, 1, 1, 2], [1, 2, 4, 8]])
def test_place_in_proportion(w):
    cent, where = _where()
    rank_node, node_switch = np.array([0, 0, 1, 1]), np.array([0, 0])
    total = int(where.sum())
    share = total * np.asarray(w, float) / sum(w)
    rnd = place(cent, where, rank_node, node_switch, mode="random", rank_weights=w,
                figures=False)
    assert np.array_equal(rnd.quota.sum(0), apportion(total, w))
    assert np.array_equal(rnd.quota.sum(1), where.sum(0))
    sem = place(cent, where, rank_node, node_switch, mode="semantic", rank_weights=w,
                figures=False)
    assert np.array_equal(sem.quota.sum(1), where.sum(0))
    assert np.all(np.abs(sem.quota.sum(0) / share - 1) <= 0.05 + 1e-9), sem.quota.sum(0)


def test_equal_weights_same_plan():
    """Any list of equal weights plans exactly what no weights plan (semantic: float
    capacities equal to the rank counts; random: the same integer targets)."""
    cent, where = _where(seed=3)
    topo = (np.array([0, 0, 1, 1]), np.array([0, 1]))
    for mode in ("semantic", "random"):
        a = place(cent, where, *topo, mode=mode, figures=False)
        b = place(cent, where, *topo, mode=mode, rank_weights=[2.5] * 4, figures=False)
        assert np.array_equal(a.quota, b.quota), mode


def test_shuffle_weighted_counts():
    ids = np.arange(9001, dtype=np.int64)
    w = [1, 0.5, 1, 2]
    dest = shuffle_destinations(ids, 4, 7, MPI.COMM_SELF, weights=w, gather_limit=0)
    assert np.array_equal(np.bincount(dest, minlength=4), apportion(ids.size, w))
    plain = shuffle_destinations(ids, 4, 7, MPI.COMM_SELF)
    assert np.bincount(plain, minlength=4).max() - np.bincount(plain, minlength=4).min() <= 1


@pytest.mark.parametrize("value, msg", [
    ("fast", 'expected "equal", "measured" or a list'),
    ([1, 0], "positive finite"),
    ([1, -2.0], "positive finite"),
    ([1, "a"], "positive finite"),
    ([], 'expected "equal", "measured" or a list'),
    (3, 'expected "equal", "measured" or a list'),
])
def test_deck_refuses_bad_weights(value, msg):
    with pytest.raises(DeckError, match=msg) as exc:
        build({"place": {"rank_weights": value}}, "deck.toml", check_inputs=False)
    assert str(exc.value).startswith("deck.toml: place.rank_weights:")


def test_deck_weights_per_rank():
    d = build({"place": {"rank_weights": [1, 2]}}, "deck.toml", check_inputs=False)
    assert d.place.rank_weights == (1.0, 2.0)
    check_world(d, 2)
    with pytest.raises(DeckError, match="place.rank_weights: 2 weights for 4 ranks"):
        check_world(d, 4)
    assert "rank_weights = [1.0, 2.0]" in d.to_toml()
    for v in ("equal", "measured"):
        d = build({"place": {"rank_weights": v}}, "deck.toml", check_inputs=False)
        check_world(d, 3)


def test_cli_exit_2(tmp_path):
    """A list of the wrong length stops the run with exit 2 and one line naming the key."""
    proc = subprocess.run(
        [sys.executable, "-m", "semzo", "run", "inputs/demo.toml",
         "--set", f"run.output_dir={tmp_path}", "--set", 'run.stages=["place"]',
         "--set", "place.rank_weights=[1, 2, 3]"],
        check=False, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "place.rank_weights: 3 weights for 1 ranks" in proc.stderr


def test_slow_hook():
    assert slow_factors("1:2.0, 3:1.5") == {1: 2.0, 3: 1.5}
    assert slow_factors("") == {}
    for bad in ("1", "x:2", "1:0.5", "-1:2"):
        with pytest.raises(ValueError, match="SEMZO_SLOW_RANKS"):
            slow_factors(bad)

    def work():
        t = time.perf_counter()
        while time.perf_counter() - t < 0.02:
            pass
        return 7

    assert slowed(work, 1.0) is work
    t0 = time.perf_counter()
    assert slowed(work, 3.0)() == 7
    assert time.perf_counter() - t0 >= 0.06


@pytest.mark.parametrize("nranks", [2, 4])
def test_measured_weights_mpi(nranks):
    """Measured weights agree on every rank and the slowed rank gets the smallest; weighted
    shuffle / random / semantic placement across ranks (tests/mpi/rank_weights.py)."""
    env = {"SEMZO_SLOW_RANKS": "1:10.0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = check(mpirun(nranks, [str(ROOT / "tests" / "mpi" / "rank_weights.py")],
                        timeout=120, env=env))
    assert f"ok: rank weights on {nranks} ranks" in proc.stdout
