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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_kernels_run_and_match_the_generic_cupy_chains(tmp_path, monkeypatch, dtype):
    """The fused decoder kernels (semzo.model.kernels_gpu) compile and run on the device
    (every launch counted), and the forward with them equals the forward with the generic
    CuPy chains (SEMZO_GPU_FUSED=0) to float32 rounding (their reductions are CuPy's own;
    the elementwise arithmetic is the same, uncontracted); a cached forward at an offset
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
    # per layer: rope x 3, softmax x 3, gated x 1, rmsnorm x 2 (+ the final norm)
    assert len(launched) >= CFG["num_hidden_layers"] * 9
    n = len(launched)
    monkeypatch.setenv("SEMZO_GPU_FUSED", "0")
    off = cp.asnumpy(gpu.logits(ids, mask))
    cache = gpu.new_cache(3, 24)
    gpu.forward_cached(ids[:, :12], cache)
    off_c = cp.asnumpy(gpu.forward_cached(ids[:, 12:16], cache))
    assert len(launched) == n                      # off means off
    valid = mask.astype(bool)
    assert np.max(np.abs(on - off)[valid]) <= 1e-5 * np.max(np.abs(off[valid]))
    assert np.max(np.abs(on_c - off_c)) <= 1e-5 * np.max(np.abs(off_c))
