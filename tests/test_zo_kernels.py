"""ZO numerical core: counter-based z, fused in-place kernels (CPU, C/CuPy source, numba.cuda).

Numbers this file relies on (see docs/zo-kernels.md):
* statistical tolerances are 6 standard errors: a correct generator fails one with probability
  about 2e-9 per check;
* the drift bound after +eps, -2eps, +eps is 1.5 ulp(|p| + |eps z|) per element (with a
  relative slack of 2**-20 for the double rounding float64 -> float32).
"""

from __future__ import annotations

import ctypes
import itertools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from cbuild import build_c

from semzo import rng
from semzo.backend import is_device_array
from semzo.model.storage import to_bits, to_float32
from semzo.zo import kernels, perturb, zgen
from semzo.zo.perturb import ZTensor, decays, multi_update, restore_update, zvec

#: bfloat16 storage in these tests: uint16 arrays of bfloat16 bits (a bfloat16 model's params)
BF16 = np.uint16

ROOT = Path(__file__).resolve().parents[1]
SIG = 6.0                                   # tolerance in standard errors
DISTS = ["gaussian", "rademacher", "gaussian-fast"]

# ----------------------------------------------------------------------------- references
_M32 = np.uint64(0xFFFFFFFF)


def np_philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 over uint64 numpy arrays, written from the published algorithm."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & _M32,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & _M32)
        k0 = (k0 + np.uint64(0x9E3779B9)) & _M32
        k1 = (k1 + np.uint64(0xBB67AE85)) & _M32
    return c0, c1, c2, c3


def ref_z(seed: int, t: int, e: np.ndarray, dist: str) -> np.ndarray:
    """z by the stream definition with numpy's libm (log, cos, sin), float32."""
    e = np.asarray(e, np.uint64)
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    tt = np.full(e.shape, t, np.uint64)
    if dist == "gaussian-fast":                 # the table is checked by test_fast_table
        r = e & np.uint64(1023)
        q = r >> np.uint64(1)
        b = ((e >> np.uint64(10)) << np.uint64(7)) | (q & np.uint64(127))
        w = np_philox(b & _M32, b >> np.uint64(32), tt, np.full(e.shape, 2, np.uint64), k0, k1)
        word = np.choose((q >> np.uint64(7)).astype(np.int64), w)
        h = np.where((r & np.uint64(1)) == 1, word >> np.uint64(16), word & np.uint64(0xFFFF))
        return rng.fast_table()[h.astype(np.int64)]
    if dist == "rademacher":
        b = e >> np.uint64(7)
        w = np_philox(b & _M32, b >> np.uint64(32), tt, np.ones_like(e), k0, k1)
        word = np.choose(((e >> np.uint64(5)) & np.uint64(3)).astype(np.int64), w)
        bit = (word >> (e & np.uint64(31))) & np.uint64(1)
        return (1.0 - 2.0 * bit.astype(np.float64)).astype(np.float32)
    b = e >> np.uint64(2)
    x0, x1, x2, x3 = np_philox(b & _M32, b >> np.uint64(32), tt, np.zeros_like(e), k0, k1)
    lane = (e & np.uint64(3)).astype(np.int64)
    xa = np.where(lane < 2, x0, x2).astype(np.float64)
    xb = np.where(lane < 2, x1, x3)
    r = np.sqrt(-2.0 * np.log((xa + 1.0) * 2.0 ** -32))
    q = (xb >> np.uint64(30)).astype(np.float64)
    theta = (q * (np.pi / 2) + ((xb & np.uint64(2 ** 30 - 1)).astype(np.float64) + 0.5)
             * np.pi * 2.0 ** -31 - np.pi / 4)
    return np.where(lane % 2 == 1, r * np.sin(theta), r * np.cos(theta)).astype(np.float32)


def store(x64: np.ndarray, dtype) -> np.ndarray:
    """The kernels' rounding: float64 -> float32 (-> float16, or -> bfloat16 bits by
    round-to-nearest-even on the float32 pattern, ``storage.to_bits``); float64 kept."""
    if dtype == np.float64:
        return x64.copy()
    if dtype == BF16:
        return to_bits(x64.astype(np.float32))
    return x64.astype(np.float32).astype(dtype)


def load64(p: np.ndarray) -> np.ndarray:
    """float64 values of stored parameters (bfloat16 bits upcast exactly)."""
    return to_float32(p).astype(np.float64) if p.dtype == BF16 else p.astype(np.float64)


def z64(seed, t, off, n, dist):
    return zvec(seed, t, off, n, dist).astype(np.float64)


def ref_perturb(p, seed, t, off, scale, dist):
    return store(load64(p) + scale * z64(seed, t, off, p.size, dist), p.dtype)


def ref_restore_update(p, seed, t, off, eps, lr, g, wd, dist):
    z = z64(seed, t, off, p.size, dist)
    pr = load64(p) + eps * z
    return store(pr - lr * (g * z + wd * pr), p.dtype)


def ref_multi_update(p, seeds, gs, t, off, lr, wd, eps, restore_seed, dist):
    acc = np.zeros(p.size)
    for s, g in zip(seeds, gs, strict=True):
        acc = acc + g * z64(s, t, off, p.size, dist)
    pr = load64(p)
    if restore_seed is not None:
        pr = pr + eps * z64(restore_seed, t, off, p.size, dist)
    return store(pr - lr * (acc + wd * pr), p.dtype)


def ulp(x, dtype=np.float32) -> np.ndarray:
    """Spacing of dtype at |x| (non-decreasing in |x|; smallest subnormal step near 0)."""
    return np.spacing(np.abs(np.asarray(x, np.float64)).astype(dtype)).astype(np.float64)


def params(n, dtype, seed=0):
    """Weights like a transformer's: N(0, 0.05), a few exact zeros and tiny values."""
    r = np.random.default_rng(seed)
    p = r.normal(0.0, 0.05, n)
    p[::97] = 0.0
    p[1::89] = r.normal(0.0, 1e-6, p[1::89].size)
    return to_bits(p.astype(np.float32)) if dtype == BF16 else p.astype(dtype)


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- generator
KAT = [  # Random123 kat_vectors: counter[4], key[2] -> output[4]
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("ctr,key,want", KAT)
def test_philox_known_answers(ctr, key, want):
    args = [np.uint64(v) for v in ctr + key]
    assert tuple(int(x) for x in rng.philox4x32_10(*args)) == want          # Python
    assert tuple(int(x) for x in zgen._dev["philox4x32_10"](*args)) == want   # numba
    assert tuple(int(x[0]) for x in np_philox(*[[v] for v in ctr], *key)) == want


def test_transform_accuracy_and_log_variants():
    """Polynomial ln/sin/cos against libm; the CPU's bit-level log equals the portable one."""
    r = np.random.default_rng(1)
    xs = np.concatenate([r.integers(0, 2 ** 32, 3000, dtype=np.uint64),
                         np.array([0, 1, 2, 3, 2 ** 31, 2 ** 32 - 1], np.uint64),
                         np.array([2 ** k + d for k in range(1, 32) for d in (-2, -1, 0, 1)],
                                  np.uint64)])
    logj = zgen._dev["neg2_log_u"]            # compiled from neg2_log_u_bits
    for x in xs:
        v = rng.neg2_log_u(x)
        assert v == rng.neg2_log_u_bits(x) == logj(x)
        assert v >= 0.0 and not np.signbit(v)
        assert abs(v - (-2.0 * np.log((float(x) + 1.0) * 2.0 ** -32))) < 1e-10
        c, s = rng.cos_sin_2pi(x)
        th = (int(x) >> 30) * np.pi / 2 + ((int(x) & (2 ** 30 - 1)) + 0.5) * np.pi * 2 ** -31 \
            - np.pi / 4
        assert abs(c - np.cos(th)) < 1e-11 and abs(s - np.sin(th)) < 1e-11
    assert rng.neg2_log_u(np.uint64(2 ** 32 - 1)) == 0.0
    assert abs(rng.ZMAX - np.sqrt(rng.neg2_log_u(np.uint64(0)))) < 1e-9


@pytest.mark.parametrize("dist", DISTS)
def test_zvec_matches_independent_numpy_reference(dist):
    seed, t, start, n = 2 ** 63 + 977, 41, 2 ** 33 - 1000, 200_003   # block index > 2**32
    z = zvec(seed, t, start, n, dist)
    ref = ref_z(seed, t, np.arange(start, start + n, dtype=np.uint64), dist)
    assert z.dtype == np.float32 and z.shape == (n,)
    if dist == "rademacher":
        assert bits_equal(z, ref)
    else:
        d = np.abs(z.astype(np.float64) - ref)
        assert d.max() <= 1e-6
        assert np.all(d <= ulp(ref))                    # at most one float32 rounding step
        assert np.mean(d == 0) > 0.99


@pytest.mark.parametrize("dist", DISTS)
def test_fill_z_of_any_size_keeps_to_its_scratch(dist):
    """fill_z on a buffer far larger than the kernels' SUB (its Philox words go through the
    WS-word scratch WSTRIDE blocks at a time): the same z as zvec, and not one word written
    past the scratch (numba checks no bounds: a guard word after it must survive)."""
    seed, t, start, n = 99, 5, 3, 70_001                # unaligned start, partial ends
    k0, k1 = rng.split_seed(seed)
    z = np.empty(n)
    ws = np.full(zgen.WS + 8, 0xDEADBEEF, np.uint64)
    zgen.fill_z(z, np.uint64(start), np.uint64(t), k0, k1, rng.dist_code(dist),
                zgen.FAST_TABLE, ws[:zgen.WS])
    assert np.all(ws[zgen.WS:] == 0xDEADBEEF)
    assert bits_equal(z.astype(np.float32), zvec(seed, t, start, n, dist))


@pytest.mark.parametrize("dist", DISTS)
def test_any_slice_regenerates_in_any_order(dist):
    n = 3 * kernels.CHUNK + 517
    full = zvec(123, 7, 0, n, dist)
    cuts = [0, 1, 2, 3, 5, 127, 128, 129, 1000, kernels.CHUNK - 1, kernels.CHUNK,
            kernels.CHUNK + 3, 2 * kernels.CHUNK + 255, n - 1, n]
    for a, b in itertools.pairwise(cuts):
        assert bits_equal(zvec(123, 7, a, b - a, dist), full[a:b])
    pairs = list(itertools.pairwise(cuts))
    pieces = {a: zvec(123, 7, a, b - a, dist) for a, b in reversed(pairs)}
    assert bits_equal(np.concatenate([pieces[a] for a in cuts[:-1]]), full)
    for a in (0, 3, 127, 4097):                            # element-by-element
        assert all(zvec(123, 7, a + i, 1, dist)[0] == full[a + i] for i in range(6))


def test_gaussian_moments():
    n = 1_000_000
    z = zvec(20240607, 3, 0, n).astype(np.float64)
    se = 1.0 / np.sqrt(n)
    assert abs(z.mean()) < SIG * se
    assert abs(z.var() - 1.0) < SIG * np.sqrt(2.0) * se
    assert abs(np.mean(z ** 3)) < SIG * np.sqrt(15.0) * se
    assert abs(np.mean(z ** 4) - 3.0) < SIG * np.sqrt(96.0) * se
    for k, pk in ((1.0, 0.682689492), (2.0, 0.954499736), (3.0, 0.997300204)):
        assert abs(np.mean(np.abs(z) < k) - pk) < SIG * np.sqrt(pk * (1 - pk)) * se
    assert np.abs(z).max() <= rng.ZMAX + 1e-6
    for lane in range(4):                                   # each Box-Muller output on its own
        zl = z[lane::4]
        assert abs(zl.mean()) < SIG / np.sqrt(zl.size)
        assert abs(zl.var() - 1.0) < SIG * np.sqrt(2.0 / zl.size)




def test_fast_table():
    """FAST_TABLE: the midpoint quantiles of N(0, 1) (checked against scipy to 1 float32
    rounding), exactly antisymmetric, mean 0, variance 1 within 1e-4, tails beyond 4; its
    bytes are pinned by a hash (the stream's bits depend on them on every device)."""
    import hashlib

    from scipy.stats import norm
    tab = rng.fast_table()
    assert tab.dtype == np.float32 and tab.shape == (65536,)
    exact = norm.ppf((np.arange(65536) + 0.5) / 65536.0)
    assert np.all(np.abs(tab - exact) <= np.spacing(np.abs(exact).astype(np.float32)))
    assert np.array_equal(tab[::-1], -tab) and np.all(np.diff(tab) > 0)
    t64 = tab.astype(np.float64)
    assert t64.mean() == 0.0 and abs(np.mean(t64 ** 2) - 1.0) < 1e-4
    assert abs(np.mean(t64 ** 4) - 3.0) < 2e-3
    assert 4.0 < tab.max() <= rng.FAST_ZMAX
    assert hashlib.sha256(tab.tobytes()).hexdigest() == FAST_TABLE_HASH


FAST_TABLE_HASH = "1cfbba1e07e34386a57626f82aeb43e6ed54ba70a3ea6b7d964dc66a841074a8"


def test_gaussian_fast_statistics():
    """Mean, variance, skewness, kurtosis, P(|z| < k), tails, KS against N(0, 1) at n = 1e6,
    every lane position of a super-block on its own."""
    from scipy import stats
    n = 1_000_000
    z = zvec(20240607, 3, 0, n, "gaussian-fast").astype(np.float64)
    se = 1.0 / np.sqrt(n)
    assert abs(z.mean()) < SIG * se
    assert abs(z.var() - 1.0) < SIG * np.sqrt(2.0) * se + 3e-5       # table variance 0.99998
    assert abs(np.mean(z ** 3)) < SIG * np.sqrt(15.0) * se
    assert abs(np.mean(z ** 4) - 3.0) < SIG * np.sqrt(96.0) * se + 1e-3
    for k, pk in ((1.0, 0.682689492), (2.0, 0.954499736), (3.0, 0.997300204),
                  (4.0, 0.999936658)):
        assert abs(np.mean(np.abs(z) < k) - pk) < SIG * np.sqrt(pk * (1 - pk)) * se
    assert np.abs(z).max() > 4.0 and np.abs(z).max() <= rng.FAST_ZMAX
    assert stats.kstest(z, "norm").pvalue > 1e-3
    for lane in (0, 1, 255, 256, 511, 512, 1023):           # word / half / block positions
        zl = z[lane::1024]
        assert abs(zl.mean()) < SIG / np.sqrt(zl.size)
        assert abs(zl.var() - 1.0) < SIG * np.sqrt(2.0 / zl.size)


def test_rademacher_balance():
    n = 1_000_000
    z = zvec(99, 5, 0, n, "rademacher")
    assert set(np.unique(z)) == {-1.0, 1.0}
    assert abs(z.astype(np.float64).mean()) < SIG / np.sqrt(n)
    pos = z[: n // 128 * 128].reshape(-1, 128).mean(axis=0)    # every bit position of a block
    assert np.all(np.abs(pos) < (SIG + 1.0) / np.sqrt(n / 128))


@pytest.mark.parametrize("dist", DISTS)
def test_no_correlation_between_neighbours(dist):
    n = 400_000
    lim = SIG / np.sqrt(n)
    base = zvec(1000, 10, 0, n, dist).astype(np.float64)
    others = {"tensor+1": zvec(1000, 11, 0, n, dist), "seed+1": zvec(1001, 10, 0, n, dist),
              "seed+2**32": zvec(1000 + 2 ** 32, 10, 0, n, dist),
              "shift by 1": zvec(1000, 10, 1, n, dist), "shift by 4": zvec(1000, 10, 4, n, dist),
              "shift by 128": zvec(1000, 10, 128, n, dist)}
    for name, o in others.items():
        r = np.corrcoef(base, o.astype(np.float64))[0, 1]
        assert abs(r) < lim, (name, r)
    if dist == "gaussian":                  # squares too (the pair of a Box-Muller shares r)
        r2 = np.corrcoef(base[0::2] ** 2, base[1::2] ** 2)[0, 1]
        assert abs(r2) < SIG / np.sqrt(n / 2)


# ----------------------------------------------------------------------------- fused kernels
DTYPES = [np.float32, np.float16, np.float64, BF16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", DISTS)
def test_fused_kernels_match_serial_reference(dtype, dist):
    n, off, t = 3 * kernels.CHUNK + 333, 1_000_003, 17
    p0 = params(n, dtype, seed=3)
    eps, lr, g, wd = 1e-3, 1e-2, 3.25, 0.1

    p = p0.copy()
    perturb.perturb([ZTensor(t, p, off)], 5, eps, dist=dist)
    assert bits_equal(p, ref_perturb(p0, 5, t, off, eps, dist))

    p1 = p.copy()
    perturb.perturb([ZTensor(t, p, off)], 5, -2 * eps, dist=dist)
    assert bits_equal(p, ref_perturb(p1, 5, t, off, -2 * eps, dist))

    p2 = p.copy()
    restore_update([ZTensor(t, p, off)], 5, eps, lr, g, wd, dist=dist)
    assert bits_equal(p, ref_restore_update(p2, 5, t, off, eps, lr, g, wd, dist))

    seeds, gs = [11, 12, 2 ** 64 - 1], [0.5, -2.0, 1.25]
    for rs in (None, 11, 77):
        q = p2.copy()
        multi_update([ZTensor(t, q, off)], seeds, gs, lr, wd, eps=eps, restore_seed=rs,
                     dist=dist)
        assert bits_equal(q, ref_multi_update(p2, seeds, gs, t, off, lr, wd, eps, rs, dist))

    q = p2.copy()                            # P = 1 with the own seed: the restore_update bits
    multi_update([(t, q)], [5], [g], lr, wd, eps=eps, restore_seed=5, dist=dist)
    r = p2.copy()
    restore_update([(t, r)], 5, eps, lr, g, wd, dist=dist)
    assert bits_equal(q, r)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rademacher_whole_blocks_match_serial_reference(dtype):
    """Offsets on a 128-element block boundary take the bufferless Rademacher path
    (zgen.rad_axpy: the sign bit of a flipped by the z bit, a whole piece of Philox blocks at
    a time), an unaligned offset the buffered one; both give the reference bits,
    also for signed zeros, for a negative and a zero scale, and next to a ragged end."""
    for off, n in ((0, 3 * kernels.CHUNK + 333), (128 * 7919, kernels.CHUNK + 128),
                   (2 ** 33, 4096), (5, 2 * kernels.CHUNK + 7)):
        p0 = params(n, dtype, seed=off % 97)
        p0[:4] = np.array([0.0, -0.0, 1.0, -1.0]).astype(p0.dtype) if dtype != BF16 else \
            np.array([0, 0x8000, 0x3F80, 0xBF80], np.uint16)
        for scale in (1e-3, -2e-3, 0.0, -0.0):
            p = p0.copy()
            perturb.perturb([ZTensor(3, p, off)], 9, scale, dist="rademacher")
            assert bits_equal(p, ref_perturb(p0, 9, 3, off, scale, "rademacher")), (off, scale)


def test_fused_update_is_correctly_rounded_and_beats_unfused_float32():
    """One rounding at the end: within 0.5 ulp of the exact value; MeZO-style float32 code
    (a rounding per operation) lands within a few ulp of the same value."""
    n, t = 200_000, 2
    eps, lr, g, wd = 1e-3, 5e-2, 40.0, 0.1
    p0 = params(n, np.float32, seed=4)
    p = p0.copy()
    restore_update([(t, p)], 9, eps, lr, g, wd)
    z32 = zvec(9, t, 0, n)
    z = z32.astype(np.float64)
    pr = p0.astype(np.float64) + eps * z
    exact = pr - lr * (g * z + wd * pr)
    assert np.all(np.abs(p - exact) <= 0.5 * ulp(exact) * (1 + 2.0 ** -20))
    f32 = np.float32
    q = p0 + f32(eps) * z32                                      # torch-like float32 passes
    q = q - f32(lr) * (f32(g) * z32 + f32(wd) * q)
    assert np.all(np.abs(q - exact) <= 4 * ulp(np.abs(exact) + np.abs(lr * g * z)))
    assert np.abs(p - exact).mean() <= np.abs(q - exact).mean()


def test_results_do_not_depend_on_thread_count():
    n = 5 * kernels.CHUNK + 11
    p0 = params(n, np.float32, seed=6)
    out = []
    for nt in (1, 2, 3):
        p = p0.copy()
        with kernels.num_threads(nt):
            perturb.perturb([(4, p)], 31, 1e-3)
            restore_update([(4, p)], 31, 1e-3, 0.1, 2.0, 0.01)
            multi_update([(4, p)], [1, 2], [0.3, 0.4], 0.1, 0.01, eps=0.0, restore_seed=3)
        out.append(p)
        assert bits_equal(zvec(31, 4, 5, n, threads=nt), zvec(31, 4, 5, n, threads=1))
    assert bits_equal(out[0], out[1]) and bits_equal(out[0], out[2])


@pytest.mark.parametrize("dist", DISTS)
def test_shards_equal_whole_tensor(dist):
    """A tensor split across ranks (element offsets) gets the whole tensor's bits."""
    n = 2 * kernels.CHUNK + 1001
    whole = params(n, np.float32, seed=7).reshape(-1, 1)          # any C-contiguous shape
    shards = [whole[:777].copy(), whole[777:9000].copy(), whole[9000:].copy()]
    offs = [0, 777, 9000]
    restore_update([(3, whole)], 8, 1e-3, 0.1, 1.5, 0.01, dist=dist)
    parts = [ZTensor(3, s, o) for s, o in zip(shards, offs, strict=True)]
    restore_update(parts, 8, 1e-3, 0.1, 1.5, 0.01, dist=dist)
    assert bits_equal(np.concatenate(shards), whole)


def test_many_tensors_of_mixed_dtypes_in_one_call():
    """A model's list (sizes 0 .. several chunks, three dtypes) in one call per pass equals the
    tensors done one by one; arrays sharing memory are refused."""
    r = np.random.default_rng(12)
    sizes = [384, 1, 0, 3 * kernels.CHUNK + 5, 1536, 7, kernels.CHUNK, 129, 2 * kernels.CHUNK]
    dts = [np.float32, np.float16, np.float64, BF16]
    model = [ZTensor(10 + i, params(n, dts[i % 4], seed=i), int(r.integers(0, 2 ** 40)),
                     bool(i % 2)) for i, n in enumerate(sizes)]
    ref = [ZTensor(z.t, z.array.copy(), z.offset, z.decay) for z in model]
    seeds, gs = [3, 4], [0.5, -0.25]
    perturb.perturb(model, 21, 1e-3)
    restore_update(model, 21, 1e-3, 0.1, 2.0, 0.3)
    multi_update(model, seeds, gs, 0.1, 0.3, eps=1e-3, restore_seed=21, dist="rademacher")
    for z, q in zip(model, ref, strict=True):
        perturb.perturb([q], 21, 1e-3)
        restore_update([q], 21, 1e-3, 0.1, 2.0, 0.3)
        multi_update([q], seeds, gs, 0.1, 0.3, eps=1e-3, restore_seed=21, dist="rademacher")
        assert bits_equal(z.array, q.array)
    p = params(1000, np.float32)
    with pytest.raises(ValueError, match="share memory"):
        perturb.perturb([(0, p[:600]), (1, p[500:])], 1, 1e-3)
    with pytest.raises(ValueError, match="share memory"):
        perturb.perturb([(0, p), (1, p)], 1, 1e-3)


def test_weight_decay_flag_and_decays():
    n = 1000
    a, b = params(n, np.float32, 1), params(n, np.float32, 2)
    a0, b0 = a.copy(), b.copy()
    restore_update([ZTensor(0, a, 0, True), ZTensor(1, b, 0, False)], 3, 1e-3, 0.1, 0.0, 0.5)
    assert bits_equal(a, ref_restore_update(a0, 3, 0, 0, 1e-3, 0.1, 0.0, 0.5, "gaussian"))
    assert bits_equal(b, ref_restore_update(b0, 3, 1, 0, 1e-3, 0.1, 0.0, 0.0, "gaussian"))
    no = ["bert.encoder.layer.0.attention.output.LayerNorm.weight", "embeddings.LayerNorm.bias",
          "encoder.layer.3.output.dense.bias", "transformer.h.0.ln_1.weight",
          "transformer.h.11.ln_2.bias", "transformer.ln_f.weight",
          "model.decoder.final_layer_norm.weight",
          "model.decoder.layers.0.self_attn_layer_norm.weight", "blocks.0.ln.weight"]
    yes = ["encoder.layer.0.attention.self.query.weight", "embeddings.word_embeddings.weight",
           "transformer.h.0.attn.c_attn.weight", "transformer.wte.weight",
           "model.decoder.layers.0.fc1.weight", "lm_head.weight"]
    assert not any(decays(s) for s in no) and all(decays(s) for s in yes)


def test_input_checks():
    p = np.zeros((4, 4), np.float32)
    with pytest.raises(ValueError):
        perturb.perturb([(0, p[:, ::2])], 1, 1e-3)             # not contiguous
    with pytest.raises(TypeError):
        perturb.perturb([(0, np.zeros(4, np.int32))], 1, 1e-3)
    with pytest.raises(ValueError):
        perturb.perturb([(0, p)], -1, 1e-3)
    with pytest.raises(ValueError):
        perturb.perturb([(2 ** 32, p)], 1, 1e-3)
    with pytest.raises(ValueError):
        perturb.perturb([(0, p)], 1, 1e-3, dist="uniform")
    with pytest.raises(ValueError):
        multi_update([(0, p)], [1, 2], [0.5], 0.1)
    perturb.perturb([(0, np.zeros(0, np.float32))], 1, 1e-3)      # empty is fine
    assert not is_device_array(p)


def test_half_conversions_exact():
    h = np.arange(2 ** 16, dtype=np.uint16)
    ref = h.view(np.float16).astype(np.float64)
    got = np.array([zgen.half_bits_to_f64(x) for x in h[::7]])
    assert bits_equal(got, ref[::7]) or np.array_equal(got, ref[::7], equal_nan=True)
    r = np.random.default_rng(0)
    xs = np.concatenate([r.normal(0, 1, 3000), r.normal(0, 1e-5, 2000), r.normal(0, 1e4, 1000),
                         [65504.0, 65520.0, 65519.99, 1e6, 6e-8, 3e-8, 2.98e-8, 0.0, -0.0,
                          np.inf, -np.inf]]).astype(np.float32)
    hs = h.view(np.float16).astype(np.float32)[::5]
    hs = hs[np.isfinite(hs)]
    xs = np.concatenate([xs, hs * np.float32(1 + 2 ** -11)])         # exact ties
    got = np.array([zgen.f32_to_half_bits(x) for x in xs], np.uint16)
    with np.errstate(over="ignore"):
        want = xs.astype(np.float16).view(np.uint16)
    assert bits_equal(got, want)


def test_bfloat16_conversions_exact():
    """The numba kernels' and the NumPy reference's bfloat16 conversions are torch's: every
    bit pattern upcast, float32 -> bfloat16 round to nearest even (ties, overflow, NaN)."""
    torch = pytest.importorskip("torch")
    h = np.arange(2 ** 16, dtype=np.uint16)
    want = torch.from_numpy(h.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
    up = to_float32(h)
    assert np.array_equal(up, want, equal_nan=True)
    got = np.array([zgen.bf16_bits_to_f64(x) for x in h.view(np.int16)[::7]])
    with np.errstate(invalid="ignore"):                 # signalling NaN patterns
        assert np.array_equal(got, want[::7].astype(np.float64), equal_nan=True)
    r = np.random.default_rng(1)
    fin = up[np.isfinite(up)][::3]
    xs = np.concatenate([r.normal(0, 1, 3000), r.normal(0, 1e-30, 500), r.normal(0, 1e30, 500),
                         [3.3895e38, 3.4e38, 1e-45, 0.0, -0.0, np.inf, -np.inf]]
                        ).astype(np.float32)
    ties = (fin.view(np.uint32) | np.uint32(0x8000)).view(np.float32)       # exactly halfway
    xs = np.concatenate([xs, fin, ties[np.isfinite(ties)]])
    want = torch.from_numpy(xs).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert bits_equal(to_bits(xs), want)
    got = np.array([zgen.f32_to_bf16_bits(x) for x in xs], np.int16).view(np.uint16)
    assert bits_equal(got, want)
    nan = np.array([np.nan, -np.nan], np.float32)
    assert np.isnan(to_float32(to_bits(nan))).all()
    assert np.isnan([zgen.bf16_bits_to_f64(zgen.f32_to_bf16_bits(x)) for x in nan]).all()


# ----------------------------------------------------------------------------- drift bound
def drift_bound(p0, z, eps, dtype=np.float32, steps=1):
    """steps * 1.5 ulp(|p0| + |eps z|), with slack for the double rounding and the drift."""
    m = (np.abs(p0.astype(np.float64)) + np.abs(eps * z)) * (1 + 2.0 ** -20 + steps * 2e-6)
    per_op = 0.5 * (1 + 2.0 ** -12) if dtype == np.float16 else 0.5 * (1 + 2.0 ** -28)
    return steps * 3 * per_op * ulp(m, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_perturb_restore_drift_bound(dtype):
    n, eps, t, seed = 1_000_000, 1e-3, 6, 4242
    p0 = params(n, dtype, seed=8)
    p = p0.copy()
    perturb.perturb([(t, p)], seed, eps)
    perturb.perturb([(t, p)], seed, -2 * eps)
    restore_update([(t, p)], seed, eps, 0.01, 0.0, 0.0)           # g = 0, wd = 0
    z = z64(seed, t, 0, n, "gaussian")
    drift = np.abs(p.astype(np.float64) - p0.astype(np.float64))
    assert np.all(drift <= drift_bound(p0, z, eps, dtype))
    q = p0.copy()                                                  # three plain perturbs
    for s in (eps, -2 * eps, eps):
        perturb.perturb([(t, q)], seed, s)
    assert bits_equal(q, p)
    ratio = drift / ulp(np.abs(p0.astype(np.float64)) + np.abs(eps * z), dtype)
    print(f"\n[zo drift {np.dtype(dtype).name}] max {ratio.max():.2f} ulp(|p|+|eps z|), "
          f"{np.mean(drift > 0):.3%} of elements moved")


def test_repeated_steps_drift_like_a_random_walk():
    n, eps, steps = 1_000_000, 1e-3, 100
    p0 = params(n, np.float32, seed=9)
    p = p0.copy()
    d1 = None
    for s in range(steps):
        seed = 7_000_000 + s
        perturb.perturb([(1, p)], seed, eps)
        perturb.perturb([(1, p)], seed, -2 * eps)
        restore_update([(1, p)], seed, eps, 0.1, 0.0, 0.0)
        if s == 0:
            d1 = p.astype(np.float64) - p0
    d = p.astype(np.float64) - p0
    u = ulp(np.abs(p0.astype(np.float64)) + eps * rng.ZMAX)
    assert np.all(np.abs(d) <= drift_bound(p0, np.full(n, rng.ZMAX), eps, steps=steps))
    rms1, rms = np.sqrt(np.mean((d1 / u) ** 2)), np.sqrt(np.mean((d / u) ** 2))
    assert rms <= 2.0 * np.sqrt(steps) * rms1          # sqrt(steps) growth, not linear
    assert abs(np.mean(d / u)) <= 0.05 * rms           # no systematic bias
    print(f"\n[zo drift] rms after 1 step {rms1:.3f} ulp, after {steps} steps {rms:.3f} ulp "
          f"(x{rms / rms1:.1f}; random walk x{np.sqrt(steps):.0f}, linear x{steps}), "
          f"max {np.abs(d / u).max():.1f} ulp")


# ----------------------------------------------------------------------------- GPU sources
@pytest.fixture(scope="module")
def zo_c_lib(tmp_path_factory) -> ctypes.CDLL:
    """The CUDA C source built once for the module's tests (gcc takes about 15 s: the
    Gaussian-fast table is 256 KiB of initializers)."""
    return _compile_c(tmp_path_factory.mktemp("zoc"))


def _compile_c(tmp_path: Path) -> ctypes.CDLL:
    from semzo.zo import kernels_cuda
    return build_c(kernels_cuda.cuda_source(), tmp_path, "zo")


def test_cuda_c_source_built_for_cpu_gives_cpu_bits(zo_c_lib):
    """The CuPy kernels' source, kernels included, compiled by gcc: same bits as numba."""
    lib = zo_c_lib
    P, L, U, D, N = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_uint64, ctypes.c_double,
                     ctypes.c_int)
    n, off, t, seed = 20_011, 2 ** 32 + 5, 9, 2 ** 40 + 3
    k0, k1 = (int(k) for k in rng.split_seed(seed))
    seeds, gs = [seed, 4, 5], [0.25, -1.0, 2.0]
    ks = np.array([[int(k) for k in rng.split_seed(s)] for s in seeds], np.uint64)
    k0s, k1s = np.ascontiguousarray(ks[:, 0]), np.ascontiguousarray(ks[:, 1])
    gsa = np.array(gs)
    for dist in DISTS:
        code = rng.dist_code(dist)
        out = np.empty(n, np.float32)
        lib.zo_zvec.argtypes = [P, L, U, U, U, U, N]
        lib.zo_zvec(out.ctypes.data, n, off, t, k0, k1, code)
        assert bits_equal(out, zvec(seed, t, off, n, dist))
        for dtype in DTYPES:
            sfx = {np.float32: "f32", np.float64: "f64", np.float16: "f16", BF16: "bf16"}[dtype]
            p0 = params(n, dtype, seed=10)
            a, b = p0.copy(), p0.copy()
            f = getattr(lib, f"zo_perturb_{sfx}")
            f.argtypes = [P, L, U, U, U, U, N, D]
            f(a.ctypes.data, n, off, t, k0, k1, code, -2e-3)
            perturb.perturb([ZTensor(t, b, off)], seed, -2e-3, dist=dist)
            assert bits_equal(a, b)
            f = getattr(lib, f"zo_restore_update_{sfx}")
            f.argtypes = [P, L, U, U, U, U, N, D, D, D, D]
            f(a.ctypes.data, n, off, t, k0, k1, code, 1e-3, 0.05, 2.5, 0.1)
            restore_update([ZTensor(t, b, off)], seed, 1e-3, 0.05, 2.5, 0.1, dist=dist)
            assert bits_equal(a, b)
            f = getattr(lib, f"zo_multi_update_{sfx}")
            f.argtypes = [P, L, U, U, P, P, P, N, D, D, N, U, U, D, N]
            for restore in (0, 1):
                f(a.ctypes.data, n, off, t, k0s.ctypes.data, k1s.ctypes.data, gsa.ctypes.data,
                  len(gs), 0.05, 0.1, restore, k0, k1, 1e-3, code)
                multi_update([ZTensor(t, b, off)], seeds, gs, 0.05, 0.1, eps=1e-3,
                             restore_seed=seed if restore else None, dist=dist)
                assert bits_equal(a, b)
            # the streamed schedule's fused pass (every op kind, then + pa z into q)
            f = getattr(lib, f"zo_stream_{sfx}")
            f.argtypes = [P, P, L, U, U, N, U, U, D, D, D, D, P, P, P, N, N, U, U, D, N]
            pk0, pk1 = (int(k) for k in rng.split_seed(77))
            for kind, mode in (("perturb", 0), ("restore_update", 1), ("multi_restore", 2),
                               ("multi", 3), ("none", 4)):
                op = perturb.Pending(kind, seed, 1e-3, 0.05, 2.5, 0.1, tuple(seeds), tuple(gs))
                qa, qb = np.empty_like(a), np.empty_like(b)
                f(a.ctypes.data, qa.ctypes.data, n, off, t, mode, k0, k1, 1e-3, 0.05, 2.5,
                  0.1, k0s.ctypes.data, k1s.ctypes.data, gsa.ctypes.data, len(gs), 1, pk0,
                  pk1, -2e-3, code)
                perturb.apply_then_perturb([ZTensor(t, b, off)], op, 77, -2e-3, dst=[qb],
                                           dist=dist)
                assert bits_equal(a, b) and bits_equal(qa, qb), (kind, dtype, dist)



def test_cuda_c_quads_at_every_alignment(zo_c_lib):
    """The GPU kernels make z a quad (one Gaussian Philox block) per thread: tensors whose
    first element sits at each position in its quad, of lengths that end anywhere in one,
    shorter than one quad and across Rademacher (128) and Gaussian-fast (1024) blocks, get
    the numba kernels' bits, and no element outside p is written."""
    from semzo.zo import kernels_gpu
    lib = zo_c_lib
    P, L, U, D, N = (ctypes.c_void_p, ctypes.c_longlong, ctypes.c_uint64, ctypes.c_double,
                     ctypes.c_int)
    lib.zo_zvec.argtypes = [P, L, U, U, U, U, N]
    lib.zo_perturb_f32.argtypes = [P, L, U, U, U, U, N, D]
    lib.zo_stream_bf16.argtypes = [P, P, L, U, U, N, U, U, D, D, D, D, P, P, P, N, N, U, U, D,
                                   N]
    seed, t = 2 ** 33 + 7, 4
    k0, k1 = (int(k) for k in rng.split_seed(seed))
    pk0, pk1 = (int(k) for k in rng.split_seed(5))
    k0s, k1s = (np.array([k], np.uint64) for k in (k0, k1))
    gsa = np.array([0.5])
    for dist in DISTS:
        code = rng.dist_code(dist)
        for off in (0, 1, 2, 3, 125, 1021, 2 ** 40 + 2):
            for n in (1, 2, 3, 4, 5, 7, 9, 1030):
                guard = np.full(n + 8, 7.0, np.float32)          # 4 sentinels each side
                lib.zo_zvec(guard[4:].ctypes.data, n, off, t, k0, k1, code)
                assert bits_equal(guard[4:4 + n], zvec(seed, t, off, n, dist)), (dist, off, n)
                assert (guard[:4] == 7.0).all() and (guard[4 + n:] == 7.0).all()
                assert kernels_gpu.nquads(off, n) == ((off + n - 1) // 4 - off // 4 + 1)
                a = params(n, np.float32, seed=off + n)
                b = a.copy()
                lib.zo_perturb_f32(a.ctypes.data, n, off, t, k0, k1, code, 1e-3)
                perturb.perturb([ZTensor(t, b, off)], seed, 1e-3, dist=dist)
                assert bits_equal(a, b), (dist, off, n)
                a = params(n, BF16, seed=off + 2 * n)
                b = a.copy()
                qa, qb = np.empty_like(a), np.empty_like(b)
                lib.zo_stream_bf16(a.ctypes.data, qa.ctypes.data, n, off, t, 2, k0, k1, 1e-3,
                                   0.05, 0.0, 0.1, k0s.ctypes.data, k1s.ctypes.data,
                                   gsa.ctypes.data, 1, 1, pk0, pk1, -2e-3, code)
                op = perturb.Pending("multi_restore", seed, 1e-3, 0.05, 0.0, 0.1, (seed,),
                                     (0.5,))
                perturb.apply_then_perturb([ZTensor(t, b, off)], op, 5, -2e-3, dst=[qb],
                                           dist=dist)
                assert bits_equal(a, b) and bits_equal(qa, qb), (dist, off, n)


SIM_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    assert os.environ["NUMBA_ENABLE_CUDASIM"] == "1"
    from semzo.zo import kernels_gpu, perturb
    from semzo import rng
    from semzo.zo.perturb import ZTensor
    K = kernels_gpu.numba_cuda_kernels(32)
    n, off, t, seed = 300, 2 ** 32 - 5, 12, 2 ** 63 + 11
    k0, k1 = rng.split_seed(seed)
    seeds, gs = [seed, 99], [0.75, -1.5]
    ks = [rng.split_seed(s) for s in seeds]
    k0s = np.array([k[0] for k in ks], np.uint64)
    k1s = np.array([k[1] for k in ks], np.uint64)
    checks = 0
    for dist in ("gaussian", "rademacher", "gaussian-fast"):
        code = rng.dist_code(dist)
        out = np.empty(n, np.float32)
        K.zvec(out, off, t, k0, k1, code)
        ref = perturb.zvec(seed, t, off, n, dist)
        assert out.tobytes() == ref.tobytes(), dist
        assert np.abs(out - ref).max() <= 1e-6
        checks += 1
        for dtype in (np.float32, np.float16, np.float64):
            p0 = np.random.default_rng(1).normal(0, 0.05, n).astype(dtype)
            a, b = p0.copy(), p0.copy()
            K.perturb(a, off, t, k0, k1, code, 1e-3)
            perturb.perturb([ZTensor(t, b, off)], seed, 1e-3, dist=dist)
            assert a.tobytes() == b.tobytes(), ("perturb", dist, dtype)
            K.restore_update(a, off, t, k0, k1, code, 1e-3, 0.05, 2.0, 0.1)
            perturb.restore_update([ZTensor(t, b, off)], seed, 1e-3, 0.05, 2.0, 0.1, dist=dist)
            assert a.tobytes() == b.tobytes(), ("restore_update", dist, dtype)
            K.multi_update(a, off, t, k0s, k1s, np.array(gs), 0.05, 0.1, True, k0, k1, 1e-3,
                           code)
            perturb.multi_update([ZTensor(t, b, off)], seeds, gs, 0.05, 0.1, eps=1e-3,
                                 restore_seed=seed, dist=dist)
            assert a.tobytes() == b.tobytes(), ("multi_update", dist, dtype)
            checks += 3
    print("SIM_OK", checks)
""")


def test_numba_cuda_kernels_under_simulator_give_cpu_bits():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-c", SIM_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, cwd=ROOT, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "SIM_OK 30" in proc.stdout


def test_cuda_source_constants_come_from_rng():
    from semzo.zo import kernels_cuda
    src = kernels_cuda.cuda_source()
    assert "@" not in src
    for c in rng.LOG_C + rng.SIN_C + rng.COS_C + (rng.LN2, rng.PI_2_M31, rng.PI_4):
        assert repr(float(c)) in src
    for m in (rng.PHILOX_M0, rng.PHILOX_M1, rng.PHILOX_W0, rng.PHILOX_W1):
        assert f"{int(m)}ULL" in src
    assert "cupy" not in sys.modules                      # nothing imported cupy


# ----------------------------------------------------------------------------- timing (info)
def _best_ms(fn, reps=3) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * min(ts)


def test_pass_timing_information(capsys):
    """One fused pass over 22.7M float32 parameters (MiniLM-L6's size), 2 threads, and the
    MeZO-style torch.normal pass in the same run when torch is installed. Information only."""
    n = 22_700_000
    p = params(n, np.float32, seed=11)
    with kernels.num_threads(2) as nt:
        res = {
            "perturb gaussian": _best_ms(lambda: perturb.perturb([(0, p)], 1, 1e-3)),
            "restore_update gaussian": _best_ms(
                lambda: restore_update([(0, p)], 1, 1e-3, 1e-6, 0.5, 0.01)),
            "perturb rademacher": _best_ms(
                lambda: perturb.perturb([(0, p)], 1, 1e-3, dist="rademacher")),
        }
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        old = torch.get_num_threads()
        torch.set_num_threads(2)
        tp = torch.from_numpy(p)
        res["torch.normal (same run)"] = _best_ms(lambda: torch.normal(0.0, 1.0, size=tp.shape))
        torch.set_num_threads(old)
    with capsys.disabled():
        print(f"\n[zo timing] one pass over {n / 1e6:.1f}M float32, {nt} threads (shared "
              "machine, noisy): " + ", ".join(f"{k} {v:.0f} ms" for k, v in res.items())
              + "; PEERS: torch.normal pass 116 ms at 2 threads")
    assert np.isfinite(p).all()
