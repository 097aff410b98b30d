"""Element-wise and row-wise kernels of the transformer forward pass.

Every public function takes arrays of one module ``xp`` (numpy or cupy) and dispatches:
float32 NumPy arrays go to single-threaded ``nogil`` Numba kernels (``fastmath``; threads come
from splitting the batch, see :func:`set_threads`), anything else
(CuPy arrays, float16 storage, bfloat16 bits) to a generic ``xp`` implementation that computes
in float32 and stores in the output's dtype. A uint16 input is bfloat16 bits
(:mod:`semzo.model.storage`) and is upcast exactly where it is read (``_f32``); the models
upcast their bfloat16 weights before calling (``TransformerBase.fparam``), so only
``embed_sum`` (which gathers rows of a table first) sees bits in practice, and a bfloat16
model's activations are float32 NumPy arrays that take the Numba kernels.

Promises (both paths):

- ``layernorm``, ``bias_residual_layernorm`` and ``masked_softmax`` accumulate in float32 and
  use a two-pass (max / mean, then sum) scheme;
- ``masked_softmax`` gives exact zeros at masked keys (and above the diagonal when causal), and
  a row whose keys are all masked becomes all zeros (never NaN);
- GELU (erf form) uses a rational approximation of ``erf`` with absolute error below 5e-7;
  ``exp`` in the CPU softmax is a vectorizable polynomial with relative error below 1e-7.

The Numba kernels use ``fastmath`` (re-association of the row sums), so results are
deterministic on one machine but not bit-identical to a plain sequential sum; the forward
pass does not need bit reproducibility across machines.
"""

from __future__ import annotations

import itertools
import math
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic
from threadpoolctl import ThreadpoolController

from semzo.backend import array_module
from semzo.model.erf import ERF_A, ERF_B
from semzo.model.storage import to_float32

F32 = np.float32

# --------------------------------------------------------------------------- scalar helpers


@intrinsic
def _bits_to_f32(typingctx, x):
    """Reinterpret the low 32 bits of an integer as a float32 (vectorizable bit cast)."""
    if not isinstance(x, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        v = args[0]
        if x.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())

    return types.float32(x), codegen


@intrinsic
def _f32_to_bits(typingctx, x):
    """The bits of a float32 as an int32 (vectorizable bit cast)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.int32(x), codegen


_KEY_MIN = np.int32(-2147483648)


@njit(inline="always", cache=True)
def _order_key(x):
    """An int32 that orders like the float32 x (-0 just below +0). Numba leaves a float max
    reduction scalar, an integer one it vectorizes: row maxima take keys, :func:`_key_value`
    turns the largest back into its float."""
    b = _f32_to_bits(x)
    return b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))


@njit(inline="always", cache=True)
def _key_value(k):
    """The float32 whose :func:`_order_key` is k (the key map is its own inverse)."""
    return _bits_to_f32(k ^ ((k >> np.int32(31)) & np.int32(0x7FFFFFFF)))


@intrinsic
def _bits_to_f64(typingctx, x):
    """Reinterpret a 64-bit integer as a float64 (vectorizable bit cast)."""
    if not isinstance(x, types.Integer) or x.bitwidth != 64:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return types.float64(x), codegen


#: fastmath without the no-NaN / no-inf promises: a NaN logit must still give a NaN loss
SAFE_FAST = {"reassoc", "contract", "nsz", "arcp", "afn"}


@njit(inline="always", fastmath=SAFE_FAST, cache=True, error_model="numpy")
def _dexp(x):
    """exp(x) for float64 x <= 0 (a vectorizable polynomial: no libm call), relative error
    about 3e-16 on [-708, 0] (3.1e-16 measured on [-700, 0]); 0 below -708 (where exp(x) < 3.3e-308). Degree-12 Taylor
    polynomial on |r| <= ln(2) / 2 after x = k ln(2) + r (k integer, Cody-Waite split)."""
    if x < -708.0:
        return 0.0
    k = math.floor(x * 1.4426950408889634 + 0.5)
    r = x - k * 0.6931471803691238
    r = r - k * 1.9082149292705877e-10
    p = 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    return p * _bits_to_f64((np.int64(k) + 1023) << 52)


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _fexp(x):
    """exp(x) for float32, relative error below 1e-7 on [-87, 88] (8.96e-8 measured on a
    dense grid); clamps outside that range. The range reduction x - k ln2 is computed in
    float64 (in float32, a caller's ``fastmath`` re-association would merge a two-constant
    Cody-Waite split: 3.1e-7 measured), the polynomial in float32, the clamps as selects:
    every operation vectorizes."""
    x = x if x > F32(-87.0) else F32(-87.0)   # noqa: FURB136 (a select; Numba's float max
    x = x if x < F32(88.0) else F32(88.0)     # noqa: FURB136  and min are NaN-aware calls)
    k = np.floor(x * F32(1.4426950408889634) + F32(0.5))
    r = F32(np.float64(x) - np.float64(k) * 0.6931471805599453)
    p = F32(1.0 / 5040.0)
    p = p * r + F32(1.0 / 720.0)
    p = p * r + F32(1.0 / 120.0)
    p = p * r + F32(1.0 / 24.0)
    p = p * r + F32(1.0 / 6.0)
    p = p * r + F32(0.5)
    p = p * r + F32(1.0)
    p = p * r + F32(1.0)
    return p * _bits_to_f32((np.int32(k) + np.int32(127)) << np.int32(23))


# erf on [-4, 4]: the rational approximation of semzo.model.erf (the GPU source pastes it too)
_ERF_A, _ERF_B = ERF_A, ERF_B


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _ferf(x):
    x = min(max(x, F32(-4.0)), F32(4.0))
    x2 = x * x
    p = F32(-2.72614225801306e-10)
    p = p * x2 + F32(2.77068142495902e-08)
    p = p * x2 + F32(-2.10102402082508e-06)
    p = p * x2 + F32(-5.69250639462346e-05)
    p = p * x2 + F32(-7.34990630326855e-04)
    p = p * x2 + F32(-2.95459980854025e-03)
    p = p * x2 + F32(-1.60960333262415e-02)
    q = F32(-1.45660718464996e-05)
    q = q * x2 + F32(-2.13374055278905e-04)
    q = q * x2 + F32(-1.68282697438203e-03)
    q = q * x2 + F32(-7.37332916720468e-03)
    q = q * x2 + F32(-1.42647390514189e-02)
    return x * p / q


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _ftanh(x):
    """tanh via the polynomial exp: (1 - e) / (1 + e) with e = exp(-2|x|)."""
    e = _fexp(F32(-2.0) * abs(x))
    t = (F32(1.0) - e) / (F32(1.0) + e)
    return t if x >= 0 else -t


# --------------------------------------------------------------------------- numba kernels

@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_layernorm(x, gamma, beta, eps, out):
    n, h = x.shape
    inv_h = F32(1.0) / F32(h)
    for i in range(n):
        s = F32(0.0)
        for j in range(h):
            s += x[i, j]
        mean = s * inv_h
        v = F32(0.0)
        for j in range(h):
            d = x[i, j] - mean
            v += d * d
        rstd = F32(1.0) / math.sqrt(v * inv_h + eps)
        for j in range(h):
            out[i, j] = (x[i, j] - mean) * rstd * gamma[j] + beta[j]


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_bias_residual_layernorm(x, bias, resid, gamma, beta, eps, out):
    n, h = x.shape
    inv_h = F32(1.0) / F32(h)
    for i in range(n):
        s = F32(0.0)
        for j in range(h):
            t = x[i, j] + bias[j] + resid[i, j]
            resid[i, j] = t
            s += t
        mean = s * inv_h
        v = F32(0.0)
        for j in range(h):
            d = resid[i, j] - mean
            v += d * d
        rstd = F32(1.0) / math.sqrt(v * inv_h + eps)
        for j in range(h):
            out[i, j] = (resid[i, j] - mean) * rstd * gamma[j] + beta[j]


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_bias_act(x, bias, kind):
    n, h = x.shape
    for i in range(n):
        if kind == 0:      # gelu, erf form
            for j in range(h):
                t = x[i, j] + bias[j]
                x[i, j] = F32(0.5) * t * (F32(1.0) + _ferf(t * F32(0.7071067811865476)))
        elif kind == 1:    # gelu, tanh form (gelu_new)
            for j in range(h):
                t = x[i, j] + bias[j]
                u = F32(0.7978845608028654) * (t + F32(0.044715) * t * t * t)
                x[i, j] = F32(0.5) * t * (F32(1.0) + _ftanh(u))
        elif kind == 2:    # relu
            for j in range(h):
                t = x[i, j] + bias[j]
                x[i, j] = t if t > 0 else F32(0.0)
        else:              # identity (bias only)
            for j in range(h):
                x[i, j] = x[i, j] + bias[j]


@njit(inline="always", fastmath=True, cache=True, error_model="numpy")
def _softmax_row(row, lo, hi, keep, mk, scale):
    """Softmax of ``scale * row[lo:hi]`` over the kept keys, in place; zeros elsewhere in row.
    ``keep`` (int32, -1 kept / 0 masked) and ``mk`` (float32, 1 / 0) describe the keys. The
    loops run over slices from 0 (an index Numba cannot prove non-negative costs a gather)."""
    seg, kp, mm = row[lo:hi], keep[lo:hi], mk[lo:hi]
    best = np.int64(_KEY_MIN)
    for j in range(seg.shape[0]):           # the row max over kept keys, as order keys
        best = max(best, (_order_key(seg[j]) & kp[j]) | (_KEY_MIN & ~kp[j]))
    m = _key_value(best) if best != _KEY_MIN else F32(0.0)
    tot = F32(0.0)
    for j in range(seg.shape[0]):
        e = _fexp((seg[j] - m) * scale) * mm[j]
        seg[j] = e
        tot += e
    inv = F32(1.0) / tot if tot > 0 else F32(0.0)
    for j in range(seg.shape[0]):
        seg[j] *= inv
    row[:lo] = F32(0.0)
    row[hi:] = F32(0.0)


@njit(inline="always", cache=True)
def _key_masks(maskf, b, keep, mk):
    """Row b of the 0/1 float mask as the int32 and float32 masks of :func:`_softmax_row`."""
    for j in range(keep.shape[0]):
        on = maskf[b, j] > 0
        keep[j] = np.int32(-1) if on else np.int32(0)
        mk[j] = maskf[b, j] if on else F32(0.0)


@njit(fastmath=True, cache=True, nogil=True, error_model="numpy")
def _nb_masked_softmax(s, maskf, scale, heads, causal):
    """Rows run only up to the last kept key (the entries after it are set to 0): the
    vectorized sum of a row then has the same shape whatever padding follows, so a text's
    probabilities do not depend on the padded length of its batch."""
    g, tq, tk = s.shape
    keep = np.empty(tk, np.int32)
    mk = np.empty(tk, np.float32)
    last = 0
    for gi in range(g):
        if gi % heads == 0:
            _key_masks(maskf, gi // heads, keep, mk)
            last = 0
            for j in range(tk):
                if keep[j] != 0:
                    last = j + 1
        for i in range(tq):
            hi = min(i + 1, tk, last) if causal else last
            _softmax_row(s[gi, i], 0, hi, keep, mk, scale)


@njit(cache=True, nogil=True)
def _nb_embed_sum(ids, word, pos, extra, out):
    b, t = ids.shape
    h = word.shape[1]
    for r in range(b * t):
        bi = r // t
        ti = r - bi * t
        w = ids[bi, ti]
        for j in range(h):
            out[r, j] = word[w, j] + pos[ti, j] + extra[j]


# --------------------------------------------------------------------------- dispatch


def _is_cpu32(*arrays) -> bool:
    return all(isinstance(a, np.ndarray) and a.dtype == F32 for a in arrays)


def _fused():
    """The fused CuPy kernels (:mod:`.kernels_gpu`): imported only with CuPy arrays."""
    from semzo.model import kernels_gpu
    return kernels_gpu


def _f32v(xp, a):
    """``a`` as float32 (bfloat16 bits upcast), the array itself when it is float32."""
    return a if a.dtype == np.float32 else _f32(xp, a)


def _f32(xp, a):
    """float32 values of ``a``: bfloat16 bits (uint16) upcast exactly, others converted."""
    if a.dtype == np.uint16:
        return to_float32(a)
    return a.astype(xp.float32)


def layernorm(x, gamma, beta, eps: float, out=None):
    """LayerNorm over the last axis of ``x`` (N, H) into ``out`` (may be ``x``); returns out."""
    if out is None:
        out = array_module(x).empty_like(x)
    if _is_cpu32(x, gamma, beta, out):
        _nb_layernorm(x, gamma, beta, F32(eps), out)
        return out
    xp = array_module(x)
    if xp is not np and _fused().layernorm(x, _f32v(xp, gamma), _f32v(xp, beta), eps, out):
        return out
    t = x.astype(xp.float32)
    mean = t.mean(axis=-1, keepdims=True)
    t -= mean
    var = (t * t).mean(axis=-1, keepdims=True)
    t *= 1.0 / xp.sqrt(var + xp.float32(eps))
    t = t * _f32(xp, gamma) + _f32(xp, beta)
    out[...] = t.astype(out.dtype, copy=False)
    return out


def bias_residual_layernorm(x, bias, resid, gamma, beta, eps: float, out):
    """``resid += x + bias`` (in place), then ``out = LayerNorm(resid)``; ``out`` may be ``resid``.

    x, resid, out: (N, H); bias, gamma, beta: (H,). Used as the post-LN residual of BERT (out is
    resid) and the pre-LN residual update of GPT-2 (out is the next block's normalized input).
    """
    if _is_cpu32(x, bias, resid, gamma, beta, out):
        _nb_bias_residual_layernorm(x, bias, resid, gamma, beta, F32(eps), out)
        return out
    xp = array_module(resid)
    b = _f32(xp, bias) if bias.dtype == np.uint16 else bias
    if xp is np or not _fused().add_bias(resid, x, _f32v(xp, b)):
        resid += x
        resid += b
    return layernorm(resid, gamma, beta, eps, out)


_ACT = {"gelu": 0, "gelu_new": 1, "gelu_pytorch_tanh": 1, "gelu_fast": 1, "relu": 2, None: 3}
ACTIVATIONS = tuple(k for k in _ACT if k is not None)


def _xp_erf(xp, x):
    x = xp.clip(x, -4.0, 4.0)
    x2 = x * x
    p = xp.full_like(x, _ERF_A[0])
    for c in _ERF_A[1:]:
        p = p * x2 + xp.float32(c)
    q = xp.full_like(x, _ERF_B[0])
    for c in _ERF_B[1:]:
        q = q * x2 + xp.float32(c)
    return x * p / q


def bias_act(x, bias, act: str | None):
    """In place ``x = act(x + bias)`` for x (N, F), bias (F,); act in :data:`ACTIVATIONS` or None."""
    kind = _ACT[act]
    if _is_cpu32(x, bias):
        _nb_bias_act(x, bias, kind)
        return x
    xp = array_module(x)
    if xp is not np and _fused().bias_act(x, _f32v(xp, bias), kind):
        return x
    t = x.astype(xp.float32) + _f32(xp, bias)
    if kind == 0:
        t = 0.5 * t * (1.0 + _xp_erf(xp, t * xp.float32(0.7071067811865476)))
    elif kind == 1:
        t = 0.5 * t * (1.0 + xp.tanh(xp.float32(0.7978845608028654) * (t + 0.044715 * t * t * t)))
    elif kind == 2:
        t = xp.maximum(t, 0)
    x[...] = t.astype(x.dtype, copy=False)
    return x


def masked_softmax(s, maskf, scale: float, heads: int, causal: bool):
    """In place softmax over the last axis of scores ``s`` (B*heads, Tq, Tk), of ``scale * s``.

    ``maskf`` (B, Tk) float32 holds 1 for keys to attend and 0 for padding; ``causal`` also
    masks keys j > i (Tq == Tk). Masked entries become exactly 0.
    """
    if _is_cpu32(s, maskf):
        _nb_masked_softmax(s, maskf, F32(scale), heads, causal)
        return s
    xp = array_module(s)
    g, tq, tk = s.shape
    # (a view only: the kernel must write into s itself)
    if xp is not np and s.flags.c_contiguous and not (causal and tq != tk) and \
            _fused().attn_softmax(s.reshape(g, 1, tq, tk), maskf, scale, heads, 0, 0, causal):
        return s
    b = g // heads
    t = s.astype(xp.float32).reshape(b, heads, tq, tk) * xp.float32(scale)
    keep = (maskf > 0)[:, None, None, :]
    if causal:
        keep = keep & xp.tril(xp.ones((tq, tk), dtype=bool))[None, None]
    t = xp.where(keep, t, xp.float32(-3.0e38))
    t -= t.max(axis=-1, keepdims=True)
    e = xp.exp(t) * keep
    tot = e.sum(axis=-1, keepdims=True)
    e /= xp.where(tot > 0, tot, 1.0)
    s[...] = e.reshape(g, tq, tk).astype(s.dtype, copy=False)
    return s


def embed_sum(ids, word, pos, extra, out):
    """``out[b*T + t] = word[ids[b, t]] + pos[t] + extra`` for ids (B, T); out (B*T, H)."""
    if _is_cpu32(word, pos, extra, out) and isinstance(ids, np.ndarray):
        _nb_embed_sum(ids, word, pos, extra, out)
        return out
    b, t = ids.shape
    h = word.shape[1]
    xp = array_module(word)
    rows = word[ids.reshape(-1)]
    if word.dtype == np.uint16:            # bfloat16 bits: upcast the rows read only
        rows, pos, extra = _f32(xp, rows), _f32(xp, pos[:t]), _f32(xp, extra)
    o = rows.reshape(b, t, h) + pos[:t][None] + extra
    out[...] = o.reshape(b * t, h)
    return out


def matmul_into(a, b, out):
    """``out[...] = a @ b``: NumPy writes straight into ``out`` (which may be a strided view);
    CuPy too for 2-D operands and a C-contiguous ``out`` of the product's dtype (the block
    projections); otherwise it computes, then copies. (The first GPU profile, SmolLM2 64 x 128
    on an H200, 2026-11-27: float32 copies were 16 % of the forward's device time, in part
    these.)"""
    if isinstance(out, np.ndarray):
        return np.matmul(a, b, out=out)
    xp = array_module(a)
    if a.ndim == 2 and b.ndim == 2 and out.flags.c_contiguous and \
            out.dtype == xp.result_type(a.dtype, b.dtype):
        return xp.matmul(a, b, out=out)
    out[...] = xp.matmul(a, b)
    return out


_scratch = threading.local()
SCRATCH_MAX_BYTES = 64 << 20


def scratch(xp, name: str, shape, dtype):
    """An uninitialised ``xp.empty(shape, dtype)`` for a temporary that lives within one call
    (a block's activations): on NumPy, a view of a buffer kept per thread and ``name`` and
    grown to the largest request (up to ``SCRATCH_MAX_BYTES``; larger ones are plain
    allocations), so the forward pass does not map, fault in and give back the same tens of
    megabytes at every block: the page faults cost SmolLM2's 8 x 128 forward 8-12 % of its time
    on 2 cores. Two live temporaries need two names. CuPy has its own memory pool."""
    if xp is not np:
        return xp.empty(shape, dtype)
    views = getattr(_scratch, "views", None)
    if views is None:
        views = _scratch.views = {}
        _scratch.bufs = {}
    # the view of the last such request (a generated token asks the same shapes at every
    # block: 0.3 us instead of 1.3)
    key = (name, shape, dtype, SCRATCH_MAX_BYTES) if type(shape) is tuple else None
    view = views.get(key)
    if view is not None:
        return view
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    if n > SCRATCH_MAX_BYTES:
        return np.empty(shape, dtype)
    bufs = _scratch.bufs
    buf = bufs.get(name)
    if buf is None or buf.nbytes < n:
        buf = bufs[name] = np.empty(max(n, 64) // 64 * 64 + 64, np.uint8)
        for k in [k for k in views if k[0] == name]:     # views of the buffer given up
            del views[k]
    view = buf[:n].view(dtype).reshape(shape)
    if key is not None and len(views) < 4096:
        views[key] = view
    return view


class OutputCache:
    """The array a function returns, reused by its next call when the caller has dropped every
    reference to it (views included: CPython's reference count), else a fresh one. A forward
    that returns 0.2 GB of logits then does not fault the same 0.2 GB in from the kernel at
    every call of an evaluation loop (SmolLM2's LM head at 8 x 128 took 313 ms on memory the
    process kept and 450-500 ms on fresh memory, 2 cores). Keeps at most ``max_bytes``
    (larger arrays are never kept) until the next call; thread-safe."""

    def __init__(self, max_bytes: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self._buf = None
        self._probe = np.empty(0)        # held exactly as _buf is: the count of no caller
        self._lock = threading.Lock()

    def get(self, shape, dtype) -> np.ndarray:
        """An uninitialised C-contiguous NumPy array of ``shape`` and ``dtype``."""
        shape, dtype = tuple(int(d) for d in shape), np.dtype(dtype)
        with self._lock:
            buf, probe = self._buf, self._probe
            # buf and probe are referenced alike here (an attribute, a local, the argument),
            # so whatever the interpreter counts, a caller's reference makes buf's larger
            if buf is not None and buf.shape == shape and buf.dtype == dtype \
                    and sys.getrefcount(buf) <= sys.getrefcount(probe):
                return buf
            self._buf = buf = None
            out = np.empty(shape, dtype)
            if out.nbytes <= self.max_bytes:
                self._buf = out
            return out


_threads = 1
_pool = None
_controller = None


def set_threads(n: int) -> None:
    """Use ``n`` threads for CPU forward passes (default 1).

    A batch of B >= 2 rows is cut into ``min(n, B)`` row blocks run concurrently on ``n``
    Python threads (NumPy's GEMMs and the ``nogil`` Numba kernels release the GIL), with BLAS
    held to one thread meanwhile. Every step of the forward pass, not only the GEMMs, is then
    parallel, and no spinning thread pool competes with another: a 2-thread 16 x 64 MiniLM
    forward with a Numba OpenMP pool next to OpenBLAS's took 459 ms, with multi-threaded BLAS
    and serial kernels 193 ms. With ``n`` = 1 (or a one-row batch) BLAS keeps whatever
    threads the process gave it. Process-wide; not for use from several threads at once.
    """
    global _threads, _pool
    n = max(1, int(n))
    if n != _threads and _pool is not None:
        _pool.shutdown(wait=True)
        _pool = None
    _threads = n


def get_threads() -> int:
    return _threads


def split_slices(n_rows: int, min_rows_tokens: int, tokens_per_row: int,
                 weights=None, parts: int | None = None) -> list[slice]:
    """The row blocks :func:`run_split` would use now (one block when it would not split):
    ``min(threads, n_rows)`` (or ``parts``) contiguous blocks of equal rows, or, given per-row
    ``weights`` (a row's real tokens, say), of about equal weight (each weight counted + 1)."""
    k = min(_threads if parts is None else parts, n_rows)
    if k <= 1 or n_rows * tokens_per_row < min_rows_tokens:
        return [slice(0, n_rows)]
    if weights is None:
        bounds = np.linspace(0, n_rows, k + 1).round().astype(int)
    else:
        c = np.cumsum(np.asarray(weights, np.float64) + 1.0)
        bounds = [0]
        for j in range(1, k):
            goal = c[-1] * j / k
            i = int(np.searchsorted(c, goal))       # c[i - 1] < goal <= c[i]
            b = i if i > 0 and goal - c[i - 1] <= c[i] - goal else i + 1
            bounds.append(min(max(b, bounds[-1] + 1), n_rows - (k - j)))
        bounds.append(n_rows)
    return [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]


_inside = threading.local()       # .busy: this thread runs a part of a run_slices call


def nested() -> bool:
    """True on a thread that runs a part of a :func:`run_slices` call (the pool's threads
    are busy: a kernel must not split again)."""
    return getattr(_inside, "busy", False)


def _part(fn, sl):
    _inside.busy = True
    try:
        return fn(sl)
    finally:
        _inside.busy = False


def run_slices(fn, slices: list[slice]):
    """``[fn(sl) for sl in slices]`` run concurrently as :func:`run_split` does (BLAS at one
    thread meanwhile); one plain call for a single slice or when called from a part of
    another run_slices call (:func:`nested`)."""
    global _pool, _controller
    if len(slices) <= 1 or nested():
        return [fn(s) for s in slices]

    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_threads - 1, thread_name_prefix="semzo-fwd")
    if _controller is None:
        _controller = ThreadpoolController()
    with _controller.limit(limits=1, user_api="blas"):
        futs = [_pool.submit(_part, fn, sl) for sl in slices[1:]]
        first = _part(fn, slices[0])
        return [first] + [f.result() for f in futs]


def run_split(fn, n_rows: int, min_rows_tokens: int, tokens_per_row: int):
    """Run ``fn(row_slice)`` over ``min(threads, n_rows)`` contiguous row blocks concurrently
    (BLAS at one thread meanwhile) and return the list of results in row order; a single
    ``fn(slice(0, n_rows))`` call when threads are 1, the batch has one row, or it has fewer
    than ``min_rows_tokens`` tokens."""
    slices = split_slices(n_rows, min_rows_tokens, tokens_per_row)
    if len(slices) == 1:
        return [fn(slices[0])]
    return run_slices(fn, slices)
