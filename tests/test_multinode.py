"""semzo on two nodes for real: two network namespaces of this machine, each with its own host
name, the ranks talking over TCP only (tests/multinode.py). Every other multi-rank test runs on
one host through shared memory, with the nodes simulated by the deck; here Open MPI's
``MPI_COMM_TYPE_SHARED`` finds the nodes.

The LLM deck (inputs/llm.toml, shortened as in tests/test_llm_pipeline.py: a tiny random Llama,
160 records, 20 steps) at 2 nodes x 2 ranks must end bit for bit where the one-host run with
``topology.ranks_per_node = 2`` ends: embeddings, clusters, shards, metrics, the model and the
collective (MPI-IO, ``checkpoint.transfer = "collective"``) checkpoints. Then a rank of the
second node is SIGKILLed mid-training: mpirun must end promptly, non-zero, and ``--resume``
(which reads the checkpoint across the two nodes) must end with the same model again. Last, the
checkpoint MPI program of tests/test_checkpoint_mpi.py writes collectively across the nodes and
the one-host run reads it back, every value checked.

Needs root and iproute2 (skips with the reason otherwise). About 70 s on 2 cores, so `make test`
runs it too; `make test-multinode` runs this file alone, SEMZO_MULTINODE=0 skips it.
"""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpiutil import MPI_ENV, ROOT, check, mpirun
from multinode import Nodes, rank_pid, two_nodes, why_not

pytestmark = [
    pytest.mark.multinode,
    pytest.mark.skipif(os.environ.get("SEMZO_MULTINODE") == "0",
                       reason="SEMZO_MULTINODE=0: two-node test switched off"),
]

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
STEPS = 20
KILL_AFTER = 13            # rank 2 (node 2) is SIGKILLed after this step; checkpoint at 10
MPIDIR = Path(__file__).parent / "mpi"


def _deck(out: Path, corpus: Path, model: Path, ranks_per_node: int, *extra: str) -> list[str]:
    """inputs/llm.toml shortened as tests/test_llm_pipeline.py does, one thread per rank,
    collective checkpoint writes every 10 steps, one switch."""
    return ["-m", "semzo", "run", "inputs/llm.toml",
            "--set", f"run.output_dir={out}", "--set", f"corpus.path={corpus}",
            "--set", f"model.path={model}", "--set", "cluster.k=3",
            "--set", 'corpus.labels=["neg", "pos"]',
            "--set", 'prompt.template="{text} It was"',
            "--set", 'prompt.label_words=[" bad", " good"]',
            "--set", "train.lora_layers=1", "--set", f"train.steps={STEPS}",
            "--set", "train.eval_every=10", "--set", "train.log_every=1",
            "--set", "zo.lr=1e-2", "--set", "train.batch_size=8",
            "--set", "model.max_length=24", "--set", "run.threads=1",
            "--set", "checkpoint.every_steps=10", "--set", "checkpoint.transfer=collective",
            "--set", f"topology.ranks_per_node={ranks_per_node}",
            "--set", "topology.nodes_per_switch=0", *extra]


def _launch(nodes: Nodes, args: list[str], *, timeout: float = 400,
            env: dict | None = None) -> subprocess.CompletedProcess:
    """``python args`` at 2 ranks on each of the two nodes."""
    full = {**os.environ, **MPI_ENV, **ENV, **nodes.env, **(env or {})}
    return subprocess.run(nodes.mpirun(2, args, timeout=timeout), capture_output=True,
                          text=True, env=full, check=False, cwd=ROOT, timeout=timeout + 15)


@pytest.fixture(scope="module")
def nodes():
    reason = why_not()
    if reason:
        pytest.skip(f"no two-node test on this machine: {reason}")
    with two_nodes() as n:
        yield n


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from llmutil import tiny_llama
    from test_llm_pipeline import _corpus

    tmp = tmp_path_factory.mktemp("multinode")
    return tmp, tiny_llama(tmp / "llama"), _corpus(tmp / "c.jsonl", 160)


@pytest.fixture(scope="module")
def one_host(inputs):
    """The reference: 4 ranks on this host, 2 simulated nodes of 2 ranks, shared memory."""
    tmp, model, corpus = inputs
    out = tmp / "one-host"
    t0 = time.monotonic()
    proc = check(mpirun(4, _deck(out, corpus, model, 2), timeout=400, env=ENV))
    print(f"\nmultinode: one-host 4-rank pipeline {time.monotonic() - t0:.1f} s")
    return out, proc


@pytest.fixture(scope="module")
def two_node(nodes, inputs):
    tmp, model, corpus = inputs
    out = tmp / "two-node"
    t0 = time.monotonic()
    proc = check(_launch(nodes, _deck(out, corpus, model, 0)))
    print(f"\nmultinode: two-node 2x2-rank pipeline {time.monotonic() - t0:.1f} s")
    return out, proc


def _datasets(path: Path) -> dict[str, np.ndarray]:
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def _same_datasets(a: Path, b: Path, names: tuple[str, ...] = ()) -> None:
    da, db = _datasets(a), _datasets(b)
    if names:
        da = {k: da[k] for k in names}
        db = {k: db[k] for k in names}
    assert da.keys() == db.keys() and da, (a.name, sorted(da), sorted(db))
    for k in da:
        assert da[k].dtype == db[k].dtype and da[k].shape == db[k].shape, (a.name, k)
        assert da[k].tobytes() == db[k].tobytes(), (a.name, k)


def _rows(path: Path) -> list[tuple]:
    """metrics.csv without the timing and energy columns."""
    with open(path, newline="") as f:
        return [tuple(v for k, v in r.items()
                      if k not in ("compute_s", "comm_s", "elapsed_s", "samples_per_s", "tokens_per_s",
                                   "energy_j", "cpu_energy_j", "gpu_energy_j", "core_s"))
                for r in csv.DictReader(f)]


def _same_checkpoint(a: Path, b: Path) -> str:
    proc = subprocess.run([sys.executable, str(MPIDIR / "ckpt_same.py"), str(a), str(b)],
                          capture_output=True, text=True, timeout=120, check=False,
                          env={**os.environ, **MPI_ENV, **ENV}, cwd=ROOT)
    assert proc.returncode == 0, (a, b, proc.stdout, proc.stderr[-3000:])
    return proc.stdout.strip()


def _same_result(out: Path, ref: Path) -> None:
    """model.h5 (every trainable tensor and the held-out accuracies) and metrics.csv."""
    _same_datasets(out / "model.h5", ref / "model.h5")
    with h5py.File(out / "model.h5") as f, h5py.File(ref / "model.h5") as g:
        for k in ("heldout_acc_before", "heldout_acc", "steps"):
            if k in g.attrs:
                assert f.attrs[k] == g.attrs[k], k
    assert _rows(out / "metrics.csv") == _rows(ref / "metrics.csv")


def test_mpi_finds_two_nodes_of_two_ranks(one_host, two_node):
    assert "topology: 4 ranks, 2 nodes (shared-memory), 1 switches (single)" \
        in two_node[1].stderr, two_node[1].stderr[-3000:]
    assert "topology: 4 ranks, 2 nodes (deck)" in one_host[1].stderr
    table = [ln.split() for ln in two_node[1].stderr.splitlines()
             if ln.split()[:1] in (["0"], ["1"], ["2"], ["3"]) and len(ln.split()) >= 4]
    hosts = {int(r[0]): r[3] for r in table[:4]}
    assert hosts == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}, table


def test_two_nodes_bit_identical_to_one_host(one_host, two_node):
    ref, out = one_host[0], two_node[0]
    _same_datasets(out / "embeddings.h5", ref / "embeddings.h5", ("embeddings", "ids"))
    _same_datasets(out / "clusters.h5", ref / "clusters.h5", ("centers", "labels"))
    _same_datasets(out / "shards.h5", ref / "shards.h5", ("ids", "clusters", "quota"))
    _same_result(out, ref)
    for step in (10, STEPS):            # written with collective MPI-IO over TCP
        name = f"ckpt-{step:09d}.h5"
        said = _same_checkpoint(out / "checkpoints" / name, ref / "checkpoints" / name)
        print(f"\nmultinode: {name} two-node vs one-host: {said}")


def _watch_death(pid_of, marker: str, seen: dict) -> None:
    """Record when rank 2 of the launch ``marker`` appears and when it is gone (or a
    zombie), polling /proc every 10 ms."""
    deadline = time.monotonic() + 300
    pid = None
    while pid is None and time.monotonic() < deadline:
        pid = pid_of(2, marker)
        time.sleep(0.01)
    seen["pid"] = pid
    while pid is not None and time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            state = "gone"
        if state in ("Z", "X", "gone"):
            seen["dead"] = time.monotonic()
            return
        time.sleep(0.01)


def test_killed_rank_on_second_node_then_resume(nodes, inputs, one_host, two_node):
    tmp, model, corpus = inputs
    out = tmp / "killed"
    out.mkdir()
    for f in ("shards.h5", "clusters.h5"):
        shutil.copy(two_node[0] / f, out / f)
    stage = ["--set", 'run.stages=["finetune"]']
    marker = uuid.uuid4().hex
    seen: dict = {}
    watch = threading.Thread(target=_watch_death, args=(rank_pid, marker, seen), daemon=True)
    watch.start()
    full = {**os.environ, **MPI_ENV, **ENV, **nodes.env,
            "SEMZO_TEST_KILL": f"2:{KILL_AFTER}", "SEMZO_MULTINODE_RUN": marker}
    proc = subprocess.Popen(nodes.mpirun(2, _deck(out, corpus, model, 0, *stage), timeout=300),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=full, cwd=ROOT)
    stdout, stderr = proc.communicate(timeout=320)
    ended = time.monotonic()
    watch.join(timeout=10)
    assert seen.get("pid"), "rank 2 never appeared in /proc"
    assert "dead" in seen, (proc.returncode, stderr[-3000:])
    took = ended - seen["dead"]
    print(f"\nmultinode: rank 2 (node2) SIGKILLed after step {KILL_AFTER}: mpirun exit "
          f"{proc.returncode} {took:.2f} s after the rank died")
    assert proc.returncode != 0 and took < 20, (proc.returncode, took, stderr[-3000:])
    assert "signal 9" in stdout + stderr
    assert not (out / "model.h5").exists()
    assert (out / "checkpoints" / "ckpt-000000010.h5").is_file()
    assert not (out / "checkpoints" / f"ckpt-{STEPS:09d}.h5").exists()
    t0 = time.monotonic()
    again = check(_launch(nodes, _deck(out, corpus, model, 0, *stage, "--resume")))
    print(f"multinode: --resume across the two nodes {time.monotonic() - t0:.1f} s")
    assert "resumed from ckpt-000000010.h5 (step 10, same world size 4)" in again.stderr
    _same_datasets(out / "model.h5", one_host[0] / "model.h5")
    with h5py.File(out / "model.h5") as f:
        assert f.attrs["steps"] == STEPS
    name = f"ckpt-{STEPS:09d}.h5"
    said = _same_checkpoint(out / "checkpoints" / name, one_host[0] / "checkpoints" / name)
    print(f"multinode: resumed {name} vs one-host uninterrupted: {said}")


def test_collective_checkpoint_written_across_nodes_reads_on_one_host(nodes, tmp_path):
    """tests/mpi/ckpt_roundtrip.py: 3 checkpoints written with collective buffering by 2 x 2
    ranks over TCP; read back exactly by 4 ranks on one host, and by 2 with the cursor rule;
    the same program on one host writes a checkpoint of the same contents."""
    rt = str(MPIDIR / "ckpt_roundtrip.py")
    two, one = tmp_path / "two", tmp_path / "one"
    out = check(_launch(nodes, [rt, "write", str(two), "3", "collective"], timeout=120))
    assert "ok: wrote 3 checkpoints on 4 ranks, collective" in out.stdout
    out = check(mpirun(4, [rt, "read", str(two), "3", "4"], timeout=90))
    assert "ok: read step 3 saved at 4 ranks on 4 ranks" in out.stdout
    out = check(mpirun(2, [rt, "read", str(two), "2", "4"], timeout=90))
    assert "ok: read step 2 saved at 4 ranks on 2 ranks" in out.stdout
    check(mpirun(4, [rt, "write", str(one), "3", "collective"], timeout=90))
    name = "ckpt-000000003.h5"
    said = _same_checkpoint(two / name, one / name)
    print(f"\nmultinode: ckpt_roundtrip {name} two-node vs one-host: {said}")
    out = check(_launch(nodes, [rt, "read", str(one), "3", "4"], timeout=120))
    assert "ok: read step 3 saved at 4 ranks on 4 ranks" in out.stdout
