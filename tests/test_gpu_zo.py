"""GPU: the ZO kernels (CuPy RawModule, and numba.cuda) against the CPU kernels bit for bit,
the ZO engine on CuPy against NumPy (was the manual script tests/mpi/zo_gpu_check.py), and
the three parallel modes at 1 and 2 ranks sharing the GPU (tests/mpi/zo_gpu_modes.py).

GPU cases are skipped only when CuPy or a GPU is absent. The ``*_on_cpu`` cases run the same
harnesses with NumPy on both sides, so the test code itself is proven without a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
from mpiutil import ROOT, check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import cupy_or_none, gpu_skip, host
from zo_common import SoloTopo, corpus, make_model

from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.model.storage import to_bits, to_float32
from semzo.tasks.base import pad_batch
from semzo.tasks.classify import FeatureClassifyTask
from semzo.zo import perturb as P
from semzo.zo.engine import ZOEngine, param_checksum
from semzo.zo.perturb import ztensors

BF16 = np.uint16        # bfloat16 storage: uint16 arrays of bfloat16 bits (a model's params)

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
SIZES = (1, 255, 256, 4097, 70_001)          # grid-stride edges and a tail
SUBNORMAL = {"float32": [1e-40, -2.5e-39, 1.4e-45, -1e-38],
             "float64": [1e-310, -2.5e-309, 5e-324, -1e-308],
             "float16": [6e-8, -3e-6, 1e-5, -6e-5]}


def kernel_case(xp, dtype, dist: str, seed: int = 3) -> dict[str, np.ndarray]:
    """Every pass of perturb.py on tensors of ``xp`` (several sizes, offsets): host copies."""
    r = np.random.default_rng(seed)
    base = [(t, to_bits(r.normal(0, 1, n).astype(np.float32)) if dtype == BF16 else
             r.normal(0, 1, n).astype(dtype)) for t, n in enumerate(SIZES)]
    for _, a in base:            # subnormals: a GPU flushing them (CuPy's -ftz=true) differs
        if a.size >= 4:
            a[:4] = (np.array([0x0001, 0x8003, 0x0040, 0x807F], np.uint16) if dtype == BF16
                     else np.array(SUBNORMAL[np.dtype(dtype).name], dtype))
    out = {}
    arrs = [P.ZTensor(t, xp.asarray(a.copy()), offset=17 * t, decay=t % 2 == 0)
            for t, a in base]
    P.multi_update(arrs, [11], [0.0], 1e-2, 0.05, dist=dist)     # decay only: they stay tiny
    out["decay_only"] = [host(z.array).copy() for z in arrs]
    P.perturb(arrs, 12345, 1e-3, dist=dist)
    out["perturb"] = [host(z.array).copy() for z in arrs]
    P.restore_update(arrs, 12345, 1e-3, 1e-2, 0.7, 0.05, dist=dist)
    out["restore_update"] = [host(z.array).copy() for z in arrs]
    P.multi_update(arrs, [7, 8, 2**63 + 5], [0.5, -1.25, 3.0], 1e-2, 0.05, eps=1e-3,
                   restore_seed=7, dist=dist)
    out["multi_update"] = [host(z.array).copy() for z in arrs]
    P.multi_update(arrs, [9], [0.25], 1e-2, 0.0, dist=dist)
    out["multi_update_norestore"] = [host(z.array).copy() for z in arrs]
    # the streamed schedule's fused first pass: the pending update, then + eps z of the next seed
    P.apply_then_perturb(arrs, P.Pending("restore_update", 9, 1e-3, 1e-2, -0.4, 0.05), 4242,
                         1e-3, dist=dist)
    out["apply_then_perturb"] = [host(z.array).copy() for z in arrs]
    return out


def check_kernels(xp, dtype, dist, exact: bool) -> None:
    ref = kernel_case(np, dtype, dist)
    got = kernel_case(xp, dtype, dist)
    for k in ref:
        for t, (a, b) in enumerate(zip(got[k], ref[k])):
            assert a.dtype == b.dtype and a.shape == b.shape
            if exact:
                assert a.tobytes() == b.tobytes(), f"{k} tensor {t} ({dtype}, {dist}) differs"
            else:   # numba.cuda may contract multiply-adds: about one float32 ulp of z,
                # which can move a stored float16 by one float16 ulp
                tol = 1e-3 if np.dtype(dtype) == np.float16 else 1e-5
                np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64),
                                           rtol=tol, atol=tol / 10, err_msg=f"{k} tensor {t}")
        assert any(not np.array_equal(x, y) for x, y in zip(ref[k], kernel_case(
            np, dtype, dist, seed=4)[k])), "the inputs must matter"


@gpu_skip()
@pytest.mark.parametrize("dist", ["gaussian", "rademacher", "gaussian-fast"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
def test_gpu_kernels_cupy_bits_equal_cpu(dtype, dist, monkeypatch):
    monkeypatch.setenv("SEMZO_ZO_GPU_BACKEND", "cupy")
    check_kernels(cupy_or_none(), dtype, dist, exact=True)


@gpu_skip()
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gpu_kernels_numba_cuda_close_to_cpu(dtype, monkeypatch):
    monkeypatch.setenv("SEMZO_ZO_GPU_BACKEND", "numba")
    check_kernels(cupy_or_none(), dtype, "gaussian", exact=False)


@gpu_skip()
def test_gpu_zvec_equals_cpu():
    from semzo import rng
    from semzo.zo import kernels_gpu
    cp = cupy_or_none()
    k0, k1 = rng.split_seed(99)
    for dist in (0, 1):
        out = cp.empty(100_003, cp.float32)
        kernels_gpu.zvec(out, 5, 3, k0, k1, dist)
        name = "gaussian" if dist == 0 else "rademacher"
        assert host(out).tobytes() == P.zvec(99, 3, 5, 100_003, name).tobytes()


@gpu_skip()
def test_gpu_param_checksum_equals_cpu():
    """The replica checksum's exact words on the device equal the host's (sums left on the
    device, one chunk boundary crossed, several storages)."""
    cp = cupy_or_none()
    r = np.random.default_rng(0)
    ts = [(f"t{i}.weight", r.normal(size=n).astype(dt)) for i, (n, dt) in
          enumerate([(3, np.float32), ((1 << 20) + 5, np.float32), (77, np.float64),
                     (1000, np.float16)])]
    a = param_checksum(ztensors(ts))
    b = param_checksum(ztensors([(n, cp.asarray(x)) for n, x in ts]))
    assert a[:2].tolist() == b[:2].tolist()
    fa, fb = a[2:].view(np.float64)[0], b[2:].view(np.float64)[0]
    assert abs(fa - fb) <= 1e-9 * max(1.0, abs(fa))


@pytest.mark.parametrize("dtype,dist", [(np.float32, "gaussian"), (BF16, "gaussian"),
                                        (np.float32, "gaussian-fast")])
def test_kernel_harness_on_cpu(dtype, dist):
    """The harness with NumPy on both sides, exact (and the inputs matter)."""
    check_kernels(np, dtype, dist, exact=True)


@gpu_skip()
def test_gpu_streamed_schedule_and_host_offload(tmp_path):
    """tests/mpi/zo_streamed_gpu_check.py: on the device the streamed step equals the
    three-pass step, the offloaded step (parameters loaded into pinned host memory, copy and
    write-back streams) equals both, and so does its stage-streamed evaluation."""
    import zo_streamed_gpu_check

    zo_streamed_gpu_check.check(tmp_path)


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gpu_zo") / "bert")


def run_engine(folder, xp, dtype="float32", params="all", steps=5, estimator="mezo"):
    m = load_model(folder, xp=xp, dtype=dtype)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, params, lora_rank=2)
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(64)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                   weight_decay=0.01, estimator=estimator, directions=3)
    losses = []
    for s in range(steps):
        rows = recs[8 * s:8 * s + 8]
        ids, mask = pad_batch(tok.encode_batch([r["text"] for r in rows]), 0)
        lab = np.array([int(r["label"][-1]) for r in rows])
        res = eng.step(lambda ids=ids, mask=mask, lab=lab: m.classify(ids, mask, lab)[0], s,
                       1e-2, 8)
        assert res.ok, (xp.__name__, dtype, s)
        losses.append(res.loss)
    return {n: host(m.params[n]) for n in names}, losses, param_checksum(eng.tensors)


def check_engine(xp, folder, dtype: str = "float32", steps: int = 5,
                 estimator: str = "mezo") -> None:
    """The engine on ``xp`` against NumPy, both in ``dtype``. float32: within 1e-4. bfloat16:
    losses within 1e-3 relative, and each tensor's largest difference at most ``steps``
    bfloat16 steps of its largest weight (2**-8 relative each).

    Why no closer bound in bfloat16: the perturbation eps * z is rounded to bfloat16's grid,
    so l+ - l- is a small difference of two losses and g carries the losses' last float32 bits
    (GEMM order) magnified; a g that differs moves every later step. Measured on the CPU
    (NumPy against itself, losses scaled by 1 +- 1e-7, 5 steps): 34 % of the weights differ,
    weights near zero by hundreds of their own steps, the worst tensor by 0.9 % of its largest
    weight (1.7 % at 1e-5); the first GPU runs (2026-11-27) failed a bound of one or five steps
    of each weight's own magnitude. The device's step is checked bit for bit given the same
    losses by ``check_replay`` (test_gpu_engine_bf16_matches_numpy_bf16)."""
    for params in ("all", "lora"):
        a, la, _ = run_engine(folder, np, dtype=dtype, params=params, steps=steps,
                              estimator=estimator)
        b, lb, _ = run_engine(folder, xp, dtype=dtype, params=params, steps=steps,
                              estimator=estimator)
        assert a.keys() == b.keys()
        if dtype == "bfloat16":
            for n in a:
                fa, fb = to_float32(a[n]), to_float32(b[n])
                worst = float(np.max(np.abs(fa - fb)))
                assert worst <= steps * 2.0 ** -8 * float(np.max(np.abs(fb))), (params, n, worst)
            np.testing.assert_allclose(la, lb, rtol=1e-3, atol=1e-5)
        else:
            worst = max(float(np.max(np.abs(a[n] - b[n]))) for n in a)
            assert worst < 1e-4, (params, worst)
            np.testing.assert_allclose(la, lb, rtol=1e-4, atol=1e-5)
        start = run_engine(folder, np, dtype=dtype, params=params, steps=0)[0]
        assert any(not np.array_equal(a[n], start[n]) for n in a), "the steps must move"


@gpu_skip()
def test_gpu_engine_matches_numpy(tiny):
    check_engine(cupy_or_none(), tiny)


@gpu_skip()
def test_gpu_engine_fzoo_matches_numpy(tiny):
    """The fzoo estimator (one-sided directions, the multi-update pass) on the device: never
    run there by a test before (the kernels' bits were)."""
    check_engine(cupy_or_none(), tiny, estimator="fzoo")


@gpu_skip()
def test_gpu_engine_bf16_matches_numpy_bf16(tiny):
    """bfloat16 on CuPy: the CPU step's bits given the same losses (full and LoRA), and within
    check_engine's bound of the CPU run with its own losses."""
    cp = cupy_or_none()
    check_replay(cp, tiny, "bfloat16")
    check_engine(cp, tiny, "bfloat16")


@pytest.mark.parametrize("dtype,estimator", [("float32", "mezo"), ("bfloat16", "mezo"),
                                             ("float32", "fzoo")])
def test_engine_harness_on_cpu(tiny, dtype, estimator):
    check_engine(np, tiny, dtype, estimator=estimator)


def run_recorded(folder, xp, dtype: str, params: str, steps: int = 5):
    """``run_engine``'s steps, recording what the engine was given: (trainable names, their
    starting host copies, the losses each ``loss_fn()`` call returned, the final host
    copies)."""
    m = load_model(folder, xp=xp, dtype=dtype)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, params, lora_rank=2)
    start = {n: host(m.params[n]).copy() for n in names}
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(64)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3,
                   weight_decay=0.01)
    calls: list[float] = []

    def loss_fn(ids, mask, lab):
        v = float(m.classify(ids, mask, lab)[0])
        calls.append(v)
        return v
    for s in range(steps):
        rows = recs[8 * s:8 * s + 8]
        ids, mask = pad_batch(tok.encode_batch([r["text"] for r in rows]), 0)
        lab = np.array([int(r["label"][-1]) for r in rows])
        res = eng.step(lambda ids=ids, mask=mask, lab=lab: loss_fn(ids, mask, lab), s, 1e-2, 8)
        assert res.ok, (xp.__name__, dtype, s)
    return names, start, calls, {n: host(m.params[n]) for n in names}


def replay_on_cpu(names, start, calls, steps: int = 5) -> dict:
    """The CPU reference step of a run recorded by :func:`run_recorded`: the same engine on
    NumPy copies of the starting parameters, given the same losses. The kernels give the same
    bits on both devices (test_gpu_kernels_cupy_bits_equal_cpu), so with the same g the CPU
    step leaves the device's bits; only the forward pass (float16 activations, which NumPy
    has no model for) is not replayed."""
    arrs = {n: start[n].copy() for n in names}
    eng = ZOEngine(ztensors([(n, arrs[n]) for n in names]), SoloTopo(), eps=1e-3,
                   weight_decay=0.01)
    it = iter(calls)
    for s in range(steps):
        assert eng.step(lambda: next(it), s, 1e-2, 8).ok
    assert next(it, None) is None, "the replay used every recorded loss"
    return arrs


def check_replay(xp, folder, dtype: str) -> None:
    """The step on ``xp`` in ``dtype`` equals the CPU reference step bit for bit (full and
    LoRA), and the steps moved the weights."""
    for params in ("all", "lora"):
        names, start, calls, got = run_recorded(folder, xp, dtype, params)
        ref = replay_on_cpu(names, start, calls)
        for n in names:
            assert got[n].dtype == ref[n].dtype == start[n].dtype, (params, n)
            assert got[n].tobytes() == ref[n].tobytes(), (params, dtype, n)
        assert any(not np.array_equal(got[n], start[n]) for n in names), "the steps must move"
        assert all(np.isfinite(calls)), calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_harness_on_cpu(tiny, dtype):
    check_replay(np, tiny, dtype)


@gpu_skip()
def test_gpu_engine_float16_equals_cpu_float16_step(tiny):
    """float16 storage on CuPy (it checked only that the losses were finite and the weights
    moved): the weights after 5 steps equal the CPU float16 step's bits given the same
    losses, full and LoRA; the first loss within 1e-2 of the CPU float32 model's (float16
    activations)."""
    cp = cupy_or_none()
    check_replay(cp, tiny, "float16")
    ref32 = run_recorded(tiny, np, "float32", "all", steps=1)[2][0]
    f16 = run_recorded(tiny, cp, "float16", "all", steps=1)[2][0]
    assert abs(f16 - ref32) <= 1e-2 * abs(ref32), (f16, ref32)


@gpu_skip()
def test_gpu_feature_task_float32(tiny):
    cp = cupy_or_none()
    m = load_model(tiny, xp=cp)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, "head+last", last_layers=0)
    feats = np.random.default_rng(0).normal(size=(40, 32)).astype(np.float32)
    task = FeatureClassifyTask(m, feats, np.arange(40) % 3, np.arange(30), np.arange(30, 40), 8)
    before = task.eval_sums()
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3)
    for s in range(20):
        eng.step(lambda s=s: task.loss(task.batch(np.arange(s % 4 * 6, s % 4 * 6 + 6))), s,
                 1e-2, 6)
    after = task.eval_sums()
    assert np.isfinite(after).all() and after[2] == before[2] == 10
    assert not np.array_equal(before, after)


# ----------------------------------------------------------------------------- MPI modes
@gpu_skip()
@pytest.mark.parametrize("nranks", [1, 2])
def test_gpu_zo_modes_mpi(tiny, nranks):
    proc = check(mpirun(nranks, [str(ROOT / "tests" / "mpi" / "zo_gpu_modes.py"), str(tiny),
                                 "cupy"], timeout=300, env=ENV))
    for mode in ("data", "perturbation", "hybrid"):
        assert f"ok: {mode} on cupy, {nranks} ranks" in proc.stdout
    assert "ok: collectives on cupy (staged)" in proc.stdout


@gpu_skip()
def test_gpu_cuda_aware_mpi(tiny):
    from gpu_common import mpi_cuda_aware
    ok, why = mpi_cuda_aware()
    if not ok:
        pytest.skip(f"MPI is not CUDA-aware here: {why}")
    proc = check(mpirun(2, [str(ROOT / "tests" / "mpi" / "zo_gpu_modes.py"), str(tiny), "cupy"],
                        timeout=300, env={**ENV, "SEMZO_CUDA_AWARE_MPI": "1"}))
    assert "ok: collectives on cupy (cuda-aware)" in proc.stdout
    assert "ok: zo gpu modes on 2 ranks" in proc.stdout


@pytest.mark.parametrize("nranks", [1, 2])
def test_zo_modes_script_on_cpu(tiny, nranks):
    """tests/mpi/zo_gpu_modes.py with NumPy on both sides."""
    proc = check(mpirun(nranks, [str(ROOT / "tests" / "mpi" / "zo_gpu_modes.py"), str(tiny),
                                 "numpy"], timeout=240, env=ENV))
    assert f"ok: zo gpu modes on {nranks} ranks" in proc.stdout
    assert "ok: collectives on numpy" in proc.stdout
    assert os.path.isfile(tiny / "config.json")
