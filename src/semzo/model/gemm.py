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
from semzo.model import gemm_cpu
from semzo.model.storage import BF16, to_bits, to_float32

#: CUDA's and cuBLAS's enumerations (cuda_runtime / cublas_api.h), fixed by their ABI
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1

MODES = ("float32", "bfloat16")
#: alpha and beta of every cuBLAS call here (host pointer mode: read during the call)
_ONE, _ZERO = np.ones((), np.float32), np.zeros((), np.float32)


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


def bf16_input(x):
    """The bfloat16 bits (C-contiguous uint16) of float32 activations ``x``, rounded to
    nearest even: on the GPU one fused kernel (:func:`semzo.model.kernels_gpu.to_bf16`),
    else :func:`semzo.model.storage.to_bits`. Computed once for the projections that share
    an input (q, k, v; gate, up)."""
    xp = array_module(x)
    if xp is not np:
        from semzo.model import kernels_gpu
        xc = xp.ascontiguousarray(x)
        xb = xp.empty(x.shape, xp.uint16)
        if kernels_gpu.to_bf16(xc, xb):
            return xb
        return to_bits(xc)
    return to_bits(x)


def matmul_bf16(x, w, out, transposed: bool = True, xb=None):
    """``out[...] = bf16(x) @ W.T`` (``transposed``; W (O, I)) or ``bf16(x) @ W`` (W (I, O)),
    W given as bfloat16 bits, products accumulated in float32; ``out`` float32 (N, O), may be
    a column slice. ``xb``: :func:`bf16_input` of x when the caller has it (x is then read
    for its shape only). NumPy or CuPy (the module of x). Returns out."""
    ld = _check(x, w, out)
    args = gemm_args(x.shape, w.shape, out.shape, ld, transposed)
    if xb is None:
        xb = bf16_input(x)
    elif xb.shape != x.shape or xb.dtype != BF16:
        raise ValueError(f"bfloat16 GEMM: xb {xb.dtype} {xb.shape} is not the bits of x "
                         f"{x.shape}")
    xp = array_module(x)
    if xp is np:
        if gemm_cpu.usable(xb, w, out, transposed):    # AVX512_BF16's dot products
            return gemm_cpu.matmul(xb, w, out)
        wf = to_float32(w)
        return np.matmul(to_float32(xb), wf.T if transposed else wf, out=out)
    _gemm_ex(xp, w, xb, out, args)
    return out


def matmul_bf16_many(x, ws, outs, xb=None) -> None:
    """:func:`matmul_bf16` of one x by each (O, I) weight of ``ws`` into the matching
    ``outs`` (a block's q, k, v, or gate and up): on the CPU with AVX512_BF16 the activations
    packed once for all (:func:`semzo.model.gemm_cpu.matmul_many`, the same bits), else one
    :func:`matmul_bf16` each."""
    if xb is None:
        xb = bf16_input(x)
    if array_module(x) is np and xb.shape == x.shape and xb.dtype == BF16:
        for w, o in zip(ws, outs):
            _check(x, w, o)                 # what matmul_bf16 refuses, refused alike
        if all(gemm_cpu.usable(xb, w, o, True) for w, o in zip(ws, outs)):
            gemm_cpu.matmul_many(xb, ws, outs)
            return
    for w, o in zip(ws, outs):
        matmul_bf16(x, w, o, True, xb)


def _gemm_ex(xp, w, xb, out, args) -> None:
    """One ``cublasGemmEx``: bfloat16 A (the weight) and B (the activations), float32 C and
    compute, on the current stream (CuPy's handle sets it), host scalars."""
    from cupy.cuda import device  # GPU only
    from cupy_backends.cuda.libs import cublas  # GPU only
    ta, tb, m, n, k, lda, ldb, ldc = args
    cublas.gemmEx(device.get_cublas_handle(), ta, tb, m, n, k, _ONE.ctypes.data, w.data.ptr,
                  CUDA_R_16BF, lda, xb.data.ptr, CUDA_R_16BF, ldb, _ZERO.ctypes.data,
                  out.data.ptr, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)


# ------------------------------------------------------------------ float32 GEMMs
def matmul_f32(x, w, out, transposed: bool = True, alpha: float = 1.0,
               beta: float = 0.0) -> bool:
    """``out[...] = alpha x @ W.T + beta out`` (``transposed``; W (O, I)) or with ``x @ W`` (W
    (I, O)) for float32 CuPy arrays, x and W C-contiguous, ``out`` (N, O) with contiguous rows
    at any row stride (a column slice of q|k|v or gate|up): one ``cublasSgemm`` writing in
    place, where CuPy's matmul into a non-contiguous ``out`` computes into a new array and
    copies it (and a scaled or accumulated product takes two more kernels). Returns False,
    doing nothing, for operands it does not take (the caller's matmul serves)."""
    if x.dtype != np.float32 or w.dtype != np.float32 or out.dtype != np.float32 or \
            x.ndim != 2 or w.ndim != 2 or out.ndim != 2 or not x.flags.c_contiguous or \
            not w.flags.c_contiguous or out.strides[1] != out.itemsize or \
            out.strides[0] % out.itemsize or out.strides[0] < out.shape[1] * out.itemsize:
        return False
    _sgemm(w, x, out, gemm_args(x.shape, w.shape, out.shape,
                                out.strides[0] // out.itemsize, transposed),
           np.float32(alpha), np.float32(beta))
    return True


def _sgemm(w, x, out, args, alpha, beta) -> None:
    """One ``cublasSgemm`` (A = the weight, B = the activations; column-major, see
    :func:`gemm_args`) on the current stream, host scalars (read during the call)."""
    from cupy.cuda import device  # GPU only
    from cupy_backends.cuda.libs import cublas  # GPU only
    ta, tb, m, n, k, lda, ldb, ldc = args
    al, be = np.array(alpha, np.float32), np.array(beta, np.float32)
    cublas.sgemm(device.get_cublas_handle(), ta, tb, m, n, k, al.ctypes.data, w.data.ptr,
                 lda, x.data.ptr, ldb, be.ctypes.data, out.data.ptr, ldc)


# ------------------------------------------------------------------ batched float32 GEMMs
def merged_batch(a) -> tuple[int, int]:
    """(count, stride in elements) of the leading dimensions of ``a`` (..., r, c) as one
    batch dimension of uniform stride; ValueError when they cannot be merged (a stride that
    is not the next one's times its extent)."""
    lead, st = a.shape[:-2], [s // a.itemsize for s in a.strides[:-2]]
    count = int(np.prod(lead)) if lead else 1
    if not lead:
        return 1, 0
    stride = st[-1]
    for i in range(len(lead) - 1):
        if lead[i] > 1 and st[i] != st[i + 1] * lead[i + 1]:
            raise ValueError(f"batch dimensions {tuple(lead)} with strides {tuple(st)} do not "
                             f"merge into one")
    return count, stride


def _operand(a) -> tuple[int, int]:
    """(transposed?, leading dimension) of the last two dimensions of ``a`` read column-major
    by cuBLAS: a row-major (r, c) block is the column-major (c, r) one."""
    sr, sc = (s // a.itemsize for s in a.strides[-2:])
    if sc == 1 or a.shape[-1] == 1:
        return 0, max(sr, a.shape[-1])
    if sr == 1 or a.shape[-2] == 1:
        return 1, max(sc, a.shape[-2])
    raise ValueError(f"operand {a.shape} with strides {a.strides}: neither its rows nor its "
                     f"columns are contiguous")


def batched_args(a, b, c) -> tuple:
    """The column-major ``cublas?gemmStridedBatched`` arguments ``(transa, transb, m, n, k,
    A is b, lda, strideA, B is a, ldb, strideB, ldc, strideC, batch)`` of the row-major
    ``c[i] = a[i] @ b[i]`` over the merged leading dimensions of views a (..., M, K),
    b (..., K, N), c (..., M, N) (c's rows contiguous). cuBLAS computes c.T = b.T @ a.T, so
    its A is b and its B is a. ValueError when shapes or layouts do not fit."""
    m_, k_ = a.shape[-2:]
    k2, n_ = b.shape[-2:]
    if k2 != k_ or c.shape[-2:] != (m_, n_) or not (a.shape[:-2] == b.shape[:-2] ==
                                                    c.shape[:-2]):
        raise ValueError(f"batched GEMM: {a.shape} @ {b.shape} -> {c.shape} do not agree")
    (_, sa), (_, sb), (nc, sc) = merged_batch(a), merged_batch(b), merged_batch(c)
    tb, ldb_ = _operand(b)
    ta, lda_ = _operand(a)
    tc, ldc = _operand(c)
    if tc:
        raise ValueError(f"batched GEMM: the output's rows must be contiguous, {c.strides}")
    ops = (CUBLAS_OP_T if tb else CUBLAS_OP_N, CUBLAS_OP_T if ta else CUBLAS_OP_N)
    return (*ops, n_, m_, k_, ldb_, sb, lda_, sa, ldc, sc, nc)


def batched_matmul_f32(a, b, c) -> None:
    """``c[...] = a @ b`` for float32 CuPy views of one batch shape (attention's scores and
    context on the GPU): one ``cublasSgemmStridedBatched`` call, where CuPy's matmul of
    4- and 5-D views launches a pointer-array kernel per operand and copies
    non-contiguous outputs. The arithmetic is a float32 GEMM, as CuPy's."""
    from cupy.cuda import device  # GPU only
    from cupy_backends.cuda.libs import cublas  # GPU only
    if a.dtype != np.float32 or b.dtype != np.float32 or c.dtype != np.float32:
        raise ValueError(f"batched GEMM: float32 only, got {a.dtype}, {b.dtype}, {c.dtype}")
    ta, tb, m, n, k, ld_b, st_b, ld_a, st_a, ldc, st_c, batch = batched_args(a, b, c)
    cublas.sgemmStridedBatched(device.get_cublas_handle(), ta, tb, m, n, k, _ONE.ctypes.data,
                               b.data.ptr, ld_b, st_b, a.data.ptr, ld_a, st_a,
                               _ZERO.ctypes.data, c.data.ptr, ldc, st_c, batch)
