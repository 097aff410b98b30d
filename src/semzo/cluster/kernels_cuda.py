"""CUDA C kernels of the GPU k-means E-step (:mod:`semzo.cluster.gpu`), and their loader.

Three kernels, each spelling a numba kernel of :mod:`semzo.cluster.kernels` operation for
operation, so that the GPU path gives the CPU path's bits from the same GEMM output:

- ``km_argmin``: a thread per row of a block of ``b`` rows, reading the transposed scores
  ``dT = centers @ rows.T`` (k, b) (a warp reads 32 consecutive floats per centre: coalesced);
  the first ``j`` minimising ``c_sq[j] - 2 dT[j, r]`` in float32, as
  :func:`~semzo.cluster.kernels.argmin_cols`; the label written in place, its score kept for
  the approximate inertia, and the labels that changed counted (an integer atomic: exact).
  Replaces a scale, a subtraction, an argmin and a gather over the (b, k) scores (four
  launches, the scores read and written twice) by one pass that reads them once.
- ``km_cluster_sums``: a thread per (cluster, feature) sums that feature over the cluster's
  rows **in row order** in float64, starting from 0.0, which is exactly what
  :func:`~semzo.cluster.kernels.accumulate_rows` does on the CPU; the rows of a cluster come
  from a sort of the labels (:func:`semzo.cluster.gpu.LloydGPU.estep`). Replaces
  ``cupy.add.at`` (float64 atomics into k x d addresses, about n / k adds contending for
  each, whose order and so whose sums changed from run to run) and the float64 copy of
  every row block it needed.
- ``km_update_nearest`` (k-means||): a thread per row folds a batch of candidates into the
  row's nearest-candidate distance, one candidate after the other, as
  :func:`~semzo.cluster.kernels.update_nearest` (the generic version took CuPy's argmin of
  the float32 scores, which picks a different candidate where two scores clamp to the same
  distance).

CuPy compiles every kernel with ``-ftz=true`` (after the caller's options; NVRTC takes the
last), which would flush float32 subnormals in the score's arithmetic, its comparison and
the float -> double conversion; inline PTX without ``.ftz`` keeps the CPU's IEEE semantics
(as in :mod:`semzo.zo.kernels_cuda`). The same source compiles as plain C (the ``KM_*``
macros turn a grid-stride loop into a serial loop and the atomic into an add): the tests
build it with gcc and compare it with the numba kernels bit for bit.

This module imports no CuPy at import time; :func:`kernels` compiles the module for the
current device the first time it is asked (``SEMZO_GPU_FUSED=0`` or a compile failure: None,
and :mod:`semzo.cluster.gpu` runs its generic CuPy E-step instead).
"""

from __future__ import annotations

import functools

KERNELS = ("km_argmin", "km_cluster_sums", "km_update_nearest")
THREADS_PER_BLOCK = 256
MAX_BLOCKS = 65535

_SOURCE = r"""
// semzo k-means kernels (generated from semzo/cluster/kernels_cuda.py)
#ifdef __CUDACC__
#define KM_GLOBAL extern "C" __global__ void
#define KM_FOR(i, n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; \
                          i < (n); i += (long long)blockDim.x * gridDim.x)
#define KM_COUNT(p) atomicAdd((p), 1ULL)
#define KM_INF __int_as_float(0x7f800000)
// IEEE float32 (no .ftz, see the module docstring): c - 2 v, a < b, and float -> double
static __device__ __forceinline__ float km_score(float c, float v) {
  float t, s;
  asm("mul.rn.f32 %0, %1, 0f40000000;" : "=f"(t) : "f"(v));
  asm("sub.rn.f32 %0, %1, %2;" : "=f"(s) : "f"(c), "f"(t));
  return s;
}
static __device__ __forceinline__ int km_lt(float a, float b) {
  unsigned int r;
  asm("{ .reg .pred p; setp.lt.f32 p, %1, %2; selp.u32 %0, 1, 0, p; }"
      : "=r"(r) : "f"(a), "f"(b));
  return (int)r;
}
static __device__ __forceinline__ double km_f2d(float x) {
  double r; asm("cvt.f64.f32 %0, %1;" : "=d"(r) : "f"(x)); return r;
}
#else
#include <math.h>
#define KM_GLOBAL void
#define KM_FOR(i, n) for (long long i = 0; i < (n); ++i)
#define KM_COUNT(p) (*(p) += 1ULL)
#define KM_INF INFINITY
static inline float km_score(float c, float v) { float t = 2.0f * v; return c - t; }
static inline int km_lt(float a, float b) { return a < b; }
static inline double km_f2d(float x) { return (double)x; }
#endif

// Rows r < b of a block: dT (k, b) float32 (centers @ rows.T), c_sq (k,) float32 (zeros for
// the spherical variant). labels (b,) int32: the previous labels in, the new ones out;
// best (b,): the winning score; *changed += the labels that changed. Ties and NaN as
// kernels.argmin_cols: the first j with a score strictly below every earlier one (a NaN
// score never wins; a row of NaN keeps j = 0 with score +inf).
KM_GLOBAL km_argmin(const float *dT, const float *c_sq, long long b, int k, int *labels,
                    float *best, unsigned long long *changed) {
  KM_FOR(r, b) {
    float bv = KM_INF;
    int bj = 0;
    for (int j = 0; j < k; ++j) {
      float s = km_score(c_sq[j], dT[(long long)j * b + r]);
      if (km_lt(s, bv)) { bv = s; bj = j; }
    }
    if (labels[r] != bj) { KM_COUNT(changed); labels[r] = bj; }
    best[r] = bv;
  }
}

// k-means|| (init.py): fold m candidates, numbered from base, into each row's nearest one.
// dT (m, b) float32 = cand @ rows.T, b_sq (m,) float32, x_sq (b,) float64; d2 (b,) float64
// and nearest (b,) int32 updated in place. Candidate j wins where max(0, x_sq + (double)
// (b_sq[j] - 2 dT[j, r])) is strictly below the row's d2 (the earlier candidate keeps a tie;
// NaN clamps to 0, as numba's max(0.0, v)): kernels.update_nearest.
KM_GLOBAL km_update_nearest(const float *dT, const float *b_sq, const double *x_sq,
                            long long b, int m, double *d2, int *nearest, int base) {
  KM_FOR(r, b) {
    double best = d2[r], xs = x_sq[r];
    int near = nearest[r];
    for (int j = 0; j < m; ++j) {
      double v = xs + km_f2d(km_score(b_sq[j], dT[(long long)j * b + r]));
      v = v > 0.0 ? v : 0.0;
      if (v < best) { best = v; near = base + j; }
    }
    d2[r] = best;
    nearest[r] = near;
  }
}

// sums[c, t] = sum over the m = count[c] rows order[start[c]], ..., order[start[c] + m - 1]
// (each < the rows of x; ascending: row order) of x[row, t], in float64 from 0.0, one add
// after the other (kernels.accumulate_rows). Four rows' loads are issued before their adds
// (the adds stay in order).
KM_GLOBAL km_cluster_sums(const float *x, const long long *order, const long long *start,
                          const long long *count, int k, int d, double *sums) {
  KM_FOR(i, (long long)k * d) {
    long long c = i / d;
    long long t = i - c * d;
    const long long *o = order + start[c];
    long long m = count[c], r = 0;
    double s = 0.0;
    for (; r + 4 <= m; r += 4) {
      float a0 = x[o[r] * d + t], a1 = x[o[r + 1] * d + t];
      float a2 = x[o[r + 2] * d + t], a3 = x[o[r + 3] * d + t];
      s += km_f2d(a0); s += km_f2d(a1); s += km_f2d(a2); s += km_f2d(a3);
    }
    for (; r < m; ++r) s += km_f2d(x[o[r] * d + t]);
    sums[i] = s;
  }
}
"""

_FAILED: dict = {}


def cuda_source() -> str:
    """The CUDA C source (also valid C: the tests build it with gcc)."""
    return _SOURCE


def blocks(n: int) -> int:
    """Blocks of THREADS_PER_BLOCK threads for a grid-stride loop over ``n`` items."""
    return max(1, min(MAX_BLOCKS, -(-int(n) // THREADS_PER_BLOCK)))


@functools.cache
def _module(device_id: int) -> dict:
    import cupy  # GPU only
    mod = cupy.RawModule(code=cuda_source(), options=("--fmad=false",))
    return {name: mod.get_function(name) for name in KERNELS}   # compiled now, once


def kernels() -> dict | None:
    """{kernel name: compiled function} on the current device; None when the fused GPU
    kernels are turned off (``SEMZO_GPU_FUSED=0``) or do not compile here (warned once)."""
    from ..backend import gpu_kernels
    return gpu_kernels(_module, _FAILED, "the k-means GPU kernels", "the generic CuPy E-step")
