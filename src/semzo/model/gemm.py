"""bfloat16 GEMMs with float32 accumulation: the projections and the LM head of a decoder
whose deck says ``model.matmul = "bfloat16"`` (with ``model.dtype = "bfloat16"``).

A bfloat16 model (:mod:`semzo.model.storage`) keeps its weights as bfloat16 bits and by
default computes every product in float32: each weight is upcast where it is read and the
GEMM is float32 (on a GPU, CUDA cores: the first profiles on an H200 had float32 GEMMs at 58 %
of the forward's device time and the forward at 0.35x torch, whose bfloat16 GEMMs run on the
tensor cores). With ``model.matmul = "bfloat16"`` the activations entering a projection (and
the LM head) are rounded to bfloat16 (round to nearest even) and multiplied by the stored
bfloat16 weights with float32 accumulation and a float32 result: on a GPU one cuBLAS
``cublasGemmEx`` call (bfloat16 A and B, ``CUBLAS_COMPUTE_32F``, the tensor cores), with no
upcast of the weight; on the CPU the same arithmetic in float32 (the product of two bfloat16
values is exact in float32), for tests and for runs that must give the GPU's numbers up to
the order of the sums. Attention's products, norms and everything else stay float32.

The rounding changes the forward's numbers (by about bfloat16's 2^-8 relative per input) and
the CPU and GPU sum in different orders, so unlike the default the two no longer agree bit
for bit; within one device a run is still deterministic (same bits at any rank count).
"""

from __future__ import annotations

import numpy as np

from semzo.backend import array_module
from semzo.model.storage import BF16, to_bits, to_float32

#: CUDA's and cuBLAS's enumerations (cuda_runtime / cublas_api.h), fixed by their ABI
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1

MODES = ("float32", "bfloat16")


def gemm_args(x_shape, w_shape, out_shape, out_row_stride: int, transposed: bool) -> tuple:
    """The column-major cuBLAS arguments ``(transa, transb, m, n, k, lda, ldb, ldc)`` of the
    row-major ``out (N, O) = x (N, I) @ W.T`` with ``W (O, I)`` (``transposed``: nn.Linear) or
    ``x @ W`` with ``W (I, O)`` (GPT-2's Conv1D), for C-contiguous x and W and an ``out`` whose
    rows are ``out_row_stride`` elements apart (a column slice of a wider array). A row-major
    (r, c) matrix is the column-major (c, r) one, so cuBLAS computes ``out.T = W.T' @ x.T``
    with A = W and B = x. ValueError on shapes that do not agree."""
    n, k = x_shape
    o = w_shape[0] if transposed else w_shape[1]
    wk = w_shape[1] if transposed else w_shape[0]
    if len(w_shape) != 2 or wk != k or tuple(out_shape) != (n, o) or out_row_stride < o:
        raise ValueError(f"bfloat16 GEMM: x {tuple(x_shape)}, weight {tuple(w_shape)} "
                         f"({'out, in' if transposed else 'in, out'}), out {tuple(out_shape)} "
                         f"(row stride {out_row_stride}) do not agree")
    if transposed:
        return CUBLAS_OP_T, CUBLAS_OP_N, o, n, k, k, k, out_row_stride
    return CUBLAS_OP_N, CUBLAS_OP_N, o, n, k, o, k, out_row_stride


def round_bf16(x):
    """float32 values of ``x`` rounded to bfloat16 (nearest even): a new array."""
    return to_float32(to_bits(x))


def _check(x, w, out) -> int:
    if w.dtype != BF16 or not w.flags.c_contiguous or w.ndim != 2:
        raise ValueError(f"bfloat16 GEMM: the weight must be C-contiguous bfloat16 bits "
                         f"(uint16, 2-D), got {w.dtype} {w.shape}")
    if x.ndim != 2 or x.dtype != np.float32:
        raise ValueError(f"bfloat16 GEMM: activations must be 2-D float32, got {x.dtype} "
                         f"{x.shape}")
    if out.ndim != 2 or out.dtype != np.float32 or out.strides[1] != out.itemsize or \
            out.strides[0] % out.itemsize:
        raise ValueError(f"bfloat16 GEMM: out must be 2-D float32 with contiguous rows, got "
                         f"{out.dtype} {out.shape} strides {out.strides}")
    return out.strides[0] // out.itemsize


def matmul_bf16(x, w, out, transposed: bool = True):
    """``out[...] = bf16(x) @ W.T`` (``transposed``; W (O, I)) or ``bf16(x) @ W`` (W (I, O)),
    W given as bfloat16 bits, products accumulated in float32; ``out`` float32 (N, O), may be
    a column slice. NumPy or CuPy (the module of x). Returns out."""
    ld = _check(x, w, out)
    args = gemm_args(x.shape, w.shape, out.shape, ld, transposed)
    xp = array_module(x)
    if xp is np:
        wf = to_float32(w)
        return np.matmul(round_bf16(x), wf.T if transposed else wf, out=out)
    xb = xp.empty(x.shape, xp.uint16)
    from semzo.model import kernels_gpu
    xc = xp.ascontiguousarray(x)
    if not kernels_gpu.to_bf16(xc, xb):
        xb = to_bits(xc)
    _gemm_ex(xp, w, xb, out, args)
    return out


def _gemm_ex(xp, w, xb, out, args) -> None:
    """One ``cublasGemmEx``: bfloat16 A (the weight) and B (the activations), float32 C and
    compute, on the current stream (CuPy's handle sets it), host scalars."""
    from cupy.cuda import device  # GPU only
    from cupy_backends.cuda.libs import cublas  # GPU only
    ta, tb, m, n, k, lda, ldb, ldc = args
    one, zero = np.ones((), np.float32), np.zeros((), np.float32)
    cublas.gemmEx(device.get_cublas_handle(), ta, tb, m, n, k, one.ctypes.data, w.data.ptr,
                  CUDA_R_16BF, lda, xb.data.ptr, CUDA_R_16BF, ldb, zero.ctypes.data,
                  out.data.ptr, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
