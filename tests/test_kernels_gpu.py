"""The fused GPU kernels of the forward (semzo.model.kernels_gpu) on the CPU: their CUDA C
source built by gcc as plain C, each kernel against the generic ``xp`` version of
semzo.model.kernels_lm / semzo.model.kernels on NumPy (the version CuPy runs without them). The index arithmetic
(rotary split into caches at an offset, grouped-query softmax masks) is checked bit for bit
where no transcendental function is involved; exp and tanh (glibc's here, CUDA's there) to
float32 rounding. The GPU side: tests/test_decoder_gpu.py and test_gpu_model.py run the
forward with these kernels against NumPy on a device."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest
from cbuild import build_c, check_launch, ptx_params

from semzo.model import kernels, kernels_gpu, kernels_lm

P, LL, I, F = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int, ctypes.c_float


@pytest.fixture(scope="module")
def lib(tmp_path_factory) -> ctypes.CDLL:
    lib = build_c(kernels_gpu.cuda_source(), tmp_path_factory.mktemp("lmgpu"), "lm")
    lib.lm_rmsnorm_row.argtypes = [P, P, I, P, P, I, P, P, I, LL, I, F]
    lib.lm_gated.argtypes = [P, P, LL, I, I, P, I]
    lib.lm_rope_split.argtypes = [P, P, I, P, P, P, I, P, P, P, LL, I, I, I, I, LL, LL, P, I]
    lib.lm_heads_to_rows.argtypes = [P, P, P, I, LL, I, I, I, I, P, I]
    lib.lm_softmax_row.argtypes = [P, P, LL, I, I, LL, LL, I, I, F]
    lib.lm_softmax_warp.argtypes = [P, P, LL, I, I, LL, LL, I, I, F]
    lib.lm_layernorm_row.argtypes = [P, P, P, P, LL, I, F]
    lib.lm_add_bias.argtypes = [P, P, P, LL, I]
    lib.lm_bias_act.argtypes = [P, P, LL, I, I]
    lib.lm_to_bf16.argtypes = [P, P, LL]
    lib.lm_softmax_row_h.argtypes = lib.lm_softmax_row.argtypes
    lib.lm_softmax_warp_h.argtypes = lib.lm_softmax_warp.argtypes
    lib.lm_layernorm_row_h.argtypes = lib.lm_layernorm_row.argtypes
    lib.lm_add_bias_h.argtypes = lib.lm_add_bias.argtypes
    lib.lm_bias_act_h.argtypes = lib.lm_bias_act.argtypes
    lib.lm_rmsnorm_row_h.argtypes = lib.lm_rmsnorm_row.argtypes
    lib.lm_gated_h.argtypes = lib.lm_gated.argtypes
    lib.lm_rope_split_h.argtypes = lib.lm_rope_split.argtypes
    lib.lm_heads_to_rows_h.argtypes = [P, P, P, I, LL, I, I, I, I]
    return lib


@pytest.fixture
def xp_path(monkeypatch):
    """The generic xp versions on NumPy float32 (what CuPy runs unfused)."""
    monkeypatch.setattr(kernels_lm, "_is_cpu32", lambda *a: False)
    monkeypatch.setattr(kernels, "_is_cpu32", lambda *a: False)


def ptr(a: np.ndarray):
    assert a.flags.c_contiguous
    return a.ctypes.data


def test_source_compiles_as_c_with_every_kernel(lib):
    for name in kernels_gpu.KERNELS:
        assert hasattr(lib, name)


def _rms2(lib, x, g, out, resid=None, bits=None):
    """lm_rmsnorm_row with g float32 or bfloat16 bits, an optional residual and bits."""
    gb = g.dtype == np.uint16
    spare = np.zeros(1, np.uint16)
    lib.lm_rmsnorm_row(ptr(x), ptr(x if resid is None else resid), int(resid is not None),
                       ptr(out if gb else g), ptr(g if gb else spare), int(gb),
                       ptr(out), ptr(spare if bits is None else bits), int(bits is not None),
                       x.shape[0], x.shape[1], 1e-6)


def test_rmsnorm_matches_the_xp_version(lib, xp_path):
    """lm_rmsnorm_row: the xp version's norm; in place; gamma read as bfloat16 bits the
    same as upcast; the residual folded in (resid written first, out may be resid); the
    bfloat16 bits of out bit for bit as storage.to_bits."""
    from semzo.model.storage import to_bits, to_float32
    rng = np.random.default_rng(0)
    n, h, eps = 37, 96, 1e-6
    x = rng.standard_normal((n, h)).astype(np.float32) * 3
    g = rng.standard_normal(h).astype(np.float32)
    ref = kernels_lm.rmsnorm(x, g, eps, np.empty_like(x))
    out = np.full_like(x, np.nan)
    _rms2(lib, x, g, out)
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=1e-7)
    y = x.copy()                                    # in place (out is x)
    _rms2(lib, y, g, y)
    assert np.array_equal(y, out)
    gbits = to_bits(g)                              # gamma as bits = its upcast as float32
    a, b = np.empty_like(x), np.empty_like(x)
    _rms2(lib, x, gbits, a)
    _rms2(lib, x, to_float32(gbits), b)
    assert np.array_equal(a, b)
    bits = np.zeros((n, h), np.uint16)              # the projections' input, in the same pass
    _rms2(lib, x, g, a, bits=bits)
    assert np.array_equal(bits, to_bits(a))
    r0 = rng.standard_normal((n, h)).astype(np.float32)
    resid, o = r0.copy(), np.empty_like(x)          # residual folded in
    want_r = r0 + x
    _rms2(lib, x, g, o, resid=resid, bits=bits)
    assert np.array_equal(resid, want_r)
    np.testing.assert_allclose(o, kernels_lm.rmsnorm(want_r, g, eps, np.empty_like(x)),
                               rtol=2e-6, atol=1e-7)
    assert np.array_equal(bits, to_bits(o))
    resid = r0.copy()                               # out is resid (the post-norm layout)
    _rms2(lib, x, g, resid, resid=resid)
    assert np.array_equal(resid, o)


@pytest.mark.parametrize("act,kind", [("silu", 0), ("gelu_pytorch_tanh", 2), ("relu", 3)])
def test_gated_matches_the_xp_version(lib, xp_path, act, kind):
    rng = np.random.default_rng(kind)
    n, m = 29, 40
    gu = (rng.standard_normal((n, 2 * m)) * 4).astype(np.float32)
    gu[0, :3] = [0.0, -0.0, 50.0]
    ref = kernels_lm.gated_act(gu, None, None, act, np.empty((n, m), np.float32))
    out = np.full((n, m), np.nan, np.float32)
    lib.lm_gated(ptr(gu), ptr(out), n, m, kind, ptr(out), 0)
    # exp / tanh of glibc against NumPy's: a few float32 ulps of the product's inputs (the
    # tanh GELU cancels 1 + tanh for large negative gates, so relative to |gate * up|)
    scale = np.abs(gu[:, :m] * gu[:, m:]) + np.abs(ref)
    assert np.all(np.abs(out - ref) <= 4e-7 * scale + 1e-30), np.abs(out - ref).max()
    if kind == 3:
        assert np.array_equal(out, ref)
    from semzo.model.storage import to_bits
    bits = np.zeros((n, m), np.uint16)                 # the bfloat16 bits of out, same kernel
    out2 = np.full((n, m), np.nan, np.float32)
    lib.lm_gated(ptr(gu), ptr(out2), n, m, kind, ptr(bits), 1)
    assert np.array_equal(out2, out) and np.array_equal(bits, to_bits(out))
    xb = np.zeros((n, m), np.uint16)                   # the xp path writes them too
    kernels_lm.gated_act(gu, None, None, act, np.empty((n, m), np.float32), xb)
    assert np.array_equal(xb, to_bits(ref))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rot_dims,bias,past", [(8, False, 0), (4, True, 3), (0, True, 2)])
def test_rope_split_is_the_xp_version_bit_for_bit(lib, xp_path, rot_dims, bias, past, packed,
                                                  dtype):
    """GQA (6 query heads, 2 kv heads), head dim 8, partial rotary (4 of 8 dims), biases,
    caches written at an offset: the same bits as the xp version, rows outside untouched.
    Packed: qkv holds only some rows of the padded layout (the others zeros): the xp
    version's scatter and the kernel's row map give the padded layout's bits. float16
    activations (lm_rope_split_h, the biases passed as their exact float32 upcast): the same
    float32 operations, one rounding to float16."""
    rng = np.random.default_rng(rot_dims + past)
    b, t, nh, nkv, d, tc = 3, 5, 6, 2, 8, 11
    w = (nh + 2 * nkv) * d
    qkv = (rng.standard_normal((b * t, w)) * 2).astype(dtype)
    rows = np.array([0, 1, 2, 5, 6, 7, 8, 9, 12], np.int64)
    if packed:
        qkv[np.setdiff1d(np.arange(b * t), rows)] = 0.0
    rmap = np.full(b * t, -1, np.int64)
    rmap[rows] = np.arange(len(rows))
    biases = tuple(rng.standard_normal(k * d).astype(dtype) for k in (nh, nkv, nkv)) \
        if bias else None
    pos = (np.arange(t)[None, :] + past + np.arange(b)[:, None]).astype(np.int64)
    h2 = rot_dims // 2
    if h2:
        ang = np.arange(20, dtype=np.float32)[:, None] * (0.3 ** np.arange(h2, dtype=np.float32))
        cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    else:
        cos = sin = None
    q0 = np.full((b, nh, t, d), 7.0, dtype)
    k0 = rng.standard_normal((b, nkv, tc, d)).astype(dtype)
    v0 = rng.standard_normal((b, nkv, tc, d)).astype(dtype)
    q, k, v = q0.copy(), k0.copy(), v0.copy()
    kernels_lm.rope_split(qkv, biases, pos, cos, sin, nh, nkv, d, q, k, v, past)
    if packed:                                          # the xp version's scatter
        q2, k2, v2 = q0.copy(), k0.copy(), v0.copy()
        kernels_lm.rope_split(np.ascontiguousarray(qkv[rows]), biases, pos, cos, sin, nh, nkv,
                              d, q2, k2, v2, past, rows)
        assert np.array_equal(q2, q) and np.array_equal(k2, k) and np.array_equal(v2, v)
    src = np.ascontiguousarray(qkv[rows]) if packed else qkv
    bcat = np.concatenate(biases).astype(np.float32) if bias else np.zeros(1, np.float32)
    cs = cos if h2 else np.zeros((1, 1), np.float32)
    sn = sin if h2 else np.zeros((1, 1), np.float32)
    qc, kc, vc = q0.copy(), k0.copy(), v0.copy()
    fn = lib.lm_rope_split if dtype == np.float32 else lib.lm_rope_split_h
    fn(ptr(src), ptr(bcat), int(bias), ptr(pos), ptr(cs), ptr(sn), h2, ptr(qc), ptr(kc),
       ptr(vc), b, t, nh, nkv, d, tc, past, ptr(rmap), int(packed))
    for got, want in ((qc, q), (kc, k), (vc, v)):
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    outside = np.ones(tc, bool)
    outside[past:past + t] = False
    assert np.array_equal(kc[:, :, outside], k0[:, :, outside])     # the cache's other rows


@pytest.mark.parametrize("packed", [False, True])
def test_heads_to_rows_is_the_layout_copy_and_take(lib, packed):
    """lm_heads_to_rows and kernels_lm.heads_to_rows: the batched product's (B, nkv, g T, d)
    to rows (B T or the packed ones, heads kv g + gg), bit for bit as the layout copy into
    (B, T, nh, d) and the take that the forward did before."""
    rng = np.random.default_rng(int(packed))
    b, nkv, g, t, d = 3, 2, 3, 5, 4
    tmp = rng.standard_normal((b, nkv, g * t, d)).astype(np.float32)
    ctx = np.empty((b, t, nkv * g, d), np.float32)
    ctx.reshape(b, t, nkv, g, d).transpose(0, 2, 3, 1, 4)[...] = tmp.reshape(b, nkv, g, t, d)
    ref = ctx.reshape(b * t, nkv * g * d)
    rows = np.array([0, 3, 4, 7, 8, 14], np.int64) if packed else None
    if packed:
        ref = ref[rows]
    got = kernels_lm.heads_to_rows(tmp, rows, t, g, np.empty_like(ref))
    assert np.array_equal(got, ref)
    out = np.full_like(ref, np.nan)
    bits = np.zeros(ref.shape, np.uint16)
    lib.lm_heads_to_rows(ptr(tmp), ptr(out), ptr(rows if packed else tmp), int(packed),
                         ref.shape[0], t, nkv, g, d, ptr(bits), 1)
    assert np.array_equal(out, ref)
    from semzo.model.storage import to_bits
    assert np.array_equal(bits, to_bits(ref))
    xb = np.zeros(ref.shape, np.uint16)
    kernels_lm.heads_to_rows(tmp, rows, t, g, np.empty_like(ref), xb)
    assert np.array_equal(xb, to_bits(ref))


def _softmax_c(lib, s, maskf, scale, rows, tq, tk, bdiv, past, window, causal,
               kernel="lm_softmax_row"):
    """lm_softmax_row (block per row) or lm_softmax_warp (warp per row, the row held in an
    array): mask and scale, max, exp, sum and divide, one row at a time."""
    getattr(lib, kernel)(ptr(s), ptr(maskf), rows, tq, tk, bdiv, past, window, causal, scale)


SOFTMAX_KERNELS = ("lm_softmax_row", "lm_softmax_warp")


@pytest.mark.parametrize("kernel", SOFTMAX_KERNELS)
@pytest.mark.parametrize("past,window", [(0, 0), (3, 0), (2, 4)])
def test_attn_softmax_matches_the_xp_version(lib, xp_path, past, window, kernel):
    """Causal, padded keys (a row left with no key: zeros), grouped queries (2 per kv head),
    a sliding window; masked entries exactly 0 as in the xp version."""
    rng = np.random.default_rng(past * 10 + window)
    b, nkv, grp, tq = 3, 2, 2, 5
    tk = past + tq
    s0 = (rng.standard_normal((b * nkv, grp, tq, tk)) * 5).astype(np.float32)
    maskf = np.ones((b, tk), np.float32)
    maskf[1, : tk - 2] = 0.0                  # batch 1: only the last two keys are real
    maskf[2, :] = 0.0                         # batch 2: nothing to attend
    scale = 0.37
    ref = kernels_lm.attn_softmax(s0.copy(), maskf, scale, nkv, past, window or None)
    s = s0.copy()
    _softmax_c(lib, s, maskf, scale, b * nkv * grp * tq, tq, tk, grp * nkv, past, window, 1,
               kernel)
    assert np.array_equal(s == 0, ref == 0)
    np.testing.assert_allclose(s, ref, rtol=2e-6, atol=1e-7)
    assert np.all(s[2 * nkv:] == 0)           # batch 2's rows: zeros
    assert np.any(ref > 0)


def test_entry_points_decline_what_they_do_not_cover(monkeypatch):
    """Cases the kernels do not take go back to the xp version (False), before any CuPy use:
    turned off, the erf GELU."""
    monkeypatch.setenv("SEMZO_GPU_FUSED", "0")
    assert not kernels_gpu.enabled()
    x = np.zeros((2, 4), np.float32)
    assert kernels_gpu.rmsnorm(x, np.ones(4, np.float32), 1e-6, x) is False
    monkeypatch.setenv("SEMZO_GPU_FUSED", "1")
    assert kernels_gpu.enabled()
    assert kernels_gpu.gated(np.zeros((2, 8), np.float32), 1, np.zeros((2, 4))) is False


def test_cpu_arrays_never_reach_the_fused_module(monkeypatch):
    """NumPy arrays of any dtype keep the CPU paths (the fused module is CuPy only)."""
    def boom(*a, **k):
        raise AssertionError("fused kernels called with NumPy arrays")
    monkeypatch.setattr(kernels_lm, "_fused", boom)
    x = np.ones((3, 4), np.float16)
    kernels_lm.rmsnorm(x, np.ones(4, np.float16), 1e-6, np.empty_like(x))
    gu = np.ones((3, 8), np.float16)
    kernels_lm.gated_act(gu, None, None, "silu", np.empty((3, 4), np.float16))


def test_source_path_is_the_one_tests_build():
    assert Path(kernels_gpu.__file__).name == "kernels_gpu.py"
    assert "lm_rope_split" in kernels_gpu.cuda_source()


@pytest.mark.parametrize("kernel", SOFTMAX_KERNELS)
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_masked_softmax_matches_the_xp_version(lib, xp_path, causal, kernel):
    """kernels.masked_softmax (the encoder's, and GPT-2's): padding mask, optionally causal;
    s (B*heads, T, T) is viewed as (B*heads, 1, T, T)."""
    rng = np.random.default_rng(int(causal))
    b, heads, t = 3, 4, 6
    s0 = (rng.standard_normal((b * heads, t, t)) * 4).astype(np.float32)
    maskf = np.ones((b, t), np.float32)
    maskf[1, 4:] = 0.0
    maskf[2, :] = 0.0
    ref = kernels.masked_softmax(s0.copy(), maskf, 0.125, heads, causal)
    s = s0.copy()
    _softmax_c(lib, s, maskf, 0.125, b * heads * t, t, t, heads, 0, 0, int(causal), kernel)
    assert np.array_equal(s == 0, ref == 0)
    np.testing.assert_allclose(s, ref, rtol=2e-6, atol=1e-7)


def test_layernorm_matches_the_xp_version(lib, xp_path):
    rng = np.random.default_rng(5)
    n, h, eps = 23, 48, 1e-12
    x = (rng.standard_normal((n, h)) * 2 + 0.5).astype(np.float32)
    g = rng.standard_normal(h).astype(np.float32)
    bt = rng.standard_normal(h).astype(np.float32)
    ref = kernels.layernorm(x, g, bt, eps, out=np.empty_like(x))
    out = np.full_like(x, np.nan)
    lib.lm_layernorm_row(ptr(x), ptr(g), ptr(bt), ptr(out), n, h, eps)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)
    y = x.copy()                                              # in place (out is x)
    lib.lm_layernorm_row(ptr(y), ptr(g), ptr(bt), ptr(y), n, h, eps)
    assert np.array_equal(y, out)


def test_add_bias_is_the_xp_version_bit_for_bit(lib, xp_path):
    """bias_residual_layernorm's residual update, rounded as resid += x; resid += bias."""
    rng = np.random.default_rng(6)
    n, h = 9, 16
    r0, x = (rng.standard_normal((n, h)).astype(np.float32) for _ in range(2))
    bias = rng.standard_normal(h).astype(np.float32)
    want = r0.copy()
    want += x
    want += bias
    got = r0.copy()
    lib.lm_add_bias(ptr(got), ptr(x), ptr(bias), n, h)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("act,kind", [("gelu", 0), ("gelu_new", 1), ("relu", 2), (None, 3)])
def test_bias_act_matches_the_xp_version(lib, xp_path, act, kind):
    """The erf GELU is kernels._xp_erf's rational function with the same float32 constants,
    operation for operation (bit for bit here: no transcendental function); tanh to rounding."""
    assert kernels._ACT[act] == kind
    rng = np.random.default_rng(kind + 10)
    n, f = 17, 33
    x0 = (rng.standard_normal((n, f)) * 3).astype(np.float32)
    x0[0, :4] = [0.0, 9.0, -9.0, 1e-30]
    bias = rng.standard_normal(f).astype(np.float32)
    ref = kernels.bias_act(x0.copy(), bias, act)
    got = x0.copy()
    lib.lm_bias_act(ptr(got), ptr(bias), n, f, kind)
    if kind == 1:
        scale = np.abs(x0 + bias) + np.abs(ref)
        assert np.all(np.abs(got - ref) <= 4e-7 * scale + 1e-30)
    else:
        assert np.array_equal(got, ref)


def test_to_bf16_is_to_bits_bit_for_bit(lib):
    """The activations' float32 -> bfloat16 kernel of model.matmul = "bfloat16": ties to
    even, subnormals, infinities, NaN (kept quiet) exactly as storage.to_bits."""
    from semzo.model.storage import to_bits
    r = np.random.default_rng(9)
    v = (r.standard_normal(50_000) * 4).astype(np.float32)
    u = v.view(np.uint32)
    u[:500] = (u[:500] & 0xFFFF0000) | 0x8000
    u[500:510] = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 1, 0x8000,
                  0x807F8000, 0x7F7FFFFF, 0x3F808000]
    out = np.empty(v.shape, np.uint16)
    lib.lm_to_bf16(ptr(v), ptr(out), v.size)
    assert np.array_equal(out, to_bits(v))


@pytest.fixture(scope="module")
def lm_params() -> dict:
    """Every kernel's parameter types, from the source's PTX (NVRTC)."""
    return ptx_params(kernels_gpu.cuda_source())


@pytest.fixture
def c_launches(lib, lm_params, monkeypatch) -> list:
    """kernels_gpu's entry points on the CPU: NumPy stands in for CuPy and every kernel launch
    runs the C build's function (serially) with the same arguments, after they are held to
    the kernel's parameter types in the PTX (number, size, kind: what CuPy's packing needs);
    returns the list of (kernel, blocks, threads) launched."""
    import sys
    import types
    launched: list = []

    def fake(name):
        def launch(grid, block, args):
            check_launch(lm_params, name, args)
            launched.append((name, grid[0], block[0]))
            c_args = [a.ctypes.data if isinstance(a, np.ndarray) and a.ndim else
                      (a.item() if isinstance(a, np.generic) else a) for a in args]
            getattr(lib, name)(*c_args)
        return launch

    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        ascontiguousarray=np.ascontiguousarray, full=np.full, arange=np.arange,
        zeros=np.zeros, concatenate=np.concatenate, int64=np.int64, float32=np.float32))
    monkeypatch.setattr(kernels_gpu, "_kernels",
                        lambda: (None, {n: fake(n) for n in kernels_gpu.KERNELS}))
    monkeypatch.setattr(kernels_gpu, "_ROWMAP", [])
    monkeypatch.setattr(kernels_gpu, "_dummy", lambda: np.zeros((1, 1), np.float32))
    return launched


def test_packed_rows_entry_points_launch_one_kernel_per_destination(c_launches, xp_path):
    """kernels_gpu.rope_split with packed rows (the row map built once for the same rows
    array, then reused) and heads_to_rows on the CPU through the C build: the xp version's
    bits, with no zero-filled copy of qkv and no take."""
    rng = np.random.default_rng(9)
    b, t, nh, nkv, d = 2, 6, 4, 2, 8
    w = (nh + 2 * nkv) * d
    rows = np.array([0, 1, 2, 3, 6, 7], np.int64)
    packed = rng.standard_normal((len(rows), w)).astype(np.float32)
    full = np.zeros((b * t, w), np.float32)
    full[rows] = packed
    pos = np.tile(np.arange(t, dtype=np.int64), (b, 1))
    ang = np.arange(8, dtype=np.float32)[:, None] * (0.5 ** np.arange(d // 2, dtype=np.float32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def bufs():
        return (np.zeros((b, nh, t, d), np.float32), np.zeros((b, nkv, t, d), np.float32),
                np.zeros((b, nkv, t, d), np.float32))
    q, k, v = bufs()
    kernels_lm.rope_split(full, None, pos, cos, sin, nh, nkv, d, q, k, v, 0)    # reference
    for _ in range(2):
        q2, k2, v2 = bufs()
        assert kernels_gpu.rope_split(packed, None, pos, cos, sin, nh, nkv, d, q2, k2, v2, 0,
                                      rows) is True
        assert np.array_equal(q2, q) and np.array_equal(k2, k) and np.array_equal(v2, v)
        assert kernels_gpu._ROWMAP[0] is rows
    assert [n for n, *_ in c_launches] == ["lm_rope_split"] * 2      # one launch a call
    m = kernels_gpu._ROWMAP[2]
    assert list(m) == [0, 1, 2, 3, -1, -1, 4, 5, -1, -1, -1, -1]
    tmp = rng.standard_normal((b, nkv, (nh // nkv) * t, d)).astype(np.float32)
    out = np.empty((len(rows), nh * d), np.float32)
    bits = np.zeros(out.shape, np.uint16)
    assert kernels_gpu.heads_to_rows(tmp, rows, t, nh // nkv, out, bits) is True
    ref = np.empty_like(out)
    kernels_lm.heads_to_rows(tmp, rows, t, nh // nkv, ref)           # NumPy: copy and take
    assert np.array_equal(out, ref)
    from semzo.model.storage import to_bits
    assert np.array_equal(bits, to_bits(ref))
    gu = rng.standard_normal((5, 8)).astype(np.float32)               # gated with bits
    inter, ib = np.empty((5, 4), np.float32), np.zeros((5, 4), np.uint16)
    assert kernels_gpu.gated(gu, 0, inter, ib) is True
    assert np.array_equal(ib, to_bits(inter))
    assert kernels_gpu.gated(gu, 0, inter, np.zeros((5, 3), np.uint16)) is False
    assert kernels_gpu.heads_to_rows(tmp, rows, t + 1, nh // nkv, out) is False   # declined


@pytest.mark.parametrize("tk", [5, 256, 257])
def test_attn_softmax_entry_point_picks_the_kernel_by_row_length(c_launches, xp_path, tk):
    """kernels_gpu.attn_softmax on the CPU, its launches served by the C build: rows of up to
    32 x WARP_COLS keys take the warp kernel with a warp for every row, longer ones the block
    kernel with a block for every row; either gives the xp version's softmax."""
    launched = c_launches
    rng = np.random.default_rng(tk)
    b, nkv, grp, tq = 2, 2, 3, 4
    past = tk - tq
    s0 = (rng.standard_normal((b * nkv, grp, tq, tk)) * 3).astype(np.float32)
    maskf = np.ones((b, tk), np.float32)
    maskf[1, :2] = 0.0
    ref = kernels_lm.attn_softmax(s0.copy(), maskf, 0.2, nkv, past, None)
    s = s0.copy()
    assert kernels_gpu.attn_softmax(s, maskf, 0.2, nkv, past, 0) is True
    rows = b * nkv * grp * tq
    ((name, grid, block),) = launched
    if tk <= 32 * kernels_gpu.WARP_COLS:
        assert name == "lm_softmax_warp" and grid * block // 32 >= rows
    else:
        assert name == "lm_softmax_row" and grid == rows and block % 32 == 0
    assert np.array_equal(s == 0, ref == 0)
    np.testing.assert_allclose(s, ref, rtol=2e-6, atol=1e-7)


# ------------------------------------------------------------------- float16 activations
def _same_half(a: np.ndarray, b: np.ndarray) -> bool:
    """float16 arrays equal bit for bit, NaN anywhere the other is NaN (payloads aside: NumPy
    keeps a NaN's payload bits, the kernels' conversion makes it the canonical quiet NaN)."""
    na, nb = np.isnan(a), np.isnan(b)
    return bool(np.array_equal(na, nb) and
                np.array_equal(a[~na].view(np.uint16), b[~nb].view(np.uint16)))


def _every_half() -> np.ndarray:
    return np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)


def test_add_bias_h_rounds_each_add_as_the_xp_version(lib, xp_path):
    """float16 activations: ``resid += x; resid += bias`` each rounded to float16, for every
    float16 value of resid (subnormals, infinities, NaN) against random x and a float16 bias
    passed as its exact float32 upcast: bit for bit (this checks the C build's float16
    conversions both ways, ties to even included)."""
    rng = np.random.default_rng(21)
    r0 = _every_half().reshape(-1, 64).copy()
    n, h = r0.shape
    x = (rng.standard_normal((n, h)) * np.exp2(rng.integers(-26, 16, (n, h)))).astype(
        np.float16)
    bias = (rng.standard_normal(h) * 1e-3).astype(np.float16)
    bias[:4] = [0.0, 6e-8, -65504.0, 1024.0]
    want = r0.copy()
    kernels.bias_residual_layernorm(x, bias, want, np.ones(h, np.float16),
                                    np.zeros(h, np.float16), 1e-5, np.empty_like(want))
    got = r0.copy()
    b32 = bias.astype(np.float32)               # kept alive across the call
    lib.lm_add_bias_h(ptr(got), ptr(x), ptr(b32), n, h)
    assert _same_half(got, want)
    ties = r0.astype(np.float32) + x.astype(np.float32)
    assert np.any(ties != ties.astype(np.float16).astype(np.float32))   # rounding exercised


@pytest.mark.parametrize("act,kind", [("gelu", 0), ("gelu_new", 1), ("relu", 2), (None, 3)])
def test_bias_act_h_matches_the_xp_version(lib, xp_path, act, kind):
    """float16 x: the float32 arithmetic of the float32 kernel, stored once as float16; the
    erf GELU, relu and none bit for bit (every float16 input), tanh GELU within one float16
    rounding."""
    x0 = _every_half().reshape(-1, 128).copy()
    n, f = x0.shape
    bias = np.random.default_rng(kind).standard_normal(f).astype(np.float16)
    bias[::3] = 0.0
    ref = kernels.bias_act(x0.copy(), bias, act)
    got = x0.copy()
    b32 = bias.astype(np.float32)               # kept alive across the call
    lib.lm_bias_act_h(ptr(got), ptr(b32), n, f, kind)
    if kind == 1:
        # tanh (glibc's here, NumPy's in the reference) to float32 rounding, which 1 + tanh
        # near -1 magnifies (as in the float32 test), then one float16 rounding
        fin = np.isfinite(ref)
        assert np.array_equal(np.isnan(got), np.isnan(ref))
        r32, g32 = ref[fin].astype(np.float32), got[fin].astype(np.float32)
        t = np.abs((x0.astype(np.float32) + bias.astype(np.float32))[fin])
        assert np.all(np.abs(g32 - r32) <= np.abs(r32) * 2.0 ** -10 + 4e-7 * t + 2.0 ** -24)
        assert np.mean(g32 == r32) > 0.99
    else:
        assert _same_half(got, ref)


def test_layernorm_h_matches_the_xp_version(lib, xp_path):
    """float16 x and out, float32 arithmetic (sums in the kernel's order), one rounding to
    float16: within one float16 ulp of the xp version, nearly all bit for bit; in place."""
    rng = np.random.default_rng(8)
    n, h, eps = 31, 384, 1e-12
    x = (rng.standard_normal((n, h)) * 3 + 0.25).astype(np.float16)
    g = rng.standard_normal(h).astype(np.float16)
    bt = rng.standard_normal(h).astype(np.float16)
    ref = kernels.layernorm(x, g, bt, eps, out=np.empty_like(x))
    out = np.full_like(x, np.nan)
    g32, bt32 = g.astype(np.float32), bt.astype(np.float32)     # kept alive across the calls
    lib.lm_layernorm_row_h(ptr(x), ptr(g32), ptr(bt32), ptr(out), n, h, eps)
    np.testing.assert_allclose(out.astype(np.float32), ref.astype(np.float32), rtol=2e-3,
                               atol=2e-3)
    assert np.mean(out.view(np.uint16) == ref.view(np.uint16)) > 0.95
    y = x.copy()                                              # in place (out is x)
    lib.lm_layernorm_row_h(ptr(y), ptr(g32), ptr(bt32), ptr(y), n, h, eps)
    assert np.array_equal(y.view(np.uint16), out.view(np.uint16))


@pytest.mark.parametrize("causal,past,window", [(False, 0, 0), (True, 0, 0), (True, 2, 3)])
def test_softmax_h_matches_the_xp_version(lib, xp_path, causal, past, window):
    """float16 scores: the block kernel (which recomputes its float32 intermediates from the
    scores) and the warp kernel give the same bits in C, within one float16 rounding of the
    xp versions (the encoder's masked_softmax; the decoders' attn_softmax with a cache
    offset and a sliding window), masked entries exactly 0."""
    rng = np.random.default_rng(past + 3 * window + int(causal))
    b, nkv, grp, tq = 3, 2, 2, 6
    tk = past + tq
    s0 = (rng.standard_normal((b * nkv, grp, tq, tk)) * 6).astype(np.float16)
    maskf = np.ones((b, tk), np.float32)
    maskf[1, : tk - 2] = 0.0
    maskf[2, :] = 0.0
    if causal:
        ref = kernels_lm.attn_softmax(s0.copy(), maskf, 0.3, nkv, past, window or None)
        bdiv = grp * nkv
    else:
        s0 = s0.reshape(b * nkv * grp, 1, tq, tk)[:, 0]
        ref = kernels.masked_softmax(s0.copy(), maskf, 0.3, nkv * grp, False)
        bdiv = nkv * grp
    got = {}
    for kernel in ("lm_softmax_row_h", "lm_softmax_warp_h"):
        s = np.ascontiguousarray(s0.copy())
        _softmax_c(lib, s, maskf, 0.3, b * nkv * grp * tq, tq, tk, bdiv, past, window,
                   int(causal), kernel)
        got[kernel] = s
        assert np.array_equal(s == 0, ref == 0)
        np.testing.assert_allclose(s.astype(np.float32), ref.astype(np.float32), rtol=2e-3,
                                   atol=1e-4)
    assert np.array_equal(got["lm_softmax_row_h"].view(np.uint16),
                          got["lm_softmax_warp_h"].view(np.uint16))
    assert np.any(ref > 0)


def test_activation_dtypes_pick_the_kernel_variant():
    """float32 activations take the float32 kernels, float16 ones the _h variants; mixed
    dtypes, bfloat16 bits and strided views go back to the xp versions (None)."""
    f32, f16 = np.zeros((2, 4), np.float32), np.zeros((2, 4), np.float16)
    assert kernels_gpu._act_suffix(f32, f32) == ""
    assert kernels_gpu._act_suffix(f16, f16) == "_h"
    assert kernels_gpu._act_suffix(f32, f16) is None
    assert kernels_gpu._act_suffix(np.zeros((2, 4), np.uint16)) is None
    assert kernels_gpu._act_suffix(np.zeros((4, 4), np.float16)[:, ::2]) is None
    for name in ("lm_softmax_row", "lm_softmax_warp", "lm_layernorm_row", "lm_add_bias",
                 "lm_bias_act", "lm_rmsnorm_row", "lm_gated", "lm_rope_split",
                 "lm_heads_to_rows"):
        assert name in kernels_gpu.KERNELS and name + "_h" in kernels_gpu.KERNELS



def _close_half(got: np.ndarray, ref: np.ndarray, share: float = 0.95) -> None:
    """float16 results within one float16 rounding of the reference (float32 sums or
    transcendental functions in another order or library), most of them bit for bit."""
    np.testing.assert_allclose(got.astype(np.float32), ref.astype(np.float32), rtol=2e-3,
                               atol=1e-4)
    assert np.mean(got.view(np.uint16) == ref.view(np.uint16)) >= share


def test_rmsnorm_h_matches_the_xp_version(lib, xp_path):
    """float16 x, out and resid (gamma upcast to float32 by the entry point): the norm within
    a float16 rounding of the xp version, in place the same bits; the residual folded in is
    ``resid += x`` rounded to float16 (bit for bit) and the norm is taken of that."""
    rng = np.random.default_rng(30)
    n, h, eps = 37, 96, 1e-6
    x = (rng.standard_normal((n, h)) * 3).astype(np.float16)
    g = rng.standard_normal(h).astype(np.float16)
    g32 = g.astype(np.float32)
    spare = np.zeros(1, np.uint16)

    def rms(x, out, resid=None):
        lib.lm_rmsnorm_row_h(ptr(x), ptr(x if resid is None else resid), int(resid is not None),
                             ptr(g32), ptr(spare), 0, ptr(out), ptr(spare), 0, n, h, eps)

    ref = kernels_lm.rmsnorm(x, g, eps, np.empty_like(x))
    out = np.full_like(x, np.nan)
    rms(x, out)
    _close_half(out, ref)
    y = x.copy()
    rms(y, y)
    assert np.array_equal(y.view(np.uint16), out.view(np.uint16))
    r0 = (rng.standard_normal((n, h)) * 2).astype(np.float16)
    want_r, want_o = r0.copy(), np.empty_like(x)
    kernels_lm.residual_rmsnorm(x, None, want_r, g, eps, want_o)
    resid, o = r0.copy(), np.empty_like(x)
    rms(x, o, resid)
    assert np.array_equal(resid.view(np.uint16), want_r.view(np.uint16))
    _close_half(o, want_o)


@pytest.mark.parametrize("act,kind", [("silu", 0), ("gelu_pytorch_tanh", 2), ("relu", 3)])
def test_gated_h_matches_the_xp_version(lib, xp_path, act, kind):
    """float16 gate|up and out: float32 arithmetic, one float16 rounding; relu bit for bit
    over every float16 gate value, silu and the tanh GELU within a float16 rounding."""
    gate = _every_half().reshape(-1, 128)
    n, m = gate.shape
    up = np.random.default_rng(kind).standard_normal((n, m)).astype(np.float16)
    gu = np.ascontiguousarray(np.concatenate([gate, up], axis=1))
    with np.errstate(all="ignore"):
        ref = kernels_lm.gated_act(gu, None, None, act, np.empty((n, m), np.float16))
    out = np.full((n, m), np.nan, np.float16)
    lib.lm_gated_h(ptr(gu), ptr(out), n, m, kind, ptr(out), 0)
    if kind == 3:
        assert _same_half(out, ref)
        return
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    fin = np.isfinite(ref) & np.isfinite(gate)
    r32, o32 = ref[fin].astype(np.float32), out[fin].astype(np.float32)
    scale = np.abs(gate.astype(np.float32) * up.astype(np.float32))[fin]
    assert np.all(np.abs(o32 - r32) <= np.abs(r32) * 2.0 ** -10 + 4e-7 * scale + 2.0 ** -24)
    assert np.mean(o32 == r32) > 0.99


@pytest.mark.parametrize("packed", [False, True])
def test_heads_to_rows_h_copies_the_bits(lib, packed):
    """lm_heads_to_rows_h: the float16 gather, the bits of kernels_lm.heads_to_rows (every
    float16 value, NaN payloads included: a copy, no conversion)."""
    b, nkv, g, t, d = 8, 2, 4, 32, 32     # 65536 values
    tmp = _every_half().reshape(b, nkv, g * t, d).copy()
    rows = np.array([0, 3, 4, 7, 8, 14, 40, 127], np.int64) if packed else None
    nr = b * t if rows is None else rows.size
    ref = kernels_lm.heads_to_rows(tmp, rows, t, g, np.empty((nr, nkv * g * d), np.float16))
    out = np.zeros_like(ref)
    lib.lm_heads_to_rows_h(ptr(tmp), ptr(out), ptr(rows if packed else tmp), int(packed), nr,
                           t, nkv, g, d)
    assert np.array_equal(out.view(np.uint16), ref.view(np.uint16))


def test_float16_entry_points_launch_the_h_kernels(c_launches, xp_path):
    """Every entry point with float16 activations on the CPU, its launches served by the C
    build: the _h kernel is launched (one launch a call) with the arguments in the order
    the kernel takes them, and the result is the xp version's on NumPy float16 (bit for bit
    where the arithmetic is elementwise and exact, else within a float16 rounding)."""
    rng = np.random.default_rng(77)
    n, h = 12, 40
    x = (rng.standard_normal((n, h)) * 2).astype(np.float16)
    g16, b16 = (rng.standard_normal(h).astype(np.float16) for _ in range(2))
    out = np.empty_like(x)
    assert kernels_gpu.layernorm(x, g16.astype(np.float32), b16.astype(np.float32), 1e-5,
                                 out) is True
    _close_half(out, kernels.layernorm(x, g16, b16, 1e-5, np.empty_like(x)), 0.9)
    r0 = (rng.standard_normal((n, h)) * 2).astype(np.float16)
    r, want = r0.copy(), r0.copy()
    assert kernels_gpu.add_bias(r, x, b16.astype(np.float32)) is True
    want += x
    want += b16
    assert np.array_equal(r.view(np.uint16), want.view(np.uint16))
    y, ref = x.copy(), kernels.bias_act(x.copy(), g16, "gelu")
    assert kernels_gpu.bias_act(y, g16.astype(np.float32), 0) is True
    assert _same_half(y, ref)
    o = np.empty_like(x)
    assert kernels_gpu.rmsnorm(x, g16, 1e-6, o) is True            # float16 gamma: upcast
    _close_half(o, kernels_lm.rmsnorm(x, g16, 1e-6, np.empty_like(x)), 0.9)
    r, want_r, want_o = r0.copy(), r0.copy(), np.empty_like(x)
    assert kernels_gpu.rmsnorm(x, g16, 1e-6, o, resid=r) is True
    kernels_lm.residual_rmsnorm(x, None, want_r, g16, 1e-6, want_o)
    assert np.array_equal(r.view(np.uint16), want_r.view(np.uint16))
    _close_half(o, want_o, 0.9)
    gu = (rng.standard_normal((n, 2 * h)) * 2).astype(np.float16)
    inter = np.empty((n, h), np.float16)
    assert kernels_gpu.gated(gu, 3, inter) is True
    assert _same_half(inter, kernels_lm.gated_act(gu, None, None, "relu",
                                                  np.empty((n, h), np.float16)))
    b, t, nh, nkv, d = 2, 6, 4, 2, 8
    rows = np.array([0, 1, 2, 3, 6, 7], np.int64)
    w = (nh + 2 * nkv) * d
    packed = rng.standard_normal((len(rows), w)).astype(np.float16)
    full = np.zeros((b * t, w), np.float16)
    full[rows] = packed
    biases = tuple(rng.standard_normal(k * d).astype(np.float16) for k in (nh, nkv, nkv))
    pos = np.tile(np.arange(t, dtype=np.int64), (b, 1))
    ang = np.arange(8, dtype=np.float32)[:, None] * (0.5 ** np.arange(d // 2, dtype=np.float32))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    want = [np.zeros(s, np.float16) for s in ((b, nh, t, d), (b, nkv, t, d), (b, nkv, t, d))]
    got = [np.zeros_like(a) for a in want]
    kernels_lm.rope_split(full, biases, pos, cos, sin, nh, nkv, d, *want, 0)
    assert kernels_gpu.rope_split(packed, biases, pos, cos, sin, nh, nkv, d, *got, 0,
                                  rows) is True
    assert all(np.array_equal(a.view(np.uint16), c.view(np.uint16)) for a, c in zip(got, want))
    tmp = rng.standard_normal((b, nkv, (nh // nkv) * t, d)).astype(np.float16)
    ctx = np.empty((len(rows), nh * d), np.float16)
    assert kernels_gpu.heads_to_rows(tmp, rows, t, nh // nkv, ctx) is True
    ref = kernels_lm.heads_to_rows(tmp, rows, t, nh // nkv, np.empty_like(ctx))
    assert np.array_equal(ctx.view(np.uint16), ref.view(np.uint16))
    assert kernels_gpu.heads_to_rows(tmp, rows, t, nh // nkv, ctx,
                                     np.zeros(ctx.shape, np.uint16)) is False   # no bits
    for tk in (7, 300):                                   # the warp and the block kernel
        s0 = (rng.standard_normal((b * nkv, 2, 3, tk)) * 3).astype(np.float16)
        maskf = np.ones((b, tk), np.float32)
        maskf[1, :2] = 0.0
        s = s0.copy()
        assert kernels_gpu.attn_softmax(s, maskf, 0.2, nkv, tk - 3, 0) is True
        ref = kernels_lm.attn_softmax(s0.copy(), maskf, 0.2, nkv, tk - 3, None)
        assert np.array_equal(s == 0, ref == 0)
        _close_half(s, ref, 0.9)
    names = [nm for nm, *_ in c_launches]
    assert names == ["lm_layernorm_row_h", "lm_add_bias_h", "lm_bias_act_h",
                     "lm_rmsnorm_row_h", "lm_rmsnorm_row_h", "lm_gated_h", "lm_rope_split_h",
                     "lm_heads_to_rows_h", "lm_softmax_warp_h", "lm_softmax_row_h"]
    assert kernels_gpu.layernorm(x, g16.astype(np.float32), b16.astype(np.float32), 1e-5,
                                 np.empty(x.shape, np.float32)) is False     # mixed types
