"""The pipeline with a decoder at 2 ranks: MiniLM shards the corpus (a decoder in [model]),
a tiny random Llama is fine-tuned on the prompt task (LoRA q,v in the top block, prefix cache),
zero-shot accuracy is logged and stored; then export (merged, loads in transformers) and
`semzo generate` from the checkpoint, with its model folder missing or changed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from llmutil import tiny_llama
from mpiutil import check, mpirun

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _corpus(path: Path, n: int) -> Path:
    rng = np.random.default_rng(0)
    nouns = ["cat", "dog", "sun", "moon", "tree", "red", "blue", "green"]
    with open(path, "w") as f:
        for i in range(n):
            lab = int(rng.integers(3))
            ws = [str(w) for w in rng.choice(nouns, 4)]
            ws.append(["good", "bad", "awful"][lab])
            f.write(json.dumps({"id": i, "text": " ".join(ws),
                                "label": ["pos", "neg", "zzz"][lab]}) + "\n")
    return path


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llmpipe")
    model = tiny_llama(tmp / "llama")
    corpus = _corpus(tmp / "c.jsonl", 160)
    out = tmp / "out"
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/llm.toml",
                            "--set", f"run.output_dir={out}", "--set", f"corpus.path={corpus}",
                            "--set", f"model.path={model}", "--set", "cluster.k=3",
                            "--set", 'corpus.labels=["neg", "pos"]',
                            "--set", 'prompt.template="{text} It was"',
                            "--set", 'prompt.label_words=[" bad", " good"]',
                            "--set", "train.lora_layers=1", "--set", "train.steps=20",
                            "--set", "train.eval_every=10", "--set", "zo.lr=1e-2",
                            "--set", "train.batch_size=8", "--set", "model.max_length=24",
                            "--set", "topology.nodes_per_switch=1",
                            "--set", "checkpoint.every_steps=10"], timeout=400, env=ENV))
    return tmp, model, out, proc


def test_prompt_pipeline(run):
    _, _, out, proc = run
    err = proc.stderr
    assert "embedded" in err and "all-MiniLM-L6-v2" in err             # MiniLM shards
    assert "held-out before fine-tuning (ZERO-SHOT" in err
    assert "label words ' bad', ' good' for labels neg, pos" in err
    assert "blocks 0..0 frozen: their output is computed once per prompt" in err
    assert "HELD-OUT ACCURACY before" in err
    with h5py.File(out / "embeddings.h5") as f:
        assert f["embeddings"].shape[1] == 384                          # MiniLM's width
        assert sorted(x.decode() if isinstance(x, bytes) else x
                      for x in f.attrs["label_names"]) == ["neg", "pos"]
        n = f["embeddings"].shape[0]
    assert 80 < n < 130                                                 # only neg and pos
    with h5py.File(out / "model.h5") as f:
        assert 0 <= f.attrs["heldout_acc_before"] <= 1
        assert f.attrs["task"] == "prompt"
        names = json.loads(f.attrs["trainable"])
    assert sorted(names) == sorted(f"model.layers.1.self_attn.{p}_proj.lora_{ab}.weight"
                                   for p in "qv" for ab in "AB")
    rows = (out / "metrics.csv").read_text().splitlines()
    assert any(r.startswith("eval,0,") or ",0," in r for r in rows[1:3])


def test_model_h5_works_with_generate_export_and_inspect(run):
    """model.h5, the run's final model, is read by the three tools as a checkpoint is (it was
    refused as "not a semzo checkpoint (format None)" after a false format-1 warning); its
    model equals the step-20 checkpoint's (the last step is saved to both)."""
    from semzo.generate import load_for_generation

    tmp, _, out, _ = run
    insp = subprocess.run([sys.executable, "-m", "semzo", "inspect", str(out / "model.h5")],
                          capture_output=True, text=True, timeout=200, check=False)
    assert insp.returncode == 0, insp.stderr
    assert "model file" in insp.stdout and "20 steps" in insp.stdout and "task prompt" in insp.stdout
    assert "format 1" not in insp.stderr and "warning" not in insp.stderr.lower(), insp.stderr
    hf = tmp / "hf-model-h5"
    exp = subprocess.run([sys.executable, "-m", "semzo", "export", str(out / "model.h5"),
                          str(hf)], capture_output=True, text=True, timeout=200, check=False)
    assert exp.returncode == 0, exp.stderr
    assert (hf / "config.json").is_file() and "(step 20, weights float32;" in exp.stdout
    info = json.loads((hf / "semzo_export.json").read_text())
    assert info["step"] == 20 and info["task"] == "prompt"
    assert info["prompt"] == {"template": "{text} It was", "label_names": ["neg", "pos"],
                              "label_words": [" bad", " good"]}
    # an existing folder is not overwritten silently; --force and another dtype
    again = subprocess.run([sys.executable, "-m", "semzo", "export", str(out / "model.h5"),
                            str(hf), "--dtype", "bfloat16"], capture_output=True, text=True,
                           timeout=200, check=False)
    assert again.returncode == 2 and "pass --force" in again.stderr, again.stderr
    forced = subprocess.run([sys.executable, "-m", "semzo", "export", str(out / "model.h5"),
                             str(hf), "--dtype", "bfloat16", "--force"], capture_output=True,
                            text=True, timeout=200, check=False)
    assert forced.returncode == 0 and "weights bfloat16" in forced.stdout, forced.stderr
    assert json.loads((hf / "config.json").read_text())["torch_dtype"] == "bfloat16"
    gen = subprocess.run([sys.executable, "-m", "semzo", "generate", str(out / "model.h5"),
                          "--prompt", "the moon", "--max-new-tokens", "3"],
                         capture_output=True, text=True, timeout=200, check=False)
    assert gen.returncode == 0, gen.stderr
    final = load_for_generation(str(out / "model.h5"))
    ck = load_for_generation(str(out / "checkpoints" / "ckpt-000000020.h5"))
    ids = np.array([[5, 9, 30, 7, 2, 11]])
    assert np.array_equal(final.model.logits(ids), ck.model.logits(ids))

def test_export_and_generate_from_checkpoint(run):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from semzo.generate import generate_ids, load_for_generation

    tmp, model, out, _ = run
    hf = tmp / "hf"
    check(subprocess.run([sys.executable, "-m", "semzo", "export", str(out / "checkpoints"),
                          str(hf)], capture_output=True, text=True, timeout=200,
                         check=False))
    g = load_for_generation(str(out / "checkpoints"))     # the best held-out model (issue 32)
    assert g.model.lora and "best.h5" in g.what, g.what
    ids = np.array([[5, 9, 30, 7, 2, 11]])
    ours = g.model.logits(ids)
    ref = AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = ref(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    greedy = generate_ids(g.model, [5, 9, 30], 6)
    with torch.no_grad():
        want = ref.generate(torch.tensor([[5, 9, 30]]), max_new_tokens=6, do_sample=False,
                            eos_token_id=None, pad_token_id=0)[0, 3:].tolist()
    assert greedy == want
    # the CLI, and a changed / missing model folder
    cmd = [sys.executable, "-m", "semzo", "generate", str(out / "checkpoints"),
           "--prompt", "the moon", "--max-new-tokens", "4"]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                         check=False)
    assert ok.returncode == 0, ok.stderr
    moved = tmp / "llama-moved"
    shutil.copytree(model, moved)
    cfg = json.loads((model / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (model / "config.json").write_text(json.dumps(cfg))
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                         check=False)
    last = bad.stderr.strip().splitlines()[-1]       # one line (after a reader warning)
    assert bad.returncode == 2 and "differs from the one the checkpoint was trained" in last \
        and "llama" in last, bad.stderr
    shutil.rmtree(model)
    gone = subprocess.run(cmd, capture_output=True, text=True, timeout=200,
                         check=False)
    assert gone.returncode == 2 and "is missing" in gone.stderr, gone.stderr
    shutil.copytree(moved, model)


def test_bfloat16_gemms_say_how_each_rank_computes_them(run, tmp_path):
    """The finetune stage alone with model.dtype = model.matmul = "bfloat16" at 2 ranks, one
    of them with SEMZO_CPU_BF16_DOT=0 (an MPMD launch): on a CPU with AVX512_BF16 the ranks
    compute the GEMMs differently, and rank 0 warns that the run's numbers depend on the
    nodes (one allreduce, reached by both); elsewhere both emulate and rank 0 says so. The
    run still trains and writes model.h5."""
    from semzo.model import gemm_cpu
    _, model, out, _ = run
    for name in ("topology.h5", "embeddings.h5", "clusters.h5", "shards.h5"):
        shutil.copy(out / name, tmp_path / name)
    deck = ["-m", "semzo", "run", "inputs/llm.toml", "--set", f"run.output_dir={tmp_path}",
            "--set", f"model.path={model}", "--set", 'run.stages=["finetune"]',
            "--set", 'corpus.labels=["neg", "pos"]', "--set", "cluster.k=3",
            "--set", 'prompt.template="{text} It was"',
            "--set", 'prompt.label_words=[" bad", " good"]', "--set", "train.lora_layers=1",
            "--set", "train.steps=10", "--set", "train.eval_every=10", "--set", "zo.lr=1e-2",
            "--set", "train.batch_size=8", "--set", "model.max_length=24",
            "--set", "topology.nodes_per_switch=1", "--set", "model.dtype=bfloat16",
            "--set", "model.matmul=bfloat16"]
    proc = check(mpirun(1, [*deck, ":", "-n", "1", "env", "SEMZO_CPU_BF16_DOT=0",
                            sys.executable, *deck], timeout=300, env=ENV))
    err = proc.stderr
    if gemm_cpu.enabled():
        assert ("the ranks compute it differently (1 of 2 ranks: "
                f"{gemm_cpu.KINDS[gemm_cpu.kind()]}; 1 of 2 ranks: emulated in float32") in err, \
            err[-3000:]
    else:
        assert "emulated in float32 (this CPU has no AVX512_BF16" in err, err[-3000:]
    assert "HELD-OUT ACCURACY before" in err
    with h5py.File(tmp_path / "model.h5") as f:
        assert f.attrs["task"] == "prompt"
    # generation from it computes as the run did (its deck's model.matmul), unless told
    from semzo.generate import generate_ids, load_for_generation
    g = load_for_generation(str(tmp_path / "model.h5"))
    assert g.model.storage == "bfloat16" and g.model.matmul == "bfloat16"
    assert len(generate_ids(g.model, g.tk.encode("great movie").ids, 3, eos_ids=set())) == 3
    assert load_for_generation(str(tmp_path / "model.h5"), None,
                               "float32").model.matmul == "float32"
