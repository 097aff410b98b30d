"""Fused CuPy kernels of the decoder's forward (:mod:`semzo.model.kernels_lm` on the GPU).

The generic ``xp`` versions in :mod:`.kernels_lm` spell each kernel as a chain of CuPy array
operations: the first GPU profile (SmolLM2 64 x 128, bfloat16 storage, an H200, 2026-11-27)
counted 3499 kernels per three forwards, 16 % of the device time in float32 copies and a
third in short elementwise kernels. Here each chain is one kernel: the rotary split into
q / k / v (one launch for the three instead of about fifteen), the gated activation (one
instead of six, reading gate and up in place), and three row kernels, one block per row with
block-wide reductions: RMSNorm (the residual add before it folded in), the encoder's
LayerNorm (mean and sum of squares), and the attention softmax (mask-and-scale, max, exp,
sum and divide in one launch, instead of about twelve with a boolean mask the size of the
scores; in the first fused version, three kernels around CuPy's max and sum, whose host
dispatch cost 50-90 us each). Rows of up to 32 x ``WARP_COLS`` keys (every training and
prompt forward of the decks here) take a warp-per-row softmax instead, the row in registers:
read once and written once where the block kernel reads and writes it three times (the block
kernel took 110 us a launch on SmolLM2 64 x 128 on an H200 against a memory floor of about
20 us). When a block computes only the real rows of a padded batch, the rotary split reads
them through a row map (built once per forward) and the context's gather writes them
(``lm_heads_to_rows``), in place of a zero-filled padded copy, a fancy-indexed scatter, a
layout copy and a fancy-indexed take per block.

The arithmetic is the ``xp`` version's, operation for operation and in the same order, and
the source is compiled with ``--fmad=false`` (no multiply-add contracted), so an elementwise
kernel gives the bits the chain of CuPy kernels gives. The row kernels' sums are taken in
their own order (each thread's strided partial sum, then a warp-shuffle tree): the same
float32 sums up to rounding, the same bits on every run of one block size. The same
source compiles as plain C (the ``LM_*`` macros turn each grid-stride loop into a serial
loop): ``tests/test_kernels_gpu.py`` builds it with gcc and checks every kernel against the
``xp`` version on the CPU.

Float32 activations take these kernels (every storage but float16 computes in float32); float16
activations (float16 storage: OPT's checkpoints, MeZO's setting) take ``_h`` variants of every
kernel but the bfloat16 conversion (the float16 MiniLM forward ran at 0.13x torch on the
generic chains), which compute in float32 as the ``xp`` versions do and round to float16
where they do (once at the end; the residual update after each add). Anything else, and every
case the kernels do not cover (biases on the gated MLP, its erf GELU), keeps the ``xp``
version. ``SEMZO_GPU_FUSED=0`` turns them off (the A/B of the
benchmarks). If the module does not compile on a machine, a warning says why once and the
``xp`` versions serve. Imported only with CuPy arrays at hand; it imports cupy only then.
"""

from __future__ import annotations

import functools

import numpy as np

from semzo.backend import gpu_fused_enabled, gpu_kernels
from semzo.model.erf import ERF_A, ERF_B
from semzo.model.storage import to_float32

THREADS_PER_BLOCK = 256
KERNELS = ("lm_rmsnorm_row", "lm_gated", "lm_rope_split", "lm_softmax_row",
           "lm_softmax_warp", "lm_heads_to_rows", "lm_layernorm_row", "lm_add_bias",
           "lm_bias_act", "lm_to_bf16", "lm_softmax_row_h", "lm_softmax_warp_h",
           "lm_layernorm_row_h", "lm_add_bias_h", "lm_bias_act_h", "lm_rmsnorm_row_h",
           "lm_gated_h", "lm_rope_split_h", "lm_heads_to_rows_h")
ROW_KERNELS = frozenset(("lm_rmsnorm_row", "lm_softmax_row", "lm_layernorm_row",
                         "lm_softmax_row_h", "lm_layernorm_row_h", "lm_rmsnorm_row_h"))
MAX_BLOCKS = 65535
MAX_ROW_BLOCKS = 2 ** 31 - 1
#: lm_softmax_warp's columns per lane (LM_WC in the source): rows of up to 32 x WARP_COLS keys
#: take the warp kernel, longer ones the block kernel
WARP_COLS = 8

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

// Row kernels: one block per row (rows strided over the grid), the block's threads strided
// over the row's columns, block-wide reductions. In C, one "thread" takes every column and
// a block reduction is the identity.
#ifdef __CUDACC__
#define LM_ROWS(r, n) for (long long r = blockIdx.x; r < (n); r += gridDim.x)
#define LM_COLS(j, n) for (int j = threadIdx.x; j < (n); j += blockDim.x)
// the sum (op 0) or the NaN-propagating max (op 1) of v over the block, returned to every
// thread; the order is fixed by the block size (deterministic); the leading barrier lets a
// second call reuse the shared slots
// (the warp's xor-shuffle tree: lm_warp_reduce, to every lane)
LM_DEV float lm_warp_reduce(float v, int op) {
  for (int o = 16; o > 0; o >>= 1) {
    float u = __shfl_xor_sync(0xffffffffu, v, o);
    v = op ? ((u > v || u != u) ? u : v) : v + u;
  }
  return v;
}
LM_DEV float lm_block_reduce(float v, int op) {
  __shared__ float sh[32];
  v = lm_warp_reduce(v, op);
  int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
  __syncthreads();
  if (lane == 0) sh[wid] = v;
  __syncthreads();
  if (wid == 0) {
    v = lm_warp_reduce(lane < nw ? sh[lane] : (op ? __int_as_float(0xff800000) : 0.0f), op);
    if (lane == 0) sh[0] = v;
  }
  __syncthreads();
  return sh[0];
}
#else
#define LM_ROWS(r, n) for (long long r = 0; r < (n); ++r)
#define LM_COLS(j, n) for (int j = 0; j < (n); ++j)
LM_DEV float lm_block_reduce(float v, int op) { (void)op; return v; }
#endif
#define LM_MAX(a, b) (((b) > (a) || (b) != (b)) ? (b) : (a))

#ifdef __CUDACC__
LM_DEV unsigned int lm_f2u(float x) { return __float_as_uint(x); }
LM_DEV float lm_u2f(unsigned int u) { return __uint_as_float(u); }
#else
LM_DEV unsigned int lm_f2u(float x) { unsigned int u; memcpy(&u, &x, sizeof u); return u; }
LM_DEV float lm_u2f(unsigned int u) { float x; memcpy(&x, &u, sizeof x); return x; }
#endif

// float16 activations (float16 storage): the kernels below with an _h suffix read and write
// float16 bits (unsigned short) and compute in float32, as the xp versions do (x.astype
// (float32), ..., .astype(float16)): lm_h2f exact, lm_f2h rounded to nearest even, IEEE
// (no flush of subnormals: PTX cvt without .ftz; in C, F. Giesen's float_to_half_rtne)
#ifdef __CUDACC__
LM_DEV float lm_h2f(unsigned short h) {
  float r; asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(h)); return r;
}
LM_DEV unsigned short lm_f2h(float x) {
  unsigned short r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(x)); return r;
}
#else
LM_DEV float lm_h2f(unsigned short h) {
  unsigned int e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
  float v = e == 0 ? (float)m * 5.9604644775390625e-08f
                   : lm_u2f(((e == 31 ? 255u : e + 112u) << 23) | (m << 13));
  return (h & 0x8000u) ? -v : v;
}
LM_DEV unsigned short lm_f2h(float x) {
  unsigned int f = lm_f2u(x), sign = f & 0x80000000u, o;
  f ^= sign;
  if (f >= 0x47800000u) {
    o = f > 0x7F800000u ? 0x7E00u : 0x7C00u;
  } else if (f < 0x38800000u) {
    o = lm_f2u(lm_u2f(f) + 0.5f) - 0x3F000000u;
  } else {
    o = (f - 0x38000000u + 0xFFFu + ((f >> 13) & 1u)) >> 13;
  }
  return (unsigned short)(o | (sign >> 16));
}
#endif
#define LM_LD_F(p, i) ((p)[i])
#define LM_ST_F(p, i, v) ((p)[i] = (v))
#define LM_LD_H(p, i) lm_h2f((p)[i])
#define LM_ST_H(p, i, v) ((p)[i] = lm_f2h(v))

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

// per row r: y[j] = x[r, j], or with res: y = resid[r, j] + x[r, j], written back to resid;
// ss = sum of y * y over the row (a block reduction);
// out[r, j] = g[j] * (y * (1 / sqrt(ss / h + eps))) with g float32 (gf) or bfloat16 bits
// (gb, when gbits); with bits also ob[r, j] = the bfloat16 bits of out[r, j] (the input of
// model.matmul = "bfloat16"'s projections). x, resid, out, ob (rows, h); out may be x or resid.
#define LM_RMSNORM(NAME, T, LD, ST)                                                           \
LM_GLOBAL NAME(const T* x, T* resid, int res, const float* gf, const unsigned short* gb,       \
               int gbits, T* out, unsigned short* ob, int bits, long long rows, int h,         \
               float eps) {                                                                    \
  LM_ROWS(r, rows) {                                                                           \
    long long o = r * (long long)h;                                                            \
    float acc = 0.0f;                                                                          \
    LM_COLS(j, h) {                                                                            \
      float y = LD(x, o + j);                                                                  \
      if (res) {                                                                               \
        ST(resid, o + j, LD(resid, o + j) + y);                                                \
        y = LD(resid, o + j);   /* as stored (float16: rounded, as resid += x rounds) */      \
      }                                                                                        \
      acc = acc + y * y;                                                                       \
    }                                                                                          \
    float ss = lm_block_reduce(acc, 0);                                                        \
    float inv = 1.0f / sqrtf(ss / (float)h + eps);                                             \
    LM_COLS(j, h) {                                                                            \
      float y = res ? LD(resid, o + j) : LD(x, o + j);                                         \
      float g = gbits ? lm_u2f(((unsigned int)gb[j]) << 16) : gf[j];                           \
      float v = g * (y * inv);                                                                 \
      ST(out, o + j, v);                                                                       \
      if (bits) {                                                                              \
        ob[o + j] = lm_bf16(v);                                                                \
      }                                                                                        \
    }                                                                                          \
  }                                                                                            \
}
LM_RMSNORM(lm_rmsnorm_row, float, LM_LD_F, LM_ST_F)
LM_RMSNORM(lm_rmsnorm_row_h, unsigned short, LM_LD_H, LM_ST_H)

// out[r, j] = act(gu[r, j]) * gu[r, m + j]; gu (rows, 2m), out (rows, m)
// kind 0: silu, 2: tanh GELU, 3: relu; with bits also ob[r, j] = the bfloat16 bits of
// out[r, j] (the down projection's input under model.matmul = "bfloat16")
#define LM_GATED(NAME, T, LD, ST)                                                             \
LM_GLOBAL NAME(const T* gu, T* out, long long rows, int m, int kind, unsigned short* ob,        \
               int bits) {                                                                     \
  LM_FOR(i, rows * (long long)m) {                                                             \
    long long r = i / m;                                                                       \
    int j = (int)(i - r * m);                                                                  \
    float g = LD(gu, r * 2 * m + j);                                                           \
    float u = LD(gu, r * 2 * m + m + j);                                                       \
    float a;                                                                                   \
    if (kind == 0) {                                                                           \
      a = g / (1.0f + expf(-g));                                                               \
    } else if (kind == 2) {                                                                    \
      float g3 = (g * g) * g;                                                                  \
      a = (0.5f * g) * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g3)));             \
    } else {                                                                                   \
      a = (g > 0.0f || g != g) ? g : 0.0f;   /* NaN passes, as xp.maximum's */                \
    }                                                                                          \
    float v = a * u;                                                                           \
    ST(out, i, v);                                                                             \
    if (bits) ob[i] = lm_bf16(v);                                                              \
  }                                                                                            \
}
LM_GATED(lm_gated, float, LM_LD_F, LM_ST_F)
LM_GATED(lm_gated_h, unsigned short, LM_LD_H, LM_ST_H)

// q[b, hh, t, j] (hh < nh), kc[b, hh - nh, past + t, j] (hh < nh + nkv), vc[b, hh - nh -
// nkv, past + t, j] (the rest) = (rotated) qkv[b * T + t, hh * d + j] (+ bias[...]): the three
// destinations in one launch. qkv (B*T, (nh + 2 nkv) d); q (B, nh, T, d), kc, vc (B, nkv,
// dlen, d) C-contiguous; pos (B, T); cos, sin (P, h2): q and k rotate their first 2 h2 dims
// (h2 = 0: none), v does not. has_map: qkv holds packed rows only, row b * T + t of the
// padded layout at qkv row rmap[b * T + t], or zeros where that is -1 (a padded row: what
// the zero-filled padded layout holds there)
#define LM_ROPE_SPLIT(NAME, T, LD, ST)                                                        \
LM_GLOBAL NAME(const T* qkv, const float* bias, int has_bias, const long long* pos,             \
               const float* cs, const float* sn, int h2, T* q, T* kc, T* vc, long long b,       \
               int t, int nh, int nkv, int d, long long dlen, long long past,                  \
               const long long* rmap, int has_map) {                                           \
  int heads = nh + 2 * nkv;                                                                    \
  long long wcols = (long long)heads * d;                                                      \
  LM_FOR(i, b * heads * (long long)t * d) {                                                    \
    long long r = i / d;                                                                       \
    int jd = (int)(i - r * d);                                                                 \
    int tt = (int)(r % t);                                                                     \
    r /= t;                                                                                    \
    int hh = (int)(r % heads);                                                                 \
    long long bb = r / heads;                                                                  \
    long long col = (long long)hh * d;                                                         \
    long long pr = bb * t + tt;                                                                \
    if (has_map) pr = rmap[pr];                                                                \
    int real = pr >= 0;                                                                        \
    const T* src = qkv + (real ? pr : 0) * wcols + col;                                        \
    float x = real ? LD(src, jd) : 0.0f;                                                       \
    if (has_bias) x = x + bias[col + jd];                                                      \
    float v = x;                                                                               \
    int rot = hh < nh + nkv ? h2 : 0;                                                          \
    if (jd < 2 * rot) {                                                                        \
      long long p = pos[bb * t + tt];                                                          \
      if (jd < rot) {                                                                          \
        float x2 = real ? LD(src, jd + rot) : 0.0f;                                            \
        if (has_bias) x2 = x2 + bias[col + jd + rot];                                          \
        v = x * cs[p * h2 + jd] - x2 * sn[p * h2 + jd];                                        \
      } else {                                                                                 \
        int jj = jd - rot;                                                                     \
        float x1 = real ? LD(src, jj) : 0.0f;                                                  \
        if (has_bias) x1 = x1 + bias[col + jj];                                                \
        v = x * cs[p * h2 + jj] + x1 * sn[p * h2 + jj];                                        \
      }                                                                                        \
    }                                                                                          \
    if (hh < nh) {                                                                             \
      ST(q, ((bb * nh + hh) * t + tt) * (long long)d + jd, v);                                 \
    } else if (hh < nh + nkv) {                                                                \
      ST(kc, ((bb * nkv + (hh - nh)) * dlen + past + tt) * d + jd, v);                         \
    } else {                                                                                   \
      ST(vc, ((bb * nkv + (hh - nh - nkv)) * dlen + past + tt) * d + jd, v);                   \
    }                                                                                          \
  }                                                                                            \
}
LM_ROPE_SPLIT(lm_rope_split, float, LM_LD_F, LM_ST_F)
LM_ROPE_SPLIT(lm_rope_split_h, unsigned short, LM_LD_H, LM_ST_H)

// ctx[k, (kv * g + gg) * d + j] = tmp[bb, kv, gg * T + tt, j] for row k of ctx (nr, nkv g d),
// bb * T + tt = rows[k] (has_rows) or k: attention's context from its batched product's
// layout (B, nkv, g T, d) to the rows of the o projection, the packed ones only when rows;
// with bits also ob[i] = the bfloat16 bits of ctx[i] (model.matmul = "bfloat16")
// the index into tmp of element i of ctx (lm_heads_to_rows, lm_heads_to_rows_h)
static LM_DEV long long lm_h2r_src(long long i, const long long* rows, int has_rows, int t,
                                   int nkv, int g, int d) {
  long long w = (long long)nkv * g * d;
  long long k = i / w;
  int c = (int)(i - k * w);
  int hh = c / d;
  int j = c - hh * d;
  int kv = hh / g;
  int gg = hh - kv * g;
  long long pr = has_rows ? rows[k] : k;
  long long bb = pr / t;
  int tt = (int)(pr - bb * t);
  return (((bb * nkv + kv) * (long long)g + gg) * t + tt) * d + j;
}

LM_GLOBAL lm_heads_to_rows(const float* tmp, float* ctx, const long long* rows, int has_rows,
                           long long nr, int t, int nkv, int g, int d, unsigned short* ob,
                           int bits) {
  LM_FOR(i, nr * (long long)nkv * g * d) {
    float v = tmp[lm_h2r_src(i, rows, has_rows, t, nkv, g, d)];
    ctx[i] = v;
    if (bits) ob[i] = lm_bf16(v);
  }
}

// lm_heads_to_rows for float16 activations: the same gather of the float16 bits (a copy)
LM_GLOBAL lm_heads_to_rows_h(const unsigned short* tmp, unsigned short* ctx,
                             const long long* rows, int has_rows, long long nr, int t,
                             int nkv, int g, int d) {
  LM_FOR(i, nr * (long long)nkv * g * d) {
    ctx[i] = tmp[lm_h2r_src(i, rows, has_rows, t, nkv, g, d)];
  }
}

// the softmax's key mask of column j of row r of s (rows, tk), row r = ((bn * grp + g) *
// tq + qt), bn = b * nkv + kv, with qi = qt + past and bb = b in scope: key j kept when
// maskf[b, j] > 0 and, if causal, j <= qi and j > qi - w (w > 0)
#define LM_SMX_KEEP(j) ((!causal || ((j) <= qi && (w <= 0 || (j) > qi - w))) && \
                        maskf[bb * tk + (j)] > 0.0f)
// row r's offset o in s, its query's position qi and its batch row bb
#define LM_SMX_ROW(r)                                                        \
  long long o = (r) * (long long)tk;                                         \
  long long qi = (r) % tq + past;                                            \
  long long bb = (r) / ((long long)tq * bdiv);

// per row r of s (rows, tk), in place: v = keep ? s * scale : -3e38; mx = max of the row;
// e = keep ? exp(v - mx) : 0; s = e / (tot > 0 ? tot : 1), tot = the row's sum of e
// (bdiv = grp * nkv; LM_SMX_KEEP above)
LM_GLOBAL lm_softmax_row(float* s, const float* maskf, long long rows, int tq, int tk,
                         long long bdiv, long long past, int w, int causal, float scale) {
  LM_ROWS(r, rows) {
    LM_SMX_ROW(r)
    float mx = -3.0e38f;
    int any = 0;
    LM_COLS(j, tk) {
      float v = LM_SMX_KEEP(j) ? s[o + j] * scale : -3.0e38f;
      s[o + j] = v;
      mx = any ? LM_MAX(mx, v) : v;
      any = 1;
    }
    mx = lm_block_reduce(any ? mx : -3.0e38f, 1);
    float acc = 0.0f;
    LM_COLS(j, tk) {
      float e = LM_SMX_KEEP(j) ? expf(s[o + j] - mx) : 0.0f;
      s[o + j] = e;
      acc = acc + e;
    }
    float tot = lm_block_reduce(acc, 0);
    float d = tot > 0.0f ? tot : 1.0f;
    LM_COLS(j, tk) {
      s[o + j] = s[o + j] / d;
    }
  }
}

// lm_softmax_row with one warp per row and the row in registers: the scores are read once
// and written once (the block version reads them three times and writes them three times)
// and no block barrier is waited on; on the GPU for tk <= 32 x LM_WC only (attn_softmax
// picks). In C a "warp" is one thread taking every column (LM_WARR: a row-long array).
#ifdef __CUDACC__
#define LM_WC @WARP_COLS@
#define LM_WARR(n) LM_WC
#define LM_WROWS(r, n)                                                       \
  for (long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; \
       r < (n); r += ((long long)gridDim.x * blockDim.x) >> 5)
#define LM_WCOLS(c, j, n)                                                    \
  _Pragma("unroll") for (int c = 0, j = (int)(threadIdx.x & 31); c < LM_WC; ++c, j += 32) \
    if (j < (n))
#else
#define LM_WARR(n) (n)
#define LM_WROWS(r, n) for (long long r = 0; r < (n); ++r)
#define LM_WCOLS(c, j, n) for (int c = 0, j = 0; c < (n); ++c, ++j)
LM_DEV float lm_warp_reduce(float v, int op) { (void)op; return v; }
#endif
#define LM_SOFTMAX_WARP(NAME, T, LD, ST)                                               \
LM_GLOBAL NAME(T* s, const float* maskf, long long rows, int tq, int tk, long long bdiv,      \
               long long past, int w, int causal, float scale) {                              \
  LM_WROWS(r, rows) {                                                                         \
    LM_SMX_ROW(r)                                                                             \
    float v[LM_WARR(tk)];                                                                     \
    float mx = -3.0e38f;                                                                      \
    int any = 0;                                                                              \
    LM_WCOLS(c, j, tk) {                                                                      \
      float x = LM_SMX_KEEP(j) ? LD(s, o + j) * scale : -3.0e38f;                             \
      v[c] = x;                                                                               \
      mx = any ? LM_MAX(mx, x) : x;                                                           \
      any = 1;                                                                                \
    }                                                                                         \
    mx = lm_warp_reduce(any ? mx : -3.0e38f, 1);                                              \
    float acc = 0.0f;                                                                         \
    LM_WCOLS(c, j, tk) {                                                                      \
      float e = LM_SMX_KEEP(j) ? expf(v[c] - mx) : 0.0f;                                      \
      v[c] = e;                                                                               \
      acc = acc + e;                                                                          \
    }                                                                                         \
    float tot = lm_warp_reduce(acc, 0);                                                       \
    float d = tot > 0.0f ? tot : 1.0f;                                                        \
    LM_WCOLS(c, j, tk) {                                                                      \
      ST(s, o + j, v[c] / d);                                                                 \
    }                                                                                         \
  }                                                                                           \
}
LM_SOFTMAX_WARP(lm_softmax_warp, float, LM_LD_F, LM_ST_F)
LM_SOFTMAX_WARP(lm_softmax_warp_h, unsigned short, LM_LD_H, LM_ST_H)

// lm_softmax_row for float16 scores: a float16 row cannot hold the float32 intermediates, so
// each pass recomputes them from the scores (read three times, written once): the same
// float32 arithmetic, rounded to float16 once at the end
LM_GLOBAL lm_softmax_row_h(unsigned short* s, const float* maskf, long long rows, int tq,
                           int tk, long long bdiv, long long past, int w, int causal,
                           float scale) {
  LM_ROWS(r, rows) {
    LM_SMX_ROW(r)
    float mx = -3.0e38f;
    int any = 0;
    LM_COLS(j, tk) {
      float v = LM_SMX_KEEP(j) ? lm_h2f(s[o + j]) * scale : -3.0e38f;
      mx = any ? LM_MAX(mx, v) : v;
      any = 1;
    }
    mx = lm_block_reduce(any ? mx : -3.0e38f, 1);
    float acc = 0.0f;
    LM_COLS(j, tk) {
      float e = LM_SMX_KEEP(j) ? expf(lm_h2f(s[o + j]) * scale - mx) : 0.0f;
      acc = acc + e;
    }
    float tot = lm_block_reduce(acc, 0);
    float d = tot > 0.0f ? tot : 1.0f;
    LM_COLS(j, tk) {
      float e = LM_SMX_KEEP(j) ? expf(lm_h2f(s[o + j]) * scale - mx) : 0.0f;
      s[o + j] = lm_f2h(e / d);
    }
  }
}

// ---- the encoder's (and GPT-2's) LayerNorm, bias + residual, bias + activation
// per row r: mean = (sum of x[r, :]) / h; d = x - mean; ss = sum of d * d;
// out[r, j] = (d * (1 / sqrt(ss / h + eps))) * g[j] + b[j] (d recomputed from x in the last
// pass, each column by the thread that writes it: out may be x); float32 g and b
#define LM_LAYERNORM(NAME, T, LD, ST)                                                         \
LM_GLOBAL NAME(const T* x, const float* g, const float* b, T* out, long long rows, int h,     \
               float eps) {                                                                   \
  LM_ROWS(r, rows) {                                                                          \
    long long o = r * (long long)h;                                                           \
    float acc = 0.0f;                                                                         \
    LM_COLS(j, h) {                                                                           \
      acc = acc + LD(x, o + j);                                                               \
    }                                                                                         \
    float mean = lm_block_reduce(acc, 0) / (float)h;                                          \
    acc = 0.0f;                                                                               \
    LM_COLS(j, h) {                                                                           \
      float d = LD(x, o + j) - mean;                                                          \
      acc = acc + d * d;                                                                      \
    }                                                                                         \
    float ss = lm_block_reduce(acc, 0);                                                       \
    float inv = 1.0f / sqrtf(ss / (float)h + eps);                                            \
    LM_COLS(j, h) {                                                                           \
      float d = LD(x, o + j) - mean;                                                          \
      ST(out, o + j, (d * inv) * g[j] + b[j]);                                                \
    }                                                                                         \
  }                                                                                           \
}
LM_LAYERNORM(lm_layernorm_row, float, LM_LD_F, LM_ST_F)
LM_LAYERNORM(lm_layernorm_row_h, unsigned short, LM_LD_H, LM_ST_H)

// resid[r, j] = (resid[r, j] + x[r, j]) + bias[j]: two in-place adds of the xp version
// (resid += x; resid += bias), each rounded to the activations' type; float32 bias
#define LM_ADD_BIAS(NAME, T, LD, ST)                                                          \
LM_GLOBAL NAME(T* resid, const T* x, const float* bias, long long rows, int h) {              \
  LM_FOR(i, rows * (long long)h) {                                                            \
    long long r = i / h;                                                                      \
    int j = (int)(i - r * h);                                                                 \
    ST(resid, i, LD(resid, i) + LD(x, i));                                                    \
    ST(resid, i, LD(resid, i) + bias[j]);                                                     \
  }                                                                                           \
}
LM_ADD_BIAS(lm_add_bias, float, LM_LD_F, LM_ST_F)
LM_ADD_BIAS(lm_add_bias_h, unsigned short, LM_LD_H, LM_ST_H)

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
// (float32 arithmetic, stored once in the activations' type); float32 bias
#define LM_BIAS_ACT(NAME, T, LD, ST)                                                          \
LM_GLOBAL NAME(T* x, const float* bias, long long rows, int f, int kind) {                    \
  LM_FOR(i, rows * (long long)f) {                                                            \
    long long r = i / f;                                                                      \
    int j = (int)(i - r * f);                                                                 \
    float t = LD(x, i) + bias[j];                                                             \
    if (kind == 0) {                                                                          \
      t = (0.5f * t) * (1.0f + lm_erf(t * 0.7071067811865476f));                              \
    } else if (kind == 1) {                                                                   \
      t = (0.5f * t) * (1.0f + tanhf(0.7978845608028654f * (t + ((0.044715f * t) * t) * t))); \
    } else if (kind == 2) {                                                                   \
      t = (t > 0.0f || t != t) ? t : 0.0f;                                                    \
    }                                                                                         \
    ST(x, i, t);                                                                              \
  }                                                                                           \
}
LM_BIAS_ACT(lm_bias_act, float, LM_LD_F, LM_ST_F)
LM_BIAS_ACT(lm_bias_act_h, unsigned short, LM_LD_H, LM_ST_H)
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
    src = _SOURCE.replace("@WARP_COLS@", str(max(1, int(WARP_COLS))))
    src = src.replace("@ERF_A0@", _f32_literal(ERF_A[0]))
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
    return gpu_fused_enabled()


_FAILED: dict = {}


@functools.cache
def _module(device_id: int):
    import cupy  # GPU only
    mod = cupy.RawModule(code=cuda_source(), options=("--fmad=false",))
    # compiled now (a failure falls back before any launch) and kept: RawModule.get_function
    # costs about 10 us of host time per call, and the forward is bound by the host
    return mod, {name: mod.get_function(name) for name in KERNELS}


def _kernels():
    """(RawModule, {kernel name: its compiled function}) of the current device, or None when
    turned off or when they do not compile here (warned once)."""
    if not enabled():
        return None
    return gpu_kernels(_module, _FAILED, "the fused decoder kernels", "the generic CuPy versions")


def _launch(fn, n: int, args: tuple) -> None:
    blocks = max(1, min(MAX_BLOCKS, -(-int(n) // THREADS_PER_BLOCK)))
    fn((blocks,), (THREADS_PER_BLOCK,), args)


def _launch_rows(fn, rows: int, cols: int, args: tuple) -> None:
    """A row kernel: one block per row (up to MAX_ROW_BLOCKS; the kernel strides over the
    rest), the row's columns over the block's threads (a multiple of the warp, at most
    THREADS_PER_BLOCK)."""
    threads = min(THREADS_PER_BLOCK, max(32, -(-int(cols) // 32) * 32))
    fn((max(1, min(MAX_ROW_BLOCKS, int(rows))),), (threads,), args)


def _launch_warps(fn, rows: int, args: tuple) -> None:
    """A warp kernel: one warp per row, THREADS_PER_BLOCK / 32 rows a block (the kernel
    strides over rows past MAX_ROW_BLOCKS blocks)."""
    per = THREADS_PER_BLOCK // 32
    fn((max(1, min(MAX_ROW_BLOCKS, -(-int(rows) // per))),), (THREADS_PER_BLOCK,), args)


def _f32c(a) -> bool:
    return a.dtype == np.float32 and a.flags.c_contiguous


def _act_suffix(*arrays) -> str | None:
    """The kernel suffix for activations that are all C-contiguous float32 (``""``) or all
    float16 (``"_h"``: float16 storage; arithmetic in float32, stored rounded), else None."""
    if not all(a.flags.c_contiguous for a in arrays):
        return None
    dts = {np.dtype(a.dtype) for a in arrays}
    if dts == {np.dtype(np.float32)}:
        return ""
    if dts == {np.dtype(np.float16)}:
        return "_h"
    return None


# ------------------------------------------------------------------------------ entry points
# Each returns True when it did the work, False when the caller's xp version must.

def rmsnorm(x, gamma, eps: float, out, bits=None, resid=None) -> bool:
    """``out = gamma * y / sqrt(mean(y**2) + eps)`` with y = x, or with ``resid`` y =
    ``resid + x`` written to resid first (one reduction, one kernel: the residual add of the
    block folded in); x, resid, out (N, H) all float32 or all float16 (out may be x or
    resid); gamma (H,) float32 or bfloat16 bits (read as such: no upcast launched) or float16
    (upcast); ``bits``: a C-contiguous uint16 (N, H) to receive the bfloat16 bits of out as
    well (model.matmul = "bfloat16")."""
    k = _kernels()
    if k is None or x.ndim != 2 or out.shape != x.shape:
        return False
    rows, h = x.shape
    if gamma.dtype not in (np.float32, np.uint16, np.float16) or gamma.shape != (h,):
        return False
    if resid is not None and resid.shape != x.shape:
        return False
    sfx = _act_suffix(x, out, *(() if resid is None else (resid,)))
    if sfx is None:
        return False
    if bits is not None and (bits.dtype != np.uint16 or not bits.flags.c_contiguous or
                             bits.shape != x.shape):
        return False
    import cupy  # GPU only
    g = cupy.ascontiguousarray(gamma)
    if g.dtype == np.float16:
        g = g.astype(cupy.float32)          # exact
    gb = g.dtype == np.uint16
    unused = out.view(np.uint16)            # a valid pointer the kernel does not read
    f32_unused = _dummy()
    _launch_rows(k[1]["lm_rmsnorm_row" + sfx], rows, h,
                 (x, x if resid is None else resid, np.int32(resid is not None),
                  f32_unused if gb else g, g if gb else unused, np.int32(gb), out,
                  bits if bits is not None else unused, np.int32(bits is not None),
                  np.int64(rows), np.int32(h), np.float32(eps)))
    return True


def _bits_ok(bits, shape) -> bool:
    return bits is None or (bits.dtype == np.uint16 and bits.flags.c_contiguous and
                            bits.shape == tuple(shape))


def gated(gu, kind: int, out, bits=None) -> bool:
    """``out = act(gate) * up`` for ``gu`` (N, 2I) = [gate | up] and out both float32 or both
    float16, no biases; kinds 0 (silu), 2 (tanh GELU), 3 (relu); ``bits``: a C-contiguous
    uint16 (N, I) to receive the bfloat16 bits of out as well."""
    if kind not in (0, 2, 3):
        return False
    k = _kernels()
    if k is None or gu.ndim != 2:
        return False
    sfx = _act_suffix(gu, out)
    rows, m2 = gu.shape
    m = m2 // 2
    if sfx is None or out.shape != (rows, m) or not _bits_ok(bits, out.shape):
        return False
    _launch(k[1]["lm_gated" + sfx], rows * m,
            (gu, out, np.int64(rows), np.int32(m), np.int32(kind),
             out.view(np.uint16) if bits is None else bits, np.int32(bits is not None)))
    return True


_ROWMAP: list = []


@functools.cache
def _dummy_on(device_id: int):
    import cupy  # GPU only
    return cupy.zeros((1, 1), cupy.float32)


def _dummy():
    """A float32 zero (1, 1) on the current device, allocated once: the pointer a kernel gets
    for an argument it does not read (no bias, no rotation), without an allocation and a
    memset launch at every call."""
    import cupy  # GPU only
    return _dummy_on(cupy.cuda.runtime.getDevice())


def _rowmap(rows, n: int):
    """int64 (n,): the packed index of each row of the padded layout, -1 for the others; kept
    for the last ``rows`` array (a forward passes the same one to all its blocks: built once)."""
    import cupy  # GPU only
    if _ROWMAP and _ROWMAP[0] is rows and _ROWMAP[1] == n:
        return _ROWMAP[2]
    m = cupy.full(n, -1, dtype=cupy.int64)
    m[rows] = cupy.arange(rows.shape[0], dtype=cupy.int64)
    _ROWMAP[:] = [rows, n, m]
    return m


def _rows_ok(rows, n: int) -> bool:
    return rows is None or (rows.ndim == 1 and rows.dtype == np.int64 and
                            rows.flags.c_contiguous and rows.shape[0] <= n)


def rope_split(qkv, biases, pos, cos, sin, nh: int, nkv: int, d: int, q, kc, vc,
               past: int, rows=None) -> bool:
    """:func:`semzo.model.kernels_lm.rope_split` for float32 or float16 arrays (qkv, q, kc,
    vc of one type): ``q`` (B, nh, T, d),
    ``kc``, ``vc`` (B, nkv, Tc, d) C-contiguous caches written at rows past..past+T-1;
    ``biases`` (bq, bk, bv) (float32, float16 or bfloat16 bits) or None; ``cos`` None: no
    rotation;
    ``rows``: qkv holds only these rows of the (B*T) padded layout (int64, sorted; the
    others read as zeros), scattered by the kernel itself (no zero-filled copy)."""
    k = _kernels()
    sfx = None if k is None or qkv.ndim != 2 else _act_suffix(qkv, q, kc, vc)
    if sfx is None:
        return False
    import cupy  # GPU only
    b, t = pos.shape
    w = (nh + 2 * nkv) * d
    if not _rows_ok(rows, b * t) or \
            qkv.shape != (b * t if rows is None else rows.shape[0], w) or \
            q.shape != (b, nh, t, d) or kc.ndim != 4 or \
            kc.shape[:2] != (b, nkv) or kc.shape[3] != d or vc.shape != kc.shape or \
            past + t > kc.shape[2]:
        return False
    p = cupy.ascontiguousarray(pos, dtype=cupy.int64)
    rmap = p if rows is None else _rowmap(rows, b * t)     # (p: any pointer when unused)
    if cos is not None:
        if cos.dtype != np.float32 or sin.dtype != np.float32 or cos.ndim != 2 or \
                sin.shape != cos.shape or 2 * int(cos.shape[1]) > d:
            return False
        cs, sn = cupy.ascontiguousarray(cos), cupy.ascontiguousarray(sin)
        h2 = int(cs.shape[1])
    else:
        cs = sn = _dummy()
        h2 = 0
    bias = None
    if biases is not None:
        bias = cupy.concatenate([to_float32(a) if a.dtype == np.uint16 else
                                 a.astype(cupy.float32, copy=False) for a in biases])
        if bias.size != w:
            return False
    bias_arr = _dummy() if bias is None else cupy.ascontiguousarray(bias)
    _launch(k[1]["lm_rope_split" + sfx], b * (nh + 2 * nkv) * t * d,
            (qkv, bias_arr, np.int32(bias is not None), p, cs, sn, np.int32(h2), q, kc, vc,
             np.int64(b), np.int32(t), np.int32(nh), np.int32(nkv), np.int32(d),
             np.int64(kc.shape[2]), np.int64(past), rmap, np.int32(rows is not None)))
    return True


def heads_to_rows(tmp, rows, t: int, g: int, out, bits=None) -> bool:
    """:func:`semzo.model.kernels_lm.heads_to_rows` for C-contiguous ``tmp`` (B, nkv, g T, d)
    and ``out`` (nr, nkv g d), both float32 or both float16: one gather kernel, in place of a
    layout copy and (with ``rows``) a fancy-indexed take; ``bits``: as :func:`gated`'s
    (float32 only)."""
    k = _kernels()
    if k is None or tmp.ndim != 4 or out.ndim != 2:
        return False
    sfx = _act_suffix(tmp, out)
    b, nkv, gt, d = tmp.shape
    nr = b * t if rows is None else rows.shape[0]
    if sfx is None or gt != g * t or not _rows_ok(rows, b * t) or \
            out.shape != (nr, nkv * g * d) or not _bits_ok(bits, out.shape) or \
            (sfx and bits is not None):
        return False
    args = (tmp, out, tmp if rows is None else rows, np.int32(rows is not None),
            np.int64(nr), np.int32(t), np.int32(nkv), np.int32(g), np.int32(d))
    if not sfx:
        args += (out if bits is None else bits, np.int32(bits is not None))
    _launch(k[1]["lm_heads_to_rows" + sfx], nr * nkv * g * d, args)
    return True


def attn_softmax(s, maskf, scale: float, nkv: int, past: int, w: int,
                 causal: bool = True) -> bool:
    """:func:`semzo.model.kernels_lm.attn_softmax` for a C-contiguous float32 or float16 ``s``
    (B*nkv, g, Tq, Tk), in place; ``causal`` False: only the padding mask
    (:func:`semzo.model.kernels.masked_softmax`, s viewed as (B*heads, 1, Tq, Tk))."""
    k = _kernels()
    sfx = None if k is None or s.ndim != 4 else _act_suffix(s)
    if sfx is None:
        return False
    import cupy  # GPU only
    bn, grp, tq, tk = s.shape
    b = bn // nkv
    if maskf.dtype != np.float32 or maskf.shape != (b, tk) or b * nkv != bn:
        return False
    m = cupy.ascontiguousarray(maskf)
    rows = bn * grp * tq
    args = (s, m, np.int64(rows), np.int32(tq), np.int32(tk), np.int64(grp * nkv),
            np.int64(past), np.int32(w), np.int32(bool(causal)), np.float32(scale))
    if tk <= 32 * WARP_COLS:
        _launch_warps(k[1]["lm_softmax_warp" + sfx], rows, args)
    else:
        _launch_rows(k[1]["lm_softmax_row" + sfx], rows, tk, args)
    return True


def layernorm(x, gamma, beta, eps: float, out) -> bool:
    """:func:`semzo.model.kernels.layernorm` for x, out (N, H) both float32 or both float16
    (out may be x) and float32 gamma, beta (H,): one row kernel (the mean and the centred
    rows' sum of squares as two block reductions)."""
    k = _kernels()
    if k is None or x.ndim != 2 or out.shape != x.shape:
        return False
    sfx = _act_suffix(x, out)
    rows, h = x.shape
    if sfx is None or gamma.dtype != np.float32 or beta.dtype != np.float32 or \
            gamma.shape != (h,) or beta.shape != (h,):
        return False
    import cupy  # GPU only
    _launch_rows(k[1]["lm_layernorm_row" + sfx], rows, h,
                 (x, cupy.ascontiguousarray(gamma), cupy.ascontiguousarray(beta), out,
                  np.int64(rows), np.int32(h), np.float32(eps)))
    return True


def add_bias(resid, x, bias) -> bool:
    """``resid += x + bias`` (rounded as ``resid += x; resid += bias``), resid and x (N, H)
    both float32 or both float16, bias (H,) float32."""
    k = _kernels()
    if k is None or resid.ndim != 2 or x.shape != resid.shape or \
            bias.dtype != np.float32 or bias.shape != resid.shape[1:]:
        return False
    sfx = _act_suffix(resid, x)
    if sfx is None:
        return False
    import cupy  # GPU only
    rows, h = resid.shape
    _launch(k[1]["lm_add_bias" + sfx], rows * h,
            (resid, x, cupy.ascontiguousarray(bias), np.int64(rows), np.int32(h)))
    return True


def bias_act(x, bias, kind: int) -> bool:
    """:func:`semzo.model.kernels.bias_act` in place for x (N, F) float32 or float16, bias
    (F,) float32; kinds of ``kernels._ACT``: 0 erf GELU, 1 tanh GELU, 2 relu, 3 none."""
    k = _kernels()
    if k is None or x.ndim != 2 or bias.dtype != np.float32 or bias.shape != x.shape[1:] or \
            kind not in (0, 1, 2, 3):
        return False
    sfx = _act_suffix(x)
    if sfx is None:
        return False
    import cupy  # GPU only
    rows, f = x.shape
    _launch(k[1]["lm_bias_act" + sfx], rows * f,
            (x, cupy.ascontiguousarray(bias), np.int64(rows), np.int32(f), np.int32(kind)))
    return True


def to_bf16(x, out) -> bool:
    """``out[...] = storage.to_bits(x)`` in one kernel: x float32, out uint16, both
    C-contiguous of one shape."""
    k = _kernels()
    if k is None or not _f32c(x) or out.dtype != np.uint16 or not out.flags.c_contiguous or \
            out.shape != x.shape:
        return False
    _launch(k[1]["lm_to_bf16"], x.size, (x, out, np.int64(x.size)))
    return True
