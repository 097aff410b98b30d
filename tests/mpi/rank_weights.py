"""Heterogeneous ranks under MPI (``place.rank_weights``).

usage: rank_weights.py
    Run with SEMZO_SLOW_RANKS="1:10.0" (rank 1 ten times slower). Every rank checks: the
    measured weights are the same on every rank, mean 1, and rank 1's is the smallest (below
    half of every other one: on a loaded machine whose ranks share cores, the measured
    throughputs of equal ranks were seen to differ up to 4x); shuffle destinations with
    weights, computed across the ranks, equal the serial map (MPI.COMM_SELF) and give every rank exactly its apportioned count;
    random placement with weights meets the apportioned counts exactly and semantic placement
    within balance_tol, with the same quota on every rank.
"""

import zlib

import numpy as np
from mpi4py import MPI

from semzo.place import place, shuffle_destinations
from semzo.place.weights import apportion, measure_rank_weights
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    w = measure_rank_weights(comm, n=128, window_s=0.2, windows=5)
    assert comm.allgather(w.tobytes()) == [w.tobytes()] * size, "weights differ between ranks"
    assert w.shape == (size,) and abs(w.sum() - size) < 1e-9 and (w > 0).all(), w
    if size > 1:
        others = np.delete(w, 1)
        assert w[1] < 0.5 * others.min(), f"the slowed rank 1 is not the slowest: {w}"

    # shuffle with weights: distributed == serial, exact apportioned counts
    n = 4001
    ids_all = np.random.default_rng(5).permutation(n).astype(np.int64)
    mine = ids_all[rank::size]
    for gather_limit in (0, 1 << 16):
        dest = shuffle_destinations(mine, size, 3, comm, weights=w, gather_limit=gather_limit)
        serial = shuffle_destinations(ids_all, size, 3, MPI.COMM_SELF, weights=w)[rank::size]
        assert np.array_equal(dest, serial), "distributed shuffle map differs from the serial"
        counts = np.bincount(dest, minlength=size)
        comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)
        assert np.array_equal(counts, apportion(n, w)), (counts, w)

    # random / semantic placement with weights
    k, d = 20, 4
    rng = np.random.default_rng(9)
    where = rng.integers(20, 300, size=(size, k)).astype(np.int64)   # same on every rank
    cent = rng.normal(size=(k, d))
    rank_node = np.arange(size) // 2
    node_switch = np.zeros(rank_node.max() + 1, np.int64)
    total = int(where.sum())
    for mode in ("random", "semantic"):
        plan = place(cent, where, rank_node, node_switch, mode=mode, comm=comm,
                     rank_weights=w, figures=False)
        sig = zlib.crc32(plan.quota.tobytes())
        assert comm.allgather(sig) == [sig] * size, "plans differ between ranks"
        loads = plan.quota.sum(0)
        assert loads.sum() == total
        if mode == "random":
            assert np.array_equal(loads, apportion(total, w)), (loads, w)
        else:
            share = total * w / w.sum()
            assert np.all(np.abs(loads / share - 1.0) <= 0.05 + 1e-9), (loads, share)
    if rank == 0:
        print(f"ok: rank weights on {size} ranks: {' '.join(f'{x:.3f}' for x in w)}",
              flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
