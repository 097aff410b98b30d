"""GPU k-means (semzo/cluster/gpu.py) against the CPU path: labels, centres, counts and
inertia at 1 and 2 ranks sharing the GPU (tests/mpi/kmeans_gpu.py), and ``predict``.

Without a GPU, ``test_gpu_estep_logic_on_cpu`` runs cluster/gpu.py itself on NumPy through a
stand-in ``cupy`` module (NumPy functions, ``cupyx.scatter_add`` = ``np.add.at``): the
module's arithmetic is checked against the CPU path although no GPU is here.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from mpiutil import ROOT, check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import cupy_or_none, gpu_skip, host
from kmeans_gpu import planted, same_partition

import semzo.cluster as cluster_pkg

km = importlib.import_module("semzo.cluster.kmeans")   # the module (the package exports a function)

SCRIPT = str(ROOT / "tests" / "mpi" / "kmeans_gpu.py")
ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@gpu_skip()
@pytest.mark.parametrize("nranks", [1, 2])
def test_gpu_kmeans_mpi(nranks):
    proc = check(mpirun(nranks, [SCRIPT, "cupy"], timeout=240, env=ENV))
    assert f"ok: kmeans on cupy, {nranks} ranks" in proc.stdout


@gpu_skip()
@pytest.mark.parametrize("spherical", [False, True])
def test_gpu_predict_equals_cpu(spherical):
    cp = cupy_or_none()
    x, _ = planted(n=5000, d=32, k=8)
    if spherical:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    c = x[:8].copy()
    got = host(km.predict(cp.asarray(x), c, spherical=spherical, block_rows=700))
    assert np.array_equal(got, km.predict(x, c, spherical=spherical, block_rows=700))


def test_kmeans_script_on_cpu():
    proc = check(mpirun(2, [SCRIPT, "numpy"], timeout=180, env=ENV))
    assert "ok: kmeans on numpy, 2 ranks" in proc.stdout


class _Dev(np.ndarray):
    """Marks an array as 'on the device' for the stand-in run below."""


def _shim_gpu_module():
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.asnumpy = lambda a: np.array(a)
    fakex = types.ModuleType("cupyx")
    fakex.scatter_add = np.add.at
    saved = {k: sys.modules.get(k) for k in ("cupy", "cupyx")}
    sys.modules["cupy"], sys.modules["cupyx"] = fake, fakex
    try:
        spec = importlib.util.spec_from_file_location(
            "semzo.cluster.gpu", Path(cluster_pkg.__file__).parent / "gpu.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return mod


@pytest.mark.parametrize("spherical", [False, True])
def test_gpu_estep_logic_on_cpu(monkeypatch, spherical):
    """cluster/gpu.py run on NumPy: the same labels, centres and counts as cluster/cpu.py."""
    from mpi4py import MPI
    gpu = _shim_gpu_module()
    monkeypatch.setitem(sys.modules, "semzo.cluster.gpu", gpu)
    monkeypatch.setattr(cluster_pkg, "gpu", gpu, raising=False)
    monkeypatch.setattr(km, "_is_cupy", lambda a: isinstance(a, _Dev))
    x, truth = planted(n=2000, d=12, k=5)
    if spherical:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    init = x[[int(np.flatnonzero(truth == c)[0]) for c in range(5)]].copy()
    cpu = km.kmeans(x, 5, MPI.COMM_SELF, global_offset=0, init=init, max_iter=20, tol=0.0,
                    spherical=spherical, block_rows=300)
    dev = km.kmeans(x.view(_Dev), 5, MPI.COMM_SELF, global_offset=0, init=init, max_iter=20,
                    tol=0.0, spherical=spherical, block_rows=300)
    assert np.array_equal(np.asarray(dev.labels), cpu.labels)
    np.testing.assert_allclose(dev.centers, cpu.centers, rtol=1e-5, atol=1e-6)
    assert np.array_equal(dev.counts, cpu.counts)
    assert dev.inertia == pytest.approx(cpu.inertia, rel=1e-6)
    assert same_partition(np.asarray(dev.labels), truth)
    par = km.kmeans(x.view(_Dev), 5, MPI.COMM_SELF, global_offset=0, seed=1, max_iter=30,
                    spherical=spherical, block_rows=300)
    assert same_partition(np.asarray(par.labels), truth)
    got = km.predict(x.view(_Dev), cpu.centers, spherical=spherical, block_rows=300)
    assert np.array_equal(np.asarray(got), km.predict(x, cpu.centers, spherical=spherical))
