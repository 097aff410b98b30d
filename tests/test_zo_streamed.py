"""The stage API (model.base) and the block-streamed ZO step (zo.schedule = "streamed"):
stage composition equals hidden_states bit for bit, every task's loss_from_state equals its
loss, the streamed step equals the three-pass step bit for bit for every task (tied LM head
included, with a skipped step), the deferred update is flushed before checkpoints and
evaluations (a checkpointed, resumed streamed run equals the uninterrupted three-pass run),
and the simulated host offload gives the same bits."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import CAUSAL, SoloTopo, corpus, make_model

from semzo.finetune.data import Batcher
from semzo.finetune.loop import LoopConfig, TrainState, evaluate, train
from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.model.kernels import set_threads
from semzo.preflight import heldout_mask
from semzo.tasks.base import pad_batch
from semzo.tasks.classify import ClassifyTask, FeatureClassifyTask, PrefixCachedClassifyTask
from semzo.tasks.lm import LMTask
from semzo.zo import kernels
from semzo.zo.engine import ZOEngine
from semzo.zo.offload import HostStore
from semzo.zo.perturb import Pending, ZTensor, apply_then_perturb, perturb, restore_update, ztensors
from semzo.zo.streamed import stage_groups, step_streamed

EPS, LR, WD = 1e-3, 2e-2, 0.05


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("streamed")
    return {k: make_model(tmp / k, kind=k) for k in ("bert", "gpt2", *CAUSAL)}


def _data(folder, n=64):
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(n)
    seqs = tok.encode_batch([r["text"] for r in recs])
    labels = np.array([int(r["label"][-1]) for r in recs])
    held = heldout_mask(np.arange(n), 0, 0.25)
    return tok, seqs, labels, np.flatnonzero(~held), np.flatnonzero(held)


def _setup(folders, kind, task_kind, params="all", **kw):
    f = folders["gpt2" if task_kind == "lm" and kind not in CAUSAL else kind]
    m = load_model(f)
    tok, seqs, labels, tr, he = _data(f)
    if task_kind == "lm":
        task = LMTask(m, seqs, labels, tr, he, tok.pad_id, 16)
    else:
        m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, params, **kw)
    if task_kind == "classify":
        task = ClassifyTask(m, seqs, labels, tr, he, tok.pad_id, 16)
    elif task_kind == "features":
        feats = np.stack([m.pooled(*pad_batch([s], tok.pad_id))[0] for s in seqs])
        task = FeatureClassifyTask(m, feats, labels, tr, he, 16)
    elif task_kind == "prefix":
        task = PrefixCachedClassifyTask(m, seqs, labels, tr, he, tok.pad_id, 16,
                                        m.config.num_layers - kw.get("last_layers", 1))
    return m, names, task


# ----------------------------------------------------------------------------- stage API
@pytest.mark.parametrize("kind", ["bert", "gpt2"])
@pytest.mark.parametrize("threads", [1, 2])
def test_stage_composition_equals_hidden_states(folders, kind, threads):
    m = load_model(folders[kind])
    m.add_lora(rank=2, seed=1)
    for spec in m.lora.values():                      # non-zero B: the deltas count
        m.params[spec.b][...] = 0.01
    tok, seqs, *_ = _data(folders[kind])
    ids, mask = pad_batch(seqs[:40], tok.pad_id)      # 40 x T > 256 tokens: rows split
    if hasattr(m, "group_tokens"):                    # the decoder: groups of ~128 tokens
        m.group_tokens = 128
    set_threads(threads)
    try:
        st = m.stage_start(ids, mask)
        assert len(st.slices) == threads
        want = m.hidden_states(ids, mask)
        for k in range(m.n_stages):
            m.stage_forward(k, st)
        assert st.hidden.tobytes() == want.tobytes()
        with pytest.raises(ValueError, match="next stage"):
            m.stage_forward(1, m.stage_start(ids, mask))
    finally:
        set_threads(1)


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_stage_names_partition_the_parameters(folders, kind):
    m = load_model(folders[kind])
    m.add_classifier(3)
    m.add_lora(rank=2)
    L = m.config.num_layers
    assert m.n_stages == L + 2
    seen = [n for k in range(m.n_stages) for n in m.stage_names(k)]
    assert sorted(seen) == sorted(m.params) and len(seen) == len(set(seen))
    last = m.stage_names(L + 1)
    assert "classifier.weight" in last and "classifier.bias" in last
    for spec_mod, spec in m.lora.items():
        k = m.stage_of(spec.a)
        assert 1 <= k <= L and k == m.stage_of(m.weight_name(spec_mod)) == m.stage_of(spec.b)
    assert m.tied_head == (kind == "gpt2")
    if kind == "gpt2":
        assert set(m.stage_names(0)) == {"wte.weight", "wpe.weight"}
        assert {"ln_f.weight", "ln_f.bias"} <= set(last)
    else:
        assert all(n.startswith("embeddings.") for n in m.stage_names(0))


def test_prefix_state_equals_hidden_from(folders):
    m = load_model(folders["bert"])
    tok, seqs, *_ = _data(folders["bert"])
    ids, mask = pad_batch(seqs[:20], tok.pad_id)
    x = m.hidden_at(ids, mask, 1)
    st = m.stage_start_from(x, mask, 1)
    for k in range(2, m.n_stages):
        m.stage_forward(k, st)
    assert st.hidden.tobytes() == m.hidden_from(x, mask, 1).tobytes()


# ----------------------------------------------------------------------------- tasks
TASKS = [("bert", "classify", "all", {}), ("gpt2", "lm", "all", {}),
         ("bert", "features", "head+last", {"last_layers": 0}),
         ("bert", "prefix", "head+last", {"last_layers": 1}),
         ("bert", "classify", "lora", {"lora_rank": 2}),
         # CausalLM decoders (Llama with GQA, untied and tied heads; OPT, tied)
         ("llama", "lm", "all", {}), ("llama_tied", "lm", "all", {}), ("opt", "lm", "all", {}),
         ("llama_tied", "lm", "lora", {"lora_rank": 2})]
_IDS = [f"{t[0]}-{t[1]}-{t[2]}" if t[0] in CAUSAL else f"{t[1]}-{t[2]}" for t in TASKS]


@pytest.mark.parametrize("kind,task_kind,params,kw", TASKS,
                         ids=_IDS)
def test_loss_from_state_equals_loss(folders, kind, task_kind, params, kw):
    _, names, task = _setup(folders, kind, task_kind, params, **kw)
    batch = task.batch(np.arange(12))
    st = task.stage_begin(batch)
    for k in range(task.stage_count()):
        st = task.stage_run(k, st)
    assert task.loss_from_state(st, batch) == task.loss(batch)
    stage_of = {n: k for k in range(task.stage_count()) for n in task.stage_params(k)}
    assert set(names) <= set(stage_of)


@pytest.mark.parametrize("kind,task_kind,params,kw", TASKS,
                         ids=_IDS)
def test_offloaded_evaluation_streams_the_stages(folders, kind, task_kind, params, kw):
    """zo.offload = "host": the held-out evaluation runs each batch stage by stage through the
    store (on a GPU the model's parameters are host arrays between stages, so a plain forward
    would fail there): the same (loss, accuracy, count) bit for bit as the resident
    evaluation, every stage uploaded once per batch, nothing left on the device."""
    m, names, task = _setup(folders, kind, task_kind, params, **kw)
    rows = task.eval_batches[0]
    b = task.eval_inputs(rows)
    st = task.stage_begin(b)
    for k in range(task.stage_count()):
        st = task.stage_run(k, st)
    assert task.score_from_state(st, b) == tuple(task.eval_batch(rows))
    want = evaluate(task, SoloTopo())
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, run_seed=3, schedule="streamed")
    assert evaluate(task, SoloTopo(), eng.store) == want          # resident store: as before
    eng.store = st = HostStore(m, task, eng)
    got = evaluate(task, SoloTopo(), st)
    assert got == want and want[2] > 0
    assert st.uploads == task.stage_count() * len(task.eval_batches)
    assert not st.on_device
    for nm, a in st.host.items():
        assert m.params[nm] is a


def _run(folders, kind, task_kind, params, kw, schedule, *, offload=False, dist="gaussian",
         steps=4, nan_at=2):
    m, names, task = _setup(folders, kind, task_kind, params, **kw)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, dist=dist, run_seed=3, schedule=schedule)
    if offload:
        eng.store = HostStore(m, task, eng)
    eng.loss_hook = lambda s, x: math.nan if s == nan_at else x
    res = []
    for s in range(steps):
        b = task.batch(np.arange(8 * s, 8 * s + 8) % len(task.train_rows))
        r = (step_streamed(eng, task, b, s, LR, 8) if schedule == "streamed"
             else eng.step(lambda b=b: task.loss(b), s, LR, 8))
        res.append((r.lp, r.lm, r.g if r.ok else 0.0, r.ok))
    eng.flush()
    return np.array(res, np.float64), {n: a.copy() for n, a in m.params.items()}, eng


@pytest.mark.parametrize("kind,task_kind,params,kw", TASKS,
                         ids=_IDS)
def test_streamed_equals_three_pass(folders, kind, task_kind, params, kw):
    ref, pref, _ = _run(folders, kind, task_kind, params, kw, "three-pass")
    got, pgot, eng = _run(folders, kind, task_kind, params, kw, "streamed")
    assert got.tobytes() == ref.tobytes()
    assert not ref[2, 3] and ref[3, 3]                # step 2 skipped, step 3 not
    for n in pref:
        assert pgot[n].tobytes() == pref[n].tobytes(), n
    assert eng.pending is None


def test_streamed_equals_three_pass_gaussian_fast(folders):
    ref, pref, _ = _run(folders, "bert", "classify", "all", {}, "three-pass",
                        dist="gaussian-fast")
    got, pgot, _ = _run(folders, "bert", "classify", "all", {}, "streamed",
                          dist="gaussian-fast")
    gau, _, _ = _run(folders, "bert", "classify", "all", {}, "streamed")
    assert got.tobytes() == ref.tobytes()
    for n in pref:
        assert pgot[n].tobytes() == pref[n].tobytes(), n
    assert got.tobytes() != gau.tobytes()            # a different stream than "gaussian"


@pytest.mark.parametrize("kind,task_kind,params", [
    ("bert", "classify", "all"), ("gpt2", "lm", "all"), ("llama", "lm", "all"),
    ("llama_tied", "lm", "all"), ("llama_tied", "lm", "lora")])
def test_simulated_offload_bit_identical(folders, kind, task_kind, params):
    kw = {"lora_rank": 2} if params == "lora" else {}
    ref, pref, _ = _run(folders, kind, task_kind, params, kw, "streamed", dist="rademacher")
    got, pgot, eng = _run(folders, kind, task_kind, params, kw, "streamed", offload=True,
                          dist="rademacher")
    assert got.tobytes() == ref.tobytes()
    for n in pref:
        assert pgot[n].tobytes() == pref[n].tobytes(), n
    st = eng.store
    n = st.n
    # untied: one upload per stage and step; tied (gpt2): blocks go up twice (+ then -);
    # a tied head whose embedding matrix does not train (LoRA) takes the untied path
    tied = st.task.tied_head and params == "all"
    want = 4 * (1 + 2 * (n - 1)) if tied else 4 * n
    assert st.task.tied_head == (kind in ("gpt2", "llama_tied"))
    assert st.uploads == want, (st.uploads, want)
    assert not st.on_device
    # the model points at the host arrays again, the device slots are separate memory
    for nm, a in st.host.items():
        assert eng.store.model.params[nm] is a
    assert 0 < st.device_bytes() < 2 * sum(a.nbytes for a in st.host.values())


def test_gpu_copies_are_queued_without_a_host_wait():
    """On a GPU a stage's write-back is queued on the copy stream with no host wait: CuPy's
    get() blocks by default, which would hold the host until the stage's - branch and copy are
    done, so it could not queue the next stage meanwhile. (A stand-in array records the calls.)
    """
    calls = []

    class Dev:
        def get(self, **kw):
            calls.append(("get", kw))

        def set(self, src, **kw):
            calls.append(("set", src, kw))

    st = HostStore.__new__(HostStore)
    st.gpu, st.up, st.down = True, "up-stream", "down-stream"
    host = np.empty(3, np.float32)
    st._copy_out(host, Dev())
    st._copy_in(Dev(), host)
    (_, kw), (_, src, kw2) = calls
    assert kw["out"] is host and kw["stream"] == "down-stream" and kw["blocking"] is False
    assert src is host and kw2 == {"stream": "up-stream"}


def test_pending_update_and_flush(folders):
    """Before flush the parameters hold the - eps state; flush applies exactly the update the
    three-pass step applied; a second flush changes nothing."""
    _, pref, _ = _run(folders, "bert", "classify", "all", {}, "three-pass", steps=1)
    m, names, task = _setup(folders, "bert", "classify", "all")
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, run_seed=3, schedule="streamed")
    step_streamed(eng, task, task.batch(np.arange(8)), 0, LR, 8)
    assert eng.pending is not None and eng.pending.kind == "restore_update"
    assert m.params["classifier.weight"].tobytes() != pref["classifier.weight"].tobytes()
    eng.flush()
    snap = {n: a.copy() for n, a in m.params.items()}
    eng.flush()
    for n in names:
        assert m.params[n].tobytes() == pref[n].tobytes() == snap[n].tobytes(), n


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("kind", ["restore_update", "perturb", "multi_restore", "multi"])
def test_fused_first_pass_equals_two_passes(dtype, kind):
    r = np.random.default_rng(0)
    a = r.normal(0, 0.1, 20000).astype(dtype)
    op = Pending(kind, 77, 1e-2, 0.1, 0.3, 0.05, (5, 6), (0.2, -0.4))
    x, y = a.copy(), a.copy()
    apply_then_perturb([(9, x)], op, 1234, 1e-2)
    if kind == "restore_update":
        restore_update([(9, y)], 77, 1e-2, 0.1, 0.3, 0.05)
    elif kind == "perturb":
        perturb([(9, y)], 77, 1e-2)
    else:
        from semzo.zo.perturb import multi_update
        multi_update([(9, y)], (5, 6), (0.2, -0.4), 0.1, 0.05, eps=1e-2,
                     restore_seed=77 if kind == "multi_restore" else None)
    perturb([(9, y)], 1234, 1e-2)
    assert x.tobytes() == y.tobytes()
    # into a destination (restore = "copy"): the source keeps the op's result
    s, d = a.copy(), np.empty_like(a)
    apply_then_perturb([(9, s)], op, 1234, 1e-2, dst=[d])
    assert d.tobytes() == y.tobytes() and s.tobytes() != d.tobytes()


@pytest.mark.parametrize("kind", ["restore_update", "perturb", "multi_restore", "multi"])
def test_fused_first_pass_equals_two_passes_gaussian_fast(kind):
    from semzo.zo.perturb import multi_update
    r = np.random.default_rng(1)
    a = r.normal(0, 0.1, 5000).astype(np.float32)
    op = Pending(kind, 77, 1e-2, 0.1, 0.3, 0.05, (5, 6), (0.2, -0.4))
    x, y = a.copy(), a.copy()
    ent = [ZTensor(9, x, 700)]                         # an offset inside a super-block
    apply_then_perturb(ent, op, 1234, 1e-2, dist="gaussian-fast")
    yy = [ZTensor(9, y, 700)]
    if kind == "restore_update":
        restore_update(yy, 77, 1e-2, 0.1, 0.3, 0.05, dist="gaussian-fast")
    elif kind == "perturb":
        perturb(yy, 77, 1e-2, dist="gaussian-fast")
    else:
        multi_update(yy, (5, 6), (0.2, -0.4), 0.1, 0.05, eps=1e-2, dist="gaussian-fast",
                     restore_seed=77 if kind == "multi_restore" else None)
    perturb(yy, 1234, 1e-2, dist="gaussian-fast")
    assert x.tobytes() == y.tobytes() and x.tobytes() != a.tobytes()


def test_plain_pass_is_an_rmw_without_z():
    a = np.arange(10000, dtype=np.float32)
    kernels.run_pass([(a, 0, 1, 0.0)], kernels.PLAIN, 0, 0, 0, a=1.0)
    assert np.array_equal(a, np.arange(10000, dtype=np.float32) + 1)


# ----------------------------------------------------------------------------- the loop
def _loop(folders, schedule, steps, state=None, params=None, ckpt_at=(), evals=None):
    m, names, task = _setup(folders, "bert", "classify", "all")
    if params is not None:
        for n in names:
            np.copyto(m.params[n], params[n])
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, run_seed=9, schedule=schedule)
    saved = {}

    def on_step(st):                      # what finetune's checkpoint hook does
        if st.step in ckpt_at:
            eng.flush()
            saved[st.step] = ({n: m.params[n].copy() for n in names}, st.to_dict())
    rows = []
    cfg = LoopConfig(steps=steps, lr=LR, eval_every=2, log_every=100, checksum_every=0)
    st = train(eng, task, Batcher(len(task.train_rows), 8, 9, 0), state or TrainState(run_seed=9),
               cfg, on_row=rows.append, on_step=on_step)
    assert eng.pending is None                      # train() ends flushed (final checksum)
    return {n: m.params[n].copy() for n in names}, rows, saved, st


def test_checkpoint_resume_eval_equal_three_pass(folders):
    ref, ref_rows, _, _ = _loop(folders, "three-pass", 6)
    full, rows, saved, _ = _loop(folders, "streamed", 6, ckpt_at=(3,))
    params3, state3 = saved[3]
    resumed, rows2, _, _ = _loop(folders, "streamed", 6, state=TrainState.from_dict(state3),
                                 params=params3)
    for n in ref:
        assert full[n].tobytes() == ref[n].tobytes() == resumed[n].tobytes(), n
    ev = [(r["step"], r["heldout_loss"], r["heldout_acc"]) for r in rows if r["kind"] == "eval"]
    ev_ref = [(r["step"], r["heldout_loss"], r["heldout_acc"]) for r in ref_rows
              if r["kind"] == "eval"]
    assert ev == ev_ref and len(ev) == 2            # evaluations saw the updated model
    tr = [(r["step"], r["loss"], r["g"]) for r in rows + rows2 if r["kind"] == "train"]
    tr_ref = [(r["step"], r["loss"], r["g"]) for r in ref_rows if r["kind"] == "train"]
    assert sorted(set(tr)) == sorted(tr_ref)


# ----------------------------------------------------------------------------- z cache
@pytest.mark.parametrize("dist", ["gaussian", "gaussian-fast", "rademacher"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bfloat16"])
def test_cached_z_gives_the_bits_of_regenerated_z(dist, dtype):
    """Pass 1 with a z cache stores exactly z (zvec's float32 values), and pass 2 reading it
    equals pass 2 generating it, for every distribution and storage."""
    from semzo.model.storage import to_bits
    from semzo.zo.perturb import perturb_cached, zvec

    r = np.random.default_rng(2)
    a = r.normal(0, 0.1, 70001)
    a = to_bits(a) if dtype == "bfloat16" else a.astype(dtype)      # uint16: bfloat16 bits
    op = Pending("restore_update", 77, 1e-2, 0.1, 0.3, 0.05)
    x, y = a.copy(), a.copy()
    zb = np.full(a.size, np.nan, np.float32)
    tx, ty = ZTensor(9, x, 300, True), ZTensor(9, y, 300, True)
    apply_then_perturb([tx], op, 1234, 1e-2, dist=dist, zcache=[zb])
    apply_then_perturb([ty], op, 1234, 1e-2, dist=dist)
    assert x.tobytes() == y.tobytes()
    assert zb.tobytes() == zvec(1234, 9, 300, a.size, dist=dist).tobytes()
    perturb_cached([tx], [zb], -2e-2)
    perturb([ty], 1234, -2e-2, dist=dist)
    assert x.tobytes() == y.tobytes() and x.tobytes() != a.tobytes()


def test_z_buffers_are_checked():
    from semzo.zo.perturb import perturb_cached
    a = np.zeros(100, np.float32)
    with pytest.raises(ValueError, match="needs a z buffer"):
        kernels.run_pass([(a, 0, 1, 0.0)], kernels.CACHED, 0, 0, 0, a=1.0)
    for bad in (np.zeros(100, np.float64), np.zeros(99, np.float32),
                np.zeros(200, np.float32)[::2]):
        with pytest.raises(ValueError, match="z buffer must be"):
            perturb_cached([(1, a)], [bad], 1.0)
    with pytest.raises(ValueError, match="share memory"):
        perturb_cached([(1, a)], [a], 1.0)
    with pytest.raises(ValueError, match="zcache takes"):
        apply_then_perturb([(1, a)], Pending(), None, zcache=[np.zeros(100, np.float32)])


def test_zcache_holds_one_block():
    from semzo.zo.streamed import ZCache

    # embeddings larger than a block: regenerated; blocks and a small head: cached
    c = ZCache([500, 40, 40, 10], tied=False)
    assert c.stages == {1, 2, 3} and c.elements == 40
    # a tied head: stage 0's pass 2 comes late, never cached even when small
    c = ZCache([30, 40, 40, 10], tied=True)
    assert c.stages == {1, 2, 3}
    c = ZCache([30, 40, 40, 10], tied=False)
    assert c.stages == {0, 1, 2, 3}
    # LoRA-like: nothing in stage 0 or the head; two stages only: the smaller one
    assert ZCache([0, 4, 4, 0], tied=False).stages == {1, 2}
    assert ZCache([50, 7], tied=False).stages == {1}
    assert ZCache([0, 0], tied=False).elements == 0


@pytest.mark.parametrize("kind,task_kind,params", [
    ("bert", "classify", "all"), ("llama_tied", "lm", "all")])
def test_z_cache_on_and_off_give_the_same_bits(folders, kind, task_kind, params,
                                               monkeypatch):
    """The streamed step with and without the z cache (and the three-pass step) agree bit
    for bit, the cache is used for the blocks, and its buffer holds one stage."""
    import semzo.zo.streamed as S

    calls = []
    real = S.perturb_cached
    monkeypatch.setattr(S, "perturb_cached", lambda *a, **k: (calls.append(1), real(*a, **k)))
    got, pgot, eng = _run(folders, kind, task_kind, params, {}, "streamed")
    n_stages = len(stage_groups(eng, eng._zcache[0]))
    assert len(calls) >= 4 * (n_stages - 2)           # every block, every step
    cache = eng._zcache[1]
    sizes = [sum(eng.tensors[i].array.size for i in g)
             for g in stage_groups(eng, eng._zcache[0])]
    assert cache.elements == max(sizes[1:-1]) < sum(sizes)
    tied = kind == "llama_tied"
    assert (0 in cache.stages) == (not tied and sizes[0] <= max(sizes[1:-1]))
    assert set(range(1, len(sizes))) <= cache.stages
    calls.clear()
    m, names, task = _setup(folders, kind, task_kind, params)
    eng2 = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                    weight_decay=WD, run_seed=3, schedule="streamed", cache_z=False)
    eng2.loss_hook = lambda s, x: math.nan if s == 2 else x
    res = []
    for s in range(4):
        b = task.batch(np.arange(8 * s, 8 * s + 8) % len(task.train_rows))
        r = step_streamed(eng2, task, b, s, LR, 8)
        res.append((r.lp, r.lm, r.g if r.ok else 0.0, r.ok))
    eng2.flush()
    assert not calls
    assert np.array(res, np.float64).tobytes() == got.tobytes()
    for n in names:
        assert m.params[n].tobytes() == pgot[n].tobytes(), n


@pytest.mark.parametrize("kind,task_kind", [("bert", "classify"), ("llama_tied", "lm")])
def test_simulated_offload_with_the_z_cache_bit_identical(folders, kind, task_kind):
    """Gaussian z: the cache serves the device copies of the simulated offload too."""
    ref, pref, _ = _run(folders, kind, task_kind, "all", {}, "streamed")
    got, pgot, eng = _run(folders, kind, task_kind, "all", {}, "streamed", offload=True)
    assert got.tobytes() == ref.tobytes()
    for n in pref:
        assert pgot[n].tobytes() == pref[n].tobytes(), n
    assert eng._zcache[1].stages and eng._zcache[1]._buf is not None


# ----------------------------------------------------------------------------- deferred rows
def _separate_row_passes(a, code, op, post_seed, dist):
    """The reference of apply_rows, by separate whole passes on copies of each row."""
    from semzo.zo.perturb import multi_update
    out = a.copy()
    for r in range(a.shape[0]):
        row = [ZTensor(9, out[r].copy(), r * a.shape[1], True)]
        if code[r] & kernels.PRE:
            perturb(row, op.seed, op.eps, dist=dist)
            perturb(row, op.seed, -2.0 * op.eps, dist=dist)
        if op.kind == "restore_update":
            restore_update(row, op.seed, op.eps, op.lr, op.g, op.wd, dist=dist)
        elif op.kind == "perturb":
            perturb(row, op.seed, op.eps, dist=dist)
        else:
            multi_update(row, op.seeds, op.gs, op.lr, op.wd, eps=op.eps, dist=dist,
                         restore_seed=op.seed)
        if code[r] & kernels.POST:
            perturb(row, post_seed, 1e-2, dist=dist)
        out[r] = row[0].array
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64, "bf16"])
@pytest.mark.parametrize("kind", ["restore_update", "perturb", "multi_restore"])
@pytest.mark.parametrize("dist", ["gaussian", "rademacher", "gaussian-fast"])
def test_row_pass_equals_separate_passes(dtype, kind, dist):
    """apply_rows: per row, the deferred + eps and - 2 eps (PRE), the pending operation and
    the new + eps z (POST) in one pass equal the separate passes bit for bit; the z it stores
    for POST rows is that z, and perturb_rows (regenerated or from that z) touches only the
    rows it is given."""
    from semzo.model.storage import to_bits
    from semzo.zo.perturb import apply_rows, perturb_rows

    r = np.random.default_rng(2)
    rows, width = 37, 300                      # rows start inside Philox blocks
    a = r.normal(0, 0.1, (rows, width)).astype(np.float32)
    a = to_bits(a) if dtype == "bf16" else a.astype(dtype)
    code = r.integers(0, 4, rows).astype(np.uint8)
    code[:3], code[-3:] = 3, 0                 # runs of equal classes, both ends covered
    op = Pending(kind, 77, 1e-2, 0.1, 0.3, 0.05, (5, 6) if kind.startswith("multi") else (),
                 (0.2, -0.4) if kind.startswith("multi") else ())
    want = _separate_row_passes(a, code, op, 1234, dist)
    got = a.copy()
    zc = np.full(a.size, np.nan, np.float32)
    for th in (1, 2):
        got = a.copy()
        apply_rows(ZTensor(9, got), code, op, 1234, 1e-2, pre=op.eps, dist=dist, threads=th,
                   zcache=zc)
        assert got.tobytes() == want.tobytes(), th
    post = (code & kernels.POST) != 0
    from semzo.zo.perturb import zvec
    zfull = zvec(1234, 9, 0, a.size, dist).reshape(rows, width)
    zc2 = zc.reshape(rows, width)
    assert zc2[post].tobytes() == zfull[post].tobytes() and np.isnan(zc2[~post]).all()
    # pass 2 on the POST rows only, regenerated and from the stored z
    x, y = got.copy(), got.copy()
    perturb_rows(ZTensor(9, x), post, 1234, -2e-2, dist=dist)
    perturb_rows(ZTensor(9, y), post, 1234, -2e-2, dist=dist, zcache=zc)
    ref = got.copy()
    for i in np.flatnonzero(post):
        row = [ZTensor(9, ref[i].copy(), i * width)]
        perturb(row, 1234, -2e-2, dist=dist)
        ref[i] = row[0].array
    assert x.tobytes() == y.tobytes() == ref.tobytes()
    assert x[~post].tobytes() == got[~post].tobytes()


def test_row_pass_refuses_bad_spans_and_codes():
    from semzo.zo.perturb import apply_rows
    a = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="spans must be"):
        kernels.run_spans(a.reshape(-1), 0, 1, 0.0, np.array([0, 4]), np.array([8, 8]),
                          np.zeros(2, np.uint8), kernels.PERTURB, 0, 1, 2, a=1.0)
    with pytest.raises(ValueError, match="spans must be"):
        kernels.run_spans(a.reshape(-1), 0, 1, 0.0, np.array([30]), np.array([8]),
                          np.zeros(1, np.uint8), kernels.PERTURB, 0, 1, 2, a=1.0)
    with pytest.raises(ValueError, match="own z"):
        apply_rows(ZTensor(1, a), np.full(4, kernels.PRE, np.uint8), Pending(), None)
    with pytest.raises(ValueError, match="one code per row"):
        apply_rows(ZTensor(1, a), np.zeros(3, np.uint8), Pending("perturb", 1, 1.0), None)
    assert not a.any()


@pytest.mark.parametrize("sizes", [[5], [40000, 3, 384, 384, 100000, 7], [32768] * 3,
                                   [384] * 500 + [1 << 20] + [384] * 500])
def test_task_plan_covers_every_element_once_in_balanced_tasks(sizes):
    """The parallel tasks cover each tensor's elements exactly once, in order, and hold
    about CHUNK elements each whatever the tensor sizes (numba splits the tasks statically)."""
    tstart, pj, pc0, pm = kernels.task_plan(np.array(sizes))
    assert tstart[0] == 0 and tstart[-1] == pj.size and (np.diff(tstart) > 0).all()
    for j, n in enumerate(sizes):
        q = pj == j
        assert pc0[q][0] == 0 and (pc0[q][1:] == (pc0[q] + pm[q])[:-1]).all()
        assert (pc0[q] + pm[q])[-1] == n and (pm[q] > 0).all() and (pm[q] <= kernels.CHUNK).all()
    # task c starts at element c * CHUNK of all tensors together, give or take one CHUNK:
    # splitting the tasks by count splits the elements to within a CHUNK
    first = np.concatenate(([0], np.cumsum(pm)))[tstart[:-1]]
    c = np.arange(first.size) * kernels.CHUNK
    assert ((first >= c) & (first < c + kernels.CHUNK)).all()
    assert first.size == -(-sum(sizes) // kernels.CHUNK)


def test_rows_the_batch_does_not_read_are_deferred(folders):
    """The streamed step defers the perturbation of the token-embedding rows a batch does
    not read: after step s those rows hold the three-pass parameters after s steps (no
    + eps, no - 2 eps yet); the rows it reads hold theta - eps z; the flush (and the next
    step's first pass) then give the three-pass bits."""
    name = "embeddings.word_embeddings.weight"
    m, names, task = _setup(folders, "bert", "classify", "all")
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, run_seed=3, schedule="streamed")
    for s in range(3):
        b = task.batch(np.arange(8 * s, 8 * s + 8) % len(task.train_rows))
        step_streamed(eng, task, b, s, LR, 8)
        read = np.zeros(m.params[name].shape[0], bool)
        read[np.unique(b[0])] = True
        assert 0 < read.sum() < read.size
        i = names.index(name)
        assert eng.owed[i].tobytes() == (~read).tobytes()
        _, before, _ = _run(folders, "bert", "classify", "all", {}, "three-pass", steps=s,
                            nan_at=-1)
        _, after, _ = _run(folders, "bert", "classify", "all", {}, "three-pass", steps=s + 1,
                           nan_at=-1)
        e = m.params[name]
        assert e[~read].tobytes() == before[name][~read].tobytes()
        assert (e[read] != before[name][read]).any()
    eng.flush()
    assert not eng.owed and m.params[name].tobytes() == after[name].tobytes()
    for n in names:
        assert m.params[n].tobytes() == after[n].tobytes(), n


def test_no_rows_are_deferred_with_a_tied_head_or_a_reference_copy(folders):
    m, names, task = _setup(folders, "gpt2", "lm", "all")
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   run_seed=3, schedule="streamed")
    from semzo.zo.streamed import lazy_rows
    b = task.batch(np.arange(8))
    assert task.tied_head and lazy_rows(eng, task, b) == {}
    m, names, task = _setup(folders, "bert", "classify", "all")
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   run_seed=3, schedule="streamed")
    b = task.batch(np.arange(8))
    got = lazy_rows(eng, task, b)
    assert list(got) == [names.index("embeddings.word_embeddings.weight")]
    eng.copy = True                            # zo.restore = "copy" with several groups
    assert lazy_rows(eng, task, b) == {}
    empty = task.batch(np.arange(0))
    eng.copy = False
    assert not next(iter(lazy_rows(eng, task, empty).values())).any()


def test_deferred_rows_survive_a_step_that_defers_none(folders):
    """Rows owed from one step are completed by the next step's first pass even when that
    step defers nothing (deferral switched off between steps, no flush): the bits stay the
    three-pass step's."""
    _, want, _ = _run(folders, "bert", "classify", "all", {}, "three-pass", steps=4, nan_at=-1)
    m, names, task = _setup(folders, "bert", "classify", "all")
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=EPS,
                   weight_decay=WD, run_seed=3, schedule="streamed")
    for s in range(4):
        eng.defer_rows = s % 2 == 0
        b = task.batch(np.arange(8 * s, 8 * s + 8) % len(task.train_rows))
        step_streamed(eng, task, b, s, LR, 8)
        assert bool(eng.owed) == (s % 2 == 0)
    eng.flush()
    for n in names:
        assert m.params[n].tobytes() == want[n].tobytes(), n
