"""Checkpoints in the finetune stage: bit-exact resume, resume at another world size, a rank
killed with SIGKILL mid-run, and a corrupt newest checkpoint. Every run is the finetune stage
alone on the shards.h5 of one small pipeline run (module fixture), with a tiny random BERT."""

from __future__ import annotations

import csv
import json
import shutil
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpiutil import check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from ckpt_common import flip, locate
from zo_common import make_model, write_corpus

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
COMMON = ["--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1",
          "--set", "model.max_length=24", "--set", "train.max_length=24",
          "--set", "train.batch_size=8", "--set", "train.log_every=5",
          "--set", "train.schedule=constant", "--set", "train.warmup_steps=0"]
N = 20


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ftresume")
    bert = make_model(tmp / "bert")
    corpus = write_corpus(tmp / "corpus.jsonl", 240)
    out = tmp / "base"
    check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                     "--set", f"run.output_dir={out}", "--set", f"corpus.path={corpus}",
                     "--set", f"model.path={bert}", "--set", "cluster.k=3",
                     "--set", "train.params=head+last", "--set", "train.last_layers=0",
                     "--set", "train.steps=1", "--set", "checkpoint.every_steps=0",
                     *COMMON], timeout=240, env=ENV))
    return tmp, bert, out


def _outdir(base, name: str) -> Path:
    tmp, _, src = base
    d = tmp / name
    d.mkdir()
    for f in ("shards.h5", "clusters.h5"):
        shutil.copy(src / f, d / f)
    return d


def _ft(base, n: int, out: Path, steps: int, *extra: str, env: dict | None = None,
        ok: bool = True, last_layers: int = 1, timeout: int = 120):
    """The finetune stage alone: head + last encoder block, hybrid ZO, a checkpoint every 5
    steps."""
    proc = mpirun(n, ["-m", "semzo", "run", "inputs/demo.toml",
                      "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                      "--set", f"model.path={base[1]}", "--set", "train.params=head+last",
                      "--set", f"train.last_layers={last_layers}",
                      "--set", f"train.steps={steps}", "--set", "train.eval_every=0",
                      "--set", "zo.mode=hybrid", "--set", "zo.lr=1e-3",
                      "--set", "checkpoint.every_steps=5", *COMMON, *extra],
                  timeout=timeout, env={**ENV, **(env or {})})
    return check(proc) if ok else proc


def _params(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        return {k: f[k][()] for k in f}


def _same_params(a: Path, b: Path) -> None:
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]), k


def _shapes(ckpt: Path) -> dict[str, tuple]:
    """Tensor path -> shape, from a checkpoint's index."""
    with h5py.File(ckpt) as f:
        return {bytes(r["path"]).decode(): tuple(int(x) for x in r["shape"][:r["ndim"]])
                for r in f["index"][()]}


def _train_rows(path: Path) -> dict[int, tuple[str, str, str]]:
    with open(path, newline="") as f:
        return {int(r["step"]): (r["loss"], r["g"], r["lr"])
                for r in csv.DictReader(f) if r["kind"] == "train"}


@pytest.fixture(scope="module")
def reference(base):
    """The uninterrupted N-step run at 2 ranks."""
    out = _outdir(base, "ref")
    _ft(base, 2, out, N)
    return out


def test_resume_is_bit_exact(base, reference):
    out = _outdir(base, "split")
    _ft(base, 2, out, N // 2)
    first = _train_rows(out / "metrics.csv")
    assert max((out / "checkpoints").glob("ckpt-*.h5")).name == "ckpt-000000010.h5"
    plain = _ft(base, 2, out, N // 2)
    assert "starting from the model" in plain.stderr and "pass --resume" in plain.stderr
    proc = _ft(base, 2, out, N, "--resume")
    assert "resumed from ckpt-000000010.h5 (step 10, same world size 2)" in proc.stderr
    second = _train_rows(out / "metrics.csv")
    ref = _train_rows(reference / "metrics.csv")
    # the resumed run keeps the first run's rows (metrics.csv holds the whole curve)
    assert sorted(first) == list(range(10)) and sorted(second) == list(range(N))
    assert second == ref and {k: second[k] for k in first} == first   # as written, every step
    _same_params(out / "model.h5", reference / "model.h5")
    with h5py.File(out / "model.h5") as f:
        assert f.attrs["steps"] == N
    assert _shapes(out / "checkpoints" / "ckpt-000000020.h5")["extras/centroids"] == (3, 32)


def test_resume_with_fused_restore_is_bit_exact(base):
    """zo.restore = "fused" with 2 seed groups: the replicas drift by rounding between the
    checksum steps (here none before the end) and each rank writes its rows of a checkpoint,
    so every save re-syncs them from rank 0 first: the resumed run then ends with the bits
    of the uninterrupted one."""
    fused = ["--set", "zo.restore=fused", "--set", "zo.checksum_every=0"]
    ref = _outdir(base, "fused-ref")
    _ft(base, 2, ref, N, *fused)
    out = _outdir(base, "fused-split")
    _ft(base, 2, out, N // 2, *fused)
    proc = _ft(base, 2, out, N, "--resume", *fused)
    assert "resumed from ckpt-000000010.h5" in proc.stderr
    assert _train_rows(out / "metrics.csv") == _train_rows(ref / "metrics.csv")
    _same_params(out / "model.h5", ref / "model.h5")


@pytest.mark.parametrize("sizes", [(4, 2), (2, 4)])
def test_resume_at_another_world_size(base, sizes):
    a, b = sizes
    out = _outdir(base, f"ws{a}to{b}")
    _ft(base, a, out, N // 2)
    proc = _ft(base, b, out, N, "--resume", timeout=180)
    assert f"written at {a} ranks, now {b}: data cursors remapped" in proc.stderr
    with h5py.File(out / "model.h5") as f:
        assert f.attrs["steps"] == N
    with h5py.File(out / "checkpoints" / f"ckpt-{N:09d}.h5") as f:
        assert f.attrs["world_size"] == b
    assert _shapes(out / "checkpoints" / f"ckpt-{N:09d}.h5")["per_rank/cursor"] == (b, 2)


@pytest.fixture(scope="module")
def reference4(base):
    """The uninterrupted N-step run at 4 ranks (2 switches x 2 nodes)."""
    out = _outdir(base, "ref4")
    _ft(base, 4, out, N)
    return out


def test_killed_rank_then_resume(base, reference4):
    """kill -9 of rank 2 of 4 mid-run: the job ends promptly; --resume ends identical."""
    out = _outdir(base, "killed")
    t0 = time.monotonic()
    proc = _ft(base, 4, out, N, env={"SEMZO_TEST_KILL": "2:13"}, ok=False, timeout=90)
    # mpirun reports the rank's signal (exit 137 = 128 + 9) well before the 90 s timeout
    assert proc.returncode != 0 and time.monotonic() - t0 < 60, proc.returncode
    assert "signal 9" in proc.stdout + proc.stderr
    assert not (out / "model.h5").exists()
    # no metrics.csv of a run that failed: its rows up to the kill are in metrics.csv.tmp
    assert not (out / "metrics.csv").exists() and (out / "metrics.csv.tmp").is_file()
    assert (out / "checkpoints" / "ckpt-000000010.h5").is_file()
    assert not (out / "checkpoints" / "ckpt-000000015.h5").exists()
    proc = _ft(base, 4, out, N, "--resume")
    assert "resumed from ckpt-000000010.h5" in proc.stderr
    _same_params(out / "model.h5", reference4 / "model.h5")
    assert (out / "metrics.csv").is_file() and not (out / "metrics.csv.tmp").exists()
    # the requeued run keeps the curve: one row per step 0..N-1, the earlier run's rows
    # (steps 0..9) as they were, and the held-out figures from before fine-tuning
    assert sorted(_train_rows(out / "metrics.csv")) == list(range(N))
    assert _train_rows(out / "metrics.csv") == _train_rows(reference4 / "metrics.csv")
    assert "recorded in the checkpoint" in proc.stderr
    with h5py.File(out / "model.h5") as f, h5py.File(reference4 / "model.h5") as g:
        assert f.attrs["heldout_acc_before"] == g.attrs["heldout_acc_before"]
        assert f.attrs["heldout_loss_before"] == g.attrs["heldout_loss_before"]


def test_corrupt_newest_checkpoint_falls_back(base, reference4):
    out = _outdir(base, "corrupt")
    _ft(base, 4, out, N // 2)
    newest = out / "checkpoints" / "ckpt-000000010.h5"
    name = next(k for k in _shapes(newest) if k.startswith("params/classifier."))
    flip(newest, locate(newest, name)[0] + 3, 0x40)
    proc = _ft(base, 4, out, N, "--resume")
    assert "skipping checkpoint" in proc.stderr and "ckpt-000000010.h5" in proc.stderr
    assert "resumed from ckpt-000000005.h5" in proc.stderr
    _same_params(out / "model.h5", reference4 / "model.h5")


def test_resume_with_another_zo_dist_is_refused(base):
    """The checkpoint records zo.dist (its deferred update and seed history regenerate z from
    that stream): resuming under another one stops with one line naming the key, exit 2;
    under the same one it resumes."""
    out = _outdir(base, "dist")
    _ft(base, 2, out, 5)
    with h5py.File(out / "checkpoints" / "ckpt-000000005.h5") as f:
        zo = json.loads(f.attrs["model_meta"])["zo"]
    assert (zo["dist"], zo["estimator"]) == ("gaussian", "mezo")    # demo.toml: a fixed lr
    proc = _ft(base, 2, out, 10, "--resume", "--set", "zo.dist=rademacher", ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "ckpt-000000005.h5: zo.dist = 'gaussian' in the checkpoint, 'rademacher' in this " \
           "deck" in proc.stderr
    proc = _ft(base, 2, out, 10, "--resume", "--set", "zo.dist=gaussian")
    assert "resumed from ckpt-000000005.h5" in proc.stderr


def test_resume_with_another_task_key_is_refused(base):
    """Keys that define what the checkpoint's tensors mean (the trainable set, the lengths,
    LoRA, the prompt) are compared with the checkpoint's deck: one line naming the key with
    both values, exit 2, and the advice fits someone who asked for --resume."""
    out = _outdir(base, "task")
    _ft(base, 2, out, 5)
    proc = _ft(base, 2, out, 10, "--resume", "--set", "train.max_length=20", ok=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    assert ("ckpt-000000005.h5: train.max_length = 24 in the checkpoint, 20 in this deck"
            in lines[0]) and "checkpoint.resume" not in lines[0], lines[0]
    proc = _ft(base, 2, out, 10, "--resume", last_layers=2, ok=False)
    assert proc.returncode == 2 and "train.last_layers = 1 in the checkpoint, 2 in this " \
        "deck" in proc.stderr, proc.stderr[-2000:]


def test_task_keys_compare_the_prompt_and_lora():
    """The prompt template, label words and LoRA rank of the checkpoint's deck against this
    deck's (a prompt-task resume is refused by key, not by tensor shapes)."""
    from types import SimpleNamespace

    from semzo import deck as deckmod
    from semzo.finetune.resume import check_same_task
    from semzo.runtime import SemzoError

    d = deckmod.load(None, ['prompt.template="{text} It was"', "train.params=lora",
                            "train.lora_rank=8"], check_inputs=False)
    ck = SimpleNamespace(path=Path("ck.h5"), deck_toml=d.to_toml())
    check_same_task(ck, d)                                        # the same deck resumes
    for setting, expect in [('prompt.template="Review: {text} It was"',
                             ("prompt.template = '{text} It was' in the checkpoint, "
                             "'Review: {text} It was' in this deck")),
                            ('prompt.label_words=[" bad", " good"]',
                             "prompt.label_words = [] in the checkpoint, [' bad', ' good']"),
                            ("train.lora_rank=4",
                             "train.lora_rank = 8 in the checkpoint, 4 in this deck")]:
        other = deckmod.load(None, ['prompt.template="{text} It was"', "train.params=lora",
                                    "train.lora_rank=8", setting], check_inputs=False)
        with pytest.raises(SemzoError) as exc:
            check_same_task(ck, other)
        assert str(exc.value).startswith("ck.h5: ") and expect in str(exc.value), exc.value


def test_task_keys_compare_lora_a_also_for_checkpoints_older_than_the_key():
    """train.lora_a (frozen A or trained A) is a task key; a checkpoint written before the key
    existed trained A (with params = "lora"): resumed under "frozen" it is refused by name,
    under "train" (the default) it resumes; without LoRA the key is not compared."""
    from types import SimpleNamespace

    from semzo import deck as deckmod
    from semzo.finetune.resume import check_same_task
    from semzo.runtime import SemzoError

    lora = ['train.params="lora"']
    frozen = deckmod.load(None, [*lora, 'train.lora_a="frozen"'], check_inputs=False)
    trained = deckmod.load(None, lora, check_inputs=False)
    assert trained.train.lora_a == "train"
    ck = SimpleNamespace(path=Path("ck.h5"), deck_toml=trained.to_toml())
    check_same_task(ck, trained)
    with pytest.raises(SemzoError, match="ck.h5: train.lora_a = 'train' in the checkpoint, "
                                         "'frozen' in this deck"):
        check_same_task(ck, frozen)
    old = "\n".join(ln for ln in trained.to_toml().splitlines() if not ln.startswith("lora_a"))
    assert "lora_a" not in old and 'params = "lora"' in old
    ck_old = SimpleNamespace(path=Path("old.h5"), deck_toml=old)
    with pytest.raises(SemzoError, match="old.h5: train.lora_a = 'train' in the checkpoint"):
        check_same_task(ck_old, frozen)
    check_same_task(ck_old, trained)
    head = deckmod.load(None, [], check_inputs=False)
    no_key = "\n".join(ln for ln in head.to_toml().splitlines() if not ln.startswith("lora_a"))
    check_same_task(SimpleNamespace(path=Path("h.h5"), deck_toml=no_key), head)


def test_resume_with_another_seed_or_split_is_refused(base):
    """run.seed sets the z stream, the data order and (train.split_seed = -1) the held-out
    split; train.split_seed and train.heldout_fraction set the split too: a resume under
    other values would move training rows into the held-out set. Each is refused with one
    line naming the key, exit 2; the same effective split seed given explicitly resumes."""
    out = _outdir(base, "seeds")
    _ft(base, 2, out, 5)
    written = (out / "model.h5").stat().st_mtime_ns
    with h5py.File(out / "checkpoints" / "ckpt-000000005.h5") as f:
        assert '"split": {"heldout_fraction": 0.1, "seed": 0, "val_fraction": 0.0}' in \
            f.attrs["model_meta"]
    ck = "ckpt-000000005.h5: "
    cases = [("run.seed=1", ck + "run.seed = 0 in the checkpoint, 1 in this deck"),
             ("train.split_seed=7", ck + "train.split_seed: the held-out split was drawn with "
              "seed 0 in the checkpoint, 7 in this deck"),
             ("train.heldout_fraction=0.2", ck + "train.heldout_fraction = 0.1 in the "
              "checkpoint, 0.2 in this deck")]
    for setting, expect in cases:
        proc = _ft(base, 2, out, 10, "--resume", "--set", setting, ok=False)
        assert proc.returncode == 2, (setting, proc.stderr[-2000:])
        lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and expect in lines[0], (setting, proc.stderr[-2000:])
        assert (out / "model.h5").stat().st_mtime_ns == written      # not rewritten
    proc = _ft(base, 2, out, 10, "--resume", "--set", "train.split_seed=0")
    assert "resumed from ckpt-000000005.h5" in proc.stderr


def test_split_of_older_checkpoints():
    """Checkpoints written before model_meta["split"]: the saved deck's split seed (-1: its
    run.seed) and held-out fraction, else the saved run seed."""
    from types import SimpleNamespace

    from semzo.finetune.resume import check_same_seeds
    from semzo.runtime import SemzoError

    def ck(deck_toml: str, meta: str = "{}"):
        return SimpleNamespace(path=Path("ckpt-000000005.h5"), state={"run_seed": 3},
                               attrs={"model_meta": meta}, deck_toml=deck_toml)

    check_same_seeds(ck(""), 3, 3, 0.1)                           # nothing but the run seed
    with pytest.raises(SemzoError, match="seed 3 in the checkpoint, 5 in this deck"):
        check_same_seeds(ck(""), 3, 5, 0.1)
    old = "[run]\nseed = 3\n[train]\nsplit_seed = 9\nheldout_fraction = 0.25\n"
    check_same_seeds(ck(old), 3, 9, 0.25)
    with pytest.raises(SemzoError, match="seed 9 in the checkpoint, 3 in this deck"):
        check_same_seeds(ck(old), 3, 3, 0.25)
    with pytest.raises(SemzoError, match="train.heldout_fraction = 0.25 in the checkpoint"):
        check_same_seeds(ck(old), 3, 9, 0.1)
    with pytest.raises(SemzoError, match="run.seed = 3 in the checkpoint, 4 in this deck"):
        check_same_seeds(ck(old), 4, 9, 0.25)
    new = '{"split": {"heldout_fraction": 0.1, "seed": 3}}'
    check_same_seeds(ck(old, new), 3, 3, 0.1)                     # model_meta comes first
    # train.val_fraction: from model_meta, else the saved deck, else 0 (before it existed)
    with pytest.raises(SemzoError, match="train.val_fraction = 0 in the checkpoint, 0.1 in"):
        check_same_seeds(ck(old, new), 3, 3, 0.1, 0.1)
    val = '{"split": {"heldout_fraction": 0.1, "seed": 3, "val_fraction": 0.15}}'
    check_same_seeds(ck(old, val), 3, 3, 0.1, 0.15)
    with pytest.raises(SemzoError, match="train.val_fraction = 0.15 in the checkpoint, 0 in "):
        check_same_seeds(ck(old, val), 3, 3, 0.1)
    with pytest.raises(SemzoError, match="train.val_fraction = 0.2 in the checkpoint"):
        check_same_seeds(ck(old + "val_fraction = 0.2\n"), 3, 9, 0.25)


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_signal_on_one_rank_checkpoints_stops_and_resumes(base, reference4, sig):
    """A batch system's warning signal reaching one rank of 4 after step 7: every rank stops
    after the same later step, the checkpoint of that step is written, exit 75 with one line;
    --resume ends with the uninterrupted run's parameters bit for bit."""
    out = _outdir(base, f"signal_{sig}")
    proc = _ft(base, 4, out, N, env={"SEMZO_TEST_SIGNAL": f"1:7:{sig}"}, ok=False, timeout=90)
    assert proc.returncode == 75, (proc.returncode, proc.stderr[-3000:])
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith(("stopped:", "error"))]
    assert len(lines) == 1 and lines[0].startswith(f"stopped: finetune: {sig} received"), lines
    # rank 1 gets it in the hook after step 7: the ranks agree on it at the end of the first
    # check step that starts after that (checks are about StopRequest.PERIOD_S apart)
    stopped = int(lines[0].split("stopped after step ")[1].split(" ")[0])
    assert 8 <= stopped < N, lines
    assert (out / "checkpoints" / f"ckpt-{stopped:09d}.h5").is_file()
    assert not (out / "model.h5").exists() and not (out / "metrics.csv").exists()
    proc = _ft(base, 4, out, N, "--resume")
    assert f"resumed from ckpt-{stopped:09d}.h5" in proc.stderr
    _same_params(out / "model.h5", reference4 / "model.h5")


def test_sigusr1_to_mpirun_is_forwarded_and_stops_with_a_checkpoint(base):
    """The way a job script or a user stops a run under Open MPI: SIGUSR1 to the mpirun
    process, which forwards it to every rank; the run stops with a checkpoint, exit 75."""
    import os
    import signal
    import subprocess

    from mpiutil import MPI_ENV

    out = _outdir(base, "usr1")
    cmd = ["timeout", "-k", "5", "120", "mpirun", "-n", "2", sys.executable, "-m", "semzo",
           "run", "inputs/demo.toml", "--set", f"run.output_dir={out}",
           "--set", 'run.stages=["finetune"]', "--set", f"model.path={base[1]}",
           "--set", "train.params=head+last", "--set", "train.last_layers=0",
           "--set", "train.steps=100000", "--set", "train.max_epochs=0",
           "--set", "train.eval_every=0",
           "--set", "checkpoint.every_steps=0", *COMMON]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, **MPI_ENV, **ENV},
                            cwd=Path(__file__).resolve().parents[1])
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "step 10/100000" in line:
            break
    kids = subprocess.run(["pgrep", "-P", str(proc.pid), "mpirun"], capture_output=True,
                          text=True, check=False).stdout.split()
    assert kids, "".join(seen[-20:])
    os.kill(int(kids[0]), signal.SIGUSR1)
    rest = proc.stderr.read()
    rc = proc.wait(timeout=60)
    assert rc == 75, (rc, rest[-3000:])
    assert "stopped: finetune: SIGUSR1 received: stopped after step " in rest
    step = int(rest.split("stopped after step ")[1].split(" ")[0])
    assert 10 <= step < 100000
    assert (out / "checkpoints" / f"ckpt-{step:09d}.h5").is_file()


def test_cursor_out_of_range_is_refused():
    """A checkpoint's data cursor is checked before the data order uses it: a negative
    position never reaches the end of the shard (the batcher would loop for ever)."""
    from semzo.finetune.data import Batcher
    from semzo.finetune.stage import cursor_error

    p = Path("ckpt-000000005.h5")
    assert cursor_error(p, 0, np.array([3, 7], np.int64), 10) is None
    assert cursor_error(p, 0, np.array([0, 0], np.int64), 0) is None        # an empty shard
    b = Batcher(10, 4, 0, 0)
    epoch, pos = 0, 0
    for _ in range(7):                        # every cursor the batcher leaves is accepted
        _, epoch, pos = b.next(epoch, pos)
        assert cursor_error(p, 0, np.array([epoch, pos], np.int64), 10) is None
    for bad in ([0, -3], [-1, 0], [0, 10], [2]):
        msg = cursor_error(p, 1, np.array(bad, np.int64), 10)
        assert msg.startswith(f"{p}: per_rank/cursor of rank 1 is {bad}"), msg
    assert cursor_error(p, 0, np.array([0.0, 1.0]), 10) is not None       # not integers


def test_fixed_lr_checkpoint_under_lr_auto_is_refused():
    """A resumed run does not scan: a checkpoint of a fixed-lr run resumed with zo.lr =
    "auto" would keep its lr under lr auto's schedule and guards. Refused in one line naming
    zo.lr; lr auto on both sides, or a number on the resuming side, goes on."""
    from types import SimpleNamespace

    from semzo.finetune.resume import check_lr_auto
    from semzo.runtime import SemzoError

    def ck(deck_toml: str):
        return SimpleNamespace(path=Path("ckpt-000000005.h5"), state={}, attrs={},
                               deck_toml=deck_toml)

    with pytest.raises(SemzoError, match=r'^ckpt-000000005.h5: zo.lr = 0.001 in the '
                                         r'checkpoint, "auto" in this deck'):
        check_lr_auto(ck("[zo]\nlr = 1e-3\n"), "auto")
    check_lr_auto(ck('[zo]\nlr = "auto"\n'), "auto")
    check_lr_auto(ck("[zo]\nlr = 1e-3\n"), 1e-3)
    check_lr_auto(ck('[zo]\nlr = "auto"\n'), 2e-4)      # a number given on purpose
    check_lr_auto(ck(""), "auto")                        # no deck saved: nothing to compare


def test_rollback_to_a_best_model_the_state_does_not_hold_is_refused():
    """The held-out guard goes back to best.h5 only when it holds the state's best step: a
    run resumed from a checkpoint older than its interrupted predecessor's last best.h5
    would otherwise load a model from that abandoned future."""
    from types import SimpleNamespace

    from semzo.finetune.loop import TrainState
    from semzo.finetune.stage import _StepSaver

    reloaded = []
    saver = object.__new__(_StepSaver)
    saver.names = ["w"]
    saver.topo = SimpleNamespace(rank=1)            # rank 0 alone logs: nothing to capture
    best = SimpleNamespace(step=700, params={"w": np.ones(3)})
    saver.ck = SimpleNamespace(load_best=lambda: best, dir=Path("ck"))
    engine = SimpleNamespace(reload=lambda d: reloaded.append(d))
    saver.rollback(TrainState(best_step=400), engine)
    assert reloaded == []
    saver.rollback(TrainState(best_step=700), engine)
    assert len(reloaded) == 1 and reloaded[0][0] is best.params["w"]
