"""The pipeline with the finetune stage, end to end at 2 ranks on a small labelled corpus and a
tiny random encoder (classification through the transformer), then the finetune stage alone
with a tiny GPT-2 (next-token loss) and with a head-only subset (cached features)."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpiutil import check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import make_model, write_corpus

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
COMMON = ["--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1",
          "--set", "model.max_length=24", "--set", "train.max_length=24",
          "--set", "train.batch_size=8", "--set", "train.log_every=5",
          "--set", "train.schedule=constant", "--set", "train.warmup_steps=0"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ft")
    bert = make_model(tmp / "bert")
    corpus = write_corpus(tmp / "corpus.jsonl", 240)
    out = tmp / "out"
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.output_dir={out}", "--set", f"corpus.path={corpus}",
                            "--set", f"model.path={bert}", "--set", "cluster.k=3",
                            "--set", "train.params=head+last", "--set", "train.last_layers=1",
                            "--set", "train.steps=12", "--set", "train.eval_every=6",
                            "--set", "zo.mode=hybrid", "--set", "zo.lr=1e-3",
                            "--set", "zo.checksum_every=5", *COMMON],
                        timeout=240, env=ENV))
    shutil.copy(out / "metrics.csv", tmp / "metrics_first.csv")   # later tests reuse `out`
    return tmp, out, proc


def _finetune_only(run, name: str, model, *sets: str, timeout: int = 180):
    """The finetune stage alone at 2 ranks in a new folder ``name`` (the first run's shards),
    on ``model`` with the deck settings ``sets``. Returns (folder, completed process)."""
    tmp, shared, _ = run
    out = tmp / name
    out.mkdir()
    shutil.copy(shared / "shards.h5", out / "shards.h5")
    args = ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={out}",
            "--set", 'run.stages=["finetune"]', "--set", f"corpus.path={tmp / 'corpus.jsonl'}",
            "--set", f"model.path={model}"]
    for kv in sets:
        args += ["--set", kv]
    return out, check(mpirun(2, [*args, *COMMON], timeout=timeout, env=ENV))


def _metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_pipeline_with_finetune(run):
    tmp, out, proc = run
    for name in ("shards.h5", "metrics.csv", "loss.png", "accuracy.png", "model.h5"):
        assert (out / name).is_file(), name
    assert not list(out.glob("*.tmp"))
    rows = _metrics(out / "metrics.csv")
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [int(r["step"]) for r in train] == list(range(12))
    assert [int(r["step"]) for r in evals] == [0, 6, 12]
    for r in train:
        assert math.isfinite(float(r["loss"])) and math.isfinite(float(r["g"]))
        assert float(r["lr"]) == 1e-3 and float(r["compute_s"]) > 0
        assert float(r["comm_s"]) >= 0 and r["skipped"] == "0"
    for r in evals:
        assert 0.0 <= float(r["heldout_acc"]) <= 1.0 and math.isfinite(float(r["heldout_loss"]))
        assert int(r["heldout_n"]) > 0
    assert "HELD-OUT ACCURACY before" in proc.stderr
    assert "mode hybrid (2 seed groups)" in proc.stderr
    # energy so far on eval rows (semzo/energy.py): core-seconds always, growing; joules only
    # where this machine's RAPL is readable, and then the summary says so
    core = [float(r["core_s"]) for r in evals]
    assert core[0] > 0 and core == sorted(core) and core[-1] > core[0]
    assert all(r["energy_j"] == "" for r in train) and all(r["core_s"] == "" for r in train)
    if evals[-1]["energy_j"] == "":
        assert all(r["energy_j"] == r["cpu_energy_j"] == r["gpu_energy_j"] == "" for r in evals)
        assert "finetune: energy not measured (no readable RAPL/NVML)" in proc.stderr
        assert re.search(r"energy not measured \(no readable RAPL/NVML\), CPU core-seconds "
                         r"[0-9.]+", proc.stderr)
    else:
        assert "energy J " in proc.stderr and float(evals[-1]["energy_j"]) >= 0
    with h5py.File(out / "model.h5") as f:
        names = json.loads(f.attrs["trainable"])
        assert names and set(names) == set(f.keys())
        assert all(n.startswith(("classifier.", "encoder.layer.1.")) for n in names)
        assert f["classifier.weight"].shape == (3, 32)
        assert "[train]" in f.attrs["semzo_deck"] and f.attrs["steps"] == 12
        w = f["encoder.layer.1.output.dense.weight"][...]
    from safetensors.numpy import load_file
    w0 = load_file(str(tmp / "bert" / "model.safetensors"))["encoder.layer.1.output.dense.weight"]
    assert w.shape == w0.shape and not np.array_equal(w, w0)      # trained
    assert np.max(np.abs(w - w0)) < 0.1
    assert "frozen: their output is computed once per text and kept" in proc.stderr


def test_export_of_the_run_carries_the_labels(run, tmp_path):
    _, out, _ = run
    check(mpirun(1, ["-m", "semzo", "export", str(out / "checkpoints"), str(tmp_path / "hf")],
                 timeout=120, env=ENV))
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    with h5py.File(out / "shards.h5") as f:
        names = [x.decode() if isinstance(x, bytes) else str(x) for x in f.attrs["label_names"]]
    assert [cfg["id2label"][str(i)] for i in range(len(names))] == names


def test_finetune_stage_lm_decoder(run):
    tmp, out, _ = run
    gpt = make_model(tmp / "gpt2", kind="gpt2")
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                            "--set", f"model.path={gpt}", "--set", "train.task=lm",
                            "--set", "train.params=lora", "--set", "train.lora_rank=2",
                            "--set", "train.steps=6", "--set", "train.eval_every=0",
                            "--set", "zo.mode=perturbation", "--set", "zo.lr=1e-3", *COMMON],
                        timeout=180, env=ENV))
    assert "HELD-OUT NEXT-TOKEN ACCURACY before" in proc.stderr
    # demo.toml's last_layers = 0 is not read under params = lora: said once (rank 0)
    assert proc.stderr.count("train.last_layers = 0 is not read: it applies to train.params "
                             "= \"head+last\", and train.params is \"lora\"") == 1
    rows = _metrics(out / "metrics.csv")
    assert len([r for r in rows if r["kind"] == "train"]) == 6
    assert all(math.isfinite(float(r["loss"])) for r in rows if r["kind"] == "train")
    with h5py.File(out / "model.h5") as f:
        names = json.loads(f.attrs["trainable"])
        assert names and all(".lora_" in n for n in names)
        assert f.attrs["task"] == "lm"


def test_finetune_stage_lora_frozen_a_is_stored_and_resumed(run):
    """train.lora_a = "frozen" at 2 ranks: only B trains, and the frozen A matrices are stored
    beside B in every checkpoint and model.h5 (export and generate rebuild the adapters from
    them); a resume puts the stored A back and goes on: A the same bits at the end, B moved."""
    tmp = run[0]
    gpt = make_model(tmp / "gpt2_fa", kind="gpt2")
    sets = ["train.task=lm", "train.params=lora", "train.lora_rank=2", "train.lora_a=frozen",
            "train.eval_every=0", "zo.lr=1e-3", "checkpoint.every_steps=3"]
    out, _ = _finetune_only(run, "out_fa", gpt, *sets, "train.steps=6")
    from mpi4py import MPI

    from semzo.checkpoint import load
    with h5py.File(out / "model.h5") as f:
        trained = json.loads(f.attrs["trainable"])
        stored = {n: f[n][...] for n in f if ".lora_" in n}
    assert trained and all(n.endswith(".lora_B.weight") for n in trained), trained
    a_names = sorted(n for n in stored if n.endswith(".lora_A.weight"))
    assert len(a_names) == len(trained) == 2                     # GPT-2's c_attn, 2 blocks
    ck6 = load(out / "checkpoints" / "ckpt-000000006.h5", MPI.COMM_SELF).params
    assert sorted(ck6) == sorted([*trained, *a_names])
    assert all(np.array_equal(ck6[n], stored[n]) for n in ck6)
    args = ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={out}",
            "--set", 'run.stages=["finetune"]', "--set", f"corpus.path={tmp / 'corpus.jsonl'}",
            "--set", f"model.path={gpt}", "--resume"]
    for kv in [*sets, "train.steps=9"]:
        args += ["--set", kv]
    proc = check(mpirun(2, [*args, *COMMON], timeout=180, env=ENV))
    assert "resumed from ckpt-000000006.h5 (step 6" in proc.stderr, proc.stderr[-2000:]
    ck9 = load(out / "checkpoints" / "ckpt-000000009.h5", MPI.COMM_SELF).params
    assert all(np.array_equal(ck9[n], ck6[n]) for n in a_names)
    assert not all(np.array_equal(ck9[n], ck6[n]) for n in trained)
    bad = mpirun(2, [*args, "--set", "train.lora_a=train", *COMMON], timeout=120, env=ENV)
    assert bad.returncode == 2 and "train.lora_a = 'frozen' in the checkpoint, 'train' in " \
        "this deck" in bad.stderr, bad.stderr[-2000:]


def test_finetune_stage_head_only_uses_cached_features(run):
    _, out, _ = run
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                            "--set", f"model.path={run[0] / 'bert'}",
                            "--set", "train.params=head+last", "--set", "train.last_layers=0",
                            "--set", "train.steps=200", "--set", "train.eval_every=100",
                            "--set", "zo.mode=data", "--set", "zo.lr=1e-2", *COMMON],
                        timeout=180, env=ENV))
    assert "taken from shards.h5: same model, max_length 24" in proc.stderr
    rows = _metrics(out / "metrics.csv")
    assert len([r for r in rows if r["kind"] == "train"]) == 200
    with h5py.File(out / "model.h5") as f:
        assert set(json.loads(f.attrs["trainable"])) == {"classifier.weight", "classifier.bias"}


def test_finetune_stage_energy_from_a_fake_powercap(run, tmp_path):
    """SEMZO_TEST_POWERCAP: a fake RAPL package whose counter a thread here advances at
    100 W of wall time (wrapping every 10 s): every eval row has the joules so far, and the
    last one at least 100 W x the training time (the meter opens before it, reads after)."""
    import threading
    import time

    _, out, _ = run
    pkg = tmp_path / "powercap" / "intel-rapl:0"
    pkg.mkdir(parents=True)
    rng = 10**9                                           # uJ: 1 kJ, wraps every 10 s
    (pkg / "max_energy_range_uj").write_text(f"{rng}\n")
    rate, t0, stop = 1e8, time.perf_counter(), threading.Event()   # uJ per second

    def write():
        while True:
            tmp = pkg / "energy_uj.tmp"
            tmp.write_text(f"{int(rate * (time.perf_counter() - t0)) % rng}\n")
            os.replace(tmp, pkg / "energy_uj")                 # never half a number
            if stop.wait(0.005):
                return
    th = threading.Thread(target=write, daemon=True)
    th.start()
    try:
        proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                                "--set", f"run.output_dir={out}",
                                "--set", 'run.stages=["finetune"]',
                                "--set", f"model.path={run[0] / 'bert'}",
                                "--set", "train.params=head+last", "--set", "train.last_layers=0",
                                "--set", "train.steps=40", "--set", "train.eval_every=20",
                                "--set", "zo.mode=data", "--set", "zo.lr=1e-2", *COMMON],
                            timeout=180, env={**ENV, "SEMZO_TEST_POWERCAP": str(pkg.parent)}))
    finally:
        stop.set()
        th.join()
    wall = time.perf_counter() - t0
    evals = [r for r in _metrics(out / "metrics.csv") if r["kind"] == "eval"]
    joules = [float(r["energy_j"]) for r in evals]
    assert [int(r["step"]) for r in evals] == [0, 20, 40]
    assert joules == sorted(joules) and joules[-1] > 0
    assert all(r["cpu_energy_j"] == r["energy_j"] and r["gpu_energy_j"] == "" for r in evals)
    # the thread's writes lag the clock by its sleeps (longer on a loaded machine): 0.5 s
    assert 1e-6 * rate * (float(evals[-1]["elapsed_s"]) - 0.5) <= joules[-1] <= \
        1e-6 * rate * wall
    assert "energy: measured: CPU packages by RAPL on 1 host" in proc.stderr
    assert re.search(r"energy J [0-9.e+]+, CPU core-seconds [0-9.]+,", proc.stderr)


def test_finetune_stage_lm_llama_streamed_offload(run):
    """A tied-head CausalLM (tiny Llama) through the finetune stage with the streamed schedule
    and the simulated host offload: runs, loss finite, the updated model is saved."""
    tmp, shared, _ = run
    out = tmp / "out_llama"                   # the placed shards of the module's run
    out.mkdir()
    shutil.copy(shared / "shards.h5", out / "shards.h5")
    llama = make_model(tmp / "llama", kind="llama_tied")
    check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                     "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                     "--set", f"corpus.path={tmp / 'corpus.jsonl'}",
                     "--set", f"model.path={llama}", "--set", "train.task=lm",
                     "--set", "train.params=all", "--set", "train.steps=4",
                     "--set", "train.eval_every=0", "--set", "zo.schedule=streamed",
                     "--set", "zo.offload=host", "--set", "zo.mode=hybrid",
                     "--set", "zo.lr=1e-3", *COMMON], timeout=180, env=ENV))
    rows = _metrics(out / "metrics.csv")
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert len(train_rows) == 4 and all(math.isfinite(float(r["loss"])) for r in train_rows)
    with h5py.File(out / "model.h5") as f:
        assert f.attrs["task"] == "lm"
        assert "model.embed_tokens.weight" in json.loads(f.attrs["trainable"])


def test_finetune_stage_fzoo_auto_offload_keeps_the_best(run):
    """The deck defaults (zo.lr = "auto", so fzoo and Rademacher z) through the finetune stage
    with a tied-head CausalLM, the streamed schedule and the simulated host offload, hybrid
    mode: the scan runs and is logged, every step's spread is finite, the best held-out
    model is kept as checkpoints/best.h5 (what export and generate take from the run folder)
    and the summary names the final and the best held-out figures."""
    from mpi4py import MPI

    from semzo.checkpoint import find_model_checkpoint

    tmp = run[0]
    llama = make_model(tmp / "llama_fz", kind="llama_tied")
    out, proc = _finetune_only(run, "out_fzoo", llama, "train.task=lm", "train.params=all",
                               "train.steps=12", "train.eval_every=4", "zo.schedule=streamed",
                               "zo.offload=host", "zo.mode=hybrid", 'zo.lr="auto"',
                               "zo.lr_scan_fraction=0.5")
    assert 'zo.lr = "auto": lr' in proc.stderr
    assert "fzoo (4 directions per step)" in proc.stderr
    rows = _metrics(out / "metrics.csv")
    train_rows = [r for r in rows if r["kind"] == "train"]
    # 12 steps of 3 forward passes: half of them (18) fit one line search of up to 12 probes
    assert len(train_rows) == 12 and all(math.isfinite(float(r["sigma"])) for r in train_rows)
    assert (out / "checkpoints" / "best.h5").is_file()
    found, which = find_model_checkpoint(out, MPI.COMM_SELF)
    assert (found.name, which) == ("best.h5", "best")
    assert "best heldout loss" in proc.stderr and "final heldout loss" in proc.stderr


def test_finetune_stage_heldout_guard_rolls_back_to_best_h5(run):
    """zo.lr_rollback at 2 ranks, hybrid mode with reference copies: a fixed lr far too large
    makes the held-out loss rise; the guard reads checkpoints/best.h5 back into every replica
    (the checksums that follow agree) and halves the lr. The rolling checkpoint written at the
    rollback's step holds exactly the parameters of the checkpoint at the best step."""
    out, proc = _finetune_only(run, "out_rollback", run[0] / "bert", "train.params=head+last",
                               "train.last_layers=1", "train.steps=24", "train.eval_every=4",
                               "zo.mode=hybrid", "zo.lr=3.0", "zo.lr_rollback=0.1",
                               "zo.checksum_every=2", "checkpoint.every_steps=4",
                               "checkpoint.keep=10")
    hits = re.findall(r"step (\d+): held-out loss \S+ is more than 10 % above the lowest so far "
                      r"\(\S+\): back to the best held-out model \(step (\d+)", proc.stderr)
    assert hits, proc.stderr[-3000:]
    assert "lr scale 1 -> 0.5 (zo.lr_rollback)" in proc.stderr
    rows = _metrics(out / "metrics.csv")
    lrs = [float(r["lr"]) for r in rows if r["kind"] == "train"]
    at = int(hits[0][0])
    assert lrs[at - 1] == 3.0 and lrs[at] == 1.5            # halved from the next step on
    from mpi4py import MPI

    from semzo.checkpoint import load

    def params(step):
        return load(out / "checkpoints" / f"ckpt-{step:09d}.h5", MPI.COMM_SELF).params
    later = [(int(a), int(b)) for a, b in hits if int(b) > 0]   # step 0 has no checkpoint
    assert later, hits
    for at, best in later:
        a, b = params(at), params(best)
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a), (at, best)


def test_finetune_stage_validation_split_makes_the_decisions(run):
    """train.val_fraction at 2 ranks, the guard's setting of the test above: the validation
    split comes out of training, not out of the held-out split (the same held-out samples
    as without it); every evaluation row holds both splits' figures; the held-out guard and
    the best model follow the validation split, and the summary reports the best model's
    held-out figure, the one of its own evaluation row."""
    out, proc = _finetune_only(run, "out_val", run[0] / "bert", "train.params=head+last",
                               "train.last_layers=1", "train.steps=24", "train.eval_every=4",
                               "zo.mode=hybrid", "zo.lr=3.0", "zo.lr_rollback=0.1",
                               "train.val_fraction=0.2")
    first = _metrics(run[0] / "metrics_first.csv")
    held_n = {r["heldout_n"] for r in first if r["kind"] == "eval"}
    counts = re.search(r"(\d+) training / (\d+) held-out / (\d+) validation samples",
                       proc.stderr)
    assert counts, proc.stderr[-3000:]
    n_train, n_held, n_val = map(int, counts.groups())
    assert held_n == {str(n_held)} and n_val > 0 and n_train + n_held + n_val == 240
    rows = [r for r in _metrics(out / "metrics.csv") if r["kind"] == "eval"]
    assert [int(r["step"]) for r in rows] == list(range(0, 25, 4))
    assert all(r["val_n"] == str(n_val) and r["heldout_n"] == str(n_held) for r in rows)
    hits = re.findall(r"step (\d+): validation loss \S+ is more than 10 % above the lowest so "
                      r"far \(\S+\): back to the best validation model \(step (\d+)",
                      proc.stderr)
    assert hits, proc.stderr[-3000:]
    # the best model: the first evaluation of the highest validation accuracy (ties: the
    # lower validation loss), among those the run had seen when it chose
    best = None
    for r in rows:
        va, vl = float(r["val_acc"]), float(r["val_loss"])
        if best is None or va > best[1] or (va == best[1] and vl < best[2]):
            best = (int(r["step"]), va, vl, float(r["heldout_acc"]))
    got = re.search(r"the best model on the validation split \(step (\d+), validation "
                    r"accuracy (\S+), kept as \S+\): held-out (\S+)", proc.stderr)
    assert got, proc.stderr[-3000:]
    assert int(got.group(1)) == best[0] and float(got.group(2)) == pytest.approx(best[1],
                                                                                abs=1e-4)
    assert float(got.group(3)) == pytest.approx(best[3], abs=1e-4)
    assert (out / "checkpoints" / "best.h5").is_file()


@pytest.mark.parametrize("kind,task", [("llama", "lm"), ("llama_tied", "prompt")],
                         ids=["untied-lm", "tied-prompt"])
def test_finetune_stage_streamed_with_deferred_rows_equals_three_pass(run, kind, task):
    """A CausalLM (tiny Llama), every parameter trained, data mode at 2 ranks (a different
    batch on each): the streamed schedule, which defers the embedding rows a rank's batch
    does not read (untied, next-token loss; tied, prompt task: the head reads only the label
    words' rows), saves the model and losses of the three-pass schedule bit for bit, with
    replica checksums and held-out evaluations along the way."""
    tmp, shared, _ = run
    llama = make_model(tmp / f"{kind}_{task}", kind=kind)
    extra = ["--set", "train.task=lm"]
    if task == "prompt":
        extra = ["--set", "train.task=prompt", "--set", 'prompt.template="{text} is"',
                 "--set", 'prompt.label_words=["sea", "code", "cake"]']
    got = {}
    for sched in ("streamed", "three-pass"):
        out = tmp / f"out_{kind}_{task}_{sched}"
        out.mkdir()
        shutil.copy(shared / "shards.h5", out / "shards.h5")
        check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                         "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                         "--set", f"corpus.path={tmp / 'corpus.jsonl'}",
                         "--set", f"model.path={llama}", *extra,
                         "--set", "train.params=all", "--set", "train.steps=6",
                         "--set", "train.eval_every=3", "--set", f"zo.schedule={sched}",
                         "--set", "zo.mode=data", "--set", "zo.checksum_every=2",
                         "--set", "zo.lr=1e-3", *COMMON], timeout=180, env=ENV))
        rows = _metrics(out / "metrics.csv")
        with h5py.File(out / "model.h5") as f:
            params = {k: f[k][()] for k in f}
            assert f.attrs["task"] == task
        got[sched] = ([(r["kind"], r["step"], r["loss"], r["heldout_loss"]) for r in rows],
                      params)
    (rs, ps), (rt, pt) = got["streamed"], got["three-pass"]
    assert rs == rt and len([r for r in rs if r[0] == "train"]) == 6
    assert "model.embed_tokens.weight" in ps and set(ps) == set(pt)
    for k in ps:
        assert ps[k].tobytes() == pt[k].tobytes(), k


def test_finetune_stage_offloaded_without_prefix_cache(run):
    """The module's run again (finetune stage alone, head + last block) with the streamed
    schedule and the simulated host offload: no frozen-prefix cache (on a GPU the parameters
    are in host memory before the store exists), every evaluation streamed through the store,
    and the held-out figures those of the resident run with its prefix cache (equal up to the
    cache's rounding)."""
    tmp, shared, _ = run
    out = tmp / "out_offload"
    out.mkdir()
    shutil.copy(shared / "shards.h5", out / "shards.h5")
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                            "--set", f"corpus.path={tmp / 'corpus.jsonl'}",
                            "--set", f"model.path={tmp / 'bert'}",
                            "--set", "train.params=head+last", "--set", "train.last_layers=1",
                            "--set", "train.steps=12", "--set", "train.eval_every=6",
                            "--set", "zo.mode=hybrid", "--set", "zo.lr=1e-3",
                            "--set", "zo.checksum_every=5", "--set", "zo.schedule=streamed",
                            "--set", "zo.offload=host", *COMMON], timeout=180, env=ENV))
    assert "no frozen-prefix cache, every step streams the whole model" in proc.stderr
    slots = re.search(r"simulated device \(zo.offload = \"host\" on the CPU\): stage slots "
                      r"([0-9.]+) MiB", proc.stderr)
    assert slots and float(slots.group(1)) > 0, proc.stderr[-2000:]
    assert "computed once per text" not in proc.stderr
    want = [r for r in _metrics(tmp / "metrics_first.csv") if r["kind"] == "eval"]
    got = [r for r in _metrics(out / "metrics.csv") if r["kind"] == "eval"]
    assert [r["step"] for r in got] == [r["step"] for r in want] == ["0", "6", "12"]
    for g, w in zip(got, want):
        assert g["heldout_n"] == w["heldout_n"]
        assert math.isclose(float(g["heldout_loss"]), float(w["heldout_loss"]), rel_tol=1e-4)
        assert abs(float(g["heldout_acc"]) - float(w["heldout_acc"])) <= 0.05


def test_finetune_without_heldout_samples_is_refused(run):
    """A split that holds out no sample (a tiny train.heldout_fraction or few records) would
    evaluate nothing (accuracy nan) and exit 0: refused before any work like a split that
    leaves no training sample, one line naming the key, exit 2, nothing written."""
    tmp, shared, _ = run
    out = tmp / "out_noheld"
    out.mkdir()
    shutil.copy(shared / "shards.h5", out / "shards.h5")
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                      "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                      "--set", f"model.path={tmp / 'bert'}", "--set", "train.params=head+last",
                      "--set", "train.steps=2", "--set", "train.heldout_fraction=1e-6",
                      *COMMON], timeout=120, env=ENV)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "inputs/demo.toml: train.heldout_fraction: no held-out samples " \
        "(1e-06 of 240 samples drew none)" in lines[0], proc.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["shards.h5"]


def test_metrics_replace_the_previous_run_only_on_success(tmp_path):
    """Rows go to metrics.csv.tmp while the stage runs; metrics.csv and the plots of an
    earlier run stay untouched until finish() (a failed rerun leaves them matching the earlier
    model.h5), which renames it whole."""
    from semzo.finetune.report import COLUMNS, Metrics

    (tmp_path / "metrics.csv").write_text("earlier run\n")
    (tmp_path / "loss.png").write_bytes(b"earlier")
    m = Metrics(tmp_path, active=True, flush_every=1)
    m.add({"kind": "eval", "step": 0, "heldout_loss": 1.5, "heldout_acc": 0.5, "heldout_n": 4})
    m.add({"kind": "train", "step": 0, "loss": 1.25, "g": 0.5, "lr": 1e-3, "skipped": 0})
    assert (tmp_path / "metrics.csv").read_text() == "earlier run\n"
    assert (tmp_path / "loss.png").read_bytes() == b"earlier"
    rows = _metrics(tmp_path / "metrics.csv.tmp")             # progress, readable mid-run
    assert [r["kind"] for r in rows] == ["eval", "train"] and rows[1]["loss"] == "1.25"
    paths = m.finish("(test)")
    assert {p.name for p in paths} == {"metrics.csv", "loss.png", "accuracy.png"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accuracy.png", "loss.png",
                                                           "metrics.csv"]
    assert tuple(_metrics(tmp_path / "metrics.csv")[0]) == COLUMNS
    assert (tmp_path / "loss.png").read_bytes()[:4] == b"\x89PNG"
    other = Metrics(tmp_path, active=False)                 # ranks > 0 write nothing
    other.add({"kind": "train", "step": 1})
    assert other.finish() == [] and not (tmp_path / "metrics.csv.tmp").exists()
