"""The lm task on a corpus without labels, through the whole pipeline at 2 ranks (it crashed
in the embed stage: an empty label vocabulary has no HDF5 type): the run trains, its held-out
next-token loss falls well beyond seed noise, and metrics.csv carries the time, the
throughput and the perplexity."""

from __future__ import annotations

import csv
import json
import math
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpiutil import check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import WORDS, make_model

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def _corpus(path: Path, n: int) -> Path:
    """Unlabelled texts: a run of one word list in its cyclic order from a random start (the
    next word is predictable from the last one)."""
    r = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(n):
            w = WORDS[i % 3].split()
            s = int(r.integers(0, 5))
            f.write(json.dumps({"text": " ".join(w[(s + j) % 10]
                                                 for j in range(int(r.integers(6, 12))))}) + "\n")
    return path


@pytest.mark.parametrize("seed", [0, 1])
def test_lm_on_unlabelled_text_learns(tmp_path, seed):
    llama = make_model(tmp_path / "llama", kind="llama")
    corpus = _corpus(tmp_path / "c.jsonl", 300)
    out = tmp_path / "out"
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.output_dir={out}", "--set", f"corpus.path={corpus}",
                            "--set", f"model.path={llama}", "--set", "train.task=lm",
                            "--set", "cluster.k=3", "--set", "train.params=all",
                            "--set", "train.steps=150", "--set", "train.eval_every=0",
                            "--set", "zo.lr=3e-3", "--set", f"run.seed={seed}",
                            "--set", "model.max_length=24", "--set", "train.max_length=24",
                            "--set", "topology.ranks_per_node=1",
                            "--set", "topology.nodes_per_switch=1"], timeout=300, env=ENV))
    with h5py.File(out / "embeddings.h5") as f:
        assert len(f.attrs["label_names"]) == 0 and (f["labels"][()] == -1).all()
    with h5py.File(out / "model.h5") as f:
        before, after = f.attrs["heldout_loss_before"], f.attrs["heldout_loss_after"]
    # measured: 4.72 -> 3.64, 4.84 -> 3.58, 4.73 -> 3.30 (seeds 0, 1, 2): 23 to 30 % lower
    assert after < 0.9 * before, (before, after)
    assert "tokens)" in proc.stderr and "next: `semzo export" in proc.stderr
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert len(train) == 150 and all(float(r["tokens_per_s"]) > 0 for r in train)
    el = [float(r["elapsed_s"]) for r in train]
    assert el == sorted(el) and el[0] > 0
    assert [int(r["step"]) for r in evals] == [0, 150]
    for r in evals:
        assert math.isclose(float(r["heldout_ppl"]), math.exp(float(r["heldout_loss"])))
