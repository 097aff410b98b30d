"""Heterogeneous ranks: ZO step time with equal weights against measured weights, one rank
slowed by the test hook.

    SEMZO_SLOW_RANKS=1:2.0 timeout 900 mpirun -n 4 .venv/bin/python bench/rank_weights.py \
        [--model minilm|smollm2] [--batch 8] [--length 64] [--steps 12] [--rounds 2]

Every rank fine-tunes the same model (all-MiniLM-L6-v2 with a 16-class head and its last block
trainable, or SmolLM2-135M with LoRA rank 8 on the ``lm`` loss; data mode) on its
own rows of the fortunes corpus; the global batch is ``--batch`` x ranks. ``SEMZO_SLOW_RANKS``
(docs/placement.md) makes the chosen ranks sleep after each forward pass so it takes that
factor longer: a slower device. Three configurations, timed in alternation for ``--rounds``
rounds (median step time over ``--steps`` steps after two warm-up steps, per round; the best
round counts):

* ``equal``: every rank ``--batch`` rows (place.rank_weights = "equal");
* ``measured``: the weights :func:`semzo.place.weights.measure_rank_weights` agrees on (the
  kernel, with the hook), batches apportioned from the same global batch;
* ``ideal``: the weights 1 / factor (what the hook simulates), for reference.

Printed: the weights, the batches, the step times and their ratio to ``equal``, with the load
average. The step waits for the slowest rank (the exchange is a collective), so with equal
batches the slowed rank sets the pace; with weights in proportion to speed the ranks finish
their forward passes together. Only the forward passes scale with the batch: the parameter
passes of a step (perturb, update) do not, which is why only the last block trains here (with
every MiniLM tensor trainable they dominate the step and weights gain little). On a machine with fewer cores than ranks the ranks also share
cores (a sleeping rank frees its core for the others): say so when reporting.
"""

from __future__ import annotations  # noqa: I001 (semzo is imported before numpy)

import argparse
import json
import os
import time
from pathlib import Path

import semzo  # noqa: F401  (before numpy: the thread-pool defaults)
import numpy as np
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]


def setup(args, comm):
    from semzo.backend import set_threads
    from semzo.deck import TopologySection
    from semzo.finetune.trainable import select_trainable
    from semzo.model import Tokenizer, load_model
    from semzo.tasks.classify import ClassifyTask
    from semzo.tasks.lm import LMTask
    from semzo.topology import build_topology
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors

    set_threads(1)                     # one thread per rank: ranks are the parallelism here
    rank, size = comm.Get_rank(), comm.Get_size()
    topo = build_topology(comm, TopologySection(ranks_per_node=1, nodes_per_switch=1))
    n = 64 * args.batch * size
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(n))]
    path = None if args.model == "minilm" else "smollm2"
    m = load_model(path)
    tok = Tokenizer.from_folder(path, max_length=args.length)
    seqs = tok.encode_batch(texts)
    rows = np.arange(rank, len(texts), size)          # this rank's rows
    none = np.zeros(0, np.int64)
    if args.model == "minilm":
        m.add_classifier(16, normalize=True)
        names = select_trainable(m, "head+last", 1)
        task = ClassifyTask(m, seqs, np.arange(len(texts)) % 16, rows, none, tok.pad_id, 64)
    else:
        names = select_trainable(m, "lora", 0, 8, 16.0, 0)
        task = LMTask(m, seqs, np.full(len(texts), -1), rows, none, tok.pad_id, 64)
    eng = ZOEngine(ztensors([(k, m.params[k]) for k in names]), topo, mode="data", eps=1e-3,
                   run_seed=0)
    return task, eng, rows.size


def time_steps(task, eng, n_rows, batch, args, comm) -> float:
    """Median seconds of a step over ``args.steps`` steps after two warm-up steps (the loop's
    train(), which applies the slow hook)."""
    from semzo.finetune.data import Batcher
    from semzo.finetune.loop import LoopConfig, TrainState, train

    rank = comm.Get_rank()
    times: list[float] = []
    last = [0.0]

    def on_row(row):
        if row["kind"] == "train":
            now = time.perf_counter()
            times.append(now - last[0])
            last[0] = now

    batcher = Batcher(n_rows, batch, 0, rank)
    cfg = LoopConfig(steps=args.steps + 2, lr=1e-7, log_every=10**9, checksum_every=10**9)
    comm.Barrier()
    last[0] = time.perf_counter()
    train(eng, task, batcher, TrainState(run_seed=0), cfg, on_row=on_row)
    med = float(np.median(times[2:]))
    return comm.allreduce(med, op=MPI.MAX)


def main() -> int:
    from semzo.place.weights import batch_shares, measure_rank_weights, slow_factors

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=("minilm", "smollm2"), default="minilm")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    task, eng, n_rows = setup(args, comm)
    measured = measure_rank_weights(comm)
    slow = slow_factors()
    ideal = np.array([1.0 / slow.get(r, 1.0) for r in range(size)])
    configs = {"equal": None, "measured": measured, "ideal": ideal}
    shares = {k: batch_shares(args.batch, w, size) for k, w in configs.items()}
    best = {k: np.inf for k in configs}
    for _ in range(args.rounds):
        for k in configs:
            best[k] = min(best[k], time_steps(task, eng, n_rows, int(shares[k][rank]), args,
                                              comm))
    if rank == 0:
        load = os.getloadavg()
        print(f"{size} ranks, {args.model}, global batch {args.batch * size}, length "
              f"{args.length}, {os.environ.get('SEMZO_SLOW_RANKS', '')!r} slowed; load average "
              f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"measured weights: {' '.join(f'{x:.3f}' for x in measured)}")
        for k in configs:
            print(f"{k:9s} batches {' '.join(f'{b:3d}' for b in shares[k])}  step "
                  f"{1e3 * best[k]:8.1f} ms  ratio to equal {best[k] / best['equal']:.3f}")
    return 0


if __name__ == "__main__":
    from semzo.runtime import run_spmd

    run_spmd(main)
