"""Fused in-place ZO kernels for the CPU (numba, parallel over elements).

One pass walks a list of flat parameter tensors (1-D, C-contiguous; float32, float64, float16
storage passed as its ``uint16`` view, or bfloat16 bits passed as their ``int16`` view) once, in
one parallel launch per storage dtype, regenerating z from the counter-based generator of
:mod:`semzo.rng` (compiled in :mod:`.zgen`) for element ``off + i`` of tensor ``t``. Arithmetic is float64 on the
float32-rounded z; the result is rounded once to float32, then, for half storage, from float32
to float16 or bfloat16, round to nearest even (float64 storage is not rounded). The two
16-bit formats differ only by the view's dtype: uint16 = float16, int16 = bfloat16 (a model
stores bfloat16 as uint16 bits, :mod:`semzo.model.storage`; :mod:`semzo.zo.perturb`
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
from collections.abc import Iterator

import numba
import numpy as np
from numba import njit, prange
from numba.core import types as nbtypes
from numba.extending import intrinsic

from .zgen import (
    _U1,
    _U7,
    _U127,
    CHUNK,
    FAST_TABLE,
    SUB,
    WS,
    WSTRIDE,
    _load,
    _store,
    fill_z,
    philox_blocks,
    rad_axpy,
    zvec_kernel,
)

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
    start = 0
    if mode == 0 and dist == 1 and not pre and not post and \
            ((off + np.uint64(c0)) & _U127) == 0:
        # Rademacher perturbation of whole 128-element blocks, WSTRIDE blocks (a piece of
        # CHUNK elements) per Philox batch: z never stored (rad_axpy); the rest below
        nbt = mc >> 7
        b = 0
        while b < nbt:
            nb = min(WSTRIDE, nbt - b)
            i0 = c0 + 128 * b
            philox_blocks(ws, nb, (off + np.uint64(i0)) >> _U7, t, _U1, k0, k1)
            rad_axpy(p[i0:i0 + 128 * nb], nb, ws, a)
            b += nb
        start = 128 * nbt
    for s0 in range(start, mc, SUB):      # z of SUB elements at a time stays in L1
        i0 = c0 + s0
        m = min(SUB, mc - s0)
        e0 = off + np.uint64(i0)
        z = zbuf[:m]
        # views indexed by loop counters (known >= 0): no negative-index wraparound code
        # in the loops below, which LLVM then vectorizes
        pv = p[i0:i0 + m]
        if mode == 0 and dist == 1 and not pre and (e0 & _U127) == 0 and (m & 127) == 0:
            # Rademacher perturbation of whole blocks (with post): z never stored
            philox_blocks(ws, m >> 7, e0 >> _U7, t, _U1, k0, k1)
            rad_axpy(pv, m >> 7, ws, a)
        elif mode == 0 or mode == 1:
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
