"""GPU: the CuPy forward of every supported model family against the NumPy forward.

Families come from ``semzo.model.config.SUPPORTED`` (tiny random configs: BERT and GPT-2 from
tests/mpi/zo_common.py, any later family from transformers' own config class), so families
added later are picked up without editing this file. Storage dtypes are those ``load_model``
accepts (float32, float16, bfloat16), each against the NumPy float32 model; bfloat16 also
against the NumPy bfloat16 model within ``TOL_SAME_BF16`` = 1e-4 relative (the same bfloat16
weights and float32 arithmetic: only the GEMMs' summation order differs, as for float32
against float32). The GPU cases are skipped
only when CuPy or a GPU is absent; ``test_forward_harness_on_cpu`` runs the same comparison
with NumPy on both sides, so the harness itself is proven without a GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import count_fused_launches, cupy_or_none, gpu_skip, host, rel_err
from zo_common import make_model

from semzo.model import load_model
from semzo.model.config import SUPPORTED
from semzo.model.storage import to_bits, to_float32
from semzo.runtime import SemzoError

TOL = {"float32": 1e-4, "float16": 3e-2, "bfloat16": 6e-2}
TOL_SAME_BF16 = 1e-4
TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64,
        "vocab_size": 97}


def tiny_folder(family: str, folder: Path) -> Path:
    """A tiny random model of ``family`` (a model_type semzo supports) in ``folder``."""
    if family in ("bert", "gpt2"):
        return make_model(folder, kind=family, layers=2, hidden=32, heads=2)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(family, **TINY)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(str(folder), safe_serialization=True)
    return folder


def _dtypes() -> list[str]:
    """float32, float16, and bfloat16 once load_model takes it (probed on a tiny BERT: a
    refusal other than "only float32 and float16", e.g. "needs xp=cupy", counts as taken)."""
    import tempfile
    out = ["float32", "float16"]
    with tempfile.TemporaryDirectory() as d:
        f = make_model(Path(d) / "m")
        try:
            load_model(f, dtype="bfloat16")
            out.append("bfloat16")
        except SemzoError as exc:
            if "only float32 and float16" not in str(exc):
                out.append("bfloat16")          # refused for another reason: test it on GPU
        except (TypeError, ValueError):   # np.dtype("bfloat16"): the loader predates it
            pass
    return out


DTYPES = _dtypes()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpu_model")
    return {f: tiny_folder(f, base / f) for f in SUPPORTED}


def batch(vocab: int, b: int = 6, t: int = 20, seed: int = 0):
    r = np.random.default_rng(seed)
    ids = r.integers(0, vocab, size=(b, t)).astype(np.int64)
    mask = np.ones((b, t), np.int64)
    for i in range(b):
        mask[i, t - i * 3:] = 0 if i else 1          # rows with 0..15 padded positions
    return ids, mask


def check_forward(xp, folder: Path, dtype: str, tol: float, ref_dtype: str = "float32") -> None:
    """The model on ``xp`` in ``dtype`` against the NumPy model in ``ref_dtype`` (float32 or
    bfloat16): final hidden states, pooled embeddings and the classification loss; in-place
    parameter edits are seen."""
    cpu = load_model(folder, dtype=ref_dtype)
    dev = load_model(folder, xp=xp, dtype=dtype)
    assert list(dev.params) == list(cpu.params)
    first = next(iter(dev.params.values()))
    assert type(first).__module__.split(".")[0] == xp.__name__.split(".")[0]
    ids, mask = batch(cpu.config.vocab_size)
    valid = mask.astype(bool)
    ref = cpu.hidden_states(ids, mask)
    got = dev.hidden_states(ids, mask)
    assert got.shape == ref.shape
    assert np.isfinite(host(got)[valid]).all()
    assert rel_err(got, ref, valid) < tol, (folder.name, dtype)
    e_ref, e_got = cpu.embed(ids, mask), dev.embed(ids, mask)
    assert np.min((host(e_ref) * host(e_got).astype(np.float32)).sum(1)) > 1 - tol
    lab = np.arange(ids.shape[0]) % 3
    cpu.add_classifier(3, seed=0)
    dev.add_classifier(3, seed=0)
    la, _, _ = cpu.classify(ids, mask, lab)
    lb, _, _ = dev.classify(ids, mask, lab)
    assert abs(la - lb) < 10 * tol * max(1.0, abs(la))
    blocks = [n for n in dev.params if n.endswith("weight") and dev.params[n].ndim == 2
              and any(f"{k}.0." in n for k in ("layer", "h", "layers"))]
    name = blocks[-1]                                  # block 0's last matrix (MLP out)
    before = host(dev.hidden_states(ids, mask)).copy()
    w = dev.params[name]
    noise = np.random.default_rng(1).normal(0.0, 0.05, w.shape).astype(np.float32)
    if dev.storage == "bfloat16":               # uint16 bits: edit the values, not the bits
        w[...] = to_bits(to_float32(w) + xp.asarray(noise))
    else:
        w += xp.asarray(noise).astype(w.dtype)
    assert float(np.abs(host(dev.hidden_states(ids, mask)) - before).max()) > 1e-4


@gpu_skip()
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_gpu_forward_matches_numpy(folders, family, dtype):
    check_forward(cupy_or_none(), folders[family], dtype, TOL[dtype])


@gpu_skip()
@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_gpu_bf16_matches_numpy_bf16(folders, family):
    """CuPy bfloat16 against NumPy bfloat16: the same array code and weights."""
    check_forward(cupy_or_none(), folders[family], "bfloat16", TOL_SAME_BF16, "bfloat16")


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_forward_harness_on_cpu(folders, family):
    """The same comparison with NumPy on both sides: equal to rounding, edits seen."""
    check_forward(np, folders[family], "float32", 1e-6)


@pytest.mark.parametrize("family", sorted(SUPPORTED))
def test_forward_harness_bf16_on_cpu(folders, family):
    """The bfloat16 comparison with NumPy on both sides (bits edited as values)."""
    check_forward(np, folders[family], "bfloat16", 1e-6, "bfloat16")


@gpu_skip()
@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_gpu_fused_kernels_match_the_generic_chains(folders, monkeypatch, family, dtype):
    """The fused kernels of the encoder path (LayerNorm, bias + residual, bias + GELU, the
    padding-masked and causal softmax: semzo.model.kernels_gpu) run on the device (launches
    counted; float16 storage: the _h kernels) and give the generic CuPy chains' hidden states
    (SEMZO_GPU_FUSED=0) to float32 rounding, or to a few float16 roundings (the row sums are
    taken in another order, which can move a float16 result by an ulp)."""
    from semzo.model import kernels_gpu as fused
    cp = cupy_or_none()
    dev = load_model(folders[family], xp="cupy", dtype=dtype)
    ids = np.random.default_rng(3).integers(1, dev.config.vocab_size, size=(3, 12))
    mask = np.ones_like(ids)
    mask[1, 8:] = 0
    launched = count_fused_launches(monkeypatch)
    on = host(dev.hidden_states(ids, mask)).astype(np.float32)
    assert not fused._FAILED, fused._FAILED
    sfx = "_h" if dtype == "float16" else ""
    layers = dev.config.num_layers          # per layer: two LayerNorms (GPT-2: with the final
    for name, per in (("lm_softmax_warp", 1), ("lm_bias_act", 1),          # one), a softmax
                      ("lm_layernorm_row", 2)):                            # (12 keys: a warp
        assert launched.count(name + sfx) >= per * layers, (name, launched)  # a row), the GELU
    n = len(launched)
    monkeypatch.setenv("SEMZO_GPU_FUSED", "0")
    off = host(dev.hidden_states(ids, mask)).astype(np.float32)
    assert len(launched) == n
    valid = mask.astype(bool)
    tol = 1e-5 if dtype == "float32" else 2e-2
    assert np.max(np.abs(on - off)[valid]) <= tol * np.max(np.abs(off[valid]))
    assert cp is not None
