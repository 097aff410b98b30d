"""Llama 3.1 and later in GGUF: llama3 rope scaling kept as llama.cpp keeps it (the tensor
``rope_freqs.weight`` of frequency divisors) when reading and when exporting; Llama 3's and
Qwen2's pre-tokenizers (``llama-bpe``, ``qwen2``) on export.

transformers' own GGUF loader drops ``rope_freqs`` (it loads such a file with the default
rope, 2 % off in the logits of the tiny model below), so the references here are the
transformers model that was written out and llama.cpp's formula for the factors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
from ggufutil import hf_meta, hf_to_gguf, tiny_config, tiny_vocab, write_gguf

from semzo.model import Tokenizer, load_model, zoo
from semzo.model.convert import convert_gguf
from semzo.model.gguf import GGUFModel
from semzo.model.gguf_export import export_gguf
from semzo.model.spec import RopeSpec, llama3_from_factors, llama3_rope_factors
from semzo.runtime import SemzoError

N_VOCAB = len(tiny_vocab()[0])
# Meta's rope_scaling of Llama 3.1 (8B: head_dim 128) and 3.2 (1B: head_dim 64)
META_31 = (500000.0, 128, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})
META_32 = (500000.0, 64, {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192})
# a tiny model's: head_dim 16, two frequencies between the groups
TINY = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}


def _factors(theta, dim, p):
    return llama3_rope_factors(theta, dim, p["factor"], p["low_freq_factor"],
                               p["high_freq_factor"], p["original_max_position_embeddings"])


def _spec(theta, p):
    return RopeSpec(theta, "llama3", p["factor"], p["low_freq_factor"], p["high_freq_factor"],
                    p["original_max_position_embeddings"])


# ---- the factors and back ----------------------------------------------------------------------
@pytest.mark.parametrize("theta, dim, params", [META_31, META_32])
def test_meta_parameters_come_back_exactly(theta, dim, params):
    f = _factors(theta, dim, params)
    assert f.dtype == np.float32 and f[0] == 1.0 and f[-1] == params["factor"]
    assert ((f > 1) & (f < params["factor"])).sum() >= 2
    got = llama3_from_factors(f, theta, dim)
    assert got == {"rope_type": "llama3", **params}
    # the frequencies semzo computes are llama.cpp's (base / factor) to float32 rounding
    base = RopeSpec(theta).inv_freq(dim)
    rel = np.abs(_spec(theta, params).inv_freq(dim) / (base / f) - 1)
    assert rel.max() <= 2.4e-7, rel.max()


def test_any_llama3_parameters_give_the_files_frequencies():
    """Random (theta, head_dim, factor, low, high, original context): what is read back may
    be another scale of (old, low, high) (the factors fix only their ratios), but its
    frequencies are the file's to LLAMA3_FACTOR_RTOL."""
    rng = np.random.default_rng(0)
    n_scaled = 0
    for _ in range(300):
        theta = float(rng.choice([1e4, 5e5, 1e6]))
        dim = int(rng.choice([16, 32, 64, 128, 256]))
        low = float(rng.uniform(0.5, 2.0))
        p = {"factor": float(rng.choice([2.0, 4.0, 8.0, 16.0, 32.0])), "low_freq_factor": low,
             "high_freq_factor": low * float(rng.uniform(1.5, 8.0)),
             "original_max_position_embeddings": int(rng.choice([32, 256, 4096, 8192, 32768]))}
        f = _factors(theta, dim, p)
        got = llama3_from_factors(f, theta, dim)
        if (f == 1).all():
            assert got is None
            continue
        n_scaled += 1
        assert got["rope_type"] == "llama3"
        if (f == p["factor"]).any():        # (else no frequency shows the factor itself)
            assert got["factor"] == p["factor"]
        assert isinstance(got["original_max_position_embeddings"], int)
        ours = _spec(theta, got).inv_freq(dim)
        want = RopeSpec(theta).inv_freq(dim) / f
        assert np.abs(ours / want - 1).max() <= 2e-6, (theta, dim, p, got)
        assert np.abs(ours / _spec(theta, p).inv_freq(dim) - 1).max() <= 3e-6
    assert n_scaled > 250


def test_other_factors_refused():
    theta, dim, p = META_32
    f = _factors(theta, dim, p)
    assert llama3_from_factors(np.ones(dim // 2, np.float32), theta, dim) is None
    bent = f.copy()
    i = int(np.flatnonzero((f > 1) & (f < p["factor"]))[0])
    bent[i] *= 1.001
    for bad, phrase in ((bent, "not the factors of llama3"),
                        (f[::-1].copy(), "decrease"),
                        (f * 0.5, "at least 1"),
                        (np.where(f > 1, np.nan, f), "finite"),
                        (f[:-1], "31 values for 32")):
        with pytest.raises(ValueError, match=phrase):
            llama3_from_factors(bad, theta, dim)


# ---- reading a GGUF file with rope_freqs ---------------------------------------------------------
def _tiny_llama3(tie: bool = True, vocab: int = N_VOCAB):
    import torch
    import transformers as tf
    common = tiny_config(vocab, tie, max_positions=256)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_scaling=dict(TINY))).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(torch.randn_like(p))
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model, state, common


def test_gguf_rope_freqs_read_as_llama3(tmp_path):
    import torch
    model, state, cfg = _tiny_llama3()
    f = _factors(10000.0, 16, TINY)
    assert ((f > 1) & (f < TINY["factor"])).sum() == 2
    tensors = {**hf_to_gguf(state, cfg, "llama"), "rope_freqs.weight": f}
    src = write_gguf(tmp_path / "l3.gguf", "llama", hf_meta(cfg), tensors)
    assert GGUFModel(src).hf_config()["rope_scaling"] == TINY
    out = tmp_path / "out"
    convert_gguf(src, out)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == TINY
    ids = np.array([[5, 70, 200, 9, 33, 3] * 10], dtype=np.int64)
    with torch.no_grad():
        want = model(torch.from_numpy(ids)).logits.numpy()
    got = load_model(out).logits(ids, np.ones_like(ids))
    rel = float(np.abs(got - want).max() / np.abs(want).max())
    assert rel < 1e-5, rel
    # the same weights with the default rope are far off: the factors matter here
    default = tmp_path / "default"
    convert_gguf(write_gguf(tmp_path / "d.gguf", "llama", hf_meta(cfg),
                            hf_to_gguf(state, cfg, "llama")), default)
    off = load_model(default).logits(ids, np.ones_like(ids))
    assert float(np.abs(off - want).max() / np.abs(want).max()) > 100 * rel


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "semzo", "convert", "gguf", *map(str, args)],
                          capture_output=True, text=True, timeout=120, check=False)


def test_bad_rope_freqs_one_line_exit_2(tmp_path):
    _, state, cfg = _tiny_llama3()
    good = hf_to_gguf(state, cfg, "llama")
    f = _factors(10000.0, 16, TINY)
    cases = {
        "shape.gguf": ("llama", {}, {"rope_freqs.weight": f[:4]}, "has shape (4,)"),
        "form.gguf": ("llama", {}, {"rope_freqs.weight": f[::-1].copy()}, "values decrease"),
        "nan.gguf": ("llama", {}, {"rope_freqs.weight": f * np.nan}, "finite"),
        "linear.gguf": ("llama", {"rope.scaling.type": "linear", "rope.scaling.factor": 2.0},
                        {"rope_freqs.weight": f}, "without rope.scaling.type"),
        "qwen.gguf": ("qwen2", {}, {"rope_freqs.weight": f}, "read for llama files"),
    }
    for name, (arch, meta, extra, phrase) in cases.items():
        tensors = {**good, **extra}
        if arch == "qwen2":
            tensors.update({f"blk.{i}.attn_{x}.bias": np.zeros(n, np.float32)
                            for i in range(2) for x, n in (("q", 64), ("k", 32), ("v", 32))})
        write_gguf(tmp_path / name, arch, {**hf_meta(cfg), **meta}, tensors)
        out = tmp_path / f"out-{name}"
        r = _cli(tmp_path / name, out)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2, (name, r.stderr)
        assert len(lines) == 1 and str(tmp_path / name) in lines[0], lines
        assert "rope_freqs.weight" in lines[0] and phrase in lines[0], lines
        assert not out.exists()


# ---- exporting -------------------------------------------------------------------------------
def _tiny_folder(tmp_path):
    """The tiny llama3 model (untied) with SmolLM2's tokenizer (a vocabulary of 49152)."""
    model, _, _ = _tiny_llama3(tie=False, vocab=49152)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    src = zoo.resolve_model_path("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, folder / name)
    return folder


def test_export_writes_llamacpp_factors_and_reads_back_the_same_model(tmp_path):
    folder = _tiny_folder(tmp_path)
    model = load_model(folder)
    export_gguf(model, tmp_path / "m.gguf", gguf_type="f32")
    r = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    t = {x.name: x for x in r.tensors}["rope_freqs.weight"]
    assert t.tensor_type.name == "F32"
    np.testing.assert_array_equal(np.asarray(t.data), _factors(10000.0, 16, TINY))
    assert not [k for k in r.fields if k.startswith("llama.rope.scaling")]
    convert_gguf(tmp_path / "m.gguf", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_scaling"] == TINY
    tok = Tokenizer.from_folder(folder)
    ids, mask = tok(["The capital of France is " * 8, "def f(x):\n    return x"])
    np.testing.assert_array_equal(load_model(tmp_path / "back").logits(ids, mask),
                                  model.logits(ids, mask))


def test_export_refuses_llama3_without_its_parameters(tmp_path):
    model = load_model(_tiny_folder(tmp_path))
    cfg = dict(model.config.raw)
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters"))
    del rope["low_freq_factor"]
    from semzo.model.gguf_export import _metadata
    cfg["rope_scaling"], cfg["rope_parameters"] = rope, None
    with pytest.raises(SemzoError, match="llama3 rope scaling lacks 'low_freq_factor'"):
        _metadata(cfg)


@pytest.mark.parametrize("tag, whole", [("llama-bpe", True), ("qwen2", False)])
def test_split_pretokenizers_exported_with_their_tags(tmp_path, tag, whole):
    """A GGUF with Llama 3's or Qwen2's pre-tokenizer, converted, exported and converted
    again: the tag and the tokenization survive (Qwen's NFC normalizer, which llama.cpp does
    not have, is dropped); ignore_merges other than llama.cpp's for that tag is refused."""
    _, state, cfg = _tiny_llama3()
    src = write_gguf(tmp_path / "a.gguf", "llama", hf_meta(cfg),
                     hf_to_gguf(state, cfg, "llama"), pre=tag)
    convert_gguf(src, tmp_path / "a")
    tj = json.loads((tmp_path / "a" / "tokenizer.json").read_text())
    assert bool(tj["model"].get("ignore_merges")) is whole
    if tag == "qwen2":                      # as Qwen's own tokenizer.json has it
        tj["normalizer"] = {"type": "NFC"}
        (tmp_path / "a" / "tokenizer.json").write_text(json.dumps(tj))
    export_gguf(load_model(tmp_path / "a"), tmp_path / "b.gguf", gguf_type="f32")
    assert GGUFModel(tmp_path / "b.gguf").value("tokenizer.ggml.pre") == tag
    convert_gguf(tmp_path / "b.gguf", tmp_path / "b")
    texts = ["The  theory 1234567 in\n\n  the they're", "  x", "😀 日本語 \t\n", "onon atat"]
    t0, t1 = Tokenizer.from_folder(tmp_path / "a"), Tokenizer.from_folder(tmp_path / "b")
    enc = [x.tolist() for x in t0.encode_batch(texts)]
    assert enc == [x.tolist() for x in t1.encode_batch(texts)]
    assert max(enc[0]) >= 3 + 256          # merged tokens (" the"), not bytes alone
    tj["model"]["ignore_merges"] = not whole
    (tmp_path / "a" / "tokenizer.json").write_text(json.dumps(tj))
    with pytest.raises(SemzoError, match=f"ignore_merges = {not whole} with the split of "
                                         f"llama.cpp's '{tag}'"):
        export_gguf(load_model(tmp_path / "a"), tmp_path / "c.gguf")
    assert not list(tmp_path.glob("c.gguf*")) and not list(tmp_path.glob(".c.gguf*"))
