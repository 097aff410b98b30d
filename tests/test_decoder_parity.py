"""Parity of the decoder families with transformers (torch CPU, float32), on tiny random models
saved with ``save_pretrained``: Llama (GQA, llama3 rope scaling, tied and untied, biases, a
head_dim that is not hidden/heads, sharded), Qwen2 (q/k/v biases, sliding window on some
layers), Mistral (with and without sliding window), OPT (pre-LN; post-LN with
project_in/project_out, as OPT-350m), Qwen3 (q/k norms after q/k/v/o biases, with and
without sliding windows), Gemma 2 (sandwich norms, (1 + w) RMSNorm, scaled embeddings,
query_pre_attn_scalar, attention and final soft-capping, alternating windows), Gemma 3 text
(q/k norms, local/global rotary bases, final soft-capping), Phi-3 (fused qkv_proj and
gate_up_proj, partial rotary, sliding window), SmolLM3 (layers without rotary, biases) and
GPT-2 with ``scale_attn_weights: false`` and ``scale_attn_by_inverse_layer_idx``.

Right-padded batches of random shapes and seeds: logits within 1e-4 relative on real tokens,
next-token loss equal to transformers' (labels -100 at padding) within 1e-5 relative. Also:
the KV cache (incremental logits equal the full forward's), the stage API (composition
bit-identical to ``hidden_states``, each stage reads only its own parameters), bf16 files.
"""

from __future__ import annotations

import copy
import itertools
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch

from semzo.model import load_model, set_threads
from semzo.model.causal import CausalLM
from semzo.model.weights import Checkpoint

RTOL = 1e-4
V = 97
SMALL = {"vocab_size": V, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
OPT = {"vocab_size": V, "hidden_size": 64, "ffn_dim": 96, "num_hidden_layers": 2,
       "num_attention_heads": 4, "max_position_embeddings": 64}

# name -> (config class, kwargs, save_pretrained kwargs)
CASES = {
    "llama_gqa_llama3_untied": ("LlamaConfig", dict(SMALL, tie_word_embeddings=False,
                                                    attention_bias=True,
                                                    rope_parameters=LLAMA3), {}),
    "llama_tied_sharded": ("LlamaConfig", dict(SMALL, hidden_size=48, num_hidden_layers=3,
                                               num_attention_heads=6,
                                               num_key_value_heads=3, head_dim=16, mlp_bias=True,
                                               tie_word_embeddings=True),
                           {"max_shard_size": "40KB"}),
    "llama_linear_rope": ("LlamaConfig", dict(SMALL, rope_parameters={
        "rope_type": "linear", "rope_theta": 5000.0, "factor": 2.5}), {}),
    "qwen2": ("Qwen2Config", dict(SMALL, tie_word_embeddings=True), {}),
    "qwen2_window": ("Qwen2Config", dict(SMALL, use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1), {}),
    "mistral": ("MistralConfig", dict(SMALL, sliding_window=None), {}),
    "mistral_window": ("MistralConfig", dict(SMALL, sliding_window=4), {}),
    "opt_pre": ("OPTConfig", dict(OPT, do_layer_norm_before=True), {}),
    "opt_post_proj": ("OPTConfig", dict(OPT, do_layer_norm_before=False,
                                        word_embed_proj_dim=32), {}),
    "opt_nobias_noaffine": ("OPTConfig", dict(OPT, enable_bias=False,
                                              layer_norm_elementwise_affine=False,
                                              activation_function="gelu"), {}),
    # later families (semzo.model.variants): q/k norms, Gemma's sandwich norms, soft-caps
    # and local/global rotary, Phi-3's fused projections and partial rotary, SmolLM3's
    # layers without rotary
    "qwen3_bias": ("Qwen3Config", dict(SMALL, head_dim=24, attention_bias=True), {}),
    "qwen3_window": ("Qwen3Config", dict(SMALL, head_dim=16, num_hidden_layers=3,
                                         use_sliding_window=True, sliding_window=5,
                                         max_window_layers=1, tie_word_embeddings=True), {}),
    "gemma2": ("Gemma2Config", dict(SMALL, head_dim=16, num_hidden_layers=3, sliding_window=5,
                                    query_pre_attn_scalar=24, attn_logit_softcapping=0.02,
                                    final_logit_softcapping=3.0), {}),
    "gemma3": ("Gemma3TextConfig", dict(
        SMALL, head_dim=24, num_hidden_layers=3, sliding_window=4, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        final_logit_softcapping=3.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}}),
               {}),
    "phi3_partial": ("Phi3Config", dict(SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                        tie_word_embeddings=True, rope_parameters={
                                            "rope_type": "default", "rope_theta": 10000.0,
                                            "partial_rotary_factor": 0.75}), {}),
    "phi3_window": ("Phi3Config", dict(SMALL, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                       sliding_window=4), {}),
    "smollm3": ("SmolLM3Config", dict(SMALL, num_hidden_layers=4, no_rope_layer_interval=2,
                                      pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                      attention_bias=True, mlp_bias=True), {}),
    "gpt2_unscaled": ("GPT2Config", {"vocab_size": V, "n_positions": 64, "n_embd": 64, "n_layer": 2,
                                         "n_head": 4, "scale_attn_weights": False}, {}),
    "gpt2_inverse_layer": ("GPT2Config", {"vocab_size": V, "n_positions": 64, "n_embd": 64,
                                              "n_layer": 3, "n_head": 4,
                                              "scale_attn_by_inverse_layer_idx": True}, {}),
}


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py

#: q/k weights scaled up in these cases (random init attends almost uniformly, so rotary in a
#: layer or not would change the logits by less than RTOL)
SHARP = {"smollm3": 12.0}


_BUILT: dict = {}


def build(name: str, tmp_path_factory):
    """(folder, transformers model) of case ``name``, made once per module."""
    if name in _BUILT:
        return _BUILT[name]
    import transformers
    cls_name, kw, save_kw = CASES[name]
    cfg = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():                 # biases and norms start at 0 / 1: move them
        for _, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
        for n, p in model.named_parameters():     # sharper attention: positions matter more
            if n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(SHARP.get(name, 1.0))
    folder = tmp_path_factory.mktemp(name)
    model.save_pretrained(folder, **save_kw)
    _BUILT[name] = (folder, model)
    return folder, model


def padded_batch(rng, vocab: int, b: int, t: int):
    ids = rng.integers(0, vocab, size=(b, t))
    lengths = rng.integers(1, t + 1, size=b)
    lengths[0] = t
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.int64)
    return ids, mask


def rel_err(a, b, valid) -> float:
    a, b = np.asarray(a, np.float64)[valid], np.asarray(b, np.float64)[valid]
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_loss_match_transformers(name, tmp_path_factory):
    folder, ref = build(name, tmp_path_factory)
    model = load_model(folder)
    if name.startswith("llama_tied"):
        assert (folder / "model.safetensors.index.json").is_file()
        assert len({Checkpoint(folder).file(n) for n in Checkpoint(folder)}) > 1
    rng = np.random.default_rng(len(name))
    worst = 0.0
    for _ in range(3):                     # random shapes: sequences longer than the windows
        ids, mask = padded_batch(rng, V, int(rng.integers(1, 5)), int(rng.integers(6, 24)))
        with torch.no_grad():
            out = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                      labels=torch.from_numpy(np.where(mask > 0, ids, -100)))
        valid = mask.astype(bool)
        worst = max(worst, rel_err(model.logits(ids, mask), out.logits.numpy(), valid))
        if mask[:, 1:].sum():
            loss = model.next_token_loss(ids, mask)
            assert abs(loss - out.loss.item()) <= 1e-5 * abs(out.loss.item()), (name, loss)
    print(f"{name}: logits max rel {worst:.2e}")
    assert worst < RTOL, name


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "mistral_window", "opt_post_proj",
                                  "qwen2_window", "qwen3_bias", "qwen3_window", "gemma2",
                                  "gemma3", "phi3_partial", "phi3_window", "smollm3"])
def test_kv_cache_matches_full_forward(name, tmp_path_factory):
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    assert isinstance(model, CausalLM)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, V, size=(2, 5))
    cache = model.new_cache(2, 16)
    z = model.forward_cached(ids[:, :3], cache)          # a prompt in two pieces
    z = np.concatenate([z, model.forward_cached(ids[:, 3:], cache)], axis=1)
    assert cache.length == 5 and z.shape == (2, 5, V)
    full = model.logits(ids, np.ones_like(ids))
    assert np.max(np.abs(z - full)) <= 1e-5 * np.max(np.abs(full))
    seq = ids
    for _ in range(8):                                    # greedy, one token at a time
        nxt = z[:, -1].argmax(-1)[:, None]
        seq = np.concatenate([seq, nxt], axis=1)
        z = model.forward_cached(nxt, cache)
        full = model.logits(seq, np.ones_like(seq))[:, -1:]
        assert np.max(np.abs(z - full)) <= 1e-5 * np.max(np.abs(full)), name
    with pytest.raises(ValueError, match="do not fit"):
        model.forward_cached(seq[:, :4], cache)


@pytest.mark.parametrize("name", ["llama_tied_sharded", "opt_post_proj"])
def test_stage_api_composes_to_hidden_states(name, tmp_path_factory):
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    model.add_lora(rank=2, targets=("q_proj", "v_proj"), freeze_base=False)
    model.add_classifier(3)
    for spec in model.lora.values():                     # make the deltas count
        model.params[spec.b][...] = 0.05
    names = [n for k in range(model.n_stages) for n in model.stage_names(k)]
    assert sorted(names) == sorted(model.params) and len(names) == len(set(names))
    last = model.stage_names(model.n_stages - 1)
    assert "classifier.weight" in last and model.tied_head == model.config.tied
    assert any(n.endswith("q_proj.lora_A.weight") for n in model.stage_names(1))
    rng = np.random.default_rng(1)
    ids, mask = padded_batch(rng, V, 5, 60)               # 300 tokens: split over threads
    for threads in (1, 2):
        set_threads(threads)
        try:
            ref = model.hidden_states(ids, mask)
            st = model.stage_start(ids, mask)
            states = [st.fork()]
            for k in range(model.n_stages):
                st = model.stage_forward(k, st)
                states.append(st.fork())
        finally:
            set_threads(1)
        assert np.array_equal(st.hidden, ref)
        loss = model.next_token_loss(ids, mask)
        assert model.next_token_loss_from_hidden(st.hidden, st.ids, st.maskf) == loss
    # each stage reads only its own parameters: poison every other one
    saved = {n: a.copy() for n, a in model.params.items()}
    try:
        for k in range(model.n_stages):
            own = set(model.stage_names(k))
            for n, a in model.params.items():
                a[...] = saved[n] if n in own else np.nan
            out = model.stage_forward(k, states[k].fork())
            assert np.array_equal(out.hidden, states[k + 1].hidden), k
            assert out.stage == k + 1
    finally:
        for n, a in model.params.items():
            a[...] = saved[n]


@pytest.mark.parametrize("name", ["llama_tied_sharded", "qwen2_window", "opt_post_proj"])
def test_padding_is_skipped_and_the_bits_do_not_depend_on_threads(name, tmp_path_factory,
                                                                  monkeypatch):
    """The forward computes the projections, norms and MLP of real tokens only (padded rows
    packed out), and cuts a batch into groups that depend on the mask alone: hidden states and
    loss equal the unpacked forward's within float32 rounding and are bit-identical for 1, 2,
    3 and 4 threads; transformers agrees on the packed forward (its parity test above)."""
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    model.add_lora(rank=2, targets=("q_proj", "v_proj"), freeze_base=False)
    for spec in model.lora.values():
        model.params[spec.b][...] = 0.05
    rng = np.random.default_rng(7)
    ids, mask = padded_batch(rng, V, 11, 48)
    mask[3] = 0                                           # a row of padding only
    mask[4, 1:] = 0                                       # one real token
    valid = mask.astype(bool)
    # the groups: consecutive rows, an even number of them, from the mask alone
    model.group_tokens = 64                               # several groups of this small batch
    groups, weights = model._plan(mask.astype(np.float32))
    assert len(groups) >= 4 and len(groups) % 2 == 0 and sum(weights) == mask.sum()
    assert groups[0][0].start == 0 and groups[-1][0].stop == 11
    assert all(a[0].stop == b[0].start for a, b in itertools.pairwise(groups))
    # every projection of a block sees the group's real tokens only (a lone real token
    # travels with one padded row: a one-row product would be a GEMV)
    seen = []
    proj = CausalLM._proj

    def spy(self, x, module, out, xb=None):
        if module.endswith("q_proj"):
            seen.append(x.shape[0])
        return proj(self, x, module, out, xb)
    monkeypatch.setattr(CausalLM, "_proj", spy)
    model.hidden_states(ids, mask)
    want = [int(mask[g[0]].sum()) for g in groups]
    want = [2 if k == 1 else k for k in want if k]
    # (each group through every block before the next group: hidden_states runs a thread's
    # groups through all the stages at once)
    assert seen == [k for k in want for _ in range(model.config.num_layers)]
    assert sum(want) < mask.size
    monkeypatch.undo()
    outs = {}
    for threads in (1, 2, 3, 4):
        set_threads(threads)
        try:
            outs[threads] = (model.hidden_states(ids, mask), model.next_token_loss(ids, mask))
        finally:
            set_threads(1)
    for threads in (2, 3, 4):
        assert np.array_equal(outs[threads][0][valid], outs[1][0][valid]), threads
        assert outs[threads][1] == outs[1][1], threads
    model.pack_min_share = 2.0                            # never pack
    hs = model.hidden_states(ids, mask)
    assert rel_err(outs[1][0], hs, valid) < 1e-6
    assert abs(model.next_token_loss(ids, mask) - outs[1][1]) < 1e-6 * abs(outs[1][1])


@pytest.mark.parametrize(("name", "taken"), [
    ("llama_gqa_llama3_untied", True), ("qwen3_window", True), ("phi3_partial", True),
    ("qwen2", True), ("smollm3", False), ("gemma3", False), ("opt_pre", False)])
def test_transposed_mlp_has_the_row_layouts_bits(name, taken, tmp_path_factory, monkeypatch):
    """The CPU's gated MLP computed transposed (``W @ a.T``; Phi-3's fused gate_up too) gives
    the row layout's logits and loss bit for bit, padded rows and several groups and threads
    included; it is taken where it applies (not for MLP biases (this SmolLM3 case), Gemma's
    sandwich norms, OPT's ungated MLP, or LoRA on an MLP projection)."""
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    rng = np.random.default_rng(11)
    ids, mask = padded_batch(rng, V, 9, 40)
    model.group_tokens = 64
    calls = []
    orig = CausalLM._mlp_transposed

    def spy(self, *a):
        calls.append(1)
        return orig(self, *a)
    monkeypatch.setattr(CausalLM, "_mlp_transposed", spy)
    outs = {}
    for flag in (False, True):
        monkeypatch.setattr(CausalLM, "mlp_transposed", flag)
        set_threads(2)
        try:
            outs[flag] = (model.logits(ids, mask).copy(), model.next_token_loss(ids, mask))
        finally:
            set_threads(1)
    assert bool(calls) == taken
    assert np.array_equal(outs[True][0], outs[False][0])
    assert outs[True][1] == outs[False][1]
    if taken:                                     # LoRA on an MLP projection: the row layout
        model.add_lora(rank=2, targets=("down_proj",), freeze_base=False)
        calls.clear()
        model.logits(ids, mask)
        assert not calls


def test_bf16_checkpoint_loads_as_float32(tmp_path_factory, tmp_path):
    _folder, ref = build("llama_gqa_llama3_untied", tmp_path_factory)
    half = copy.deepcopy(ref).to(torch.bfloat16)
    half.save_pretrained(tmp_path)
    assert Checkpoint(tmp_path).dtype("lm_head.weight") == "BF16"
    model = load_model(tmp_path)
    sd = half.state_dict()
    for name, a in model.params.items():
        assert np.array_equal(a, sd[name].float().numpy()), name


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window", "qwen3_window", "gemma2",
                                  "gemma3", "phi3_window"])
def test_sliding_window_is_what_makes_the_match(name, tmp_path_factory):
    """Without its window the model no longer matches: the parity above exercises it."""
    from dataclasses import replace
    folder, ref = build(name, tmp_path_factory)
    model = load_model(folder)
    assert any(w is not None for w in model.config.sliding_window)
    model.config = replace(model.config, sliding_window=())
    ids = np.random.default_rng(0).integers(0, V, size=(1, 20))
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert rel_err(model.logits(ids), want, np.ones((1, 20), bool)) > 1e-3


@pytest.mark.parametrize("name,field", [
    ("qwen3_bias", "qk_norm"), ("gemma2", "norm_plus_one"), ("gemma2", "sandwich"),
    ("gemma2", "embed_scale"), ("gemma2", "attn_scale"), ("gemma2", "attn_softcap"),
    ("gemma2", "final_softcap"), ("gemma3", "qk_norm"), ("gemma3", "rope_local"),
    ("gemma3", "final_softcap"), ("phi3_partial", "rope"), ("smollm3", "no_rope")])
def test_each_later_feature_is_what_makes_the_match(name, field, tmp_path_factory):
    """Switched off (its default; Phi-3: rotary on the whole head), a feature of the later
    families breaks the match: the parity above exercises every one."""
    from dataclasses import fields, replace

    from semzo.model.spec import RopeSpec
    folder, ref = build(name, tmp_path_factory)
    model = load_model(folder)
    off = {f.name: f.default for f in fields(model.config)}[field]
    if field == "rope":
        off = RopeSpec(model.config.rope.theta)
    assert getattr(model.config, field) != off
    model.config = replace(model.config, **{field: off})
    model.scale = model.config.head_dim ** -0.5 if field == "attn_scale" else model.scale
    ids = np.random.default_rng(0).integers(0, V, size=(1, 20))
    with torch.no_grad():
        want = ref(input_ids=torch.from_numpy(ids)).logits.numpy()
    assert rel_err(model.logits(ids), want, np.ones((1, 20), bool)) > 1e-3


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "qwen2_window", "opt_post_proj",
                                  "qwen3_bias", "gemma2", "gemma3", "phi3_partial", "smollm3"])
def test_generic_xp_path_matches_numba_path(name, tmp_path_factory, monkeypatch):
    """The array-module code the GPU runs (CuPy), exercised with NumPy on CPU."""
    from semzo.model import kernels, kernels_lm
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    ids, mask = padded_batch(np.random.default_rng(2), V, 3, 17)
    want = model.logits(ids, mask)
    cache = model.new_cache(3, 20)
    want_c = model.forward_cached(ids[:, :9], cache)
    monkeypatch.setattr(kernels_lm, "_is_cpu32", lambda *a: False)
    monkeypatch.setattr(kernels, "_is_cpu32", lambda *a: False)
    got = model.logits(ids, mask)
    valid = mask.astype(bool)
    assert rel_err(got, want, valid) < 1e-5
    cache = model.new_cache(3, 20)
    assert np.max(np.abs(model.forward_cached(ids[:, :9], cache) - want_c)) < \
        1e-5 * np.max(np.abs(want_c))


@pytest.mark.parametrize("name", ["llama_tied_sharded", "opt_post_proj"])
def test_trained_in_place_then_exported_loads_in_transformers(name, tmp_path_factory, tmp_path):
    import transformers

    from semzo.model import export_hf
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    model.add_lora(rank=2, targets=("v_proj",))
    rng = np.random.default_rng(7)
    for _, a in model.named_parameters():                # what a ZO update does: in place
        a += rng.standard_normal(a.shape).astype(np.float32) * 0.05
    out = export_hf(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids, mask = padded_batch(np.random.default_rng(4), V, 3, 12)
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    assert rel_err(model.logits(ids, mask), want.numpy(), mask.astype(bool)) < RTOL


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "opt_pre", "qwen2", "qwen3_bias",
                                  "smollm3"])
def test_batched_generation_of_right_padded_prompts_equals_each_alone(name, tmp_path_factory):
    """(Not for sliding windows: a window counts cache slots, padded ones included, as
    transformers' does.)"""
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    rng = np.random.default_rng(5)
    ids, mask = padded_batch(rng, V, 3, 7)
    mask[1, 3:] = 0
    cache = model.new_cache(3, 16)
    z = model.forward_cached(ids, cache, mask)
    last = mask.sum(1) - 1
    nxt = z[np.arange(3), last].argmax(-1)
    steps = [nxt]
    for _ in range(5):
        z = model.forward_cached(nxt[:, None], cache)
        nxt = z[:, -1].argmax(-1)
        steps.append(nxt)
    got = np.stack(steps, 1)
    for r in range(3):
        seq = ids[r:r + 1, :int(mask[r].sum())]
        c1 = model.new_cache(1, 16)
        z1 = model.forward_cached(seq, c1)
        out = []
        for _ in range(6):
            n = int(z1[0, -1].argmax())
            out.append(n)
            z1 = model.forward_cached(np.array([[n]]), c1)
        assert out == got[r].tolist(), (name, r)


def test_transformers4_rope_keys_read_like_rope_parameters(tmp_path_factory, tmp_path):
    """config.json written by transformers 4 (top-level rope_theta, rope_scaling with "type")."""
    import json
    folder, _ = build("llama_gqa_llama3_untied", tmp_path_factory)
    cfg = json.loads((folder / "config.json").read_text())
    rp = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rp.pop("rope_theta")
    rp["type"] = rp.pop("rope_type")
    cfg["rope_scaling"] = rp
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    a, b = load_model(folder), load_model(tmp_path)
    assert a.config.rope == b.config.rope and a.config.rope.kind == "llama3"
    ids = np.arange(30).reshape(2, 15) % V
    assert np.array_equal(a.logits(ids), b.logits(ids))


#: the projections each later family offers LoRA (suffixes of ``lora_modules()``)
LORA_TARGETS = {
    "qwen3_bias": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma2": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "gemma3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
    "phi3_partial": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
    "smollm3": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
}


@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_default_lora_targets_are_the_attention_inputs(name, tmp_path_factory):
    """The deck's default (`train.lora_targets = []`): q and v, or Phi-3's fused qkv_proj
    (never the MLP or the output projection)."""
    from semzo.finetune.trainable import default_lora_targets
    folder, _ = build(name, tmp_path_factory)
    want = ("qkv_proj",) if "qkv_proj" in LORA_TARGETS[name] else ("q_proj", "v_proj")
    assert default_lora_targets(load_model(folder)) == want


@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_lora_targets_of_the_later_families_export_to_transformers(name, tmp_path_factory,
                                                                   tmp_path):
    """Every projection takes LoRA (Phi-3: the fused ``qkv_proj`` / ``gate_up_proj``, as
    PEFT); trained in place, merged by export_hf, the folder loads in transformers and gives
    our logits; the stage API still holds every tensor in one stage."""
    import transformers

    from semzo.model import export_hf
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    mods = model.lora_modules()
    assert {m.rsplit(".", 1)[-1] for m in mods} == LORA_TARGETS[name]
    assert len(mods) == len(LORA_TARGETS[name]) * model.config.num_layers
    model.add_lora(rank=2, targets=tuple(LORA_TARGETS[name]), freeze_base=False)
    names = [n for k in range(model.n_stages) for n in model.stage_names(k)]
    assert sorted(names) == sorted(model.params) and len(names) == len(set(names))
    rng = np.random.default_rng(7)
    for _, a in model.named_parameters():
        a += rng.standard_normal(a.shape).astype(np.float32) * 0.05
    out = export_hf(model, tmp_path / "out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids, mask = padded_batch(np.random.default_rng(4), V, 3, 12)
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    assert rel_err(model.logits(ids, mask), want.numpy(), mask.astype(bool)) < RTOL


@pytest.mark.parametrize("name", ["qwen3_window", "gemma2", "gemma3", "phi3_partial",
                                  "phi3_window", "smollm3"])
def test_greedy_generation_of_the_later_families_equals_transformers(name, tmp_path_factory):
    """The KV cache (sliding windows, per-layer rotary, soft-capped logits) against
    transformers' own cache in ``generate``."""
    folder, ref = build(name, tmp_path_factory)
    model = load_model(folder)
    ids = np.random.default_rng(11).integers(3, V, size=(1, 6))
    cache = model.new_cache(1, 20)
    z = model.forward_cached(ids, cache)
    ours = []
    for _ in range(10):
        nxt = int(z[0, -1].argmax())
        ours.append(nxt)
        z = model.forward_cached(np.array([[nxt]]), cache)
    with torch.no_grad():
        out = ref.generate(torch.from_numpy(ids), max_new_tokens=10, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert ours == out[0, 6:].tolist(), name


@pytest.mark.parametrize("name,key,value", [
    ("phi3_partial", "rope_parameters", {"rope_type": "longrope", "rope_theta": 1e4,
                                         "short_factor": [1.0] * 6, "long_factor": [2.0] * 6,
                                         "partial_rotary_factor": 0.75}),
    ("phi3_partial", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4,
                                         "partial_rotary_factor": 0.2}),  # 3 dims: odd
    ("gemma3", "use_bidirectional_attention", True),
    ("gemma3", "rope_parameters", {"rope_type": "default", "rope_theta": 1e4}),
    ("gemma2", "layer_types", ["full_attention"]),
    ("smollm3", "no_rope_layers", [1, 0, 2, 1]),
    ("qwen3_window", "layer_types", ["chunked_attention"] * 3),
    # a window of 0 tokens (the kernels would take it for none)
    ("mistral_window", "sliding_window", 0), ("gemma2", "sliding_window", 0),
    ("qwen2_window", "sliding_window", 0), ("phi3_partial", "sliding_window", 0)])
def test_later_families_refuse_by_name(name, key, value, tmp_path_factory, tmp_path):
    import json

    from semzo.runtime import SemzoError
    folder, _ = build(name, tmp_path_factory)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(SemzoError) as ei:
        load_model(tmp_path)
    msg = str(ei.value)
    assert (key in msg or "head_dim" in msg) and "config.json" in msg and "\n" not in msg, msg


@pytest.mark.parametrize("name", ["gemma3", "phi3_partial"])
def test_transformers4_rope_keys_of_gemma3_and_phi3(name, tmp_path_factory, tmp_path):
    """Gemma 3 files of transformers 4: ``rope_theta`` / ``rope_scaling`` for the full layers,
    ``rope_local_base_freq`` for the sliding ones; Phi-3: top-level ``partial_rotary_factor``
    and ``rope_theta``."""
    import json
    folder, _ = build(name, tmp_path_factory)
    cfg = json.loads((folder / "config.json").read_text())
    rp = cfg.pop("rope_parameters")
    if name == "gemma3":
        full = dict(rp["full_attention"])
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_scaling"] = full
        cfg["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    else:
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    a, b = load_model(folder), load_model(tmp_path)
    assert a.config.rope == b.config.rope and a.config.rope_local == b.config.rope_local
    ids = np.arange(30).reshape(2, 15) % V
    assert np.array_equal(a.logits(ids), b.logits(ids))


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "llama_gqa_llama3_untied"])
def test_prompt_label_word_scores_equal_the_full_logits(name, tmp_path_factory):
    """The prompt task's label-word scores (only the label words' LM-head rows) equal the
    model's full logits at each row's last real position, Gemma 2's final soft-cap included
    (it was skipped once: the accuracy is the same, the loss was not)."""
    from semzo.tasks.prompt import prompt_scores
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder)
    ids, mask = padded_batch(np.random.default_rng(3), V, 3, 7)
    full = model.logits(ids, mask)                                  # (B, T, V)
    words = np.array([5, 17, 42])
    last = mask.sum(axis=1) - 1
    want = full[np.arange(3), last][:, words]
    got = prompt_scores(model, model.hidden_states(ids, mask), mask.astype(np.float32), words)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if model.config.final_softcap:
        assert np.abs(got).max() < model.config.final_softcap        # capped
