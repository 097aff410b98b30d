"""Array backends: NumPy on CPU, CuPy on GPU (imported only when a GPU is asked for)."""

from __future__ import annotations

import os
from types import ModuleType

import numpy as np


def get_xp(device: str) -> ModuleType:
    """The array module for ``device`` (``cpu`` -> numpy, ``gpu`` -> cupy)."""
    if device == "cpu":
        return np
    import cupy  # only when a GPU is asked for: CPU machines never need CuPy

    return cupy


def is_device_array(a: object) -> bool:
    """True for a CuPy (or other ``__cuda_array_interface__``) array."""
    return hasattr(a, "__cuda_array_interface__") and not isinstance(a, np.ndarray)


def array_module(a: object) -> ModuleType:
    """numpy or cupy, whichever owns ``a`` (without importing cupy for numpy arrays)."""
    if is_device_array(a):
        import cupy

        return cupy.get_array_module(a)
    return np


def synchronize(a: object) -> None:
    """Wait for the current CUDA stream, so a GPU buffer is complete before MPI reads it."""
    if is_device_array(a):
        import cupy

        cupy.cuda.get_current_stream().synchronize()


def cuda_aware_mpi() -> bool:
    """Whether MPI may be handed device pointers (``SEMZO_CUDA_AWARE_MPI=1``); else staged."""
    return os.environ.get("SEMZO_CUDA_AWARE_MPI", "0") == "1"


def bind_gpu(local_rank: int) -> int:
    """Bind this rank to GPU ``local_rank mod n_gpus`` (one rank per GPU); return its id."""
    import cupy

    n = cupy.cuda.runtime.getDeviceCount()
    if n == 0:
        raise RuntimeError("run.device = gpu but no GPU is visible")
    dev = local_rank % n
    cupy.cuda.Device(dev).use()
    return dev


def set_threads(n: int) -> int:
    """Limit BLAS/OpenMP and numba to ``n`` threads in this process, and have CPU forward
    passes split each batch into ``n`` row blocks run side by side
    (:func:`semzo.model.kernels.set_threads`: the same bits as one block); return ``n``."""
    from threadpoolctl import threadpool_limits

    from semzo.model.kernels import set_threads as split_forwards

    threadpool_limits(limits=n)
    split_forwards(n)
    try:
        import numba

        numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    except ImportError:  # pragma: no cover - numba is a dependency
        pass
    return n
