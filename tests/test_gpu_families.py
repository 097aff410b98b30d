"""GPU: every decoder family of tests/test_decoder_parity.py on a device against the same
model on NumPy. The device tests of the forward phase ran a tiny Llama and GPT-2 only, so the
later families' own code had never run on a GPU: Qwen2/Qwen3 biases and q/k norms, sliding
windows (Mistral, Qwen2, Gemma 2/3, Phi-3) in the softmax kernels, Gemma's sandwich norms,
(1 + w) RMSNorm, scaled embeddings and soft-capping, Phi-3's fused projections and partial
rotary, SmolLM3's layers without rotary, OPT's LayerNorms, ReLU and projections.

Per case (random right-padded batches): logits within 1e-4 relative on real tokens (float32;
bfloat16 storage against the CPU's bfloat16 storage), the next-token loss within 1e-5
relative, and the KV cache's incremental logits against the full forward. Without a GPU
the same comparison runs with the model on the ``generic_xp`` stand-in (tests/conftest.py:
NumPy under another name, so the model takes the branches a GPU takes, cuBLAS's calls
served by NumPy) against the CPU's branches, for every case (``*_on_cpu``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import cupy_or_none, gpu_skip, host
from test_decoder_parity import CASES, V, build, padded_batch, rel_err

from semzo.model import load_model

RTOL = 1e-4


def _same_family(name: str, tmp_path_factory, xp, dtype: str = "float32") -> None:
    folder, _ = build(name, tmp_path_factory)
    cpu = load_model(folder, dtype=dtype)
    dev = load_model(folder, xp=xp, dtype=dtype)
    assert dev.xp is xp
    rng = np.random.default_rng(len(name))
    for _ in range(2):                     # sequences longer than the windows
        ids, mask = padded_batch(rng, V, int(rng.integers(2, 5)), int(rng.integers(8, 24)))
        valid = mask.astype(bool)
        ref = cpu.logits(ids, mask)
        got = host(dev.logits(ids, mask))
        assert rel_err(got, ref, valid) < RTOL, (name, dtype, rel_err(got, ref, valid))
        if mask[:, 1:].sum():
            a, b = cpu.next_token_loss(ids, mask), dev.next_token_loss(ids, mask)
            assert abs(a - b) <= 1e-5 * abs(a), (name, dtype, a, b)
    ids = rng.integers(0, V, size=(2, 9))
    full = cpu.logits(ids, np.ones_like(ids))
    cache = dev.new_cache(2, 12)
    z = np.concatenate([host(dev.forward_cached(ids[:, :5], cache)),
                        host(dev.forward_cached(ids[:, 5:], cache))], axis=1)
    assert np.max(np.abs(z - full)) <= RTOL * np.max(np.abs(full)), (name, dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_family_harness_on_cpu(dtype, tmp_path_factory, generic_xp):
    """Every case through the generic xp branches (what a GPU runs, on NumPy) against the
    CPU's Numba branches."""
    for name in CASES:
        _same_family(name, tmp_path_factory, generic_xp, dtype)


@gpu_skip()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_families_match_cpu(dtype, tmp_path_factory):
    """Every case, each failure collected (one device test per storage type: the report
    names every family that differs, not only the first)."""
    failed = []
    for name in CASES:
        try:
            _same_family(name, tmp_path_factory, cupy_or_none(), dtype)
        except Exception as exc:  # noqa: BLE001 - collect, report all below
            failed.append(f"{name}: {type(exc).__name__}: {str(exc)[:300]}")
    assert not failed, "\n".join(failed)
