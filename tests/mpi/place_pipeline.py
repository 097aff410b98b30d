"""Placement end to end: counts -> place(comm=) -> destinations -> redistribute.

Every rank checks: the plan is identical everywhere; after redistribution it holds exactly
quota[:, rank] samples of each cluster; every id arrived exactly once with intact columns;
rows moved / crossing nodes / crossing switches equal the plan's figures. Also: a label out of
range on one rank makes every rank raise in cluster_counts (nobody hangs).

usage: place_pipeline.py
"""

import zlib

import numpy as np
from mpi4py import MPI

from semzo.place import cluster_counts, destinations, place
from semzo.place.redistribute import redistribute
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    k, d = 24, 6
    rng = np.random.default_rng(100 + rank)
    n_local = int(rng.integers(200, 900))
    labels = np.minimum(rng.geometric(0.12, n_local) - 1, k - 1)   # skewed cluster sizes
    first = np.zeros(1, dtype=np.int64)
    comm.Exscan([np.array([n_local], dtype=np.int64), MPI.INT64_T], [first, MPI.INT64_T])
    ids = (first[0] if rank else 0) + np.arange(n_local, dtype=np.int64)
    n_total = comm.allreduce(n_local)
    emb = (ids[:, None] * 0.5 + np.arange(d)).astype(np.float32)

    where = cluster_counts(labels, k, comm)
    assert where.shape == (size, k) and where[rank].sum() == n_local
    cent = np.random.default_rng(7).normal(size=(k, d)).astype(np.float32)
    rank_node = np.arange(size) % 2 if size > 1 else np.zeros(1, dtype=np.int64)
    node_switch = np.array([0, 1])[: rank_node.max() + 1]
    sw = node_switch[rank_node]

    for mode in ("semantic", "random"):
        plan = place(cent, where, rank_node, node_switch, mode=mode, comm=comm,
                     bytes_per_row=4 * d + 16)
        sig = zlib.crc32(plan.quota.tobytes())
        assert comm.allgather(sig) == [sig] * size, "plans differ between ranks"
        dest = destinations(labels, plan, comm)
        moved = np.array([(dest != rank).sum(), (rank_node[dest] != rank_node[rank]).sum(),
                          (sw[dest] != sw[rank]).sum()], dtype=np.int64)
        tot = np.empty_like(moved)
        comm.Allreduce([moved, MPI.INT64_T], [tot, MPI.INT64_T], op=MPI.SUM)
        f = plan.figures
        assert tot[0] == round(f["moved_fraction"] * n_total), (tot, f)
        assert tot[1] == f["rows_cross_node"] and tot[2] == f["rows_cross_switch"], (tot, f)
        stats = {}
        got, texts = redistribute(comm, dest, {"id": ids, "cluster": labels, "emb": emb},
                                  memory_cap_bytes=4096, stats=stats)
        assert texts is None and stats["rounds"] >= 1
        assert np.array_equal(np.bincount(got["cluster"], minlength=k), plan.quota[:, rank])
        assert np.array_equal(got["emb"], (got["id"][:, None] * 0.5 + np.arange(d))
                              .astype(np.float32))
        every = np.sort(np.concatenate(comm.allgather(got["id"])))
        assert np.array_equal(every, np.arange(n_total)), "ids lost or duplicated"
        loads = comm.allgather(got["id"].size)
        assert max(loads) <= 1.05 * n_total / size and min(loads) >= 0.95 * n_total / size

    # an out-of-range label on the last rank: every rank raises, the world stays usable
    bad = labels.copy()
    if rank == size - 1 and bad.size:
        bad[0] = k
    try:
        cluster_counts(bad, k, comm)
        raised = 0
    except ValueError as exc:
        assert f"ranks [{size - 1}]" in str(exc)
        raised = 1
    assert comm.allreduce(raised) == size
    if rank == 0:
        print(f"ok: pipeline on {size} ranks", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
