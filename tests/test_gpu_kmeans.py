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
def test_gpu_kmeans_rank_without_rows():
    """2 ranks, the second holding no rows: the same labels as the CPU path (cupy 8116)."""
    proc = check(mpirun(2, [SCRIPT, "cupy", "empty"], timeout=240, env=ENV))
    assert "ok: kmeans on cupy, 2 ranks (the last without rows)" in proc.stdout


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


@pytest.mark.parametrize("empty", [False, True])
def test_kmeans_script_on_cpu(empty):
    proc = check(mpirun(2, [SCRIPT, "numpy"] + (["empty"] if empty else []), timeout=180,
                        env=ENV))
    assert "ok: kmeans on numpy, 2 ranks" in proc.stdout
    assert ("(the last without rows)" in proc.stdout) == empty


class _Dev(np.ndarray):
    """Marks an array as 'on the device' for the stand-in run below."""


def _old_cupy_bincount(x, minlength=0):
    """``cp.bincount`` of CuPy releases without the fix for cupy issue 8116."""
    if x.size == 0:
        raise ValueError("bincount of an empty array (cupy issue 8116)")
    return np.bincount(x, minlength=minlength)


def _shim_gpu_module():
    """cluster/gpu.py loaded against a stand-in ``cupy`` (NumPy, with the old bincount that
    raises on an empty array) and no ``cupyx`` at all (scatter_add is deprecated)."""
    fake = types.ModuleType("cupy")
    fake.__getattr__ = lambda name: getattr(np, name)
    fake.asnumpy = lambda a: np.array(a)
    fake.bincount = _old_cupy_bincount
    saved = {k: sys.modules.get(k) for k in ("cupy", "cupyx")}
    sys.modules["cupy"] = fake
    sys.modules["cupyx"] = None        # import cupyx raises: cluster/gpu.py must not need it
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


def _estep_without_rows(gpu, xp) -> None:
    """A rank that holds no rows: E-step, exact cost and predict give empty labels and zero
    counts (cluster/gpu.py on ``xp``)."""
    data = gpu.LocalData(xp.zeros((0, 4), dtype=xp.float32), 100, 3)
    a = gpu.LloydGPU(data, 3, False)
    centers = np.eye(3, 4, dtype=np.float32)
    sums, counts = np.zeros((3, 4)), np.zeros(3)
    changed, inertia, n = a.estep(centers, sums, counts, True)
    assert (changed, inertia, n) == (0, 0.0, 0)
    assert not sums.any() and not counts.any()
    fin = np.zeros(3)
    e2, cost = data.exact_cost(a.labels, centers, fin, False)
    assert e2.shape == (0,) and cost == 0.0 and not fin.any()
    assert host(gpu.predict(xp.zeros((0, 4), dtype=xp.float32), centers, False, 100)).shape \
        == (0,)


def test_gpu_estep_without_rows_on_cpu():
    _estep_without_rows(_shim_gpu_module(), np)


@gpu_skip()
def test_gpu_estep_without_rows():
    from semzo.cluster import gpu
    _estep_without_rows(gpu, cupy_or_none())


class _Recorder:
    """An allreduce that records its calls (and sums nothing: one rank)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, buf):
        self.calls += 1


def _bad_shape_raises_after_one_collective(x_bad) -> None:
    """A rank whose rows are not 2-D raises the same ValueError as every rank, after the shape
    agreement (one allreduce) and before any other collective: on the GPU it used to raise in
    LocalData while the others waited in allreduce."""
    from mpi4py import MPI
    for fn, kw in ((km.kmeans, {"max_iter": 2}), (km.init_centers, {})):
        rec = _Recorder()
        with pytest.raises(ValueError, match="must be 2-D"):
            fn(x_bad, 3, MPI.COMM_SELF, global_offset=0, allreduce=rec, **kw)
        assert rec.calls == 1, fn.__name__


def test_kmeans_bad_shape_is_collective_on_cpu(monkeypatch):
    x = np.zeros(12, np.float32)
    _bad_shape_raises_after_one_collective(x)                  # the CPU path
    gpu = _shim_gpu_module()
    monkeypatch.setitem(sys.modules, "semzo.cluster.gpu", gpu)
    monkeypatch.setattr(cluster_pkg, "gpu", gpu, raising=False)
    monkeypatch.setattr(km, "_is_cupy", lambda a: isinstance(a, _Dev))
    _bad_shape_raises_after_one_collective(x.view(_Dev))       # the device path, stand-in


@gpu_skip()
def test_gpu_kmeans_bad_shape_is_collective():
    cp = cupy_or_none()
    _bad_shape_raises_after_one_collective(cp.zeros(12, dtype=cp.float32))


@gpu_skip()
def test_gpu_predict_returns_device_labels():
    """``predict``'s contract: labels where the rows live (a CuPy array for CuPy rows)."""
    from semzo.backend import array_module
    cp = cupy_or_none()
    x, _ = planted(n=500, d=8, k=4)
    lab = km.predict(cp.asarray(x), x[:4].copy(), block_rows=100)
    assert array_module(lab) is cp and lab.dtype == cp.int32 and lab.shape == (500,)
