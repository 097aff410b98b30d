"""The frozen-prefix cache of the ``choice`` and ``lm`` tasks (issue 31): with LoRA in the top
blocks of a tiny Llama, the cached tasks give the plain tasks' losses, accuracies and held-out
sums up to rounding (also after the trained blocks change), a few ZO steps (three-pass and
streamed) leave the same parameters, a step never runs the stages below the cached block,
and the task builders of the finetune stage take the cache only when they may (nothing below
the top blocks trains, ``train.prefix_cache_mb`` > 0, not offloaded)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from llmutil import tiny_llama
from zo_common import SoloTopo

from semzo.corpus.records import canonical
from semzo.finetune.data import Batcher
from semzo.finetune.loop import LoopConfig, TrainState, evaluate, train
from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.model.chat import InstructTokenizer
from semzo.tasks.choice import ChoiceTask, build_choice_task
from semzo.tasks.lm import LMTask, build_lm_task
from semzo.tasks.prefix_store import PrefixStore
from semzo.zo.engine import ZOEngine
from semzo.zo.perturb import ztensors
from semzo.zo.streamed import step_streamed

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

NOUNS = ["cat", "dog", "sun", "moon", "tree", "red", "blue", "green", "house", "river"]
LAYERS = 4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("pc") / "llama", layers=LAYERS)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(str(w) for w in rng.choice(NOUNS, int(rng.integers(3, 12))))
            for _ in range(n)]


def _choice_recs(n: int, seed: int = 0) -> list[dict]:
    """Records of 2 to 4 choices of different token lengths (a wrong row index would gather
    another row's states, of another length)."""
    rng = np.random.default_rng(seed + 1)
    out = []
    for t in _texts(n, seed):
        k = int(rng.integers(2, 5))
        cs = [" " + " ".join(str(w) for w in rng.choice(NOUNS, int(rng.integers(1, 4))))
              for _ in range(k)]
        out.append({"prompt": t, "choices": cs, "answer": int(rng.integers(k))})
    return out


def _lora(m, layers: int = 2) -> list[str]:
    return select_trainable(m, "lora", lora_rank=4, lora_alpha=8, seed=0, lora_layers=layers)


def _make(folder, kind: str, layer: int, n: int = 24, model=None, store=None):
    m = model or load_model(folder)
    rows = np.arange(n)
    if kind == "choice":
        it = InstructTokenizer.from_folder(folder)
        cc = [it.choice(r, 48) for r in _choice_recs(n)]
        task = ChoiceTask(m, [c[0] for c in cc], [c[1] for c in cc],
                          [r["answer"] for r in _choice_recs(n)], rows, rows, it.pad_id, 8,
                          layer=layer, store=store, store_key=("tiny",))
    else:
        tok = Tokenizer.from_folder(str(folder), max_length=48)
        task = LMTask(m, tok.encode_batch(_texts(n)), np.full(n, -1), rows, rows, tok.pad_id,
                      8, layer=layer, store=store, store_key=("tiny",))
    return m, task


def _nudge(m, names, seed=1):
    """Random values in the trained tensors (LoRA B starts at zero: the adapters then act)."""
    rng = np.random.default_rng(seed)
    for n in names:
        m.params[n][...] += (0.05 * rng.standard_normal(m.params[n].shape)).astype(np.float32)


@pytest.mark.parametrize("kind", ["choice", "lm"])
def test_cached_losses_equal_plain(llama, kind):
    m = load_model(llama)
    names = _lora(m)
    _nudge(m, names)
    _, plain = _make(llama, kind, 0, model=m)
    _, cached = _make(llama, kind, LAYERS - 2, model=m)
    assert plain.cache is None and cached.cache is not None and cached.layer == LAYERS - 2
    assert cached.stage_count() == plain.stage_count() - (LAYERS - 2) - 1
    for pos in (np.array([3, 17, 5, 20, 9, 0]), np.arange(24)):
        bp, bc = plain.batch(pos), cached.batch(pos)
        assert cached.loss(bc) == pytest.approx(plain.loss(bp), rel=1e-5)
    np.testing.assert_allclose(cached.eval_sums(), plain.eval_sums(), rtol=1e-5)
    lp, ap = plain.eval_batch(np.arange(24))
    lc, ac = cached.eval_batch(np.arange(24))
    assert lc == pytest.approx(lp, rel=1e-5) and ac == pytest.approx(ap, abs=1e-9)
    if kind == "choice":
        assert (cached.predict(np.arange(24)) == plain.predict(np.arange(24))).all()
    # the trained blocks change: the cache stays valid
    _nudge(m, names, seed=2)
    b = np.arange(8, 20)
    assert cached.loss(cached.batch(b)) == pytest.approx(plain.loss(plain.batch(b)), rel=1e-5)
    # the streamed stages from the cached state give the cached loss bit for bit
    bc = cached.batch(b)
    st = cached.stage_begin(bc)
    for k in range(cached.stage_count()):
        st = cached.stage_run(k, st)
    assert cached.loss_from_state(st, bc) == cached.loss(bc)


def _steps(folder, kind: str, layer: int, schedule: str, calls: list | None = None):
    m = load_model(folder)
    names = _lora(m)
    _nudge(m, names)
    _, task = _make(folder, kind, layer, model=m)
    if calls is not None:           # the stage each piece of the forward belongs to: the
        embed, block, final = m._embed, m._block_rows, m._final     # embeddings 0, block i
        m._embed = lambda *a, **k: calls.append(0) or embed(*a, **k)      # i + 1, the final
        m._block_rows = lambda i, *a: calls.append(i + 1) or block(i, *a)  # norm L + 1
        m._final = lambda *a, **k: calls.append(LAYERS + 1) or final(*a, **k)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                   run_seed=5, schedule=schedule)
    state = TrainState(run_seed=5)
    train(eng, task, Batcher(24, 6, 5, 0), state,
          LoopConfig(steps=4, lr=5e-3, eval_every=0, log_every=10**6, checksum_every=0))
    eng.flush()
    return task, state, {n: np.array(m.params[n]) for n in names}


@pytest.mark.parametrize("schedule", ["three-pass", "streamed"])
@pytest.mark.parametrize("kind", ["choice", "lm"])
def test_zo_steps_same_params(llama, kind, schedule):
    m0 = load_model(llama)
    names = _lora(m0)
    _nudge(m0, names)
    start = {n: np.array(m0.params[n]) for n in names}
    _, sp, pp = _steps(llama, kind, 0, schedule)
    task, sc, pc = _steps(llama, kind, LAYERS - 2, schedule)
    assert task.cache is not None and sp.step == sc.step == 4
    moved = sum(float(np.abs(pp[n] - start[n]).sum()) for n in names)
    diff = sum(float(np.abs(pc[n] - pp[n]).sum()) for n in names)
    assert moved > 0 and diff <= 1e-4 * moved, (diff, moved)
    for n in names:
        np.testing.assert_allclose(pc[n], pp[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("schedule", ["three-pass", "streamed"])
@pytest.mark.parametrize("kind", ["choice", "lm"])
def test_cached_step_skips_the_frozen_stages(llama, kind, schedule):
    """Stage k + 1 is block k: with the cache of block 2's input, a step runs stages 3..L+1
    only; without it every stage runs (the count can fail)."""
    calls: list = []
    _steps(llama, kind, LAYERS - 2, schedule, calls)
    assert calls and min(calls) == LAYERS - 1, sorted(set(calls))
    plain: list = []
    _steps(llama, kind, 0, schedule, plain)
    assert min(plain) == 0 and plain.count(0) == plain.count(LAYERS + 1)


@pytest.mark.parametrize("kind", ["choice", "lm"])
def test_store_reuses_rows(llama, kind):
    """A second task of the same sequences takes every cached row from the store (the
    choice task's rows are its (record, choice) pairs) and gives the same losses."""
    m = load_model(llama)
    store = PrefixStore()
    _, a = _make(llama, kind, 2, model=m, store=store)
    _, b = _make(llama, kind, 2, model=m, store=store)
    n_rows = len(a.cache_seqs) if kind == "choice" else len(a.seqs)
    if kind == "choice":
        assert n_rows == sum(len(r["choices"]) for r in _choice_recs(24))
    assert a.cache_use[:2] == (0, n_rows) and b.cache_use[:2] == (n_rows, 0)
    np.testing.assert_array_equal(a.cache, b.cache)


# ----------------------------------------------------------------------------- builders
def _ctx(folder, mb: float = 64.0):
    train_ = SimpleNamespace(prefix_cache_mb=mb, choice_score="sum", overlong="skip",
                             eval_batch_size=8)
    deck = SimpleNamespace(train=train_, model=SimpleNamespace(path=str(folder),
                                                               dtype="float32"),
                           corpus=SimpleNamespace(path="corpus.jsonl"))
    return SimpleNamespace(deck=deck, topo=SoloTopo(), xp=np)


def _build(folder, kind: str, names_of, mb: float = 64.0, cache: bool = True):
    m = load_model(folder)
    names = names_of(m)
    n = 12
    if kind == "choice":
        texts = [canonical(r) for r in _choice_recs(n)]
    else:
        texts = _texts(n)
    rows = SimpleNamespace(texts=texts, ids=np.arange(n), labels=np.full(n, -1))
    build = build_choice_task if kind == "choice" else build_lm_task
    return build(_ctx(folder, mb), m, names, rows, np.arange(8), np.arange(8, n), 48,
                 cache=cache)


@pytest.mark.parametrize("kind", ["choice", "lm"])
def test_builder_takes_the_cache_only_when_it_may(llama, kind, caplog):
    got = _build(llama, kind, lambda m: _lora(m, 2))
    assert got.cache is not None and got.layer == LAYERS - 2
    got = _build(llama, kind, lambda m: select_trainable(m, "head+last", last_layers=1))
    assert got.cache is not None and got.layer == LAYERS - 1
    # LoRA in every block (block 0 trains): no cache
    got = _build(llama, kind, lambda m: _lora(m, 0))
    assert got.cache is None and got.layer == 0 and got.stage_count() == LAYERS + 2
    # the embeddings train: no cache
    got = _build(llama, kind, lambda m: select_trainable(m, "all"))
    assert got.cache is None and got.layer == 0
    # train.prefix_cache_mb = 0, a budget too small, or zo.offload (cache=False): no cache
    assert _build(llama, kind, lambda m: _lora(m, 2), mb=0.0).cache is None
    caplog.clear()
    with caplog.at_level("INFO", logger="semzo"):
        assert _build(llama, kind, lambda m: _lora(m, 2), mb=1e-4).cache is None
    assert "no frozen-prefix cache" in caplog.text and "prefix_cache_mb = 0.0001" in caplog.text
    assert _build(llama, kind, lambda m: _lora(m, 2), cache=False).cache is None


def test_lm_batch_of_four_without_cache(llama):
    """The benchmarks build lm batches by hand as (ids, mask, labels, n): still a loss."""
    _, task = _make(llama, "lm", 0)
    b = task.batch(np.arange(6))
    assert task.loss(b[:4]) == task.loss(b)
    st = task.stage_begin(b[:4])
    for k in range(task.stage_count()):
        st = task.stage_run(k, st)
    assert task.loss_from_state(st, b[:4]) == task.loss(b)


def test_evaluate_with_the_cache(llama):
    """finetune.loop.evaluate (the held-out sums over the ranks) reads the cached tasks."""
    for kind in ("choice", "lm"):
        m = load_model(llama)
        _nudge(m, _lora(m))
        _, plain = _make(llama, kind, 0, model=m)
        _, cached = _make(llama, kind, 2, model=m)
        np.testing.assert_allclose(evaluate(cached, SoloTopo()), evaluate(plain, SoloTopo()),
                                   rtol=1e-5)


def test_streamed_step_on_cached_choice_batch(llama):
    """One streamed step of the cached choice task equals its three-pass step bit for bit."""
    out = []
    for schedule in ("streamed", "three-pass"):
        m = load_model(llama)
        names = _lora(m)
        _, task = _make(llama, "choice", 2, model=m)
        eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                       run_seed=4, schedule=schedule)
        b = task.batch(np.arange(6))
        r = (step_streamed(eng, task, b, 0, 1e-2, 6) if schedule == "streamed"
             else eng.step(lambda b=b, t=task: t.loss(b), 0, 1e-2, 6))
        out.append((r.lp, r.lm, r.g))
    assert out[0] == out[1]


# ----------------------------------------------------------------------------- pipeline
def test_lm_pipeline_cached_and_resumed(tmp_path):
    """The finetune stage at 2 ranks builds the lm task with the cache (LoRA in the top
    block of 2) and logs it; a run checkpointed at step 4 and resumed equals the
    uninterrupted run bit for bit (the cache is rebuilt at the resume)."""
    import shutil

    import h5py
    from mpiutil import check, mpirun
    from zo_common import make_model, write_corpus

    env = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    llama = make_model(tmp_path / "llama", kind="llama")
    corpus = write_corpus(tmp_path / "c.jsonl", 120)

    def run(out, steps, *extra):
        return check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                                "--set", f"run.output_dir={out}", "--set",
                                f"corpus.path={corpus}", "--set", f"model.path={llama}",
                                "--set", "train.task=lm", "--set", "cluster.k=3",
                                "--set", "train.params=lora", "--set", "train.lora_layers=1",
                                "--set", f"train.steps={steps}", "--set", "train.eval_every=0",
                                "--set", "zo.lr=1e-3", "--set", "checkpoint.every_steps=4",
                                "--set", "model.max_length=24", "--set",
                                "train.max_length=24", "--set", "train.batch_size=8",
                                "--set", "topology.ranks_per_node=1",
                                "--set", "topology.nodes_per_switch=1", *extra],
                            timeout=240, env=env))

    ref = run(tmp_path / "ref", 8)
    assert "lm task: blocks 0..0 frozen: their output is computed once per text" in ref.stderr
    assert "frozen-prefix cache:" in ref.stderr
    out = tmp_path / "split"
    out.mkdir()
    for f in ("shards.h5", "clusters.h5"):
        shutil.copy(tmp_path / "ref" / f, out / f)
    run(out, 4, "--set", 'run.stages=["finetune"]')
    proc = run(out, 8, "--set", 'run.stages=["finetune"]', "--resume")
    assert "resumed from ckpt-000000004.h5" in proc.stderr
    with h5py.File(out / "model.h5") as fa, h5py.File(tmp_path / "ref" / "model.h5") as fb:
        assert fa.keys() == fb.keys() and len(fa.keys())
        for k in fa:
            assert np.array_equal(fa[k][()], fb[k][()]), k
