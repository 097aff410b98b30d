"""xp-level ZO perturbation API: in-place passes over a model's trainable tensors.

A model is a list of tensors, each given as ``(t, array)`` or a :class:`ZTensor` (tensor index,
array, element offset of a shard, weight-decay flag). ``t`` must be the same on every rank and
device for the same tensor: it keys the direction z (rng.py). numpy arrays go to the numba CPU
kernels (kernels.py), cupy arrays to the GPU kernels (kernels_gpu.py; cupy is imported only when
a cupy array is seen). Arrays must be C-contiguous float32, float64, float16, or uint16 holding
bfloat16 bits (a bfloat16 model's storage, :mod:`semzo.model.storage`; no other parameter is
ever uint16). Half storage is storage only: the arithmetic is float64, rounded once to float32
and then to float16 / bfloat16, round to nearest even. z is never stored.

A MeZO step is three passes over the trainable parameters::

    perturb(params, seed, +eps)              # theta + eps z         -> loss L+
    perturb(params, seed, -2 * eps)          # theta - eps z         -> loss L-
    g = (L+ - L-) / (2 * eps)
    restore_update(params, seed, eps, lr, g, wd)   # theta - lr (g z + wd theta), z made once

Perturbation-parallel or ZO-data-parallel steps apply several (seed, g) pairs in one pass with
:func:`multi_update`, optionally fused with the restore of the rank's own perturbation.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from .. import rng
from ..backend import is_device_array
from . import kernels, kernels_gpu

SMALL = 1 << 16         # tensors below this many elements: kernels on one thread


class ZTensor(NamedTuple):
    """One trainable tensor (or a shard of one) as the ZO passes see it.

    t: tensor index (uint32), the same everywhere for the same tensor.
    array: C-contiguous numpy or cupy array (any shape; used flat), modified in place.
    offset: element index of ``array``'s first element within tensor t (0 unless a shard).
    decay: whether weight decay applies (see :func:`decays`).
    """

    t: int
    array: Any
    offset: int = 0
    decay: bool = True


def decays(name: str) -> bool:
    """Whether a Hugging Face parameter name gets weight decay (MeZO/HF convention).

    False for biases (names ending in 'bias') and LayerNorm parameters (names containing
    'LayerNorm', 'layer_norm', 'ln_' or '.ln', e.g. GPT-2's ln_1, ln_2, ln_f); True otherwise.
    """
    if name.endswith("bias"):
        return False
    return not any(k in name for k in ("LayerNorm", "layer_norm", "ln_", ".ln"))


def tensor_index(name: str) -> int:
    """The generator's tensor index of a parameter: crc32 of its name (stable across runs,
    rank counts, trainable subsets and code versions)."""
    return zlib.crc32(name.encode("utf-8"))


def ztensors(named: Sequence[tuple[str, object]]) -> list[ZTensor]:
    """ZTensors of (name, array) pairs: index by :func:`tensor_index`, decay by name."""
    out = [ZTensor(tensor_index(n), a, 0, decays(n)) for n, a in named]
    idx = [z.t for z in out]
    if len(set(idx)) != len(idx):
        raise RuntimeError("two trainable tensors hash to the same generator index")
    return out


def _entries(params: Iterable) -> list[ZTensor]:
    out = []
    for item in params:
        z = item if isinstance(item, ZTensor) else ZTensor(*item)
        rng.check_tensor_index(z.t)
        if int(z.offset) < 0:
            raise ValueError(f"tensor {z.t}: negative offset {z.offset}")
        out.append(z)
    return out


def _flat_numpy(a: np.ndarray, t: int) -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise TypeError(f"tensor {t}: need a numpy or cupy array, got {type(a).__name__}")
    if not a.flags.c_contiguous:
        raise ValueError(f"tensor {t}: array must be C-contiguous")
    if not a.flags.writeable:
        raise ValueError(f"tensor {t}: array is read-only")
    flat = a.reshape(-1)
    if flat.dtype == np.float16:
        return flat.view(np.uint16)          # the kernels' float16 view
    if flat.dtype == np.uint16:
        return flat.view(np.int16)           # bfloat16 bits: the kernels' bfloat16 view
    if flat.dtype not in (np.float32, np.float64):
        raise TypeError(f"tensor {t}: ZO kernels support float32, float64, float16 and "
                        f"bfloat16 (uint16 bits) storage, not {a.dtype}")
    return flat


def _flat_cupy(a, t: int):
    if not a.flags.c_contiguous:
        raise ValueError(f"tensor {t}: array must be C-contiguous")
    return a.reshape(-1)


def _gpu():
    return kernels_gpu


def _split(params: Iterable, wd: float) -> tuple[list, list[ZTensor]]:
    """(numpy entries (p, off, t, wd_t) for kernels.run_pass, cupy ZTensors)."""
    cpu, gpu = [], []
    for z in _entries(params):
        if is_device_array(z.array):
            gpu.append(z)
        else:
            cpu.append((_flat_numpy(z.array, z.t), int(z.offset), int(z.t),
                        float(wd) if z.decay else 0.0))
    return cpu, gpu


def perturb(params: Iterable, seed: int, scale: float, *, dist: str = "gaussian",
            threads: int | None = None) -> None:
    """p <- p + scale * z(seed) for every tensor, in place, one pass.

    params: (t, array) pairs or ZTensor (no array twice: ValueError if two share memory);
    seed: int in [0, 2**64); dist: 'gaussian', 'gaussian-fast' or 'rademacher'; threads: numba
    threads for numpy arrays (None: numba's setting). All numpy tensors go in one parallel launch.
    """
    k0, k1 = rng.split_seed(seed)
    code = rng.dist_code(dist)
    cpu, gpu = _split(params, 0.0)
    with kernels.num_threads(threads):
        kernels.run_pass(cpu, kernels.PERTURB, code, k0, k1, a=scale)
    for z in gpu:
        _gpu().perturb(_flat_cupy(z.array, z.t), z.offset, z.t, k0, k1, code, float(scale))


def perturb_cached(params: Iterable, zbufs: Sequence[np.ndarray], scale: float, *,
                   threads: int | None = None) -> None:
    """p <- p + scale * z for every (numpy) tensor, z read from ``zbufs`` (one float32 array per
    tensor, as a pass with ``zcache`` of :func:`apply_then_perturb` left it): the bits of
    :func:`perturb` with that pass's seed, without generating z again."""
    cpu, gpu = _split(params, 0.0)
    if gpu:
        raise ValueError("perturb_cached takes numpy tensors only")
    with kernels.num_threads(threads):
        kernels.run_pass(cpu, kernels.CACHED, 0, 0, 0, a=scale, zbufs=list(zbufs))


def restore_update(params: Iterable, seed: int, eps: float, lr: float, g: float,
                   wd: float = 0.0, *, dist: str = "gaussian",
                   threads: int | None = None) -> None:
    """Restore from the -eps state and apply the ZO-SGD update, in one pass, in place.

    For every tensor: pr = p + eps z; p <- pr - lr (g z + wd_t pr), with z = z(seed) computed
    once per element and wd_t = wd if the tensor's decay flag is set, else 0.
    """
    k0, k1 = rng.split_seed(seed)
    code = rng.dist_code(dist)
    cpu, gpu = _split(params, wd)
    with kernels.num_threads(threads):
        kernels.run_pass(cpu, kernels.RESTORE_UPDATE, code, k0, k1, a=eps, lr=lr, g=g)
    for z in gpu:
        _gpu().restore_update(_flat_cupy(z.array, z.t), z.offset, z.t, k0, k1, code,
                              float(eps), float(lr), float(g),
                              float(wd) if z.decay else 0.0)


def multi_update(params: Iterable, seeds: Sequence[int], gs: Sequence[float], lr: float,
                 wd: float = 0.0, *, eps: float = 0.0, restore_seed: int | None = None,
                 dist: str = "gaussian", threads: int | None = None) -> None:
    """Apply P ZO updates (and optionally the restore of this step's perturbation) in one pass.

    For every tensor: pr = p + eps z(restore_seed) if restore_seed is given, else pr = p;
    p <- pr - lr (sum_k gs[k] z(seeds[k]) + wd_t pr), the sum taken in order k = 0, 1, ...
    This is one step along the summed direction: pass gs[k] / P to average P perturbations
    (MeZO's n-SPSA). With P = 1 and restore_seed = seeds[0] it equals :func:`restore_update`
    bit for bit.
    """
    if len(seeds) != len(gs):
        raise ValueError(f"{len(seeds)} seeds but {len(gs)} projected gradients")
    keys = [rng.split_seed(s) for s in seeds]
    k0s = np.array([k[0] for k in keys], np.uint64)
    k1s = np.array([k[1] for k in keys], np.uint64)
    gsa = np.asarray(gs, np.float64).reshape(-1)
    restore = restore_seed is not None
    rk0, rk1 = rng.split_seed(restore_seed if restore else 0)
    code = rng.dist_code(dist)
    mode = kernels.MULTI_RESTORE if restore else kernels.MULTI
    cpu, gpu = _split(params, wd)
    with kernels.num_threads(threads):
        kernels.run_pass(cpu, mode, code, rk0, rk1, a=eps, lr=lr, k0s=k0s, k1s=k1s, gs=gsa)
    for z in gpu:
        _gpu().multi_update(_flat_cupy(z.array, z.t), z.offset, z.t, k0s, k1s, gsa, float(lr),
                            float(wd) if z.decay else 0.0, restore, rk0, rk1, float(eps), code)


class Pending(NamedTuple):
    """A parameter operation deferred to the next pass over the tensors (the block-streamed
    schedule applies step t's update in step t+1's first pass).

    kind: "none"; "perturb" (p += eps z(seed): undo a skipped step's -eps state);
    "restore_update" (:func:`restore_update` with seed, eps, lr, g, wd); "multi" or
    "multi_restore" (:func:`multi_update` with seeds, gs, lr, wd and, for "multi_restore",
    the restore of ``seed`` scaled by eps).
    """

    kind: str = "none"
    seed: int = 0
    eps: float = 0.0
    lr: float = 0.0
    g: float = 0.0
    wd: float = 0.0
    seeds: tuple = ()
    gs: tuple = ()


_MODES = {"none": kernels.NONE, "perturb": kernels.PERTURB,
          "restore_update": kernels.RESTORE_UPDATE, "multi": kernels.MULTI,
          "multi_restore": kernels.MULTI_RESTORE}


def apply_then_perturb(params: Sequence, op: Pending, post_seed: int | None,
                       post_scale: float = 0.0, *, dst: Sequence | None = None,
                       dist: str = "gaussian", threads: int | None = None,
                       zcache: Sequence[np.ndarray] | None = None) -> None:
    """Apply the deferred ``op`` to ``params`` and then ``q <- p + post_scale z(post_seed)``
    in ONE memory pass (numpy; cupy: the same kernels one after the other, same bits).
    ``zcache``: one float32 array per (numpy) tensor, same order: that z is stored there too,
    for :func:`perturb_cached`.

    q is ``params`` itself, or ``dst`` (ZTensors or arrays like params, same order): then
    params keep the op's result (the reference copy of ``zo.restore = "copy"``) and dst gets
    the perturbed values. ``post_seed`` None: the op alone (a flush), and with ``dst`` the
    op's result is copied into dst. Every element equals the separate passes bit for bit: the
    op's result is rounded to the storage type and read back before the perturbation.
    """
    if op.kind not in _MODES:
        raise ValueError(f"unknown pending operation {op.kind!r}")
    ents = _entries(params)
    dz = _entries([(z.t, d.array if isinstance(d, ZTensor) else d, z.offset, z.decay)
                   for z, d in zip(ents, dst)]) if dst is not None else None
    if dz is not None and len(dz) != len(ents):
        raise ValueError("dst must have one array per tensor")
    if zcache is not None and (len(zcache) != len(ents) or post_seed is None
                               or any(is_device_array(z.array) for z in ents)):
        raise ValueError("zcache takes one array per numpy tensor, with a post_seed")
    code = rng.dist_code(dist)
    k0, k1 = rng.split_seed(op.seed)
    keys = [rng.split_seed(s) for s in op.seeds]
    k0s = np.array([k[0] for k in keys], np.uint64)
    k1s = np.array([k[1] for k in keys], np.uint64)
    gsa = np.asarray(op.gs, np.float64).reshape(-1)
    mode = _MODES[op.kind]
    post = None
    if post_seed is not None:
        pk0, pk1 = rng.split_seed(post_seed)
        post = (pk0, pk1, float(post_scale))
    cpu, gpu = [], []
    for i, z in enumerate(ents):
        d = dz[i] if dz is not None else None
        if is_device_array(z.array):
            gpu.append((z, d))
            continue
        flat = _flat_numpy(z.array, z.t)
        fd = _flat_numpy(d.array, d.t) if d is not None else None
        wdt = float(op.wd) if z.decay else 0.0
        if post is None and fd is not None:
            cpu.append((flat, int(z.offset), int(z.t), wdt, None, fd))
        else:
            cpu.append((flat, int(z.offset), int(z.t), wdt, fd, None))
    with kernels.num_threads(threads):
        if cpu and (mode != kernels.NONE or post is not None):
            kernels.run_pass([c[:5] if c[4] is not None else c[:4] for c in cpu], mode, code,
                             k0, k1, a=op.eps, lr=op.lr, g=op.g, k0s=k0s, k1s=k1s, gs=gsa,
                             post=post, zbufs=None if zcache is None else list(zcache))
        for c in cpu:
            if c[5] is not None:
                np.copyto(c[5], c[0])
    for z, d in gpu:
        _gpu_apply_then_perturb(z, d, op, mode, post, code, k0, k1, k0s, k1s, gsa)


def _row_spans(code: np.ndarray, width: int, skip: int | None):
    """Element spans (starts, sizes, classes) of the runs of equal ``code`` over the rows of a
    (rows, width) tensor, leaving out runs of class ``skip``."""
    code = np.asarray(code, np.uint8)
    cut = np.flatnonzero(code[1:] != code[:-1]) + 1
    lo = np.concatenate(([0], cut))
    hi = np.concatenate((cut, [code.size]))
    cls = code[lo]
    if skip is not None:
        keep = cls != skip
        lo, hi, cls = lo[keep], hi[keep], cls[keep]
    return lo * width, (hi - lo) * width, cls


def _row_tensor(z: ZTensor, code: np.ndarray) -> tuple[np.ndarray, int]:
    a = z.array
    if is_device_array(a) or a.ndim != 2 or code.shape != (a.shape[0],):
        raise ValueError(f"tensor {z.t}: row passes take a 2-D numpy tensor and one code per "
                         f"row")
    return _flat_numpy(a, z.t), int(a.shape[1])


def apply_rows(z: ZTensor, code: np.ndarray, op: Pending, post_seed: int | None,
               post_scale: float = 0.0, *, pre: float = 0.0, dist: str = "gaussian",
               threads: int | None = None, zcache: np.ndarray | None = None) -> None:
    """:func:`apply_then_perturb` on the rows of one 2-D numpy tensor, row by row as
    ``code`` says (one launch, one memory pass): every row gets ``op``; a row whose code has
    bit ``kernels.PRE`` first gets ``+ pre z`` and then ``- 2 pre z``, each rounded to the
    storage type, with op's own z (the perturbation pair of the step whose update ``op`` is,
    deferred for rows that step's batch did not read); a row whose code has bit
    ``kernels.POST`` then gets ``+ post_scale z(post_seed)``, its z stored in ``zcache`` (a
    float32 array of the tensor's size) when given. The same bits as those separate passes."""
    rng.check_tensor_index(z.t)
    flat, width = _row_tensor(z, code)
    if np.any(code & kernels.PRE) and op.kind not in ("perturb", "restore_update",
                                                      "multi_restore"):
        raise ValueError(f"a deferred perturbation pair needs an operation with its own z, "
                         f"not {op.kind!r}")
    mode = _MODES[op.kind]
    starts, sizes, cls = _row_spans(code, width, 0 if mode == kernels.NONE else None)
    post = None
    if post_seed is not None:
        pk0, pk1 = rng.split_seed(post_seed)
        post = (pk0, pk1, float(post_scale))
    elif np.any(code & kernels.POST):
        raise ValueError("rows marked POST need a post_seed")
    k0, k1 = rng.split_seed(op.seed)
    keys = [rng.split_seed(s) for s in op.seeds]
    with kernels.num_threads(threads):
        kernels.run_spans(flat, int(z.offset), int(z.t), float(op.wd) if z.decay else 0.0,
                          starts, sizes, cls, mode, rng.dist_code(dist), k0, k1, a=op.eps,
                          lr=op.lr, g=op.g, k0s=np.array([k[0] for k in keys], np.uint64),
                          k1s=np.array([k[1] for k in keys], np.uint64),
                          gs=np.asarray(op.gs, np.float64).reshape(-1), post=post,
                          pre=(float(pre), -2.0 * float(pre)),
                          zbuf=None if zcache is None else zcache.reshape(-1))


def perturb_rows(z: ZTensor, rows: np.ndarray, seed: int, scale: float, *,
                 dist: str = "gaussian", threads: int | None = None,
                 zcache: np.ndarray | None = None) -> None:
    """:func:`perturb` (or, with ``zcache``, :func:`perturb_cached`) on the rows of one 2-D
    numpy tensor where ``rows`` (bool, one per row) is True; the others are left alone."""
    rng.check_tensor_index(z.t)
    code = np.asarray(rows, bool).astype(np.uint8)
    flat, width = _row_tensor(z, code)
    starts, sizes, _ = _row_spans(code, width, 0)
    k0, k1 = rng.split_seed(seed)
    mode = kernels.CACHED if zcache is not None else kernels.PERTURB
    with kernels.num_threads(threads):
        kernels.run_spans(flat, int(z.offset), int(z.t), 0.0, starts, sizes,
                          np.zeros(starts.size, np.uint8), mode, rng.dist_code(dist), k0, k1,
                          a=scale, zbuf=None if zcache is None else zcache.reshape(-1))


def _gpu_apply_then_perturb(z: ZTensor, d, op: Pending, mode, post, code, k0, k1, k0s, k1s,
                            gsa) -> None:
    """CuPy: one fused launch (``kernels_gpu.stream_pass``, the CUDA twin of the CPU pass);
    with the numba.cuda backend the op's kernel, a copy into dst, then the perturbation
    (separate launches, the same bits)."""
    g = _gpu()
    p = _flat_cupy(z.array, z.t)
    wdt = float(op.wd) if z.decay else 0.0
    q = _flat_cupy(d.array, d.t) if d is not None else p
    if not g._use_numba():
        if mode != kernels.NONE or post is not None:
            pk0, pk1, pa = post if post is not None else (0, 0, 0.0)
            g.stream_pass(p, q, z.offset, z.t, mode, k0, k1, float(op.eps), float(op.lr),
                          float(op.g), wdt, k0s, k1s, gsa, post is not None, pk0, pk1, pa, code)
        if post is None and d is not None:
            q[...] = p
        return
    if mode == kernels.PERTURB:
        g.perturb(p, z.offset, z.t, k0, k1, code, float(op.eps))
    elif mode == kernels.RESTORE_UPDATE:
        g.restore_update(p, z.offset, z.t, k0, k1, code, float(op.eps), float(op.lr),
                         float(op.g), wdt)
    elif mode in (kernels.MULTI, kernels.MULTI_RESTORE):
        g.multi_update(p, z.offset, z.t, k0s, k1s, gsa, float(op.lr), wdt,
                       mode == kernels.MULTI_RESTORE, k0, k1, float(op.eps), code)
    if d is not None:
        q[...] = p
    if post is not None:
        g.perturb(q, z.offset, z.t, post[0], post[1], code, post[2])


def zvec(seed: int, t: int, start: int, count: int, dist: str = "gaussian",
         *, threads: int | None = None) -> np.ndarray:
    """z(seed, t, e) for e in [start, start + count) as a float32 numpy array (reference/tests).

    Any slice equals the same slice of the full vector: zvec(s, t, a, b - a) ==
    zvec(s, t, 0, b)[a:b], bit for bit.
    """
    k0, k1 = rng.split_seed(seed)
    tt = rng.check_tensor_index(t)
    if start < 0 or count < 0:
        raise ValueError("start and count must be >= 0")
    out = np.empty(int(count), np.float32)
    if count:
        with kernels.num_threads(threads):
            kernels.zvec(out, start, tt, k0, k1, rng.dist_code(dist))
    return out


__all__ = ["Pending", "ZTensor", "apply_rows", "apply_then_perturb", "decays",
           "multi_update", "perturb", "perturb_cached", "perturb_rows", "restore_update", "zvec"]
