"""The instruction tasks through the whole pipeline at 2 ranks (issue 31): the same chat and
prompt/completion records as JSONL and as Parquet give the same embeddings and the same shards,
the sft task fine-tunes a tiny Llama from them (loss on completion tokens, generations), the
choice task runs on multiple-choice records, and a malformed record or an overlong completion
stops the run (exit 2, one line naming the file and line) before anything is embedded."""

from __future__ import annotations

import csv
import json
import re

import h5py
import numpy as np
import pytest
from llmutil import tiny_llama
from mpiutil import check, mpirun

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
NOUNS = ["cat", "dog", "sun", "moon", "tree", "red", "blue", "green"]
TPL = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _sft_records(n: int) -> list[dict]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        lab = int(rng.integers(2))
        ws = [str(w) for w in rng.choice(NOUNS, 4)] + [["good", "bad"][lab]]
        if i % 2:
            out.append({"prompt": " ".join(ws) + " It was", "completion": [" good", " bad"][lab]})
        else:
            out.append({"messages": [{"role": "user", "content": " ".join(ws)},
                                     {"role": "assistant", "content": ["good", "bad"][lab]}]})
    return out


def _args(out, corpus, model, *extra):
    return ["-m", "semzo", "run", "inputs/sft.toml", "--set", f"run.output_dir={out}",
            "--set", f"corpus.path={corpus}", "--set", f"model.path={model}",
            "--set", "cluster.k=3", "--set", "topology.nodes_per_switch=1",
            "--set", "model.max_length=32", "--set", "train.max_length=32",
            "--set", "train.lora_layers=1", "--set", "train.steps=20",
            "--set", "train.eval_every=10", "--set", "train.gen_samples=6",
            "--set", "train.gen_tokens=4", "--set", "checkpoint.every_steps=0", *extra]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    tmp = tmp_path_factory.mktemp("sftpipe")
    model = tiny_llama(tmp / "llama", chat_template=TPL)
    recs = _sft_records(96)
    jl = tmp / "c.jsonl"
    jl.write_text("".join(json.dumps(r) + "\n" for r in recs))
    pqf = tmp / "c.parquet"
    rows = [{"prompt": r.get("prompt"), "completion": r.get("completion"),
             "messages": r.get("messages")} for r in recs]
    pq.write_table(pa.Table.from_pylist(rows), str(pqf), row_group_size=10)
    return tmp, model, jl, pqf


def test_sft_jsonl_and_parquet_same_shards_and_training(setup):
    tmp, model, jl, pqf = setup
    a = check(mpirun(2, _args(tmp / "a", jl, model), timeout=300, env=ENV))
    check(mpirun(2, _args(tmp / "b", pqf, model, "--set",
                          'run.stages=["topology", "embed", "cluster", "place"]'),
                 timeout=300, env=ENV))
    for name, keys in (("embeddings.h5", ("embeddings", "ids", "text_bytes")),
                       ("shards.h5", ("embeddings", "ids", "text_bytes", "rank_offsets"))):
        with h5py.File(tmp / "a" / name) as fa, h5py.File(tmp / "b" / name) as fb:
            for k in keys:
                assert np.array_equal(fa[k][()], fb[k][()]), (name, k)
    err = a.stderr
    assert "sft task: loss on completion tokens only" in err
    assert "blocks 0..0 frozen" in err
    assert "HELD-OUT COMPLETION-TOKEN ACCURACY before" in err and "completion tokens)" in err
    assert "HELD-OUT GENERATIONS exact match" in err and "generation 3 after" in err
    with h5py.File(tmp / "a" / "model.h5") as f:
        assert f.attrs["task"] == "sft"


def test_sft_with_a_validation_split(setup):
    """train.val_fraction with the sft task at 2 ranks: every evaluation row has the
    validation split's completion tokens beside the held-out ones, the generations are of
    held-out records only and as many as train.gen_samples, and the summary reports the best
    model on the validation split with its held-out figure."""
    tmp, model, jl, _ = setup
    out = tmp / "val"
    p = check(mpirun(2, _args(out, jl, model, "--set", "train.val_fraction=0.25"),
                     timeout=300, env=ENV))
    got = re.search(r"(\d+) training / (\d+) held-out / (\d+) validation samples", p.stderr)
    assert got and int(got.group(3)) > 0, p.stderr[-3000:]
    with open(out / "metrics.csv", newline="") as f:
        ev = [r for r in csv.DictReader(f) if r["kind"] == "eval"]
    assert [int(r["step"]) for r in ev] == [0, 10, 20]
    assert all(int(r["val_n"]) > 0 and int(r["heldout_n"]) > 0 for r in ev)
    assert "(6 greedy generations)" in p.stderr
    assert "the best model on the validation split (step" in p.stderr


def test_choice_pipeline(setup):
    tmp, model, _, _ = setup
    rng = np.random.default_rng(1)
    path = tmp / "ch.jsonl"
    with open(path, "w") as f:
        for i in range(80):
            lab = int(rng.integers(2))
            ws = [str(w) for w in rng.choice(NOUNS, 4)] + [["good", "bad"][lab]]
            ch = [" good", " bad"] + ([" awful tree"] if i % 2 else [])
            f.write(json.dumps({"prompt": " ".join(ws) + " It was", "choices": ch,
                                "answer": lab}) + "\n")
    p = check(mpirun(2, _args(tmp / "c", path, model, "--set", "train.task=choice"),
                     timeout=300, env=ENV))
    assert "choice task: summed log-likelihood" in p.stderr
    assert "blocks 0..0 frozen: their output is computed once per (record, choice) row" \
        in p.stderr                                   # LoRA in the top block of 2: cached
    assert "(ZERO-SHOT, the prompt alone)" in p.stderr and "HELD-OUT ACCURACY before" in p.stderr


@pytest.mark.parametrize("task,rec,want", [
    ("choice", {"prompt": "a", "choices": ["x", "y"], "answer": 2},
     "bad.jsonl:3: 'answer' 2 is out of range for 2 choices (0..1)"),
    ("sft", {"prompt": "a", "completion": " " + "cat dog " * 30},
     "bad.jsonl:3: the record's completion alone does not fit train.max_length = 32"),
])
def test_bad_records_stop_before_embedding(setup, task, rec, want):
    tmp, model, _, _ = setup
    good = ({"prompt": "a b", "choices": ["x", "y"], "answer": 0} if task == "choice"
            else {"prompt": "a b", "completion": " c"})
    path = tmp / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in (good, good, rec, *[good] * 30)))
    p = mpirun(2, _args(tmp / "bad", path, model, "--set", f"train.task={task}"),
               timeout=120, env=ENV)
    assert p.returncode == 2, p.stderr[-2000:]
    assert want in p.stderr and "embedded" not in p.stderr
    assert p.stderr.count(want) == 1
