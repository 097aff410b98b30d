"""Parallel HDF5 helpers: collective files written atomically, with the resolved deck inside.

Every output file is created under ``NAME.tmp`` with the ``mpio`` driver, closed collectively,
and renamed by rank 0 after a barrier, so a file under its final name is always complete.
Creating datasets and attributes is collective: every rank makes the same calls with the same
values.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from . import __version__


def require_mpi_h5py() -> None:
    """Fail fast when h5py was built without MPI (parallel writes would be impossible)."""
    if not h5py.get_config().mpi:
        raise RuntimeError("h5py was built without MPI; run `make setup` (it rebuilds h5py "
                           "against parallel HDF5)")


@contextlib.contextmanager
def create_collective(path: str | Path, comm: MPI.Intracomm, deck_toml: str,
                      **attrs) -> Iterator[h5py.File]:
    """Create ``path`` collectively and atomically; yields the open file. Collective.

    The resolved deck, the semzo version and the world size are stored as root attributes.
    On an exception the temporary file is left for inspection and never renamed.
    """
    require_mpi_h5py()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    f = h5py.File(tmp, "w", driver="mpio", comm=comm)
    try:
        f.attrs["semzo_deck"] = deck_toml
        f.attrs["semzo_version"] = __version__
        f.attrs["world_size"] = comm.Get_size()
        for k, v in attrs.items():
            f.attrs[k] = v
        yield f
    finally:
        f.close()
    comm.Barrier()
    if comm.Get_rank() == 0:
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    comm.Barrier()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def open_collective(path: str | Path, comm: MPI.Intracomm) -> h5py.File:
    """Open an existing file read-only with the ``mpio`` driver. Collective."""
    require_mpi_h5py()
    return h5py.File(path, "r", driver="mpio", comm=comm)


def write_rows(f: h5py.File, name: str, local: np.ndarray, offset: int, total: int) -> None:
    """Create dataset ``name`` of ``total`` rows and write this rank's rows at ``offset``.

    Collective: every rank calls it, a rank with no rows writes an empty selection.
    """
    dset = f.create_dataset(name, shape=(total, *local.shape[1:]), dtype=local.dtype)
    with dset.collective:
        dset[offset:offset + local.shape[0]] = local


def row_range(n_total: int, comm: MPI.Intracomm) -> tuple[int, int]:
    """This rank's contiguous block [lo, hi) of ``n_total`` rows (balanced, rank order)."""
    p, r = comm.Get_size(), comm.Get_rank()
    return n_total * r // p, n_total * (r + 1) // p


def offsets(n_local: int, comm: MPI.Intracomm) -> tuple[int, int]:
    """(offset of this rank's rows, total rows) from an exclusive prefix sum. Collective."""
    total = comm.allreduce(n_local, op=MPI.SUM)
    off = comm.exscan(n_local, op=MPI.SUM)
    return (off or 0) if comm.Get_rank() else 0, total
