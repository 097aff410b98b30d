"""Issue 12, defect 8: a damaged newest checkpoint of a real 4-rank fine-tuning run must be
skipped (one warning naming it) and the run resumed from the older one, ending bit-identical
to the undamaged run; never a hang, a segfault or a traceback.

One real run (module fixture): the pipeline at 2 ranks, then the finetune stage at 4 ranks
for 10 steps with a checkpoint every 5 steps (ckpt-5, ckpt-10), and the uninterrupted
15-step run as the reference. Each case damages a copy of ckpt-10: changed bytes in the
metadata (the HDF5 superblock's end-of-file address, an attribute header, a B-tree or heap
signature, the last bytes), in the data, in the whole-file record, and truncations.
``--resume`` then runs the 4 ranks to step 15 under a timeout. A wider set of random damages
goes through ``resume`` alone, 4 ranks, one launch (tests/mpi/ckpt_damage.py).
"""

from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpiutil import ROOT, check, mpirun

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
from ckpt_common import flip, locate
from zo_common import make_model, write_corpus

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
COMMON = ["--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1",
          "--set", "model.max_length=24", "--set", "train.max_length=24",
          "--set", "train.batch_size=8", "--set", "train.log_every=5",
          "--set", "train.schedule=constant", "--set", "train.warmup_steps=0"]
N, FIRST, GOOD = 15, 10, 5
DAMAGED = f"ckpt-{FIRST:09d}.h5"


def _ft(bert: Path, out: Path, steps: int, *extra: str, timeout: int = 150):
    return mpirun(4, ["-m", "semzo", "run", "inputs/demo.toml",
                      "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                      "--set", f"model.path={bert}", "--set", "train.params=head+last",
                      "--set", "train.last_layers=1", "--set", f"train.steps={steps}",
                      "--set", "train.eval_every=0", "--set", "zo.mode=hybrid",
                      "--set", "zo.lr=1e-3", "--set", "checkpoint.every_steps=5",
                      *COMMON, *extra], timeout=timeout, env=ENV)


def _outdir(src: Path, dst: Path, checkpoints: bool) -> Path:
    dst.mkdir(parents=True)
    for f in ("shards.h5", "clusters.h5"):
        shutil.copy(src / f, dst / f)
    if checkpoints:
        shutil.copytree(src / "checkpoints", dst / "checkpoints")
    return dst


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckdamage")
    bert = make_model(tmp / "bert")
    corpus = write_corpus(tmp / "corpus.jsonl", 240)
    base = tmp / "base"
    check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                     "--set", f"run.output_dir={base}", "--set", f"corpus.path={corpus}",
                     "--set", f"model.path={bert}", "--set", "cluster.k=3",
                     "--set", "train.params=head+last", "--set", "train.last_layers=0",
                     "--set", "train.steps=1", "--set", "checkpoint.every_steps=0",
                     *COMMON], timeout=240, env=ENV))
    first = _outdir(base, tmp / "first", False)
    check(_ft(bert, first, FIRST))
    ref = _outdir(base, tmp / "ref", False)
    check(_ft(bert, ref, N))
    names = sorted(p.name for p in (first / "checkpoints").glob("ckpt-*.h5"))
    assert names == [f"ckpt-{GOOD:09d}.h5", DAMAGED], names
    return tmp, bert, first, ref


def _find(raw: bytes, sig: bytes) -> int:
    i = raw.find(sig, 4096)
    assert i > 0, sig
    return i


def damage(path: Path, how: str) -> str:
    """Damage ``path`` as ``how`` says; returns a description."""
    raw = path.read_bytes()
    size = len(raw)
    if how.startswith("truncate"):
        n = {"truncate-half": size // 2, "truncate-superblock": 4096 + 48,
             "truncate-last": size - 1}[how]
        with open(path, "r+b") as fh:
            fh.truncate(n)
        return f"truncated to {n} of {size}"
    if how.startswith("seed"):
        rng = random.Random(int(how[4:]))
        off = rng.randrange(size)
        flip(path, off, rng.randrange(1, 256))
        return f"byte {off} of {size}"
    off = {"superblock-eof": 4096 + 40, "record": 40, "last-byte": size - 1,
           "near-end": size - 881, "attribute-header": _find(raw, b"attrs_checksum"),
           "btree": _find(raw, b"TREE") + 5, "heap": _find(raw, b"HEAP") + 6,
           "data": locate(path, "params/classifier.weight")[0] + 3}[how]
    flip(path, off, 0x40)
    return f"byte {off} of {size}"


def _params(path: Path) -> dict[str, np.ndarray]:
    with h5py.File(path) as f:
        return {k: f[k][()] for k in f}


# End to end (a 4-rank resumed run each): one case per way a damage is caught (a changed
# byte in the HDF5 metadata, in the data, a truncation). The other named places go through
# the one-launch resume test below, with the random damages: the same detection code, a
# launch saved per case.
CASES = ["superblock-eof", "data", "truncate-half"]
NAMED = ["near-end", "last-byte", "attribute-header", "btree", "record",
         "truncate-superblock"]


@pytest.mark.parametrize("how", CASES)
def test_damaged_newest_is_skipped_and_the_run_ends_identical(real, how):
    tmp, bert, first, ref = real
    out = _outdir(first, tmp / f"case-{how}", True)
    what = damage(out / "checkpoints" / DAMAGED, how)
    proc = _ft(bert, out, N, "--resume")
    text = proc.stdout + proc.stderr
    assert proc.returncode not in (124, 137, 139), f"{how} ({what}): exit {proc.returncode}"
    assert "Traceback" not in text, f"{how} ({what}):\n{text[-3000:]}"
    check(proc)
    warned = [ln for ln in proc.stderr.splitlines() if "skipping checkpoint" in ln]
    assert len(warned) == 1 and DAMAGED in warned[0], (how, what, warned)
    assert f"resumed from ckpt-{GOOD:09d}.h5" in proc.stderr
    pa, pb = _params(out / "model.h5"), _params(ref / "model.h5")
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and np.array_equal(pa[k], pb[k]), (how, k)


def test_many_random_damages_resume_at_4_ranks(real, tmp_path):
    """The named damages not run end to end, and 40 more (random bytes with random masks,
    truncations at random points) of the real checkpoint, each resumed by the checkpoint
    layer at 4 ranks in one launch."""
    _, _, first, _ = real
    for how in NAMED:
        d = tmp_path / f"n-{how}"
        shutil.copytree(first / "checkpoints", d)
        damage(d / DAMAGED, how)
    rng = random.Random(12)
    for i in range(40):
        d = tmp_path / f"c{i:02d}"
        shutil.copytree(first / "checkpoints", d)
        p = d / DAMAGED
        size = p.stat().st_size
        if i % 4 == 3:
            with open(p, "r+b") as fh:
                fh.truncate(rng.randrange(size))
        else:
            damage(p, f"seed{rng.randrange(10**6)}")
    proc = mpirun(4, [str(ROOT / "tests" / "mpi" / "ckpt_damage.py"), str(tmp_path),
                      str(GOOD)], timeout=240, env=ENV)
    assert proc.returncode not in (124, 137, 139), proc.returncode
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    check(proc)
    n = 40 + len(NAMED)
    assert f"ok: {n} damaged folders resumed from step 5" in proc.stdout
    assert proc.stderr.count("skipping checkpoint") == n
