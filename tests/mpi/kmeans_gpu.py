"""GPU k-means under MPI (ranks share the GPU): the labels of each rank's rows and the
centres equal those of the CPU path at the same rank count, for given initial centres and
for k-means|| (the same partition).

usage: mpirun -n P python kmeans_gpu.py [cupy|numpy] [empty]

``empty``: the last rank holds no rows (shape (0, d)), which kmeans.py allows: on the GPU that
rank's counts must not go through ``cp.bincount`` of an empty array (cupy issue 8116).
"""

from __future__ import annotations

import sys

import numpy as np
from mpi4py import MPI

from semzo.backend import gpu_fused_enabled
from semzo.cluster.kmeans import kmeans
from semzo.runtime import run_spmd


def planted(n=3000, d=16, k=6, seed=0):
    r = np.random.default_rng(seed)
    centres = r.normal(0, 10, (k, d))
    lab = r.integers(0, k, n)
    return (centres[lab] + r.normal(0, 0.5, (n, d))).astype(np.float32), lab


def same_partition(a, b) -> bool:
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "cupy"
    if which == "cupy":
        import cupy as xp
        xp.cuda.Device(0).use()
    else:
        xp = np
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    empty = len(sys.argv) > 2 and sys.argv[2] == "empty" and size > 1
    x, truth = planted()
    parts = size - 1 if empty else size          # ranks that hold rows
    r = min(rank, parts)
    lo, hi = len(x) * r // parts, len(x) * min(r + 1, parts) // parts
    init = x[[int(np.flatnonzero(truth == c)[0]) for c in range(6)]].copy()
    cpu = kmeans(x[lo:hi], 6, comm, global_offset=lo, init=init, max_iter=30, tol=0.0)
    dev = kmeans(xp.asarray(x[lo:hi]), 6, comm, global_offset=lo, init=init, max_iter=30,
                 tol=0.0)
    lab = dev.labels.get() if hasattr(dev.labels, "get") else np.asarray(dev.labels)
    assert lab.dtype == np.int32 and lab.shape == (hi - lo,)
    assert np.array_equal(lab, cpu.labels), "labels differ from the CPU path"
    np.testing.assert_allclose(dev.centers, cpu.centers, rtol=1e-5, atol=1e-5)
    if gpu_fused_enabled():   # the same labels at every iteration: the sums in row order
        assert np.array_equal(dev.centers, cpu.centers), "centres differ from the CPU's bits"
    assert np.array_equal(dev.counts, cpu.counts) and dev.n_iter == cpu.n_iter
    assert abs(dev.inertia - cpu.inertia) <= 1e-6 * abs(cpu.inertia)
    assert same_partition(lab, truth[lo:hi])
    par = kmeans(xp.asarray(x[lo:hi]), 6, comm, global_offset=lo, seed=3, max_iter=50)
    plab = par.labels.get() if hasattr(par.labels, "get") else np.asarray(par.labels)
    assert same_partition(plab, truth[lo:hi]), "k-means|| on the device missed the planted split"
    if rank == 0:
        print(f"ok: kmeans on {which}, {size} ranks"
              f"{' (the last without rows)' if empty else ''}", flush=True)


if __name__ == "__main__":
    run_spmd(main)
