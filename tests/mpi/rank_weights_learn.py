"""A weighted run learns (``place.rank_weights``), at the loop level.

usage: mpirun -n P python rank_weights_learn.py MODEL_FOLDER WEIGHTS MODE
    WEIGHTS: "equal" or comma-separated numbers (one per rank). Rank r holds a contiguous
    share of the training rows apportioned by the weights and trains on batches of its share
    of the global batch (8 x P), as the place and finetune stages arrange it; 300 ZO steps of
    head + last block (lr 0.05, mode MODE), replicas compared every 50 steps (the loop raises
    ReplicaMismatch otherwise) and at the end. Prints the held-out loss before and after.
"""

from __future__ import annotations

import hashlib
import sys

import numpy as np
from mpi4py import MPI
from zo_common import corpus

from semzo.deck import TopologySection
from semzo.finetune.data import Batcher
from semzo.finetune.loop import LoopConfig, TrainState, evaluate, train
from semzo.finetune.trainable import select_trainable
from semzo.model import Tokenizer, load_model
from semzo.place.weights import apportion, batch_shares
from semzo.preflight import heldout_mask
from semzo.runtime import run_spmd
from semzo.tasks.classify import ClassifyTask
from semzo.topology import build_topology
from semzo.zo.engine import ZOEngine
from semzo.zo.perturb import ztensors

STEPS, LR, BATCH, SEED = 300, 0.05, 8, 0


def main():
    folder, spec, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    w = None if spec == "equal" else [float(x) for x in spec.split(",")]
    topo = build_topology(comm, TopologySection(ranks_per_node=1, nodes_per_switch=1))
    recs = corpus(400, 1)
    m = load_model(folder)
    m.add_classifier(3, normalize=True, std=0.5)
    names = select_trainable(m, "head+last", last_layers=1)
    tok = Tokenizer.from_folder(folder, max_length=24)
    seqs = tok.encode_batch([r["text"] for r in recs])
    labels = np.array([int(r["label"][-1]) for r in recs])
    held = heldout_mask(np.arange(len(recs)), 0, 0.3)
    train_all = np.flatnonzero(~held)
    ends = np.concatenate(([0], np.cumsum(apportion(train_all.size,
                                                    w if w is not None else [1.0] * size))))
    mine = train_all[ends[rank]:ends[rank + 1]]
    task = ClassifyTask(m, seqs, labels, mine, np.flatnonzero(held)[rank::size], tok.pad_id, 64)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), topo, mode=mode, eps=1e-3,
                   run_seed=SEED)
    shares = batch_shares(BATCH, w, size)
    batcher = Batcher(mine.size, int(shares[rank]), SEED, rank)
    before = evaluate(task, topo)
    train(eng, task, batcher, TrainState(run_seed=SEED),
          LoopConfig(steps=STEPS, lr=LR, log_every=10**9, checksum_every=50))
    after = evaluate(task, topo)
    h = hashlib.sha256(b"".join(np.ascontiguousarray(m.params[n]).tobytes() for n in names))
    digests = comm.allgather(h.hexdigest())
    assert digests == [digests[0]] * size, "replicas differ"
    if rank == 0:
        print(f"held-out loss {before[0]:.4f} -> {after[0]:.4f}, batches "
              f"{' '.join(map(str, shares.tolist()))}, {size} ranks, mode {mode}", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
