"""The CUDA C source of the CuPy GPU kernels (:mod:`.kernels_gpu`), with every constant of the
generator pasted from :mod:`semzo.rng` (:func:`cuda_source`).

The source spells the operations of rng.py in C, in the same order; it is compiled with
``--fmad=false`` so that no multiply-add is contracted. The same source, kernels included,
compiles as plain C (the ``ZO_*`` macros turn each grid-stride loop into a serial loop): the
tests build it with gcc and require the numba CPU kernels' bits.
"""

from __future__ import annotations

import functools

import numpy as np

from .. import rng

_SOURCE_TEMPLATE = r"""
// semzo ZO kernels (generated from semzo/finetune/kernels_gpu.py; constants from rng.py).
// z(seed, t, e): Philox-4x32-10, key (seed lo, seed hi), counter (block lo, block hi, t, domain).
#ifdef __CUDACC__
#define ZO_DEV static __device__ __forceinline__
#define ZO_CONST static __device__ const
#define ZO_GLOBAL extern "C" __global__ void
#define ZO_FOR(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
                          i < (n); i += (long long)blockDim.x * gridDim.x)
#define ZO_F2U(f) __float_as_uint(f)
#define ZO_U2F(u) __uint_as_float(u)
// CuPy compiles every kernel with -ftz=true (appended after the caller's options; NVRTC takes
// the last), which would flush float32 subnormals in float <-> double conversions. Inline PTX
// without .ftz keeps the IEEE conversions of the CPU kernels.
static __device__ __forceinline__ double ZO_F2D(float x) {
  double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x)); return r;
}
static __device__ __forceinline__ float ZO_D2F(double x) {
  float r; asm("cvt.rn.f32.f64 %0, %1;" : "=f"(r) : "d"(x)); return r;
}
#define ZO_D2U(d) ((unsigned long long)__double_as_longlong(d))
#define ZO_U2D(u) __longlong_as_double((long long)(u))
#define ZO_UNROLL _Pragma("unroll")
#else
#include <math.h>
#include <string.h>
#define ZO_DEV static inline
#define ZO_CONST static const
#define ZO_GLOBAL void
#define ZO_FOR(i, n) for (long long i = 0; i < (n); ++i)
static inline unsigned int ZO_F2U(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float ZO_U2F(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
#define ZO_F2D(x) ((double)(x))
#define ZO_D2F(x) ((float)(x))
static inline unsigned long long ZO_D2U(double d) {
  unsigned long long u; memcpy(&u, &d, 8); return u;
}
static inline double ZO_U2D(unsigned long long u) { double d; memcpy(&d, &u, 8); return d; }
#define ZO_UNROLL
#endif
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
#define ZO_M32 0xFFFFFFFFULL

ZO_DEV void zo_philox(u64 c[4], u64 k0, u64 k1) {
  // every word is < 2**32 by the stream's contract; saying so lets the compiler use 32 x 32
  // -> 64-bit multiplies (the bits are unchanged)
  k0 &= ZO_M32; k1 &= ZO_M32;
  for (int i = 0; i < 4; ++i) c[i] &= ZO_M32;
  for (int r = 0; r < 10; ++r) {
    u64 p0 = @PHILOX_M0@ULL * c[0];
    u64 p1 = @PHILOX_M1@ULL * c[2];
    u64 n0 = (p1 >> 32) ^ c[1] ^ k0;
    u64 n2 = (p0 >> 32) ^ c[3] ^ k1;
    c[1] = p1 & ZO_M32;
    c[3] = p0 & ZO_M32;
    c[0] = n0;
    c[2] = n2;
    k0 = (k0 + @PHILOX_W0@ULL) & ZO_M32;
    k1 = (k1 + @PHILOX_W1@ULL) & ZO_M32;
  }
}

// rng.neg2_log_u_bits: the exponent and mantissa of m read from its bits (both reductions
// exact, so the bits of rng.neg2_log_u's binary search; seven compare-and-scale steps fewer)
ZO_DEV double zo_neg2_log_u(u64 x) {
  double m = (double)x + 1.0;
  u64 bits = ZO_D2U(m);
  double e = (double)(bits >> 52) - 1023.0;
  m = ZO_U2D((bits & @M52@ULL) | @EXP1023@ULL);
  int c = m > @SQRT2@;
  m = c ? m * 0.5 : m;
  e = c ? e + 1.0 : e;
  double s = (m - 1.0) / (m + 1.0);
  double s2 = s * s;
  double poly = @LOG_C4@;
  poly = poly * s2 + @LOG_C3@;
  poly = poly * s2 + @LOG_C2@;
  poly = poly * s2 + @LOG_C1@;
  poly = poly * s2 + @LOG_C0@;
  poly = poly * s2 + 1.0;
  return (32.0 - e) * (2.0 * @LN2@) - 4.0 * s * poly;
}

ZO_DEV void zo_cos_sin(u64 x, double* cs, double* sn) {
  u64 q = x >> 30;
  double phi = ((double)(x & 0x3FFFFFFFULL) + 0.5) * @PI_2_M31@ - @PI_4@;
  double p2 = phi * phi;
  double sp = @SIN_C4@;
  sp = sp * p2 + @SIN_C3@;
  sp = sp * p2 + @SIN_C2@;
  sp = sp * p2 + @SIN_C1@;
  sp = sp * p2 + @SIN_C0@;
  double s = phi + phi * (p2 * sp);
  double cp = @COS_C5@;
  cp = cp * p2 + @COS_C4@;
  cp = cp * p2 + @COS_C3@;
  cp = cp * p2 + @COS_C2@;
  cp = cp * p2 + @COS_C1@;
  cp = cp * p2 + @COS_C0@;
  double c = 1.0 + p2 * cp;
  int odd = (q & 1ULL) != 0ULL;
  double c1 = odd ? -s : c;
  double s1 = odd ? c : s;
  int half = (q & 2ULL) != 0ULL;
  *cs = half ? -c1 : c1;
  *sn = half ? -s1 : s1;
}

// rng.box_muller, each z rounded to float32 (as rng.gauss4)
ZO_DEV void zo_box_muller(u64 xa, u64 xb, double* za, double* zb) {
  double r = sqrt(zo_neg2_log_u(xa));
  double cs, sn;
  zo_cos_sin(xb, &cs, &sn);
  *za = ZO_F2D(ZO_D2F(r * cs));
  *zb = ZO_F2D(ZO_D2F(r * sn));
}

ZO_DEV double zo_gauss_at(u64 e, u64 t, u64 k0, u64 k1) {
  u64 b = e >> 2;
  u64 c[4] = {b & ZO_M32, b >> 32, t, 0ULL};
  zo_philox(c, k0, k1);
  u64 lane = e & 3ULL;
  int second = lane >= 2ULL;
  double za, zb;
  zo_box_muller(second ? c[2] : c[0], second ? c[3] : c[1], &za, &zb);
  return (lane & 1ULL) != 0ULL ? zb : za;
}

// word j (0..3) of a Philox output, selected without indexing (registers on the GPU)
ZO_DEV u64 zo_word(const u64 c[4], u64 j) {
  u64 lo = j == 1ULL ? c[1] : c[0];
  u64 hi = j == 3ULL ? c[3] : c[2];
  return j >= 2ULL ? hi : lo;
}

ZO_DEV double zo_rad_at(u64 e, u64 t, u64 k0, u64 k1) {
  u64 b = e >> 7;
  u64 c[4] = {b & ZO_M32, b >> 32, t, 1ULL};
  zo_philox(c, k0, k1);
  u64 j = (e >> 5) & 3ULL;
  u64 w = zo_word(c, j);
  return 1.0 - 2.0 * (double)((w >> (e & 31ULL)) & 1ULL);
}

// Gaussian-fast (domain 2): 16-bit value h of word q >> 7 of Philox block (S << 7) | (q & 127),
// S = e >> 10, r = e & 1023, q = r >> 1, half r & 1; z = FAST_TABLE[h] (float32 bit patterns).
ZO_CONST u32 zo_fast_tab[65536] = {
@FAST_TABLE@
};

ZO_DEV double zo_fast_at(u64 e, u64 t, u64 k0, u64 k1) {
  u64 r = e & 1023ULL;
  u64 q = r >> 1;
  u64 blk = ((e >> 10) << 7) | (q & 127ULL);
  u64 c[4] = {blk & ZO_M32, blk >> 32, t, 2ULL};
  zo_philox(c, k0, k1);
  u64 k = q >> 7;
  u64 x = zo_word(c, k);
  u64 h = (r & 1ULL) != 0ULL ? (x >> 16) : (x & 0xFFFFULL);
  return (double)ZO_U2F(zo_fast_tab[h]);
}

ZO_DEV double zo_z(u64 e, u64 t, u64 k0, u64 k1, int dist) {
  return dist == 0 ? zo_gauss_at(e, t, k0, k1)
                   : (dist == 1 ? zo_rad_at(e, t, k0, k1) : zo_fast_at(e, t, k0, k1));
}

// The kernels walk quads: quad Q is elements 4Q .. 4Q + 3 of a tensor, one Gaussian Philox
// block, so one Philox call and two Box-Muller pairs give its four z (element by element they
// took four calls and four pairs, two of them thrown away); a Rademacher quad lies in one
// 128-element block (one call), a Gaussian-fast quad in two blocks (two calls). Each z is
// the zo_z of its element, bit for bit. p[i] is element off + i: the quads of a launch are
// off >> 2 .. (off + n - 1) >> 2, the first and last possibly partial (zo_lane).
ZO_DEV void zo_z4(u64 e4, u64 t, u64 k0, u64 k1, int dist, double z[4]) {
  if (dist == 0) {
    u64 b = e4 >> 2;
    u64 c[4] = {b & ZO_M32, b >> 32, t, 0ULL};
    zo_philox(c, k0, k1);
    zo_box_muller(c[0], c[1], &z[0], &z[1]);
    zo_box_muller(c[2], c[3], &z[2], &z[3]);
  } else if (dist == 1) {
    u64 b = e4 >> 7;
    u64 c[4] = {b & ZO_M32, b >> 32, t, 1ULL};
    zo_philox(c, k0, k1);
    u64 j = (e4 >> 5) & 3ULL;
    u64 w = zo_word(c, j);
    ZO_UNROLL
    for (int l = 0; l < 4; ++l)
      z[l] = 1.0 - 2.0 * (double)((w >> ((e4 + (u64)l) & 31ULL)) & 1ULL);
  } else {
    ZO_UNROLL
    for (int h = 0; h < 2; ++h) {
      // elements e4 + 2h and e4 + 2h + 1: the low and high 16 bits of one word
      u64 r = (e4 + 2ULL * (u64)h) & 1023ULL;
      u64 q = r >> 1;
      u64 blk = ((e4 >> 10) << 7) | (q & 127ULL);
      u64 c[4] = {blk & ZO_M32, blk >> 32, t, 2ULL};
      zo_philox(c, k0, k1);
      u64 k = q >> 7;
      u64 lo = k == 1ULL ? c[1] : c[0];
      u64 hi = k == 3ULL ? c[3] : c[2];
      u64 x = k >= 2ULL ? hi : lo;
      z[2 * h] = (double)ZO_U2F(zo_fast_tab[x & 0xFFFFULL]);
      z[2 * h + 1] = (double)ZO_U2F(zo_fast_tab[x >> 16]);
    }
  }
}

// acc[l] = sum over k of gs[k] z_k (lane l of the quad at e4), k = 0, 1, ... from 0.0: the
// CPU's order (the multi-perturbation update)
ZO_DEV void zo_acc4(u64 e4, u64 t, const u64* k0s, const u64* k1s, const double* gs, int npert,
                    int dist, double acc[4]) {
  double z[4];
  ZO_UNROLL
  for (int l = 0; l < 4; ++l) acc[l] = 0.0;
  for (int k = 0; k < npert; ++k) {
    zo_z4(e4, t, k0s[k], k1s[k], dist, z);
    ZO_UNROLL
    for (int l = 0; l < 4; ++l) acc[l] = acc[l] + gs[k] * z[l];
  }
}

ZO_DEV long long zo_nquads(u64 off, long long n) {
  return n <= 0 ? 0LL : (long long)(((off + (u64)(n - 1)) >> 2) - (off >> 2) + 1ULL);
}

ZO_DEV u64 zo_quad(u64 off, long long j) { return ((off >> 2) + (u64)j) << 2; }

// the index into p of lane l of the quad at element e4, or -1 where p does not reach
ZO_DEV long long zo_lane(u64 off, long long n, u64 e4, int l) {
  u64 e = e4 + (u64)l;
  if (e < off || e - off >= (u64)n) return -1;
  return (long long)(e - off);
}

ZO_DEV double zo_half_to_double(u16 h) {
  long long x = (long long)h;
  long long e = (x >> 10) & 0x1F;
  long long m = x & 0x3FF;
  double v;
  if (e == 0) {
    v = (double)m * 5.9604644775390625e-08;
  } else {
    long long ef = e == 31 ? 255 : e + 112;
    v = (double)ZO_U2F((u32)((ef << 23) | (m << 13)));
  }
  return (x & 0x8000) != 0 ? -v : v;
}

ZO_DEV u16 zo_float_to_half(float x) {
  long long f = (long long)ZO_F2U(x);
  long long sign = f & 0x80000000LL;
  long long o;
  f = f ^ sign;
  if (f >= 0x47800000LL) {
    o = f > 0x7F800000LL ? 0x7E00 : 0x7C00;
  } else if (f < 0x38800000LL) {
    float ff = ZO_U2F((u32)f) + 0.5f;
    o = (long long)ZO_F2U(ff) - 0x3F000000LL;
  } else {
    long long odd = (f >> 13) & 1;
    o = (f - 0x38000000LL + 0xFFF + odd) >> 13;
  }
  return (u16)(o | (sign >> 16));
}

// bfloat16 storage: the uint16 bits are the upper half of a float32 (exact upcast); a float32
// is stored rounded to nearest even on its bit pattern, NaN kept quiet (kernels.py's rule).
ZO_DEV double zo_bf16_to_double(u16 h) { return ZO_F2D(ZO_U2F(((u32)h) << 16)); }

ZO_DEV u16 zo_float_to_bf16(float x) {
  u32 f = ZO_F2U(x);
  if ((f & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((f >> 16) | 0x40u);
  return (u16)((f + 0x7FFFu + ((f >> 16) & 1u)) >> 16);
}

#define ZO_LOAD_f32(p, i) ZO_F2D((p)[i])
#define ZO_STORE_f32(p, i, v) ((p)[i] = ZO_D2F(v))
#define ZO_LOAD_f64(p, i) ((p)[i])
#define ZO_STORE_f64(p, i, v) ((p)[i] = (v))
#define ZO_LOAD_f16(p, i) zo_half_to_double((p)[i])
#define ZO_STORE_f16(p, i, v) ((p)[i] = zo_float_to_half(ZO_D2F(v)))
#define ZO_LOAD_bf16(p, i) zo_bf16_to_double((p)[i])
#define ZO_STORE_bf16(p, i, v) ((p)[i] = zo_float_to_bf16(ZO_D2F(v)))

ZO_GLOBAL zo_zvec(float* out, long long n, u64 e0, u64 t, u64 k0, u64 k1, int dist) {
  long long nq = zo_nquads(e0, n);
  ZO_FOR(j, nq) {
    u64 e4 = zo_quad(e0, j);
    double z[4];
    zo_z4(e4, t, k0, k1, dist, z);
    ZO_UNROLL
    for (int l = 0; l < 4; ++l) {
      long long i = zo_lane(e0, n, e4, l);
      if (i >= 0) out[i] = (float)z[l];
    }
  }
}

#define ZO_DEFINE(S, T)                                                                       \
ZO_GLOBAL zo_perturb_##S(T* p, long long n, u64 off, u64 t, u64 k0, u64 k1, int dist,         \
                         double scale) {                                                      \
  long long nq = zo_nquads(off, n);                                                           \
  ZO_FOR(j, nq) {                                                                             \
    u64 e4 = zo_quad(off, j);                                                                 \
    double z[4];                                                                              \
    zo_z4(e4, t, k0, k1, dist, z);                                                            \
    ZO_UNROLL                                                                                 \
    for (int l = 0; l < 4; ++l) {                                                             \
      long long i = zo_lane(off, n, e4, l);                                                   \
      if (i >= 0) ZO_STORE_##S(p, i, ZO_LOAD_##S(p, i) + scale * z[l]);                       \
    }                                                                                         \
  }                                                                                           \
}                                                                                             \
ZO_GLOBAL zo_restore_update_##S(T* p, long long n, u64 off, u64 t, u64 k0, u64 k1, int dist,  \
                                double eps, double lr, double g, double wd) {                 \
  long long nq = zo_nquads(off, n);                                                           \
  ZO_FOR(j, nq) {                                                                             \
    u64 e4 = zo_quad(off, j);                                                                 \
    double z[4];                                                                              \
    zo_z4(e4, t, k0, k1, dist, z);                                                            \
    ZO_UNROLL                                                                                 \
    for (int l = 0; l < 4; ++l) {                                                             \
      long long i = zo_lane(off, n, e4, l);                                                   \
      if (i < 0) continue;                                                                    \
      double pr = ZO_LOAD_##S(p, i) + eps * z[l];                                             \
      ZO_STORE_##S(p, i, pr - lr * (g * z[l] + wd * pr));                                     \
    }                                                                                         \
  }                                                                                           \
}                                                                                             \
ZO_GLOBAL zo_multi_update_##S(T* p, long long n, u64 off, u64 t, const u64* k0s,             \
                              const u64* k1s, const double* gs, int npert, double lr,         \
                              double wd, int restore, u64 rk0, u64 rk1, double eps,           \
                              int dist) {                                                     \
  long long nq = zo_nquads(off, n);                                                           \
  ZO_FOR(j, nq) {                                                                             \
    u64 e4 = zo_quad(off, j);                                                                 \
    double acc[4], z[4];                                                                      \
    zo_acc4(e4, t, k0s, k1s, gs, npert, dist, acc);                                           \
    if (restore) zo_z4(e4, t, rk0, rk1, dist, z);                                             \
    ZO_UNROLL                                                                                 \
    for (int l = 0; l < 4; ++l) {                                                             \
      long long i = zo_lane(off, n, e4, l);                                                   \
      if (i < 0) continue;                                                                    \
      double pr = ZO_LOAD_##S(p, i);                                                          \
      if (restore) pr = pr + eps * z[l];                                                      \
      ZO_STORE_##S(p, i, pr - lr * (acc[l] + wd * pr));                                       \
    }                                                                                         \
  }                                                                                           \
}                                                                                             \
ZO_GLOBAL zo_stream_##S(T* p, T* q, long long n, u64 off, u64 t, int mode, u64 k0, u64 k1,   \
                        double a, double lr, double g, double wd, const u64* k0s,             \
                        const u64* k1s, const double* gs, int npert, int post, u64 pk0,       \
                        u64 pk1, double pa, int dist) {                                       \
  long long nq = zo_nquads(off, n);                                                           \
  ZO_FOR(j, nq) {                                                                             \
    u64 e4 = zo_quad(off, j);                                                                 \
    double z[4] = {0.0, 0.0, 0.0, 0.0}, acc[4] = {0.0, 0.0, 0.0, 0.0};                        \
    double zp[4] = {0.0, 0.0, 0.0, 0.0};                                                      \
    if (mode == 2 || mode == 3) zo_acc4(e4, t, k0s, k1s, gs, npert, dist, acc);               \
    if (mode == 0 || mode == 1 || mode == 2) zo_z4(e4, t, k0, k1, dist, z);                   \
    if (post) zo_z4(e4, t, pk0, pk1, dist, zp);                                               \
    ZO_UNROLL                                                                                 \
    for (int l = 0; l < 4; ++l) {                                                             \
      long long i = zo_lane(off, n, e4, l);                                                   \
      if (i < 0) continue;                                                                    \
      if (mode == 0) {                                                                        \
        ZO_STORE_##S(p, i, ZO_LOAD_##S(p, i) + a * z[l]);                                     \
      } else if (mode == 1) {                                                                 \
        double pr = ZO_LOAD_##S(p, i) + a * z[l];                                             \
        ZO_STORE_##S(p, i, pr - lr * (g * z[l] + wd * pr));                                   \
      } else if (mode == 2 || mode == 3) {                                                    \
        double pr = ZO_LOAD_##S(p, i);                                                        \
        if (mode == 2) pr = pr + a * z[l];                                                    \
        ZO_STORE_##S(p, i, pr - lr * (acc[l] + wd * pr));                                     \
      }                                                                                       \
      if (post) ZO_STORE_##S(q, i, ZO_LOAD_##S(p, i) + pa * zp[l]);                           \
    }                                                                                         \
  }                                                                                           \
}

ZO_DEFINE(f32, float)
ZO_DEFINE(f64, double)
ZO_DEFINE(f16, u16)
ZO_DEFINE(bf16, u16)
"""


def _c_double(x: float) -> str:
    """A C literal that parses to exactly the double ``x``."""
    s = repr(float(x))
    return s if ("e" in s or "." in s) else s + ".0"


@functools.cache
def cuda_source() -> str:
    """The CUDA C source of the GPU kernels (also valid C: see the module docstring)."""
    subs = {
        "PHILOX_M0": str(int(rng.PHILOX_M0)), "PHILOX_M1": str(int(rng.PHILOX_M1)),
        "PHILOX_W0": str(int(rng.PHILOX_W0)), "PHILOX_W1": str(int(rng.PHILOX_W1)),
        "TWO_M32": _c_double(rng.TWO_M32), "TWO_M16": _c_double(rng.TWO_M16),
        "TWO_M8": _c_double(rng.TWO_M8), "SQRT2": _c_double(rng.SQRT2),
        "LN2": _c_double(rng.LN2), "PI_2_M31": _c_double(rng.PI_2_M31),
        "PI_4": _c_double(rng.PI_4),
        "M52": str(int(rng.M52)), "EXP1023": str(int(rng.EXP1023)),
    }
    bits = rng.fast_table().view(np.uint32)
    subs["FAST_TABLE"] = "\n".join(
        ",".join(f"0x{int(v):08x}u" for v in bits[i:i + 8]) + ","
        for i in range(0, bits.size, 8))
    for name in ("LOG_C", "SIN_C", "COS_C"):
        for i, c in enumerate(getattr(rng, name)):
            subs[f"{name}{i}"] = _c_double(c)
    src = _SOURCE_TEMPLATE
    for k, v in subs.items():
        src = src.replace(f"@{k}@", v)
    if "@" in src:
        raise RuntimeError("unsubstituted constant in the CUDA source")
    return src
