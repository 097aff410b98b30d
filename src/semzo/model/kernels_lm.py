"""Kernels of the spec-driven decoder (:mod:`semzo.model.causal`): RMSNorm, residual updates,
rotary embeddings with the Q/K/V split, grouped-query causal softmax, gated MLP activations.

Same discipline as :mod:`semzo.model.kernels`: float32 NumPy arrays go to single-threaded
``nogil`` Numba kernels (``fastmath``: row sums re-associated; deterministic on one machine),
anything else (CuPy, float16 storage, bfloat16 bits as uint16) to a generic ``xp`` version
computing in float32 and storing in the output's dtype. Threads come from splitting the batch (``kernels.run_split``).
Indices these kernels read (positions) are computed by the model, never read from a file.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from semzo.backend import array_module
from semzo.model.gemm import bf16_input
from semzo.model.gemm_cpu import _widen
from semzo.model.kernels import (
    _KEY_MIN,
    SAFE_FAST,
    _dexp,
    _f32,
    _ferf,
    _fexp,
    _ftanh,
    _fused,
    _is_cpu32,
    _key_masks,
    _key_value,
    _order_key,
    _softmax_row,
    _xp_erf,
    scratch,
)

F32 = np.float32
#: ``fastmath=True`` without ``arcp`` (a division stays a division when vectorized: the same
#: bits as the scalar loop)
EXACT_DIV_FAST = {"nnan", "ninf", "nsz", "contract", "afn", "reassoc"}
#: activation codes of the gated MLP kernel
GATED_ACTS = {"silu": 0, "swish": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2,
              "relu": 3}


@njit(fastmath=True, cache=True, nogil=True)
def _nb_rmsnorm(x, gamma, eps, out):
    """gamma float32 or bfloat16 bits (widened exactly in the loop: the bits of its float32
    upcast, without making one a call)."""
    n, h = x.shape
    for i in range(n):
        s = F32(0.0)
        for j in range(h):
            s += x[i, j] * x[i, j]
        r = F32(1.0) / math.sqrt(s / F32(h) + eps)
        for j in range(h):
            out[i, j] = _widen(gamma[j]) * (x[i, j] * r)


@njit(fastmath=True, cache=True, nogil=True)
def _nb_residual_rmsnorm(x, bias, resid, gamma, eps, out):
    n, h = x.shape
    hb = bias.shape[0] > 0
    for i in range(n):
        s = F32(0.0)
        for j in range(h):
            t = resid[i, j] + x[i, j]
            if hb:
                t += _widen(bias[j])
            resid[i, j] = t
            s += t * t
        r = F32(1.0) / math.sqrt(s / F32(h) + eps)
        for j in range(h):
            out[i, j] = _widen(gamma[j]) * (resid[i, j] * r)


@njit(fastmath=True, cache=True, nogil=True)
def _nb_residual_add(x, bias, resid):
    n, h = x.shape
    hb = bias.shape[0] > 0
    for i in range(n):
        for j in range(h):
            t = resid[i, j] + x[i, j]
            if hb:
                t += _widen(bias[j])
            resid[i, j] = t


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_residual_add_t(xt, resid):
    """``resid += xt.T`` for xt (H, N), resid (N, H), in tiles of 16 rows of resid (one cache
    line of xt per column): 0.21 ms for SmolLM2's 512 x 576 against NumPy's 0.65 ms."""
    h, n = xt.shape
    for i0 in range(0, n, 16):
        i1 = min(i0 + 16, n)
        for j in range(h):
            for i in range(i0, i1):
                resid[i, j] += xt[j, i]


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_rope_split(qkv, bq, bk, bv, pos, cos, sin, nh, nkv, d, rot, q, k, v, past):
    """Each head's row as 1-D views with the branches (bias, rotation, q or k) outside the
    loops over a head's dims, which then vectorize; loops run from 0 over slices (an index
    Numba cannot prove non-negative costs a gather). SmolLM2 at 512 tokens: 0.18 ms a call
    against 0.36-0.75 ms with the branches inside one loop (2026-11-28, AMD EPYC); the same
    bits."""
    b_, t_ = pos.shape
    half = cos.shape[1] if rot else d // 2      # partial rotary: dims 2*half.. pass through
    hb = bq.shape[0] > 0
    lo = 2 * half if rot else 0
    for b in range(b_):
        for t in range(t_):
            r = b * t_ + t
            p = pos[b, t]
            cs = cos[p]
            sn = sin[p]
            for hh in range(nh + nkv):
                src = qkv[r, hh * d:(hh + 1) * d]
                if hh < nh:
                    dst = q[b, hh, t]
                    bias = bq[hh * d:(hh + 1) * d]
                else:
                    dst = k[b, hh - nh, past + t]
                    bias = bk[(hh - nh) * d:(hh - nh + 1) * d]
                if rot and hb:
                    for j in range(half):
                        x1 = src[j] + _widen(bias[j])
                        x2 = src[j + half] + _widen(bias[j + half])
                        dst[j] = x1 * cs[j] - x2 * sn[j]
                        dst[j + half] = x2 * cs[j] + x1 * sn[j]
                elif rot:
                    for j in range(half):
                        x1 = src[j]
                        x2 = src[j + half]
                        dst[j] = x1 * cs[j] - x2 * sn[j]
                        dst[j + half] = x2 * cs[j] + x1 * sn[j]
                _copy_bias(src[lo:], bias[lo:] if hb else bias, hb, dst[lo:])
            for hh in range(nkv):
                col = (nh + nkv + hh) * d
                _copy_bias(qkv[r, col:col + d], bv[hh * d:(hh + 1) * d] if hb else bv, hb,
                           v[b, hh, past + t])


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _copy_bias(src, bias, hb, dst):
    """``dst[:] = src (+ bias)`` over 1-D views from 0."""
    if hb:
        for j in range(dst.shape[0]):
            dst[j] = src[j] + _widen(bias[j])
    else:
        for j in range(dst.shape[0]):
            dst[j] = src[j]


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_attn_softmax(s, maskf, scale, nkv, past, window):
    g_, grp, tq, tk = s.shape
    keep = np.empty(tk, np.int32)
    mk = np.empty(tk, np.float32)
    for gi in range(g_):
        if gi % nkv == 0:
            _key_masks(maskf, gi // nkv, keep, mk)
        for hq in range(grp):
            for i in range(tq):
                qi = past + i
                hi = min(qi + 1, tk)
                lo = max(0, qi - window + 1) if window > 0 else 0
                _softmax_row(s[gi, hq, i], lo, hi, keep, mk, scale)


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_attend_one(q, kc, vc, maskf, scale, past, window, ctx):
    """Attention of one new token a row: q (B, nh, 1, d) against keys and values 0..past of
    kc, vc (B, nkv, L, d) into ctx (B, nh d). Each score a dot product over d, the softmax of
    :func:`_softmax_row` (causal by construction, key mask, sliding window), each context
    element a sum over the keys in their order: one call for what took two batched matmuls
    and the softmax call a block."""
    b_, nh = q.shape[0], q.shape[1]
    d = q.shape[3]
    g = nh // kc.shape[1]
    tk = past + 1
    lo = max(0, past - window + 1) if window > 0 else 0
    keep = np.empty(tk, np.int32)
    mk = np.empty(tk, np.float32)
    row = np.empty(tk, np.float32)
    for b in range(b_):
        _key_masks(maskf, b, keep, mk)
        for h in range(nh):
            qh = q[b, h, 0]
            kk = kc[b, h // g]
            for j in range(tk):
                kj = kk[j]
                acc = F32(0.0)
                for e in range(d):
                    acc += qh[e] * kj[e]
                row[j] = acc
            _softmax_row(row, lo, tk, keep, mk, scale)
            out = ctx[b, h * d:(h + 1) * d]
            out[:] = F32(0.0)
            vv = vc[b, h // g, lo:tk]
            ps = row[lo:tk]
            for j in range(vv.shape[0]):
                p = ps[j]
                vj = vv[j]
                for e in range(d):
                    out[e] += p * vj[e]


@njit(inline="always", fastmath=True, cache=True)
def _act(x, kind):
    if kind == 0:
        return x / (F32(1.0) + _fexp(-x))
    if kind == 1:
        return F32(0.5) * x * (F32(1.0) + _ferf(x * F32(0.7071067811865476)))
    if kind == 2:
        return F32(0.5) * x * (F32(1.0) + _ftanh(F32(0.7978845608028654) *
                                                 (x + F32(0.044715) * x * x * x)))
    return x if x > 0 else F32(0.0)


@njit(fastmath=EXACT_DIV_FAST, cache=True, nogil=True, error_model="numpy")
def _nb_gated(gu, bg, bu, kind, out):
    """``error_model="numpy"``: Python's error model checks every division for a zero divisor,
    which kept the loops scalar (SwiGLU on 512 x 1536: 1.05 ms; GELU 2.5 ms, tanh GELU 5.2 ms;
    now 0.48, 0.86 and 0.83 ms, 2026-11-28, AMD EPYC); ``EXACT_DIV_FAST``: without ``arcp``
    the vectorized division stays a division (a reciprocal estimate would move 0.4 % of the
    outputs by an ulp), so the bits are those of the scalar loops."""
    n, i2 = gu.shape
    m = i2 // 2
    if bg.shape[0] > 0:                  # biases: add them in place first (rare: mlp_bias)
        for r in range(n):
            for j in range(m):
                gu[r, j] += _widen(bg[j])
                gu[r, m + j] += _widen(bu[j])
    for r in range(n):                   # one branch-free loop per kind, so LLVM vectorizes
        o = out[r]
        g = gu[r, :m]
        u = gu[r, m:]
        if kind == 0:                    # exp in its own loop: both loops vectorize
            for j in range(m):
                o[j] = _fexp(-g[j])
            for j in range(m):
                o[j] = g[j] / (F32(1.0) + o[j]) * u[j]
        elif kind != 3:
            for j in range(m):
                o[j] = _act(g[j], kind) * u[j]
        else:
            for j in range(m):
                x = g[j]
                o[j] = (x if x > 0 else F32(0.0)) * u[j]


# --------------------------------------------------------------------------- dispatch

def _empty_like_bias(x, bias):
    return bias if bias is not None else np.empty(0, F32)


def _cpu_gamma(g) -> bool:
    """A norm weight the CPU kernels take: float32, or bfloat16 bits (widened in the loop)."""
    return isinstance(g, np.ndarray) and (g.dtype == F32 or g.dtype == np.uint16)


def rmsnorm(x, gamma, eps: float, out, bits=None):
    """``out = gamma * x / sqrt(mean(x**2) + eps)`` over the last axis of x (N, H); gamma
    float32 or bfloat16 bits. ``bits``: a uint16 (N, H) that also receives the bfloat16 bits
    of out (:func:`semzo.model.gemm.bf16_input`'s, the projections' input of
    model.matmul = "bfloat16"; on the GPU written by the same kernel)."""
    if _is_cpu32(x, out) and _cpu_gamma(gamma):
        _nb_rmsnorm(x, gamma, F32(eps), out)
        return with_bf16_bits(out, bits)
    xp = array_module(x)
    if xp is not np and _fused().rmsnorm(x, gamma, eps, out, bits):
        return out
    t = x.astype(xp.float32)
    t *= 1.0 / xp.sqrt((t * t).mean(axis=-1, keepdims=True) + xp.float32(eps))
    out[...] = (_f32(xp, gamma) * t).astype(out.dtype, copy=False)
    return with_bf16_bits(out, bits)


def residual_rmsnorm(x, bias, resid, gamma, eps: float, out, bits=None):
    """``resid += x (+ bias)`` in place, then ``out = rmsnorm(resid)`` (``bits``: as
    :func:`rmsnorm`); on the GPU without a bias one reduction and one kernel in all."""
    if _is_cpu32(x, resid, out) and _cpu_gamma(gamma) and (bias is None or _is_cpu32(bias)):
        _nb_residual_rmsnorm(x, _empty_like_bias(x, bias), resid, gamma, F32(eps), out)
        return with_bf16_bits(out, bits)
    if bias is None and array_module(x) is not np and \
            _fused().rmsnorm(x, gamma, eps, out, bits, resid=resid):
        return out
    residual_add(x, bias, resid)
    return rmsnorm(resid, gamma, eps, out, bits)


def with_bf16_bits(out, bits):
    """``bits[...] = bf16_input(out)`` when bits is given; returns out."""
    if bits is not None:
        bits[...] = bf16_input(out)
    return out


def residual_add(x, bias, resid):
    """``resid += x (+ bias)`` in place; x, resid (N, H), bias (H,) or None."""
    if _is_cpu32(x, resid) and (bias is None or _is_cpu32(bias)):
        _nb_residual_add(x, _empty_like_bias(x, bias), resid)
        return resid
    resid += x
    if bias is not None:
        resid += _f32(array_module(bias), bias) if bias.dtype == np.uint16 else bias
    return resid


def residual_add_t(xt, resid):
    """``resid += xt.T`` in place: xt (H, N), resid (N, H) (the transposed MLP's output,
    :meth:`semzo.model.causal.CausalLM._mlp_transposed`); the same additions, hence the same
    bits, as :func:`residual_add` of ``xt.T``."""
    if _is_cpu32(xt, resid):
        _nb_residual_add_t(xt, resid)
    else:
        resid += xt.T
    return resid


def rope_split(qkv, biases, pos, cos, sin, nh: int, nkv: int, d: int, q, k, v, past: int,
               rows=None):
    """Split ``qkv`` (B*T, (nh + 2 nkv) d) = [q | k | v] columns into ``q`` (B, nh, T, d) and
    ``k``, ``v`` (B, nkv, Tc, d) at rows ``past .. past+T-1``, adding the biases
    ``(bq, bk, bv)`` (or None) and rotating q and k by the angles of ``pos`` (B, T) (row
    indices into ``cos``/``sin`` (P, r/2): the first r dims of a head rotate, the others pass
    through (partial rotary); ``cos`` None: no rotation). ``rows``: ``qkv`` holds only these
    rows (sorted int64 indices into B*T) of the padded layout, whose other rows are zeros
    (the GPU's kernel reads them in place; elsewhere they are scattered into a zeroed
    scratch array first)."""
    if rows is not None:
        xp = array_module(qkv)
        if xp is not np and _fused().rope_split(qkv, biases, pos, cos, sin, nh, nkv, d, q,
                                                k, v, past, rows):
            return
        full = scratch(xp, "full", (pos.shape[0] * pos.shape[1], qkv.shape[1]), qkv.dtype)
        full.fill(0)
        full[rows] = qkv
        qkv = full
    bq, bk, bv = biases if biases is not None else (None, None, None)
    rot = cos is not None
    arrays = [qkv, q, k, v] + ([bq, bk, bv] if bq is not None else [])
    if _is_cpu32(*arrays) and isinstance(pos, np.ndarray):
        e = np.empty(0, F32)
        c = cos if rot else np.zeros((1, 1), F32)
        s = sin if rot else np.zeros((1, 1), F32)
        _nb_rope_split(qkv, bq if bq is not None else e, bk if bk is not None else e,
                       bv if bv is not None else e, pos, c, s, nh, nkv, d, rot, q, k, v, past)
        return
    xp = array_module(qkv)
    if xp is not np and _fused().rope_split(qkv, biases, pos, cos, sin, nh, nkv, d, q, k, v,
                                            past):
        return
    b, t = pos.shape
    x = qkv.astype(xp.float32).reshape(b, t, nh + 2 * nkv, d)
    if bq is not None:
        x = x + _f32(xp, xp.concatenate([bq, bk, bv])).reshape(nh + 2 * nkv, d)
    qk = x[:, :, :nh + nkv]
    if rot:
        c = xp.asarray(cos)[pos][:, :, None, :]          # (B, T, 1, d/2)
        s = xp.asarray(sin)[pos][:, :, None, :]
        h2 = c.shape[-1]
        x1, x2 = qk[..., :h2], qk[..., h2:2 * h2]
        qk = xp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s, qk[..., 2 * h2:]], axis=-1)
    q[...] = qk[:, :, :nh].transpose(0, 2, 1, 3).astype(q.dtype, copy=False)
    k[:, :, past:past + t] = qk[:, :, nh:].transpose(0, 2, 1, 3).astype(k.dtype, copy=False)
    v[:, :, past:past + t] = x[:, :, nh + nkv:].transpose(0, 2, 1, 3).astype(v.dtype, copy=False)


def heads_to_rows(tmp, rows, t: int, g: int, out, bits=None):
    """``out`` (nr, nkv g d) = attention's context as rows of the o projection's input, from
    its batched product's layout ``tmp`` (B, nkv, g T, d): row b T + t, head kv g + gg =
    tmp[b, kv, gg T + t]; only the rows ``rows`` (sorted int64 indices into B*T; None: all).
    Copies only: the same bits on every path. ``bits``: as :func:`gated_act`'s. Returns
    ``out``."""
    xp = array_module(tmp)
    if xp is not np and _fused().heads_to_rows(tmp, rows, t, g, out, bits):
        return out
    b, nkv, _, d = tmp.shape
    full = tmp.reshape(b, nkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b * t, nkv * g * d)
    out[...] = full if rows is None else full[rows]
    return with_bf16_bits(out, bits)


def attn_softmax(s, maskf, scale: float, nkv: int, past: int, window: int | None):
    """In place softmax of ``scale * s`` over the last axis, ``s`` (B*nkv, g, Tq, Tk) holding
    the scores of query ``past + i`` against keys 0..Tk-1: keys after the query (causal),
    keys at or before ``query - window`` (sliding window) and keys with ``maskf`` (B, Tk) 0 get
    exact zeros; a row with no key left becomes zeros."""
    w = int(window or 0)
    if _is_cpu32(s, maskf):
        _nb_attn_softmax(s, maskf, F32(scale), nkv, past, w)
        return s
    xp = array_module(s)
    if xp is not np and _fused().attn_softmax(s, maskf, scale, nkv, past, w):
        return s
    g, grp, tq, tk = s.shape
    b = g // nkv
    qi = xp.arange(tq)[:, None] + past
    kj = xp.arange(tk)[None, :]
    keep = kj <= qi
    if w > 0:
        keep &= kj > qi - w
    keep = keep[None, None, None] & (maskf > 0)[:, None, None, None, :]
    t = s.astype(xp.float32).reshape(b, nkv, grp, tq, tk) * xp.float32(scale)
    t = xp.where(keep, t, xp.float32(-3.0e38))
    t -= t.max(axis=-1, keepdims=True)
    e = xp.exp(t) * keep
    tot = e.sum(axis=-1, keepdims=True)
    e /= xp.where(tot > 0, tot, 1.0)
    s[...] = e.reshape(g, grp, tq, tk).astype(s.dtype, copy=False)
    return s


def attend_one_usable(q, kc, vc, maskf, ctx) -> bool:
    """True when :func:`attend_one` takes these operands: float32 NumPy arrays, one query a
    row, the layouts it reads (contiguous last axes)."""
    return (_is_cpu32(q, kc, vc, maskf, ctx) and q.shape[2] == 1 and q.flags.c_contiguous
            and kc.strides[3] == 4 and vc.strides[3] == 4 and ctx.flags.c_contiguous)


def attend_one(q, kc, vc, maskf, scale: float, past: int, window: int | None, ctx):
    """``ctx`` (B, nh d) = softmax(scale q k^T) v for one new token a row at position
    ``past`` (:func:`_nb_attend_one`; :func:`attend_one_usable`): the masks of
    :func:`attn_softmax`. The shapes are checked first (the kernel does not check bounds).
    Returns ctx."""
    b, nh, _, d = q.shape
    if not (kc.shape == vc.shape and kc.shape[0] == b and kc.shape[3] == d
            and kc.shape[2] > past >= 0 and nh % kc.shape[1] == 0
            and maskf.shape[0] == b and maskf.shape[1] > past and ctx.shape == (b, nh * d)):
        raise ValueError(f"attend_one: q {q.shape}, keys {kc.shape}, values {vc.shape}, "
                         f"mask {maskf.shape}, out {ctx.shape} at position {past}")
    _nb_attend_one(q, kc, vc, maskf, F32(scale), past, int(window or 0), ctx)
    return ctx


def gated_act(gu, bg, bu, act: str, out, bits=None):
    """``out = act(gate) * up`` with ``gu`` (N, 2I) = [gate | up] (+ biases ``bg``, ``bu`` or
    None); out (N, I). ``bits``: a uint16 (N, I) that receives the bfloat16 bits of out too
    (the down projection's input under model.matmul = "bfloat16"; on the GPU written by the
    same kernel)."""
    kind = GATED_ACTS[act]
    if _is_cpu32(gu, out) and (bg is None or _is_cpu32(bg, bu)):
        e = np.empty(0, F32)
        _nb_gated(gu, e if bg is None else bg, e if bu is None else bu, kind, out)
        return with_bf16_bits(out, bits)
    xp = array_module(gu)
    if xp is not np and bg is None and _fused().gated(gu, kind, out, bits):
        return out
    _gated_xp(xp, gu, bg, bu, kind, out)
    return with_bf16_bits(out, bits)


def _gated_xp(xp, gu, bg, bu, kind: int, out) -> None:
    """:func:`gated_act` as a chain of ``xp`` operations (CuPy without the fused kernel)."""
    m = gu.shape[1] // 2
    g = gu[:, :m].astype(xp.float32)
    u = gu[:, m:].astype(xp.float32)
    if bg is not None:
        g += _f32(xp, bg)
        u += _f32(xp, bu)
    if kind == 0:
        g = g / (1.0 + xp.exp(-g))
    elif kind == 1:
        g = 0.5 * g * (1.0 + _xp_erf(xp, g * xp.float32(0.7071067811865476)))
    elif kind == 2:
        g = 0.5 * g * (1.0 + xp.tanh(xp.float32(0.7978845608028654) * (g + 0.044715 * g ** 3)))
    else:
        g = xp.maximum(g, 0)
    out[...] = (g * u).astype(out.dtype, copy=False)


@njit(fastmath=SAFE_FAST, cache=True, nogil=True, error_model="numpy")
def _nb_token_nll(z, labels, nll, hit):
    """Per row of float32 logits z (N, V): nll[i] = logsumexp(z[i]) - z[i, labels[i]] and
    hit[i] = 1.0 when labels[i] is the first maximal index, else 0.0 (float64 arithmetic).
    Labels were checked by the caller. The row max is taken over integer order keys (a
    vectorized reduction); the first maximal index is searched only when the label's logit
    equals the max. A NaN logit gives a NaN loss."""
    n, v = z.shape
    for i in range(n):
        row = z[i]
        best = np.int64(_KEY_MIN)
        for j in range(v):
            best = max(best, _order_key(row[j]))
        m = _key_value(best)
        lab = labels[i]
        first = row[lab] == m
        if first:
            for j in range(lab):
                if row[j] == m:
                    first = False
                    break
        m64 = np.float64(m)
        s = 0.0
        for j in range(v):
            s += _dexp(np.float64(row[j]) - m64)
        nll[i] = m64 + math.log(s) - np.float64(row[lab])
        hit[i] = 1.0 if first else 0.0


def token_nll(z, labels, nll, hit) -> None:
    """Per-row cross-entropy ``nll`` (float64, (N,)) and top-1 hit ``hit`` (float64 0/1) of
    float32 NumPy logits ``z`` (N, V) against ``labels`` (N,) int64, each in [0, V) (checked
    here: the kernel indexes with them). Single-threaded, ``nogil``."""
    lab = np.ascontiguousarray(labels, dtype=np.int64)
    if lab.size and (int(lab.min()) < 0 or int(lab.max()) >= z.shape[1]):
        raise ValueError(f"target id outside [0, {z.shape[1]})")
    _nb_token_nll(np.ascontiguousarray(z, dtype=np.float32), lab, nll, hit)
