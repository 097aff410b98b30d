"""A plan applied and planned again moves nothing, under MPI (issue 12, defect 4).

For several random layouts: counts -> place(comm=) -> destinations -> redistribute, then the
counts of the moved rows -> place again: every rank asserts the second quota equals the first,
every destination is the rank itself, and the loads did not change. 3 ranks: nodes [0, 1, 2]
on switches [0, 1, 1]; 4 ranks: 2 nodes of 2 on 2 switches.

usage: place_replan.py
"""

import numpy as np
from mpi4py import MPI

from semzo.place import cluster_counts, destinations, place
from semzo.place.redistribute import redistribute
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 3:
        rank_node, node_switch = np.array([0, 1, 2]), np.array([0, 1, 1])
    else:
        rank_node, node_switch = np.arange(size) // 2, np.arange((size + 1) // 2)
    for seed in range(12):
        rng = np.random.default_rng(1000 * seed + rank)
        k = 6
        n_local = int(rng.integers(300, 700)) if (seed % 2 or rank == 0) else 0
        labels = rng.integers(0, k, n_local)
        cent = np.random.default_rng(seed).normal(size=(k, 4))
        where = cluster_counts(labels, k, comm)
        first = place(cent, where, rank_node, node_switch, comm=comm)
        dest = destinations(labels, first, comm)
        got, _ = redistribute(comm, dest, {"cluster": labels}, memory_cap_bytes=1 << 20)
        where2 = cluster_counts(got["cluster"], k, comm)
        again = place(cent, where2, rank_node, node_switch, comm=comm)
        assert np.array_equal(again.quota, first.quota), (seed, first.quota, again.quota)
        dest2 = destinations(got["cluster"], again, comm)
        assert (dest2 == rank).all(), (seed, rank)
        assert again.figures["moved_fraction"] == 0.0
        assert again.figures["load_max_over_mean"] == first.figures["load_max_over_mean"]
    if rank == 0:
        print(f"ok: re-plan on {size} ranks moved nothing", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
