"""Array backends: NumPy on CPU, CuPy on GPU (imported only when a GPU is asked for)."""

from __future__ import annotations

import functools
import os
import sys
import warnings
from types import ModuleType

import numba
import numpy as np
from threadpoolctl import threadpool_limits


def device_module(device: str) -> ModuleType:
    """The array module for ``device`` (``cpu`` -> numpy, ``gpu`` -> cupy)."""
    if device == "cpu":
        return np
    import cupy  # only when a GPU is asked for: CPU machines never need CuPy

    return cupy


def array_module(a: object) -> ModuleType:
    """numpy or cupy, whichever owns ``a``: the one answer to "NumPy or CuPy?" in semzo.

    It sits in the forward pass's hot path, so a NumPy array returns at the first test, and
    cupy is never imported here: a cupy array can only exist once cupy has been imported."""
    if isinstance(a, np.ndarray):
        return np
    cp = sys.modules.get("cupy")
    if cp is not None and isinstance(a, cp.ndarray):
        return cp
    return np


def is_device_array(a: object) -> bool:
    """True for a CuPy array (the arrays that live on a GPU)."""
    return array_module(a) is not np


def synchronize(a: object) -> None:
    """Wait for the current CUDA stream, so a GPU buffer is complete before MPI reads it."""
    if is_device_array(a):
        import cupy  # a device array exists: cupy is loaded

        cupy.cuda.get_current_stream().synchronize()


def gpu_fused_enabled() -> bool:
    """Whether semzo's own CUDA kernels are asked for (``SEMZO_GPU_FUSED``, default on): the
    fused forward kernels (:mod:`semzo.model.kernels_gpu`) and the k-means E-step's
    (:mod:`semzo.cluster.kernels_cuda`). Off, the generic CuPy array code serves (the A/B)."""
    return os.environ.get("SEMZO_GPU_FUSED", "1").strip().lower() not in ("0", "false", "no",
                                                                          "off")


def gpu_kernels(compiled, failed: dict, what: str, instead: str):
    """``compiled(device_id)`` (a cached compile of semzo's CUDA kernels for the current
    device), or None when they are turned off (:func:`gpu_fused_enabled`) or did not compile
    on this device: the failure is kept in ``failed`` (device id -> message) and warned once,
    naming ``what`` failed and what serves ``instead``."""
    if not gpu_fused_enabled():
        return None
    import cupy  # GPU only: a device array exists

    dev = cupy.cuda.runtime.getDevice()
    if dev in failed:
        return None
    try:
        return compiled(dev)
    except Exception as exc:  # noqa: BLE001 - any compile failure: the generic code serves
        failed[dev] = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"semzo: {what} did not compile on GPU {dev}; {instead} serves "
                      f"({failed[dev].splitlines()[0][:300]})", RuntimeWarning, stacklevel=4)
        return None


def cuda_aware_mpi() -> bool:
    """Whether MPI may be handed device pointers (``SEMZO_CUDA_AWARE_MPI=1``); else staged."""
    return os.environ.get("SEMZO_CUDA_AWARE_MPI", "0") == "1"


def bind_gpu(local_rank: int, asked: str = "run.device = gpu") -> int:
    """Bind this rank to GPU ``local_rank mod n_gpus`` (one rank per GPU); return its id.

    Raises RuntimeError with one line when CuPy is missing or sees no device: CuPy's
    ``getDeviceCount`` raises (``CUDARuntimeError``: no driver, no device, driver too old for
    the wheel) where one would expect 0. ``asked``: what asked for the GPU, as the message
    names it."""
    try:
        import cupy  # only when a GPU is asked for
    except Exception as exc:  # noqa: BLE001 - ImportError, or a CUDA library that fails to load
        raise RuntimeError(f"{asked} but CuPy does not import ({type(exc).__name__}: "
                           f"{_first_line(exc)}); install the CuPy wheel of the machine's "
                           f"CUDA major (docs/guide.md)") from None
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError without driver or device
        raise RuntimeError(f"{asked} but no GPU is visible ({type(exc).__name__}: "
                           f"{_first_line(exc)})") from None
    if n == 0:
        raise RuntimeError(f"{asked} but no GPU is visible")
    dev = local_rank % n
    cupy.cuda.Device(dev).use()
    return dev


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def set_threads(n: int) -> int:
    """Limit BLAS/OpenMP and numba to ``n`` threads in this process; return ``n``. (The driver
    also has CPU forward passes split each batch into ``n`` row blocks:
    :func:`semzo.model.kernels.set_threads`.)"""
    threadpool_limits(limits=n)
    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    return n


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo; "unknown" elsewhere): benchmarks print it, since
    ratios differ between CPU makers."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


@functools.lru_cache(maxsize=4)
def _sgemm_operands(m: int, k: int, n: int):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((m, k), dtype=np.float32),
            rng.standard_normal((n, k), dtype=np.float32), np.empty((m, n), dtype=np.float32))


def sgemm_rate(m: int, k: int, n: int, reps: int = 20) -> float:
    """GFLOP/s of NumPy float32 (m, k) @ (k, n) with a transposed (n, k) weight, best of
    ``reps``: the machine's matrix-multiply limit the benchmarks compare against. The operands
    are made once per shape, so a benchmark can sample the rate between its timed calls
    (``bench/decoder.py`` does: on a shared host the rate moves by a third within minutes)."""
    import time
    a, w, out = _sgemm_operands(m, k, n)
    np.matmul(a, w.T, out=out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.matmul(a, w.T, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9
