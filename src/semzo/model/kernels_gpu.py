"""Fused CuPy kernels of the decoder's forward (:mod:`semzo.model.kernels_lm` on the GPU).

The generic ``xp`` versions in :mod:`.kernels_lm` spell each kernel as a chain of CuPy array
operations: the first GPU profile (SmolLM2 64 x 128, bfloat16 storage, an H200, 2026-11-27)
counted 3499 kernels per three forwards, 16 % of the device time in float32 copies and a
third in short elementwise kernels. Here each chain is one kernel: the rotary split into
q / k / v (one launch per destination instead of about fifteen), the gated activation (one
instead of six, reading gate and up in place), RMSNorm (a sum-of-squares reduction, then one
kernel) and the attention softmax (mask-and-scale, exp, divide around CuPy's own max and sum
reductions, instead of about twelve with a boolean mask the size of the scores).

The arithmetic is the ``xp`` version's, operation for operation and in the same order, and
the source is compiled with ``--fmad=false`` (no multiply-add contracted), so an elementwise
kernel gives the bits the chain of CuPy kernels gives; the reductions are CuPy's. The same
source compiles as plain C (the ``LM_*`` macros turn each grid-stride loop into a serial
loop): ``tests/test_kernels_gpu.py`` builds it with gcc and checks every kernel against the
``xp`` version on the CPU.

Only float32 activations take these kernels (every storage but float16 computes in float32);
anything else, and every case the kernels do not cover (biases on the gated MLP, the erf
GELU), keeps the ``xp`` version. ``SEMZO_GPU_FUSED=0`` turns them off (the A/B of the
benchmarks). If the module does not compile on a machine, a warning says why once and the
``xp`` versions serve. Imported only with CuPy arrays at hand; it imports cupy only then.
"""

from __future__ import annotations

import functools
import os
import warnings

import numpy as np

from semzo.model.erf import ERF_A, ERF_B
from semzo.model.storage import to_float32

THREADS_PER_BLOCK = 256
KERNELS = ("lm_rmsnorm_apply2", "lm_gated", "lm_rope_split", "lm_softmax_scale",
           "lm_softmax_exp", "lm_softmax_div", "lm_center", "lm_layernorm_apply",
           "lm_add_bias", "lm_bias_act", "lm_to_bf16")
MAX_BLOCKS = 65535

_SOURCE = r"""
// semzo decoder kernels (generated from semzo/model/kernels_gpu.py)
#ifdef __CUDACC__
#define LM_GLOBAL extern "C" __global__ void
#define LM_DEV __device__ __forceinline__
#define LM_FOR(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
                          i < (n); i += (long long)blockDim.x * gridDim.x)
#else
#include <math.h>
#include <string.h>
#define LM_GLOBAL void
#define LM_DEV inline
#define LM_FOR(i, n) for (long long i = 0; i < (n); ++i)
#endif

#ifdef __CUDACC__
LM_DEV unsigned int lm_f2u(float x) { return __float_as_uint(x); }
LM_DEV float lm_u2f(unsigned int u) { return __uint_as_float(u); }
#else
LM_DEV unsigned int lm_f2u(float x) { unsigned int u; memcpy(&u, &x, sizeof u); return u; }
LM_DEV float lm_u2f(unsigned int u) { float x; memcpy(&x, &u, sizeof x); return x; }
#endif

// the bfloat16 bits of v, rounded to nearest even; a NaN stays a quiet NaN
// (semzo.model.storage.to_bits)
LM_DEV unsigned short lm_bf16(float v) {
  unsigned int u = lm_f2u(v);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    return (unsigned short)((u >> 16) | 0x40u);
  }
  return (unsigned short)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// out[i] = the bfloat16 bits of x[i]: the activations of model.matmul = "bfloat16"
LM_GLOBAL lm_to_bf16(const float* x, unsigned short* out, long long n) {
  LM_FOR(i, n) {
    out[i] = lm_bf16(x[i]);
  }
}

// y[r, j] = x[r, j], or with res: y = resid[r, j] + x[r, j], written back to resid;
// out[r, j] = g[j] * (y * (1 / sqrt(ss[r] / h + eps))) with g float32 (gf) or bfloat16 bits
// (gb, when gbits); with bits also ob[r, j] = the bfloat16 bits of out[r, j] (the input of
// model.matmul = "bfloat16"'s projections). x, resid, out, ob (rows, h); out may be x or resid.
LM_GLOBAL lm_rmsnorm_apply2(const float* x, float* resid, int res, const float* ss,
                            const float* gf, const unsigned short* gb, int gbits, float* out,
                            unsigned short* ob, int bits, long long rows, int h, float eps) {
  LM_FOR(i, rows * (long long)h) {
    long long r = i / h;
    int j = (int)(i - r * h);
    float y = x[i];
    if (res) {
      y = resid[i] + y;
      resid[i] = y;
    }
    float inv = 1.0f / sqrtf(ss[r] / (float)h + eps);
    float g = gbits ? lm_u2f(((unsigned int)gb[j]) << 16) : gf[j];
    float v = g * (y * inv);
    out[i] = v;
    if (bits) {
      ob[i] = lm_bf16(v);
    }
  }
}

// out[r, j] = act(gu[r, j]) * gu[r, m + j]; gu (rows, 2m), out (rows, m)
// kind 0: silu, 2: tanh GELU, 3: relu
LM_GLOBAL lm_gated(const float* gu, float* out, long long rows, int m, int kind) {
  LM_FOR(i, rows * (long long)m) {
    long long r = i / m;
    int j = (int)(i - r * m);
    float g = gu[r * 2 * m + j];
    float u = gu[r * 2 * m + m + j];
    float a;
    if (kind == 0) {
      a = g / (1.0f + expf(-g));
    } else if (kind == 2) {
      float g3 = (g * g) * g;
      a = (0.5f * g) * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g3)));
    } else {
      a = (g > 0.0f || g != g) ? g : 0.0f;   // NaN passes, as xp.maximum's
    }
    out[i] = a * u;
  }
}

// dst[b, hh, past + t, j] = (rotated) qkv[b * T + t, (off + hh) * d + j] (+ bias[...]);
// qkv (B*T, wcols); dst (B, heads, dlen, d) C-contiguous; pos (B, T); cos, sin (P, h2).
// rot: rotate the first 2 h2 dims of each head (h2 = 0: none).
LM_GLOBAL lm_rope_split(const float* qkv, const float* bias, int has_bias,
                        const long long* pos, const float* cs, const float* sn, int h2,
                        float* dst, long long b, int t, int heads, int d, int wcols, int off,
                        long long dlen, long long past) {
  LM_FOR(i, b * heads * (long long)t * d) {
    long long r = i / d;
    int jd = (int)(i - r * d);
    int tt = (int)(r % t);
    r /= t;
    int hh = (int)(r % heads);
    long long bb = r / heads;
    long long col = (long long)(off + hh) * d;
    const float* src = qkv + (bb * t + tt) * (long long)wcols + col;
    float x = src[jd];
    if (has_bias) x = x + bias[col + jd];
    float v = x;
    if (jd < 2 * h2) {
      long long p = pos[bb * t + tt];
      if (jd < h2) {
        float x2 = src[jd + h2];
        if (has_bias) x2 = x2 + bias[col + jd + h2];
        v = x * cs[p * h2 + jd] - x2 * sn[p * h2 + jd];
      } else {
        int jj = jd - h2;
        float x1 = src[jj];
        if (has_bias) x1 = x1 + bias[col + jj];
        v = x * cs[p * h2 + jj] + x1 * sn[p * h2 + jj];
      }
    }
    dst[((bb * heads + hh) * dlen + past + tt) * d + jd] = v;
  }
}

// the softmax's key mask of score i of s (rows, tk), row r = ((bn * grp + g) * tq + qt),
// bn = b * nkv + kv: key j kept when maskf[b, j] > 0 and, if causal, j <= past + qt and
// j > past + qt - w (w > 0)
#define LM_KEEP(i)                                                           \
  long long r = (i) / tk;                                                    \
  int j = (int)((i) - r * tk);                                               \
  long long qi = r % tq + past;                                              \
  long long bb = r / ((long long)tq * bdiv);                                 \
  int keep = (!causal || (j <= qi && (w <= 0 || j > qi - w))) &&             \
             maskf[bb * tk + j] > 0.0f;

// s = keep ? s * scale : -3e38 (in place); bdiv = grp * nkv
LM_GLOBAL lm_softmax_scale(float* s, const float* maskf, long long rows, int tq, int tk,
                           long long bdiv, long long past, int w, int causal, float scale) {
  LM_FOR(i, rows * (long long)tk) {
    LM_KEEP(i)
    s[i] = keep ? s[i] * scale : -3.0e38f;
  }
}

// s = keep ? exp(s - mx[r]) : 0 (in place)
LM_GLOBAL lm_softmax_exp(float* s, const float* mx, const float* maskf, long long rows,
                         int tq, int tk, long long bdiv, long long past, int w, int causal) {
  LM_FOR(i, rows * (long long)tk) {
    LM_KEEP(i)
    s[i] = keep ? expf(s[i] - mx[r]) : 0.0f;
  }
}

// s /= (tot[r] > 0 ? tot[r] : 1) (in place)
LM_GLOBAL lm_softmax_div(float* s, const float* tot, long long rows, int tk) {
  LM_FOR(i, rows * (long long)tk) {
    long long r = i / tk;
    float t = tot[r];
    s[i] = s[i] / (t > 0.0f ? t : 1.0f);
  }
}

// ---- the encoder's (and GPT-2's) LayerNorm, bias + residual, bias + activation
// d[r, j] = x[r, j] - mean[r] (d may be x)
LM_GLOBAL lm_center(const float* x, const float* mean, float* d, long long rows, int h) {
  LM_FOR(i, rows * (long long)h) {
    d[i] = x[i] - mean[i / h];
  }
}

// out[r, j] = (d[r, j] * (1 / sqrt(ss[r] / h + eps))) * g[j] + b[j] (out may be d)
LM_GLOBAL lm_layernorm_apply(const float* d, const float* ss, const float* g, const float* b,
                             float* out, long long rows, int h, float eps) {
  LM_FOR(i, rows * (long long)h) {
    long long r = i / h;
    int j = (int)(i - r * h);
    float inv = 1.0f / sqrtf(ss[r] / (float)h + eps);
    out[i] = (d[i] * inv) * g[j] + b[j];
  }
}

// resid[r, j] = (resid[r, j] + x[r, j]) + bias[j]
LM_GLOBAL lm_add_bias(float* resid, const float* x, const float* bias, long long rows, int h) {
  LM_FOR(i, rows * (long long)h) {
    long long r = i / h;
    int j = (int)(i - r * h);
    resid[i] = (resid[i] + x[i]) + bias[j];
  }
}

// kernels._xp_erf: a rational function of x clipped to [-4, 4]
static LM_DEV float lm_erf(float x) {
  x = x < -4.0f ? -4.0f : (x > 4.0f ? 4.0f : x);
  float x2 = x * x;
  float p = @ERF_A0@;
@ERF_P@
  float q = @ERF_B0@;
@ERF_Q@
  return (x * p) / q;
}

// x[r, j] = act(x[r, j] + bias[j]) in place; kind 0: erf GELU, 1: tanh GELU, 2: relu, 3: none
LM_GLOBAL lm_bias_act(float* x, const float* bias, long long rows, int f, int kind) {
  LM_FOR(i, rows * (long long)f) {
    long long r = i / f;
    int j = (int)(i - r * f);
    float t = x[i] + bias[j];
    if (kind == 0) {
      t = (0.5f * t) * (1.0f + lm_erf(t * 0.7071067811865476f));
    } else if (kind == 1) {
      t = (0.5f * t) * (1.0f + tanhf(0.7978845608028654f * (t + ((0.044715f * t) * t) * t)));
    } else if (kind == 2) {
      t = (t > 0.0f || t != t) ? t : 0.0f;
    }
    x[i] = t;
  }
}
"""


def _f32_literal(c: float) -> str:
    """A C float literal of ``np.float32(c)`` (the xp version's constant), exactly."""
    v = np.float32(c)
    r = repr(float(v))
    assert np.float32(float(r)) == v
    return r + ("f" if ("e" in r or "." in r) else ".0f")


@functools.cache
def cuda_source() -> str:
    """The CUDA C source of the kernels (also valid C: see the module docstring), with the
    erf GELU's coefficients pasted from :mod:`semzo.model.erf`."""
    src = _SOURCE.replace("@ERF_A0@", _f32_literal(ERF_A[0]))
    src = src.replace("@ERF_B0@", _f32_literal(ERF_B[0]))
    src = src.replace("@ERF_P@", "\n".join(f"  p = p * x2 + {_f32_literal(c)};"
                                           for c in ERF_A[1:]))
    src = src.replace("@ERF_Q@", "\n".join(f"  q = q * x2 + {_f32_literal(c)};"
                                           for c in ERF_B[1:]))
    if "@" in src:
        raise RuntimeError("unsubstituted constant in the CUDA source")
    return src


def enabled() -> bool:
    """Whether the fused kernels are asked for (``SEMZO_GPU_FUSED``, default on)."""
    return os.environ.get("SEMZO_GPU_FUSED", "1").strip().lower() not in ("0", "false", "no",
                                                                          "off")


_FAILED: dict = {}


@functools.cache
def _module(device_id: int):
    import cupy  # GPU only
    mod = cupy.RawModule(code=cuda_source(), options=("--fmad=false",))
    for name in KERNELS:
        mod.get_function(name)          # compile now: a failure falls back before any launch
    sumsq = cupy.ReductionKernel("float32 x", "float32 y", "x * x", "a + b", "y = a", "0",
                                 "semzo_sumsq")
    # the sum of squares of resid + x, the sum the residual norm takes before it writes
    # resid: the same float32 addition as the kernel's
    sumsq2 = cupy.ReductionKernel("float32 r, float32 x", "float32 y", "(r + x) * (r + x)",
                                  "a + b", "y = a", "0", "semzo_sumsq_res")
    return mod, sumsq, sumsq2


def _kernels():
    """(RawModule, sum-of-squares reduction) of the current device, or None when turned off
    or when they do not compile here (warned once)."""
    if not enabled():
        return None
    import cupy  # GPU only
    dev = cupy.cuda.runtime.getDevice()
    if dev in _FAILED:
        return None
    try:
        return _module(dev)
    except Exception as exc:  # noqa: BLE001 - any compile failure: the xp versions serve
        _FAILED[dev] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"semzo: the fused decoder kernels did not compile on GPU {dev}; the "
                      f"generic CuPy versions serve ({_FAILED[dev].splitlines()[0][:300]})",
                      RuntimeWarning, stacklevel=3)
        return None


def _launch(fn, n: int, args: tuple) -> None:
    blocks = max(1, min(MAX_BLOCKS, -(-int(n) // THREADS_PER_BLOCK)))
    fn((blocks,), (THREADS_PER_BLOCK,), args)


def _f32c(a) -> bool:
    return a.dtype == np.float32 and a.flags.c_contiguous


# ------------------------------------------------------------------------------ entry points
# Each returns True when it did the work, False when the caller's xp version must.

def rmsnorm(x, gamma, eps: float, out, bits=None, resid=None) -> bool:
    """``out = gamma * y / sqrt(mean(y**2) + eps)`` with y = x, or with ``resid`` y =
    ``resid + x`` written to resid first (one reduction, one kernel: the residual add of the
    block folded in); x, resid, out (N, H) float32 (out may be x or resid); gamma (H,) float32
    or bfloat16 bits (read as such: no upcast launched); ``bits``: a C-contiguous uint16 (N, H)
    to receive the bfloat16 bits of out as well (model.matmul = "bfloat16")."""
    k = _kernels()
    if k is None or x.ndim != 2 or not (_f32c(x) and _f32c(out)) or out.shape != x.shape:
        return False
    rows, h = x.shape
    if gamma.dtype not in (np.float32, np.uint16) or gamma.shape != (h,):
        return False
    if resid is not None and (not _f32c(resid) or resid.shape != x.shape):
        return False
    if bits is not None and (bits.dtype != np.uint16 or not bits.flags.c_contiguous or
                             bits.shape != x.shape):
        return False
    import cupy  # GPU only
    mod, sumsq, sumsq2 = k
    g = cupy.ascontiguousarray(gamma)
    gb = g.dtype == np.uint16
    ss = sumsq(x, axis=1) if resid is None else sumsq2(resid, x, axis=1)
    unused = out.view(np.uint16)            # a valid pointer the kernel does not read
    _launch(mod.get_function("lm_rmsnorm_apply2"), rows * h,
            (x, x if resid is None else resid, np.int32(resid is not None), ss,
             out if gb else g, g if gb else unused, np.int32(gb), out,
             bits if bits is not None else unused, np.int32(bits is not None),
             np.int64(rows), np.int32(h), np.float32(eps)))
    return True


def gated(gu, kind: int, out) -> bool:
    """``out = act(gate) * up`` for ``gu`` (N, 2I) = [gate | up] float32, no biases; kinds
    0 (silu), 2 (tanh GELU), 3 (relu)."""
    if kind not in (0, 2, 3):
        return False
    k = _kernels()
    if k is None or gu.ndim != 2 or not (_f32c(gu) and _f32c(out)):
        return False
    rows, m2 = gu.shape
    m = m2 // 2
    if out.shape != (rows, m):
        return False
    _launch(k[0].get_function("lm_gated"), rows * m,
            (gu, out, np.int64(rows), np.int32(m), np.int32(kind)))
    return True


def rope_split(qkv, biases, pos, cos, sin, nh: int, nkv: int, d: int, q, kc, vc,
               past: int) -> bool:
    """:func:`semzo.model.kernels_lm.rope_split` for float32 arrays: ``q`` (B, nh, T, d),
    ``kc``, ``vc`` (B, nkv, Tc, d) C-contiguous caches written at rows past..past+T-1;
    ``biases`` (bq, bk, bv) (float32 or bfloat16 bits) or None; ``cos`` None: no rotation."""
    k = _kernels()
    if k is None or qkv.ndim != 2 or not all(_f32c(a) for a in (qkv, q, kc, vc)):
        return False
    import cupy  # GPU only
    b, t = pos.shape
    w = (nh + 2 * nkv) * d
    if qkv.shape != (b * t, w) or q.shape != (b, nh, t, d) or kc.ndim != 4 or \
            kc.shape[:2] != (b, nkv) or kc.shape[3] != d or vc.shape != kc.shape or \
            past + t > kc.shape[2]:
        return False
    p = cupy.ascontiguousarray(pos, dtype=cupy.int64)
    if cos is not None:
        if cos.dtype != np.float32 or sin.dtype != np.float32 or cos.ndim != 2 or \
                sin.shape != cos.shape or 2 * int(cos.shape[1]) > d:
            return False
        cs, sn = cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin)
        h2 = int(cs.shape[1])
    else:
        cs = sn = cupy.zeros((1, 1), cupy.float32)
        h2 = 0
    bias = None
    if biases is not None:
        bias = cupy.concatenate([to_float32(a) if a.dtype == np.uint16 else a for a in biases])
        if bias.dtype != np.float32 or bias.size != w:
            return False
    bias_arr = cupy.zeros(1, cupy.float32) if bias is None else cupy.ascontiguousarray(bias)
    fn = k[0].get_function("lm_rope_split")
    for dst, heads, off, rot in ((q, nh, 0, h2), (kc, nkv, nh, h2), (vc, nkv, nh + nkv, 0)):
        dlen = t if dst is q else dst.shape[2]
        at = 0 if dst is q else past
        _launch(fn, b * heads * t * d,
                (qkv, bias_arr, np.int32(bias is not None), p, cs, sn, np.int32(rot), dst,
                 np.int64(b), np.int32(t), np.int32(heads), np.int32(d), np.int32(w),
                 np.int32(off), np.int64(dlen), np.int64(at)))
    return True


def attn_softmax(s, maskf, scale: float, nkv: int, past: int, w: int,
                 causal: bool = True) -> bool:
    """:func:`semzo.model.kernels_lm.attn_softmax` for a C-contiguous float32 ``s``
    (B*nkv, g, Tq, Tk), in place; ``causal`` False: only the padding mask
    (:func:`semzo.model.kernels.masked_softmax`, s viewed as (B*heads, 1, Tq, Tk))."""
    k = _kernels()
    if k is None or s.ndim != 4 or not _f32c(s):
        return False
    import cupy  # GPU only
    bn, grp, tq, tk = s.shape
    b = bn // nkv
    if maskf.dtype != np.float32 or maskf.shape != (b, tk) or b * nkv != bn:
        return False
    m = cupy.ascontiguousarray(maskf)
    mod = k[0]
    rows = bn * grp * tq
    flat = s.reshape(rows, tk)
    n = rows * tk
    idx = (np.int64(rows), np.int32(tq), np.int32(tk), np.int64(grp * nkv), np.int64(past),
           np.int32(w), np.int32(bool(causal)))
    _launch(mod.get_function("lm_softmax_scale"), n, (flat, m, *idx, np.float32(scale)))
    mx = flat.max(axis=1)
    _launch(mod.get_function("lm_softmax_exp"), n, (flat, mx, m, *idx))
    tot = flat.sum(axis=1)
    _launch(mod.get_function("lm_softmax_div"), n, (flat, tot, np.int64(rows), np.int32(tk)))
    return True


def layernorm(x, gamma, beta, eps: float, out) -> bool:
    """:func:`semzo.model.kernels.layernorm` for float32 x, out (N, H) (out may be x) and
    float32 gamma, beta (H,): CuPy's mean, the centred rows written to ``out``, their sum of
    squares (the RMSNorm reduction), one kernel for the rest."""
    k = _kernels()
    if k is None or x.ndim != 2 or not (_f32c(x) and _f32c(out)) or out.shape != x.shape:
        return False
    rows, h = x.shape
    if gamma.dtype != np.float32 or beta.dtype != np.float32 or gamma.shape != (h,) or \
            beta.shape != (h,):
        return False
    import cupy  # GPU only
    mod, sumsq = k[0], k[1]
    mean = x.mean(axis=1)
    n = np.int64(rows)
    _launch(mod.get_function("lm_center"), rows * h, (x, mean, out, n, np.int32(h)))
    ss = sumsq(out, axis=1)
    _launch(mod.get_function("lm_layernorm_apply"), rows * h,
            (out, ss, cupy.ascontiguousarray(gamma), cupy.ascontiguousarray(beta), out, n,
             np.int32(h), np.float32(eps)))
    return True


def add_bias(resid, x, bias) -> bool:
    """``resid += x + bias`` (rounded as ``resid += x; resid += bias``), float32 (N, H)."""
    k = _kernels()
    if k is None or resid.ndim != 2 or not (_f32c(resid) and _f32c(x)) or \
            x.shape != resid.shape or bias.dtype != np.float32 or bias.shape != resid.shape[1:]:
        return False
    import cupy  # GPU only
    rows, h = resid.shape
    _launch(k[0].get_function("lm_add_bias"), rows * h,
            (resid, x, cupy.ascontiguousarray(bias), np.int64(rows), np.int32(h)))
    return True


def bias_act(x, bias, kind: int) -> bool:
    """:func:`semzo.model.kernels.bias_act` in place for float32 x (N, F), bias (F,); kinds of
    ``kernels._ACT``: 0 erf GELU, 1 tanh GELU, 2 relu, 3 none."""
    k = _kernels()
    if k is None or x.ndim != 2 or not _f32c(x) or bias.dtype != np.float32 or \
            bias.shape != x.shape[1:] or kind not in (0, 1, 2, 3):
        return False
    import cupy  # GPU only
    rows, f = x.shape
    _launch(k[0].get_function("lm_bias_act"), rows * f,
            (x, cupy.ascontiguousarray(bias), np.int64(rows), np.int32(f), np.int32(kind)))
    return True


def to_bf16(x, out) -> bool:
    """``out[...] = storage.to_bits(x)`` in one kernel: x float32, out uint16, both
    C-contiguous of one shape."""
    k = _kernels()
    if k is None or not _f32c(x) or out.dtype != np.uint16 or not out.flags.c_contiguous or \
            out.shape != x.shape:
        return False
    _launch(k[0].get_function("lm_to_bf16"), x.size, (x, out, np.int64(x.size)))
    return True
