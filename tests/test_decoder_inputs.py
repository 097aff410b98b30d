"""Bad input to the model loader and the forward passes (issue 12 defects 1-3, issue 13):
token ids outside the vocabulary (padded positions included), the pad id a tokenizer picks,
unknown architectures, refused config fields (every field of every supported transformers
config class is honoured, inert or refused), missing shards, wrong shapes, truncated files,
BERT checkpoints with MLM / pre-training heads, and the name sort key."""

from __future__ import annotations

import json
import logging
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch

from semzo.model import Tokenizer, families, load_model
from semzo.model.base import TokenIdError
from semzo.model.loader import _name_key
from semzo.model.spec import COMMON_INERT, COMMON_REFUSED
from semzo.model.tokenizer import pad_id_for
from semzo.runtime import SemzoError

V = 53


def save(folder, cls_name: str, **kw):
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, cls_name.replace("ForCausalLM", "Config").replace(
        "LMHeadModel", "Config").replace("ForMaskedLM", "Config").replace(
        "ForPreTraining", "Config").replace("Model", "Config"))(**kw)
    getattr(transformers, cls_name)(cfg).eval().save_pretrained(folder)
    return folder


LLAMA = {"vocab_size": V, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM", **LLAMA)


@pytest.fixture(scope="module")
def gpt2_small_vocab(tmp_path_factory):
    """GPT2Config's default eos 50256 lies outside this model's 53 ids."""
    return save(tmp_path_factory.mktemp("gpt2"), "GPT2LMHeadModel", vocab_size=V,
                n_positions=32, n_embd=32, n_layer=1, n_head=2)


# ----------------------------------------------------------------------------- token ids

@pytest.mark.parametrize("seed", range(4))
def test_out_of_vocabulary_ids_raise_naming_id_and_size(llama, gpt2_small_vocab, seed):
    rng = np.random.default_rng(seed)
    models = [load_model(llama), load_model(gpt2_small_vocab)]
    for model in models:
        ids = rng.integers(0, V, size=(3, 9))
        mask = np.ones_like(ids)
        mask[1:, 5:] = 0
        bad = int(rng.choice([V, V + 7, 10**9, -1, 2**40]))
        r, c = int(rng.integers(1, 3)), int(rng.integers(5, 9))     # a masked pad position
        ids[r, c] = bad
        for call in (model.hidden_states, model.logits, model.next_token_loss):
            with pytest.raises(TokenIdError) as ei:
                call(ids, mask)
            msg = str(ei.value)
            assert str(bad) in msg and str(V) in msg and "\n" not in msg
            assert isinstance(ei.value, ValueError) and ei.value.exit_code == 2
        ids[r, c] = V - 1                                            # the last valid id
        assert np.isfinite(model.logits(ids, mask)).all()
    with pytest.raises(TokenIdError, match=str(10**9)):
        models[0].stage_start(np.array([[1, 10**9]]), np.array([[1, 0]]))
    cache = models[0].new_cache(1, 8)
    with pytest.raises(TokenIdError, match="-3"):
        models[0].forward_cached(np.array([[1, -3]]), cache)
    assert cache.length == 0


def test_minilm_pad_position_id_out_of_vocabulary():
    """Issue 12's reproducer: it segfaulted (exit 139)."""
    enc = load_model()
    with pytest.raises(TokenIdError, match="1000000000.*30522"):
        enc.hidden_states(np.array([[101, 2000, 102, 10**9]]), np.array([[1, 1, 1, 0]]))
    with pytest.raises(TokenIdError, match="30527"):
        enc.embed(np.array([[101, 30527, 102]]))


def test_pad_id_is_always_inside_the_vocabulary():
    rng = random.Random(0)
    for _ in range(300):
        vocab = rng.choice([None, 1, 5, 50, 50257])
        cfg = {k: v for k, v in (("vocab_size", vocab),
                                 ("pad_token_id", rng.choice([None, 0, 3, 49, 50256, -1])),
                                 ("eos_token_id", rng.choice([None, 0, 2, 50256, [4, 9], []])))
               if rng.random() < 0.8}
        tok_pad = rng.choice([None, None, 1, 70000])
        pid = pad_id_for(cfg, tok_pad)
        vocab = cfg.get("vocab_size")
        assert pid >= 0 and (vocab is None or pid < vocab)
        cands = [tok_pad, cfg.get("pad_token_id"), (cfg.get("eos_token_id") or [None])[0]
                 if isinstance(cfg.get("eos_token_id"), list) else cfg.get("eos_token_id")]
        valid = [c for c in cands if c is not None and c >= 0 and (vocab is None or c < vocab)]
        assert pid == (valid[0] if valid else 0)
    assert pad_id_for({"pad_token_id": 0, "eos_token_id": 7, "vocab_size": 9}) == 0


def test_small_vocab_gpt2_tokenizer_pads_with_a_valid_id(gpt2_small_vocab, tmp_path):
    """The realistic trigger of defect 1: a GPT-2 with a small vocabulary and no pad token."""
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(V)}
    tk = HFTok(models.WordLevel(vocab, unk_token="w0"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.save(str(gpt2_small_vocab / "tokenizer.json"))
    tok = Tokenizer.from_folder(gpt2_small_vocab)
    assert json.loads((gpt2_small_vocab / "config.json").read_text())["eos_token_id"] == 50256
    assert tok.pad_id == 0
    ids, mask = tok(["w1 w2 w3 w4", "w5"])
    assert ids[1, 1] == 0 and mask[1, 1] == 0
    model = load_model(gpt2_small_vocab)
    assert np.isfinite(model.next_token_loss(ids, mask))


# ----------------------------------------------------------------------------- config fields

def _tables():
    import transformers as t
    out = []
    for fam in families.FAMILIES:
        cls = getattr(t, getattr(fam, "CONFIG_CLASS", None) or
                      fam.ARCHITECTURES[0].replace("ForCausalLM", "Config"))
        out.append((cls, fam.HONOURED, fam.INERT, fam.REFUSED))
    return out


def test_every_field_of_every_config_class_is_honoured_inert_or_refused():
    """A field transformers adds later (to a class or to PretrainedConfig) fails here until it
    is classified."""
    import dataclasses
    for cls, honoured, inert, refused in _tables():
        fields = set(cls().to_dict())
        if dataclasses.is_dataclass(cls):
            fields |= {f.name for f in dataclasses.fields(cls)}
        known = honoured | inert | set(refused) | COMMON_INERT | set(COMMON_REFUSED)
        missing = sorted(fields - known)
        assert not missing, f"{cls.__name__}: unclassified fields {missing}"
        assert not (honoured & inert), cls.__name__


def test_refused_fields_name_the_key(llama, tmp_path):
    cases = [("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
             ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.5}),
             ("hidden_act", "tanh"), ("pruned_heads", {"0": [1]})]
    for key, value in cases:
        d = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        cfg = json.loads((llama / "config.json").read_text())
        cfg[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        (d / "model.safetensors").symlink_to(llama / "model.safetensors")
        with pytest.raises(SemzoError) as ei:
            load_model(d)
        msg = str(ei.value)
        assert key in msg and "config.json" in msg and "\n" not in msg, msg
    bert = tmp_path / "bert"
    save(bert, "BertModel", vocab_size=V, hidden_size=32, num_hidden_layers=1,
         num_attention_heads=2, intermediate_size=64, is_decoder=True)
    with pytest.raises(SemzoError, match="is_decoder"):
        load_model(bert)


def test_unknown_architecture_lists_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["MambaForCausalLM"], "model_type": "mamba"}))
    with pytest.raises(SemzoError) as ei:
        load_model(tmp_path)
    msg = str(ei.value)
    assert "MambaForCausalLM" in msg and ei.value.exit_code == 2 and "\n" not in msg
    for arch in families.SUPPORTED_ARCHS:
        assert arch in msg


# ----------------------------------------------------------------------------- files

def test_missing_shard_and_wrong_shape_name_file_and_tensor(tmp_path):
    import transformers
    cfg = transformers.LlamaConfig(**LLAMA)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "s", max_shard_size="20KB")
    index = json.loads((tmp_path / "s" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    load_model(tmp_path / "s")
    victim = shards[1]
    (tmp_path / "s" / victim).unlink()
    with pytest.raises(SemzoError) as ei:
        load_model(tmp_path / "s")
    held = [n for n, f in index["weight_map"].items() if f == victim]
    assert victim in str(ei.value) and any(repr(n) in str(ei.value) for n in held)

    from safetensors.numpy import load_file, save_file
    one = save(tmp_path / "one", "LlamaForCausalLM", **LLAMA)
    t = load_file(str(one / "model.safetensors"))
    t["model.layers.1.self_attn.k_proj.weight"] = np.zeros((17, 32), np.float32)
    save_file(t, str(one / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SemzoError) as ei:
        load_model(one)
    msg = str(ei.value)
    assert "model.safetensors" in msg and "model.layers.1.self_attn.k_proj.weight" in msg
    assert "[17, 32]" in msg and "\n" not in msg


def test_truncated_or_foreign_safetensors_file(llama, tmp_path):
    data = (llama / "model.safetensors").read_bytes()
    (tmp_path / "config.json").write_text((llama / "config.json").read_text())
    for cut in (len(data) - 5, len(data) // 2, 7, 0):
        (tmp_path / "model.safetensors").write_bytes(data[:cut])
        with pytest.raises(SemzoError) as ei:
            load_model(tmp_path)
        assert "model.safetensors" in str(ei.value) and "\n" not in str(ei.value)
    (tmp_path / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"not json!" * 2)
    with pytest.raises(SemzoError, match="not a safetensors file"):
        load_model(tmp_path)


@pytest.mark.parametrize("head", ["BertForMaskedLM", "BertForPreTraining"])
def test_bert_with_pretraining_heads_loads_and_ignores_them(head, tmp_path, caplog):
    import transformers
    kw = {"vocab_size": V, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 32}
    save(tmp_path, head, **kw)
    with caplog.at_level(logging.INFO):
        model = load_model(tmp_path)
    assert not any(n.startswith("cls.") for n in model.params)
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len(lines) == 1 and "cls." in lines[0]
    ref = getattr(transformers, head).from_pretrained(str(tmp_path)).eval().bert
    ids = np.random.default_rng(0).integers(0, V, size=(2, 7))
    mask = np.ones_like(ids)
    mask[1, 4:] = 0
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(ids),
                   attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    got = model.hidden_states(ids, mask)
    valid = mask.astype(bool)
    assert np.max(np.abs(got[valid] - want[valid])) < 1e-4 * np.max(np.abs(want[valid]))


def test_name_key_orders_any_mixture_of_names():
    rng = random.Random(1)
    parts = ["cls", "predictions", "bias", "weight", "transform", "dense", "0", "1", "10",
             "LayerNorm", "decoder", "2"]
    for _ in range(200):
        names = {".".join(rng.choice(parts) for _ in range(rng.randint(1, 5)))
                 for _ in range(12)}
        ordered = sorted(names, key=_name_key)          # used to raise TypeError
        assert sorted(ordered, key=_name_key) == ordered
    assert sorted(["a.bias", "a.weight", "a.10.weight", "a.2.weight"], key=_name_key) == \
        ["a.weight", "a.bias", "a.2.weight", "a.10.weight"]


def test_class_labels_outside_the_head_raise(llama):
    model = load_model(llama)
    model.add_classifier(3)
    ids = np.ones((2, 4), np.int64)
    for bad in (-1, 3, 10**9):
        with pytest.raises(TokenIdError, match=f"label {bad} .*3 classes"):
            model.classify(ids, np.ones_like(ids), np.array([0, bad]))
    loss, acc, _ = model.classify(ids, np.ones_like(ids), np.array([0, 2]))
    assert np.isfinite(loss) and 0 <= acc <= 1
