"""bfloat16 weight storage on the CPU (:mod:`semzo.model.storage`): every family against
transformers, export, checkpoints, the deck / load_model / generate rules, ZO at 2 ranks.

Bounds (figures measured on the tiny models of test_decoder_parity.py, one thread):

- against transformers whose weights are rounded to bfloat16 and computed in float32
  (every parameter ``p.to(torch.bfloat16).float()``, the same numbers semzo stores; buffers
  such as rotary frequencies stay float32): logits within ``RTOL_BF16`` = 2e-6 relative
  (measured 1.8e-7 .. 4.3e-7; MiniLM hidden states 5.2e-7), next-token loss within 1e-5
  relative: only the float32 summation order differs, as in the float32 parity;
- against the float32 model: within ``RTOL_F32`` = 1e-2 (measured 1.8e-3 .. 4.8e-3): every
  weight is rounded by at most 2**-9 relative, the price of bfloat16 itself.
(``model.to(torch.bfloat16)`` would also round the rotary ``inv_freq`` buffer: 6.5e-6.)
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import pytest
import torch
from mpiutil import ROOT, check, mpirun
from test_decoder_parity import CASES, V, build, padded_batch, rel_err

from semzo.model import export_hf, load_model
from semzo.model.storage import to_bits, to_float32
from semzo.model.weights import Checkpoint
from semzo.runtime import SemzoError

RTOL_BF16 = 2e-6
RTOL_F32 = 1e-2


pytestmark = pytest.mark.usefixtures("one_thread")   # tests/conftest.py


def bf16_ref(ref):
    """transformers on bfloat16-rounded weights (every parameter; buffers such as rotary
    frequencies stay float32, as semzo's), computed in float32."""
    out = copy.deepcopy(ref)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_every_family_matches_transformers_on_bf16_weights(name, tmp_path_factory):
    folder, ref = build(name, tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    assert model.storage == "bfloat16" and model.dtype == np.float32
    assert all(a.dtype == np.uint16 for a in model.params.values())
    r16 = bf16_ref(ref)
    sd = r16.state_dict()
    for n, a in model.params.items():        # the stored bits are torch's rounding
        assert np.array_equal(to_float32(a), sd[n].numpy()), n
    ids, mask = padded_batch(np.random.default_rng(len(name) + 1), V, 3, 19)
    with torch.no_grad():
        o16 = r16(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                  labels=torch.from_numpy(np.where(mask > 0, ids, -100)))
        o32 = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    valid = mask.astype(bool)
    got = model.logits(ids, mask)
    e16, e32 = rel_err(got, o16.logits.numpy(), valid), rel_err(got, o32.logits.numpy(), valid)
    print(f"{name}: logits max rel {e16:.2e} vs bf16 weights, {e32:.2e} vs float32")
    assert e16 < RTOL_BF16 and e32 < RTOL_F32, (e16, e32)
    loss = model.next_token_loss(ids, mask)
    assert abs(loss - o16.loss.item()) <= 1e-5 * abs(o16.loss.item())


def test_minilm_encoder_bf16_matches_transformers():
    from transformers import AutoModel

    from semzo.model import Tokenizer, default_model_path
    model = load_model(None, dtype="bfloat16")
    ref = AutoModel.from_pretrained(str(default_model_path())).eval()
    tok = Tokenizer.from_folder()
    ids, mask = tok(["a sentence about cats", "bfloat16 weights, float32 sums", "x"])
    with torch.no_grad():
        want = bf16_ref(ref)(input_ids=torch.from_numpy(ids),
                             attention_mask=torch.from_numpy(mask)).last_hidden_state.numpy()
    got = model.hidden_states(ids, mask)
    err = rel_err(got, want, mask.astype(bool))
    print(f"minilm: hidden max rel {err:.2e} vs bf16 weights")
    assert err < RTOL_BF16
    emb = model.embed(ids, mask)
    assert emb.dtype == np.float32 and np.allclose(np.linalg.norm(emb, axis=1), 1, atol=1e-6)


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "opt_post_proj", "gpt2_unscaled"])
def test_generic_xp_path_stages_and_cache(name, tmp_path_factory, monkeypatch):
    """The generic xp code (what CuPy runs) equals the Numba path on a bfloat16 model; the
    stages compose to hidden_states bit for bit; the KV cache gives the full forward's logits."""
    from semzo.model import kernels, kernels_lm
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    ids, mask = padded_batch(np.random.default_rng(2), V, 3, 17)
    want = model.logits(ids, mask)
    assert np.array_equal(model.stage_hidden_states(ids, mask), model.hidden_states(ids, mask))
    if hasattr(model, "new_cache"):
        cache = model.new_cache(1, 17)
        one = model.forward_cached(ids[:1], cache)
        assert rel_err(one, want[:1], mask[:1].astype(bool)) < 1e-5
    monkeypatch.setattr(kernels_lm, "_is_cpu32", lambda *a: False)
    monkeypatch.setattr(kernels, "_is_cpu32", lambda *a: False)
    assert rel_err(model.logits(ids, mask), want, mask.astype(bool)) < 1e-5


def test_lora_export_and_reload(tmp_path_factory, tmp_path):
    """LoRA adapters are bfloat16 too; export writes BF16 safetensors (bits unchanged without
    LoRA, merged deltas rounded once) that transformers and load_model read back."""
    import transformers
    folder, _ = build("llama_tied_sharded", tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    export_hf(model, tmp_path / "plain")
    again = load_model(tmp_path / "plain", dtype="bfloat16")
    assert all(np.array_equal(again.params[n], a) for n, a in model.params.items())
    ck = Checkpoint(tmp_path / "plain")
    assert {ck.dtype(n) for n in ck} == {"BF16"}
    model.add_lora(rank=2, targets=("v_proj",))
    spec = next(iter(model.lora.values()))
    assert model.params[spec.a].dtype == np.uint16
    b = model.params[spec.b]
    b[...] = to_bits(np.random.default_rng(3).normal(0, 0.1, b.shape).astype(np.float32))
    out = export_hf(model, tmp_path / "lora")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.dtype == torch.bfloat16
    ours = load_model(out, dtype="bfloat16")
    ids, mask = padded_batch(np.random.default_rng(4), V, 2, 11)
    with torch.no_grad():
        want = hf.float()(input_ids=torch.from_numpy(ids),
                          attention_mask=torch.from_numpy(mask)).logits.numpy()
    valid = mask.astype(bool)
    assert rel_err(ours.logits(ids, mask), want, valid) < RTOL_BF16
    assert rel_err(model.logits(ids, mask), want, valid) < 2e-2     # merged W rounded once


def test_checkpoint_inspect_and_export_keep_bf16_bits(tmp_path, tmp_path_factory):
    """A ZO-perturbed bfloat16 model's tensors: checkpoint (``/packed/uint16``) -> load bit for
    bit; ``semzo inspect`` names the storage; ``semzo export`` rebuilds the model in bfloat16
    from the stored deck and writes the same bits as BF16."""
    from mpi4py import MPI

    from semzo import deck as deckmod
    from semzo.checkpoint import Checkpointer, load
    from semzo.checkpoint.tools import export, summary
    from semzo.deck import CheckpointSection
    from semzo.zo.perturb import perturb
    folder, _ = build("qwen2", tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    trained = [n for n in model.params if "layers.1." in n]
    perturb([(i, model.params[n]) for i, n in enumerate(trained)], 5, 0.05)
    deck = deckmod.load(None, [f'model.path="{folder}"', 'model.dtype="bfloat16"'],
                        check_inputs=False)
    comm = MPI.COMM_SELF
    with Checkpointer(comm, CheckpointSection(dir=str(tmp_path / "ck")),
                      deck_toml=deck.to_toml()) as ck:
        p = ck.save(3, {n: model.params[n] for n in trained}, {"step": 3})
    back = load(p, comm).params
    assert list(back) == trained
    for n in trained:
        assert back[n].dtype == np.uint16 and back[n].tobytes() == model.params[n].tobytes(), n
    text, ok = summary(p, comm, deck=False)
    assert ok and "model.dtype bfloat16: uint16 tensors (u2) are bfloat16 bits" in text
    out = export(p, tmp_path / "hf", comm)
    again = load_model(out, dtype="bfloat16")
    for n, a in model.params.items():
        assert again.params[n].tobytes() == a.tobytes(), n
    assert {Checkpoint(out).dtype(n) for n in Checkpoint(out)} == {"BF16"}


def test_dtype_rules_agree(tmp_path_factory):
    from semzo import deck as deckmod
    from semzo.checkpoint.tools import checkpoint_dtype
    from semzo.deck import DeckError
    from semzo.generate import load_for_generation
    d = deckmod.load(None, ["model.dtype=\"bfloat16\""], check_inputs=False)
    assert d.model.dtype == "bfloat16" and d.run.device == "cpu"
    with pytest.raises(DeckError, match=r"model.dtype: float16 .*\(bfloat16 runs on the CPU\)"):
        deckmod.load(None, ["model.dtype=\"float16\""], check_inputs=False)
    with pytest.raises(DeckError, match="model.dtype"):
        deckmod.load(None, ["model.dtype=\"int8\""], check_inputs=False)
    folder, _ = build("mistral", tmp_path_factory)
    with pytest.raises(SemzoError, match="float16 needs xp=cupy"):
        load_model(folder, dtype="float16")
    with pytest.raises(SemzoError, match="model dtype 'int8'"):
        load_model(folder, dtype="int8")
    from llmutil import tiny_llama

    from semzo.generate import generate_ids
    llama = tiny_llama(tmp_path_factory.mktemp("gen16") / "llama")
    g16, g32 = load_for_generation(str(llama), "bfloat16"), load_for_generation(str(llama))
    assert g16.model.storage == "bfloat16" and g32.model.storage == "float32"
    ids = g16.tk.encode("the cat was").ids
    out = generate_ids(g16.model, ids, 6, eos_ids=set())
    assert len(out) == 6 and all(0 <= i < g16.model.config.vocab_size for i in out)
    with pytest.raises(SemzoError, match="--dtype float16: generate stores float32 or bfloat16"):
        load_for_generation(str(llama), "float16")
    with pytest.raises(SemzoError, match="--dtype float32: ck.h5 holds bfloat16 weights"):
        checkpoint_dtype(d, "float32", "ck.h5")
    assert checkpoint_dtype(d, None, "ck.h5") == "bfloat16"


def test_generate_with_bfloat16_gemms(tmp_path_factory):
    """``generate --matmul bfloat16``: each generated token (one row: the GEMV form of the
    CPU's kernel where it has AVX512_BF16) gives the greedy tokens of the full forward over
    the whole sequence computed with the same arithmetic (prompt rows: the 48 x 8 form);
    the model keeps the mode on the way to a device; float32 weights are refused naming the
    option, exit 2, one line."""
    import subprocess

    from llmutil import tiny_llama

    from semzo.generate import generate_ids, load_for_generation, to_device
    llama = tiny_llama(tmp_path_factory.mktemp("genmm") / "llama")
    g = load_for_generation(str(llama), "bfloat16", "bfloat16")
    assert g.model.matmul == g.matmul == "bfloat16"
    assert load_for_generation(str(llama), "bfloat16").model.matmul == "float32"
    ids = g.tk.encode("the cat was on the mat and").ids
    out = generate_ids(g.model, ids, 12, eos_ids=set())
    seq = list(ids)
    for _ in range(12):                         # no cache: every row of the sequence again
        seq.append(int(np.argmax(g.model.logits(np.array([seq]))[0, -1])))
    assert out == seq[len(ids):]
    assert to_device(g.model, np).matmul == "bfloat16"
    proc = subprocess.run([sys.executable, "-m", "semzo", "generate", str(llama), "--prompt",
                           "the cat", "--matmul", "bfloat16"], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not proc.stdout, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--matmul bfloat16: model.matmul = 'bfloat16' needs a " \
        "decoder stored as bfloat16" in lines[0] and "(--dtype bfloat16)" in lines[0], lines


@pytest.mark.parametrize("name", ["llama_gqa_llama3_untied", "opt_post_proj", "gpt2_unscaled"])
@pytest.mark.parametrize("storage", ["bfloat16", "float32"])
def test_one_token_at_a_time_reads_the_weights_in_place(name, storage, tmp_path_factory,
                                                         monkeypatch):
    """Generating with float32 products: every one-row step multiplies by the stored weight
    in place (gemm_cpu.gemv_f32, q/k/v and gate/up in one gemv_f32_many launch each; for
    bfloat16 no float32 copy of a weight; for (out, in) weights: GPT-2's Conv1D keeps the
    float32 path, its LM head does not), and the logits of the tokens fed one at a time
    through the KV cache are the full forward's within 1e-5, and bit for bit those of one
    launch a weight. (Block by block: the compiled step of semzo.model.decode, which calls
    the same kernels, has its own tests in test_decode_step.py.)"""
    from semzo.model import base, causal, gemm_cpu
    folder, _ = build(name, tmp_path_factory)
    model = load_model(folder, dtype=storage)
    model.decode_compiled = False
    ids, mask = padded_batch(np.random.default_rng(4), V, 1, 11)
    ids = ids[:, :int(mask.sum())]
    want = model.logits(ids)
    calls = []
    real = gemm_cpu.gemv_f32

    def counted(x, w, out):
        calls.append(x.shape[0])
        return real(x, w, out)
    real_many = gemm_cpu.gemv_f32_many

    def counted_many(x, ws, outs):
        calls.extend([x.shape[0]] * len(ws))
        return real_many(x, ws, outs)
    monkeypatch.setattr(base, "gemv_f32", counted)
    monkeypatch.setattr(causal, "gemv_f32", counted)
    monkeypatch.setattr(base, "gemv_f32_many", counted_many)

    def one_at_a_time():
        cache = model.new_cache(1, ids.shape[1])
        return np.concatenate([model.forward_cached(ids[:, j:j + 1], cache)
                               for j in range(ids.shape[1])], axis=1)
    got = one_at_a_time()
    assert rel_err(got, want, np.ones(ids.shape, bool)) < 1e-5
    n_calls = len(calls)
    monkeypatch.setattr(base, "gemv_f32_many", lambda *a: pytest.fail("not one a weight"))
    monkeypatch.setattr(base.TransformerBase, "_proj_many", lambda self, x, mods, outs, xb:
                        [self._proj(x, mod, o, xb) for mod, o in zip(mods, outs)])
    assert np.array_equal(one_at_a_time(), got)
    assert len(calls) == 2 * n_calls                # the same weights, one launch each
    del calls[n_calls:]
    if model.layout == "out_in":
        assert calls and set(calls) == {1}
        assert len(calls) >= ids.shape[1] * model.config.num_layers * 3, len(calls)
    else:
        assert set(calls) == {1} and len(calls) == ids.shape[1]     # the LM head only
    calls.clear()
    model.logits(ids)                           # 11 rows: OpenBLAS as before
    assert not calls


@pytest.mark.parametrize("matmul", ["float32", "bfloat16"])
def test_projections_of_one_input_in_one_call_keep_lora_and_bits(matmul, tmp_path_factory,
                                                                  monkeypatch):
    """_proj_many (q, k, v and gate, up in one call: one GEMV launch of a few rows, or one
    packing of the activations for bfloat16 GEMMs) with LoRA adapters on some of them: the
    logits of a prompt and of tokens fed one at a time are bit for bit those of one _proj a
    module, and the adapters count (they change the logits)."""
    from semzo.model import base
    folder, _ = build("llama_gqa_llama3_untied", tmp_path_factory)
    model = load_model(folder, dtype="bfloat16")
    model.set_matmul(matmul)
    ids, mask = padded_batch(np.random.default_rng(6), V, 2, 11)

    def run():
        cache = model.new_cache(2, ids.shape[1] + 3)
        out = [model.forward_cached(ids, cache, mask)]
        for j in range(3):
            out.append(model.forward_cached(ids[:, j:j + 1], cache))
        return np.concatenate(out, axis=1)
    plain = run()
    model.add_lora(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "up_proj"))
    r = np.random.default_rng(1)
    for name in model.params:
        if name.endswith("lora_B.weight"):
            b = model.params[name]
            b[...] = to_bits(r.standard_normal(b.shape).astype(np.float32) * 0.2) \
                if b.dtype == np.uint16 else r.standard_normal(b.shape) * 0.2
    got = run()
    assert not np.array_equal(got, plain)
    monkeypatch.setattr(base.TransformerBase, "_proj_many", lambda self, x, mods, outs, xb:
                        [self._proj(x, mod, o, xb) for mod, o in zip(mods, outs)])
    assert np.array_equal(run(), got)


def test_resume_across_storages_is_refused(tmp_path_factory):
    """A bfloat16 tensor never meets a float array through a numeric cast."""
    from semzo.model.storage import same_storage_copy
    folder, _ = build("opt_pre", tmp_path_factory)
    m32, m16 = load_model(folder), load_model(folder, dtype="bfloat16")
    n = next(iter(m32.params))
    with pytest.raises(ValueError, match=f"{n}: stored as bfloat16, the model holds float32"):
        same_storage_copy(m32.params[n], m16.params[n], n)


def test_zo_modes_bf16_two_ranks(tmp_path_factory):
    """ZO steps on bfloat16 storage at 2 ranks: replicas bit-identical, equal to the serial
    reference bit for bit (data, perturbation, hybrid modes)."""
    sys.path.insert(0, str(Path(__file__).parent / "mpi"))
    from zo_common import make_model
    tiny = make_model(tmp_path_factory.mktemp("zo16") / "bert")
    env = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    proc = check(mpirun(2, [str(ROOT / "tests" / "mpi" / "zo_modes.py"), str(tiny), "bfloat16"],
                        timeout=240, env=env))
    assert "ok: zo modes on 2 ranks (bfloat16)" in proc.stdout
    for mode in ("data/copy", "perturbation/copy", "perturbation/fused", "hybrid/copy"):
        assert f"ok: {mode}" in proc.stdout, mode
