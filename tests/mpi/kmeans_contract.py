"""MPI contract script for semzo.cluster.kmeans: the same data split over this run's ranks
(unevenly; at 4 ranks one rank holds no rows) must give the answer of a 1-rank run.

usage: kmeans_contract.py OUT_DIR [flat|hier]
Rank 0 writes OUT_DIR/kmeans_<size>.npz with, per configuration, the init centres, centres,
labels in global order, inertia and n_iter. Every rank asserts that all ranks hold identical
centres. "hier" uses the lead's hierarchical allreduce (2 simulated ranks per node).
"""

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from semzo.cluster import kmeans
from semzo.runtime import run_spmd

N, D, K = 6000, 24, 16
CUTS = {1: [0, N], 2: [0, 2500, N], 3: [0, 1500, 4000, N], 4: [0, 1000, 1000, 3700, N]}
CONFIGS = {
    "lloyd": {"algorithm": "lloyd", "tol": 1e-4},
    "pruned": {"algorithm": "pruned", "tol": 0.0},
    "spherical": {"algorithm": "lloyd", "tol": 0.0, "spherical": True},
}


def data():
    rng = np.random.default_rng(42)
    c = rng.normal(size=(12, D)) * 2.5
    x = c[rng.integers(0, 12, N)] + rng.normal(size=(N, D)) * rng.uniform(0.5, 2.0, (N, 1))
    return x.astype(np.float32)


def main():
    out_dir = Path(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else "flat"
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    threadpool_limits(1)
    allreduce = None
    if mode == "hier":
        from semzo.deck import TopologySection
        from semzo.topology import build_topology
        topo = build_topology(comm, TopologySection(ranks_per_node=2))
        allreduce = topo.allreduce
    x = data()
    lo, hi = CUTS[size][rank], CUTS[size][rank + 1]
    out = {}
    for name, cfg in CONFIGS.items():
        xs = x.copy()
        if cfg.get("spherical"):
            xs /= np.linalg.norm(xs, axis=1, keepdims=True)
        xl = xs[lo:hi]
        init = kmeans(xl, K, comm, global_offset=lo, allreduce=allreduce, max_iter=1, seed=5,
                      spherical=cfg.get("spherical", False))
        # k-means|| with its own seed, then the configured run from the same init
        res = kmeans(xl, K, comm, global_offset=lo, allreduce=allreduce, seed=5, max_iter=60,
                     **cfg)
        assert res.labels.shape == (hi - lo,)
        for arr in (init.centers, res.centers):
            allc = np.empty((size,) + arr.shape, np.float32)
            comm.Allgather(arr, allc)
            assert all(np.array_equal(allc[0], a) for a in allc), "centres differ across ranks"
        counts = np.array(comm.allgather(hi - lo))
        labels = np.empty(N, np.int32) if rank == 0 else None
        comm.Gatherv(res.labels.astype(np.int32), [labels, counts] if rank == 0 else None, root=0)
        assert int(res.counts.sum()) == N
        out[f"{name}_init"] = init.centers
        out[f"{name}_centers"] = res.centers
        out[f"{name}_labels"] = labels if rank == 0 else np.zeros(0)
        out[f"{name}_scalars"] = np.array([res.inertia, res.n_iter], np.float64)
    if rank == 0:
        np.savez(out_dir / f"kmeans_{size}{'_hier' if mode == 'hier' else ''}.npz", **out)


if __name__ == "__main__":
    run_spmd(main)
