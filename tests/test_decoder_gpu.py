"""GPU-only: the CuPy path of the decoder families against the NumPy path (float32, float16
and bfloat16 storage; bfloat16 against NumPy bfloat16, the same weights and float32
arithmetic, within 1e-4 relative). Skipped, with the reason, only when cupy cannot be imported or sees no
CUDA device."""

from __future__ import annotations

import numpy as np
import pytest

try:
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no CUDA device")
except Exception as exc:  # noqa: BLE001 - any failure to reach a GPU means: skip
    pytest.skip(f"GPU-only tests: cupy with a CUDA device is not available ({exc})",
                allow_module_level=True)

import sys
from pathlib import Path

from safetensors.numpy import save_file

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import count_fused_launches

from semzo.model import load_model

CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 101,
       "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
       "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def tiny_llama(folder):
    import json

    from semzo.model.causal import expected_tensors
    from semzo.model.families import llama, read_spec
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CFG))
    spec = read_spec(llama, CFG, folder / "config.json")
    rng = np.random.default_rng(0)
    t = {n: (rng.standard_normal(s) * (0.1 if len(s) > 1 else 0.05) + (len(s) == 1))
         .astype(np.float32) for n, s, _ in expected_tensors(spec, "model.")}
    save_file(t, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 3e-2), ("bfloat16", 1e-4)])
def test_cupy_decoder_matches_numpy(tmp_path, dtype, tol):
    folder = tiny_llama(tmp_path / "m")
    cpu = load_model(folder, dtype="bfloat16" if dtype == "bfloat16" else "float32")
    gpu = load_model(folder, xp="cupy", dtype=dtype)
    ids = np.random.default_rng(1).integers(0, 101, size=(3, 20))
    mask = np.ones_like(ids)
    mask[1, 12:] = 0
    ref = cpu.logits(ids, mask)
    got = cp.asnumpy(gpu.logits(ids, mask))
    valid = mask.astype(bool)
    assert np.max(np.abs(got - ref)[valid]) / np.max(np.abs(ref[valid])) < tol
    assert abs(cpu.next_token_loss(ids, mask) - gpu.next_token_loss(ids, mask)) < 10 * tol
    cache = gpu.new_cache(3, 24)
    z = cp.asnumpy(gpu.forward_cached(ids[:, :8], cache))
    assert np.max(np.abs(z - ref[:, :8])) / np.max(np.abs(ref[:, :8])) < tol
    with pytest.raises(ValueError, match="1000000000"):
        gpu.logits(np.array([[1, 10**9]]), np.array([[1, 0]]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fused_kernels_run_and_match_the_generic_cupy_chains(tmp_path, monkeypatch, dtype):
    """The fused decoder kernels (semzo.model.kernels_gpu) compile and run on the device
    (every launch counted; float16 storage: the _h kernels), and the forward with them
    equals the forward with the generic CuPy chains (SEMZO_GPU_FUSED=0) to float32 rounding
    (the row kernels' sums are taken in their own order; the elementwise arithmetic is the
    same, uncontracted), float16 to a few float16 roundings; a cached forward at an offset
    (past > 0) too."""
    from semzo.model import kernels_gpu as fused
    folder = tiny_llama(tmp_path / "m")
    gpu = load_model(folder, xp="cupy", dtype=dtype)
    ids = np.random.default_rng(2).integers(0, 101, size=(3, 20))
    mask = np.ones_like(ids)
    mask[2, 15:] = 0
    launched = count_fused_launches(monkeypatch)
    on = cp.asnumpy(gpu.logits(ids, mask))
    cache = gpu.new_cache(3, 24)
    gpu.forward_cached(ids[:, :12], cache)
    on_c = cp.asnumpy(gpu.forward_cached(ids[:, 12:16], cache))
    assert not fused._FAILED, fused._FAILED
    # per layer and forward (three forwards): rope (q, k and v in one launch), softmax (at
    # most 20 keys: a warp a row), the context's rows, gated, rmsnorm x 2 (+ the final
    # norm); the padded forward
    # (5 of 60 rows padding) runs its blocks on the packed rows: rope_split and
    # heads_to_rows scatter and take them (no zero-filled copy, no fancy indexing)
    layers = CFG["num_hidden_layers"]
    assert gpu._pack_rows(cp.asarray(mask, dtype=cp.float32)) is not None
    sfx = "_h" if dtype == "float16" else ""
    for name, per in (("lm_rope_split", 1), ("lm_softmax_warp", 1), ("lm_heads_to_rows", 1),
                      ("lm_gated", 1),
                      ("lm_rmsnorm_row", 2)):
        assert launched.count(name + sfx) >= 3 * per * layers, (name, launched)
    n = len(launched)
    monkeypatch.setenv("SEMZO_GPU_FUSED", "0")
    off = cp.asnumpy(gpu.logits(ids, mask))
    cache = gpu.new_cache(3, 24)
    gpu.forward_cached(ids[:, :12], cache)
    off_c = cp.asnumpy(gpu.forward_cached(ids[:, 12:16], cache))
    assert len(launched) == n                      # off means off
    valid = mask.astype(bool)
    tol = 2e-2 if dtype == "float16" else 1e-5
    on, off, on_c, off_c = (a.astype(np.float32) for a in (on, off, on_c, off_c))
    assert np.max(np.abs(on - off)[valid]) <= tol * np.max(np.abs(off[valid]))
    assert np.max(np.abs(on_c - off_c)) <= tol * np.max(np.abs(off_c))


def test_bf16_activation_kernel_is_to_bits_bit_for_bit():
    """The fused float32 -> bfloat16 kernel of model.matmul = "bfloat16" against
    storage.to_bits on the device: ties, subnormals, infinities and NaN included."""
    from semzo.model import kernels_gpu
    from semzo.model.storage import to_bits
    r = np.random.default_rng(5)
    v = r.standard_normal(100_000).astype(np.float32) * np.float32(3.0)
    u = v.view(np.uint32)
    u[:1000] = (u[:1000] & 0xFFFF0000) | 0x8000            # exact ties
    u[1000:1010] = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF, 1, 0x8000,
                    0x807F8000, 0x7F7FFFFF, 0x3F808000]
    x = cp.asarray(v)
    out = cp.empty(x.shape, cp.uint16)
    assert kernels_gpu.to_bf16(x, out)
    assert np.array_equal(out.get(), to_bits(v))


@pytest.mark.parametrize("transposed", [True, False])
def test_tensor_core_gemm_matches_the_cpu_arithmetic(transposed):
    """cublasGemmEx on bfloat16 bits (model.matmul = "bfloat16") against the float64 product
    of the same rounded inputs, and the CPU's emulation, within float32 summation rounding;
    into a column slice of a wider array, the columns beside it untouched."""
    from semzo.model.gemm import matmul_bf16, round_bf16
    from semzo.model.storage import to_bits, to_float32
    r = np.random.default_rng(6)
    n, k, o = 300, 576, 200
    x = r.standard_normal((n, k)).astype(np.float32)
    w = to_bits(r.standard_normal((o, k) if transposed else (k, o)).astype(np.float32))
    wf = to_float32(w).astype(np.float64)
    ref = round_bf16(x).astype(np.float64) @ (wf.T if transposed else wf)
    bound = 2 * k * 2.0 ** -24 * (np.abs(round_bf16(x)).astype(np.float64)
                                  @ np.abs(wf.T if transposed else wf))
    wide = cp.full((n, o + 7), 7.0, cp.float32)
    got = matmul_bf16(cp.asarray(x), cp.asarray(w), wide[:, 3:3 + o], transposed)
    assert got.shape == (n, o)
    g = wide.get()
    assert np.all(g[:, :3] == 7.0) and np.all(g[:, 3 + o:] == 7.0)
    assert np.all(np.abs(g[:, 3:3 + o] - ref) <= bound)
    cpu = matmul_bf16(x, w, np.empty((n, o), np.float32), transposed)
    assert np.all(np.abs(cpu - ref) <= bound)


def test_tensor_core_decoder_matches_the_cpu_emulation(tmp_path):
    """A bfloat16 Llama with model.matmul = "bfloat16" on the device against the same model
    on NumPy (the CPU's emulation of the arithmetic): the logits agree to bfloat16 rounding
    (the device sums in another order, which can move an activation across a bfloat16
    rounding boundary), and both differ from the float32-matmul forward by about that much."""
    f = tiny_llama(tmp_path / "m")
    ids = np.random.default_rng(7).integers(0, CFG["vocab_size"], size=(4, 24))
    mask = np.ones_like(ids)
    mask[2, 17:] = 0
    cpu = load_model(f, dtype="bfloat16")
    ref32 = cpu.logits(ids, mask)
    cpu.set_matmul("bfloat16")
    ref = cpu.logits(ids, mask)
    dev = load_model(f, xp="cupy", dtype="bfloat16")
    dev.set_matmul("bfloat16")
    got = dev.logits(ids, mask).get()
    valid = mask.astype(bool)
    scale = np.abs(ref[valid]).max()
    assert np.abs(got - ref)[valid].max() <= 2e-2 * scale
    assert np.abs(got - ref)[valid].mean() <= 2e-3 * scale
    assert np.abs(ref - ref32)[valid].max() > 1e-6 * scale     # the rounding did happen
    loss = dev.next_token_loss(ids, mask)
    assert abs(loss - cpu.next_token_loss(ids, mask)) <= 1e-2 * abs(loss)


def test_strided_batched_attention_gemms_match_numpy():
    """The decoder's attention products on the device (one cublasSgemmStridedBatched each:
    scores against a transposed cache view, context against a cache slice) against NumPy."""
    from semzo.model.gemm import batched_matmul_f32
    r = np.random.default_rng(8)
    b, nkv, gt, d, cap, tk = 3, 2, 10, 16, 40, 29
    q = r.standard_normal((b, nkv, gt, d)).astype(np.float32)
    kc = r.standard_normal((b, nkv, cap, d)).astype(np.float32)
    p = r.standard_normal((b, nkv, gt, tk)).astype(np.float32)
    dk = cp.asarray(kc)
    s = cp.empty((b, nkv, gt, tk), cp.float32)
    batched_matmul_f32(cp.asarray(q), dk[:, :, :tk].transpose(0, 1, 3, 2), s)
    want = q.astype(np.float64) @ kc[:, :, :tk].transpose(0, 1, 3, 2)
    assert np.abs(s.get() - want).max() <= 1e-5 * np.abs(want).max()
    c = cp.empty((b, nkv, gt, d), cp.float32)
    batched_matmul_f32(cp.asarray(p), dk[:, :, :tk], c)
    want = p.astype(np.float64) @ kc[:, :, :tk]
    assert np.abs(c.get() - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("tk", [7, 256, 300])
def test_gpu_softmax_kernels_match_the_generic_chain(monkeypatch, tk):
    """attn_softmax on the device: the warp kernel (up to 32 x WARP_COLS keys) and the block
    kernel (longer rows) against the generic CuPy chain (SEMZO_GPU_FUSED=0): causal with an
    offset, padded keys, a row with no key, a sliding window."""
    from semzo.model import kernels_gpu as fused
    from semzo.model import kernels_lm
    rng = np.random.default_rng(tk)
    b, nkv, grp, tq = 3, 2, 3, 5
    past = tk - tq
    s0 = cp.asarray((rng.standard_normal((b * nkv, grp, tq, tk)) * 4).astype(np.float32))
    maskf = np.ones((b, tk), np.float32)
    maskf[1, :3] = 0.0
    maskf[2, :] = 0.0
    maskf = cp.asarray(maskf)
    for window in (None, 4):
        launched = count_fused_launches(monkeypatch)
        on = kernels_lm.attn_softmax(s0.copy(), maskf, 0.3, nkv, past, window)
        assert not fused._FAILED, fused._FAILED
        want = "lm_softmax_warp" if tk <= 32 * fused.WARP_COLS else "lm_softmax_row"
        assert launched == [want]
        monkeypatch.setenv("SEMZO_GPU_FUSED", "0")
        off = kernels_lm.attn_softmax(s0.copy(), maskf, 0.3, nkv, past, window)
        assert launched == [want]
        assert bool(cp.all((on == 0) == (off == 0)))
        assert float(cp.max(cp.abs(on - off))) <= 2e-6
        assert bool(cp.all(on[2 * nkv:] == 0))
