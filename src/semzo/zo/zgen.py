"""The direction z on the CPU: the generator of :mod:`semzo.rng` compiled with numba, the
half-precision bit conversions the fused passes load and store with, and the kernels that fill
a buffer with z (:func:`fill_z`, :func:`zvec_kernel`). The fused passes that use them are in
:mod:`.kernels`; the GPU kernels (:mod:`.kernels_gpu`) compile the same generator functions
(:func:`build_device_functions`) for CUDA, so z has the same bits on CPU and GPU.

numba keys a cached kernel on its own file only; ``import semzo`` drops the package's caches
when any source changed (``semzo._drop_stale_numba_caches``), so edits of rng.py reach them.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import numpy as np
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import overload

from .. import rng

CHUNK = 32768       # elements per parallel task (a multiple of 128, the Rademacher block)
SUB = 1024          # elements per z buffer inside a task (8 KiB of float64: stays in L1)

DEVICE_FUNCTIONS = ("philox4x32_10", "neg2_log_tail", "neg2_log_u", "cos_sin_2pi", "box_muller",
                    "gauss4", "gauss_at", "rad_words", "rad_bit", "rad_at", "fast_words",
                    "fast_at")


def build_device_functions(decorator: Callable, *, cpu: bool = False) -> dict:
    """Compile the generator functions of rng.py with ``decorator`` (``numba.njit`` or
    ``numba.cuda.jit(device=True)``), each calling the compiled versions of the others.

    ``cpu=True`` swaps in :func:`rng.neg2_log_u_bits` (bit-identical, faster on the CPU).
    Returns the namespace: rng's globals with the compiled functions under their names.
    """
    ns = dict(vars(rng))
    for name in DEVICE_FUNCTIONS:
        f = getattr(rng, name)
        if cpu and name == "neg2_log_u":
            f = rng.neg2_log_u_bits
        g = types.FunctionType(f.__code__, ns, name, f.__defaults__, f.__closure__)
        g.__qualname__ = name
        g.__module__ = rng.__name__
        g.__doc__ = f.__doc__
        ns[name] = decorator(g)
    return ns


_dev = build_device_functions(lambda f: njit(inline="always", error_model="numpy")(f), cpu=True)
_box_muller = _dev["box_muller"]
_gauss_at = _dev["gauss_at"]
_rad_words = _dev["rad_words"]
_rad_bit = _dev["rad_bit"]
_rad_at = _dev["rad_at"]
_fast_words = _dev["fast_words"]
_fast_at = _dev["fast_at"]
_U0, _U1, _U2, _U3, _U7 = (np.uint64(v) for v in (0, 1, 2, 3, 7))
_U10, _U15, _U16, _U63, _U127, _U1023 = (np.uint64(v) for v in (10, 15, 16, 63, 127, 1023))
_M16 = np.uint64(0xFFFF)
FAST_TABLE = rng.fast_table()       # float32[65536], passed to the kernels as an argument
# RAD_NIBBLES[4 n + b] = Rademacher z of bit b of the 4-bit value n (float64 +-1.0)
RAD_NIBBLES = np.array([1.0 - 2.0 * ((n >> b) & 1) for n in range(16) for b in range(4)])
WSTRIDE = SUB // 4                  # column stride of the Philox words in ws (philox_blocks)
WS = 4 * WSTRIDE                    # uint64 scratch words per task (Gaussian-fast needs 512)
assert SUB % 128 == 0 and WS >= 512
_philox = _dev["philox4x32_10"]
_M32 = rng.M32
_U32 = rng.U32


# ----------------------------------------------------------------------------- half precision
@njit(cache=True, error_model="numpy")
def half_bits_to_f64(h):
    """float16 bits (uint16) -> float64, exact (subnormals, inf, nan included)."""
    x = np.int64(h)
    e = (x >> 10) & 0x1F
    m = x & 0x3FF
    if e == 0:
        v = np.float64(m) * 5.9604644775390625e-08           # m * 2**-24
    else:
        ef = 255 if e == 31 else e + 112
        v = np.float64(np.uint32((ef << 23) | (m << 13)).view(np.float32))
    return -v if (x & 0x8000) != 0 else v


@njit(cache=True, error_model="numpy")
def f32_to_half_bits(x):
    """float32 -> float16 bits (uint16), round to nearest even (F. Giesen's float_to_half_rtne)."""
    f = np.int64(np.float32(x).view(np.uint32))
    sign = f & 0x80000000
    f = f ^ sign
    if f >= 0x47800000:                                  # overflow to inf, or inf / nan
        o = 0x7E00 if f > 0x7F800000 else 0x7C00
    elif f < 0x38800000:                                 # half subnormal or zero
        ff = np.uint32(f).view(np.float32) + np.float32(0.5)
        o = np.int64(np.float32(ff).view(np.uint32)) - 0x3F000000
    else:
        odd = (f >> 13) & 1
        o = (f - 0x38000000 + 0xFFF + odd) >> 13
    return np.uint16(o | (sign >> 16))


@njit(cache=True, error_model="numpy")
def bf16_bits_to_f64(h):
    """bfloat16 bits (an int16 or uint16 holding them) -> float64, exact."""
    x = np.uint32((np.int64(h) & 0xFFFF) << 16)
    return np.float64(x.view(np.float32))


@njit(cache=True, error_model="numpy")
def f32_to_bf16_bits(x):
    """float32 -> bfloat16 bits as an int16 (the storage view), round to nearest even; NaN
    stays a quiet NaN; overflow rounds to inf (as torch's ``.to(torch.bfloat16)``)."""
    f = np.int64(np.float32(x).view(np.uint32))
    if (f & 0x7FFFFFFF) > 0x7F800000:
        o = (f >> 16) | 0x40
    else:
        o = (f + 0x7FFF + ((f >> 16) & 1)) >> 16
    o = o & 0xFFFF
    return np.int16(o - 0x10000 if o >= 0x8000 else o)


def _load(p, i):
    pass


def _store(p, i, v):
    pass


@overload(_load)
def _ol_load(p, i):
    if p.dtype == nbtypes.uint16:
        return lambda p, i: half_bits_to_f64(p[i])
    if p.dtype == nbtypes.int16:
        return lambda p, i: bf16_bits_to_f64(p[i])
    return lambda p, i: np.float64(p[i])


@overload(_store)
def _ol_store(p, i, v):
    if p.dtype == nbtypes.uint16:
        def store_half(p, i, v):
            p[i] = f32_to_half_bits(np.float32(v))
        return store_half
    if p.dtype == nbtypes.int16:
        def store_bf16(p, i, v):
            p[i] = f32_to_bf16_bits(np.float32(v))
        return store_bf16

    def store(p, i, v):
        p[i] = v                                          # one rounding float64 -> dtype
    return store


# ----------------------------------------------------------------------------- z generation
@njit(cache=True, error_model="numpy")
def fast_block_words(ws, s, t, k0, k1):
    """ws[k * 128 + j] = word k of Gaussian-fast Philox block 128 s + j (j < 128): the 512
    words of super-block s side by side (one straight loop over the 128 blocks)."""
    b0 = s << _U7
    for j in range(128):
        x0, x1, x2, x3 = _fast_words(b0 + np.uint64(j), t, k0, k1)
        ws[j] = x0
        ws[128 + j] = x1
        ws[256 + j] = x2
        ws[384 + j] = x3


@njit(cache=True, error_model="numpy")
def fill_fast(z, e0, t, k0, k1, tab, ws):
    """z[i] = Gaussian-fast z of element e0 + i (float64), ws: uint64[WS] scratch. Serial.

    Whole aligned super-blocks of 1024 elements: 128 Philox calls, then two table lookups per
    word; a partial super-block computes its 128 calls and looks up the elements it needs.
    """
    m = z.size
    i = 0
    e = e0
    while i < m:
        s = e >> _U10
        r0 = np.int64(e & _U1023)
        cnt = min(1024 - r0, m - i)
        fast_block_words(ws, s, t, k0, k1)
        zz = z[i:i + cnt]
        if cnt == 1024:
            for q in range(512):
                x = ws[q]
                zz[2 * q] = np.float64(tab[x & _M16])
                zz[2 * q + 1] = np.float64(tab[x >> _U16])
        else:
            for r in range(cnt):
                x = ws[(r + r0) >> 1]
                h = (x >> _U16) if ((r + r0) & 1) != 0 else (x & _M16)
                zz[r] = np.float64(tab[h])
        i += cnt
        e += np.uint64(cnt)


@njit(cache=True, error_model="numpy")
def philox_blocks(ws, nb, b0, t, dom, k0, k1):
    """ws[k * WSTRIDE + j] = word k of Philox block b0 + j (counter (b, t, dom)), j < nb.

    Structure of arrays: a straight loop over nb <= WSTRIDE independent calls that LLVM
    vectorizes (8 blocks per AVX-512 register, vpmuludq for the 32x32->64 products)."""
    for j in range(nb):
        b = b0 + np.uint64(j)
        x0, x1, x2, x3 = _philox(b & _M32, b >> _U32, t, dom, k0, k1)
        ws[j] = x0
        ws[WSTRIDE + j] = x1
        ws[2 * WSTRIDE + j] = x2
        ws[3 * WSTRIDE + j] = x3


@njit(cache=True, error_model="numpy")
def _gauss_blocks(z, i, nb, ws):
    """z[i + 4 j + l] = Gaussian z of lane l of Philox block j of ws (after
    :func:`philox_blocks` with domain 0), j < nb: :func:`rng.gauss4`'s Box-Muller on words
    the Philox loop made side by side. The same operations as ``gauss4``, hence the same
    bits; with the Philox rounds out of it the loop vectorizes (4 float64 lanes): 3.1 ns per
    z against 4.9 with Philox inside (Intel Xeon, one thread, 2026-11-27)."""
    zz = z[i:]
    for j in range(nb):
        za, zb = _box_muller(ws[j], ws[WSTRIDE + j])
        zc, zd = _box_muller(ws[2 * WSTRIDE + j], ws[3 * WSTRIDE + j])
        zz[4 * j] = np.float64(np.float32(za))
        zz[4 * j + 1] = np.float64(np.float32(zb))
        zz[4 * j + 2] = np.float64(np.float32(zc))
        zz[4 * j + 3] = np.float64(np.float32(zd))


@njit(cache=True, error_model="numpy")
def _rad_blocks(z, i, nb, ws):
    """z[i + 128 j + 32 k + b] = Rademacher z of bit b of word k of column j of ws (after
    :func:`philox_blocks`), j < nb: four z at a time from :data:`RAD_NIBBLES` (the same
    +-1.0 as :func:`rng.rad_bit`; a constant array to numba)."""
    nib = RAD_NIBBLES
    zz = z[i:]                  # indices from loop counters: known >= 0, no wraparound code
    for j in range(nb):
        for k in range(4):
            w = ws[k * WSTRIDE + j]
            for q in range(8):
                n4 = np.int64((w >> np.uint64(4 * q)) & _U15) * 4
                o = 128 * j + 32 * k + 4 * q
                zz[o] = nib[n4]
                zz[o + 1] = nib[n4 + 1]
                zz[o + 2] = nib[n4 + 2]
                zz[o + 3] = nib[n4 + 3]


@njit(cache=True, error_model="numpy")
def rad_axpy(pv, nb, ws, a):
    """pv[128 j + 32 k + b] += a z for the Rademacher z of :func:`_rad_blocks` (j < nb),
    without a z buffer: a z = a (1 - 2 bit) is exactly +-a, made by flipping the sign bit of
    a with the z bit (integer shifts and a xor, no table and no multiply), the same value and
    rounding as ``_load(pv, i) + a * z[i]``. One straight loop per word, vectorized (it runs
    at the speed of the plain pass p + a in L1; the multiply form took 1.5x)."""
    ab = np.float64(a).view(np.uint64)
    for j in range(nb):
        for k in range(4):
            w = ws[k * WSTRIDE + j]
            o = 128 * j + 32 * k
            for b in range(32):
                s = ((w >> np.uint64(b)) & _U1) << _U63
                _store(pv, o + b, _load(pv, o + b) + np.uint64(ab ^ s).view(np.float64))


@njit(cache=True, error_model="numpy")
def fill_z(z, e0, t, k0, k1, dist, tab, ws):
    """z[i] = z(seed, t, e0 + i) for i < z.size (float64 array of float32-rounded
    values).

    e0, t, k0, k1: uint64; dist: rng.GAUSSIAN, rng.RADEMACHER or rng.GAUSSIAN_FAST;
    tab: FAST_TABLE; ws: uint64[WS] scratch. Serial. Whole Philox blocks are generated
    together (:func:`philox_blocks`, at most WSTRIDE at a time: any z.size is safe for ws),
    partial ones at the ends element by element.
    """
    m = z.size
    i = 0
    e = e0
    if dist == 2:
        fill_fast(z, e0, t, k0, k1, tab, ws)
    else:
        gauss = dist == 0               # Gaussian: 4 z per Philox block, Rademacher: 128
        per = 4 if gauss else 128
        mask = np.uint64(per - 1)
        shift = _U2 if gauss else _U7
        dom = _U0 if gauss else _U1
        while i < m and (e & mask) != _U0:                   # a partial first block
            z[i] = _gauss_at(e, t, k0, k1) if gauss else _rad_at(e, t, k0, k1)
            i += 1
            e += _U1
        left = (m - i) // per
        while left > 0:                     # at most WSTRIDE blocks per fill of ws
            nb = min(left, WSTRIDE)
            philox_blocks(ws, nb, e >> shift, t, dom, k0, k1)
            if gauss:
                _gauss_blocks(z, i, nb, ws)
            else:
                _rad_blocks(z, i, nb, ws)
            i += per * nb
            e += np.uint64(per * nb)
            left -= nb
        while i < m:
            z[i] = _gauss_at(e, t, k0, k1) if gauss else _rad_at(e, t, k0, k1)
            i += 1
            e += _U1


@njit(parallel=True, cache=True, error_model="numpy")
def zvec_kernel(out, e0, t, k0, k1, dist, tab):
    """out[i] = z(seed, t, e0 + i), out float32 1-D; tab: FAST_TABLE."""
    n = out.size
    for c in prange((n + CHUNK - 1) // CHUNK):
        i0 = c * CHUNK
        m = min(CHUNK, n - i0)
        zbuf = np.empty(SUB, np.float64)
        ws = np.empty(WS, np.uint64)
        for s0 in range(0, m, SUB):
            ms = min(SUB, m - s0)
            fill_z(zbuf[:ms], e0 + np.uint64(i0 + s0), t, k0, k1, dist, tab, ws)
            ov = out[i0 + s0:i0 + s0 + ms]
            for i in range(ms):
                ov[i] = zbuf[i]
