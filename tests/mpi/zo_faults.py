"""Failure paths of ZO training under MPI: a corrupted replica and NaN losses on one rank.

usage: mpirun -n P python zo_faults.py MODEL_FOLDER CASE
CASE: mismatch-caught (every rank catches ReplicaMismatch and says so), mismatch (uncaught:
every rank exits 1, no hang), nan (rank P-1 returns NaN losses from step 2 on: steps skipped on
every rank, then TooManySkips everywhere, exit 1).
"""

from __future__ import annotations

import math
import sys

import numpy as np
from mpi4py import MPI
from zo_common import corpus

from semzo.deck import TopologySection
from semzo.finetune.data import Batcher
from semzo.finetune.loop import LoopConfig, TrainState, train
from semzo.model import Tokenizer, load_model
from semzo.preflight import heldout_mask
from semzo.runtime import run_spmd
from semzo.tasks.classify import ClassifyTask
from semzo.topology import build_topology
from semzo.zo.engine import ReplicaMismatch, ZOEngine
from semzo.zo.perturb import ztensors


def main() -> None:
    folder, case = sys.argv[1], sys.argv[2]
    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    topo = build_topology(comm, TopologySection(ranks_per_node=1))
    m = load_model(folder)
    m.add_classifier(3, normalize=True, std=0.5)
    names = [n for n, _ in m.named_parameters()]
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(60, seed=rank)
    held = heldout_mask(np.arange(60), 0, 0.2)
    task = ClassifyTask(m, tok.encode_batch([r["text"] for r in recs]),
                        np.array([int(r["label"][-1]) for r in recs]), np.flatnonzero(~held),
                        np.flatnonzero(held), tok.pad_id, 16)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), topo, mode="data", eps=1e-3)
    batcher = Batcher(task.train_rows.size, 8, 0, rank)
    state = TrainState()
    if case.startswith("mismatch"):
        state = train(eng, task, batcher, state, LoopConfig(steps=2, lr=1e-2))
        if rank == P - 1:                      # one ulp in one element of one tensor
            w = m.params["classifier.weight"]
            w[1, 2] = np.nextafter(w[1, 2], np.float32(np.inf))
        if case == "mismatch-caught":
            try:
                eng.verify(state.step)
            except ReplicaMismatch as exc:
                assert f"rank(s) {P - 1}" in str(exc), str(exc)
                print(f"ok: rank {rank} detected the mismatch", flush=True)
                return
            raise AssertionError("no mismatch detected")
        eng.verify(state.step)
        raise AssertionError("unreachable: verify must raise")
    if case == "nan":
        if rank == P - 1:
            eng.loss_hook = lambda step, loss: math.nan if step >= 2 else loss
        train(eng, task, batcher, state, LoopConfig(steps=20, lr=1e-2, max_skips=3))
        raise AssertionError("unreachable: TooManySkips must be raised")
    raise SystemExit(f"unknown case {case}")


if __name__ == "__main__":
    run_spmd(main)
