"""GPU: the pipeline end to end with ``run.device = "gpu"`` at 2 ranks sharing the GPU, a
checkpoint saved from device arrays then a bit-exact resume, and the prefix cache (frozen
lower blocks' output kept on the device).

Every harness takes the device as a parameter: the ``cpu`` cases run the very same code with
``run.device = "cpu"`` (or NumPy), so the test code is proven without a GPU; the ``gpu`` cases
are skipped only when CuPy or a GPU is absent.
"""

from __future__ import annotations

import csv
import shutil
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpiutil import check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from gpu_common import GPU_REASON, cupy_or_none, host
from zo_common import make_model, write_corpus

from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.tasks.classify import ClassifyTask, PrefixCachedClassifyTask

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
COMMON = ["--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1",
          "--set", "model.max_length=24", "--set", "train.max_length=24",
          "--set", "train.batch_size=8", "--set", "train.log_every=5",
          "--set", "train.schedule=constant", "--set", "train.warmup_steps=0"]
N = 10
DEVICES = [pytest.param("gpu", marks=pytest.mark.skipif(
    GPU_REASON is not None, reason=f"GPU-only: {GPU_REASON}"), id="gpu"),
    pytest.param("cpu", id="on_cpu")]


@pytest.fixture(scope="module", params=DEVICES)
def base(request, tmp_path_factory):
    """The whole pipeline (topology, embed, cluster, place, finetune) at 2 ranks."""
    device = request.param
    tmp = tmp_path_factory.mktemp(f"gpupipe_{device}")
    bert = make_model(tmp / "bert")
    corpus = write_corpus(tmp / "corpus.jsonl", 160)
    out = tmp / "base"
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.device={device}",
                            "--set", f"run.output_dir={out}", "--set", f"corpus.path={corpus}",
                            "--set", f"model.path={bert}", "--set", "cluster.k=3",
                            "--set", "train.params=head+last", "--set", "train.last_layers=1",
                            "--set", "train.steps=3", "--set", "checkpoint.every_steps=0",
                            *COMMON], timeout=300, env=ENV))
    return device, tmp, bert, out, proc


def test_pipeline_end_to_end(base):
    device, _, _, out, proc = base
    for name in ("topology.h5", "embeddings.h5", "clusters.h5", "shards.h5", "model.h5",
                 "metrics.csv"):
        assert (out / name).is_file(), name
    assert not list(out.glob("*.tmp"))
    with h5py.File(out / "embeddings.h5") as f:
        emb = f["embeddings"][...]
        assert emb.shape == (160, 32) and f.attrs["semzo_deck"].count(f'device = "{device}"')
    assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-4)
    with h5py.File(out / "clusters.h5") as f:
        assert f["labels"].shape == (160,) and int(f["counts"][...].sum()) == 160
    assert "none lost, none duplicated" in proc.stderr
    if device == "gpu":
        assert "bound to GPU 0" in proc.stderr


def _ft(base, out: Path, steps: int, *extra: str):
    device, _, bert, _, _ = base
    return check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml",
                            "--set", f"run.device={device}",
                            "--set", f"run.output_dir={out}", "--set", 'run.stages=["finetune"]',
                            "--set", f"model.path={bert}", "--set", "train.params=head+last",
                            "--set", "train.last_layers=1", "--set", f"train.steps={steps}",
                            "--set", "train.eval_every=0", "--set", "zo.mode=hybrid",
                            "--set", "zo.lr=1e-3", "--set", "checkpoint.every_steps=5",
                            *COMMON, *extra], timeout=240, env=ENV))


def _outdir(base, name: str) -> Path:
    d = base[1] / name
    d.mkdir()
    for f in ("shards.h5", "clusters.h5"):
        shutil.copy(base[3] / f, d / f)
    return d


def _rows(path: Path) -> dict:
    with open(path, newline="") as f:
        return {int(r["step"]): (r["loss"], r["g"]) for r in csv.DictReader(f)
                if r["kind"] == "train"}


def test_checkpoint_from_device_then_bit_exact_resume(base):
    ref = _outdir(base, "ref")
    _ft(base, ref, N)
    out = _outdir(base, "split")
    _ft(base, out, N // 2)
    first = _rows(out / "metrics.csv")
    proc = _ft(base, out, N, "--resume")
    assert f"resumed from ckpt-{N // 2:09d}.h5" in proc.stderr
    assert {**first, **_rows(out / "metrics.csv")} == _rows(ref / "metrics.csv")
    with h5py.File(out / "model.h5") as a, h5py.File(ref / "model.h5") as b:
        assert a.keys() == b.keys() and len(a.keys()) > 0
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k][()], b[k][()]), k
    with h5py.File(out / "checkpoints" / f"ckpt-{N:09d}.h5") as f:
        assert f.attrs["world_size"] == 2


# ----------------------------------------------------------------------------- prefix cache
def check_prefix_cache(xp, folder: Path) -> None:
    """The cached task (lower blocks' output kept in xp) equals the plain task on xp, and the
    NumPy plain task, up to rounding; also after the trained block changes."""
    tok = Tokenizer.from_folder(folder, max_length=24)
    from zo_common import corpus
    recs = corpus(40)
    seqs = tok.encode_batch([r["text"] for r in recs])
    labels = np.array([int(r["label"][-1]) for r in recs])
    train, held = np.arange(32), np.arange(32, 40)
    models = {}
    for name, mod in (("dev", xp), ("cpu", np)):
        m = load_model(folder, xp=mod)
        m.add_classifier(3, seed=0, normalize=True)
        models[name] = m
    names = select_trainable(models["dev"], "head+last", 1)
    select_trainable(models["cpu"], "head+last", 1)
    first = models["dev"].config.num_layers - 1
    cached = PrefixCachedClassifyTask(models["dev"], seqs, labels, train, held, tok.pad_id, 8,
                                      first)
    assert type(cached.cache).__module__.split(".")[0] == xp.__name__.split(".")[0]
    plain = ClassifyTask(models["dev"], seqs, labels, train, held, tok.pad_id, 8)
    ref = ClassifyTask(models["cpu"], seqs, labels, train, held, tok.pad_id, 8)
    pos = np.array([3, 17, 5, 30, 22, 9])
    for step in range(2):
        a = cached.loss(cached.batch(pos))
        assert a == pytest.approx(plain.loss(plain.batch(pos)), rel=1e-5)
        assert a == pytest.approx(ref.loss(ref.batch(pos)), rel=1e-4)
        assert np.allclose(host(cached.eval_sums()), host(ref.eval_sums()), rtol=1e-4)
        r = np.random.default_rng(step)
        for n in names:                        # the trained block moves, the cache stays valid
            d = (0.01 * r.standard_normal(models["cpu"].params[n].shape)).astype(np.float32)
            models["cpu"].params[n] += d
            models["dev"].params[n] += xp.asarray(d)


@pytest.mark.skipif(GPU_REASON is not None, reason=f"GPU-only: {GPU_REASON}")
def test_gpu_prefix_cache(tmp_path):
    check_prefix_cache(cupy_or_none(), make_model(tmp_path / "bert"))


def test_prefix_cache_harness_on_cpu(tmp_path):
    check_prefix_cache(np, make_model(tmp_path / "bert"))

