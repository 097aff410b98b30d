"""The experiment report's statistics (issue 12, defect 5) against scipy and hand computations,
and the degenerate cases of the paired tests, defined once (:func:`paired_p`): p is nan
("n.d." in the report) with fewer than 2 finite differences or zero sample variance, per mode
and pooled alike."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from scipy import stats as sps

from semzo import deck as deckmod
from semzo.experiment import analysis as an
from semzo.experiment.analysis import Experiment, Run


def _run(sharding, mode, seed, loss, acc, wall=10.0, steps=(0, 50, 100)):
    return Run(sharding=sharding, mode=mode, seed=seed, steps=np.asarray(steps),
               loss=np.asarray(loss, np.float64), acc=np.asarray(acc, np.float64),
               compute_s=1.0, comm_s=0.25, skipped=0, n_steps=steps[-1], wall_s=wall)


def _exp(runs, shardings=("semantic", "shuffle"), modes=("data", "hybrid"), seeds=3,
         target=0.0, shared=None, place=None, sets=()):
    d = deckmod.load(None, [*sets, f"experiment.shardings={list(shardings)}".replace("'", '"'),
                            f"experiment.modes={list(modes)}".replace("'", '"'),
                            f"experiment.seeds={seeds}", f"experiment.target_loss={target}",
                            "train.steps=100"], check_inputs=False)
    return Experiment(base=Path("."), deck=d, ranks=2, runs=runs,
                      shared=shared or {"topology": 1.0, "embed": 4.0, "cluster": 2.0},
                      place=place or {s: 0.5 + i for i, s in enumerate(shardings)}, budget=100)


def hand_p(d):
    d = np.asarray(d, np.float64)
    n = d.size
    t = d.mean() / (d.std(ddof=1) / math.sqrt(n))
    return float(2 * sps.t.sf(abs(t), n - 1))


FLOATS = st.floats(-10, 10, allow_nan=False, width=32)


@given(st.lists(FLOATS, min_size=2, max_size=12))
def test_paired_p_is_the_one_sample_t_test(d):
    a = np.asarray(d, np.float64)
    assume(np.ptp(a) > 1e-6 * max(np.abs(a).max(), 1e-3))
    p = an.paired_p(a)
    assert p == pytest.approx(float(sps.ttest_1samp(a, 0.0).pvalue), rel=1e-9, abs=1e-15)
    assert p == pytest.approx(hand_p(a), rel=1e-6, abs=1e-12)
    # nan entries are dropped, not propagated
    assert an.paired_p(np.concatenate([a, [math.nan]])) == pytest.approx(p, rel=1e-12)


@pytest.mark.parametrize("d", [[], [0.3], [math.nan, math.nan], [math.nan, 0.2], [0.1, 0.1, 0.1],
                               [0.0, 0.0], [0.025, 0.025, math.nan], [1.0, 1.0 + 1e-12]])
def test_paired_p_degenerate_cases_are_not_defined(d):
    assert math.isnan(an.paired_p(np.asarray(d, np.float64)))


def _grid(fa, fl):
    """Runs whose final accuracy/loss are fa(sharding, mode, seed) / fl(...)."""
    runs = []
    for s in ("semantic", "shuffle"):
        for m in ("data", "hybrid"):
            for i in range(3):
                runs.append(_run(s, m, i, [2.0, 1.5, fl(s, m, i)], [0.2, 0.3, fa(s, m, i)],
                                 wall=10.0 + i + (s == "semantic")))
    return runs


def test_comparisons_by_hand():
    rng = np.random.default_rng(3)
    noise = rng.normal(size=(2, 2, 3))
    si = {"semantic": 0, "shuffle": 1}
    mi = {"data": 0, "hybrid": 1}
    runs = _grid(lambda s, m, i: 0.5 + 0.05 * noise[si[s], mi[m], i] + 0.02 * (s == "semantic"),
                 lambda s, m, i: 1.0 + 0.1 * noise[si[s], mi[m], i])
    exp = _exp(runs)
    rows = an.comparisons(exp)
    assert [(r["other"], r["mode"]) for r in rows] == [("shuffle", "data"), ("shuffle", "hybrid"),
                                                     ("shuffle", "all modes")]
    want = {}
    for m in ("data", "hybrid"):
        acc = np.array([0.02 + 0.05 * (noise[0, mi[m], i] - noise[1, mi[m], i])
                        for i in range(3)])
        loss = np.array([0.1 * (noise[0, mi[m], i] - noise[1, mi[m], i]) for i in range(3)])
        want[m] = (acc, loss)
    want["all modes"] = tuple(np.concatenate([want[m][j] for m in ("data", "hybrid")])
                              for j in (0, 1))
    for r in rows:
        acc, loss = want[r["mode"]]
        assert np.allclose(r["acc"], acc) and np.allclose(r["loss"], loss)
        assert r["p_acc"] == pytest.approx(sps.ttest_1samp(acc, 0.0).pvalue)
        assert r["p_loss"] == pytest.approx(sps.ttest_1samp(loss, 0.0).pvalue)
    for key in ("p_acc", "p_loss"):
        p = [r[key] for r in rows]
        order = np.argsort(p)
        adj = np.maximum.accumulate([min(1.0, (3 - j) * p[i]) for j, i in enumerate(order)])
        for j, i in enumerate(order):
            assert rows[i][key + "_holm"] == pytest.approx(adj[j])


def test_comparisons_degenerate_rows_agree_per_mode_and_pooled():
    """Every seed gives the same difference: not defined per mode *and* pooled (the old code
    said p = 0.0 per mode and nan pooled); one seed: not defined either."""
    runs = _grid(lambda s, m, i: 0.5 + 0.025 * (s == "semantic"), lambda s, m, i: 1.0)
    rows = an.comparisons(_exp(runs))
    assert len(rows) == 3
    for r in rows:
        assert np.allclose(r["acc"], 0.025) and np.allclose(r["loss"], 0.0)
        for key in ("p_acc", "p_loss", "p_acc_holm", "p_loss_holm"):
            assert math.isnan(r[key]), (r["mode"], key)
    one = [r for r in runs if r.seed == 0]
    for r in an.comparisons(_exp(one, seeds=1)):
        assert r["acc"].size == (1 if r["mode"] != "all modes" else 2)
        assert math.isnan(r["p_acc"])         # one seed; pooled: two equal differences


def test_target_loss_by_hand():
    runs = _grid(lambda s, m, i: 0.5, lambda s, m, i: 1.0 - 0.1 * (s == "semantic") + 0.01 * i)
    t, why = an.target_loss(_exp(runs))
    best = 0.9 + 0.01                                  # semantic mean final loss
    assert t == pytest.approx(0.5 * (2.0 + best)) and "halfway" in why
    t, why = an.target_loss(_exp(runs, target=1.25))
    assert t == 1.25 and "experiment.target_loss" in why
    flat = _grid(lambda s, m, i: 0.5, lambda s, m, i: 2.5)       # nothing improved
    t, why = an.target_loss(_exp(flat))
    assert t == pytest.approx(2.0) and "no configuration lowered" in why


def test_semantic_cost_and_overhead_by_hand():
    runs = _grid(lambda s, m, i: 0.5, lambda s, m, i: 1.0)
    exp = _exp(runs, shared={"topology": 1.0, "embed": 4.0, "cluster": 2.0},
               place={"semantic": 3.0, "shuffle": 1.0})
    extra, share = an.semantic_cost(exp)
    sem_ft = np.mean([11.0, 12.0, 13.0])             # wall 10 + seed + 1 (semantic)
    # the deck trains a block through the transformer: only semantic sharding embeds
    assert extra == pytest.approx(4.0 + 2.0 + 3.0 - 1.0) and share == pytest.approx(8.0 / sem_ft)
    head = _exp(runs, shared={"topology": 1.0, "embed": 4.0, "cluster": 2.0},
                place={"semantic": 3.0, "shuffle": 1.0}, sets=["train.last_layers=0"])
    extra, share = an.semantic_cost(head)             # a head on the embed stage's features:
    assert extra == pytest.approx(2.0 + 3.0 - 1.0)    # every sharding needs the embedding
    assert share == pytest.approx(4.0 / sem_ft)
    r = runs[0]                                       # semantic, data, seed 0: wall 11
    assert an.overhead(exp, r) == pytest.approx((4.0 + 2.0 + 3.0) / (1 + 4 + 2 + 3 + 11.0))
    assert an.semantic_cost(_exp(runs, shardings=("semantic", "random"))) is None
    zero = _exp(runs, shared={"topology": 0.0, "embed": 0.0, "cluster": 0.0},
                place={"semantic": 0.0, "shuffle": 0.0})
    r0 = _run("semantic", "data", 0, [2, 1, 1], [0, 0, 0], wall=0.0)
    assert math.isnan(an.overhead(zero, r0))
