"""MPI-IO details of checkpoint files: hints, the transfer mode, and slab I/O in place.

Every dataset transfer is a collective H5Dwrite/H5Dread: every rank makes the call, a rank
with no rows selects nothing (the selection logic is :mod:`semzo.h5io`'s, which avoids the
h5py empty-selection hang). Underneath, HDF5 can either run MPI-IO collective buffering
(``collective``: aggregators gather the ranks' pieces, then write large blocks) or let every
rank move its own contiguous slab with independent MPI-IO calls (``individual``: HDF5's
``H5FD_MPIO_INDIVIDUAL_IO`` collective option). A checkpoint's slabs are large and
contiguous, which is the case ``individual`` is for (docs/checkpoint.md has the timings).
h5py does not wrap ``H5Pset_dxpl_mpio_collective_opt``; it is called through ctypes on the
HDF5 library h5py itself loaded, and if that fails the transfer stays ``collective``.
"""

from __future__ import annotations

import ctypes
import functools

import h5py
import numpy as np
from mpi4py import MPI

from ..h5io import _spaces
from ..runtime import get_logger

log = get_logger(__name__)

_H5FD_MPIO_INDIVIDUAL_IO = 1      # H5FD_mpio_collective_opt_t


@functools.lru_cache(maxsize=1)
def _hdf5_library() -> ctypes.CDLL | None:
    """The libhdf5 mapped into this process by h5py (found in /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as fh:
            paths = {ln.split()[-1] for ln in fh if "libhdf5" in ln and ".so" in ln}
    except OSError:
        return None
    for p in sorted(paths):
        if "_hl" in p.rsplit("/", 1)[-1]:
            continue
        try:
            lib = ctypes.CDLL(p)
            lib.H5Pset_dxpl_mpio_collective_opt.argtypes = [ctypes.c_int64, ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def transfer_plist(mode: str) -> h5py.h5p.PropDXID:
    """A collective data-transfer property list; ``individual`` adds independent MPI-IO."""
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    if mode == "independent":
        dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_INDEPENDENT)
        return dxpl
    dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    if mode == "individual":
        lib = _hdf5_library()
        if lib is None or lib.H5Pset_dxpl_mpio_collective_opt(dxpl.id,
                                                              _H5FD_MPIO_INDIVIDUAL_IO) < 0:
            log.debug("H5Pset_dxpl_mpio_collective_opt unavailable: collective buffering")
    elif mode != "collective":
        raise ValueError(f"unknown transfer mode {mode!r}")
    return dxpl


def info(hints: tuple[tuple[str, str], ...]) -> MPI.Info:
    """An ``MPI.Info`` with the given hints (the caller frees it)."""
    inf = MPI.Info.Create()
    for k, v in hints:
        inf.Set(k, v)
    return inf


def write_rows(dset: h5py.Dataset, start: int, rows: np.ndarray, dxpl) -> None:
    """Collectively write ``rows`` (C-contiguous, the dataset's dtype) at row ``start``; a
    rank with no rows takes part with an empty selection."""
    n = int(rows.shape[0])
    buf = rows if n else np.zeros((1, *dset.shape[1:]), dtype=dset.dtype)
    mspace, fspace = _spaces(dset, start, n)
    dset.id.write(mspace, fspace, buf, dxpl=dxpl)


def read_rows_into(dset: h5py.Dataset, start: int, out: np.ndarray, dxpl) -> None:
    """Collectively read ``len(out)`` rows at ``start`` straight into ``out`` (C-contiguous);
    a rank with no rows takes part with an empty selection."""
    n = int(out.shape[0])
    buf = out if n else np.zeros((1, *dset.shape[1:]), dtype=dset.dtype)
    mspace, fspace = _spaces(dset, start, n)
    dset.id.read(mspace, fspace, buf, dxpl=dxpl)
