"""Issue 32: the prompt task's label-word rows trained by their exact gradient beside the ZO
step (``train.label_rows``): the gradient against finite differences, Adam's step and state,
the rows in files (model.h5, checkpoints) and in export/generate (a tied head untied), a
learning run, a bit-exact resume, and the deck's and the resume's refusals."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from llmutil import tiny_llama

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import SoloComm, SoloTopo, StopAt

from semzo.deck import DeckError, ZoSection, load
from semzo.deck.read import auto_rows_warmup, label_rows_mode, label_rows_warmup
from semzo.finetune.data import Batcher
from semzo.finetune.label_rows import LabelRows
from semzo.finetune.loop import LoopConfig, TrainState, evaluate, train
from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.model.label_rows import DELTA, WORD_IDS, apply_to_model, from_state, take_from
from semzo.preflight import heldout_mask
from semzo.runtime import SemzoError
from semzo.tasks.prompt import PromptTask, encode_prompts
from semzo.zo.engine import ZOEngine
from semzo.zo.perturb import ztensors


def _ce(h, w, y, cap=0.0):
    z = h @ w.T
    if cap:
        z = cap * np.tanh(z / cap)
    s = z - z.max(1, keepdims=True)
    lp = s - np.log(np.exp(s).sum(1, keepdims=True))
    return -lp[np.arange(len(y)), y].mean(), z


@pytest.mark.parametrize("cap", [0.0, 3.0])
def test_gradient_is_the_exact_gradient_of_the_label_word_loss(cap):
    """The summed rows' gradient over two losses, divided by their rows, against central
    differences of the mean cross-entropy (and through Gemma 2's soft cap)."""
    rng = np.random.default_rng(0)
    h, w, y = rng.normal(size=(10, 6)), rng.normal(size=(3, 6)), rng.integers(0, 3, 10)
    lr = LabelRows(np, w, [4, 7, 9], 0.01)
    lr.begin()
    for rows in (slice(0, 4), slice(4, 10)):           # two losses of one step
        _, z = _ce(h[rows], w, y[rows], cap)
        lr.add(h[rows], z, y[rows], cap)
    assert lr._g[-1] == 10
    g = lr._g[:-1].reshape(3, 6) / 10
    num = np.zeros_like(w)
    for i in range(3):
        for j in range(6):
            d = np.zeros_like(w)
            d[i, j] = 1e-6
            num[i, j] = (_ce(h, w + d, y, cap)[0] - _ce(h, w - d, y, cap)[0]) / 2e-6
    assert np.abs(g - num).max() < 1e-7, np.abs(g - num).max()


def test_adam_step_state_round_trip_and_checks():
    rng = np.random.default_rng(1)
    w = rng.normal(size=(2, 5)).astype(np.float32)
    lr = LabelRows(np, w, [1, 2], 0.05)
    h, y = rng.normal(size=(8, 5)), rng.integers(0, 2, 8)
    lr.begin()
    assert not lr.step(SoloComm(), 1.0)                 # no rows, no step
    lr.add(h, h @ w.T, y)
    assert lr.step(SoloComm(), 0.5) and lr.t == 1
    # Adam's first step moves every coordinate by lr x rms x frac (m/sqrt(v) = sign(g))
    rms = float(np.sqrt((w.astype(np.float64) ** 2).mean()))
    assert np.allclose(np.abs(lr.delta), 0.05 * rms * 0.5, rtol=1e-5)
    packed = lr.pack()
    other = LabelRows(np, w, [1, 2], 0.05)
    other.unpack(packed, "x.h5")
    assert other.pack().tobytes() == packed.tobytes()
    for bad in (packed[:, :1], packed.astype(np.float32), np.where(packed == packed[0, 0, 0],
                                                                   np.nan, packed)):
        with pytest.raises(SemzoError, match="x.h5: state/label_rows"):
            other.unpack(bad, "x.h5")


def test_files_hold_checked_rows():
    d, ids = np.ones((2, 4), np.float32), np.array([3, 5])
    assert take_from({"a": 1}, "m.h5") is None
    p = {DELTA: d, WORD_IDS: ids, "other": 0}
    got = take_from(p, "m.h5")
    assert list(p) == ["other"] and np.array_equal(got[0], ids) and np.array_equal(got[1], d)
    with pytest.raises(SemzoError, match="m.h5: label_rows.delta and label_rows.word_ids go"):
        take_from({DELTA: d}, "m.h5")
    with pytest.raises(SemzoError, match="m.h5: label_rows.delta"):
        take_from({DELTA: d, WORD_IDS: np.array([3])}, "m.h5")
    assert from_state({"label_rows": np.zeros(0)}, "c.h5") is None
    st = np.zeros((4, 2, 4))
    st[0] = 2.0
    ids2, d2 = from_state({"label_rows": st, "label_row_ids": ids}, "c.h5")
    assert d2.dtype == np.float32 and (d2 == 2).all() and np.array_equal(ids2, ids)
    with pytest.raises(SemzoError, match="c.h5: state/label_rows"):
        from_state({"label_rows": st, "label_row_ids": ids[:1]}, "c.h5")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("lr") / "llama")


def test_untie_keeps_logits_and_apply_changes_only_the_label_rows(llama):
    m = load_model(llama)
    assert m.tied_head
    ids = np.array([[5, 9, 30, 7, 2, 11]])
    before = m.logits(ids)
    emb = m.params[m.head_weight_name()].copy()
    m.untie_head()
    assert not m.tied_head and m.head_weight_name() == "lm_head.weight"
    assert m.config.raw["tie_word_embeddings"] is False
    assert np.array_equal(m.logits(ids), before)
    d = np.full((2, emb.shape[1]), 0.25, np.float32)
    apply_to_model(m, np.array([9, 30]), d, "m.h5")
    w = m.params["lm_head.weight"]
    assert np.array_equal(w[[9, 30]], emb[[9, 30]] + 0.25)
    rest = np.setdiff1d(np.arange(emb.shape[0]), [9, 30])
    assert np.array_equal(w[rest], emb[rest])
    assert np.array_equal(m.params[m.prefix + m.config.names.embed], emb)   # inputs unchanged
    after = m.logits(ids)
    assert np.abs(after[..., [9, 30]] - before[..., [9, 30]]).max() > 1e-3
    assert np.array_equal(after[..., rest], before[..., rest])
    with pytest.raises(SemzoError, match="m.h5: label_rows.word_ids: ids must lie in"):
        apply_to_model(m, np.array([9, emb.shape[0]]), d, "m.h5")


# ----------------------------------------------------------------------------- training
def _prompt_task(folder, seed: int = 0):
    """A tiny Llama's prompt task (LoRA q, v in the top block) on texts whose last word
    names their class; the label words are not those words."""
    rng = np.random.default_rng(seed)
    nouns = ["cat", "dog", "sun", "moon", "tree", "red", "blue", "green"]
    texts, labels = [], []
    for _ in range(240):
        c = int(rng.integers(2))
        texts.append(" ".join(str(w) for w in rng.choice(nouns, 4)) + [" good", " bad"][c])
        labels.append(c)
    m = load_model(folder)
    tok = Tokenizer.from_folder(folder, max_length=None)
    tok.tk.no_truncation()
    seqs = encode_prompts(tok, texts, "{text} It was", 24, 512, "test")
    words = np.array([tok.tk.encode(" tree").ids[0], tok.tk.encode(" sun").ids[0]])
    held = heldout_mask(np.arange(len(texts)), 0, 0.3)
    names = select_trainable(m, "lora", lora_layers=1, seed=seed)
    task = PromptTask(m, seqs, np.array(labels), np.flatnonzero(~held), np.flatnonzero(held),
                      tok.pad_id, 64, words)
    task.label_rows = LabelRows.of_model(m, words, 0.01)
    return m, names, task


def _engine(m, names, seed):
    z = ZoSection()
    return ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=z.eps,
                    run_seed=seed, estimator=z.estimator_name, directions=z.directions,
                    dist=z.dist_name)


def test_exact_label_rows_learn_where_zo_alone_is_slow(llama):
    """The defaults (auto lr, fzoo, the rows' warm-up) for 60 steps on three seeds: with the
    label rows trained the held-out loss falls on every seed, by more than with the rows
    frozen on average."""
    drops = {"exact": [], "frozen": []}
    for seed in range(3):
        for mode in ("exact", "frozen"):
            m, names, task = _prompt_task(llama, seed)
            if mode == "frozen":
                task.label_rows = None
            before = evaluate(task, SoloTopo())[0]
            warm = auto_rows_warmup(60) if mode == "exact" else 0
            train(_engine(m, names, seed), task, Batcher(task.train_rows.size, 16, seed, 0),
                  TrainState(run_seed=seed), LoopConfig(steps=60, lr="auto",
                                                        schedule="cosine", log_every=1000,
                                                        checksum_every=0, rows_warmup=warm))
            drops[mode].append(before - evaluate(task, SoloTopo())[0])
            if mode == "exact":
                assert np.abs(task.label_rows.delta).max() > 0
    ex, fr = np.array(drops["exact"]), np.array(drops["frozen"])
    assert (ex > 0.01).all(), drops
    assert ex.mean() > fr.mean(), drops


@pytest.mark.parametrize("warm,stop", [(0, 9), (6, 2)])
def test_resume_with_label_rows_is_bit_exact(llama, warm, stop):
    """Stopped after step ``stop`` and resumed in a fresh process's objects: the same bits as
    one run; (6, 2): inside the rows' warm-up, the lr scan after the resume."""
    def run(split):
        m, names, task = _prompt_task(llama)
        eng = _engine(m, names, 5)
        b = Batcher(task.train_rows.size, 8, 5, 0)
        cfg = LoopConfig(steps=24, lr="auto", schedule="cosine", history=8, log_every=1000,
                         checksum_every=0, rows_warmup=warm)
        s = TrainState(run_seed=5)
        s.label_rows, s.label_row_ids = task.label_rows.pack(), task.word_ids.copy()
        if split:
            s = train(eng, task, b, s, cfg, stop=StopAt(stop))
            assert s.step == stop + 1
            assert (s.base_lr < 0) == (stop < warm)
            s = TrainState.from_dict(s.to_dict())
            m2, _, task = _prompt_task(llama)           # a fresh process's objects
            for n in names:
                np.copyto(m2.params[n], m.params[n])
            m, eng = m2, _engine(m2, names, 5)
            b = Batcher(task.train_rows.size, 8, 5, 0)
        s = train(eng, task, b, s, cfg)
        return {n: m.params[n].copy() for n in names}, s, task.label_rows.pack()

    a, sa, ra = run(False)
    b, sb, rb = run(True)
    assert all(a[n].tobytes() == b[n].tobytes() for n in a)
    assert ra.tobytes() == rb.tobytes() and np.abs(ra[0]).max() > 0
    da, db = sa.to_dict(), sb.to_dict()
    for k in da:
        assert np.array_equal(da[k], db[k]), k


def test_rows_warmup_trains_the_rows_alone_then_zo(llama):
    """train.label_rows_warmup: its steps cost one forward pass each, move the label rows and
    nothing else, lower the held-out loss by themselves; the lr scan and the ZO updates come
    after them."""
    m, names, task = _prompt_task(llama, 1)
    task.label_rows = LabelRows.of_model(m, task.word_ids, 0.05)
    init = {n: m.params[n].copy() for n in names}
    before = evaluate(task, SoloTopo())[0]
    seen = []

    def on_step(st):
        same = all(np.array_equal(m.params[n], init[n]) for n in names)
        seen.append((st.step, st.forwards, st.base_lr, st.lr, same,
                     float(np.abs(task.label_rows.delta).max()), evaluate(task, SoloTopo())[0]))

    st = train(_engine(m, names, 1), task, Batcher(task.train_rows.size, 16, 1, 0),
               TrainState(run_seed=1), LoopConfig(steps=12, lr="auto", schedule="cosine",
                                                  log_every=1000, checksum_every=0,
                                                  rows_warmup=10), on_step=on_step)
    for step, fw, base, lr, same, moved, _ in seen[:10]:
        assert fw == step and base < 0 and lr == 0.0 and same and moved > 0, seen[step - 1]
    losses = [before] + [x[6] for x in seen[:10]]
    print(losses)
    assert all(b < a for a, b in itertools.pairwise(losses)), losses  # the rows alone learn
    assert losses[-1] < before - 0.01, losses
    step, fw, base, lr, same, _, _ = seen[10]
    assert base > 0 and lr > 0 and not same and fw > 10 + 5    # the scan, then a ZO step
    assert st.step == 12


def test_rows_warmup_resolution():
    d = load(None, ['train.task="prompt"'], check_inputs=False)
    assert label_rows_warmup(d, 200) == 10 and label_rows_warmup(d, 600) == 30
    assert label_rows_warmup(d, 5000) == 50 and label_rows_warmup(d, 3) == 1
    assert label_rows_warmup(d, 0) == 0
    d = load(None, ['train.task="prompt"', "train.label_rows_warmup=7"], check_inputs=False)
    assert label_rows_warmup(d, 200) == 7 and label_rows_warmup(d, 4) == 4
    assert LoopConfig.from_deck(d).rows_warmup == 7
    d = load(None, ['train.task="prompt"', "zo.lr=1e-3"], check_inputs=False)
    assert label_rows_warmup(d, 200) == 0                       # the rows do not train
    with pytest.raises(DeckError, match="train.label_rows_warmup: 7 steps train the label "
                                        "rows alone, but they do not train here"):
        load(None, ['train.task="prompt"', "zo.lr=1e-3", "train.label_rows_warmup=7"],
             check_inputs=False)
    load(None, ['train.task="prompt"', "zo.lr=1e-3", "train.label_rows_warmup=0"],
         check_inputs=False)


def test_deck_mode_and_refusals(tmp_path):
    d = load(None, ['train.task="prompt"'], check_inputs=False)
    assert label_rows_mode(d) == "exact"                       # auto with zo.lr "auto"
    d = load(None, ['train.task="prompt"', "zo.lr=1e-3"], check_inputs=False)
    assert label_rows_mode(d) == "frozen"
    d = load(None, ['train.task="prompt"', "zo.lr=1e-3", 'train.label_rows="exact"'],
             check_inputs=False)
    assert label_rows_mode(d) == "exact"
    assert label_rows_mode(load(None, [], check_inputs=False)) == "frozen"   # task auto
    with pytest.raises(DeckError, match="train.label_rows: \"exact\" trains the label words"):
        load(None, ['train.label_rows="exact"', 'train.task="sft"'], check_inputs=False)
    with pytest.raises(DeckError, match="train.label_rows_lr"):
        load(None, ["train.label_rows_lr=0"], check_inputs=False)
    assert "label_rows" in d.to_toml()


# ----------------------------------------------------------------------------- the run, 2 ranks
@pytest.fixture(scope="module")
def piped(tmp_path_factory, llama):
    from mpiutil import check, mpirun
    from test_llm_pipeline import ENV, _corpus

    tmp = tmp_path_factory.mktemp("lrpipe")
    corpus = _corpus(tmp / "c.jsonl", 160)
    base = ["-m", "semzo", "run", "inputs/llm.toml", "--set", f"corpus.path={corpus}",
            "--set", f"model.path={llama}", "--set", "cluster.k=3",
            "--set", 'corpus.labels=["neg", "pos"]', "--set", 'prompt.template="{text} It was"',
            "--set", 'prompt.label_words=[" bad", " good"]', "--set", "train.lora_layers=1",
            "--set", "train.eval_every=10", "--set", "train.batch_size=8",
            "--set", "model.max_length=24", "--set", "topology.nodes_per_switch=1",
            "--set", "checkpoint.every_steps=10"]
    out = tmp / "out"
    proc = check(mpirun(2, [*base, "--set", f"run.output_dir={out}", "--set", "train.steps=30"],
                        timeout=400, env=ENV))
    return tmp, base, out, proc


def test_run_trains_stores_and_exports_the_label_rows(piped, llama):
    """The LLM deck's defaults at 2 ranks: the rows train (logged), model.h5 and the
    checkpoints hold them, and export writes an untied head whose label rows carry the
    delta; transformers and `semzo generate` compute the same logits from it."""
    import subprocess

    import h5py
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from semzo.generate import load_for_generation

    tmp, _, out, proc = piped
    assert 'train.label_rows = "exact": the 2 label words\' rows' in proc.stderr
    with h5py.File(out / "model.h5") as f:
        d, ids = f[DELTA][()], f[WORD_IDS][()]
    assert d.shape == (2, 32) and np.abs(d).max() > 0 and len(set(ids.tolist())) == 2
    hf = tmp / "hf"
    exp = subprocess.run([sys.executable, "-m", "semzo", "export", str(out / "model.h5"),
                          str(hf)], capture_output=True, text=True, timeout=200, check=False)
    assert exp.returncode == 0, exp.stderr
    ref = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(str(llama), dtype=torch.float32).eval()
    assert not ref.config.tie_word_embeddings
    w, w0 = ref.lm_head.weight.detach().numpy(), base.lm_head.weight.detach().numpy()
    assert np.abs(w[ids] - w0[ids] - d).max() < 1e-6
    assert np.array_equal(np.delete(w, ids, 0), np.delete(w0, ids, 0))
    assert np.array_equal(ref.model.embed_tokens.weight.detach().numpy(),
                          base.model.embed_tokens.weight.detach().numpy())
    x = np.array([[5, 9, 30, 7, 2, 11]])
    g = load_for_generation(str(out / "model.h5"))
    with torch.no_grad():
        theirs = ref(torch.tensor(x)).logits.numpy()
    assert np.abs(g.model.logits(x) - theirs).max() < 1e-4
    best = load_for_generation(str(out / "checkpoints"))       # best.h5: its state's rows
    assert "best.h5" in best.what
    assert not best.model.tied_head


def test_resume_keeps_the_rows_and_refuses_the_other_mode(piped):
    import shutil

    from mpiutil import mpirun
    from test_llm_pipeline import ENV

    tmp, base, out, _ = piped
    other = tmp / "other"
    shutil.copytree(out, other)
    bad = mpirun(2, [*base, "--set", f"run.output_dir={other}", "--set", "train.steps=40",
                     "--set", 'train.label_rows="frozen"', "--set", 'run.stages=["finetune"]',
                     "--resume"], timeout=300, env=ENV)
    errs = [ln for ln in bad.stderr.splitlines() if ln.startswith("error:")]
    assert bad.returncode == 2 and len(errs) == 1, bad.stderr      # one line, every rank
    assert 'written with train.label_rows = "exact", this run\'s is "frozen"' in errs[0]
    ok = mpirun(2, [*base, "--set", f"run.output_dir={other}", "--set", "train.steps=40",
                    "--set", 'run.stages=["finetune"]', "--resume"], timeout=300, env=ENV)
    assert ok.returncode == 0, ok.stderr
    assert "resumed from ckpt-000000030.h5" in ok.stderr


def test_rollback_puts_the_best_models_rows_back():
    """The held-out guard's rollback reads best.h5: the trained label rows (and their Adam
    state) go back with the ZO-trained tensors; the loop then hands them to the task."""
    from types import SimpleNamespace

    from semzo.finetune.stage import _StepSaver

    kept = np.arange(2 * 4 * 3, dtype=np.float64).reshape(4, 2, 3)
    loaded = SimpleNamespace(step=7, params={"w": np.ones(3, np.float32)},
                             state={"label_rows": kept})
    ck = SimpleNamespace(load_best=lambda: loaded)
    w = np.zeros(3, np.float32)
    saver = _StepSaver(ck, SimpleNamespace(params={"w": w}), ["w"], 1, centroids={},
                       topo=SoloTopo())
    got = {}
    eng = SimpleNamespace(reload=lambda arrays: got.update(arrays))
    st = TrainState(best_step=7)
    st.label_rows = np.zeros((4, 2, 3))
    saver.rollback(st, eng)
    assert np.array_equal(got[0], loaded.params["w"])
    assert st.label_rows.tobytes() == kept.tobytes()


def test_step_size_away_from_its_default_is_named_when_unread():
    from semzo.deck.read import unread_keys
    d = load(None, ['train.task="prompt"', "zo.lr=1e-3", "train.label_rows_lr=0.05"],
             check_inputs=False)
    msgs = unread_keys(d)
    assert any("train.label_rows_lr = 0.05 is not read" in m for m in msgs), msgs
    d = load(None, ['train.task="prompt"', "train.label_rows_lr=0.05"], check_inputs=False)
    assert not any("label_rows_lr" in m for m in unread_keys(d))


def _rows_run(xp):
    """Three steps of LabelRows on ``xp`` arrays (the same host numbers); the packed state."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(3, 16)).astype(np.float32)
    lr = LabelRows(xp, xp.asarray(w), [2, 5, 7], 0.02)
    for _ in range(3):
        h = rng.normal(size=(12, 16)).astype(np.float32)
        y = rng.integers(0, 3, 12)
        lr.begin()
        d = lr.delta.get() if hasattr(lr.delta, "get") else lr.delta
        z = (h @ (w + d).T).astype(np.float32)          # the scores: the same host numbers
        lr.add(xp.asarray(h), xp.asarray(z), xp.asarray(y), 2.5)
        assert lr.step(SoloComm(), 0.7)
    return lr.pack()


def test_label_rows_on_cpu_are_deterministic():
    """The harness of the GPU case below, NumPy on both sides."""
    assert _rows_run(np).tobytes() == _rows_run(np).tobytes()


def _gpu_skip():
    sys.path.insert(0, str(Path(__file__).parent / "mpi"))
    from gpu_common import gpu_skip
    return gpu_skip()


@_gpu_skip()
def test_label_rows_on_the_gpu_match_the_cpu():
    """Gradient and Adam on CuPy arrays (the delta on the device, the moments on the host)
    from the same scores against NumPy: the same state to the rounding of float64 exp."""
    from gpu_common import cupy_or_none
    cp = cupy_or_none()
    got, ref = _rows_run(cp), _rows_run(np)
    assert np.abs(got - ref).max() <= 1e-9 * max(1.0, np.abs(ref).max())
