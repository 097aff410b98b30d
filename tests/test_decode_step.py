"""A generated token's blocks as one compiled call each (semzo.model.decode): the logits of
the block-by-block path to float32 rounding (the same kernels; Numba inlines them into the
block or calls them, depending on whether it compiled them in this process or loaded them
from its cache, and LLVM may contract or vectorize an inlined operation differently: an ulp
here and there) and the same tokens, for every decoder family it takes, float32 and
bfloat16 weights, one and several rows; bit for bit the same at one and two threads; the
families and settings it does not take go block by block; weights replaced or perturbed in
place are read as they are now; arrays that do not fit the config never reach the kernel."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import contextlib

import numba
import numpy as np
import pytest
from test_decoder_parity import CASES, V, build, padded_batch

from semzo.model import decode, load_model

#: the cases whose blocks the compiled step takes (pre-norm RMSNorm blocks with a gated MLP;
#: biases, sliding windows, layers without rotary, QK norms, Gemma 3's sandwich norms, 1 + w
#: scales and local/global rotary, Phi-3's fused projections and partial rotary included;
#: not Gemma 2's soft-capped attention, OPT's and GPT-2's LayerNorm blocks)
TAKEN = {"llama_gqa_llama3_untied", "llama_tied_sharded", "llama_linear_rope", "qwen2",
         "qwen2_window", "mistral", "mistral_window", "smollm3", "qwen3_bias",
         "qwen3_window", "gemma3", "phi3_partial", "phi3_window"}


@contextlib.contextmanager
def numba_threads(n: int):
    """Numba's threads (the GEMV launches' parts) set to n (at most what it has), then back."""
    old = numba.get_num_threads()
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    try:
        yield
    finally:
        numba.set_num_threads(old)


@pytest.fixture
def count(monkeypatch):
    """How many steps the compiled blocks ran (a list of one int): calls of decode.run that
    took them, each checked to run every block once."""
    n, blocks = [0], [0]
    real_run, real_block = decode.run, decode._nb_block

    def block(*a):
        blocks[0] += 1
        return real_block(*a)

    def run(model, *a):
        before = blocks[0]
        took = real_run(model, *a)
        assert blocks[0] - before == (model.config.num_layers if took else 0)
        n[0] += took
        return took

    monkeypatch.setattr(decode, "_nb_block", block)
    monkeypatch.setattr(decode, "run", run)
    return n


def greedy(model, ids, mask=None, steps: int = 6):
    """Logits of the prompt's last real token and of ``steps`` greedy tokens (B, steps+1, V)."""
    b = ids.shape[0]
    cache = model.new_cache(b, ids.shape[1] + steps + 1)
    z = model.forward_cached(ids, cache, mask)
    last = (mask.sum(1) - 1) if mask is not None else np.full(b, ids.shape[1] - 1)
    out = [z[np.arange(b), last].copy()]
    for _ in range(steps):
        nxt = out[-1].argmax(-1)[:, None]
        out.append(model.forward_cached(nxt, cache)[:, -1].copy())
    return np.stack(out, 1)


def close(a, b) -> bool:
    """Logits a and b equal to float32 rounding (1e-6 of the largest), the same argmax."""
    return (np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
            and np.array_equal(a.argmax(-1), b.argmax(-1)))


def both_ways(model, *args):
    """greedy(...) with the compiled step, then block by block."""
    model.decode_compiled = True
    a = greedy(model, *args)
    model.decode_compiled = False
    b = greedy(model, *args)
    model.decode_compiled = True
    return a, b


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_step_has_the_bits_of_the_blocks(name, dtype, tmp_path_factory, count):
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder, dtype=dtype)
    rng = np.random.default_rng(11)
    ids = rng.integers(0, V, size=(1, 7))
    got = []
    for threads in (1, 2):
        before = count[0]
        with numba_threads(threads):
            a, b = both_ways(model, ids)
        assert close(a, b), (name, dtype, threads, np.abs(a - b).max())
        assert np.isfinite(a).all()
        assert (count[0] - before == 6) == (name in TAKEN), (name, count[0] - before)
        assert count[0] - before in (0, 6)
        got.append(a)
    assert np.array_equal(*got)                    # the GEMVs' cut over threads: no change


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "smollm3", "qwen2"])
def test_several_padded_prompts_at_once(name, tmp_path_factory, count):
    """Right-padded prompts of different lengths (generate_many's batch): each row's new
    token attends to its real keys only; the bits of the blocks, several rows in one call."""
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    rng = np.random.default_rng(5)
    ids, mask = padded_batch(rng, V, 3, 7)
    mask[1, 3:] = 0
    with numba_threads(2):
        a, b = both_ways(model, ids, mask)
    assert count[0] == 6
    assert close(a, b)
    for r in range(3):                     # each row as its prompt alone, to rounding
        n = int(mask[r].sum())
        alone = greedy(model, ids[r:r + 1, :n])[0]
        if (alone.argmax(-1) == a[r].argmax(-1)).all():
            assert np.abs(alone - a[r]).max() <= 1e-4 * np.abs(alone).max(), r


def test_what_it_does_not_take_goes_block_by_block(tmp_path_factory, count):
    folder, _ = build("mistral", tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    ids = np.random.default_rng(2).integers(0, V, size=(1, 5))
    greedy(model, ids, None, 2)
    assert count[0] == 2
    model.set_matmul("bfloat16")                       # bfloat16 GEMMs
    greedy(model, ids, None, 2)
    model.set_matmul("float32")
    model.add_lora(rank=2, targets=["q_proj", "v_proj"], seed=1)   # adapters
    a, b = both_ways(model, ids)
    assert np.array_equal(a, b)                        # both block by block
    assert count[0] == 2
    model.lora.clear()
    cache = model.new_cache(2, 12)                     # a padded new token: rows packed
    model.forward_cached(ids[:, :4].repeat(2, 0), cache)
    before = count[0]
    model.forward_cached(ids[:, 4:].repeat(2, 0), cache, np.array([[1], [0]]))
    assert count[0] == before


def test_replaced_and_perturbed_weights_are_read_as_they_are_now(tmp_path_factory, count):
    """The checked tuples of weights are kept while ``params`` holds the same arrays: a
    weight replaced by another array is checked and read; one changed in place (a ZO
    perturbation) is read as it is."""
    folder, _ = build("qwen2", tmp_path_factory)
    model = load_model(folder)
    ids = np.random.default_rng(4).integers(0, V, size=(1, 6))
    first, _ = both_ways(model, ids)
    name = model._mods[1]["down"] + ".weight"
    model.params[name] = model.params[name] * np.float32(3.0)            # replaced
    a, b = both_ways(model, ids)
    assert close(a, b) and np.abs(a - first).max() > 1e-3
    model.params[name] *= np.float32(0.5)                                 # in place
    c, d = both_ways(model, ids)
    assert close(c, d) and np.abs(c - a).max() > 1e-3
    assert count[0] == 3 * 6


def test_arrays_that_do_not_fit_never_reach_the_kernel(tmp_path_factory, count):
    """A weight of another shape, dtype or order than the config's: the compiled step
    declines (Numba would read out of bounds); the blocks one by one then decide."""
    folder, _ = build("mistral", tmp_path_factory)
    model = load_model(folder)
    name = model._mods[0]["o"] + ".weight"
    good = model.params[name]
    x = np.zeros((1, model.config.hidden_size), np.float32)
    cache = model.new_cache(1, 4)
    pos = np.zeros((1, 1), np.int64)
    for bad in (good[:, :-1].copy(), good.astype(np.float64), np.asfortranarray(good),
                good[:-1].copy()):
        model.params[name] = bad
        assert decode.run(model, x, cache.maskf[:, :1], pos, None, cache, 0) is False
    model.params[name] = good
    assert decode.run(model, x, cache.maskf[:, :1], pos, None, cache, 0) is True
    assert count[0] == 1


@pytest.mark.parametrize("window", [0, 3])
def test_attention_of_one_token_against_float64(window):
    """attend_one: scores, masked softmax (padding, causal by construction, a sliding
    window) and context of one query a row, grouped-query heads, against float64."""
    from semzo.model.kernels_lm import attend_one, attend_one_usable

    rng = np.random.default_rng(9)
    b, nh, nkv, d, past, size = 2, 6, 2, 8, 6, 10
    q = rng.standard_normal((b, nh, 1, d)).astype(np.float32)
    kc = rng.standard_normal((b, nkv, size, d)).astype(np.float32)
    vc = rng.standard_normal((b, nkv, size, d)).astype(np.float32)
    maskf = np.ones((b, past + 1), np.float32)
    maskf[1, [0, 2, 5]] = 0                        # padding among row 1's keys
    ctx = np.full((b, nh * d), np.nan, np.float32)
    assert attend_one_usable(q, kc, vc, maskf, ctx)
    attend_one(q, kc, vc, maskf, 0.3, past, window, ctx)
    want = np.zeros((b, nh, d))
    lo = max(0, past - window + 1) if window else 0
    for r in range(b):
        for h in range(nh):
            keys = [j for j in range(lo, past + 1) if maskf[r, j] > 0]
            s = 0.3 * kc[r, h // 3, keys].astype(np.float64) @ q[r, h, 0]
            p = np.exp(s - s.max())
            want[r, h] = (p / p.sum()) @ vc[r, h // 3, keys]
    assert np.abs(ctx.reshape(b, nh, d) - want).max() < 1e-5
    assert not attend_one_usable(q.repeat(2, axis=2), kc, vc, maskf, ctx)   # two queries
    for bad in ((q, kc, vc, maskf, 0.3, size, window, ctx),             # past the cache
                (q, kc, vc, maskf[:, :3], 0.3, past, window, ctx),       # a short mask
                (q, kc[:, :, :, :4], vc, maskf, 0.3, past, window, ctx)):  # head size
        with pytest.raises(ValueError, match="attend_one"):
            attend_one(*bad)


def test_a_cache_of_another_layout_is_refused(tmp_path_factory):
    """The kernels append keys and values without bounds checks: a cache of another model's
    layout (heads, head size, layers, dtype) is refused by name before they run."""
    folder, _ = build("mistral", tmp_path_factory)
    model = load_model(folder)
    other = load_model(build("llama_tied_sharded", tmp_path_factory)[0])
    ids = np.array([[1, 2, 3]])
    for cache in (other.new_cache(1, 8), model.new_cache(1, 8)):
        if cache.k[0].shape[1:] == model.new_cache(1, 8).k[0].shape[1:]:
            cache.k[1] = cache.k[1][:, :, :, :-1].copy()         # one layer's head size
        with pytest.raises(ValueError, match="KV cache does not fit"):
            model.forward_cached(ids, cache)
    cache = model.new_cache(1, 8)
    cache.v = cache.v[:-1]                                       # a layer short
    with pytest.raises(ValueError, match="KV cache does not fit"):
        model.forward_cached(ids, cache)
    assert model.forward_cached(ids, model.new_cache(1, 8)).shape == (1, 3, V)


def test_takes_says_which_path_a_generated_token_takes(tmp_path_factory):
    folder, _ = build("qwen3_bias", tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    assert decode.takes(model)
    model.set_matmul("bfloat16")
    assert not decode.takes(model)
    model.set_matmul("float32")
    model.decode_compiled = False
    assert not decode.takes(model)
    assert not decode.takes(load_model(build("gemma2", tmp_path_factory)[0]))
