"""GPU ZO kernels: a CuPy RawModule (CUDA C) and numba.cuda kernels, same z stream as the CPU.

Import this module only when a GPU is used (or in the simulator test); it imports neither cupy
nor numba.cuda at import time.

Two implementations of the same contract (rng.py stream definition, kernels.py formulas):

* **CuPy** (:mod:`.kernels_cuda`, used for cupy arrays by default). The CUDA C source spells the
  operations of rng.py in C, in the same order, with every constant pasted from rng.py
  (:func:`cuda_source`). It is compiled with ``--fmad=false`` so that no multiply-add is contracted
  and the float64 arithmetic is the CPU's, operation for operation. The same source, kernels
  included, compiles as plain C (the ``ZO_*`` macros turn each grid-stride loop into a serial
  loop); the tests build it with gcc and require bit-identical results to the numba CPU kernels
  (and the GPU kit, tools/gpu-check.sh, on a device). A thread makes the z of a quad: four
  elements of one Gaussian Philox block, one Philox call and two Box-Muller pairs
  (:func:`nquads` sizes the grid).
* **numba.cuda** (:func:`numba_cuda_kernels`, used when ``SEMZO_ZO_GPU_BACKEND=numba``). The
  device functions are rng.py's own Python functions compiled with ``cuda.jit(device=True)``
  (textually the same code as the CPU path). Tested under the CUDA simulator
  (``NUMBA_ENABLE_CUDASIM=1``), where it gives the CPU's bits; on a real GPU, NVVM may contract
  multiply-adds, which changes Gaussian z by at most about one float32 ulp (< 1e-6).

Entry points mirror kernels.py: ``zvec``, ``perturb``, ``restore_update``, ``multi_update`` take
a flat device array ``p`` (float32, float64, float16, or uint16 bfloat16 bits: CuPy backend
only), the element offset ``off`` of ``p[0]`` in
tensor ``t``, the seed key words, and act in place on the current CuPy stream.

Every entry point checks its arrays before any launch (:func:`_check_flat`,
:func:`_check_seeds`): a kernel indexes ``p`` as a flat C-ordered buffer of ``p.size``
elements and the seed arrays up to ``gs.size``, so a strided view, an unsupported dtype, a
``q`` smaller than ``p`` or a ``k0s`` shorter than ``gs`` would read or write past the end of
device memory instead of raising.
"""

from __future__ import annotations

import functools
import os

import numpy as np

from .. import rng
from .kernels_cuda import cuda_source
from .zgen import build_device_functions

THREADS_PER_BLOCK = 256
cuda = None              # numba.cuda, imported by numba_cuda_kernels()
MAX_BLOCKS = 65535

#: storage dtype -> kernel suffix; uint16 arrays are bfloat16 bits (semzo.model.storage)
SUFFIX = {np.dtype(np.float32): "f32", np.dtype(np.float64): "f64", np.dtype(np.float16): "f16",
          np.dtype(np.uint16): "bf16"}


# ----------------------------------------------------------------------------- CuPy backend
@functools.cache
def _cupy_module(device_id: int):
    import cupy  # GPU only: this module loads on CPU machines too
    return cupy.RawModule(code=cuda_source(), options=("--fmad=false",))


@functools.cache
def _cupy_function(device_id: int, name: str):
    return _cupy_module(device_id).get_function(name)


def nquads(off: int, n: int) -> int:
    """The quads (4-element groups of a Gaussian Philox block, kernels_cuda's ``zo_nquads``)
    that elements ``off`` .. ``off + n - 1`` of a tensor touch: one thread each."""
    return 0 if n <= 0 else ((int(off) + n - 1) >> 2) - (int(off) >> 2) + 1


def _cupy_launch(name: str, off: int, n: int, args: tuple) -> None:
    """Launch ``name`` over the quads of elements off .. off + n - 1 (grid-stride beyond
    MAX_BLOCKS blocks)."""
    import cupy  # GPU only
    fn = _cupy_function(cupy.cuda.runtime.getDevice(), name)
    blocks = max(1, min(MAX_BLOCKS, -(-nquads(off, n) // THREADS_PER_BLOCK)))
    fn((blocks,), (THREADS_PER_BLOCK,), args)


_SEEDS: dict = {}      # the last seed arrays put on the device (a pass reuses them per tensor)


def _device_seeds(k0s, k1s, gs) -> tuple:
    """(k0s, k1s, gs) as device arrays (uint64, uint64, float64): uploaded once for the many
    launches of a pass that share them (read only by the kernels)."""
    import cupy  # GPU only
    host = (np.asarray(k0s, np.uint64), np.asarray(k1s, np.uint64), np.asarray(gs, np.float64))
    key = (cupy.cuda.runtime.getDevice(), *(h.tobytes() for h in host))
    got = _SEEDS.get(key)
    if got is None:
        _SEEDS.clear()
        got = _SEEDS[key] = tuple(cupy.asarray(h) for h in host)
    return got


def _storage(p):
    """(suffix, array the kernel writes) for a flat cupy array: float16 goes as its uint16 view,
    bfloat16 bits (uint16) as they are."""
    import cupy  # GPU only
    sfx = SUFFIX.get(np.dtype(p.dtype))
    if sfx is None:
        raise TypeError(f"ZO kernels support float32, float64, float16 and bfloat16 (uint16 "
                        f"bits) storage, not {p.dtype}")
    return sfx, (p.view(cupy.uint16) if sfx == "f16" else p)


def _check_flat(name: str, a, dtypes) -> None:
    """``a`` must be a C-contiguous array of one of ``dtypes`` (the kernels index it flat)."""
    dt = getattr(a, "dtype", None)
    if dt is None or not hasattr(a, "size"):
        raise TypeError(f"ZO kernels: {name} must be a device array, got {type(a).__name__}")
    if np.dtype(dt) not in dtypes:
        names = ", ".join(sorted(np.dtype(d).name for d in dtypes))
        raise TypeError(f"ZO kernels: {name} has dtype {np.dtype(dt).name}; supported: {names} "
                        f"(uint16 = bfloat16 bits)")
    flags = getattr(a, "flags", None)
    # numpy and cupy: flags.c_contiguous; numba's device arrays: a dict
    contiguous = flags is not None and bool(flags["C_CONTIGUOUS"] if isinstance(flags, dict)
                                            else flags.c_contiguous)
    if not contiguous:
        raise ValueError(f"ZO kernels: {name} must be C-contiguous (the kernels index it as a "
                         f"flat buffer of {a.size} elements); got a strided view of shape "
                         f"{tuple(a.shape)}")


def _check_pair(p, q) -> None:
    """``q`` (the post-perturb destination of stream_pass) shaped and typed as ``p``."""
    _check_flat("q", q, SUFFIX)
    if q.size != p.size or np.dtype(q.dtype) != np.dtype(p.dtype):
        raise ValueError(f"ZO kernels: q ({q.size} x {np.dtype(q.dtype).name}) must match p "
                         f"({p.size} x {np.dtype(p.dtype).name})")


def _check_seeds(k0s, k1s, gs) -> int:
    """The number of perturbations; k0s, k1s, gs: 1-D, one entry each per perturbation."""
    lens = [np.shape(a) for a in (k0s, k1s, gs)]
    if any(len(s) != 1 for s in lens) or len({s[0] for s in lens}) != 1:
        raise ValueError(f"ZO kernels: k0s, k1s and gs must be 1-D of equal length (one entry "
                         f"per perturbation), got shapes {lens}")
    return lens[0][0]


def _check_scalar(name: str, v) -> None:
    """Offsets and seed words are unsigned 64-bit: reject what would wrap (a negative offset)."""
    if int(v) < 0 or int(v) >= 2**64:
        raise ValueError(f"ZO kernels: {name} = {v} is not an unsigned 64-bit integer")


def _check_offset(name: str, off, n: int) -> None:
    """``off`` and the element indices off .. off + n - 1 must all be unsigned 64-bit (the
    kernels' quads would wrap past 2**64)."""
    _check_scalar(name, off)
    if int(off) + int(n) > 2**64:
        raise ValueError(f"ZO kernels: elements {name} = {off} .. {name} + {n} - 1 run past "
                         f"2**64")


_OUT_F32 = (np.dtype(np.float32),)


def _u(x) -> np.uint64:
    return np.uint64(x)


def _use_numba() -> bool:
    return os.environ.get("SEMZO_ZO_GPU_BACKEND", "cupy").lower() == "numba"


def zvec(out, e0, t, k0, k1, dist) -> None:
    """out[i] = z(seed, t, e0 + i) into a float32 device array."""
    _check_flat("out", out, _OUT_F32)
    _check_offset("e0", e0, out.size)
    if _use_numba():
        numba_cuda_kernels().zvec(out, e0, t, k0, k1, dist)
        return
    n = out.size
    _cupy_launch("zo_zvec", e0, n, (out, np.int64(n), _u(e0), _u(t), _u(k0), _u(k1),
                                np.int32(dist)))


def perturb(p, off, t, k0, k1, dist, scale) -> None:
    """p <- p + scale z, in place (formula of kernels.perturb_kernel)."""
    _check_flat("p", p, SUFFIX)
    _check_offset("off", off, p.size)
    if _use_numba():
        numba_cuda_kernels().perturb(p, off, t, k0, k1, dist, scale)
        return
    sfx, q = _storage(p)
    n = p.size
    _cupy_launch(f"zo_perturb_{sfx}", off, n, (q, np.int64(n), _u(off), _u(t), _u(k0), _u(k1),
                                           np.int32(dist), np.float64(scale)))


def restore_update(p, off, t, k0, k1, dist, eps, lr, g, wd) -> None:
    """pr = p + eps z; p <- pr - lr (g z + wd pr), in place."""
    _check_flat("p", p, SUFFIX)
    _check_offset("off", off, p.size)
    if _use_numba():
        numba_cuda_kernels().restore_update(p, off, t, k0, k1, dist, eps, lr, g, wd)
        return
    sfx, q = _storage(p)
    n = p.size
    _cupy_launch(f"zo_restore_update_{sfx}", off, n,
                 (q, np.int64(n), _u(off), _u(t), _u(k0), _u(k1), np.int32(dist),
                  np.float64(eps), np.float64(lr), np.float64(g), np.float64(wd)))


def multi_update(p, off, t, k0s, k1s, gs, lr, wd, restore, rk0, rk1, eps, dist) -> None:
    """pr = p + eps z_r (if restore); p <- pr - lr (sum_k gs[k] z_k + wd pr), in place.

    k0s, k1s: uint64[P], gs: float64[P] host (numpy) arrays of equal length P.
    """
    _check_flat("p", p, SUFFIX)
    _check_offset("off", off, p.size)
    _check_seeds(k0s, k1s, gs)
    if _use_numba():
        numba_cuda_kernels().multi_update(p, off, t, k0s, k1s, gs, lr, wd, restore, rk0, rk1,
                                          eps, dist)
        return
    sfx, q = _storage(p)
    n = p.size
    dk0, dk1, dgs = _device_seeds(k0s, k1s, gs)
    _cupy_launch(f"zo_multi_update_{sfx}", off, n,
                 (q, np.int64(n), _u(off), _u(t), dk0, dk1, dgs, np.int32(dgs.size),
                  np.float64(lr), np.float64(wd), np.int32(bool(restore)), _u(rk0), _u(rk1),
                  np.float64(eps), np.int32(dist)))


def stream_pass(p, q, off, t, mode, k0, k1, a, lr, g, wd, k0s, k1s, gs, post, pk0, pk1, pa,
                dist) -> None:
    """The block-streamed schedule's fused pass (kernels.fused_kernel's modes, then ``post``:
    q <- p + pa z(pk0, pk1), q may be p), one launch, CuPy only. k0s, k1s, gs: host arrays
    of equal length; q shaped and typed as p."""
    _check_flat("p", p, SUFFIX)
    _check_pair(p, q)
    _check_offset("off", off, p.size)
    _check_seeds(k0s, k1s, gs)
    sfx, pp = _storage(p)
    _, qq = _storage(q)
    n = p.size
    dk0, dk1, dgs = _device_seeds(k0s, k1s, gs)
    _cupy_launch(f"zo_stream_{sfx}", off, n,
                 (pp, qq, np.int64(n), _u(off), _u(t), np.int32(mode), _u(k0), _u(k1),
                  np.float64(a), np.float64(lr), np.float64(g), np.float64(wd), dk0, dk1, dgs,
                  np.int32(dgs.size), np.int32(bool(post)), _u(pk0), _u(pk1), np.float64(pa),
                  np.int32(dist)))


# ----------------------------------------------------------------------------- numba.cuda backend
def restore_row_stack() -> bool:
    """Give NumPy back ``np.row_stack`` (an alias of ``np.vstack``) where it lacks it; True if
    it was missing.

    numba-cuda registers an overload of ``np.row_stack`` while it compiles its first kernel
    (``numba/cuda/np/arrayobj.py``); NumPy 2.5 removed that alias (deprecated since 2.0), so on
    the GPU image (numpy 2.5.2, numba 0.68.0 with numba-cuda) every numba.cuda launch raised
    ``AttributeError: module 'numpy' has no attribute 'row_stack'`` (first GPU run of the kit,
    2026-11-27). The alias is ``np.vstack`` under its old name; nothing else changes."""
    if hasattr(np, "row_stack"):
        return False
    np.row_stack = np.vstack
    return True


class _NumbaCuda:
    """numba.cuda kernels compiled from rng.py's device functions (see numba_cuda_kernels)."""

    def __init__(self, threads_per_block: int) -> None:
        global cuda
        restore_row_stack()
        from numba import cuda  # a module global: the simulator swaps it in kernel globals
        self.cuda = cuda
        self.tpb = threads_per_block
        dev = build_device_functions(lambda f: cuda.jit(device=True)(f))
        gauss_at = dev["gauss_at"]
        rad_at = dev["rad_at"]
        fast_at = dev["fast_at"]
        self._tab = None

        @cuda.jit(device=True)
        def z_at(e, t, k0, k1, dist, tab):
            if dist == 0:
                return gauss_at(e, t, k0, k1)
            if dist == 1:
                return rad_at(e, t, k0, k1)
            return fast_at(e, t, k0, k1, tab)

        @cuda.jit(device=True)
        def rounded(v, rnd32):
            # float32 and float16 storage: round once to float32 (float16: then to float16)
            return np.float64(np.float32(v)) if rnd32 else v

        @cuda.jit
        def k_zvec(out, e0, t, k0, k1, dist, tab):
            for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
                out[i] = np.float32(z_at(e0 + np.uint64(i), t, k0, k1, dist, tab))

        @cuda.jit
        def k_perturb(p, off, t, k0, k1, dist, scale, rnd32, tab):
            for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
                z = z_at(off + np.uint64(i), t, k0, k1, dist, tab)
                p[i] = rounded(np.float64(p[i]) + scale * z, rnd32)

        @cuda.jit
        def k_restore_update(p, off, t, k0, k1, dist, eps, lr, g, wd, rnd32, tab):
            for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
                z = z_at(off + np.uint64(i), t, k0, k1, dist, tab)
                pr = np.float64(p[i]) + eps * z
                p[i] = rounded(pr - lr * (g * z + wd * pr), rnd32)

        @cuda.jit
        def k_multi_update(p, off, t, k0s, k1s, gs, lr, wd, restore, rk0, rk1, eps, dist,
                           rnd32, tab):
            for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
                e = off + np.uint64(i)
                acc = 0.0
                for k in range(gs.size):
                    acc = acc + gs[k] * z_at(e, t, k0s[k], k1s[k], dist, tab)
                pr = np.float64(p[i])
                if restore:
                    pr = pr + eps * z_at(e, t, rk0, rk1, dist, tab)
                p[i] = rounded(pr - lr * (acc + wd * pr), rnd32)

        self.k_zvec, self.k_perturb = k_zvec, k_perturb
        self.k_restore_update, self.k_multi_update = k_restore_update, k_multi_update

    def tab(self):
        """FAST_TABLE on the device (copied once)."""
        if self._tab is None:
            self._tab = self.cuda.to_device(rng.fast_table())
        return self._tab

    def _cfg(self, n: int):
        blocks = max(1, min(MAX_BLOCKS, -(-n // self.tpb)))
        return blocks, self.tpb

    def _stream(self, p):
        """numba stream matching cupy's current stream for cupy arrays, else the default."""
        if type(p).__module__.startswith("cupy"):
            import cupy  # GPU only
            return self.cuda.external_stream(cupy.cuda.get_current_stream().ptr)
        return 0

    @staticmethod
    def _rnd32(p) -> bool:
        if np.dtype(p.dtype) == np.dtype(np.uint16):
            raise TypeError("bfloat16 storage (uint16 bits) has no numba.cuda ZO kernel: "
                            "unset SEMZO_ZO_GPU_BACKEND to use the CuPy kernels")
        return np.dtype(p.dtype) != np.dtype(np.float64)

    def zvec(self, out, e0, t, k0, k1, dist):
        b, tpb = self._cfg(out.size)
        self.k_zvec[b, tpb, self._stream(out)](out, _u(e0), _u(t), _u(k0), _u(k1), int(dist),
                                                self.tab())

    def perturb(self, p, off, t, k0, k1, dist, scale):
        b, tpb = self._cfg(p.size)
        self.k_perturb[b, tpb, self._stream(p)](p, _u(off), _u(t), _u(k0), _u(k1), int(dist),
                                                float(scale), self._rnd32(p), self.tab())

    def restore_update(self, p, off, t, k0, k1, dist, eps, lr, g, wd):
        b, tpb = self._cfg(p.size)
        self.k_restore_update[b, tpb, self._stream(p)](
            p, _u(off), _u(t), _u(k0), _u(k1), int(dist), float(eps), float(lr), float(g),
            float(wd), self._rnd32(p), self.tab())

    def multi_update(self, p, off, t, k0s, k1s, gs, lr, wd, restore, rk0, rk1, eps, dist):
        b, tpb = self._cfg(p.size)
        self.k_multi_update[b, tpb, self._stream(p)](
            p, _u(off), _u(t), np.asarray(k0s, np.uint64), np.asarray(k1s, np.uint64),
            np.asarray(gs, np.float64), float(lr), float(wd), bool(restore), _u(rk0), _u(rk1),
            float(eps), int(dist), self._rnd32(p), self.tab())


@functools.cache
def numba_cuda_kernels(threads_per_block: int = THREADS_PER_BLOCK) -> _NumbaCuda:
    """The numba.cuda kernels (compiled lazily on first launch; works under the simulator)."""
    return _NumbaCuda(threads_per_block)


__all__ = ["THREADS_PER_BLOCK", "cuda_source", "multi_update", "numba_cuda_kernels", "perturb",
           "restore_row_stack", "restore_update", "stream_pass", "zvec"]
