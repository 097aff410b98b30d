"""A deck that a later stage of the same run would refuse because of the samples (cluster.k,
the finetune stage's labels, held-out split or task) fails at the start of the embed stage,
with that stage's own one-line message and exit 2, before the corpus is embedded: nothing is
written. The same checks still run in the later stages (a stage rerun alone)."""

from __future__ import annotations

import json
import time

import pytest
from mpiutil import mpirun


def _corpus(path, n: int, labels: bool) -> None:
    with open(path, "w") as f:
        for i in range(n):
            rec = {"id": i, "text": f"record number {i} says something about topic {i % 3}"}
            if labels:
                rec["label"] = f"class{i % 2}"
            f.write(json.dumps(rec) + "\n")


CASES = [
    ("k", True, ["run.stages=[\"topology\", \"embed\", \"cluster\"]", "cluster.k=50"],
     "cluster.k: 50 clusters for only 12 samples"),
    ("k after max_records", True,
     ["run.stages=[\"embed\", \"cluster\"]", "cluster.k=6", "corpus.max_records=5"],
     "cluster.k: 6 clusters for only 5 samples"),
    ("unlabelled corpus, classify", False, ["cluster.k=2"],
     ("train.task = classify needs a label on every record and at least 2 classes "
     "(12 unlabeled, 0 classes)")),
    ("one class", True, ["cluster.k=2", "corpus.labels=[\"class1\"]"],
     ("train.task = classify needs a label on every record and at least 2 classes "
     "(0 unlabeled, 1 classes)")),
    ("lm on an encoder", True, ["cluster.k=2", "train.task=\"lm\""],
     "train.task: lm fine-tuning needs a decoder in model.path, got an encoder"),
    ("no held-out samples", True, ["cluster.k=2", "train.heldout_fraction=1e-6"],
     "train.heldout_fraction: no held-out samples (1e-06 of 12 samples drew none)"),
    ("no validation samples", True, ["cluster.k=2", "train.val_fraction=1e-6"],
     "train.val_fraction: no validation samples (1e-06 of "),
    ("label word of two tokens", True, ["cluster.k=2", "model.path=smollm2",
                                        "train.task=\"prompt\""],
     "prompt.label_words: ' class0' (label 'class0') (default: the label names) is 2 tokens"),
]


@pytest.mark.parametrize("name,labels,sets,message", CASES + [
    ("empty corpus", False, ["cluster.k=2"], "c.jsonl: the corpus has no records")],
    ids=[c[0] for c in CASES] + ["empty corpus"])
def test_later_stage_refusal_comes_before_the_embedding(tmp_path, name, labels, sets, message):
    corpus = tmp_path / "c.jsonl"
    _corpus(corpus, 0 if name == "empty corpus" else 12, labels)
    out = tmp_path / "out"
    args = ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={out}",
            "--set", f"corpus.path={corpus}", "--set", "topology.ranks_per_node=0",
            "--set", "topology.nodes_per_switch=0"]
    for s in sets:
        args += ["--set", s]
    t0 = time.perf_counter()
    proc = mpirun(2, args, timeout=120)
    seconds = time.perf_counter() - t0
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert "embedded" not in proc.stderr             # the embed stage's log line after the work
    assert not (out / "embeddings.h5").exists()
    written = sorted(p.name for p in out.rglob("*.h5")) if out.exists() else []
    assert written in ([], ["topology.h5"]), written   # the topology stage ran before embed
    assert seconds < 100


def test_a_valid_deck_passes_the_preflight(tmp_path):
    """The same corpus with a deck the later stages accept goes through embed and cluster."""
    corpus = tmp_path / "c.jsonl"
    _corpus(corpus, 12, True)
    out = tmp_path / "out"
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={out}",
                      "--set", f"corpus.path={corpus}", "--set", "topology.ranks_per_node=0",
                      "--set", "topology.nodes_per_switch=0",
                      "--set", "run.stages=[\"embed\", \"cluster\"]", "--set", "cluster.k=12"],
                  timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "embeddings.h5").is_file() and (out / "clusters.h5").is_file()


def test_ranks_without_a_training_sample_are_named(caplog, monkeypatch):
    """More ranks than training samples: the idle ranks are said once (a warning), before
    the work and where they idle, instead of running silently."""
    import logging

    # semzo's logger does not propagate to the root logger, where caplog listens (the test
    # passed in the whole suite, where that state depends on the tests run before it)
    from semzo.runtime import get_logger
    get_logger("semzo.preflight")
    monkeypatch.setattr(logging.getLogger("semzo"), "propagate", True)

    import numpy as np

    from semzo import deck as deckmod
    from semzo.preflight import check_samples

    d = deckmod.load(None, ["train.heldout_fraction=0.5"], check_inputs=False)

    def three_empty_ranks(counts):                  # this rank plus 3 with no sample
        counts += np.array([0, 0, 0, 1, 1, 0]) * 3

    ids = np.arange(40)
    with caplog.at_level(logging.WARNING):
        check_samples(d, "lm", ids, np.full(40, -1), 0, three_empty_ranks)
    assert "3 of 4 ranks hold no training sample" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        check_samples(d, "lm", ids[:2], np.full(2, -1), 0, three_empty_ranks, placed=False)
    assert "of 4 ranks will hold no training sample" in caplog.text


def test_splits_emptied_by_left_out_records_are_refused():
    """sft/choice with train.overlong = "skip" leave records out after check_samples counted
    the splits: a split they empty stops every rank (a validation split with no sample would
    make every validation figure nan and the best model never chosen)."""
    import numpy as np

    from semzo import deck as deckmod
    from semzo.preflight import check_kept, split_masks
    from semzo.runtime import AllRanksError

    d = deckmod.load(None, ["train.heldout_fraction=0.3", "train.val_fraction=0.2",
                            'train.overlong="skip"'], check_inputs=False)
    ids = np.arange(200)
    held, val = split_masks(d, ids)
    train = np.flatnonzero(~held & ~val)
    ev = np.flatnonzero(held | val)
    same = lambda c: c                                    # one rank
    assert check_kept(d, train, ev, held, val, same) == (
        train.size, int(held.sum()), int(val.sum()))
    with pytest.raises(AllRanksError, match=r'train.overlong = "skip": no validation samples '
                                            r'left'):
        check_kept(d, train, np.flatnonzero(held), held, val, same)
    with pytest.raises(AllRanksError, match="no training and no held-out samples left"):
        check_kept(d, train[:0], np.flatnonzero(val), held, val, same)

    def other_rank_keeps_some(counts):              # another rank still has each split
        counts += np.array([5, 5, 5])
    assert check_kept(d, train[:0], ev[:0], held, val, other_rank_keeps_some) == (5, 5, 5)
