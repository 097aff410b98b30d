"""Parallel HDF5 helpers: collective files written atomically, with the resolved deck inside.

Every output file is created under ``NAME.tmp`` with the ``mpio`` driver, closed collectively,
and renamed by rank 0 after a barrier, so a file under its final name is always complete.
Creating datasets and attributes is collective: every rank makes the same calls with the same
values.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from . import __version__
from .corpus.strings import decode_strings, encode_strings
from .h5check import DAMAGED, InputFileError, OutputFileError, agree, offsets_error


def string_array(values) -> np.ndarray:
    """A list of str as an array HDF5 stores as variable-length UTF-8 strings, empty lists
    included (a plain object array of no element has no HDF5 type: an unlabelled corpus)."""
    return np.array(list(values), dtype=h5py.string_dtype())


def require_mpi_h5py() -> None:
    """Fail fast when h5py was built without MPI (parallel writes would be impossible)."""
    if not h5py.get_config().mpi:
        raise RuntimeError("h5py was built without MPI; run `make setup` (it rebuilds h5py "
                           "against parallel HDF5)")


@contextlib.contextmanager
def create_collective(path: str | Path, comm: MPI.Intracomm, deck_toml: str,
                      **attrs) -> Iterator[h5py.File]:
    """Create ``path`` collectively and atomically; yields the open file. Collective.

    The resolved deck, the semzo version, the world size and a random id of this file
    (``semzo_file_id``: a later stage's output records the ids of the files it was made from,
    so a file made again upstream is noticed) are stored as root attributes.
    On an exception the temporary file is left for inspection and never renamed.
    """

    require_mpi_h5py()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    file_id = comm.bcast(uuid.uuid4().hex if comm.Get_rank() == 0 else None, root=0)
    f, err = None, None
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm)
    except OSError as exc:          # MPI_File_open is collective: it fails on every rank
        err = f"{tmp}: cannot create it ({str(exc).splitlines()[0][:200]})"
    errors = comm.allgather(err)
    first = next((e for e in errors if e), None)
    if first:                       # (a file opened here but not elsewhere stays open)
        raise OutputFileError(first)
    try:
        f.attrs["semzo_deck"] = deck_toml
        f.attrs["semzo_version"] = __version__
        f.attrs["world_size"] = comm.Get_size()
        f.attrs["semzo_file_id"] = file_id
        for k, v in attrs.items():
            f.attrs[k] = v
        yield f
    except BaseException as exc:
        close_after_error(f, comm, exc)
        raise
    f.close()
    comm.Barrier()
    if comm.Get_rank() == 0:
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    comm.Barrier()


def close_after_error(f, comm: MPI.Intracomm, exc: BaseException) -> None:
    """Close the collective (``mpio``) file ``f`` while ``exc`` propagates, unless the other
    ranks may not be closing it too. Closing is collective: after an exception raised on this
    rank alone, another rank may be waiting inside a collective write or read on the same
    file, and both would hang. So the file is closed only when one rank runs, or when ``exc``
    is an error every rank raised together (``all_ranks``); otherwise it is left open and the
    exception reaches :func:`semzo.runtime.run_spmd`, which aborts every rank."""
    if comm.Get_size() == 1 or getattr(exc, "all_ranks", False):
        f.close()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_collective(path: str | Path, comm: MPI.Intracomm,
                    missing: str = "") -> Iterator[h5py.File]:
    """Open an existing file read-only with the ``mpio`` driver, as a context manager that
    closes it (collectively; after an error on one rank it does not, see
    :func:`close_after_error`). Collective.

    A file that is missing (``missing``: what to do about it, e.g. "run the embed stage
    first"), not a regular file, not HDF5, or that HDF5 cannot open (truncated, damaged
    superblock) raises :class:`~semzo.h5check.InputFileError` on every rank: one line naming
    the file, exit 2. Rank 0 looks at the file before anyone opens it (so no rank reaches
    MPI-IO with a path that is a folder or absent), then every rank's open result is agreed."""

    require_mpi_h5py()
    p = Path(path)
    err = None
    if comm.Get_rank() == 0:
        if not p.exists():
            err = f"{p}: not found" + (f" ({missing})" if missing else "")
        elif not p.is_file():
            err = f"{p}: not a regular file"
        else:
            try:
                if not h5py.is_hdf5(str(p)):
                    err = f"{p}: not an HDF5 file: {DAMAGED}"
            except OSError as exc:
                err = f"{p}: cannot be read ({exc.strerror or exc})"
    err = comm.bcast(err, root=0)
    if err:
        raise InputFileError(err)
    f = None
    try:
        f = h5py.File(p, "r", driver="mpio", comm=comm)
    except OSError as exc:
        why = str(exc).split("\n")[0][:200]
        err = f"{p}: HDF5 cannot open it ({why}): {DAMAGED}"
    agree(comm, err)
    try:
        yield f
    except BaseException as exc:
        close_after_error(f, comm, exc)
        raise
    f.close()


def _collective_dxpl() -> h5py.h5p.PropDXID:
    dxpl = h5py.h5p.create(h5py.h5p.DATASET_XFER)
    if h5py.get_config().mpi:
        dxpl.set_dxpl_mpio(h5py.h5fd.MPIO_COLLECTIVE)
    return dxpl


def _spaces(dset: h5py.Dataset, start: int, n: int):
    """(memory space, file space) selecting rows [start, start + n) of ``dset``; for n = 0
    both select nothing, so the rank still takes part in the collective call."""
    rest = tuple(dset.shape[1:])
    fspace = dset.id.get_space()
    if n == 0:
        fspace.select_none()
        mspace = h5py.h5s.create_simple((1, *rest))
        mspace.select_none()
    else:
        fspace.select_hyperslab((start,) + (0,) * len(rest), (n, *rest))
        mspace = h5py.h5s.create_simple((n, *rest))
    return mspace, fspace


def write_slab(dset: h5py.Dataset, start: int, local: np.ndarray) -> None:
    """Collectively write ``local`` to rows [start, start + len(local)) of ``dset``.

    Collective over the file's communicator. Unlike ``dset[a:b] = x`` under
    ``dset.collective``, a rank with no rows still makes the H5Dwrite call (h5py skips
    empty selections, which hangs the other ranks: h5py issue #965).
    """
    n = int(local.shape[0])
    buf = np.ascontiguousarray(local, dtype=dset.dtype)
    if n == 0:
        buf = np.zeros((1, *dset.shape[1:]), dtype=dset.dtype)
    mspace, fspace = _spaces(dset, start, n)
    dset.id.write(mspace, fspace, buf, dxpl=_collective_dxpl())


def read_slab(dset: h5py.Dataset, start: int, stop: int) -> np.ndarray:
    """Collectively read rows [start, stop) of ``dset`` (an empty range still takes part)."""
    n = max(0, int(stop) - int(start))
    out = np.zeros((max(n, 1), *dset.shape[1:]), dtype=dset.dtype)
    mspace, fspace = _spaces(dset, start, n)
    dset.id.read(mspace, fspace, out, dxpl=_collective_dxpl())
    return out[:n]


def write_rows(f: h5py.File, name: str, local: np.ndarray, offset: int, total: int) -> None:
    """Create dataset ``name`` of ``total`` rows and write this rank's rows at ``offset``.

    Collective: every rank calls it, a rank with no rows writes an empty selection.
    """
    dset = f.create_dataset(name, shape=(total, *local.shape[1:]), dtype=local.dtype)
    write_slab(dset, offset, local)


def row_range(n_total: int, comm: MPI.Intracomm) -> tuple[int, int]:
    """This rank's contiguous block [lo, hi) of ``n_total`` rows (balanced, rank order)."""
    p, r = comm.Get_size(), comm.Get_rank()
    return n_total * r // p, n_total * (r + 1) // p


def offsets(n_local: int, comm: MPI.Intracomm) -> tuple[int, int]:
    """(offset of this rank's rows, total rows) from an exclusive prefix sum. Collective."""
    total = comm.allreduce(n_local, op=MPI.SUM)
    off = comm.exscan(n_local, op=MPI.SUM)
    return (off or 0) if comm.Get_rank() else 0, total


def write_texts(f: h5py.File, texts: list[str], off: int, total: int,
                comm: MPI.Intracomm) -> None:
    """Write this rank's strings as rows [off, off + len(texts)) of ``text_offsets`` (N + 1,)
    and ``text_bytes`` (UTF-8): row i is ``text_bytes[text_offsets[i]:text_offsets[i+1]]``.
    Collective."""

    data, lengths = encode_strings(texts)
    boff, btotal = offsets(int(data.size), comm)
    ends = boff + np.cumsum(lengths, dtype=np.int64)
    tof = f.create_dataset("text_offsets", shape=(total + 1,), dtype=np.int64)
    write_slab(tof, off + 1, ends)               # row i's end goes to slot i + 1
    write_slab(tof, 0, np.zeros(1 if comm.Get_rank() == 0 else 0, np.int64))
    write_rows(f, "text_bytes", data, boff, btotal)


def read_texts(f: h5py.File, lo: int, hi: int, comm: MPI.Intracomm | None = None,
               path: str | Path | None = None) -> list[str]:
    """Rows [lo, hi) of the strings written by :func:`write_texts`. Collective.

    With ``comm``: the offsets are checked (non-decreasing, inside ``text_bytes``) and the
    bytes decoded as UTF-8 with every rank agreeing on the outcome: a damaged file raises the
    same one-line :class:`semzo.h5check.InputFileError` on every rank (naming ``path``)."""

    offs = read_slab(f["text_offsets"], lo, hi + 1)
    if comm is not None:
        agree(comm, offsets_error(path or f.filename, "text_offsets", offs, 0,
                                  int(f["text_bytes"].shape[0]), row0=lo))
    raw = read_slab(f["text_bytes"], int(offs[0]), int(offs[-1]))
    if comm is None:
        return decode_strings(raw, np.diff(offs))
    out, err = [], None
    try:
        out = decode_strings(raw, np.diff(offs))
    except UnicodeDecodeError as exc:
        err = (f"{path or f.filename}: dataset text_bytes: invalid UTF-8 at byte "
               f"{int(offs[0]) + exc.start}: {DAMAGED}")
    agree(comm, err)
    return out
