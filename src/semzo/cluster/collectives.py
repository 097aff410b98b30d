"""The few collectives k-means needs, on plain numpy buffers (no pickled messages).

Every function here is collective over ``comm``: every rank calls it, with the same dtype and
trailing shape, and a rank with nothing to contribute passes an empty array.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Allreduce = Callable[[np.ndarray], None]


def default_allreduce(comm) -> Allreduce:
    """``allreduce(buf)``: in-place sum of a contiguous numpy buffer over ``comm``."""
    from mpi4py import MPI

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
