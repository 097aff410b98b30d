"""The ZO engine on one process: step arithmetic against a plain-numpy reference (zvec), the
drift bound of perturb/restore, trainable subsets (LoRA), the NaN guard, checksums, schedules,
the training state and resumable data order."""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import SoloTopo, corpus, make_model

from semzo import rng
from semzo.finetune.data import Batcher, epoch_permutation
from semzo.finetune.loop import LoopConfig, TooManySkips, TrainState, train
from semzo.finetune.schedule import lr_at
from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.preflight import heldout_mask, validation_mask
from semzo.tasks.base import pad_batch
from semzo.tasks.classify import ClassifyTask, init_head_class_means
from semzo.zo.engine import ZOEngine, param_checksum, step_seed
from semzo.zo.perturb import ztensors, zvec

EPS, LR, WD = 1e-3, 1e-2, 0.1


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny") / "bert")


def _setup(folder, params="all", **kw):
    m = load_model(folder)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, params, **kw)
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(120)
    seqs = tok.encode_batch([r["text"] for r in recs])
    labels = np.array([int(r["label"][-1]) for r in recs])
    held = heldout_mask(np.arange(120), 0, 0.25)
    task = ClassifyTask(m, seqs, labels, np.flatnonzero(~held), np.flatnonzero(held),
                        tok.pad_id, 32)
    return m, names, task


def _snapshot(m):
    return {n: a.copy() for n, a in m.params.items()}


@pytest.mark.parametrize("dist", ["gaussian", "rademacher", "gaussian-fast"])
def test_step_equals_numpy_reference(folder, dist):
    m, names, task = _setup(folder)
    batch = task.batch(np.arange(16))
    theta0 = _snapshot(m)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, dist=dist, run_seed=7)
    res = eng.step(lambda: task.loss(batch), 3, LR, 16)
    got = _snapshot(m)

    # reference: the documented formulas with z from zvec, float64 arithmetic, one rounding
    seed = step_seed(7, 3, 0)
    z = {n: zvec(seed, eng.tensors[i].t, 0, theta0[n].size, dist).astype(np.float64)
         .reshape(theta0[n].shape) for i, n in enumerate(names)}
    for n in names:
        np.copyto(m.params[n], (theta0[n].astype(np.float64) + EPS * z[n]).astype(np.float32))
    lp = task.loss(batch)
    p2 = {}
    for n in names:
        p2[n] = (m.params[n].astype(np.float64) - 2 * EPS * z[n]).astype(np.float32)
        np.copyto(m.params[n], p2[n])
    lm = task.loss(batch)
    g = (lp - lm) / (2 * EPS)
    assert res.ok and res.lp == lp and res.lm == lm and res.g == g
    assert abs(g) > 0
    for i, n in enumerate(names):
        pr = p2[n].astype(np.float64) + EPS * z[n]
        wd = WD if eng.tensors[i].decay else 0.0
        want = (pr - LR * (g * z[n] + wd * pr)).astype(np.float32)
        assert got[n].tobytes() == want.tobytes(), n
    for n in m.params:            # frozen tensors untouched
        if n not in names:
            assert got[n].tobytes() == theta0[n].tobytes(), n
    # weight decay skipped exactly on biases and LayerNorm
    flags = {n: z.decay for n, z in zip(names, eng.tensors)}
    assert not flags["classifier.bias"] and flags["classifier.weight"]
    assert not any(flags[n] for n in names if "LayerNorm" in n or n.endswith("bias"))


def test_drift_bound_with_zero_update(folder):
    """perturb(+eps), perturb(-2 eps), restore (lr = 0) for several steps: every element stays
    within steps x 1.5 ulp(|p| + eps * ZMAX) of its start (kernels' documented bound)."""
    m, names, _ = _setup(folder)
    theta0 = _snapshot(m)
    eps = 1e-2
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=eps)
    steps = 5
    for s in range(steps):
        eng.step(lambda s=s: 1.0 + s, s, 0.0, 1)
    worst = 0.0
    for n in names:
        p0 = theta0[n].astype(np.float64)
        bound = steps * 1.5 * np.spacing((np.abs(p0) + eps * rng.ZMAX).astype(np.float32))
        d = np.abs(m.params[n].astype(np.float64) - p0)
        assert np.all(d <= bound * (1 + 2 ** -20)), n
        worst = max(worst, float((d / bound).max()))
    assert worst > 0          # rounding does leave residue: the bound is not vacuous


def test_lora_changes_only_adapters_and_head(folder):
    m, names, task = _setup(folder, "lora", lora_rank=2)
    assert names and all(".lora_" in n or n.startswith("classifier.") for n in names)
    assert any(".lora_A." in n for n in names) and "classifier.weight" in names
    before = _snapshot(m)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS)
    for s in range(3):
        b = task.batch(np.arange(16 * s, 16 * s + 16))
        eng.step(lambda b=b: task.loss(b), s, 1e-2, 16)
    for n, a in m.params.items():
        changed = a.tobytes() != before[n].tobytes()
        assert changed == (n in names), n


def test_head_plus_last_selects_top_block(folder):
    _, names, _ = _setup(folder, "head+last", last_layers=1)
    assert "classifier.weight" in names
    assert all(n.startswith(("classifier.", "encoder.layer.1.")) for n in names)
    _, names0, _ = _setup(folder, "head+last", last_layers=0)
    assert set(names0) == {"classifier.weight", "classifier.bias"}


def test_nan_guard_skips_counts_and_stops(folder):
    m, names, task = _setup(folder)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS)
    eng.loss_hook = lambda step, loss: math.nan if step in (2, 3) else loss
    theta = {}

    def snap(row):
        if row["kind"] == "train":
            theta[row["step"]] = _snapshot(m)

    batcher = Batcher(task.train_rows.size, 8, 0, 0)
    st = train(eng, task, batcher, TrainState(), LoopConfig(steps=5, lr=1e-2, max_skips=2),
               on_row=snap)
    assert st.skips == 2 and st.step == 5
    assert len(st.hist_seed) == 3            # only applied steps are recorded
    for n in names:                          # a skipped step leaves theta where it was
        a, b = theta[1][n].astype(np.float64), theta[3][n].astype(np.float64)
        tol = 2 * 1.5 * np.spacing((np.abs(a) + EPS * rng.ZMAX).astype(np.float32))
        assert np.all(np.abs(a - b) <= tol)
    eng.loss_hook = lambda step, loss: math.nan if step >= 5 else loss
    with pytest.raises(TooManySkips, match="max_skips"):
        train(eng, task, batcher, st, LoopConfig(steps=20, lr=1e-2, max_skips=2))


def test_resume_from_state_is_exact(folder):
    def run(split):
        m, names, task = _setup(folder)
        eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                       run_seed=3)
        b = Batcher(task.train_rows.size, 8, 3, 0)
        st = TrainState(run_seed=3)
        cfg = LoopConfig(steps=6, lr=1e-2, schedule="cosine", warmup_steps=2, history=4)
        if split:
            st = train(eng, task, b, st, LoopConfig(**{**cfg.__dict__, "steps": 3}))
            st = TrainState.from_dict(st.to_dict())
            b = Batcher(task.train_rows.size, 8, 3, 0)     # a fresh process's objects
        st = train(eng, task, b, st, cfg)
        return _snapshot(m), st

    a, sa = run(False)
    b, sb = run(True)
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)
    da, db = sa.to_dict(), sb.to_dict()
    assert da.keys() == db.keys()
    for k in da:
        assert np.array_equal(da[k], db[k]), k
    assert len(sa.hist_seed) == 4 and sa.hist_step.tolist() == [2, 3, 4, 5]
    assert all(isinstance(v, (int, float, np.ndarray)) for v in da.values())


def test_checksum_sees_one_ulp():
    a = np.linspace(-1, 1, 3000, dtype=np.float32).reshape(30, 100)
    zs = ztensors([("w", a)])
    c0 = param_checksum(zs)
    a[7, 3] = np.nextafter(a[7, 3], np.float32(2))
    c1 = param_checksum(zs)
    assert c0[0] != c1[0] and c0[1] != c1[1]
    b = a.copy()
    b.reshape(-1)[[10, 20]] = b.reshape(-1)[[20, 10]]        # a swap keeps the plain sum
    c2 = param_checksum(ztensors([("w", b)]))
    assert c2[0] == c1[0] and c2[1] != c1[1]


def test_schedules():
    assert lr_at(0, 100, 1.0, "constant") == 1.0
    assert lr_at(0, 100, 1.0, "constant", warmup=4) == 0.25
    assert lr_at(3, 100, 1.0, "linear", warmup=4) == 1.0
    assert lr_at(4, 100, 1.0, "linear", warmup=4) == 1.0
    assert lr_at(99, 100, 1.0, "linear", warmup=4, min_ratio=0.1) == pytest.approx(0.1)
    assert lr_at(99, 100, 2.0, "cosine") == pytest.approx(0.0, abs=1e-12)
    mid = lr_at(50, 101, 2.0, "cosine")
    assert mid == pytest.approx(1.0)
    xs = [lr_at(s, 50, 1.0, "cosine", warmup=5) for s in range(50)]
    assert all(b <= a + 1e-15 for a, b in itertools.pairwise(xs[5:]))   # decreasing after warm-up
    with pytest.raises(ValueError):
        lr_at(0, 10, 1.0, "step")


def test_seeds_and_data_order():
    assert step_seed(0, 5, 1) == 0xC7789E80E81FFAA1        # recorded; see test_seeds_reference.py
    assert len({step_seed(0, s, g) for s in range(50) for g in range(4)}) == 200
    assert 0 <= step_seed(2**64 - 1, 2**40, 7) < 2**64
    p = epoch_permutation(97, 1, 2, 3)
    assert sorted(p.tolist()) == list(range(97))
    assert not np.array_equal(p, epoch_permutation(97, 1, 3, 3))
    b = Batcher(10, 4, 0, 0)
    seen, e, pos = [], 0, 0
    for _ in range(5):
        rows, e, pos = b.next(e, pos)
        assert len(rows) == 4
        seen += rows.tolist()
    assert sorted(seen[:10]) == list(range(10)) and (e, pos) == (2, 0)
    assert b.next(1, 2)[0].tolist() == seen[12:16]          # resumes from any cursor
    ids = np.arange(20000)
    h = heldout_mask(ids, 0, 0.1)
    assert 0.09 < h.mean() < 0.11
    assert np.array_equal(h[5000:6000], heldout_mask(ids[5000:6000], 0, 0.1))  # per id
    # train.val_fraction: the next slice of the same hash, disjoint, the held-out rows as
    # they were, per id (any rank count)
    v = validation_mask(ids, 0, 0.1, 0.15)
    assert not (h & v).any() and 0.14 < v.mean() < 0.16
    assert np.array_equal(heldout_mask(ids, 0, 0.25), h | v)
    assert np.array_equal(v[5000:6000], validation_mask(ids[5000:6000], 0, 0.1, 0.15))
    assert not validation_mask(ids, 0, 0.1, 0.0).any()
    ids2, mask = pad_batch([np.array([5, 6, 7]), np.array([8])], 0)
    assert ids2.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.sum() == 4


def test_class_means_head(folder):
    m = load_model(folder)
    m.add_classifier(3, init="zeros", normalize=True)
    r = np.random.default_rng(0)
    emb = r.normal(size=(30, 32)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    labels = np.arange(30) % 3
    counts = init_head_class_means(m, emb, labels, 3, 10.0, SoloTopo())
    assert counts.tolist() == [10, 10, 10]
    w = m.params["classifier.weight"]
    mean0 = emb[labels == 0].mean(0)
    assert np.allclose(w[0], 10 * mean0 / np.linalg.norm(mean0), atol=1e-5)
    assert np.allclose(m.params["classifier.bias"], np.log(1 / 3), atol=1e-6)
