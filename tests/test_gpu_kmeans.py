"""GPU k-means (semzo/cluster/gpu.py) against the CPU path: labels, centres, counts and
inertia at 1 and 2 ranks sharing the GPU (tests/mpi/kmeans_gpu.py), and ``predict``.

Without a GPU, ``test_gpu_estep_logic_on_cpu`` runs cluster/gpu.py itself on NumPy through a
stand-in ``cupy`` module (NumPy functions), both E-steps: the generic one (CuPy array code) and
the one with our kernels, whose launches run the kernels' CUDA C source built by gcc as plain
C (cluster/kernels_cuda.py); the C build is also compared with the numba kernels of the CPU
path bit for bit. The module's arithmetic is checked against the CPU path although no GPU is
here.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from cbuild import build_c, check_launch, ptx_params
from mpiutil import ROOT, check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import cupy_or_none, gpu_skip, host
from kmeans_gpu import planted, same_partition

import semzo.cluster as cluster_pkg
from semzo.cluster import kernels as kn
from semzo.cluster import kernels_cuda

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


P, LL, I = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int


@pytest.fixture(scope="module")
def km_lib(tmp_path_factory) -> ctypes.CDLL:
    """cluster/kernels_cuda.py's CUDA C source built by gcc as plain C."""
    lib = build_c(kernels_cuda.cuda_source(), tmp_path_factory.mktemp("kmgpu"), "km")
    lib.km_argmin.argtypes = [P, P, LL, I, P, P, P]
    lib.km_cluster_sums.argtypes = [P, P, P, P, I, I, P]
    lib.km_update_nearest.argtypes = [P, P, P, LL, I, P, P, I]
    return lib


#: each kernel's parameters as the CUDA source declares them (pointers and values): a launch
#: must pass exactly these dtypes, or the device reads its bytes as another type
SIGNATURES = {
    "km_argmin": ("float32", "float32", "int64", "int32", "int32", "float32", "uint64"),
    "km_cluster_sums": ("float32", "int64", "int64", "int64", "int32", "int32", "float64"),
    "km_update_nearest": ("float32", "float32", "float64", "int64", "int32", "float64",
                          "int32", "int32"),
}


def test_signatures_are_the_sources():
    """SIGNATURES (what the launches are checked against) spells the CUDA source's."""
    ctype = {"float": "float32", "double": "float64", "int": "int32", "long long": "int64",
             "unsigned long long": "uint64"}
    src = kernels_cuda.cuda_source()
    for name, want in SIGNATURES.items():
        params = src.split(f"KM_GLOBAL {name}(")[1].split(")")[0]
        got = tuple(ctype[" ".join(p.replace("const", "").replace("*", " ").split()[:-1])]
                    for p in params.split(","))
        assert got == want, name


@functools.cache
def _km_ptx() -> dict:
    return ptx_params(kernels_cuda.cuda_source())


def _c_kernels(lib) -> dict:
    """kernels_cuda.kernels() on the CPU: each launch runs the C build (serially) with the
    launch's arguments (NumPy arrays as pointers, NumPy scalars as values), each checked
    against the kernel's parameter types."""
    def fake(name):
        def launch(grid, block, args):
            assert grid[0] >= 1 and block[0] == kernels_cuda.THREADS_PER_BLOCK
            assert len(args) == len(SIGNATURES[name]), name
            check_launch(_km_ptx(), name, args)          # sizes as CuPy packs them
            c_args = []
            for a, want in zip(args, SIGNATURES[name]):
                assert a.dtype == np.dtype(want), (name, a.dtype, want)
                if isinstance(a, np.ndarray):
                    assert a.flags.c_contiguous, name
                    c_args.append(a.ctypes.data)
                else:
                    assert isinstance(a, np.generic), (name, type(a))  # typed scalars only
                    c_args.append(a.item())
            getattr(lib, name)(*c_args)
        return launch
    return {n: fake(n) for n in kernels_cuda.KERNELS}


def _awkward_scores(rng, k, b) -> tuple[np.ndarray, np.ndarray]:
    """(dT (k, b), c_sq (k,)) float32 with exact ties, NaN, infinities, signed zeros and
    subnormals among ordinary values."""
    d_t = rng.standard_normal((k, b)).astype(np.float32)
    c_sq = np.abs(rng.standard_normal(k)).astype(np.float32)
    d_t[:, 0] = 0.5                                      # every centre ties
    c_sq[3] = c_sq[1]
    d_t[3, 1] = d_t[1, 1] = 9.0                          # a tie between centres 1 and 3
    d_t[:, 2] = np.nan                                   # a row of NaN scores
    d_t[0, 3] = np.nan                                   # NaN first, then ordinary values
    d_t[2, 4] = np.inf
    d_t[1, 5], d_t[4, 5] = -np.inf, -np.inf
    d_t[:, 6] = np.float32(1e-45) * rng.integers(-3, 4, k)  # subnormal scores
    c_sq[5] = 0.0
    d_t[:, 7] = -0.0
    return d_t, c_sq


@pytest.mark.parametrize("k,b", [(1, 9), (7, 8), (33, 301)])
def test_argmin_kernel_is_the_numba_argmin_on_cpu(km_lib, k, b):
    rng = np.random.default_rng(k * 1000 + b)
    d_t, c_sq = _awkward_scores(rng, max(k, 6), b)
    d_t, c_sq = np.ascontiguousarray(d_t[:k]), np.ascontiguousarray(c_sq[:k])
    best, bj = np.empty(b, np.float32), np.empty(b, np.int32)
    kn.argmin_cols(d_t, c_sq, best, bj)
    old = rng.integers(-1, k, b).astype(np.int32)
    labels, got_best = old.copy(), np.full(b, 7.0, np.float32)
    changed = np.zeros(1, np.uint64)
    km_lib.km_argmin(d_t.ctypes.data, c_sq.ctypes.data, b, k, labels.ctypes.data,
                     got_best.ctypes.data, changed.ctypes.data)
    assert np.array_equal(labels, bj)
    assert np.array_equal(got_best.view(np.uint32), best.view(np.uint32))
    assert int(changed[0]) == int((old != bj).sum())
    if k > 1:
        assert labels[2] == 0 and got_best[2] == np.inf     # NaN never wins
        assert labels[1] in (1, 3) and labels[1] == bj[1]    # the first of a tie


@pytest.mark.parametrize("m,b,base", [(1, 9, 0), (6, 8, 3), (40, 301, 17)])
def test_update_nearest_kernel_is_the_numba_fold_on_cpu(km_lib, m, b, base):
    """k-means||'s fold of a candidate batch: the numba kernel's d2 and nearest bit for bit,
    with distances that clamp to zero (-0.0 to +0.0; two candidates tie at 0: the earlier
    keeps it, where an argmin of the scores would take the lower score), NaN, infinities,
    rows already nearer than every candidate."""
    rng = np.random.default_rng(m * 100 + b)
    d_t, b_sq = _awkward_scores(rng, max(m, 6), b)
    d_t, b_sq = np.ascontiguousarray(d_t[:m]), np.ascontiguousarray(b_sq[:m])
    x_sq = np.abs(rng.standard_normal(b)) * 4.0
    x_sq[8 % b] = np.nan
    if m > 2 and b > 9:
        x_sq[9] = 1.0
        d_t[0, 9], d_t[2, 9], b_sq[0], b_sq[2] = 3.0, 5.0, 1.0, 1.0   # both clamp to 0
    d2 = np.where(rng.random(b) < 0.3, rng.random(b) * 0.01, np.inf)
    if m > 5 and b > 7:         # -0.0 + -0.0 clamps to +0.0
        b_sq[5], d_t[5, 7], x_sq[7], d2[7] = -0.0, 0.0, -0.0, np.inf
    near = rng.integers(0, 5, b).astype(np.int32)
    want_d2, want_near = d2.copy(), near.copy()
    kn.update_nearest(d_t, b_sq, x_sq, want_d2, want_near, base)
    got_d2, got_near = d2.copy(), near.copy()
    km_lib.km_update_nearest(d_t.ctypes.data, b_sq.ctypes.data, x_sq.ctypes.data, b, m,
                             got_d2.ctypes.data, got_near.ctypes.data, base)
    assert np.array_equal(got_d2.view(np.uint64), want_d2.view(np.uint64))
    assert np.array_equal(got_near, want_near)
    if m > 2 and b > 9:
        assert got_near[9] == base and got_d2[9] == 0.0


@pytest.mark.parametrize("n,d,k", [(0, 3, 2), (1, 5, 1), (13, 3, 4), (1000, 17, 9)])
def test_cluster_sums_kernel_is_accumulate_rows_on_cpu(km_lib, n, d, k):
    """Every cluster's rows summed in row order from a sort of the labels (as gpu.py sorts
    them): the CPU's float64 sums bit for bit, empty clusters included, with values whose
    sum depends on the order (mixed magnitudes, subnormals, signed zeros)."""
    rng = np.random.default_rng(n + d + k)
    x = (rng.standard_normal((n, d)) * 10.0 ** rng.integers(-30, 30, (n, d))).astype(np.float32)
    if n > 3:
        x[1, 0], x[2, 0], x[3, :] = np.float32(1e-44), -0.0, -0.0
    labels = rng.integers(0, max(1, k - 1), n).astype(np.int32)   # the last cluster empty
    want_s, want_c = np.zeros((k, d)), np.zeros(k)
    kn.accumulate_rows(x, labels, want_s, want_c)
    cnt = np.bincount(labels, minlength=k).astype(np.int64)
    start = np.ascontiguousarray(np.cumsum(cnt) - cnt)
    order = np.argsort(labels.astype(np.int64) * n + np.arange(n))
    got = np.full((k, d), np.nan)
    km_lib.km_cluster_sums(x.ctypes.data, order.ctypes.data, start.ctypes.data,
                           cnt.ctypes.data, k, d, got.ctypes.data)
    assert np.array_equal(got.view(np.uint64), want_s.view(np.uint64))
    assert np.array_equal(cnt.astype(np.float64), want_c)


@pytest.mark.parametrize("kernels", ["generic", "ours"])
@pytest.mark.parametrize("spherical", [False, True])
def test_gpu_estep_logic_on_cpu(monkeypatch, km_lib, spherical, kernels):
    """cluster/gpu.py run on NumPy: the same labels, centres and counts as cluster/cpu.py;
    with our kernels (their C build) the centres bit for bit."""
    from mpi4py import MPI
    gpu = _shim_gpu_module()
    monkeypatch.setattr(kernels_cuda, "kernels",
                        (lambda: _c_kernels(km_lib)) if kernels == "ours" else (lambda: None))
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
    if kernels == "ours":
        assert np.array_equal(dev.centers, cpu.centers)
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


@pytest.mark.parametrize("kernels", ["generic", "ours"])
def test_gpu_estep_without_rows_on_cpu(monkeypatch, km_lib, kernels):
    monkeypatch.setattr(kernels_cuda, "kernels",
                        (lambda: _c_kernels(km_lib)) if kernels == "ours" else (lambda: None))
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
