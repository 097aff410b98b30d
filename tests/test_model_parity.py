"""Parity of semzo.model with the reference implementations (torch CPU, transformers,
sentence-transformers; installed by ``EXTRAS=test bash tools/setup.sh``, so never skipped).

- all-MiniLM-L6-v2 with its real weights on real sentences (short, 256 tokens = the maximum
  length, padded batches, unicode): hidden states within 1e-4 relative, sentence embeddings
  within 1e-5 cosine of ``SentenceTransformer.encode``;
- a small randomly initialized GPT-2 (transformers' GPT2Config, saved with save_pretrained):
  logits within 1e-4 relative, next-token loss equal to transformers' loss;
- export -> ``AutoModel.from_pretrained`` -> same outputs, weights bit-identical;
- a real unsupported architecture -> SemzoError.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from semzo.model import (
    Tokenizer,
    default_model_path,
    embed_texts,
    export_hf,
    length_batches,
    load_model,
)
from semzo.runtime import SemzoError

DATA = Path(__file__).parent / "data"
SENTENCES = (DATA / "model_sentences.txt").read_text(encoding="utf-8").splitlines()
RTOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


@pytest.fixture(scope="module")
def minilm():
    return load_model()


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_folder()


@pytest.fixture(scope="module")
def hf_bert():
    from transformers import AutoModel
    return AutoModel.from_pretrained(str(default_model_path())).eval()


def rel_err(a, b, valid=None) -> float:
    """max |a - b| / max |b| over the valid rows."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if valid is not None:
        a, b = a[valid], b[valid]
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def token_rel_err(a, b, valid) -> float:
    """max over real tokens of ||a_t - b_t|| / ||b_t||."""
    a, b = np.asarray(a, np.float64)[valid], np.asarray(b, np.float64)[valid]
    return float(np.max(np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)))


def hf_hidden(model, ids, mask):
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids),
                     attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()


def test_minilm_hidden_states_and_embeddings_match_transformers(minilm, tok, hf_bert):
    seqs = tok.encode_batch(SENTENCES)
    assert max(len(s) for s in seqs) == tok.max_length == 256
    # a padded batch mixing the longest and the shortest (mostly padding), then length buckets
    lengths = [len(s) for s in seqs]
    order = np.argsort(lengths)
    batches = [np.concatenate([order[-1:], order[:4]])] + list(length_batches(lengths, 6))
    worst = worst_tok = worst_emb = 0.0
    for idx in batches:
        ids, mask = tok.pad([seqs[i] for i in idx])
        ours = minilm.hidden_states(ids, mask)
        ref = hf_hidden(hf_bert, ids, mask)
        valid = mask.astype(bool)
        worst = max(worst, rel_err(ours, ref, valid))
        worst_tok = max(worst_tok, token_rel_err(ours, ref, valid))
        m = mask[:, :, None].astype(np.float64)
        pooled = (ref * m).sum(1) / m.sum(1)
        pooled /= np.linalg.norm(pooled, axis=1, keepdims=True)
        worst_emb = max(worst_emb, rel_err(minilm.embed(ids, mask), pooled))
    print(f"MiniLM hidden states: max rel {worst:.2e}, max token rel {worst_tok:.2e}, "
          f"embeddings max rel {worst_emb:.2e}")
    assert worst < RTOL and worst_tok < RTOL and worst_emb < RTOL


def test_sentence_embeddings_equal_sentence_transformers(minilm, tok):
    from sentence_transformers import SentenceTransformer
    st = SentenceTransformer(str(default_model_path()), device="cpu")
    assert st.max_seq_length == tok.max_length
    ref = st.encode(SENTENCES, batch_size=8, convert_to_numpy=True)
    ours = embed_texts(minilm, tok, SENTENCES, batch_size=8)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"sentence-transformers: min cosine {cos.min():.9f}, max abs {np.abs(ours - ref).max():.2e}")
    assert ours.shape == ref.shape == (len(SENTENCES), 384)
    assert cos.min() > 1 - 1e-5
    assert np.max(np.abs(ours - ref)) < 1e-4


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=211, n_positions=48, n_embd=64, n_layer=3, n_head=4)
    model = GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():                       # exercise biases and norms too (init: 0 / 1)
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    folder = tmp_path_factory.mktemp("gpt2")
    model.save_pretrained(folder)
    return folder, model


def random_batch(vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(4, 40))
    mask = np.ones_like(ids)
    for r, n in enumerate((40, 33, 9, 1)):
        mask[r, n:] = 0
    return ids, mask


def test_gpt2_logits_and_loss_match_transformers(gpt2_folder):
    folder, ref = gpt2_folder
    model = load_model(folder)
    assert model.kind == "decoder" and model.prefix == "transformer."
    ids, mask = random_batch(211)
    ours = model.logits(ids, mask)
    with torch.no_grad():
        out = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                  labels=torch.from_numpy(np.where(mask > 0, ids, -100)))
    valid = mask.astype(bool)
    err = rel_err(ours, out.logits.numpy(), valid)
    loss = model.next_token_loss(ids, mask)
    print(f"GPT-2 logits max rel {err:.2e}; loss {loss:.6f} vs {out.loss.item():.6f}")
    assert err < RTOL
    assert abs(loss - out.loss.item()) < 1e-5 * abs(out.loss.item())


def test_export_loads_in_transformers_bit_identical(minilm, tok, tmp_path):
    from transformers import AutoModel
    minilm.add_classifier(3, seed=0)             # head goes to its own file, not in the way
    try:
        out = export_hf(minilm, tmp_path / "minilm")
    finally:
        del minilm.params["classifier.weight"], minilm.params["classifier.bias"]
        minilm.head = None
    hf = AutoModel.from_pretrained(str(out)).eval()
    src = load_file(str(default_model_path() / "model.safetensors"))
    sd = hf.state_dict()
    for name, arr in src.items():
        if name in sd:
            assert sd[name].numpy().tobytes() == arr.tobytes(), name
    assert all(n in sd for n in minilm.params if not n.startswith("classifier"))
    ids, mask = tok(SENTENCES[:5])
    assert rel_err(minilm.hidden_states(ids, mask), hf_hidden(hf, ids, mask),
                   mask.astype(bool)) < RTOL


def test_gpt2_trained_in_place_then_exported(gpt2_folder, tmp_path):
    from transformers import AutoModel, GPT2LMHeadModel
    folder, _ = gpt2_folder
    model = load_model(folder)
    rng = np.random.default_rng(7)
    for _, a in model.named_parameters():          # what a ZO update does: in place
        a += rng.standard_normal(a.shape).astype(np.float32) * 0.01
    out = export_hf(model, tmp_path / "gpt2")
    hf = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    sd = hf.state_dict()
    for name, arr in model.params.items():
        assert sd[name].numpy().tobytes() == arr.tobytes(), name
    ids, mask = random_batch(211, seed=1)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
        base = AutoModel.from_pretrained(str(out)).eval()(
            input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    valid = mask.astype(bool)
    assert rel_err(model.logits(ids, mask), ref.numpy(), valid) < RTOL
    assert rel_err(model.hidden_states(ids, mask), base.last_hidden_state.numpy(), valid) < RTOL


def test_unsupported_real_architecture(tmp_path):
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                        num_hidden_layers=1, num_attention_heads=2)
    GPTNeoXForCausalLM(cfg).save_pretrained(tmp_path / "neox")
    with pytest.raises(SemzoError) as ei:
        load_model(tmp_path / "neox")
    msg = str(ei.value)
    assert "gpt_neox" in msg and "GPTNeoXForCausalLM" in msg and "config.json" in msg
    assert "LlamaForCausalLM" in msg and "OPTForCausalLM" in msg      # the supported list
    assert "\n" not in msg
