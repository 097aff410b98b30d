"""GPU: the instruction tasks of issue 31 on a device against the same tasks on NumPy: ``sft``
(the completion-token loss and accuracy, the greedy generations of the held-out records with
their KV cache, exact match and F1) and ``choice`` (each choice's summed and mean
log-likelihood, the loss and accuracy over a record's choices). These paths had never run on
a device (the kit's pipeline phase runs the encoder deck, and ``demo_llm_gpu`` the prompt
task). A tiny Llama in float32 and in bfloat16 storage; its LM head scaled so that greedy choices are far from ties
(the device's and the CPU's GEMMs round differently); the training loss also through the
frozen-prefix cache kept on the device. Without a GPU the same comparison runs with the
models on the ``generic_xp`` stand-in (tests/conftest.py: the branches a GPU takes, on
NumPy) against the CPU's branches (``*_on_cpu``)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import cupy_or_none, gpu_skip, host
from llmutil import tiny_llama
from zo_common import SoloTopo

from semzo.model import load_model
from semzo.model.chat import InstructTokenizer
from semzo.model.storage import BF16, to_float32, to_storage
from semzo.tasks.choice import ChoiceTask
from semzo.tasks.sft import SFTTask

TPL = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SFT_RECS = [
    {"prompt": "the cat is", "completion": " good"},
    {"prompt": "red blue green tree sun", "completion": " bad awful"},
    {"messages": [{"role": "user", "content": "cat dog"},
                  {"role": "assistant", "content": "good"},
                  {"role": "user", "content": "sun"},
                  {"role": "assistant", "content": "moon tree"}]},
    {"prompt": "moon moon", "completion": " green"},
]
CHOICE_RECS = [
    {"prompt": "the cat is", "choices": [" good", " bad awful", " red"], "answer": 0},
    {"prompt": "sun moon", "choices": [" tree", " green blue sun"], "answer": 1},
    {"prompt": "dog", "choices": [" cat", " moon", " sun", " red tree"], "answer": 3},
]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("gpu_llm") / "llama", chat_template=TPL)


def _model(folder, xp, dtype: str):
    m = load_model(folder, xp=xp, dtype=dtype)
    m.untie_head()
    name = m.head_weight_name()
    w = m.params[name]
    if dtype == "bfloat16":                     # bits: scale the float32 values, store again
        m.params[name] = xp.asarray(to_storage(to_float32(host(w)) * 40.0, BF16))
    else:
        w *= 40.0                               # logits far apart: greedy choices not ties
    return m


def _tasks(folder, xp, layer: int = 0, dtype: str = "float32"):
    """(sft task, [choice task summed, mean]) on ``xp``; ``layer``: the frozen-prefix cache of
    blocks below it (the residual stream entering block ``layer`` kept per row)."""
    it = InstructTokenizer.from_folder(folder)
    enc = [it.sft(r, 40) for r in SFT_RECS]
    rows = np.arange(len(SFT_RECS))
    sft = SFTTask(_model(folder, xp, dtype), [e[0] for e in enc], [e[1] for e in enc], rows, rows,
                  it.pad_id, 2, tk=it.tk, eos={it.eos_id}, gen_rows=rows, gen_tokens=5,
                  topo=SoloTopo(), layer=layer)
    cc = [it.choice(r, 40) for r in CHOICE_RECS]
    rows = np.arange(len(CHOICE_RECS))
    choice = [ChoiceTask(_model(folder, xp, dtype), [c[0] for c in cc], [c[1] for c in cc],
                         [r["answer"] for r in CHOICE_RECS], rows, rows, it.pad_id, 2,
                         mean=mean, layer=layer) for mean in (False, True)]
    return sft, choice


def _same_tasks(folder, xp, dtype: str = "float32") -> None:
    """The tasks on ``xp`` give the NumPy tasks' figures, both in ``dtype`` storage (the
    arithmetic float32: within 1e-4 relative)."""
    ref_sft, ref_choice = _tasks(folder, np, dtype=dtype)
    dev_sft, dev_choice = _tasks(folder, xp, dtype=dtype)
    assert dev_sft.model.xp is xp
    sums = [t.eval_sums() for t in (ref_sft, dev_sft)]
    np.testing.assert_allclose(sums[1], sums[0], rtol=1e-4)
    assert sums[0][2] > 0                               # completion tokens were scored
    assert dev_sft.last_gen is not None and dev_sft.last_gen[2] == len(SFT_RECS)
    assert [e[2] for e in dev_sft.examples] == [e[2] for e in ref_sft.examples]
    assert any(e[2] for e in ref_sft.examples)          # something was generated
    for ref, dev in zip(ref_choice, dev_choice):
        b = ref.batch(np.arange(len(CHOICE_RECS)))
        want = ref.choice_scores(ref._full(b).hidden, b)
        got = dev.choice_scores(dev._full(b).hidden, b)
        assert isinstance(got, np.ndarray) and got.shape == want.shape == (9,)
        np.testing.assert_allclose(got, want, rtol=1e-4)
        rl, ra = ref.eval_batch(np.arange(len(CHOICE_RECS)))
        dl, da = dev.eval_batch(np.arange(len(CHOICE_RECS)))
        assert dl == pytest.approx(rl, rel=1e-4) and da == ra
    # the training loss through the frozen-prefix cache of block 0, kept on the device
    cached_sft, cached_choice = _tasks(folder, xp, layer=1, dtype=dtype)
    for ref, dev in ((ref_sft, cached_sft), *zip(ref_choice, cached_choice)):
        b = ref.batch(np.arange(3))
        assert dev.stage_count() == ref.stage_count() - 2
        assert dev.loss(b) == pytest.approx(ref.loss(b), rel=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llm_tasks_harness_on_cpu(llama, generic_xp, dtype):
    """The tasks through the generic xp branches (what a GPU runs, on NumPy) against the
    CPU's branches."""
    _same_tasks(llama, generic_xp, dtype)


@gpu_skip()
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_llm_tasks_match_cpu(llama, dtype):
    _same_tasks(llama, cupy_or_none(), dtype)


def _same_generation(folder, xp) -> None:
    """``semzo generate``'s path with ``--device gpu``: the decoder built on the host, moved by
    generate.to_device to ``xp``, generates the host's tokens (greedy, KV cache, bfloat16 too),
    with a LoRA adapter carried; several prompts of different lengths in one padded KV cache
    (``generate_many``, the path of repeated ``--prompt``) give each host row's tokens."""
    from semzo.generate import generate_ids, generate_many, to_device
    for dtype in ("float32", "bfloat16"):
        host_model = _model(folder, np, dtype)
        host_model.add_lora(rank=2, alpha=4.0, targets=("model.layers.0.self_attn.q_proj",))
        b = host_model.params["model.layers.0.self_attn.q_proj.lora_B.weight"]
        b[...] = np.random.default_rng(0).standard_normal(b.shape).astype(b.dtype) * 0.1
        dev = to_device(host_model, xp)
        assert dev.xp is xp and type(dev) is type(host_model) and dev.lora == host_model.lora
        for prompt in ([5, 7, 9], [11, 3, 2, 8, 30]):
            want = generate_ids(host_model, prompt, 6)
            assert generate_ids(dev, prompt, 6) == want and len(want) == 6, (dtype, prompt)
        prompts = [[5, 7, 9], [11, 3, 2, 8, 30], [4]]
        want = generate_many(host_model, prompts, 5, batch=1)
        assert generate_many(dev, prompts, 5, batch=3) == want, dtype
        assert generate_many(dev, prompts, 5, temperature=0.8, seed=3, batch=2) == \
            generate_many(host_model, prompts, 5, temperature=0.8, seed=3, batch=1), dtype


def test_generate_on_a_device_harness_on_cpu(llama, generic_xp):
    _same_generation(llama, generic_xp)


@gpu_skip()
def test_gpu_generate_equals_cpu(llama):
    _same_generation(llama, cupy_or_none())


def test_generate_device_gpu_without_a_gpu_is_one_line_on_cpu(llama):
    """``semzo generate --device gpu`` where CuPy or a device is missing: one line, exit 2."""
    import subprocess

    from gpu_common import GPU_REASON
    if GPU_REASON is None:
        pytest.skip("a GPU is here: it would generate")
    proc = subprocess.run([sys.executable, "-m", "semzo", "generate", str(llama), "--prompt",
                           "the cat", "--device", "gpu"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error") and "generate --device gpu but " in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
