"""xp-level ZO perturbation API: in-place passes over a model's trainable tensors.

A model is a list of tensors, each given as ``(t, array)`` or a :class:`ZTensor` (tensor index,
array, element offset of a shard, weight-decay flag). ``t`` must be the same on every rank and
device for the same tensor: it keys the direction z (rng.py). numpy arrays go to the numba CPU
kernels (kernels.py), cupy arrays to the GPU kernels (kernels_gpu.py; cupy is imported only when
a cupy array is seen). Arrays must be C-contiguous float32, float64, or float16 (storage only:
the arithmetic is float64, rounded once to float32 and then to float16). z is never stored.

A MeZO step is three passes over the trainable parameters::

    perturb(params, seed, +eps)              # theta + eps z         -> loss L+
    perturb(params, seed, -2 * eps)          # theta - eps z         -> loss L-
    g = (L+ - L-) / (2 * eps)
    restore_update(params, seed, eps, lr, g, wd)   # theta - lr (g z + wd theta), z made once

Perturbation-parallel or ZO-data-parallel steps apply several (seed, g) pairs in one pass with
:func:`multi_update`, optionally fused with the restore of the rank's own perturbation.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import kernels, rng


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


def is_cupy(a: Any) -> bool:
    """True for a cupy array (checked without importing cupy)."""
    return type(a).__module__.startswith("cupy")


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
        return flat.view(np.uint16)
    if flat.dtype not in (np.float32, np.float64):
        raise TypeError(f"tensor {t}: ZO kernels support float32, float64, float16 storage, "
                        f"not {a.dtype}")
    return flat


def _flat_cupy(a, t: int):
    if not a.flags.c_contiguous:
        raise ValueError(f"tensor {t}: array must be C-contiguous")
    return a.reshape(-1)


def _gpu():
    from . import kernels_gpu
    return kernels_gpu


def _split(params: Iterable, wd: float) -> tuple[list, list[ZTensor]]:
    """(numpy entries (p, off, t, wd_t) for kernels.run_pass, cupy ZTensors)."""
    cpu, gpu = [], []
    for z in _entries(params):
        if is_cupy(z.array):
            gpu.append(z)
        else:
            cpu.append((_flat_numpy(z.array, z.t), int(z.offset), int(z.t),
                        float(wd) if z.decay else 0.0))
    return cpu, gpu


def perturb(params: Iterable, seed: int, scale: float, *, dist: str = "gaussian",
            threads: int | None = None) -> None:
    """p <- p + scale * z(seed) for every tensor, in place, one pass.

    params: (t, array) pairs or ZTensor (no array twice: ValueError if two share memory);
    seed: int in [0, 2**64); dist: 'gaussian' or 'rademacher'; threads: numba threads for
    numpy arrays (None: numba's setting). All numpy tensors go in one parallel launch.
    """
    k0, k1 = rng.split_seed(seed)
    code = rng.dist_code(dist)
    cpu, gpu = _split(params, 0.0)
    with kernels.num_threads(threads):
        kernels.run_pass(cpu, kernels.PERTURB, code, k0, k1, a=scale)
    for z in gpu:
        _gpu().perturb(_flat_cupy(z.array, z.t), z.offset, z.t, k0, k1, code, float(scale))


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


__all__ = ["ZTensor", "decays", "is_cupy", "multi_update", "perturb", "restore_update", "zvec"]
