"""The fzoo estimator under MPI: replicas identical bit for bit on every rank in every mode,
and equal to a serial reference (the N directions spread over the seed groups, each
group's losses on its ranks' batches, one N-direction update).

usage: mpirun -n P python zo_fzoo.py MODEL_FOLDER
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI
from zo_common import corpus
from zo_modes import B, batches, check_identical, setup

from semzo.deck import TopologySection
from semzo.model import Tokenizer
from semzo.runtime import run_spmd
from semzo.topology import build_topology
from semzo.zo.engine import SIGMA_TINY, ZOEngine, step_seed
from semzo.zo.perturb import multi_update, perturb, ztensors

EPS, LR, WD, STEPS, N = 1e-3, 1e-4, 0.05, 3, 4


def reference(folder, tok, recs, groups_of_rank, size, m_per, copy):
    """Serial reference of STEPS fzoo steps (z Rademacher). ``copy``: the update goes to the
    step's starting parameters (``restore = "copy"``); else (one group) to the last
    perturbed state, fused with its restore, as the engine does."""
    m, names = setup(folder)
    zs = ztensors([(n, m.params[n]) for n in names])
    n_groups = max(groups_of_rank) + 1
    z_d = "rademacher"
    for s in range(STEPS):
        theta = [z.array.copy() for z in zs]
        seeds, ds, ns = [], [], []
        for k in range(n_groups):
            sk = [step_seed(11, s, k * m_per + i) for i in range(m_per)]
            acc, n = np.zeros(m_per + 1), 0.0
            for r in (r for r in range(size) if groups_of_rank[r] == k):
                for z, t in zip(zs, theta):
                    np.copyto(z.array, t)
                ids, mask, lab = batches(tok, recs, r, s, size)
                vals = [m.classify(ids, mask, lab)[0]]
                for i, x in enumerate(sk):
                    perturb(zs, x, EPS, dist=z_d)
                    vals.append(m.classify(ids, mask, lab)[0])
                    if i + 1 < len(sk):
                        perturb(zs, x, -EPS, dist=z_d)
                acc += np.array(vals) * B
                n += B
            mean = acc / n
            seeds += sk
            ds += list(mean[1:] - mean[0])
            ns += [n] * m_per
        d, ns = np.array(ds), np.array(ns)
        w = d / EPS * (ns / ns.sum()) / (np.std(d) + SIGMA_TINY)
        if copy:
            for z, t in zip(zs, theta):
                np.copyto(z.array, t)
            multi_update(zs, seeds, w, LR, WD, dist=z_d)
        else:
            multi_update(zs, seeds, w, LR, WD, eps=-EPS, restore_seed=seeds[-1], dist=z_d)
    return [z.array for z in zs]


def main() -> None:
    import sys
    folder = sys.argv[1]
    comm = MPI.COMM_WORLD
    P, rank = comm.Get_size(), comm.Get_rank()
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(200)
    configs = [("data", 1, "copy"), ("perturbation", 1, "copy"), ("perturbation", 1, "fused")]
    if P > 1:
        configs += [("hybrid", 2 if P == 4 else 1, "copy")]
    for mode, rpn, restore in configs:
        topo = build_topology(comm, TopologySection(ranks_per_node=rpn))
        m, names = setup(folder)
        eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), topo, mode=mode, eps=EPS,
                       weight_decay=WD, restore=restore, run_seed=11, estimator="fzoo",
                       directions=N, dist="rademacher")
        for s in range(STEPS):
            ids, mask, lab = batches(tok, recs, rank, s, P)
            res = eng.step(lambda m=m, ids=ids, mask=mask, lab=lab: m.classify(ids, mask, lab)[0],
                           s, LR, B)
            assert res.ok and np.isfinite(res.sigma) and np.isfinite(res.loss)
            assert len(res.seeds) == eng.n_directions >= N
            assert res.forwards == 1 + eng.dirs_per_group
        what = f"{mode}/{restore} rpn={rpn} ({eng.n_groups} groups, {eng.n_directions} dirs)"
        eng.verify(STEPS)
        mine = [m.params[n] for n in names]
        check_identical(comm, mine, what)
        groups = {"data": [0] * P, "perturbation": list(range(P)),
                  "hybrid": [int(x) for x in topo.rank_node]}[mode]
        ref = reference(folder, tok, recs, groups, P, eng.dirs_per_group, eng.copy)
        if eng.copy or (eng.n_groups == 1 and P <= 2):      # the same operations: bit for bit
            for a, b in zip(mine, ref):
                assert a.tobytes() == b.tobytes(), what
        else:
            # data mode at 4 ranks (the allreduce's order of summation) and fused restores:
            # rounding, amplified by the division by the spread of the loss differences
            for a, b in zip(mine, ref):
                np.testing.assert_allclose(a, b, rtol=1e-3, atol=2e-4)
        if rank == 0:
            print(f"ok: fzoo {what}", flush=True)
    if rank == 0:
        print(f"ok: fzoo on {P} ranks", flush=True)


if __name__ == "__main__":
    run_spmd(main)
