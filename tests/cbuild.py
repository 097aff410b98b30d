"""The CUDA C sources of the GPU kernels built on the CPU as plain C (gcc), for the tests that
compare them with the CPU kernels: every source's ``#ifdef __CUDACC__`` branches turn a
grid-stride loop into a serial loop, so the same kernels run here, one "thread" after the
other. ``-ffp-contract=off``: no multiply-add is contracted, as ``--fmad=false`` on the GPU."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path


def build_c(source: str, folder: Path, name: str) -> ctypes.CDLL:
    """``source`` compiled by gcc into ``folder``/lib``name``.so and loaded."""
    cc = shutil.which("gcc") or shutil.which("cc")
    assert cc, "a C compiler is needed to test the CUDA C source on the CPU"
    src, so = folder / f"{name}.c", folder / f"lib{name}.so"
    src.write_text(source)
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-Wall", "-Werror", "-shared", "-fPIC",
                    "-x", "c", str(src), "-o", str(so), "-lm"], check=True)
    return ctypes.CDLL(str(so))
