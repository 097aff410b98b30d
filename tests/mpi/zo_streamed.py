"""The block-streamed step (zo.schedule = "streamed") equals the three-pass step bit for bit
under MPI, in every mode and restore, with a skipped (NaN) step in the middle; replicas stay
identical; the simulated host offload gives the same bits.

usage: mpirun -n P python zo_streamed.py MODEL_FOLDER [MODES]

An encoder trains a classification head (ClassifyTask), a decoder (GPT-2 or CausalLM:
Llama, OPT, tied heads included) the next-token loss (LMTask). MODES: comma-separated modes
to run (default: all of data, perturbation, hybrid).
"""

from __future__ import annotations

import math
import sys

import numpy as np
from mpi4py import MPI
from zo_common import corpus
from zo_modes import check_identical

from semzo.deck import TopologySection
from semzo.model import Tokenizer, load_model
from semzo.runtime import run_spmd
from semzo.tasks.classify import ClassifyTask
from semzo.tasks.lm import LMTask
from semzo.topology import build_topology
from semzo.zo.engine import ZOEngine
from semzo.zo.offload import HostStore
from semzo.zo.perturb import ztensors
from semzo.zo.streamed import stage_groups, step_streamed

EPS, LR, WD, STEPS, B = 1e-3, 5e-2, 0.05, 3, 6


def run(folder, topo, mode, restore, schedule, offload, seqs, labels, pad_id):
    m = load_model(folder)
    if m.kind != "decoder":
        m.add_classifier(3, normalize=True, std=0.5)
    names = [n for n, _ in m.named_parameters()]
    rows = np.arange(len(seqs))
    cls = LMTask if m.kind == "decoder" else ClassifyTask
    task = cls(m, seqs, labels, rows, rows[:0], pad_id, 8)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), topo, mode=mode, eps=EPS,
                   weight_decay=WD, restore=restore, run_seed=5, schedule=schedule)
    if offload:
        eng.store = HostStore(m, task, eng)
    # step 1 is skipped on every rank (a NaN on rank 0): the undo path is deferred too
    eng.loss_hook = lambda s, x: math.nan if (s == 1 and topo.rank == 0) else x
    out = []
    for s in range(STEPS):
        lo = ((s * topo.size + topo.rank) * B) % (len(seqs) - B)
        batch = task.batch(np.arange(lo, lo + B))
        if schedule == "streamed":
            r = step_streamed(eng, task, batch, s, LR, B)
        else:
            r = eng.step(lambda b=batch: task.loss(b), s, LR, B)
        assert r.ok == (s != 1), (s, r.ok)
        out.append((r.lp, r.lm, r.g if r.ok else 0.0))
    eng.verify(STEPS)                       # flushes the pending update, collective
    assert eng.pending is None
    return out, [m.params[n].copy() for n in names], eng


def main() -> None:
    folder = sys.argv[1]
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(80)
    seqs = tok.encode_batch([r["text"] for r in recs])
    labels = np.array([int(r["label"][-1]) for r in recs])
    configs = [("data", 1, 0, "copy"), ("perturbation", 1, 0, "copy"),
               ("perturbation", 1, 0, "fused")]
    if P >= 2:
        configs += [("hybrid", 2, 0, "copy"), ("hybrid", 2, 0, "fused")]
    if len(sys.argv) > 2:
        modes = set(sys.argv[2].split(","))
        configs = [c for c in configs if c[0] in modes]
    for mode, rpn, nps, restore in configs:
        topo = build_topology(comm, TopologySection(ranks_per_node=rpn, nodes_per_switch=nps))
        ref, theta_ref, _ = run(folder, topo, mode, restore, "three-pass", False, seqs,
                                labels, tok.pad_id)
        for offload in (False, True):
            got, theta, eng = run(folder, topo, mode, restore, "streamed", offload, seqs,
                                  labels, tok.pad_id)
            what = f"{mode}/{restore} offload={offload}"
            assert np.array(got).tobytes() == np.array(ref).tobytes(), \
                f"{what}: losses differ {got} vs {ref}"
            for a, b in zip(theta, theta_ref):
                assert a.tobytes() == b.tobytes(), f"{what}: parameters differ"
            if not (restore == "fused" and eng.n_groups > 1):
                check_identical(comm, theta, what)
            if offload:
                groups = stage_groups(eng, eng.store.task)
                n = len(groups)
                tied = eng.store.task.tied_head and groups[0]   # tied: blocks go up twice
                per_step = 1 + 2 * (n - 1) if tied else n
                assert eng.store.uploads == STEPS * per_step, (eng.store.uploads, per_step)
            if comm.Get_rank() == 0:
                print(f"ok: streamed {what}", flush=True)
    if comm.Get_rank() == 0:
        print(f"ok: zo streamed on {P} ranks", flush=True)


if __name__ == "__main__":
    run_spmd(main)
