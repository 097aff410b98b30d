"""Hierarchical vs flat MPI_Allreduce, 8 B to 64 MiB.

    timeout 600 mpirun -n 4 .venv/bin/python bench/allreduce.py [--ranks-per-node 1]
                                                               [--nodes-per-switch 2]

Peer: the MPI library's own MPI_Allreduce on the world communicator (Open MPI's tuned
collective), measured in the same run on the same buffers. Prints, per size, the best time
over repetitions for each and the ratio flat/hierarchical (> 1: hierarchical faster).
On one host the "nodes" and "switches" are simulated, so this measures the algorithm's
overhead, not the saving of cross-switch traffic that a real tree network gives.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from semzo.deck import TopologySection
from semzo.runtime import run_spmd
from semzo.topology import build_topology


def best_time(fn, buf_src, reps: int, comm) -> float:
    best = float("inf")
    for _ in range(reps):
        buf = buf_src.copy()
        comm.Barrier()
        t0 = time.perf_counter()
        fn(buf)
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        best = min(best, dt)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--nodes-per-switch", type=int, default=2)
    ap.add_argument("--max-mib", type=float, default=64)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    P = comm.Get_size()
    rpn = args.ranks_per_node if P % max(args.ranks_per_node, 1) == 0 else 0
    nps = args.nodes_per_switch if rpn and (P // rpn) % max(args.nodes_per_switch, 1) == 0 else 0
    topo = build_topology(comm, TopologySection(ranks_per_node=rpn, nodes_per_switch=nps))
    if topo.rank == 0:
        print(topo.describe().splitlines()[0])
        print(f"{'bytes':>10} {'flat [us]':>12} {'hier [us]':>12} {'flat/hier':>10}  check")
    sizes = [8, 64, 512, 4096, 32768, 262144, 2**20, 2**22, 2**24, 2**26]
    for size in [s for s in sizes if s <= args.max_mib * 2**20]:
        n = max(1, size // 8)
        x = np.random.default_rng(topo.rank).standard_normal(n)
        reps = int(max(3, min(200, 2e7 / max(size, 1) ** 0.9 / 50)))
        flat = best_time(lambda b: topo.world.Allreduce(MPI.IN_PLACE, b, op=MPI.SUM), x,
                         reps, topo.world)
        hier = best_time(lambda b: topo.allreduce(b), x, reps, topo.world)
        ref = x.copy()
        topo.world.Allreduce(MPI.IN_PLACE, ref)
        got = topo.allreduce(x.copy())
        rel = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-300))
        if topo.rank == 0:
            print(f"{size:>10} {flat * 1e6:>12.1f} {hier * 1e6:>12.1f} {flat / hier:>10.2f}  "
                  f"rel.diff {rel:.1e}")
    topo.free()


if __name__ == "__main__":
    run_spmd(main)
