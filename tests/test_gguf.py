"""GGUF reading and `semzo convert gguf` on small synthetic files (SmolLM2: test_gguf_smollm2.py).

Each tensor type is checked against an independent expectation: the float input within the
type's rounding step (types the gguf package can quantize), or ggml's C decoding re-written in
tests/ggufutil.py (K-quants, which the package cannot quantize).
"""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest
from ggufutil import (
    hf_meta,
    hf_to_gguf,
    random_k_blocks,
    ref_q4_k,
    ref_q5_0,
    ref_q5_k,
    ref_q6_k,
    ref_q8_0,
    tiny_config,
    tiny_vocab,
    write_gguf,
)

from semzo.model.convert import convert_gguf, to_bfloat16_bits
from semzo.model.gguf import SUPPORTED_TYPES, GGUFModel, permute_qk, unpermute_qk
from semzo.runtime import SemzoError

Q = gguf.GGMLQuantizationType
N_VOCAB = len(tiny_vocab()[0])
META = {"block_count": 1, "context_length": 64, "embedding_length": 64,
        "feed_forward_length": 96, "attention.head_count": 4, "attention.head_count_kv": 2,
        "rope.freq_base": 10000.0, "attention.layer_norm_rms_epsilon": 1e-5}


def _block_tensors(rng, h=64, f=96, heads=4, kv=2, vocab=N_VOCAB, tie=True) -> dict:
    hd = h // heads
    t = {"token_embd.weight": rng.standard_normal((vocab, h)),
         "output_norm.weight": rng.standard_normal(h),
         "blk.0.attn_norm.weight": rng.standard_normal(h),
         "blk.0.ffn_norm.weight": rng.standard_normal(h),
         "blk.0.attn_q.weight": rng.standard_normal((heads * hd, h)),
         "blk.0.attn_k.weight": rng.standard_normal((kv * hd, h)),
         "blk.0.attn_v.weight": rng.standard_normal((kv * hd, h)),
         "blk.0.attn_output.weight": rng.standard_normal((h, heads * hd)),
         "blk.0.ffn_gate.weight": rng.standard_normal((f, h)),
         "blk.0.ffn_up.weight": rng.standard_normal((f, h)),
         "blk.0.ffn_down.weight": rng.standard_normal((h, f))}
    if not tie:
        t["output.weight"] = rng.standard_normal((vocab, h))
    return {k: v.astype(np.float32) for k, v in t.items()}


# ---- dequantization, type by type ----------------------------------------------------------
# step of each block type relative to the block's range: max|x| for the symmetric types,
# (max - min) for the ones with a minimum
_STEP = {Q.Q8_0: ("amax", 127), Q.Q4_0: ("amax", 8), Q.Q5_0: ("amax", 16),
         Q.Q4_1: ("range", 15), Q.Q5_1: ("range", 31)}


@pytest.mark.parametrize("qtype", list(_STEP), ids=lambda q: q.name)
def test_dequantize_block_types_within_half_a_step(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    x = rng.standard_normal((8, 256)).astype(np.float32)
    q = gguf.quants.quantize(x, qtype)
    p = write_gguf(tmp_path / "q.gguf", "llama", META, {"t.weight": (q, qtype)}, tokenizer=False)
    got = GGUFModel(p).dequantize("t.weight")
    assert got.shape == x.shape and got.dtype == np.float32
    blocks = x.reshape(-1, 32)
    kind, div = _STEP[qtype]
    rng_ = np.abs(blocks).max(1) if kind == "amax" else blocks.max(1) - blocks.min(1)
    step = (rng_ / div)[:, None]
    err = np.abs(got.reshape(-1, 32) - blocks)
    # half a step (a full step where Q4_0/Q5_0 clip the end opposite the block's largest
    # magnitude: their codes span -div..div-1 steps), plus the float16 rounding of the
    # block scale (and minimum)
    half = np.where(np.abs(blocks) <= (div - 1) * step, step / 2, step)
    bound = half + (np.abs(blocks) + rng_[:, None]) * 2.0 ** -10
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0  # a quantized type: the check above is not vacuous


@pytest.mark.parametrize("qtype,ref", [(Q.Q4_K, ref_q4_k), (Q.Q5_K, ref_q5_k),
                                       (Q.Q6_K, ref_q6_k)], ids=["Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_k_quants_match_ggml_reference(tmp_path, qtype, ref):
    rng = np.random.default_rng(int(qtype))
    b = random_k_blocks(qtype, 6, rng)  # 6 blocks of 256 = 3 rows of 512
    p = write_gguf(tmp_path / "k.gguf", "llama", META,
                   {"t.weight": (b.reshape(3, -1), qtype)}, tokenizer=False)
    got = GGUFModel(p).dequantize("t.weight")
    assert got.shape == (3, 512)
    want = np.concatenate([ref(blk) for blk in b]).reshape(3, 512)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype,ref", [(Q.Q5_0, ref_q5_0), (Q.Q8_0, ref_q8_0)],
                         ids=["Q5_0", "Q8_0"])
def test_dequantize_q5_0_q8_0_match_ggml_reference(tmp_path, qtype, ref):
    """Q5_0 and Q8_0 (Gemma 3 270M's q/k/gate/up and embedding/v types) on random block
    bytes, every code and high bit reached, against ggml's C decoder re-written: exact."""
    rng = np.random.default_rng(int(qtype) + 100)
    b = random_k_blocks(qtype, 48, rng)  # 48 blocks of 32 = 3 rows of 512
    p = write_gguf(tmp_path / "q.gguf", "llama", META,
                   {"t.weight": (b.reshape(3, -1), qtype)}, tokenizer=False)
    got = GGUFModel(p).dequantize("t.weight")
    assert got.shape == (3, 512)
    want = np.concatenate([ref(blk) for blk in b]).reshape(3, 512)
    np.testing.assert_array_equal(got, want)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)          # (48, 1) scales
    codes = np.rint(want.reshape(48, 32) / d).astype(int)
    lo, hi = (-16, 15) if qtype == Q.Q5_0 else (-128, 127)
    assert codes.min() == lo and codes.max() == hi and len(np.unique(codes)) == hi - lo + 1


def test_dequantize_float_types_exact(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    bf = gguf.quants.quantize(x, Q.BF16)
    p = write_gguf(tmp_path / "f.gguf", "llama", META,
                   {"a.weight": x, "b.weight": x.astype(np.float16), "c.weight": (bf, Q.BF16)},
                   tokenizer=False)
    g = GGUFModel(p)
    assert {t.tensor_type.name for t in g.tensors.values()} == {"F32", "F16", "BF16"}
    np.testing.assert_array_equal(g.dequantize("a.weight"), x)
    np.testing.assert_array_equal(g.dequantize("b.weight"), x.astype(np.float16).astype(np.float32))
    want_bf = (to_bfloat16_bits(x).astype(np.uint32) << 16).view(np.float32)
    np.testing.assert_array_equal(g.dequantize("c.weight"), want_bf)
    assert np.abs(want_bf - x).max() <= np.abs(x).max() * 2.0 ** -8


def test_supported_types_listed():
    assert set(SUPPORTED_TYPES) >= {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


# ---- q/k permutation --------------------------------------------------------------------------
@pytest.mark.parametrize("heads,rows_per_head", [(4, 16), (9, 64), (3, 64), (1, 2)])
def test_qk_permutation_round_trip(heads, rows_per_head):
    w = np.random.default_rng(heads).standard_normal((heads * rows_per_head, 7))
    p = permute_qk(w, heads)
    np.testing.assert_array_equal(unpermute_qk(p, heads), w)
    np.testing.assert_array_equal(permute_qk(unpermute_qk(w, heads), heads), w)
    if rows_per_head > 2:
        assert not np.array_equal(p, w)
    b = w[:, 0].copy()  # biases (1-D) permute the same way
    np.testing.assert_array_equal(unpermute_qk(permute_qk(b, heads), heads), b)


# ---- tiny transformers models through GGUF and back ---------------------------------------------
def _tiny_hf(tmp_path, family: str, tie: bool):
    import torch
    import transformers as tf
    common = tiny_config(N_VOCAB, tie)
    torch.manual_seed(0)
    if family == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif family == "qwen3":
        # head size 128 != hidden / heads, as in Qwen3's own models (and transformers' GGUF
        # loader, the reference below, ignores qwen3.attention.key_length: 128 is its default)
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=128))
    else:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common))
    model.eval()
    with torch.no_grad():  # random norms and biases, so a wrong mapping cannot hide
        for n, p in model.named_parameters():
            if n.endswith(("norm.weight", ".bias")):
                p.copy_(torch.randn_like(p))
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    cfg = {**common, "rope_theta": 10000.0}
    return model, state, cfg


@pytest.mark.parametrize("family,tie", [("llama", False), ("llama", True), ("qwen2", False),
                                        ("qwen3", False), ("qwen3", True)])
def test_tiny_model_gguf_round_trip(tmp_path, family, tie):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    model, state, cfg = _tiny_hf(tmp_path, family, tie)
    meta = hf_meta(cfg)
    hd = 128 if family == "qwen3" else 16
    if family == "qwen3":   # llama.cpp's converter writes the head size of a config that has one
        meta.update({"attention.key_length": hd, "attention.value_length": hd})
    src = write_gguf(tmp_path / "tiny.gguf", family, meta, hf_to_gguf(state, cfg, family))
    out = tmp_path / "out"
    s = convert_gguf(src, out)
    assert s["tensors"] == len(state) - (1 if tie else 0)
    got = load_file(str(out / "model.safetensors"))
    want = {k: v for k, v in state.items() if not (tie and k == "lm_head.weight")}
    assert set(got) == set(want)
    for k, w in want.items():
        np.testing.assert_array_equal(got[k], w, err_msg=k)
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == [type(model).__name__]
    assert conf["tie_word_embeddings"] is tie
    assert (conf["num_key_value_heads"], conf["head_dim"]) == (2, hd)
    # transformers reads the converted folder and the GGUF itself to the same weights
    ours = AutoModelForCausalLM.from_pretrained(out)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf",
                                               dtype=torch.float32)
    ids = torch.tensor([[5, 70, 200, 9, 33, 3]])
    with torch.no_grad():
        want_logits = model(ids).logits
        np.testing.assert_array_equal(ours(ids).logits.numpy(), want_logits.numpy())
    for k, v in ref.state_dict().items():
        assert torch.equal(v, ours.state_dict()[k]), k


def test_convert_dtypes(tmp_path):
    from safetensors import safe_open
    rng = np.random.default_rng(1)
    src = write_gguf(tmp_path / "m.gguf", "llama", META, _block_tensors(rng))
    x = GGUFModel(src).hf_tensor("blk.0.ffn_up.weight", GGUFModel(src).hf_config())
    for dtype, st in (("float16", "F16"), ("bfloat16", "BF16")):
        out = tmp_path / dtype
        convert_gguf(src, out, dtype=dtype)
        assert json.loads((out / "config.json").read_text())["torch_dtype"] == dtype
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            t = f.get_tensor("model.layers.0.mlp.up_proj.weight")
        assert str(t.dtype).endswith(dtype)
        np.testing.assert_allclose(t.float().numpy(), x, rtol=2.0 ** -7 if st == "BF16" else 1e-3)


# ---- bad input: one line naming the file, exit 2, nothing written ------------------------------
def _cli(*args):
    return subprocess.run([sys.executable, "-m", "semzo", "convert", "gguf", *map(str, args)],
                          capture_output=True, text=True, timeout=120, check=False)


def _bad_files(tmp_path) -> dict:
    rng = np.random.default_rng(2)
    good = _block_tensors(rng)
    (tmp_path / "text.gguf").write_text("this is not a model\n")
    (tmp_path / "empty.gguf").write_bytes(b"")
    full = write_gguf(tmp_path / "full.gguf", "llama", META, good).read_bytes()
    (tmp_path / "trunc.gguf").write_bytes(full[: len(full) - 100])
    iq = dict(good)
    nbytes = 64 // 32 * gguf.GGML_QUANT_SIZES[Q.IQ4_NL][1]
    iq["blk.0.ffn_up.weight"] = (np.zeros((96, nbytes), dtype=np.uint8), Q.IQ4_NL)
    write_gguf(tmp_path / "iq4.gguf", "llama", META, iq)
    write_gguf(tmp_path / "mamba.gguf", "mamba", META, good)
    write_gguf(tmp_path / "moe.gguf", "llama", {**META, "expert_count": 8}, good)
    return {"text.gguf": "not a GGUF file", "empty.gguf": "not a GGUF file",
            "trunc.gguf": "truncated", "iq4.gguf": "IQ4_NL",
            "mamba.gguf": "architecture 'mamba'", "moe.gguf": "llama.expert_count"}


def test_bad_files_cli_exit_2_one_line(tmp_path):
    for name, phrase in _bad_files(tmp_path).items():
        out = tmp_path / f"out-{name}"
        r = _cli(tmp_path / name, out)
        assert r.returncode == 2, (name, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and str(tmp_path / name) in lines[0] and phrase in lines[0], lines
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_truncated_everywhere_is_one_error(tmp_path):
    rng = np.random.default_rng(3)
    full = write_gguf(tmp_path / "full.gguf", "llama", META, _block_tensors(rng)).read_bytes()
    cuts = sorted({*range(0, 64, 3), *np.linspace(64, len(full) - 1, 60).astype(int).tolist()})
    for cut in cuts:
        p = tmp_path / "cut.gguf"
        p.write_bytes(full[:cut])
        with pytest.raises(SemzoError) as e:
            convert_gguf(p, tmp_path / "out")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(str(p)), (cut, msg)
        assert ("truncated" in msg or "not a GGUF" in msg), (cut, msg)
        assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "full.gguf"]


def test_existing_outdir_needs_force(tmp_path):
    rng = np.random.default_rng(4)
    src = write_gguf(tmp_path / "m.gguf", "llama", META, _block_tensors(rng))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    r = _cli(src, out)
    assert r.returncode == 2 and "already exists" in r.stderr
    assert (out / "keep.txt").is_file()
    r = _cli(src, out, "--force")
    assert r.returncode == 0, r.stderr
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_shape_and_missing_tensor_refused(tmp_path):
    rng = np.random.default_rng(5)
    t = _block_tensors(rng)
    del t["blk.0.ffn_gate.weight"]
    p = write_gguf(tmp_path / "miss.gguf", "llama", META, t)
    with pytest.raises(SemzoError, match="missing tensor 'blk.0.ffn_gate.weight'"):
        convert_gguf(p, tmp_path / "o")
    t = _block_tensors(rng)
    t["blk.0.ffn_up.weight"] = t["blk.0.ffn_up.weight"][:, :32]
    p = write_gguf(tmp_path / "shape.gguf", "llama", META, t)
    with pytest.raises(SemzoError, match="blk.0.ffn_up.weight' has shape"):
        convert_gguf(p, tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("key, value, want", [
    ("llama.block_count", float("nan"), "expected a non-negative integer, got nan"),
    ("llama.context_length", float("inf"), "expected a non-negative integer, got inf"),
    ("llama.feed_forward_length", 96.5, "expected a non-negative integer, got 96.5"),
    ("tokenizer.ggml.eos_token_id", float("nan"), "expected a non-negative integer, got nan"),
    ("tokenizer.ggml.bos_token_id", float("-inf"), "expected a non-negative integer"),
    ("tokenizer.ggml.eos_token_id", 1e9, "outside the vocabulary"),
    ("llama.rope.freq_base", float("nan"), "expected a finite positive number, got nan"),
    ("llama.attention.layer_norm_rms_epsilon", float("inf"), "expected a finite positive"),
])
def test_nan_or_infinite_metadata_is_one_error(tmp_path, key, value, want):
    """Integer metadata stored as NaN/infinite floats (were ValueError/OverflowError
    tracebacks from int()), and non-finite float metadata: one error naming file and key."""
    p = write_gguf(tmp_path / "nan.gguf", "llama", META, _block_tensors(np.random.default_rng(6)),
                   floats={key: value})
    with pytest.raises(SemzoError) as e:
        convert_gguf(p, tmp_path / "o")
    msg = str(e.value)
    assert msg.startswith(f"{p}: ") and key in msg and want in msg and "\n" not in msg, msg
    assert not (tmp_path / "o").exists()


def test_gemma2_config_as_llamacpp_runs_it(tmp_path):
    """llama.cpp's Gemma 2 defaults when the file leaves them out (window 4096, soft-caps 50
    and 30), the file's values when present, sliding layers 0, 2, ..., and the 27B's
    attention scale (hidden / heads, 46 blocks)."""
    meta = {**META, "block_count": 4, "attention.key_length": 32,
            "attention.value_length": 32, "vocab_size": N_VOCAB}
    cfg = GGUFModel(write_gguf(tmp_path / "a.gguf", "gemma2", meta, {})).hf_config()
    assert cfg["architectures"] == ["Gemma2ForCausalLM"] and cfg["model_type"] == "gemma2"
    assert (cfg["sliding_window"], cfg["attn_logit_softcapping"],
            cfg["final_logit_softcapping"]) == (4096, 50.0, 30.0)
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert cfg["query_pre_attn_scalar"] == 32 and cfg["head_dim"] == 32
    assert cfg["hidden_activation"] == "gelu_pytorch_tanh" and "hidden_act" not in cfg
    more = {**meta, "block_count": 46, "attention.sliding_window": 5,
            "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0}
    cfg = GGUFModel(write_gguf(tmp_path / "b.gguf", "gemma2", more, {})).hf_config()
    assert (cfg["sliding_window"], cfg["attn_logit_softcapping"],
            cfg["final_logit_softcapping"]) == (5, 20.0, 10.0)
    assert cfg["query_pre_attn_scalar"] == 64 // 4        # hidden / heads
    bad = write_gguf(tmp_path / "c.gguf", "gemma2", {**meta, "attn_logit_softcapping": -1.0},
                     {})
    with pytest.raises(SemzoError, match="gemma2.attn_logit_softcapping"):
        GGUFModel(bad).hf_config()
    bad = write_gguf(tmp_path / "d.gguf", "gemma2", {**meta, "attention.sliding_window": 0}, {})
    with pytest.raises(SemzoError, match="sliding window must be at least 1 token, got 0"):
        GGUFModel(bad).hf_config()


def test_split_model_read_from_its_first_shard(tmp_path):
    """A model in shards (llama.cpp's gguf-split layout, here written by gguf.GGUFWriter's
    split_max_tensors) converts to the same folder as the one file; a missing shard, opening
    another shard than the first, a shard that says it is another one and a tensor count that
    disagrees are one line each naming the file."""
    from safetensors.numpy import load_file
    t = _block_tensors(np.random.default_rng(7))
    one = write_gguf(tmp_path / "one.gguf", "llama", META, t)
    write_gguf(tmp_path / "m.gguf", "llama", META, t, split_max_tensors=4)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert [p.name for p in shards] == [f"m-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    convert_gguf(one, tmp_path / "a")
    convert_gguf(shards[0], tmp_path / "b")
    a, b = (load_file(str(tmp_path / d / "model.safetensors")) for d in "ab")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    with pytest.raises(SemzoError, match="open the first of the 3 shards"):
        GGUFModel(shards[1])
    shards[2].rename(tmp_path / "away.gguf")
    with pytest.raises(SemzoError, match="shard 3 of 3 not found"):
        GGUFModel(shards[0])
    (tmp_path / "away.gguf").rename(shards[2])
    shards[1].write_bytes(shards[2].read_bytes())          # shard 3's bytes under 2's name
    with pytest.raises(SemzoError, match="m-00002-of-00003.gguf: split.no / split.count = "
                                         "2 / 3, expected 1 / 3"):
        GGUFModel(shards[0])
    write_gguf(tmp_path / "n.gguf", "llama", META, t, split_max_tensors=4)
    fewer = dict(list(t.items())[:-1])                    # 10 tensors: shards of 4, 4, 2
    write_gguf(tmp_path / "p.gguf", "llama", META, fewer, split_max_tensors=4)
    (tmp_path / "p-00003-of-00003.gguf").replace(tmp_path / "n-00003-of-00003.gguf")
    with pytest.raises(SemzoError, match="n-00001-of-00003.gguf: split.tensors.count 11: "
                                         "the 3 shards hold 10 tensors"):
        GGUFModel(tmp_path / "n-00001-of-00003.gguf")


# ---- a SentencePiece (Gemma) vocabulary ---------------------------------------------------------
SP_PIECES = ["▁", "a", "b", "c", "▁a", "ab", "bc", "▁ab", "abc", "▁abc", "▁b", "ca"]


def _sp_gguf(path, scores_fall: bool = True):
    """A tiny gemma2 file with a SentencePiece-BPE vocabulary as llama.cpp writes Gemma's:
    control <pad> <eos> <bos>, <unk>, the 256 byte tokens, normal pieces scored minus their
    position (or, ``scores_fall=False``, two of them swapped)."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)] \
        + SP_PIECES
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(SP_PIECES)
    scores = [0.0] * 4 + [0.0] * 256 + [-float(i) for i in range(260, len(tokens))]
    if not scores_fall:
        scores[-1], scores[-2] = scores[-2], scores[-1]
    h, f, hd = 64, 96, 32
    rng = np.random.default_rng(8)
    t = {"token_embd.weight": rng.standard_normal((len(tokens), h)),
         "output_norm.weight": rng.standard_normal(h)}
    for name, shape in {"attn_norm": (h,), "attn_q": (2 * hd, h), "attn_k": (hd, h),
                        "attn_v": (hd, h), "attn_output": (h, 2 * hd),
                        "post_attention_norm": (h,), "ffn_norm": (h,), "ffn_gate": (f, h),
                        "ffn_up": (f, h), "ffn_down": (h, f), "post_ffw_norm": (h,)}.items():
        t[f"blk.0.{name}.weight"] = rng.standard_normal(shape)
    w = gguf.GGUFWriter(str(path), "gemma2")
    for k, v in {"block_count": 1, "context_length": 64, "embedding_length": h,
                 "feed_forward_length": f, "attention.head_count": 2,
                 "attention.head_count_kv": 1, "attention.key_length": hd,
                 "attention.value_length": hd, "vocab_size": len(tokens)}.items():
        w.add_uint32(f"gemma2.{k}", v)
    w.add_float32("gemma2.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for name, arr in t.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gemma2_sentencepiece_vocabulary_as_transformers_reads_it(tmp_path):
    """A Gemma-style SentencePiece vocabulary in a gemma2 file: semzo's tokenizer.json gives
    the ids transformers' own GGUF tokenizer gives (merges, byte fallback, spaces, <bos>);
    a vocabulary whose normal tokens' scores do not fall with their position is refused."""
    from transformers import AutoTokenizer

    from semzo.model import Tokenizer
    src = _sp_gguf(tmp_path / "g2.gguf")
    convert_gguf(src, tmp_path / "out")
    ours = Tokenizer.from_folder(tmp_path / "out")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="g2.gguf")
    texts = ["abc ab a", " a  b", "bca abc", "xyz ab", "a\nb", "日本 ab", "abcabc bc"]
    got = [x.tolist() for x in ours.encode_batch(texts)]
    assert got == [ref(t)["input_ids"] for t in texts]
    assert got[0][0] == 2 and any(i >= 260 + 4 for i in got[0])     # <bos>, merged pieces
    # exported by semzo (a Gemma 2 model with this vocabulary) and read back: the same ids
    from semzo.model import load_model
    from semzo.model.gguf_export import export_gguf
    export_gguf(load_model(tmp_path / "out"), tmp_path / "back.gguf", gguf_type="f32")
    assert GGUFModel(tmp_path / "back.gguf").value("tokenizer.ggml.model") == "llama"
    convert_gguf(tmp_path / "back.gguf", tmp_path / "back")
    again = Tokenizer.from_folder(tmp_path / "back")
    assert [x.tolist() for x in again.encode_batch(texts)] == got
    with pytest.raises(SemzoError, match="scores do not fall with their position"):
        convert_gguf(_sp_gguf(tmp_path / "bad.gguf", scores_fall=False), tmp_path / "o2")
