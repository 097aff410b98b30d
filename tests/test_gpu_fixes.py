"""Defects a first GPU run would have met (issue 35), each proven on the CPU (a NumPy stand-in
for CuPy, a monkeypatched module, or plain NumPy where the fix is device-independent) and on
the GPU beside it (``test_gpu_*``: skipped only without CuPy and a device, and the kit counts
a skip as a failure):

- ``backend.bind_gpu``: CuPy's ``getDeviceCount`` raising (no driver / device) gives the
  friendly one-line error, as does a CuPy that does not import;
- ``topology.collectives.allgather`` under CUDA-aware MPI returns an array of the input's
  module (it returned NumPy while the staged path returns CuPy);
- ``zo.kernels_gpu``: dtype, contiguity and equal seed/scalar lengths checked before any launch;
- ``model.encoder``: an offload slot is freed once unbound (``_qkv_groups`` kept every slot);
- token type ids checked on every device (CuPy's fancy indexing does not check bounds).

(cluster/gpu.py and cluster/kmeans.py: tests/test_gpu_kmeans.py; the float16 engine step
against the CPU: tests/test_gpu_zo.py.)
"""

from __future__ import annotations

import gc
import sys
import types
import weakref
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import GPU_REASON, cupy_or_none, gpu_skip, host
from mpiutil import ROOT, mpirun
from zo_common import make_model

from semzo import backend
from semzo.model import Tokenizer, load_model
from semzo.model.losses import TokenIdError
from semzo.topology import collectives
from semzo.zo import kernels_gpu


# ----------------------------------------------------------------------------- bind_gpu
class CUDARuntimeError(RuntimeError):
    """Named as CuPy's (cupy_backends.cuda.api.runtime.CUDARuntimeError)."""


def _fake_cupy(count):
    def get_count():
        if isinstance(count, Exception):
            raise count
        return count
    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=get_count),
                                      Device=lambda i: types.SimpleNamespace(use=lambda: None))
    return fake


def test_bind_gpu_friendly_errors_on_cpu(monkeypatch):
    err = CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected\ndetail")
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(err))
    with pytest.raises(RuntimeError) as info:
        backend.bind_gpu(0)
    msg = str(info.value)
    assert msg == ("run.device = gpu but no GPU is visible (CUDARuntimeError: "
                   "cudaErrorNoDevice: no CUDA-capable device is detected)")
    assert info.value.__cause__ is None and "\n" not in msg
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(0))
    with pytest.raises(RuntimeError, match="^run.device = gpu but no GPU is visible$"):
        backend.bind_gpu(0)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(2))
    assert backend.bind_gpu(3) == 1
    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy raises ImportError
    with pytest.raises(RuntimeError, match="CuPy does not import .*CUDA major"):
        backend.bind_gpu(0)


@gpu_skip()
def test_gpu_bind_gpu():
    cp = cupy_or_none()
    n = cp.cuda.runtime.getDeviceCount()
    assert backend.bind_gpu(n) == 0 and cp.cuda.runtime.getDevice() == 0


# ----------------------------------------------------------------------------- allgather
class _Dev(np.ndarray):
    """A NumPy array standing for a device array."""


class _DevModule:
    """The array module of ``_Dev`` arrays (what cupy is to cupy arrays)."""

    @staticmethod
    def empty(shape, dtype):
        return np.empty(shape, dtype).view(_Dev)

    @staticmethod
    def empty_like(a):
        return np.empty_like(np.asarray(a)).view(_Dev)

    @staticmethod
    def asarray(a):
        return np.asarray(a).view(_Dev)


class _SelfWorld:
    """A one-rank communicator's Allgather, as a device copy (a CUDA-aware library's)."""

    def Allgather(self, send, out):       # mpi4py's name
        out[0] = send


_SOLO = types.SimpleNamespace(hierarchical=False, size=1, world=_SelfWorld())


def _allgather_keeps_module(xp, buf) -> None:
    got = collectives.allgather(_SOLO, buf)
    assert backend.array_module(got) is backend.array_module(buf)
    assert type(got) is type(buf) and got.shape == (1, *buf.shape)
    assert np.array_equal(host(got)[0], host(buf))


def test_allgather_cuda_aware_keeps_module_on_cpu(monkeypatch):
    monkeypatch.setenv("SEMZO_CUDA_AWARE_MPI", "1")
    monkeypatch.setattr(collectives, "is_device_array", lambda a: isinstance(a, _Dev))
    monkeypatch.setattr(collectives, "synchronize", lambda a: None)
    monkeypatch.setattr(collectives, "array_module",
                        lambda a: _DevModule if isinstance(a, _Dev) else np)
    _allgather_keeps_module(_DevModule, np.arange(6, dtype=np.float64).view(_Dev))
    _allgather_keeps_module(np, np.arange(6, dtype=np.float64))


@gpu_skip()
@pytest.mark.parametrize("aware", ["0", "1"])
def test_gpu_allgather_keeps_module(monkeypatch, aware):
    cp = cupy_or_none()
    monkeypatch.setenv("SEMZO_CUDA_AWARE_MPI", aware)
    _allgather_keeps_module(cp, cp.arange(6, dtype=cp.float64))


# ----------------------------------------------------------------------------- ZO kernels
def _kernel_misuse(xp) -> None:
    """Each entry point raises before any launch on what would read or write out of bounds."""
    f32 = xp.zeros(16, dtype=xp.float32)
    u64 = np.zeros(2, np.uint64)
    with pytest.raises(TypeError, match="dtype int32"):
        kernels_gpu.perturb(xp.zeros(8, dtype=xp.int32), 0, 0, 1, 2, 0, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels_gpu.perturb(f32[::2], 0, 0, 1, 2, 0, 1.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        kernels_gpu.restore_update(f32.reshape(4, 4).T, 0, 0, 1, 2, 0, 1e-3, 0.1, 1.0, 0.0)
    with pytest.raises(TypeError, match="out has dtype float64"):
        kernels_gpu.zvec(xp.zeros(8, dtype=xp.float64), 0, 0, 1, 2, 0)
    with pytest.raises(ValueError, match="equal length"):
        kernels_gpu.multi_update(f32, 0, 0, u64, np.zeros(3, np.uint64), np.zeros(3), 0.1, 0.0,
                                 False, 0, 0, 0.0, 0)
    with pytest.raises(ValueError, match="equal length"):
        kernels_gpu.stream_pass(f32, f32, 0, 0, 3, 0, 0, 0.0, 0.1, 0.0, 0.0, u64, u64,
                                np.zeros(1), 0, 0, 0, 0.0, 0)
    with pytest.raises(ValueError, match="q .* must match p"):
        kernels_gpu.stream_pass(f32, f32[:8], 0, 0, 0, 0, 0, 0.0, 0.1, 0.0, 0.0, u64, u64,
                                np.zeros(2), 1, 0, 0, 0.0, 0)
    with pytest.raises(ValueError, match="not an unsigned 64-bit"):
        kernels_gpu.perturb(f32, -1, 0, 1, 2, 0, 1.0)
    with pytest.raises(ValueError, match="run past 2\\*\\*64"):
        kernels_gpu.perturb(f32, 2**64 - 8, 0, 1, 2, 0, 1.0)     # 16 elements: wraps
    with pytest.raises(ValueError, match="run past 2\\*\\*64"):
        kernels_gpu.zvec(f32, 2**64 - 15, 0, 1, 2, 0)


def test_gpu_deck_without_a_gpu_is_one_line_on_cpu(tmp_path):
    """``run.device = "gpu"`` where CuPy or a device is missing: every rank stops together
    with one line naming the deck (no traceback, no MPI abort), exit 2, nothing written."""
    if GPU_REASON is None:
        pytest.skip("a GPU is here: the run would start")
    out = tmp_path / "run"
    proc = mpirun(2, ["-m", "semzo", "run", str(ROOT / "inputs" / "llm.toml"), "--set",
                      "run.device=gpu", "--set", f"run.output_dir={out}"], timeout=120)
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"error: {ROOT / 'inputs' / 'llm.toml'}: run.device = gpu but "), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "MPI_ABORT" not in proc.stderr
    assert not out.exists()


def test_zo_kernels_validate_before_launch_on_cpu():
    """NumPy arrays: every check fires before the CuPy or numba launch (no cupy is imported:
    a check after it would fail here with ModuleNotFoundError instead)."""
    _kernel_misuse(np)
    assert "cupy" not in sys.modules or sys.modules["cupy"] is None


@gpu_skip()
def test_gpu_zo_kernels_validate_before_launch():
    cp = cupy_or_none()
    _kernel_misuse(cp)
    p = cp.zeros(300, dtype=cp.float32)                   # a valid call still runs
    kernels_gpu.perturb(p, 0, 0, 1, 2, 0, 1.0)
    assert bool((p != 0).any())


# ----------------------------------------------------------------------------- the encoder
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("gpu_fixes") / "bert")


def _batch(folder, xp):
    tok = Tokenizer.from_folder(folder, max_length=16)
    enc = tok.encode_batch(["alpha beta gamma", "delta"])
    t = max(len(e) for e in enc)
    ids = np.zeros((2, t), np.int64)
    mask = np.zeros((2, t), np.int64)
    for i, e in enumerate(enc):
        ids[i, :len(e)], mask[i, :len(e)] = e, 1
    return xp.asarray(ids), xp.asarray(mask)


def _slot_freed_once_unbound(folder, xp) -> int:
    """A layer's Q/K/V bound to a slot from alloc_stage: the fused GEMM on the slot gives the
    resident bits; bound back to the host arrays and dropped by its owner, the slot is freed
    (the model holds none). Returns the weakref's target count left (0) on NumPy, the device
    pool's bytes still used beyond the start on CuPy (0)."""
    m = load_model(folder, xp=xp)
    ids, mask = _batch(folder, xp)
    ref = host(m.hidden_states(ids, mask))
    base = f"{m.prefix}encoder.layer.0.attention.self."
    names = [f"{base}{q}.{w}" for q in ("query", "key", "value") for w in ("weight", "bias")]
    pool = xp.get_default_memory_pool() if xp is not np else None
    before = pool.used_bytes() if pool is not None else 0
    slot = m.alloc_stage(names, xp)
    for n in names:
        slot[n][...] = m.params[n]
    resident = {n: m.params[n] for n in names}
    m.bind_params(slot)
    w = slot[names[0]].base
    assert m._fused[0][0] is w, "the slot's fused buffer is used"
    assert np.array_equal(host(m.hidden_states(ids, mask)), ref)
    m.bind_params(resident)
    assert m._fused[0][0] is resident[names[0]].base
    assert np.array_equal(host(m.hidden_states(ids, mask)), ref)
    if pool is None:
        gone = weakref.ref(w)
        del slot, w
        gc.collect()
        return int(gone() is not None)
    del slot, w
    gc.collect()
    return max(0, pool.used_bytes() - before)


def test_encoder_slot_freed_once_unbound_on_cpu(tiny):
    assert _slot_freed_once_unbound(tiny, np) == 0


@gpu_skip()
def test_gpu_encoder_slot_freed_once_unbound(tiny):
    assert _slot_freed_once_unbound(tiny, cupy_or_none()) == 0


def _type_ids_checked(folder, xp) -> None:
    m = load_model(folder, xp=xp)
    ids, mask = _batch(folder, xp)
    ok = host(m.hidden_states(ids, mask, token_type_ids=xp.zeros(ids.shape, dtype=xp.int64)))
    assert np.array_equal(ok, host(m.hidden_states(ids, mask)))
    ones = host(m.hidden_states(ids, mask, token_type_ids=xp.ones(ids.shape, dtype=xp.int64)))
    assert not np.array_equal(ones, ok)
    for bad in (2, -1):                      # the tiny model has 2 token types
        tti = xp.zeros(ids.shape, dtype=xp.int64)
        tti[1, 0] = bad
        with pytest.raises(TokenIdError, match=f"token type id {bad} at position \\(1, 0\\)"):
            m.hidden_states(ids, mask, token_type_ids=tti)
        with pytest.raises(TokenIdError, match="token type id"):
            m.hidden_states(host(ids), host(mask), token_type_ids=host(tti))
    with pytest.raises(ValueError, match="shaped as input_ids"):
        m.hidden_states(ids, mask, token_type_ids=xp.zeros((2, 1), dtype=xp.int64))
    with pytest.raises(ValueError, match="integer array"):
        m.hidden_states(ids, mask, token_type_ids=xp.zeros(ids.shape, dtype=xp.float32))


def test_token_type_ids_checked_on_cpu(tiny):
    _type_ids_checked(tiny, np)


@gpu_skip()
def test_gpu_token_type_ids_checked(tiny):
    _type_ids_checked(tiny, cupy_or_none())


# ----------------------------------------------------------------------------- host_params
class _DeviceArray(np.ndarray):
    """A stand-in device array: like CuPy's, its setitem refuses a NumPy (host) source."""

    def __setitem__(self, key, value):
        if isinstance(value, np.ndarray) and not isinstance(value, _DeviceArray):
            raise ValueError("non-scalar numpy.ndarray cannot be used for fill")  # noqa: TRY004 (as CuPy raises)
        super().__setitem__(key, value)


def _device_module():
    dev = types.ModuleType("standin_device")
    dev.__getattr__ = lambda name: getattr(np, name)
    dev.ndarray = _DeviceArray
    dev.empty = lambda *a, **k: np.empty(*a, **k).view(_DeviceArray)
    return dev


def test_encoder_host_params_fused_in_host_memory_on_cpu(tiny):
    """zo.offload = "host" loads the parameters into host memory with a device xp: the fused
    Q/K/V buffer must be allocated in host memory too (it was allocated on the device, whose
    setitem refused the host source: the offloaded GPU step failed at load, first kit run)."""
    m = load_model(tiny, xp=_device_module(), host_params=True)
    base = f"{m.prefix}encoder.layer.0.attention.self."
    w, b, views = m._fused[0]
    assert type(w) is np.ndarray and type(b) is np.ndarray
    assert m.params[f"{base}key.weight"] is views[1][0] and views[1][0].base is w
    ref = load_model(tiny)
    assert np.array_equal(m.params[f"{base}key.weight"], ref.params[f"{base}key.weight"])
    with pytest.raises(ValueError, match="cannot be used for fill"):   # the stand-in bites
        _device_module().empty(3)[...] = np.ones(3)


def test_restore_row_stack_on_cpu(monkeypatch):
    """numba-cuda overloads np.row_stack, which NumPy 2.5 removed: restored as np.vstack."""
    monkeypatch.delattr(np, "row_stack", raising=False)
    assert kernels_gpu.restore_row_stack() is True
    assert np.row_stack is np.vstack
    assert kernels_gpu.restore_row_stack() is False


def test_encoder_binds_arrays_whose_base_is_no_array_on_cpu(tiny):
    """HostStore binds pinned host arrays (cupyx.empty_pinned), whose ``base`` is CuPy's
    PinnedMemoryPointer, not an array: bind_params read its ``shape`` and raised (second GPU
    run, 2026-11-27). Arrays over a bytearray have such a base here."""
    m = load_model(tiny)
    ids, mask = _batch(tiny, np)
    ref = m.hidden_states(ids, mask)
    base = f"{m.prefix}encoder.layer.0.attention.self."
    arrs = {}
    for q in ("query", "key", "value"):
        for kind in ("weight", "bias"):
            a = m.params[f"{base}{q}.{kind}"]
            arrs[f"{base}{q}.{kind}"] = np.ndarray(a.shape, a.dtype, buffer=bytearray(a.nbytes))
            arrs[f"{base}{q}.{kind}"][...] = a
    assert type(arrs[f"{base}key.weight"].base) is bytearray
    m.bind_params(arrs)
    assert m.params[f"{base}key.weight"] is arrs[f"{base}key.weight"]
    assert np.array_equal(m.hidden_states(ids, mask), ref)


def test_gpu_kernels_fall_back_once_when_they_do_not_compile_on_cpu(monkeypatch):
    """backend.gpu_kernels (the fused forward's and the k-means E-step's loader): a compile
    failure warns once with its first line, is remembered per device (no second try, no
    second warning), and SEMZO_GPU_FUSED=0 never compiles; a compile that works is returned."""
    dev = [0]
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDevice=lambda: dev[0]))))
    tries = []

    def broken(device_id):
        tries.append(device_id)
        raise RuntimeError("nvrtc: error: identifier x is undefined\nmore log")

    failed: dict = {}
    with pytest.warns(RuntimeWarning, match=r"the k-means GPU kernels did not compile on GPU 0; "
                                            r"the generic E-step serves \(RuntimeError: nvrtc"):
        assert backend.gpu_kernels(broken, failed, "the k-means GPU kernels",
                                   "the generic E-step") is None
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.gpu_kernels(broken, failed, "x", "y") is None
    assert tries == [0] and list(failed) == [0] and "more log" in failed[0]
    dev[0] = 1
    assert backend.gpu_kernels(lambda d: {"k": d}, failed, "x", "y") == {"k": 1}
    monkeypatch.setenv("SEMZO_GPU_FUSED", "0")
    assert backend.gpu_kernels(lambda d: 1 / 0, {}, "x", "y") is None


def test_zo_launch_arguments_match_the_kernels_on_cpu(monkeypatch):
    """Every CuPy ZO entry point, for every storage dtype: the launch's arguments held to the
    kernel's parameters in the PTX (NVRTC, no GPU): their number, and each one's size and
    kind, which CuPy's packing needs (a wrong scalar type would shift every later parameter
    on the device)."""
    from cbuild import check_launch, ptx_params

    from semzo.zo.kernels_cuda import cuda_source
    params = ptx_params(cuda_source())
    launched = []
    fake = types.ModuleType("cupy")
    fake.uint16 = np.uint16
    fake.asarray = np.asarray
    fake.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.delenv("SEMZO_ZO_GPU_BACKEND", raising=False)
    monkeypatch.setattr(kernels_gpu, "_SEEDS", {})

    def record(name, off, n, args):
        check_launch(params, name, args)
        launched.append(name)

    monkeypatch.setattr(kernels_gpu, "_cupy_launch", record)
    seeds = (np.array([1, 2], np.uint64), np.array([3, 4], np.uint64), np.array([0.5, -1.0]))
    for dt in (np.float32, np.float64, np.float16, np.uint16):
        p, q = np.zeros(10, dt), np.zeros(10, dt)
        kernels_gpu.perturb(p, 3, 1, 2, 3, 0, 1.0)
        kernels_gpu.restore_update(p, 3, 1, 2, 3, 0, 1e-3, 1e-4, 0.5, 0.0)
        kernels_gpu.multi_update(p, 3, 1, *seeds, 1e-4, 0.0, True, 5, 6, 1e-3, 0)
        kernels_gpu.stream_pass(p, q, 3, 1, 0, 2, 3, 1e-3, 1e-4, 0.5, 0.0, *seeds, True, 7, 8,
                                1e-3, 0)
    kernels_gpu.zvec(np.zeros(10, np.float32), 3, 1, 2, 3, 0)
    want = {f"zo_{k}_{sfx}" for k in ("perturb", "restore_update", "multi_update", "stream")
            for sfx in kernels_gpu.SUFFIX.values()} | {"zo_zvec"}
    assert set(launched) == want
