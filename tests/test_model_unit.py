"""semzo.model without torch: kernels, parameter contract, heads, LoRA, tokenizer, errors.

The packaged all-MiniLM-L6-v2 is the real model of most tests; the decoder tests use a tiny
random GPT-2 written as a Hugging Face folder by hand (config.json + model.safetensors).
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from semzo.model import (
    CausalLM,
    Encoder,
    Tokenizer,
    embed_ids,
    embed_texts,
    export_hf,
    is_no_decay,
    length_batches,
    load_model,
)
from semzo.model import kernels as K
from semzo.runtime import SemzoError

DATA = Path(__file__).parent / "data"
SENTENCES = (DATA / "model_sentences.txt").read_text(encoding="utf-8").splitlines()


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def minilm():
    return load_model()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder()


def tiny_gpt2(folder: Path, seed: int = 0, prefix: str = "", vocab: int = 97, h: int = 32,
              layers: int = 2, heads: int = 4, positions: int = 40) -> Path:
    """A random GPT-2 in Hugging Face layout (Conv1D weights (in, out))."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
           "n_embd": h, "n_layer": layers, "n_head": heads, "n_positions": positions,
           "layer_norm_epsilon": 1e-5, "activation_function": "gelu_new"}
    (folder / "config.json").write_text(json.dumps(cfg))

    def r(*shape, s=0.2):
        return (rng.standard_normal(shape) * s).astype(np.float32)
    t = {f"{prefix}wte.weight": r(vocab, h), f"{prefix}wpe.weight": r(positions, h),
         f"{prefix}ln_f.weight": 1 + r(h), f"{prefix}ln_f.bias": r(h)}
    for i in range(layers):
        p = f"{prefix}h.{i}."
        t.update({p + "ln_1.weight": 1 + r(h), p + "ln_1.bias": r(h),
                  p + "attn.c_attn.weight": r(h, 3 * h), p + "attn.c_attn.bias": r(3 * h),
                  p + "attn.c_proj.weight": r(h, h), p + "attn.c_proj.bias": r(h),
                  p + "ln_2.weight": 1 + r(h), p + "ln_2.bias": r(h),
                  p + "mlp.c_fc.weight": r(h, 4 * h), p + "mlp.c_fc.bias": r(4 * h),
                  p + "mlp.c_proj.weight": r(4 * h, h), p + "mlp.c_proj.bias": r(h)})
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# ----------------------------------------------------------------------------- kernels

def test_fast_exp_erf_gelu_accuracy():
    x = np.linspace(-30, 30, 100_001).astype(np.float32)
    ref = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x.astype(np.float64)])
    g = np.ascontiguousarray(x.reshape(1, -1).copy())
    K.bias_act(g, np.zeros(g.shape[1], np.float32), "gelu")
    assert np.max(np.abs(g[0] - ref)) < 1e-5 * 30
    assert np.max(np.abs(g[0] - ref)[np.abs(x) < 3]) < 1e-6
    # tanh form against numpy's tanh
    t = x.reshape(1, -1).copy()
    K.bias_act(t, np.zeros(t.shape[1], np.float32), "gelu_new")
    x64 = x.astype(np.float64)
    reft = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    assert np.max(np.abs(t[0] - reft) / np.maximum(np.abs(reft), 1)) < 1e-6
    # generic (xp) erf path agrees with the numba one
    assert np.max(np.abs(K._xp_erf(np, x) - np.array([math.erf(v) for v in x64]))) < 5e-7


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "relu"])
def test_gated_kernel_values_and_a_nan_gate(act):
    """The gated MLP kernel against float64 references (biases included), and a NaN or inf
    gate gives NaN/inf outputs, never an exception: under Numba's Python error model the
    GELU kernel raised ZeroDivisionError on a NaN gate (a diverged model must reach the
    loss as NaN, which the training loop skips)."""
    from semzo.model.kernels_lm import gated_act
    rng = np.random.default_rng(3)
    n, m = 5, 37                                  # odd widths: the loops' vector tails
    gu = (rng.standard_normal((n, 2 * m)) * 3).astype(np.float32)
    bg, bu = (rng.standard_normal(m).astype(np.float32) for _ in range(2))
    g64 = gu[:, :m].astype(np.float64) + bg
    u64 = gu[:, m:].astype(np.float64) + bu
    act64 = {"silu": lambda x: x / (1 + np.exp(-x)),
             "gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
             "gelu_pytorch_tanh": lambda x: 0.5 * x * (1 + np.tanh(
                 math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
             "relu": lambda x: np.maximum(x, 0)}[act]
    ref = act64(g64) * u64
    out = np.empty((n, m), np.float32)
    gated_act(gu.copy(), bg, bu, act, out)
    assert np.max(np.abs(out - ref) / np.maximum(np.abs(ref), 1)) < 5e-6
    bad = gu.copy()
    bad[1, 3], bad[2, 0] = np.nan, np.inf
    gated_act(bad, None, None, act, out)          # no exception
    if act != "relu":       # relu's select gives 0 for NaN (the residual stream keeps it)
        assert np.isnan(out[1, 3])
        assert np.isnan(out[2, 0]) or np.isinf(out[2, 0])
    assert np.all(np.isfinite(np.delete(out.ravel(), [1 * m + 3, 2 * m])))


def test_softmax_masks_causal_and_empty_rows():
    rng = np.random.default_rng(1)
    b, h, t = 3, 2, 7
    s = (rng.standard_normal((b * h, t, t)) * 5).astype(np.float32)
    mask = np.ones((b, t), np.float32)
    mask[1, 4:] = 0
    mask[2, :] = 0                       # a row of batch 2 has no key at all
    for causal in (False, True):
        got = K.masked_softmax(s.copy(), mask, 0.3, h, causal)
        gen = K.masked_softmax(s.copy().astype(np.float64), mask, 0.3, h, causal)  # xp path
        z = s.reshape(b, h, t, t).astype(np.float64) * 0.3
        keep = (mask > 0)[:, None, None, :] & (np.tril(np.ones((t, t), bool)) if causal
                                               else np.ones((t, t), bool))[None, None]
        z = np.where(keep, z, -np.inf)
        m = np.max(z, axis=-1, keepdims=True)
        e = np.where(keep, np.exp(z - np.where(np.isfinite(m), m, 0)), 0)
        tot = e.sum(-1, keepdims=True)
        ref = (e / np.where(tot > 0, tot, 1)).reshape(b * h, t, t)
        assert np.all(np.isfinite(got))
        assert np.max(np.abs(got - ref)) < 1e-6
        assert np.max(np.abs(gen - ref)) < 1e-6
        assert np.all(got.reshape(b, h, t, t)[~np.broadcast_to(keep, (b, h, t, t))] == 0)
        assert np.all(got.reshape(b, h, t, t)[2] == 0)


def test_layernorm_kernels_match_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 48)).astype(np.float32) * 3 + 1
    r = rng.standard_normal((5, 48)).astype(np.float32)
    bias, g, be = (rng.standard_normal(48).astype(np.float32) for _ in range(3))
    t = x + bias + r
    ref = (t - t.mean(1, keepdims=True)) / np.sqrt(t.var(1, keepdims=True) + 1e-5) * g + be
    resid = r.copy()
    out = np.empty_like(x)
    K.bias_residual_layernorm(x, bias, resid, g, be, 1e-5, out)
    assert np.max(np.abs(resid - t)) < 1e-6 and np.max(np.abs(out - ref)) < 1e-5
    resid = r.copy()
    K.bias_residual_layernorm(x, bias, resid, g, be, 1e-5, resid)       # in place, as BERT does
    assert np.max(np.abs(resid - ref)) < 1e-5
    gen = K.layernorm(t.astype(np.float64), g, be, 1e-5)                 # generic xp path
    assert np.max(np.abs(gen - ref)) < 1e-5


def test_generic_xp_path_matches_numba_path(minilm, tok, tmp_path, monkeypatch):
    """The xp (CuPy-style) code path, run with NumPy, against the Numba kernels."""
    ids, mask = tok(SENTENCES[:6])
    fast = minilm.hidden_states(ids, mask).copy()
    dec = load_model(tiny_gpt2(tmp_path / "g"))
    gids = np.random.default_rng(0).integers(0, 97, size=(2, 9))
    gmask = np.array([[1] * 9, [1] * 5 + [0] * 4])
    zfast = dec.logits(gids, gmask)
    monkeypatch.setattr(K, "_is_cpu32", lambda *a: False)
    slow = minilm.hidden_states(ids, mask)
    valid = mask.astype(bool)
    assert np.max(np.abs(slow - fast)[valid]) < 1e-4
    assert np.max(np.abs(dec.logits(gids, gmask) - zfast)[gmask.astype(bool)]) < 1e-4


def test_split_slices_by_weight_are_consecutive_non_empty_and_balanced():
    """Row blocks by weight (real tokens per row): consecutive, never empty, covering every
    row, each block's weight (+1 per row) within one row of the even share."""
    rng = np.random.default_rng(3)
    for n, parts in [(16, 2), (16, 4), (5, 4), (4, 4), (40, 3), (7, 2)]:
        w = rng.integers(0, 65, size=n)
        w[rng.integers(0, n)] = 0
        sl = K.split_slices(n, 0, 1, w, parts=parts)
        assert len(sl) == min(parts, n) and sl[0].start == 0 and sl[-1].stop == n
        assert all(a.stop == b.start and a.stop > a.start for a, b in itertools.pairwise(sl))
        tot = [int((w[s] + 1).sum()) for s in sl]
        share = (w + 1).sum() / len(sl)
        if len(sl) < n:
            assert max(tot) - share <= (w + 1).max(), (n, parts, tot)
    assert K.split_slices(3, 0, 1, [5, 5, 5], parts=1) == [slice(0, 3)]


def test_scratch_buffers_are_reused_per_name_and_thread(monkeypatch):
    """The decoder's block temporaries: one buffer per (thread, name), grown to the largest
    request, never shared between names or threads; above the cap a plain allocation."""
    import threading

    a = K.scratch(np, "t-a", (4, 8), np.float32)
    a[...] = 1.0
    a2 = K.scratch(np, "t-a", (2, 3), np.float32)          # smaller: the same memory
    assert np.shares_memory(a, a2) and a2.shape == (2, 3) and a2.dtype == np.float32
    b = K.scratch(np, "t-b", (4, 8), np.float32)
    assert not np.shares_memory(a, b)
    big = K.scratch(np, "t-a", (64, 64), np.float64)         # larger: a new buffer
    assert big.shape == (64, 64) and big.dtype == np.float64 and big.flags.c_contiguous
    assert np.shares_memory(big, K.scratch(np, "t-a", (64, 64), np.float64))
    # a shape asked before the buffer grew: a view of the new buffer, not of the old one
    again = K.scratch(np, "t-a", (4, 8), np.float32)
    assert np.shares_memory(again, big) and not np.shares_memory(again, a)
    assert again is K.scratch(np, "t-a", (4, 8), np.float32)     # the same request: kept
    assert K.scratch(np, "t-a", [4, 8], np.float32).shape == (4, 8)   # a list: not kept
    other = []
    th = threading.Thread(target=lambda: other.append(K.scratch(np, "t-a", (64, 64),
                                                                  np.float64)))
    th.start()
    th.join()
    assert not np.shares_memory(big, other[0])
    monkeypatch.setattr(K, "SCRATCH_MAX_BYTES", 1024)
    huge = K.scratch(np, "t-a", (64, 64), np.float64)        # over the cap: its own array
    assert not np.shares_memory(huge, big)


def test_output_cache_reuses_only_what_the_caller_let_go():
    c = K.OutputCache(max_bytes=4096)
    a = c.get((4, 5), np.float32)
    b = c.get((4, 5), np.float32)                       # a still held: a new array
    assert not np.shares_memory(a, b)
    del a
    addr = b.ctypes.data
    del b
    again = c.get((4, 5), np.float32)                    # dropped: the same memory back
    assert again.ctypes.data == addr and again.shape == (4, 5)
    view = again[1:]
    del again
    fresh = c.get((4, 5), np.float32)                    # a view still held: a new array
    assert not np.shares_memory(fresh, view)
    assert c.get((3, 5), np.float32).shape == (3, 5)     # another shape: a new array
    del fresh
    big = c.get((64, 64), np.float64)                    # 32 KiB > max_bytes: never kept
    assert big.shape == (64, 64) and c._buf is None


def test_decoder_logits_never_overwrite_an_array_the_caller_holds(tmp_path):
    m = load_model(tiny_gpt2(tmp_path / "g"))
    rng = np.random.default_rng(5)
    x = rng.integers(0, m.config.vocab_size, size=(2, 7))
    y = rng.integers(0, m.config.vocab_size, size=(2, 7))
    zx = m.logits(x)
    keep = zx.copy()
    zy = m.logits(y)                                     # zx held: not reused
    assert np.array_equal(zx, keep) and not np.shares_memory(zx, zy)
    addr = zy.ctypes.data
    del zy
    zy2 = m.logits(y)                                    # dropped: its memory reused
    assert zy2.ctypes.data == addr
    assert np.array_equal(m.logits(x), keep)


def test_decoder_forward_is_repeatable_with_scratch_buffers(tmp_path):
    """Reused block temporaries leave no trace: the same logits, bit for bit, on a second
    call, after a call of another shape, and on two threads."""
    from semzo.model import set_threads

    m = load_model(tiny_gpt2(tmp_path / "g"))
    rng = np.random.default_rng(3)
    ids = rng.integers(0, m.config.vocab_size, size=(4, 9))
    mask = np.ones_like(ids)
    mask[1, 6:] = 0
    z0 = m.logits(ids, mask)
    m.logits(ids[:3, :5], mask[:3, :5])
    assert np.array_equal(m.logits(ids, mask), z0)
    set_threads(2)
    try:
        z2 = m.logits(ids, mask)
    finally:
        set_threads(1)
    np.testing.assert_allclose(z2, z0, rtol=1e-5, atol=1e-5)


def test_thread_split_forward_equals_single(minilm, tok, tmp_path):
    """set_threads(n): row blocks run concurrently give the one-thread results, in order."""
    from semzo.model import get_threads, set_threads
    ids, mask = tok(SENTENCES[:7])
    dec = load_model(tiny_gpt2(tmp_path / "g"))
    gids = np.random.default_rng(0).integers(0, 97, size=(5, 30))
    one, z1 = minilm.hidden_states(ids, mask), dec.logits(gids)
    old = get_threads()
    set_threads(3)
    try:
        dec.split_min_tokens = 1
        many, z3 = minilm.hidden_states(ids, mask), dec.logits(gids)
    finally:
        set_threads(old)
        dec.split_min_tokens = type(dec).split_min_tokens
    assert many.shape == one.shape and z3.shape == z1.shape
    v = mask.astype(bool)               # padded positions mean nothing (and may be skipped)
    assert np.max(np.abs(many[v] - one[v])) < 1e-5 and np.max(np.abs(z3 - z1)) < 1e-5


def test_encoder_skips_padding(minilm, tok, monkeypatch):
    """With at least 1/16 of a batch's tokens padding, the encoder's blocks run their
    projections, LayerNorms and MLP on the real tokens only (packed): that many rows reach
    the QKV projection of every layer; real tokens equal the padded computation's within
    float32 rounding (bit-identical where OpenBLAS rows do not depend on the row count,
    not asserted); so do the pooled embeddings and the frozen-prefix split; a batch without
    padding is not packed."""
    texts = [SENTENCES[0], SENTENCES[1] * 3, "short", SENTENCES[2] + " " + SENTENCES[3]]
    ids, mask = tok.pad(tok.encode_batch(texts))
    assert 1 - mask.mean() >= 1 / 16
    seen = []
    qkv = minilm._qkv
    monkeypatch.setattr(minilm, "_qkv", lambda x, i, out: (seen.append(x.shape[0]),
                                                           qkv(x, i, out))[1])
    packed = minilm.hidden_states(ids, mask)
    assert seen == [int(mask.sum())] * minilm.config.num_layers
    pooled = minilm.embed(ids, mask)
    pre = minilm.hidden_from(minilm.hidden_at(ids, mask, 2), mask, 2)
    seen.clear()
    monkeypatch.setattr(minilm, "pack_min_share", 2.0)          # never pack
    padded = minilm.hidden_states(ids, mask)
    assert seen == [mask.size] * minilm.config.num_layers
    v = mask.astype(bool)
    assert np.allclose(packed[v], padded[v], rtol=1e-5, atol=1e-6)
    assert np.allclose(pre[v], padded[v], rtol=1e-5, atol=1e-6)
    assert np.allclose(pooled, minilm.embed(ids, mask), rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(minilm, "pack_min_share", 1 / 16)
    seen.clear()
    full = np.ones_like(mask)
    minilm.hidden_states(ids, full)
    assert seen == [full.size] * minilm.config.num_layers


def test_inference_layout_same_bits(minilm, tok):
    """inference_layout stores the block projection weights in Fortran order, so the GEMM
    operand W.T is C-contiguous: same names, shapes and values, bit-identical hidden states
    (padded batch, packed rows, thread split) and pooled embeddings; the ZO kernels refuse the
    laid-out tensors instead of perturbing a copy."""
    from semzo.model.kernels import set_threads
    from semzo.zo.perturb import perturb
    model = load_model()
    assert model.inference_layout() is True
    assert list(model.params) == list(minilm.params)
    moved = [n for n, a in model.params.items() if not a.flags.c_contiguous]
    assert len(moved) == 6 * minilm.config.num_layers
    for n in moved:                 # Q, K, V: row blocks of the fused (3H, H) buffer
        a = model.params[n]
        assert np.array_equal(a, minilm.params[n])
        assert a.T.flags.c_contiguous or ".attention.self." in n
    assert all(w.T.flags.c_contiguous for w, _, _ in model._fused)
    texts = [SENTENCES[0], SENTENCES[1] * 3, "short", SENTENCES[2] + " " + SENTENCES[3]]
    ids, mask = tok.pad(tok.encode_batch(texts))
    for threads in (1, 2):
        set_threads(threads)
        try:
            assert np.array_equal(model.hidden_states(ids, mask), minilm.hidden_states(ids, mask))
            assert np.array_equal(model.embed(ids, mask), minilm.embed(ids, mask))
        finally:
            set_threads(1)
    w = model.params[moved[0]]
    before = w.copy()
    with pytest.raises(ValueError, match="C-contiguous"):
        perturb([(0, w)], seed=1, scale=1e-3)
    assert np.array_equal(w, before)
    assert load_model(dtype="bfloat16").inference_layout() is False


# ----------------------------------------------------------------------------- parameters

def test_parameter_collection_contract(minilm):
    names = list(minilm.params)
    assert names[0] == "embeddings.word_embeddings.weight"
    assert names[5] == "encoder.layer.0.attention.self.query.weight"
    assert names[-2:] == ["pooler.dense.weight", "pooler.dense.bias"]
    assert names == list(load_model().params)                      # stable across loads
    assert minilm.frozen == {"pooler.dense.weight", "pooler.dense.bias"}
    assert "embeddings.position_ids" in minilm.buffers and "embeddings.position_ids" not in names
    trainable = dict(minilm.named_parameters())
    assert len(trainable) == len(names) - 2
    assert minilm.num_parameters() == 22565376
    for name, a in minilm.params.items():
        assert a.flags.c_contiguous and a.flags.writeable and a.dtype == np.float32, name
    ref = load_file(str(minilm.source / "model.safetensors"))
    for name, a in minilm.params.items():
        assert np.array_equal(a, ref[name]), name
    assert is_no_decay("encoder.layer.0.output.LayerNorm.weight")
    assert is_no_decay("h.3.ln_1.weight") and is_no_decay("classifier.bias")
    assert not is_no_decay("encoder.layer.0.attention.self.query.weight")


def test_in_place_perturbation_is_seen_and_restorable(minilm, tok):
    ids, mask = tok(SENTENCES[:4])
    base = minilm.hidden_states(ids, mask).copy()
    rng = np.random.default_rng(3)
    zs = {n: rng.standard_normal(a.shape).astype(np.float32) for n, a in minilm.named_parameters()}
    orig = {n: a.copy() for n, a in minilm.named_parameters()}
    for n, a in minilm.named_parameters():
        a += 1e-3 * zs[n]
    pert = minilm.hidden_states(ids, mask).copy()
    # Q, K, V separately: each block of the fused buffer is read on every call
    # (a constant on the key bias would not do: softmax ignores a shift of a row)
    k = minilm.params["encoder.layer.2.attention.self.key.weight"]
    dk = rng.standard_normal(k.shape).astype(np.float32) * 0.05
    k += dk
    pert_k = minilm.hidden_states(ids, mask).copy()
    k -= dk
    for n, a in minilm.named_parameters():
        a[...] = orig[n]                      # exact restore: nothing stale may remain
    back = minilm.hidden_states(ids, mask)
    assert np.max(np.abs(pert - base)) > 1e-3
    assert np.max(np.abs(pert_k - pert)) > 1e-4
    assert np.array_equal(back, base)
    # replacing an entry (not in place) falls back to separate GEMMs and is still honoured
    name = "encoder.layer.1.attention.self.value.weight"
    old = minilm.params[name]
    keep = old.copy()
    try:
        minilm.params[name] = old + 0.01
        moved = minilm.hidden_states(ids, mask).copy()
        old += 0.01
        minilm.params[name] = old
        fused = minilm.hidden_states(ids, mask)
        assert np.max(np.abs(moved - fused)) < 1e-5 and np.max(np.abs(moved - base)) > 1e-4
    finally:
        old[...] = keep
        minilm.params[name] = old


# ----------------------------------------------------------------------------- outputs

def test_embed_texts_order_padding_and_buckets(minilm, tok):
    texts = SENTENCES + SENTENCES[:3]
    got = embed_texts(minilm, tok, texts, batch_size=4)
    one = np.concatenate([minilm.embed(*tok([t])) for t in texts])
    assert got.shape == (len(texts), 384) and got.dtype == np.float32
    assert np.max(np.abs(got - one)) < 2e-6
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-6)
    assert np.array_equal(got[-3:], got[:3])
    raw = embed_ids(minilm, tok.encode_batch(texts), normalize=False, max_tokens=200)
    assert np.allclose(raw / np.linalg.norm(raw, axis=1, keepdims=True), got, atol=2e-6)
    lens = [5, 1, 9, 9, 3, 7, 2]
    batches = list(length_batches(lens, 3, max_tokens=18))
    assert sorted(np.concatenate(batches).tolist()) == list(range(7))
    assert all(len(b) * max(lens[i] for i in b) <= 18 for b in batches)


def test_tokenizer_truncation_and_padding(tok):
    assert tok.max_length == 256 and tok.pad_id == 0
    seqs = tok.encode_batch(SENTENCES)
    assert max(len(s) for s in seqs) == 256
    assert seqs[0].tolist() == [101, 7592, 2088, 102]            # [CLS] hello world [SEP]
    ids, mask = tok.pad(seqs[:3])
    assert ids.shape == mask.shape == (3, 12) and mask.sum() == sum(len(s) for s in seqs[:3])
    assert Tokenizer.from_folder(max_length=16).encode_batch(SENTENCES[-1:])[0].size == 16


@pytest.mark.parametrize("file, key, value, want", [
    ("tokenizer_config.json", "model_max_length", 40, 40),
    ("tokenizer_config.json", "model_max_length", 64.0, 64),
    ("tokenizer_config.json", "model_max_length", 10**30, 77),    # transformers' "no limit"
    ("tokenizer_config.json", "model_max_length", float("inf"), 77),
    ("tokenizer_config.json", "model_max_length", -1, None),
    ("tokenizer_config.json", "model_max_length", 0, None),
    ("tokenizer_config.json", "model_max_length", "abc", None),
    ("tokenizer_config.json", "model_max_length", 12.5, None),
    ("tokenizer_config.json", "model_max_length", float("nan"), None),
    ("tokenizer_config.json", "model_max_length", True, None),
    ("sentence_bert_config.json", "max_seq_length", 33, 33),
    ("sentence_bert_config.json", "max_seq_length", -5, None),
    ("sentence_bert_config.json", "max_seq_length", 10**30, None),
    ("sentence_bert_config.json", "max_seq_length", [8], None),
    ("config.json", "max_position_embeddings", -3, None),
    ("config.json", "n_positions", "512", None),
])
def test_tokenizer_length_keys_are_checked(tmp_path, file, key, value, want):
    from semzo.model.loader import default_model_path
    tj = json.loads((default_model_path() / "tokenizer.json").read_text(encoding="utf-8"))
    tj["truncation"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 77}))
    (tmp_path / file).write_text(json.dumps({key: value}))
    if want is not None:
        assert Tokenizer.from_folder(tmp_path).max_length == want
        return
    with pytest.raises(SemzoError) as exc:
        Tokenizer.from_folder(tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"{tmp_path / file}: '{key}' must be a positive integer"), msg
    assert "\n" not in msg


def test_classifier_head_loss_and_accuracy(minilm, tok):
    ids, mask = tok(SENTENCES[:6])
    labels = np.array([0, 1, 2, 0, 1, 2])
    minilm.add_classifier(3, init="normal", std=0.5, seed=1)
    try:
        loss, acc, logits = minilm.classify(ids, mask, labels)
        hs = minilm.hidden_states(ids, mask).astype(np.float64)
        m = mask[:, :, None]
        pooled = (hs * m).sum(1) / m.sum(1)
        z = pooled @ minilm.params["classifier.weight"].T.astype(np.float64) + \
            minilm.params["classifier.bias"]
        lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
        assert abs(loss - np.mean(lse - z[np.arange(6), labels])) < 1e-5
        assert acc == np.mean(z.argmax(1) == labels)
        assert np.allclose(logits, z, atol=1e-5)
        assert ("classifier.weight", minilm.params["classifier.weight"]) in \
            [(n, a) for n, a in minilm.named_parameters() if n.startswith("classifier")]
        assert list(minilm.params)[-2:] == ["classifier.weight", "classifier.bias"]
    finally:
        del minilm.params["classifier.weight"], minilm.params["classifier.bias"]
        minilm.head = None


def test_lora_hook_and_merged_export(tmp_path, tok):
    model = load_model()
    ids, mask = tok(SENTENCES[:5])
    base = model.hidden_states(ids, mask).copy()
    new = model.add_lora(rank=4, alpha=8, targets=("query", "value", "output.dense"))
    assert len(new) == 2 * 3 * 6 and new[0].endswith(".query.lora_A.weight")
    assert np.array_equal(model.hidden_states(ids, mask), base)        # B = 0
    assert {n for n, _ in model.named_parameters()} == set(new)
    rng = np.random.default_rng(4)
    for n in new:
        if "lora_B" in n:
            model.params[n] += rng.standard_normal(model.params[n].shape).astype(np.float32) * .05
    adapted = model.hidden_states(ids, mask).copy()
    assert np.max(np.abs(adapted - base)) > 1e-3
    # the same delta, added by hand to one projection, gives the same output
    m = "encoder.layer.3.attention.self.value"
    spec = model.lora[m]
    ref = load_model()
    ref.add_lora(rank=4, alpha=8, targets=("query", "value", "output.dense"))
    for n in new:
        ref.params[n][...] = model.params[n]
    ref.params[spec.b][...] = 0
    w = ref.params[m + ".weight"]
    w += (model.params[spec.b] @ model.params[spec.a]) * spec.scale
    assert np.max(np.abs(ref.hidden_states(ids, mask) - adapted)) < 1e-4
    out = export_hf(model, tmp_path / "merged")
    back = load_model(out)
    assert not back.lora and "encoder.layer.0.attention.self.query.lora_A.weight" \
        not in back.params
    assert np.max(np.abs(back.hidden_states(ids, mask) - adapted)) < 1e-4


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_honour_the_umask(minilm, tmp_path, umask):
    """Every exported file gets the mode ``open()`` would give it (safetensors alone wrote
    model.safetensors and semzo_head.safetensors 0600); no ``*.tmp`` is left."""
    import stat

    minilm.add_classifier(3, seed=1)
    old = os.umask(umask)
    try:
        out = export_hf(minilm, tmp_path / "exp")
    finally:
        os.umask(old)
        del minilm.params["classifier.weight"], minilm.params["classifier.bias"]
        minilm.head = None
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"model.safetensors", "semzo_head.safetensors", "config.json"} <= \
        {p.name for p in files}
    assert not [p for p in files if p.name.endswith(".tmp")]
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, (p.name, oct(p.stat().st_mode))


def test_export_roundtrip_bit_identical_with_head(minilm, tmp_path, tok):
    minilm.add_classifier(4, seed=2)
    try:
        out = export_hf(minilm, tmp_path / "exp")
        for f in ("config.json", "model.safetensors", "tokenizer.json", "vocab.txt",
                  "modules.json", "1_Pooling/config.json", "semzo_head.safetensors"):
            assert (out / f).is_file(), f
        src = load_file(str(minilm.source / "model.safetensors"))
        dst = load_file(str(out / "model.safetensors"))
        assert set(src) == set(dst)
        for k in src:
            assert src[k].dtype == dst[k].dtype and src[k].tobytes() == dst[k].tobytes(), k
        back = load_model(out)
        assert back.head == minilm.head
        ids, mask = tok(SENTENCES[:3])
        la, aa, za = minilm.classify(ids, mask, [0, 1, 3])
        lb, ab, zb = back.classify(ids, mask, [0, 1, 3])
        assert la == lb and aa == ab and np.array_equal(za, zb)
    finally:
        del minilm.params["classifier.weight"], minilm.params["classifier.bias"]
        minilm.head = None


# ----------------------------------------------------------------------------- decoder

def test_bad_head_file_is_one_error_naming_file_and_tensor(minilm, tmp_path):
    """semzo_head.safetensors is checked when loaded: a damaged header, a missing tensor, a
    non-float dtype, a width other than the hidden size, a bias that does not match the
    weight's rows (was silently broadcast), NaN values, a bad ``normalize`` value."""
    minilm.add_classifier(3, seed=2)
    try:
        out = export_hf(minilm, tmp_path / "exp")
    finally:
        del minilm.params["classifier.weight"], minilm.params["classifier.bias"]
        minilm.head = None
    head = out / "semzo_head.safetensors"
    good = head.read_bytes()
    w = np.zeros((3, 384), np.float32)
    cases = [
        (b"\x10" + b"\x00" * 7 + b"not json!" * 2, "not a safetensors file"),
        (good[:len(good) - 9], "truncated or damaged file"),
        ({"classifier.weight": w}, "missing tensor 'classifier.bias'"),
        ({"classifier.weight": w.astype(np.int32), "classifier.bias": np.zeros(3, np.float32)},
         "classifier.weight has dtype I32, expected a float tensor"),
        ({"classifier.weight": w[:, :8], "classifier.bias": np.zeros(3, np.float32)},
         "classifier.weight has shape [3, 8], expected [classes, 384]"),
        ({"classifier.weight": w, "classifier.bias": np.zeros(1, np.float32)},
         "classifier.bias has shape [1], expected [3]"),
        ({"classifier.weight": w + np.nan, "classifier.bias": np.zeros(3, np.float32)},
         "classifier.weight holds NaN or infinite values"),
        (({"classifier.weight": w, "classifier.bias": np.zeros(3, np.float32)},
          {"normalize": "yes"}), "metadata 'normalize' is 'yes'"),
    ]
    for content, want in cases:
        if isinstance(content, bytes):
            head.write_bytes(content)
        else:
            tensors, meta = content if isinstance(content, tuple) else (content, None)
            save_file(tensors, str(head), metadata=meta)
        with pytest.raises(SemzoError) as exc:
            load_model(out)
        msg = str(exc.value)
        assert msg.startswith(str(head)) and want in msg and "\n" not in msg, (want, msg)
    save_file({"classifier.weight": w + 1, "classifier.bias": np.ones(3, np.float32)}, str(head),
              metadata={"normalize": "true"})
    back = load_model(out)
    assert back.head.n_classes == 3 and back.head.normalize
    assert np.array_equal(np.asarray(back.params["classifier.bias"]), np.ones(3, np.float32))


def test_decoder_loss_matches_logits_and_prefix(tmp_path):
    a = load_model(tiny_gpt2(tmp_path / "g"))
    b = load_model(tiny_gpt2(tmp_path / "t", prefix="transformer."))
    assert isinstance(a, CausalLM) and a.prefix == "" and b.prefix == "transformer."
    rng = np.random.default_rng(5)
    ids = rng.integers(0, 97, size=(3, 11))
    mask = np.ones((3, 11), np.int64)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    za, zb = a.logits(ids, mask), b.logits(ids, mask)
    assert za.shape == (3, 11, 97) and np.array_equal(za, zb)
    z = za[:, :-1].astype(np.float64)
    tgt = ids[:, 1:]
    lse = np.log(np.exp(z - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
    nll = lse - np.take_along_axis(z, tgt[..., None], -1)[..., 0]
    ref = (nll * mask[:, 1:]).sum() / mask[:, 1:].sum()
    assert abs(a.next_token_loss(ids, mask, chunk=7) - ref) < 1e-5
    # causality: changing a later token leaves earlier logits unchanged
    ids2 = ids.copy()
    ids2[0, 6] = (ids2[0, 6] + 1) % 97
    z2 = a.logits(ids2, mask)
    assert np.array_equal(z2[0, :6], za[0, :6]) and not np.allclose(z2[0, 6:], za[0, 6:])
    # padding: a padded row equals the unpadded short sequence
    short = a.logits(ids[2:3, :3], mask[2:3, :3])
    assert np.max(np.abs(short[0] - za[2, :3])) < 1e-5


def test_gpt2_decoder_skips_padding(tmp_path, monkeypatch):
    """With at least 1/16 of a batch's tokens padding, the GPT-2 decoder's blocks run their
    projections on the real tokens only (packed at stage 0): that many rows reach every
    block's c_attn projection; real tokens' hidden states and the next-token loss equal the
    padded computation's within float32 rounding; padded positions come out zero; the
    staged forward equals the one-call forward bit for bit; a batch without padding is not
    packed, and a row block of padding only is computed without error."""
    model = load_model(tiny_gpt2(tmp_path / "g"))
    rng = np.random.default_rng(6)
    ids = rng.integers(0, 97, size=(4, 12))
    mask = np.ones((4, 12), np.int64)
    mask[1, 5:] = 0
    mask[3, 2:] = 0
    seen = []
    proj = model._proj
    monkeypatch.setattr(model, "_proj", lambda x, mod, out, xb=None: (
        seen.append(x.shape[0]) if mod.endswith("attn.c_attn") else None,
        proj(x, mod, out, xb))[1])
    packed = model.hidden_states(ids, mask)
    assert seen == [int(mask.sum())] * model.config.num_layers
    loss = model.next_token_loss(ids, mask)
    assert np.array_equal(model.stage_hidden_states(ids, mask), packed)
    v = mask.astype(bool)
    assert not packed[~v].any()
    seen.clear()
    monkeypatch.setattr(model, "pack_min_share", 2.0)           # never pack
    padded = model.hidden_states(ids, mask)
    assert seen == [mask.size] * model.config.num_layers
    assert np.allclose(packed[v], padded[v], rtol=1e-5, atol=1e-6)
    assert abs(model.next_token_loss(ids, mask) - loss) < 1e-6 * max(1.0, abs(loss))
    monkeypatch.setattr(model, "pack_min_share", 1 / 16)
    seen.clear()
    model.hidden_states(ids, np.ones_like(mask))
    assert seen == [mask.size] * model.config.num_layers
    none = np.zeros_like(mask)
    none[0, 0] = 1
    out = model.hidden_states(ids[1:], none[1:])                 # no real token at all
    assert out.shape == (3, 12, model.config.hidden_size) and not out.any()


def test_token_nll_kernel_and_thread_independent_loss(tmp_path):
    from semzo.model.kernels_lm import token_nll

    rng = np.random.default_rng(8)
    z = (rng.standard_normal((37, 1001)) * 4).astype(np.float32)
    z[5, 17] = z[5, 3] = z[5].max() + 1                    # a tie: the first index wins
    z[6, 4] = z[6, 9] = z[6].max() + 1
    lab = rng.integers(0, 1001, 37)
    lab[5], lab[6] = 17, 4
    nll, hit = np.empty(37), np.empty(37)
    token_nll(z, lab, nll, hit)
    zz = z.astype(np.float64)
    m = zz.max(1)
    ref = m + np.log(np.exp(zz - m[:, None]).sum(1)) - zz[np.arange(37), lab]
    assert np.max(np.abs(nll - ref) / np.abs(ref)) < 1e-13
    assert np.array_equal(hit, (np.argmax(z, 1) == lab).astype(np.float64))
    assert hit[5] == 0 and hit[6] == 1
    # a NaN or +inf logit gives NaN (the ZO loop skips such steps); a -inf target, +inf
    z[1, 9], z[2, 9] = np.nan, np.inf
    z[3, lab[3]] = -np.inf
    token_nll(z, lab, nll, hit)
    assert np.isnan(nll[1]) and np.isnan(nll[2]) and nll[3] == np.inf and np.isfinite(nll[4])
    for bad in (-1, 1001):
        with pytest.raises(ValueError, match="target id"):
            token_nll(z[:2], np.array([0, bad]), nll[:2], hit[:2])
    # the loss does not depend on how many threads share the chunks
    a = load_model(tiny_gpt2(tmp_path / "g"))
    ids = rng.integers(0, 97, size=(6, 13))
    mask = np.ones((6, 13), np.int64)
    mask[4, 5:] = 0
    got = []
    for th in (1, 2, 3):
        K.set_threads(th)
        try:
            got.append(a.next_token_loss(ids, mask, chunk=5, return_accuracy=True))
        finally:
            K.set_threads(1)
    assert got[0] == got[1] == got[2]
    # the array-module path (GPU, other dtypes: sums left on the device, all-padding chunks
    # skipped) agrees with the CPU kernel's
    hid = a.hidden_states(ids, mask)
    mask[1:3] = 0                                            # whole chunks of padding
    maskf = mask.astype(np.float32)
    cpu = a.next_token_loss_from_hidden(hid, ids, maskf, chunk=5, return_accuracy=True)
    gen = a.next_token_loss_from_hidden(hid.astype(np.float64), ids, maskf, chunk=5,
                                        return_accuracy=True)
    assert abs(gen[0] - cpu[0]) < 1e-5 * abs(cpu[0]) and abs(gen[1] - cpu[1]) < 1e-9
    assert cpu != got[0]


# ----------------------------------------------------------------------------- errors

def test_unsupported_architecture_and_bad_inputs(tmp_path):
    d = tmp_path / "falcon"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 64}))
    with pytest.raises(SemzoError) as ei:
        load_model(d)
    msg = str(ei.value)
    assert "config.json" in msg and "FalconForCausalLM" in msg and "\n" not in msg
    with pytest.raises(SemzoError, match="not found"):
        load_model(tmp_path / "missing")
    g = tiny_gpt2(tmp_path / "nost")
    (g / "model.safetensors").rename(g / "pytorch_model.bin")
    with pytest.raises(SemzoError, match="no model.safetensors"):
        load_model(g)
    with pytest.raises(SemzoError, match="float16"):
        load_model(dtype="float16")
    cfg = json.loads((tiny_gpt2(tmp_path / "act") / "config.json").read_text())
    cfg["activation_function"] = "swish"
    (tmp_path / "act" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SemzoError, match="swish"):
        load_model(tmp_path / "act")
    enc = load_model()
    assert isinstance(enc, Encoder)
    with pytest.raises(ValueError, match="exceeds"):
        enc.hidden_states(np.zeros((1, 513), np.int64))


def test_embedding_does_not_depend_on_the_batch(minilm, tok):
    """A text's embedding has the same bits whatever batch it is embedded in: alone, in
    batches of 5 or 64 (other padded lengths, other texts, packed or not), or split over two
    threads. The encoder runs attention per text length (L x L products: BLAS shapes that
    depend on the text alone) and each softmax row up to its last real key; so embeddings,
    and the k-means on them, are bit-identical at any rank count (docs/guide.md)."""
    from semzo.backend import set_threads
    from semzo.model import set_threads as split_forwards
    from semzo.model.embed import embed_texts

    texts = [f"{SENTENCES[i % len(SENTENCES)]} {' '.join(['word'] * (i % 23))}"
             for i in range(70)]
    one = np.stack([embed_texts(minilm, tok, [t], batch_size=1)[0] for t in texts[:12]])
    for bs in (5, 64):
        got = embed_texts(minilm, tok, texts, batch_size=bs)
        assert np.array_equal(got[:12], one), bs
    set_threads(2)
    split_forwards(2)
    try:
        assert np.array_equal(embed_texts(minilm, tok, texts, batch_size=64)[:12], one)
    finally:
        set_threads(1)
        split_forwards(1)
    ids, mask = tok.pad(tok.encode_batch(texts[:4]))
    wide = np.zeros((4, ids.shape[1] + 9), ids.dtype)
    wmask = np.zeros(wide.shape, mask.dtype)
    wide[:, :ids.shape[1]], wmask[:, :ids.shape[1]] = ids, mask
    assert np.array_equal(minilm.embed(ids, mask), minilm.embed(wide, wmask))


@pytest.mark.parametrize("file", ["sentence_bert_config.json", "tokenizer_config.json",
                                  "config.json"])
@pytest.mark.parametrize("text, why", [("{not json", "not valid JSON"),
                                       ("[1, 2]", "must hold a JSON object"),
                                       (b"\xff\xfe{}", "not valid JSON")])
def test_tokenizer_refuses_a_damaged_json_file_by_name(tmp_path, file, text, why):
    """A config file that is there but damaged is refused in one line naming it (it used to
    read as {}, and the tokenizer quietly lost its lengths and pad id)."""
    from semzo.model.loader import default_model_path
    tj = json.loads((default_model_path() / "tokenizer.json").read_text(encoding="utf-8"))
    tj["truncation"] = None
    (tmp_path / "tokenizer.json").write_text(json.dumps(tj), encoding="utf-8")
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 77}))
    p = tmp_path / file
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(SemzoError) as exc:
        Tokenizer.from_folder(tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"{p}: {why}"), msg
    assert "\n" not in msg
