"""Fused in-place ZO kernels for the CPU (numba, parallel over elements).

One pass walks a list of flat parameter tensors (1-D, C-contiguous; float32, float64, float16
storage passed as its ``uint16`` view, or bfloat16 bits passed as their ``int16`` view) once, in
one parallel launch per storage dtype, regenerating z from the counter-based generator of
:mod:`semzo.finetune.rng` for element ``off + i`` of tensor ``t``. Arithmetic is float64 on the
float32-rounded z; the result is rounded once to float32, then, for half storage, from float32
to float16 or bfloat16, round to nearest even (float64 storage is not rounded). The two
16-bit formats differ only by the view's dtype: uint16 = float16, int16 = bfloat16 (a model
stores bfloat16 as uint16 bits, :mod:`semzo.model.storage`; :mod:`semzo.finetune.perturb`
passes those arrays as int16 views, so no storage code travels separately). bfloat16 bits
``h`` read as the float32 ``h << 16`` (exact); a float32 ``f`` is written as
``(f + 0x7FFF + ((f >> 16) & 1)) >> 16`` on its bit pattern (NaN: ``(f >> 16) | 0x40``).
The exact formulas, which the numpy reference in the tests writes out and which the GPU kernels
follow, are:

    perturb:         p <- p + scale * z
    restore_update:  pr = p + eps * z;  p <- pr - lr * (g * z + wd * pr)           (one z)
    multi_update:    pr = p + eps * z_r (if restoring);  acc = sum_k gs[k] * z_k  (k = 0, 1, ...)
                     p <- pr - lr * (acc + wd * pr)

Parallel with ``numba.prange`` over tasks of about ``CHUNK`` consecutive elements of all
tensors together (:func:`task_plan`: many small tensors or row spans share a task, so that
numba's static split of the tasks is a split by elements); each element's value depends on
its own index only, so results are bit-identical for any thread count (:func:`num_threads`). The kernels are compiled on first use per storage dtype and
cached on disk (``cache=True``). numba's cache does not see edits to rng.py: touch this file
after changing the generator.
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Callable, Iterator

import numba
import numpy as np
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import intrinsic, overload

from . import rng

CHUNK = 32768       # elements per parallel task (a multiple of 128, the Rademacher block)
SUB = 1024          # elements per z buffer inside a task (8 KiB of float64: stays in L1)

DEVICE_FUNCTIONS = ("philox4x32_10", "neg2_log_u", "cos_sin_2pi", "box_muller", "gauss4",
                    "gauss_at", "rad_words", "rad_bit", "rad_at", "fast_words", "fast_at")


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
_gauss4 = _dev["gauss4"]
_gauss_at = _dev["gauss_at"]
_rad_words = _dev["rad_words"]
_rad_bit = _dev["rad_bit"]
_rad_at = _dev["rad_at"]
_fast_words = _dev["fast_words"]
_fast_at = _dev["fast_at"]
_U0, _U1, _U2, _U3, _U7 = (np.uint64(v) for v in (0, 1, 2, 3, 7))
_U10, _U15, _U16, _U127, _U1023 = (np.uint64(v) for v in (10, 15, 16, 127, 1023))
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
def fill_z(z, e0, t, k0, k1, dist, tab, ws):
    """z[i] = z(seed, t, e0 + i) for i < z.size <= SUB (float64 array of float32-rounded
    values).

    e0, t, k0, k1: uint64; dist: rng.GAUSSIAN, rng.RADEMACHER or rng.GAUSSIAN_FAST;
    tab: FAST_TABLE; ws: uint64[WS] scratch. Serial. Whole Philox blocks are generated
    together (:func:`philox_blocks`), partial ones at the ends element by element.
    """
    m = z.size
    i = 0
    e = e0
    if dist == 2:
        fill_fast(z, e0, t, k0, k1, tab, ws)
    elif dist == 0:
        while i < m and (e & _U3) != _U0:
            z[i] = _gauss_at(e, t, k0, k1)
            i += 1
            e += _U1
        nb = (m - i) >> 2
        b0 = e >> _U2
        zz = z[i:i + 4 * nb]
        for j in range(nb):
            z0, z1, z2, z3 = _gauss4(b0 + np.uint64(j), t, k0, k1)
            zz[4 * j] = z0
            zz[4 * j + 1] = z1
            zz[4 * j + 2] = z2
            zz[4 * j + 3] = z3
        i += 4 * nb
        e += np.uint64(4 * nb)
        while i < m:
            z[i] = _gauss_at(e, t, k0, k1)
            i += 1
            e += _U1
    else:
        while i < m and (e & _U127) != _U0:
            z[i] = _rad_at(e, t, k0, k1)
            i += 1
            e += _U1
        nb = (m - i) >> 7
        if nb > 0:
            philox_blocks(ws, nb, e >> _U7, t, _U1, k0, k1)
            _rad_blocks(z, i, nb, ws)
        i += 128 * nb
        e += np.uint64(128 * nb)
        while i < m:
            z[i] = _rad_at(e, t, k0, k1)
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


# ----------------------------------------------------------------------------- fused updates
PERTURB, RESTORE_UPDATE, MULTI_RESTORE, MULTI, NONE, PLAIN, CACHED = 0, 1, 2, 3, 4, 5, 6
POST, PRE = 1, 2      # bits of an entry's flags (fused_kernel)
_PROTO_Z = np.empty(0, np.float32)
_NO_KEYS = np.zeros(0, np.uint64)
_NO_GS = np.zeros(0, np.float64)
#: storage views the kernels take: uint16 = float16 bits, int16 = bfloat16 bits
STORAGE = (np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.uint16), np.dtype(np.int16))


@intrinsic
def _as_pointer(typingctx, addr, proto):
    """The address ``addr`` (an integer) as a pointer to ``proto``'s element type."""
    if not isinstance(addr, nbtypes.Integer) or not isinstance(proto, nbtypes.Array):
        return None
    ptrty = nbtypes.CPointer(proto.dtype)

    def codegen(context, builder, sig, args):
        return builder.inttoptr(args[0], context.get_value_type(ptrty))
    return ptrty(addr, proto), codegen


@njit(parallel=True, cache=True, error_model="numpy")
def fused_kernel(proto, addrs, sizes, offs, ts, wds, plan, dist, k0, k1, a, lr, g, k0s, k1s,
                 gs, mode, dsts, flags, pk0, pk1, pa, qa1, qa2, tab, zouts, zproto):
    """One in-place pass over a list of tensors of proto's dtype, all chunks in one launch.

    Tensor j: flat array of sizes[j] elements at address addrs[j]; its element i is element
    offs[j] + i of tensor ts[j]; weight decay wds[j]. ``plan`` (:func:`task_plan`): the
    parallel tasks, each a run of pieces (tensor, first element, length).
    z = z(k0, k1); z_k keyed by (k0s[k], k1s[k]).

    mode PERTURB:        p <- p + a z
    mode RESTORE_UPDATE: pr = p + a z;  p <- pr - lr (g z + wd pr)         (z made once)
    mode MULTI_RESTORE:  pr = p + a z;  p <- pr - lr (sum_k gs[k] z_k + wd pr)
    mode MULTI:          pr = p;        p <- pr - lr (sum_k gs[k] z_k + wd pr)
    mode NONE:           p unchanged
    mode PLAIN:          p <- p + a (no z: the memory-speed baseline of bench/zo_step.py)
    mode CACHED:         p <- p + a zc, zc = the float32 array at zouts[j] (a z written by an
                         earlier pass: PERTURB's bits without generating z)
    before the mode, if ``flags[j] & PRE`` (modes PERTURB, RESTORE_UPDATE, MULTI_RESTORE):
                         p <- p + qa1 z, then p <- p + qa2 z, each rounded to the storage type
                         and read back, with the mode's own z (made once): the +eps and -2 eps
                         passes of the step whose update the mode applies, for rows of a
                         token embedding the step's batch did not read (streamed.py);
    then, if ``flags[j] & POST``: q <- p + pa z(pk0, pk1), q = the array at dsts[j] (p
    itself when 0), reading p as stored (rounded): the same bits as a second pass, in the same memory pass
    (the block-streamed schedule's first pass: the pending update, then the new +eps z);
    that z is also stored, as float32 (exact: every z of every distribution is a float32
    value), at zouts[j] when it is not 0, for the stage's second pass (mode CACHED).
    tab: FAST_TABLE (read by dist GAUSSIAN_FAST only).
    One kernel for every mode and tensor: one compilation per dtype, one thread-pool launch per
    pass (many small tensors cost no more launches than one large one).
    """
    tstart = plan[0]
    pj = plan[1]
    pc0 = plan[2]
    pm = plan[3]
    for c in prange(tstart.size - 1):
        zbuf = np.empty(SUB, np.float64)
        abuf = np.empty(SUB, np.float64)
        obuf = np.empty(SUB, np.float64)
        ws = np.empty(WS, np.uint64)
        for piece in range(tstart[c], tstart[c + 1]):
            j = pj[piece]
            _fused_piece(proto, addrs[j], sizes[j], offs[j], ts[j], wds[j], pc0[piece],
                         pm[piece], dist, k0, k1, a, lr, g, k0s, k1s, gs, mode, dsts[j],
                         flags[j], pk0, pk1, pa, qa1, qa2, tab, zouts[j], zproto, zbuf, abuf,
                         obuf, ws)


@njit(cache=True, error_model="numpy")
def _fused_piece(proto, addr, size, off, t, wd, c0, mc, dist, k0, k1, a, lr, g, k0s, k1s, gs,
                 mode, dst, flag, pk0, pk1, pa, qa1, qa2, tab, zout, zproto, zbuf, abuf, obuf,
                 ws):
    """Elements c0 .. c0 + mc - 1 of one tensor: the body of :func:`fused_kernel`."""
    npert = gs.size
    p = numba.carray(_as_pointer(addr, proto), size)
    q = p if dst == 0 else numba.carray(_as_pointer(dst, proto), size)
    zc = numba.carray(_as_pointer(zout, zproto), size)   # used only if not 0
    post = (flag & POST) != 0
    pre = (flag & PRE) != 0
    for s0 in range(0, mc, SUB):          # z of SUB elements at a time stays in L1
        i0 = c0 + s0
        m = min(SUB, mc - s0)
        e0 = off + np.uint64(i0)
        z = zbuf[:m]
        # views indexed by loop counters (known >= 0): no negative-index wraparound code
        # in the loops below, which LLVM then vectorizes
        pv = p[i0:i0 + m]
        if mode == 0 or mode == 1:
            fill_z(z, e0, t, k0, k1, dist, tab, ws)
            if pre:
                for i in range(m):
                    _store(pv, i, _load(pv, i) + qa1 * z[i])
                for i in range(m):
                    _store(pv, i, _load(pv, i) + qa2 * z[i])
            if mode == 0:
                for i in range(m):
                    _store(pv, i, _load(pv, i) + a * z[i])
            else:
                for i in range(m):
                    zi = z[i]
                    pr = _load(pv, i) + a * zi
                    _store(pv, i, pr - lr * (g * zi + wd * pr))
        elif mode == 5:
            for i in range(m):
                _store(pv, i, _load(pv, i) + a)
        elif mode == 6:
            zcv = zc[i0:i0 + m]
            for i in range(m):
                _store(pv, i, _load(pv, i) + a * np.float64(zcv[i]))
        elif mode != 4:
            if mode == 2 and pre:
                zo = obuf[:m]
                fill_z(zo, e0, t, k0, k1, dist, tab, ws)
                for i in range(m):
                    _store(pv, i, _load(pv, i) + qa1 * zo[i])
                for i in range(m):
                    _store(pv, i, _load(pv, i) + qa2 * zo[i])
            acc = abuf[:m]
            acc[:] = 0.0
            for k in range(npert):
                fill_z(z, e0, t, k0s[k], k1s[k], dist, tab, ws)
                gk = gs[k]
                for i in range(m):
                    acc[i] = acc[i] + gk * z[i]
            if mode == 2 and pre:
                for i in range(m):
                    pr = _load(pv, i) + a * zo[i]
                    _store(pv, i, pr - lr * (acc[i] + wd * pr))
            elif mode == 2:
                fill_z(z, e0, t, k0, k1, dist, tab, ws)
                for i in range(m):
                    pr = _load(pv, i) + a * z[i]
                    _store(pv, i, pr - lr * (acc[i] + wd * pr))
            else:
                for i in range(m):
                    pr = _load(pv, i)
                    _store(pv, i, pr - lr * (acc[i] + wd * pr))
        if post:
            fill_z(z, e0, t, pk0, pk1, dist, tab, ws)
            if zout != 0:
                zcv = zc[i0:i0 + m]
                for i in range(m):
                    zcv[i] = np.float32(z[i])
            if dst == 0:          # in place: one array, the loop LLVM vectorizes best
                for i in range(m):    # (through q = p it cost 9 ms more per Gaussian pass)
                    _store(pv, i, _load(pv, i) + pa * z[i])
            else:
                qv = q[i0:i0 + m]
                for i in range(m):
                    _store(qv, i, _load(pv, i) + pa * z[i])


def task_plan(sizes: np.ndarray, cache: bool = True) -> tuple:
    """The parallel tasks of a pass over tensors of ``sizes`` elements: (tstart, pj, pc0,
    pm). Piece q is elements pc0[q] .. pc0[q] + pm[q] - 1 of tensor pj[q] (tensors cut into
    CHUNK pieces); task c runs pieces tstart[c] .. tstart[c + 1] - 1, consecutive pieces of
    about CHUNK elements in all, so that numba's static split of the tasks between threads
    is a split by elements, however small the tensors (a row span of a token embedding) are.
    """
    sizes = np.asarray(sizes, np.int64)
    if not cache:                         # row spans: new sizes every step
        return _task_plan(sizes)
    key = sizes.tobytes()
    got = _PLANS.get(key)
    if got is None:
        if len(_PLANS) >= 256:            # the passes of a run use a handful of tensor lists
            _PLANS.clear()
        got = _PLANS[key] = _task_plan(sizes)
    return got


_PLANS: dict[bytes, tuple] = {}


def _task_plan(sizes: np.ndarray) -> tuple:
    nch = (sizes + CHUNK - 1) // CHUNK
    pj = np.repeat(np.arange(sizes.size, dtype=np.int64), nch)
    first = np.cumsum(nch) - nch
    pc0 = (np.arange(pj.size, dtype=np.int64) - np.repeat(first, nch)) * CHUNK
    pm = np.minimum(CHUNK, sizes[pj] - pc0)
    task = (np.cumsum(pm) - pm) // CHUNK          # start of the piece, in CHUNKs
    cut = np.flatnonzero(task[1:] != task[:-1]) + 1
    tstart = np.concatenate(([0], cut, [pj.size])).astype(np.int64) if pj.size else \
        np.zeros(1, np.int64)
    return tstart, pj, pc0, pm


def _u(x) -> np.uint64:
    return np.uint64(x)


def _check_zbuf(zb, p: np.ndarray, t: int, mode: int) -> None:
    """A z buffer (None, or a flat, C-contiguous, writeable float32 array of p's size);
    mode CACHED needs one."""
    if zb is not None and (not isinstance(zb, np.ndarray) or zb.dtype != np.float32
                           or zb.ndim != 1 or zb.size != p.size
                           or not zb.flags.c_contiguous or not zb.flags.writeable):
        raise ValueError(f"tensor {t}: the z buffer must be a flat, C-contiguous, writeable "
                         f"float32 array of {p.size} elements")
    if zb is None and mode == CACHED:
        raise ValueError(f"tensor {t}: mode CACHED needs a z buffer")


def run_pass(entries, mode: int, dist: int, k0, k1, a: float = 0.0, lr: float = 0.0,
             g: float = 0.0, k0s: np.ndarray = _NO_KEYS, k1s: np.ndarray = _NO_KEYS,
             gs: np.ndarray = _NO_GS, post: tuple | None = None,
             zbufs: list | None = None) -> None:
    """One fused pass (``mode``, see :func:`fused_kernel`) over ``entries``, in place.

    entries: (p, off, t, wd) or (p, off, t, wd, dst) with p a flat C-contiguous writeable
    numpy array of float32, float64, uint16 (the view of float16 storage) or int16 (the view of
    bfloat16 bits) and dst None or an
    array like p. ``post`` = (pk0, pk1, pa): after the mode's operation, dst (or p) <- p +
    pa z(pk0, pk1) in the same pass. One kernel launch per storage dtype.
    ``zbufs``: one flat float32 array (or None) per entry, of the entry's size: with ``post``
    the pass stores that z there; mode CACHED reads its z from there (every entry needs one).
    ValueError if two arrays share memory (the chunks run concurrently).
    """
    groups: dict[np.dtype, list] = {}
    spans = []
    if zbufs is not None and len(zbufs) != len(entries):
        raise ValueError("zbufs must have one entry per tensor")
    for n, ent in enumerate(entries):
        p, off, t, wd = ent[:4]
        dst = ent[4] if len(ent) > 4 else None
        zb = zbufs[n] if zbufs is not None else None
        _check_zbuf(zb, p, t, mode)
        for arr in (p,) if dst is None else (p, dst):
            if arr.dtype not in STORAGE or arr.ndim != 1 or not arr.flags.c_contiguous \
                    or not arr.flags.writeable:
                raise ValueError(f"tensor {t}: need a flat, C-contiguous, writeable array of "
                                 f"float32/float64/uint16 (float16)/int16 (bfloat16), got "
                                 f"{arr.dtype} {arr.shape}")
        if dst is not None and (dst.dtype != p.dtype or dst.size != p.size):
            raise ValueError(f"tensor {t}: destination {dst.dtype} {dst.shape} does not match "
                             f"{p.dtype} {p.shape}")
        if p.size:
            groups.setdefault(p.dtype, []).append((p, off, t, wd, dst, zb))
            for arr in (p, dst, zb):
                if arr is not None:
                    spans.append((arr.ctypes.data, arr.ctypes.data + arr.nbytes, t))
    spans.sort()
    for (_, hi, t0), (lo, _, t1) in itertools.pairwise(spans):
        if lo < hi:
            raise ValueError(f"tensors {t0} and {t1} share memory")
    k0s = np.ascontiguousarray(k0s, np.uint64)
    k1s = np.ascontiguousarray(k1s, np.uint64)
    gs = np.ascontiguousarray(gs, np.float64)
    if not k0s.size == k1s.size == gs.size:
        raise ValueError("k0s, k1s and gs must have the same length")
    pk0, pk1, pa = post if post is not None else (0, 0, 0.0)
    for dt, items in groups.items():
        sizes = np.array([it[0].size for it in items], np.int64)
        dsts = np.array([0 if it[4] is None else it[4].ctypes.data for it in items], np.uint64)
        zouts = np.array([0 if it[5] is None else it[5].ctypes.data for it in items], np.uint64)
        fused_kernel(np.empty(0, dt), np.array([it[0].ctypes.data for it in items], np.uint64),
                     sizes, np.array([it[1] for it in items], np.uint64),
                     np.array([it[2] for it in items], np.uint64),
                     np.array([it[3] for it in items], np.float64), task_plan(sizes),
                     int(dist),
                     _u(k0), _u(k1), float(a), float(lr), float(g), k0s, k1s, gs, int(mode),
                     dsts, np.full(len(items), POST if post is not None else 0, np.uint8),
                     _u(pk0), _u(pk1), float(pa), 0.0, 0.0, FAST_TABLE, zouts, _PROTO_Z)


def run_spans(p: np.ndarray, off: int, t: int, wd: float, starts: np.ndarray,
              sizes: np.ndarray, flags: np.ndarray, mode: int, dist: int, k0, k1,
              a: float = 0.0, lr: float = 0.0, g: float = 0.0, k0s: np.ndarray = _NO_KEYS,
              k1s: np.ndarray = _NO_KEYS, gs: np.ndarray = _NO_GS, post: tuple | None = None,
              pre: tuple = (0.0, 0.0), zbuf: np.ndarray | None = None) -> None:
    """One fused pass (``mode``) over spans of ONE flat tensor, in place, one launch.

    Span s is elements ``starts[s] .. starts[s] + sizes[s] - 1`` of ``p`` (element ``off + i``
    of tensor ``t``); spans must be increasing and disjoint. ``flags[s]``: :data:`POST` (then
    ``post`` = (pk0, pk1, pa) applies to the span) and :data:`PRE` (``pre`` = (qa1, qa2)
    applies first: see :func:`fused_kernel`). ``zbuf``: a float32 array of ``p``'s size; a
    POST span stores its z at the same elements of it (mode CACHED reads them). The rows of a
    token embedding the step's batch read and did not read are such spans (streamed.py).
    """
    if p.dtype not in STORAGE or p.ndim != 1 or not p.flags.c_contiguous \
            or not p.flags.writeable:
        raise ValueError(f"tensor {t}: need a flat, C-contiguous, writeable storage array")
    starts = np.ascontiguousarray(starts, np.int64)
    sizes = np.ascontiguousarray(sizes, np.int64)
    flags = np.ascontiguousarray(flags, np.uint8)
    if not starts.shape == sizes.shape == flags.shape or starts.ndim != 1:
        raise ValueError("starts, sizes and flags must be 1-D of one length")
    if starts.size == 0:
        return
    ends = starts + sizes
    if (sizes <= 0).any() or starts[0] < 0 or ends[-1] > p.size \
            or (starts[1:] < ends[:-1]).any():
        raise ValueError(f"tensor {t}: spans must be non-empty, increasing, disjoint and "
                         f"inside its {p.size} elements")
    _check_zbuf(zbuf, p, t, mode)
    if zbuf is not None and np.shares_memory(zbuf, p):
        raise ValueError(f"tensor {t}: the z buffer shares memory with the tensor")
    n = starts.size
    base = p.ctypes.data
    zouts = (np.zeros(n, np.uint64) if zbuf is None
             else (zbuf.ctypes.data + 4 * starts).astype(np.uint64))
    pk0, pk1, pa = post if post is not None else (0, 0, 0.0)
    fused_kernel(np.empty(0, p.dtype), (base + p.itemsize * starts).astype(np.uint64), sizes,
                 (int(off) + starts).astype(np.uint64), np.full(n, t, np.uint64),
                 np.full(n, wd, np.float64), task_plan(sizes, cache=False), int(dist),
                 _u(k0), _u(k1), float(a), float(lr), float(g),
                 np.ascontiguousarray(k0s, np.uint64), np.ascontiguousarray(k1s, np.uint64), np.ascontiguousarray(gs, np.float64),
                 int(mode), np.zeros(n, np.uint64), flags, _u(pk0), _u(pk1), float(pa),
                 float(pre[0]), float(pre[1]), FAST_TABLE, zouts, _PROTO_Z)


def perturb(p: np.ndarray, off: int, t: int, k0, k1, dist: int, scale: float) -> None:
    """p <- p + scale z, in place. p: flat float32/float64 array, float16 as uint16 view or
    bfloat16 bits as int16 view."""
    run_pass([(p, off, t, 0.0)], PERTURB, dist, k0, k1, a=scale)


def restore_update(p: np.ndarray, off: int, t: int, k0, k1, dist: int, eps: float, lr: float,
                   g: float, wd: float) -> None:
    """pr = p + eps z; p <- pr - lr (g z + wd pr), in place, z computed once per element."""
    run_pass([(p, off, t, wd)], RESTORE_UPDATE, dist, k0, k1, a=eps, lr=lr, g=g)


def multi_update(p: np.ndarray, off: int, t: int, k0s: np.ndarray, k1s: np.ndarray,
                 gs: np.ndarray, lr: float, wd: float, restore: bool, rk0, rk1, eps: float,
                 dist: int) -> None:
    """pr = p + eps z_r (if restore); p <- pr - lr (sum_k gs[k] z_k + wd pr), in place.

    k0s, k1s: uint64[P] key words of the P seeds; gs: float64[P]; (rk0, rk1): restore key.
    """
    run_pass([(p, off, t, wd)], MULTI_RESTORE if restore else MULTI, dist, rk0, rk1, a=eps,
             lr=lr, k0s=k0s, k1s=k1s, gs=gs)


def zvec(out: np.ndarray, e0: int, t: int, k0, k1, dist: int) -> None:
    """out[i] = z(seed, t, e0 + i) into a float32 array."""
    zvec_kernel(out, _u(e0), _u(t), _u(k0), _u(k1), int(dist), FAST_TABLE)


# ----------------------------------------------------------------------------- threads
@contextlib.contextmanager
def num_threads(n: int | None) -> Iterator[int]:
    """Run the kernels inside the block on ``n`` numba threads (None: leave as is).

    Results do not depend on the thread count. Yields the count in effect.
    """
    if n is None:
        yield numba.get_num_threads()
        return
    old = numba.get_num_threads()
    numba.set_num_threads(max(1, min(int(n), numba.config.NUMBA_NUM_THREADS)))
    try:
        yield numba.get_num_threads()
    finally:
        numba.set_num_threads(old)
