"""model.matmul = "bfloat16" on the CPU: the cuBLAS argument mapping of semzo.model.gemm
(checked by a column-major GEMM written out in NumPy on the raw buffers, as cuBLAS reads
them), the CPU's arithmetic (bfloat16-rounded inputs, float32 products and sums), the model's
projections and LM head taking it, the deck key and its refusals. The GPU side:
tests/test_decoder_gpu.py (cublasGemmEx and the conversion kernel on a device)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import make_model

from semzo.model import load_model
from semzo.model.gemm import CUBLAS_OP_N, CUBLAS_OP_T, gemm_args, matmul_bf16, round_bf16
from semzo.model.storage import to_bits, to_float32


def colmajor_gemm(ta, tb, m, n, k, a, lda, b, ldb, c, ldc):
    """C (m x n, column-major, leading dimension ldc) = op(A) @ op(B), as cuBLAS reads the
    flat buffers a, b, c (column-major with leading dimensions lda, ldb)."""
    def mat(buf, rows, cols, ld):
        return np.lib.stride_tricks.as_strided(buf, (rows, cols),
                                               (buf.itemsize, ld * buf.itemsize))
    opa = mat(a, k, m, lda).T if ta == CUBLAS_OP_T else mat(a, m, k, lda)
    opb = mat(b, n, k, ldb).T if tb == CUBLAS_OP_T else mat(b, k, n, ldb)
    cm = np.lib.stride_tricks.as_strided(c, (m, n), (c.itemsize, ldc * c.itemsize),
                                         writeable=True)
    cm[...] = opa.astype(np.float64) @ opb


@pytest.mark.parametrize("transposed", [True, False])
@pytest.mark.parametrize("pad", [0, 5])
def test_cublas_arguments_compute_the_row_major_product(transposed, pad):
    r = np.random.default_rng(0)
    n, k, o = 7, 5, 3
    x = r.standard_normal((n, k))
    w = r.standard_normal((o, k) if transposed else (k, o))
    wide = np.full((n, o + pad), -9.0)
    out = wide[:, :o]
    ta, tb, m, nn, kk, lda, ldb, ldc = gemm_args(x.shape, w.shape, out.shape,
                                                 wide.strides[0] // 8, transposed)
    flat = wide.reshape(-1)
    colmajor_gemm(ta, tb, m, nn, kk, w.reshape(-1), lda, x.reshape(-1), ldb, flat, ldc)
    assert np.allclose(out, x @ (w.T if transposed else w), rtol=1e-12, atol=1e-12)
    assert np.all(wide[:, o:] == -9.0)


def test_gemm_arguments_refuse_shapes_that_do_not_agree():
    with pytest.raises(ValueError, match="do not agree"):
        gemm_args((4, 5), (3, 6), (4, 3), 3, True)
    with pytest.raises(ValueError, match="do not agree"):
        gemm_args((4, 5), (3, 5), (4, 3), 2, True)
    assert gemm_args((4, 5), (5, 3), (4, 3), 3, False)[0] == CUBLAS_OP_N


def test_round_bf16_is_nearest_bfloat16():
    r = np.random.default_rng(1)
    x = (r.standard_normal(10_000) * 10).astype(np.float32)
    y = round_bf16(x)
    assert np.all(y.view(np.uint32) & 0xFFFF == 0)
    up = (y.view(np.uint32) + (1 << 16)).view(np.float32)
    dn = (y.view(np.uint32) - (1 << 16)).view(np.float32)
    d = np.abs(x.astype(np.float64) - y)
    assert np.all(d <= np.abs(x.astype(np.float64) - up))
    assert np.all(d <= np.abs(x.astype(np.float64) - dn))


@pytest.mark.parametrize("transposed", [True, False])
def test_cpu_arithmetic_is_rounded_inputs_float32_sums(transposed):
    r = np.random.default_rng(2)
    x = r.standard_normal((40, 64)).astype(np.float32)
    w = to_bits(r.standard_normal((24, 64) if transposed else (64, 24)).astype(np.float32))
    wf = to_float32(w).astype(np.float64)
    ref = round_bf16(x).astype(np.float64) @ (wf.T if transposed else wf)
    out = np.empty((40, 24), np.float32)
    assert matmul_bf16(x, w, out, transposed) is out
    assert np.abs(out - ref).max() <= 64 * 2.0 ** -24 * np.abs(ref).max()
    plain = x.astype(np.float64) @ (wf.T if transposed else wf)
    assert np.abs(out - plain).max() > 1e-4 * np.abs(plain).max()      # inputs were rounded


def test_matmul_bf16_refuses_float_weights_and_strided_rows():
    x = np.ones((3, 4), np.float32)
    with pytest.raises(ValueError, match="not the bits of x"):
        matmul_bf16(x, to_bits(np.ones((2, 4), np.float32)), np.empty((3, 2), np.float32),
                    xb=to_bits(np.ones((3, 5), np.float32)))
    with pytest.raises(ValueError, match="bfloat16 bits"):
        matmul_bf16(x, np.ones((2, 4), np.float32), np.empty((3, 2), np.float32))
    with pytest.raises(ValueError, match="contiguous rows"):
        matmul_bf16(x, to_bits(np.ones((2, 4), np.float32)),
                    np.empty((3, 4), np.float32)[:, ::2])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    d = tmp_path_factory.mktemp("gemm")
    return {k: make_model(d / k, kind=k, layers=2, hidden=32, heads=2)
            for k in ("llama", "llama_tied", "gpt2", "bert")}


def test_set_matmul_refuses_what_it_cannot_do(folders):
    with pytest.raises(ValueError, match="needs a decoder stored as bfloat16.*decoder, stored "
                                         "as float32"):
        load_model(folders["llama"]).set_matmul("bfloat16")
    with pytest.raises(ValueError, match="encoder, stored as bfloat16"):
        load_model(folders["bert"], dtype="bfloat16").set_matmul("bfloat16")
    with pytest.raises(ValueError, match="choose one of float32, bfloat16"):
        load_model(folders["llama"], dtype="bfloat16").set_matmul("float16")


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "gpt2"])
def test_decoder_projections_and_head_take_the_bf16_product(folders, monkeypatch, kind):
    """Every projection and the LM head go through matmul_bf16 (GPT-2's Conv1D weights as
    (in, out); q, k, v and gate, up of (out, in) weights through matmul_bf16_many, the bits
    of one matmul_bf16 each); the logits move from the float32-matmul ones by bfloat16
    rounding only; the next-token loss (the chunked head of the CPU) agrees with the
    logits' own."""
    from semzo.model import base, causal
    m = load_model(folders[kind], dtype="bfloat16")
    ids = np.random.default_rng(3).integers(2, m.config.vocab_size, size=(3, 10))
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    ref = m.logits(ids, mask).copy()
    m.set_matmul("bfloat16")
    seen = []

    def counted(x, w, out, transposed=True, xb=None):
        seen.append((w.shape, transposed))
        return matmul_bf16(x, w, out, transposed, xb)
    from semzo.model.gemm import matmul_bf16_many

    def counted_many(x, ws, outs, xb=None):
        seen.extend((w.shape, True) for w in ws)
        return matmul_bf16_many(x, ws, outs, xb)
    monkeypatch.setattr(base, "matmul_bf16", counted)
    monkeypatch.setattr(causal, "matmul_bf16", counted)
    monkeypatch.setattr(base, "matmul_bf16_many", counted_many)
    got = m.logits(ids, mask).copy()
    monkeypatch.setattr(base, "matmul_bf16_many", lambda x, ws, outs, xb=None: [
        counted(x, w, o, True, xb) for w, o in zip(ws, outs)])
    assert np.array_equal(m.logits(ids, mask), got)     # one matmul_bf16 a weight: the bits
    del seen[len(seen) // 2:]
    mats = [n for n, a in m.params.items() if a.ndim == 2 and "embed" not in n and "wte" not in
            n and "wpe" not in n and "lm_head" not in n]
    assert len(seen) == len(mats) + 1                  # each projection once, then the head
    assert seen[-1][0] == (m.config.vocab_size, m.config.hidden_size)
    assert all(t == (kind != "gpt2") for _, t in seen[:-1])
    valid = mask.astype(bool)
    d = np.abs(got - ref)[valid]
    scale = np.abs(ref[valid]).max()
    assert 1e-6 * scale < d.max() < 5e-2 * scale
    lp = got - got.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    tgt = ids[:, 1:]
    w = mask[:, 1:].astype(bool)
    want = -np.take_along_axis(lp[:, :-1], tgt[..., None], -1)[..., 0][w].mean()
    assert abs(m.next_token_loss(ids, mask) - want) < 1e-5 * abs(want)


def test_strided_batched_arguments_compute_attention_products():
    """batched_args on the attention layouts of the decoder (scores: q @ k-cache.T over the
    merged (batch, kv head) dimensions; context: probabilities @ v-cache), read back by a
    column-major strided-batched GEMM written out in NumPy on the raw buffers."""
    from semzo.model.gemm import batched_args
    r = np.random.default_rng(4)
    b, nkv, gt, d, cap, tk = 3, 2, 6, 4, 9, 7
    q = r.standard_normal((b, nkv, gt, d))
    kc = r.standard_normal((b, nkv, cap, d))
    cases = [(q, kc[:, :, :tk].transpose(0, 1, 3, 2), np.zeros((b, nkv, gt, tk))),
             (r.standard_normal((b, nkv, gt, tk)), kc[:, :, :tk], np.zeros((b, nkv, gt, d)))]
    for a, bb, c in cases:
        ta, tb, m, n, k, ld_b, st_b, ld_a, st_a, ldc, st_c, batch = batched_args(a, bb, c)
        assert batch == b * nkv
        base_a = a.reshape(-1) if a.flags.c_contiguous else kc.reshape(-1)
        base_b = kc.reshape(-1)
        flat_c = c.reshape(-1)
        off_b = (bb.__array_interface__["data"][0] - kc.__array_interface__["data"][0]) // 8
        for i in range(batch):
            colmajor_gemm(ta, tb, m, n, k, base_b[off_b + i * st_b:], ld_b,
                          base_a[i * st_a:], ld_a, flat_c[i * st_c:], ldc)
        assert np.allclose(c, a @ bb, rtol=1e-12, atol=1e-12)


def test_batched_args_refuse_what_does_not_merge():
    from semzo.model.gemm import batched_args, merged_batch
    x = np.zeros((3, 4, 5, 6))[:, ::2]
    assert merged_batch(np.zeros((3, 4, 5, 6))) == (12, 30)
    with pytest.raises(ValueError, match="do not merge"):
        merged_batch(np.zeros((3, 4, 5, 6)).transpose(1, 0, 2, 3))
    with pytest.raises(ValueError, match="do not agree"):
        batched_args(x, np.zeros((3, 2, 7, 2)), np.zeros((3, 2, 5, 2)))
    with pytest.raises(ValueError, match="neither its rows nor its columns"):
        batched_args(np.zeros((2, 4, 4))[:, ::2, ::2], np.zeros((2, 2, 3)),
                     np.zeros((2, 2, 3)))


def emulated_sgemm(calls: list):
    """A stand-in for gemm._sgemm: cuBLAS's column-major sgemm on the flat buffer under
    ``out`` (its leading dimension ldc), ``out = alpha op(A) op(B) + beta out``; records the
    arguments and the scalars in ``calls``."""
    def sgemm(w, x, out, args, alpha, beta):
        ta, tb, m, n, k, lda, ldb, ldc = args
        calls.append((args, float(alpha), float(beta)))
        base = out.base if out.base is not None else out
        off = (out.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // 4
        flat = base.reshape(-1)[off:]
        before = out.astype(np.float64)
        colmajor_gemm(ta, tb, m, n, k, w.reshape(-1), lda, x.reshape(-1), ldb, flat, ldc)
        out[...] = alpha * out.astype(np.float64) + beta * before
    return sgemm


@pytest.mark.parametrize("transposed", [True, False])
def test_matmul_f32_writes_a_column_slice_in_place(monkeypatch, transposed):
    """gemm.matmul_f32 (the GPU's float32 projections into q|k|v or gate|up column slices):
    its cuBLAS call, served here by the column-major emulation, writes the row-major product
    into the slice and nothing beside it; operands it does not take are declined untouched."""
    from semzo.model import gemm
    calls = []

    monkeypatch.setattr(gemm, "_sgemm", emulated_sgemm(calls))
    r = np.random.default_rng(2)
    n, k, o, wide_o = 6, 5, 3, 8
    x = r.standard_normal((n, k)).astype(np.float32)
    w = r.standard_normal((o, k) if transposed else (k, o)).astype(np.float32)
    wide = np.full((n, wide_o), -9.0, np.float32)
    out = wide[:, 2:2 + o]
    assert gemm.matmul_f32(x, w, out, transposed) is True
    assert calls and calls[0][0][-1] == wide_o                    # ldc: the row stride
    np.testing.assert_allclose(out, x.astype(np.float64) @ (w.T if transposed else w),
                               rtol=1e-6, atol=1e-6)
    assert np.all(wide[:, :2] == -9.0) and np.all(wide[:, 2 + o:] == -9.0)
    prev = out.astype(np.float64)                        # alpha and beta (LoRA's delta)
    assert gemm.matmul_f32(x, w, out, transposed, alpha=0.5, beta=1.0) is True
    np.testing.assert_allclose(out, prev + 0.5 * (x.astype(np.float64) @ (
        w.T if transposed else w)), rtol=1e-6, atol=1e-6)
    assert np.all(wide[:, :2] == -9.0) and np.all(wide[:, 2 + o:] == -9.0)
    n_calls = len(calls)
    assert gemm.matmul_f32(x.astype(np.float64), w, out, transposed) is False
    assert gemm.matmul_f32(np.asfortranarray(x), w, out, transposed) is False
    assert gemm.matmul_f32(x, w, wide[:, ::2][:, :o], transposed) is False   # strided columns
    assert len(calls) == n_calls


def test_lora_delta_on_the_gpu_path_is_two_sgemm_calls(monkeypatch):
    """base._lora_add off NumPy (a stand-in xp whose arrays are NumPy's, cuBLAS served by
    the column-major emulation): scale as the first call's alpha, the sum into the output
    column slice as the second's beta; the delta equals the NumPy path's to float32
    rounding and nothing beside the slice is written."""
    from types import SimpleNamespace

    from semzo.model import base as base_mod
    from semzo.model import gemm
    calls = []
    monkeypatch.setattr(gemm, "_sgemm", emulated_sgemm(calls))
    monkeypatch.setattr(base_mod, "matmul_f32", gemm.matmul_f32)
    r = np.random.default_rng(4)
    n, din, rank, dout = 5, 6, 2, 4
    x = r.standard_normal((n, din)).astype(np.float32)
    params = {"a": r.standard_normal((rank, din)).astype(np.float32),
              "b": r.standard_normal((dout, rank)).astype(np.float32)}
    model = SimpleNamespace(xp=SimpleNamespace(empty=np.empty), params=params,
                            dtype=np.dtype(np.float32), fparam=lambda name: params[name])
    spec = base_mod.LoraSpec("a", "b", 2.0)
    wide = np.full((n, dout + 3), 1.5, np.float32)
    out = wide[:, 1:1 + dout]
    base_mod.TransformerBase._lora_add(model, x, spec, out)
    assert [c[1:] for c in calls] == [(2.0, 0.0), (1.0, 1.0)]
    want = 1.5 + 2.0 * (x.astype(np.float64) @ params["a"].T) @ params["b"].T
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
    assert np.all(wide[:, 0] == 1.5) and np.all(wide[:, 1 + dout:] == 1.5)
