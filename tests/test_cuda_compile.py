"""The CUDA C of the GPU kernels compiled on a CPU machine: NVRTC (NVIDIA's runtime compiler,
the library CuPy's RawModule calls on a GPU machine; the `nvidia-cuda-nvrtc` wheel of the test
extra) needs no GPU and no driver. The sources (the forward's fused kernels,
semzo.model.kernels_gpu; the ZO kernels, semzo.zo.kernels_cuda; the k-means E-step's,
semzo.cluster.kernels_cuda) must compile with the options
CuPy is given (``--fmad=false``) for the oldest and the newest architecture CUDA 13 supports,
and every kernel the Python side launches must be an entry point of the result; and each
source must assemble to machine code for sm_75 and sm_90 (NVRTC running ptxas), which is
where inline PTX is parsed.

Why: on a GPU a source that does not compile is met only at the first launch (the fused
forward then warns and falls back to the generic CuPy chains), and a GPU is lent to few
sessions; the C builds of the same sources (tests/test_kernels_gpu.py, test_zo_kernels.py)
check the arithmetic but not CUDA's own constructs (shuffles, shared memory, intrinsics)."""

from __future__ import annotations

import ctypes
import re

import pytest
from cbuild import assemble, compile_ptx, load_nvrtc

from semzo.cluster import kernels_cuda as km_cuda
from semzo.model import kernels_gpu as model_gpu
from semzo.zo import kernels_gpu as zo_gpu
from semzo.zo.kernels_cuda import cuda_source as zo_source

ARCHS = ("compute_75", "compute_90")


@pytest.fixture(scope="module")
def nvrtc() -> ctypes.CDLL:
    return load_nvrtc()


def entries(ptx: str) -> set[str]:
    return set(re.findall(r"\.entry\s+(\w+)", ptx))


def test_the_harness_sees_a_compile_error(nvrtc):
    """A source with an error fails, and the log names the undefined identifier."""
    rc, log, ptx = compile_ptx(nvrtc, 'extern "C" __global__ void k(float* x) '
                                      '{ x[0] = not_defined_here; }', "bad.cu", ARCHS[0])
    assert rc != 0 and ptx == ""
    assert "not_defined_here" in log


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_kernels_compile_with_every_entry_point(nvrtc, arch):
    rc, log, ptx = compile_ptx(nvrtc, model_gpu.cuda_source(), "semzo_model.cu", arch)
    assert rc == 0, log
    assert set(model_gpu.KERNELS) <= entries(ptx), set(model_gpu.KERNELS) - entries(ptx)
    assert model_gpu.ROW_KERNELS <= set(model_gpu.KERNELS)


@pytest.mark.parametrize("arch", ARCHS)
def test_zo_kernels_compile_with_every_entry_point(nvrtc, arch):
    rc, log, ptx = compile_ptx(nvrtc, zo_source(), "semzo_zo.cu", arch)
    assert rc == 0, log
    want = {"zo_zvec"} | {f"zo_{k}_{sfx}" for k in ("perturb", "restore_update",
                                                     "multi_update", "stream")
                          for sfx in zo_gpu.SUFFIX.values()}
    assert want <= entries(ptx), want - entries(ptx)


@pytest.mark.parametrize("arch", ARCHS)
def test_kmeans_kernels_compile_with_every_entry_point_and_no_flush(nvrtc, arch):
    """With ``-ftz=true`` (which CuPy appends to every compile), no float32 instruction of
    the k-means kernels flushes subnormals: the score, its comparison and the conversion to
    float64 are the CPU's IEEE operations (inline PTX)."""
    rc, log, ptx = compile_ptx(nvrtc, km_cuda.cuda_source(), "semzo_km.cu", arch,
                               ("-ftz=true",))
    assert rc == 0, log
    assert set(km_cuda.KERNELS) <= entries(ptx), set(km_cuda.KERNELS) - entries(ptx)
    assert ".f32" in ptx and ".ftz" not in ptx
    rc, _, plain = compile_ptx(nvrtc, "extern \"C\" __global__ void k(float* x, double* y) "
                                      "{ y[0] = (double)(x[0] * 2.0f); }", "ftz.cu", arch,
                               ("-ftz=true",))
    assert rc == 0 and ".ftz" in plain          # what the inline PTX avoids


SOURCES = {"forward": model_gpu.cuda_source, "zo": zo_source, "kmeans": km_cuda.cuda_source}


@pytest.mark.parametrize("arch", ("sm_75", "sm_90"))
@pytest.mark.parametrize("which", sorted(SOURCES))
def test_sources_assemble_to_machine_code(nvrtc, which, arch):
    """Each source assembled for a real architecture, with CuPy's options and its appended
    ``-ftz=true``: ptxas parses the inline PTX (the conversions without ``.ftz``, the k-means
    score and comparison), which a compile to PTX copies through unread; a CuPy RawModule
    meets an error there only at its first launch on a device."""
    rc, log, size = assemble(nvrtc, SOURCES[which](), f"semzo_{which}.cu", arch, ("-ftz=true",))
    assert rc == 0 and size > 0, log


def test_the_harness_sees_an_inline_ptx_error(nvrtc):
    """Bad inline PTX: a compile to PTX passes it on, the assembly fails and names it."""
    bad = ('extern "C" __global__ void k(float* x) { float t; '
           'asm("mul.rn.f32 %0, %1, 0fZZ;" : "=f"(t) : "f"(x[0])); x[0] = t; }')
    assert compile_ptx(nvrtc, bad, "bad.cu", "compute_90")[0] == 0
    rc, log, size = assemble(nvrtc, bad, "bad.cu", "sm_90")
    assert rc != 0 and size == 0 and "ptxas" in log and "fZZ" in log
