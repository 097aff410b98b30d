"""Counter-based generator for the ZO direction z: Philox-4x32-10 keyed by (seed, tensor, element).

The direction z of a ZO step is never stored. Element ``e`` of tensor ``t`` under step seed
``seed`` is a pure function of ``(seed, t, e)``, so any slice of z can be regenerated on any
device, by any thread, in any order, with no generator state.

Stream definition (the contract every implementation -- numba CPU, numba.cuda, CuPy, the numpy
reference in the tests -- must follow bit for bit):

* Generator: Philox-4x32-10 (Salmon et al., SC'11; Random123 known-answer vectors hold).
  key   = (seed & 0xffffffff, seed >> 32)                 seed: uint64
  counter = (block & 0xffffffff, block >> 32, t, domain)   block: uint64, t: uint32
  domain = 0 for Gaussian z, 1 for Rademacher z (independent streams).
* Gaussian: element e lies in block ``e >> 2``, lane ``e & 3``. Output words (x0, x1, x2, x3)
  give two Box-Muller pairs: lanes 0, 1 = r(x0) * (cos, sin)(theta(x1)); lanes 2, 3 =
  r(x2) * (cos, sin)(theta(x3)), where
  r(x)     = sqrt(-2 ln u),  u = (x + 1) * 2**-32 in (0, 1]        (so |z| <= 6.6604)
  theta(x) = q * pi/2 + phi,  q = x >> 30,
             phi = ((x & (2**30 - 1)) + 0.5) * pi * 2**-31 - pi/4  in (-pi/4, pi/4)
  (a uniform angle on the circle, offset by -pi/4 so the polynomials run on |phi| < pi/4).
  ln, sin and cos are evaluated in float64 by fixed polynomials written out below (no libm),
  absolute error < 1e-9 on z; the result is rounded once to float32. The same float64 operations
  on the GPU give the same float32 z up to FMA contraction (|dz| < 1e-6; bit-identical where the
  compiler is told not to contract).
* Rademacher: element e lies in block ``e >> 7``; z = +1 if bit ``e & 31`` of word
  ``(e >> 5) & 3`` is 0, else -1. Integer-only: bit-identical everywhere.

The functions here are plain Python written in the subset that numba compiles for the CPU
(``numba.njit``) and for CUDA (``numba.cuda.jit(device=True)``), and that the CUDA simulator runs
as Python with numpy scalars: every integer is a ``numpy.uint64`` (Philox words stay below 2**32,
so the product of two fits in 64 bits and nothing overflows), every float a float64. kernels.py and
kernels_gpu.py compile these same functions; the CUDA C source in kernels_gpu.py spells the same
operations in C with the constants taken from this module.
"""

from __future__ import annotations

import math

import numpy as np

GAUSSIAN = 0
RADEMACHER = 1
DISTS = {"gaussian": GAUSSIAN, "normal": GAUSSIAN, "rademacher": RADEMACHER}

# Philox-4x32 multipliers and Weyl key increments (Random123).
PHILOX_M0 = np.uint64(0xD2511F53)
PHILOX_M1 = np.uint64(0xCD9E8D57)
PHILOX_W0 = np.uint64(0x9E3779B9)
PHILOX_W1 = np.uint64(0xBB67AE85)
M32 = np.uint64(0xFFFFFFFF)
M30 = np.uint64(0x3FFFFFFF)
U0 = np.uint64(0)
U1 = np.uint64(1)
U2 = np.uint64(2)
U3 = np.uint64(3)
U5 = np.uint64(5)
U7 = np.uint64(7)
U30 = np.uint64(30)
U31 = np.uint64(31)
U32 = np.uint64(32)
U52 = np.uint64(52)
M52 = np.uint64((1 << 52) - 1)
EXP1023 = np.uint64(1023 << 52)

# Float constants of the Gaussian transform (float64).
LN2 = 0.6931471805599453
SQRT2 = 1.4142135623730951
TWO_M32 = 2.0 ** -32
TWO_M16 = 2.0 ** -16
TWO_M8 = 2.0 ** -8
PI_2_M31 = math.pi * 2.0 ** -31          # (pi/2) / 2**30: one step of the in-quadrant angle
PI_4 = math.pi / 4.0
# ln(x) = 2 atanh(s), s = (x-1)/(x+1), |s| <= 0.1716: 2 s (1 + s^2/3 + ... + s^10/11)
LOG_C = (1.0 / 3.0, 1.0 / 5.0, 1.0 / 7.0, 1.0 / 9.0, 1.0 / 11.0)
# Taylor polynomials on |phi| < pi/4 (truncation error < 1e-11 for sin, < 4e-13 for cos)
SIN_C = (-1.0 / 6.0, 1.0 / 120.0, -1.0 / 5040.0, 1.0 / 362880.0, -1.0 / 39916800.0)
COS_C = (-0.5, 1.0 / 24.0, -1.0 / 720.0, 1.0 / 40320.0, -1.0 / 3628800.0, 1.0 / 479001600.0)

ZMAX = math.sqrt(-2.0 * math.log(2.0 ** -32))   # largest |z| the Gaussian stream can give


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of counter (c0..c3) under key (k0, k1); all uint64 values < 2**32."""
    for _ in range(10):
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        n0 = (p1 >> U32) ^ c1 ^ k0
        n2 = (p0 >> U32) ^ c3 ^ k1
        c1 = p1 & M32
        c3 = p0 & M32
        c0 = n0
        c2 = n2
        k0 = (k0 + PHILOX_W0) & M32
        k1 = (k1 + PHILOX_W1) & M32
    return c0, c1, c2, c3


def neg2_log_u(x):
    """-2 ln u for u = (x + 1) 2**-32, x a uint64 < 2**32; float64, >= 0, abs error < 1e-10."""
    m = np.float64(x) + 1.0                   # 1 .. 2**32, exact
    e = 0.0
    # exponent of m by a branch-free binary search (scalings by powers of two are exact)
    c = m >= 4294967296.0
    m = m * TWO_M32 if c else m
    e = e + 32.0 if c else e
    c = m >= 65536.0
    m = m * TWO_M16 if c else m
    e = e + 16.0 if c else e
    c = m >= 256.0
    m = m * TWO_M8 if c else m
    e = e + 8.0 if c else e
    c = m >= 16.0
    m = m * 0.0625 if c else m
    e = e + 4.0 if c else e
    c = m >= 4.0
    m = m * 0.25 if c else m
    e = e + 2.0 if c else e
    c = m >= 2.0
    m = m * 0.5 if c else m
    e = e + 1.0 if c else e
    c = m > SQRT2
    m = m * 0.5 if c else m
    e = e + 1.0 if c else e
    # m in (sqrt(2)/2, sqrt(2)], ln u = (e - 32) ln 2 + ln m
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    poly = LOG_C[4]
    poly = poly * s2 + LOG_C[3]
    poly = poly * s2 + LOG_C[2]
    poly = poly * s2 + LOG_C[1]
    poly = poly * s2 + LOG_C[0]
    poly = poly * s2 + 1.0
    # -2 ln u = (32 - e) 2 ln 2 - 4 s poly; exactly +0.0 (never -0.0) for u = 1
    return (32.0 - e) * (2.0 * LN2) - 4.0 * s * poly


def neg2_log_u_bits(x):
    """:func:`neg2_log_u` with the exponent and mantissa of m read from its float64 bits.

    For numba on the CPU and numpy only (numba.cuda does not compile scalar ``.view``). Both
    reductions are exact, so the result is bit-identical to :func:`neg2_log_u` (tested).
    """
    m = np.float64(x) + 1.0
    bits = np.float64(m).view(np.uint64)
    e = np.float64(bits >> U52) - 1023.0
    m = np.uint64((bits & M52) | EXP1023).view(np.float64)
    c = m > SQRT2
    m = m * 0.5 if c else m
    e = e + 1.0 if c else e
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    poly = LOG_C[4]
    poly = poly * s2 + LOG_C[3]
    poly = poly * s2 + LOG_C[2]
    poly = poly * s2 + LOG_C[1]
    poly = poly * s2 + LOG_C[0]
    poly = poly * s2 + 1.0
    return (32.0 - e) * (2.0 * LN2) - 4.0 * s * poly


def cos_sin_2pi(x):
    """(cos, sin) of the angle theta(x) of the stream definition; x a uint64 < 2**32."""
    q = x >> U30
    phi = (np.float64(x & M30) + 0.5) * PI_2_M31 - PI_4
    p2 = phi * phi
    sp = SIN_C[4]
    sp = sp * p2 + SIN_C[3]
    sp = sp * p2 + SIN_C[2]
    sp = sp * p2 + SIN_C[1]
    sp = sp * p2 + SIN_C[0]
    s = phi + phi * (p2 * sp)
    cp = COS_C[5]
    cp = cp * p2 + COS_C[4]
    cp = cp * p2 + COS_C[3]
    cp = cp * p2 + COS_C[2]
    cp = cp * p2 + COS_C[1]
    cp = cp * p2 + COS_C[0]
    c = 1.0 + p2 * cp
    odd = (q & U1) != U0
    c1 = -s if odd else c
    s1 = c if odd else s
    half = (q & U2) != U0
    c2 = -c1 if half else c1
    s2 = -s1 if half else s1
    return c2, s2


def box_muller(xa, xb):
    """Two standard normals (float64, before the float32 rounding) from two uint32 words."""
    r = math.sqrt(neg2_log_u(xa))
    c, s = cos_sin_2pi(xb)
    return r * c, r * s


def gauss4(b, t, k0, k1):
    """The four Gaussian z of block b (elements 4b .. 4b+3), float32-rounded, as float64."""
    x0, x1, x2, x3 = philox4x32_10(b & M32, b >> U32, t, U0, k0, k1)
    za, zb = box_muller(x0, x1)
    zc, zd = box_muller(x2, x3)
    return (np.float64(np.float32(za)), np.float64(np.float32(zb)),
            np.float64(np.float32(zc)), np.float64(np.float32(zd)))


def gauss_at(e, t, k0, k1):
    """Gaussian z of element e (uint64), float32-rounded, as float64.

    Computes the block's Philox words and only the Box-Muller pair the element needs; the same
    operations as :func:`gauss4`, so the same bits.
    """
    b = e >> U2
    x0, x1, x2, x3 = philox4x32_10(b & M32, b >> U32, t, U0, k0, k1)
    lane = e & U3
    second = lane >= U2
    xa = x2 if second else x0
    xb = x3 if second else x1
    za, zb = box_muller(xa, xb)
    z = zb if (lane & U1) != U0 else za
    return np.float64(np.float32(z))


def rad_words(b, t, k0, k1):
    """The four 32-bit words of Rademacher block b (elements 128b .. 128b+127)."""
    return philox4x32_10(b & M32, b >> U32, t, U1, k0, k1)


def rad_bit(w, k):
    """Rademacher z from bit k (uint64 < 32) of word w: +1.0 for 0, -1.0 for 1."""
    return 1.0 - 2.0 * np.float64((w >> k) & U1)


def rad_at(e, t, k0, k1):
    """Rademacher z of element e (uint64), as float64 (recomputes its block)."""
    w0, w1, w2, w3 = rad_words(e >> U7, t, k0, k1)
    j = (e >> U5) & U3
    lo = w1 if j == U1 else w0
    hi = w3 if j == U3 else w2
    w = hi if j >= U2 else lo
    return rad_bit(w, e & U31)


def split_seed(seed: int) -> tuple[np.uint64, np.uint64]:
    """Philox key words (k0, k1) of a seed in [0, 2**64); ValueError otherwise."""
    seed = int(seed)
    if not 0 <= seed < 2 ** 64:
        raise ValueError(f"seed must be in [0, 2**64), got {seed}")
    return np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)


def check_tensor_index(t: int) -> np.uint64:
    """The tensor index as uint64; ValueError unless 0 <= t < 2**32."""
    t = int(t)
    if not 0 <= t < 2 ** 32:
        raise ValueError(f"tensor index must be in [0, 2**32), got {t}")
    return np.uint64(t)


def dist_code(dist: str | int) -> int:
    """GAUSSIAN or RADEMACHER from a name ('gaussian'/'normal', 'rademacher') or a code."""
    if isinstance(dist, str):
        try:
            return DISTS[dist.lower()]
        except KeyError:
            raise ValueError(f"unknown z distribution {dist!r}; use 'gaussian' or "
                             "'rademacher'") from None
    if dist in (GAUSSIAN, RADEMACHER):
        return int(dist)
    raise ValueError(f"unknown z distribution code {dist!r}")
