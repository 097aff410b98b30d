"""Helpers of the GPU tests (tests/test_gpu_*.py and the MPI scripts tests/mpi/*gpu*.py).

``GPU_REASON`` is None when CuPy imports and sees a CUDA device, else why not; the GPU tests
are skipped with that reason and only then. Every comparison helper here takes the array
module of each side, so the CPU proofs run the same code with numpy on both sides.
"""

from __future__ import annotations

import numpy as np


def _gpu_reason() -> str | None:
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        if n < 1:
            return "cupy sees no CUDA device"
        cupy.zeros(1).sum()                      # a kernel really runs
        return None
    except Exception as exc:  # noqa: BLE001 - any failure to reach a GPU means: skip
        return f"cupy with a CUDA device is not available ({type(exc).__name__}: {exc})"


GPU_REASON = _gpu_reason()


def gpu_skip():
    """``pytest.mark.skipif`` for the GPU tests, with the reason."""
    import pytest
    return pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU-only: {GPU_REASON}")


def cupy_or_none():
    if GPU_REASON is not None:
        return None
    import cupy
    return cupy


def host(a) -> np.ndarray:
    """A numpy copy of a numpy or cupy array."""
    return a.get() if hasattr(a, "get") else np.asarray(a)


def rel_err(got, ref, valid=None) -> float:
    """max |got - ref| / max |ref| over ``valid`` (all if None), both taken to the host."""
    g = host(got).astype(np.float64)
    r = host(ref).astype(np.float64)
    if valid is not None:
        g, r = g[valid], r[valid]
    return float(np.max(np.abs(g - r)) / max(np.max(np.abs(r)), 1e-30))


def mpi_cuda_aware() -> tuple[bool, str]:
    """(whether the MPI library takes device pointers, why): MPIX_Query_cuda_support through
    mpi4py where the library has it, else ``ompi_info``'s build flag."""
    import shutil
    import subprocess
    try:
        from mpi4py import MPI
    except Exception as exc:  # noqa: BLE001
        return False, f"mpi4py does not load ({exc})"
    q = getattr(MPI, "Query_cuda_support", None)
    try:
        ok = bool(q()) if q is not None else None
    except Exception:  # noqa: BLE001 - the library lacks the MPIX extension
        ok = None
    if ok is not None:
        return ok, f"MPIX_Query_cuda_support() = {int(ok)} ({MPI.Get_library_version()[:40]})"
    if shutil.which("ompi_info"):
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
        for line in out.splitlines():
            if "mpi_built_with_cuda_support:value" in line:
                ok = line.strip().endswith("true")
                return ok, f"ompi_info: {line.strip()}"
    return False, "the MPI library does not say it is CUDA-aware"


def count_fused_launches(monkeypatch) -> list:
    """Record every launch of the fused forward kernels (semzo.model.kernels_gpu), the
    elementwise ones, the row kernels and the warp kernels, in the returned list (one entry, the kernel's
    name, per launch); SEMZO_GPU_FUSED set on."""
    from semzo.model import kernels_gpu
    launched: list = []

    def name_of(fn) -> str:
        k = kernels_gpu._kernels()
        return next((n for n, f in (k[1].items() if k else ()) if f is fn), "?")

    for attr in ("_launch", "_launch_rows", "_launch_warps"):
        real = getattr(kernels_gpu, attr)

        def counted(fn, *rest, _real=real):
            launched.append(name_of(fn))
            return _real(fn, *rest)

        monkeypatch.setattr(kernels_gpu, attr, counted)
    monkeypatch.setenv("SEMZO_GPU_FUSED", "1")
    return launched
