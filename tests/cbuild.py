"""The CUDA C sources of the GPU kernels on a CPU machine.

* :func:`build_c`: built as plain C (gcc), for the tests that compare them with the CPU
  kernels: every source's ``#ifdef __CUDACC__`` branches turn a grid-stride loop into a
  serial loop, so the same kernels run here, one "thread" after the other.
  ``-ffp-contract=off``: no multiply-add is contracted, as ``--fmad=false`` on the GPU.
* :func:`compile_ptx`: compiled by NVRTC (the `nvidia-cuda-nvrtc` wheel of the test extra;
  no GPU, no driver) as CuPy compiles them (:func:`assemble`: on to machine code, through
  ptxas); :func:`ptx_params` reads each kernel's parameter
  types from the PTX, and :func:`check_launch` holds a launch's arguments to them: CuPy packs
  each argument by its own type (a NumPy int64 is 8 bytes whatever the kernel declares), so a
  wrong scalar type shifts every later parameter on the device, which the C build (ctypes
  converts what it is given) cannot see.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np


def build_c(source: str, folder: Path, name: str) -> ctypes.CDLL:
    """``source`` compiled by gcc into ``folder``/lib``name``.so and loaded."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to test the CUDA C source on the CPU"
    src, so = folder / f"{name}.c", folder / f"lib{name}.so"
    src.write_text(source)
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-Wall", "-Werror", "-shared", "-fPIC",
                    "-x", "c", str(src), "-o", str(so), "-lm"], check=True)
    return ctypes.CDLL(str(so))


@functools.cache
def load_nvrtc() -> ctypes.CDLL:
    import nvidia  # the nvidia-cuda-nvrtc wheel (test extra): a namespace package
    libs = sorted(p for d in nvidia.__path__
                  for p in glob.glob(os.path.join(d, "*", "lib", "libnvrtc.so*"))
                  if "builtins" not in p)
    assert libs, f"no libnvrtc.so under {list(nvidia.__path__)} (pip install nvidia-cuda-nvrtc)"
    return ctypes.CDLL(libs[0])


def _nvrtc(nv: ctypes.CDLL, source: str, name: str, arch: str, extra: tuple[str, ...],
           product: str) -> tuple[int, str, bytes]:
    """(NVRTC's status, its log, its ``product``: "PTX" or "CUBIN") of ``source`` compiled
    with CuPy's option (``--fmad=false``) for ``arch``."""
    prog = ctypes.c_void_p()
    rc = nv.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None,
                               None)
    assert rc == 0, f"nvrtcCreateProgram: {rc}"
    try:
        opts = [b"--fmad=false", f"--gpu-architecture={arch}".encode(),
                *(o.encode() for o in extra)]
        rc = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        n = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        log = ctypes.create_string_buffer(n.value + 1)
        nv.nvrtcGetProgramLog(prog, log)
        out = b""
        if rc == 0:
            assert getattr(nv, f"nvrtcGet{product}Size")(prog, ctypes.byref(n)) == 0
            buf = ctypes.create_string_buffer(n.value + 1)
            assert getattr(nv, f"nvrtcGet{product}")(prog, buf) == 0
            out = buf.raw[:n.value]
        return rc, log.value.decode(errors="replace"), out
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_ptx(nv: ctypes.CDLL, source: str, name: str, arch: str,
                extra: tuple[str, ...] = ()) -> tuple[int, str, str]:
    """(NVRTC's status, its log, the PTX) of ``source`` compiled as CuPy compiles it."""
    rc, log, ptx = _nvrtc(nv, source, name, arch, extra, "PTX")
    return rc, log, ptx.rstrip(b"\0").decode()


def assemble(nv: ctypes.CDLL, source: str, name: str, arch: str,
             extra: tuple[str, ...] = ()) -> tuple[int, str, int]:
    """(NVRTC's status, its log, the CUBIN's size) of ``source`` compiled for a real
    architecture (``sm_90``): NVRTC then runs ptxas itself, which parses the inline PTX that
    a compile to PTX (``compute_90``) only copies through, as the driver would at the first
    launch on a device."""
    rc, log, cubin = _nvrtc(nv, source, name, arch, extra, "CUBIN")
    return rc, log, len(cubin)


def ptx_params(source: str) -> dict[str, list[str]]:
    """{kernel: its parameters' PTX types (``u64`` for a pointer or a 64-bit integer, ``u32``
    for an int, ``f32``, ``f64``, ...)} of every entry point of ``source``."""
    rc, log, ptx = compile_ptx(load_nvrtc(), source, "sig.cu", "compute_90")
    assert rc == 0, log
    out = {}
    for name, params in re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx):
        out[name] = re.findall(r"\.param\s+\.(\w+)", params)
    return out


#: the PTX parameter type CuPy's packing of each NumPy scalar type matches
_SCALAR = {np.dtype(np.int64): "u64", np.dtype(np.uint64): "u64", np.dtype(np.int32): "u32",
           np.dtype(np.uint32): "u32", np.dtype(np.float32): "f32", np.dtype(np.float64): "f64"}


def check_launch(params: dict[str, list[str]], name: str, args) -> None:
    """A launch of kernel ``name`` with ``args`` (arrays pass a pointer, NumPy scalars their
    bytes) matches the kernel's parameters in number, and each argument in size and kind."""
    want = params[name]
    assert len(args) == len(want), f"{name}: {len(args)} arguments, the kernel takes {len(want)}"
    for i, (a, w) in enumerate(zip(args, want)):
        if isinstance(a, np.ndarray) and a.ndim > 0:
            got = "u64"                               # a device pointer
        else:
            assert isinstance(a, np.generic), f"{name} argument {i}: {type(a).__name__} (CuPy " \
                                              f"would choose its size)"
            got = _SCALAR.get(a.dtype, a.dtype.name)
        assert got == w, f"{name} argument {i}: {got} where the kernel takes .{w}"
