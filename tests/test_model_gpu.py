"""GPU-only: the CuPy path of semzo.model against the NumPy path (float32 and float16 storage).

Skipped, with the reason, only when cupy cannot be imported or sees no CUDA device; on a GPU
machine with CuPy these run (tools/gpu-check.sh runs them with the kit's MiniLM stand-in:
random weights of the model's shapes). tests/test_gpu_model.py covers every family.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

try:
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no CUDA device")
except Exception as exc:  # noqa: BLE001 - any failure to reach a GPU means: skip
    pytest.skip(f"GPU-only tests: cupy with a CUDA device is not available ({exc})",
                allow_module_level=True)

from semzo.model import Tokenizer, embed_texts, load_model

SENTENCES = (Path(__file__).parent / "data" / "model_sentences.txt").read_text(
    encoding="utf-8").splitlines()


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("float16", 3e-2)])
def test_cupy_encoder_matches_numpy(dtype, tol):
    tok = Tokenizer.from_folder()
    cpu = load_model()
    gpu = load_model(xp="cupy", dtype=dtype)
    assert isinstance(gpu.params["embeddings.word_embeddings.weight"], cp.ndarray)
    assert list(gpu.params) == list(cpu.params)
    ids, mask = tok(SENTENCES[:8])
    ref = cpu.hidden_states(ids, mask)
    got = cp.asnumpy(gpu.hidden_states(ids, mask)).astype(np.float32)
    valid = mask.astype(bool)
    assert np.max(np.abs(got - ref)[valid]) / np.max(np.abs(ref[valid])) < tol
    e_cpu = embed_texts(cpu, tok, SENTENCES, batch_size=8)
    e_gpu = embed_texts(gpu, tok, SENTENCES, batch_size=8)
    assert isinstance(e_gpu, np.ndarray) and e_gpu.dtype == np.float32
    assert np.min((e_cpu * e_gpu).sum(1)) > 1 - tol
    gpu.add_classifier(3, seed=0)
    cpu.add_classifier(3, seed=0)
    la, _, _ = cpu.classify(ids, mask, np.arange(8) % 3)
    lb, _, zb = gpu.classify(ids, mask, np.arange(8) % 3)
    assert isinstance(zb, cp.ndarray) and abs(la - lb) < 10 * tol
    # in-place perturbation on the device is seen by the next call
    # (a random direction: a constant added to W shifts every query by 0.05 * sum(x), which is
    # 0 after a LayerNorm of weight 1 and bias 0, as the kit's stand-in weights have)
    w = gpu.params["encoder.layer.0.attention.self.query.weight"]
    before = gpu.hidden_states(ids, mask).copy()
    w += cp.asarray(0.05 * np.random.default_rng(0).standard_normal(w.shape), dtype=w.dtype)
    assert float(cp.abs(gpu.hidden_states(ids, mask) - before).max()) > 1e-3
