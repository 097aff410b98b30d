"""The ZO engine on the GPU under MPI (ranks share the GPU): in each mode (data, perturbation,
hybrid) the replicas are bit-identical on every rank, and equal, to rounding, to the same
steps on NumPy. Also the staged collectives on CuPy buffers against NumPy ones, and, with
SEMZO_CUDA_AWARE_MPI=1, device pointers handed to MPI directly.

usage: mpirun -n P python zo_gpu_modes.py MODEL_FOLDER [cupy|numpy]
(``numpy`` on both sides is the CPU proof of this script: tests/test_gpu_zo.py runs it too.)
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI
from zo_common import corpus
from zo_modes import batches, check_identical

from semzo.deck import TopologySection
from semzo.model import Tokenizer, load_model
from semzo.runtime import run_spmd
from semzo.topology import build_topology
from semzo.zo.engine import ZOEngine
from semzo.zo.perturb import ztensors

EPS, LR, WD, STEPS, B = 1e-3, 5e-2, 0.05, 3, 8


def train(folder, xp, tok, recs, topo, mode, rank, size):
    m = load_model(folder, xp=xp)
    m.add_classifier(3, normalize=True, std=0.5)
    names = [n for n, _ in m.named_parameters()]
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), topo, mode=mode, eps=EPS,
                   weight_decay=WD, run_seed=11)
    losses = []
    for s in range(STEPS):
        ids, mask, lab = batches(tok, recs, rank, s, size)
        res = eng.step(lambda ids=ids, mask=mask, lab=lab: m.classify(ids, mask, lab)[0], s,
                       LR, B)
        assert res.ok and np.isfinite(res.loss), (mode, s)
        losses.append(res.loss)
    eng.verify(STEPS)                     # collective checksum, computed on the device
    host = [m.params[n].get() if hasattr(m.params[n], "get") else m.params[n] for n in names]
    return host, losses


def collectives(topo, xp, rank, size):
    """allreduce / allgather / bcast of xp buffers equal the numpy results."""
    from semzo.topology.collectives import allgather, allreduce, bcast
    a = np.arange(12, dtype=np.float64).reshape(3, 4) * (rank + 1)
    d = xp.asarray(a)
    out = allreduce(topo, d)
    assert type(out) is type(d)
    ref = np.arange(12, dtype=np.float64).reshape(3, 4) * (size * (size + 1) / 2)
    assert np.array_equal(out.get() if hasattr(out, "get") else out, ref)
    g = allgather(topo, xp.asarray(np.full(5, rank, np.int64)))
    g = g.get() if hasattr(g, "get") else g
    assert np.array_equal(g, np.repeat(np.arange(size), 5).reshape(size, 5))
    b = xp.asarray(np.full(7, rank, np.float32))
    b = bcast(topo, b, root=size - 1)
    b = b.get() if hasattr(b, "get") else b
    assert np.array_equal(b, np.full(7, size - 1, np.float32))


def main() -> None:
    folder = sys.argv[1]
    which = sys.argv[2] if len(sys.argv) > 2 else "cupy"
    if which == "cupy":
        import cupy as xp

        from semzo.backend import bind_gpu
        bind_gpu(0)                       # every rank on GPU 0: ranks share the GPU
    else:
        xp = np
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    tok = Tokenizer.from_folder(folder, max_length=24)
    recs = corpus(200)
    topo = build_topology(comm, TopologySection(ranks_per_node=1, nodes_per_switch=0))
    collectives(topo, xp, rank, size)
    if rank == 0:
        print(f"ok: collectives on {which} ({'cuda-aware' if _aware() else 'staged'})",
              flush=True)
    for mode in ("data", "perturbation", "hybrid"):
        got, lg = train(folder, xp, tok, recs, topo, mode, rank, size)
        check_identical(comm, got, f"{mode} on {which}")
        ref, lr_ = train(folder, np, tok, recs, topo, mode, rank, size)
        # float32 loss rounding / (2 eps) * lr moves an update by up to about 1e-5
        for a, b in zip(got, ref):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)
        np.testing.assert_allclose(lg, lr_, rtol=1e-4, atol=1e-5)
        if rank == 0:
            print(f"ok: {mode} on {which}, {size} ranks", flush=True)
    topo.free()
    if rank == 0:
        print(f"ok: zo gpu modes on {size} ranks", flush=True)


def _aware() -> bool:
    from semzo.backend import cuda_aware_mpi
    return cuda_aware_mpi()


if __name__ == "__main__":
    run_spmd(main)
