"""The few collectives k-means needs, on plain numpy buffers (no pickled messages).

Every function here is collective over ``comm``: every rank calls it, with the same dtype and
trailing shape, and a rank with nothing to contribute passes an empty array.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

Allreduce = Callable[[np.ndarray], None]


def default_allreduce(comm) -> Allreduce:
    """``allreduce(buf)``: in-place sum of a contiguous numpy buffer over ``comm``."""

    def allreduce(buf: np.ndarray) -> None:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    return allreduce


def allgatherv(comm, arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate every rank's ``arr`` (n_r, ...) along axis 0 in rank order.

    Collective over comm. Returns (the concatenation, the per-rank row counts (size,) int64).
    """
    arr = np.ascontiguousarray(arr)
    tail = arr.shape[1:]
    per_row = int(np.prod(tail)) if tail else 1
    counts = np.empty(comm.Get_size(), dtype=np.int64)
    comm.Allgather(np.array([arr.shape[0]], dtype=np.int64), counts)
    out = np.empty((int(counts.sum()),) + tail, dtype=arr.dtype)
    comm.Allgatherv(arr.reshape(-1), [out.reshape(-1), [int(c) * per_row for c in counts]])
    return out, counts


def bcast_array(comm, arr: np.ndarray, root: int) -> np.ndarray:
    """Broadcast a contiguous array from ``root``; other ranks pass a buffer of the same shape."""
    arr = np.ascontiguousarray(arr)
    comm.Bcast(arr, root=root)
    return arr


def patient_barrier(comm, spin_s: float = 2e-4, max_sleep_s: float = 5e-4) -> None:
    """A barrier that polls (``Ibarrier`` + ``Test``) for ``spin_s`` seconds, then sleeps between
    polls (doubling from 20 us up to ``max_sleep_s``). Collective over comm.

    MPI's blocking collectives spin while they wait. When the ranks share their cores with other
    processes (more runnable processes than cores), a rank that arrived early then burns CPU time
    the late rank needs; OpenMP runtimes stop spinning after a while for the same reason. A rank
    that arrives last leaves at once; an early one leaves at most ``max_sleep_s`` after the last
    one arrives. Used before the k-means iteration's allreduce, whose wait is the ranks' load
    imbalance; the allreduce itself then runs with every rank present.
    """
    if comm.Get_size() == 1:
        return
    req = comm.Ibarrier()
    t_end = time.perf_counter() + spin_s
    while not req.Test():
        if time.perf_counter() > t_end:
            break
    else:
        return
    nap = 2e-5
    while not req.Test():
        time.sleep(nap)
        nap = min(2.0 * nap, max_sleep_s)
