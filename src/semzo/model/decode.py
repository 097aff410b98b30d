"""A generated token's decoder blocks, each as one compiled call (the CPU).

Generating a token is a forward of one row a prompt: in each block a few GEMVs that read the
weights once (:func:`semzo.model.gemm_cpu.gemv_f32`) and small kernels (RMSNorm, rotary,
attention, SwiGLU, residual adds). Block by block from Python (:meth:`CausalLM._block_rows`)
the step spent time between those kernels: SmolLM2-135M with bfloat16 weights took 12.4 ms
a token of which the GEMV kernels were 8.1 (cProfile of 100 tokens; the rest calls, checks,
scratch arrays, dtype dispatch; AMD EPYC, 2 threads, 2026-11-29). :func:`run` calls the same
Numba kernels in the same order from one Numba function a block, :func:`_nb_block` (the
GEMV launches from compiled code: a parallel Numba function called from another runs on
Numba's threads as from Python), about 10 us of Python a block. All the blocks in one call
was faster still (9.3 against 10.4 ms a token) but Numba indexes a tuple of arrays by a
loop variable through a switch over its length: 25 s to compile for SmolLM2's 30 blocks,
growing with the depth; with one block a call the first generated token of an empty cache
takes about 13 s (every kernel of the step compiled, ``cache=True``: once), whatever the
depth.

The logits agree with the block-by-block path to float32 rounding and are the same at any
thread count (``tests/test_decode_step.py``): Numba inlines a kernel into the block when it
compiled that kernel in the same process and calls it when it loaded it from its cache, and
LLVM may contract or vectorize an inlined operation differently (an ulp here and there).

It takes the pre-norm decoders with RMSNorm and a gated MLP: separate or fused (Phi-3)
q/k/v and gate/up projections, rotary or no positions per block (one table, partial
rotary, or Gemma's local and global ones), sliding windows, grouped-query attention, biases
(read as stored), QK norms (Qwen3, Gemma 3), Gemma's sandwich norms and ``1 + w`` scales;
float32 or bfloat16 weights read in place, float32 products: Llama, Mistral, Qwen2, Qwen3,
Gemma 3, Phi-3, SmolLM2/3. Anything else (LoRA adapters, soft-capped attention (Gemma 2),
LayerNorm blocks (OPT, GPT-2), ``model.matmul = "bfloat16"``, CuPy, more than
:data:`~semzo.model.gemm_cpu.GEMV_ROWS` rows, padding among the new tokens) goes block by
block. ``CausalLM.decode_compiled = False`` turns it off.
"""

from __future__ import annotations

import operator

import numpy as np
from numba import njit

from semzo.model.gemm_cpu import (
    GEMV_ROWS,
    _gemv_f32_many_par,
    _gemv_f32_par,
    _gemv_parts,
    _widen,
)
from semzo.model.kernels import nested
from semzo.model.kernels_lm import (
    GATED_ACTS,
    _nb_attend_one,
    _nb_gated,
    _nb_residual_add,
    _nb_residual_rmsnorm,
    _nb_rmsnorm,
    _nb_rope_split,
)
from semzo.model.variants import rope_tables

F32 = np.float32


@njit(cache=True, nogil=True)
def _gemv(x, w, out, parts):
    """:func:`semzo.model.gemm_cpu.gemv_f32` of a whole weight: its launch, also for one
    part (not the serial kernel, which Numba could compile into the block differently: the
    launch's code is the same at every thread count)."""
    _gemv_f32_par(x, w, out, parts)


@njit(cache=True, nogil=True)
def _gemv2(x, w1, w2, o1, o2, parts):
    """Two weights of one input: one launch (:func:`_gemv_f32_many_par`)."""
    _gemv_f32_many_par(x, (w1, w2), (o1, o2), parts)


@njit(cache=True, nogil=True)
def _gemv3(x, w1, w2, w3, o1, o2, o3, parts):
    """Three weights of one input: one launch (:func:`_gemv_f32_many_par`)."""
    _gemv_f32_many_par(x, (w1, w2, w3), (o1, o2, o3), parts)


@njit(cache=True, nogil=True)
def _plus_one(g):
    """Gemma's norm scale ``1 + g`` (``variants.plus_one``: float32(g) + 1 in float32) of a
    float32 or bfloat16-bits ``g``."""
    gp = np.empty(g.shape[0], F32)
    for j in range(g.shape[0]):
        gp[j] = _widen(g[j]) + F32(1.0)
    return gp


@njit(cache=True, nogil=True)
def _norm(x, g, plus, eps, out):
    """``out = rmsnorm(x)`` with the scale ``g`` (float32 or bfloat16 bits), or
    :func:`_plus_one` of it when ``plus``."""
    if plus:
        _nb_rmsnorm(x, _plus_one(g), eps, out)
    else:
        _nb_rmsnorm(x, g, eps, out)


@njit(cache=True, nogil=True)
def _resnorm(y, bias, x, g, plus, eps, out):
    """``x += y (+ bias)``, then ``out = rmsnorm(x)`` with the scale of :func:`_norm`."""
    if plus:
        _nb_residual_rmsnorm(y, bias, x, _plus_one(g), eps, out)
    else:
        _nb_residual_rmsnorm(y, bias, x, g, eps, out)


@njit(cache=True, nogil=True)
def _head_norm(qkv, lo, hi, d, g, plus, eps):
    """Columns lo..hi of qkv (B, .) normed a head (d values) at a time in place (a QK norm,
    as ``variants.project_qkv``: a contiguous copy of the heads as rows, normed, put back)."""
    b = qkv.shape[0]
    part = np.ascontiguousarray(qkv[:, lo:hi]).reshape(b * (hi - lo) // d, d)
    _norm(part, g, plus, eps, part)
    qkv[:, lo:hi] = part.reshape(b, hi - lo)


@njit(cache=True, nogil=True)
def _nb_block(x, wq, wk, wv, wo, wg, wu, wd, n1, n2, bq, bk, bv, bo, bg, bu, bd, nqn, nkn,
              npa, npm, kc, vc, pos, rot, cos, sin, maskf, window, scale, eps, plus, qk_norm,
              sandwich, past, nh, nkv, d, act, parts):
    """One block on the residual stream x (B, H) in place, for one new token a row at
    position ``past`` (its key and value appended to kc, vc (B, nkv, L, d)): the weights
    ``wq`` .. ``wd`` (out, in; a fused [q | k | v] in wq with wk, wv empty, a fused
    [gate | up] in wg with wu empty), the norm weights ``n1``, ``n2``, the biases ``bq`` .. ``bd``
    (empty: none), with ``qk_norm`` the heads' norms ``nqn``, ``nkn`` (d,), with ``sandwich``
    the norms of the attention's and the MLP's outputs ``npa``, ``npm`` (Gemma's), every
    norm's scale ``1 + w`` when ``plus``; rotary tables ``cos``, ``sin`` when ``rot``, a
    sliding ``window`` (0: none). ``parts``: the GEMV launches' thread counts (q/k/v, o,
    gate/up, down). The kernels and their order are :meth:`CausalLM._block_rows`'s."""
    b, h = x.shape
    nq, nk = nh * d, nkv * d
    fused_gu = wu.shape[0] == 0                     # [gate | up] in wg (Phi-3)
    inter_n = wg.shape[0] // 2 if fused_gu else wg.shape[0]
    a = np.empty((b, h), F32)
    qkv = np.empty((b, nq + 2 * nk), F32)
    q = np.empty((b, nh, 1, d), F32)
    ctx = np.empty((b, nq), F32)
    o = np.empty((b, h), F32)
    gu = np.empty((b, 2 * inter_n), F32)
    inter = np.empty((b, inter_n), F32)
    down = np.empty((b, h), F32)
    _norm(x, n1, plus, eps, a)
    if wk.shape[0] == 0:                            # [q | k | v] in wq (Phi-3)
        _gemv(a, wq, qkv, parts[0])
    else:
        _gemv3(a, wq, wk, wv, qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:], parts[0])
    if qk_norm:                     # biases first, then each head of q and k normed
        if bq.shape[0] > 0:
            for r in range(b):
                for j in range(nq):
                    qkv[r, j] += _widen(bq[j])
                for j in range(nk):
                    qkv[r, nq + j] += _widen(bk[j])
                    qkv[r, nq + nk + j] += _widen(bv[j])
        _head_norm(qkv, 0, nq, d, nqn, plus, eps)
        _head_norm(qkv, nq, nq + nk, d, nkn, plus, eps)
        _nb_rope_split(qkv, bq[:0], bk[:0], bv[:0], pos, cos, sin, nh, nkv, d, rot, q, kc,
                       vc, past)
    else:
        _nb_rope_split(qkv, bq, bk, bv, pos, cos, sin, nh, nkv, d, rot, q, kc, vc, past)
    _nb_attend_one(q, kc, vc, maskf, scale, past, window, ctx)
    _gemv(ctx, wo, o, parts[1])
    if sandwich:                    # Gemma: the output normed, then added (no biases)
        _norm(o, npa, plus, eps, o)
    _resnorm(o, bo, x, n2, plus, eps, a)
    if fused_gu:
        _gemv(a, wg, gu, parts[2])
    else:
        _gemv2(a, wg, wu, gu[:, :inter_n], gu[:, inter_n:], parts[2])
    _nb_gated(gu, bg, bu, act, inter)
    _gemv(inter, wd, down, parts[3])
    if sandwich:
        _norm(down, npm, plus, eps, down)
    _nb_residual_add(down, bd, x)


def _plain(model) -> bool:
    """Whether ``model``'s blocks are the ones :func:`_nb_block` computes (the config and
    the model's settings; the arrays are checked by :func:`run`)."""
    s = model.config
    return (model.kind == "decoder" and model.xp is np and model.dtype == np.float32
            and model.matmul == "float32" and model.storage in ("float32", "bfloat16")
            and model.layout == "out_in" and s.pre_norm and s.norm == "rmsnorm"
            and s.norm_affine and not s.norm_bias and s.gated and s.act in GATED_ACTS
            and not (s.sandwich and (s.o_bias or s.mlp_bias))
            and not s.attn_softcap and not model.lora)


def _layout(model) -> list:
    """(module role, tensor, shape or None when the model has none, ndim) of each array
    :func:`_nb_block` takes a block, in its order: weights (a fused [q | k | v] or
    [gate | up] projection in the place of q or gate, k, v or up then absent), norms,
    biases, head norms, sandwich norms."""
    s, m0 = model.config, model._mods[0]
    h, nq, nk, i_, d = (s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim,
                        s.intermediate_size, s.head_dim)
    out = {"q": nq, "k": nk, "v": nk, "o": h, "gate": i_, "up": i_, "down": h}
    inn = {"q": h, "k": h, "v": h, "o": nq, "gate": h, "up": h, "down": i_}
    bias = {"q": s.qkv_bias, "k": s.qkv_bias, "v": s.qkv_bias, "o": s.o_bias,
            "gate": s.mlp_bias, "up": s.mlp_bias, "down": s.mlp_bias}
    weights = [(r, "weight", (out[r], inn[r]), 2) for r in out]
    if "qkv" in m0:
        weights[0:3] = [("qkv", "weight", (nq + 2 * nk, h), 2), ("k", "weight", None, 2),
                        ("v", "weight", None, 2)]
    if "gate_up" in m0:
        weights[4:6] = [("gate_up", "weight", (2 * i_, h), 2), ("up", "weight", None, 2)]
    return (weights
            + [(r, "weight", (h,), 1) for r in ("norm1", "norm2")]
            + [(r, "bias", (out[r],) if bias[r] else None, 1) for r in out]
            + [(r, "weight", (d,) if s.qk_norm else None, 1) for r in ("qnorm", "knorm")]
            + [(r, "weight", (h,) if s.sandwich else None, 1) for r in ("norm_pa", "norm_pm")])


def _arrays(model):
    """The arrays of :func:`_nb_block` a block (:func:`_layout`; empty arrays for what the
    config has none of), checked once for the arrays ``model.params`` holds now (their
    shapes against the config: Numba does not check bounds; one dtype, float32 or bfloat16
    bits; C order) and kept until an array is replaced; None when they do not fit (then the
    blocks run one by one)."""
    p, lay = model.params, _layout(model)
    now = [p.get(m[r] + "." + t) if r in m else None
           for r, t, shape, _ in lay if shape is not None for m in model._mods]
    kept = model.__dict__.get("_decode_arrays")
    if kept is not None and len(kept[0]) == len(now) and all(map(operator.is_, kept[0], now)):
        return kept[1]
    if now[0] is None:
        return None
    layers, dt = len(model._mods), now[0].dtype
    cols, j, ok = [], 0, True
    for _, _, shape, ndim in lay:
        if shape is None:
            cols.append([np.empty((0,) * ndim, dt)] * layers)
            continue
        col = now[j:j + layers]
        j += layers
        ok = ok and all(isinstance(a, np.ndarray) and a.shape == shape and a.dtype == dt
                        and a.flags.c_contiguous for a in col)
        cols.append(col)
    ok = ok and dt in (np.float32, np.uint16)
    blocks = [tuple(c[i] for c in cols) for i in range(layers)] if ok else None
    model.__dict__["_decode_arrays"] = (now, blocks)
    return blocks


def takes(model) -> bool:
    """Whether ``model``'s generated tokens (one a row, none padded) take the compiled
    blocks (what benchmarks print beside their figures)."""
    return bool(model.decode_compiled and _plain(model) and _arrays(model) is not None)


def run(model, x, maskf, pos, rows, cache, past: int) -> bool:
    """Blocks 0..L-1 of ``model`` on the residual stream x (B, H) for one new token a row,
    as :meth:`CausalLM._blocks` with ``cache`` at ``past`` computes them, one call of
    :func:`_nb_block` a block; True when done, False (nothing done) when it does not take
    them (see the module docstring): the caller then runs the blocks one by one."""
    b, t = pos.shape
    if not (model.decode_compiled and t == 1 and rows is None and b <= GEMV_ROWS
            and cache is not None and _plain(model) and x.dtype == F32
            and x.flags.c_contiguous and not nested()):   # (a part of a split forward:
        return False                                        # no launch of its own)
    blocks = _arrays(model)
    if blocks is None:
        return False
    s = model.config
    tables = {}
    for i in range(len(blocks)):
        rope = s.layer_rope(i)
        if rope is not None and rope not in tables:
            tables[rope] = rope_tables(model, past + 1, rope)
    off = np.zeros((1, 1), F32)
    nh, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
    w = blocks[0]
    parts = np.array([_gemv_parts(w[0].shape[0] + w[1].shape[0] + w[2].shape[0]),
                      _gemv_parts(w[3].shape[0]), _gemv_parts(w[4].shape[0] + w[5].shape[0]),
                      _gemv_parts(w[6].shape[0])], np.int64)
    eps, act = F32(s.norm_eps), GATED_ACTS[s.act]
    for i, w in enumerate(blocks):
        rope = s.layer_rope(i)
        cos, sin = tables[rope] if rope is not None else (off, off)
        scale = model.scale / (i + 1) if s.scale_by_layer else model.scale
        _nb_block(x, *w, cache.k[i], cache.v[i], pos, rope is not None, cos, sin, maskf,
                  int(s.window(i) or 0), F32(scale), eps, s.norm_plus_one, s.qk_norm,
                  s.sandwich, past, nh, nkv, d, act, parts)
    return True
