"""Reading format-1 checkpoints (one dataset per tensor), written before format 2.

Kept so that runs checkpointed by an earlier semzo still resume and inspect. A format-1 file
has no whole-file record; :func:`semzo.checkpoint.filesum.check_collective` checks its
superblock and warns before these functions open it (docs/checkpoint.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from . import format as fmt
from . import mpio
from .format import CheckpointError


@dataclass
class _Entry:
    path: str
    shape: tuple
    dtype: np.dtype
    kind: str
    layout: fmt.BlockLayout
    digests: np.ndarray


def _agree(comm: MPI.Intracomm, err: str | None) -> str | None:
    """The first rank's error, on every rank (collective)."""
    errs = comm.allgather(err)
    return next((e for e in errs if e), None)


def _scan(f: h5py.File) -> tuple[dict, list[_Entry], dict[str, dict]]:
    """Root attributes, datasets in canonical order, group attributes. Raises on bad format."""
    attrs = fmt.root_attrs(f, 1, " without a whole-file record (only format 1 has none)")
    kind = str(attrs["checksum_kind"])
    entries: list[_Entry] = []
    groups: dict[str, dict] = {}

    def add(path: str) -> None:
        d = f[path]
        if not isinstance(d, h5py.Dataset):
            raise CheckpointError(f"{path}: expected a dataset")
        br = int(d.attrs["block_rows"])
        dig = np.asarray(d.attrs["digests"], dtype=np.uint64)
        shape = tuple(d.shape)
        n_rows = shape[0] if shape else 1
        size = int(np.prod(shape)) if shape else 1
        n_blocks = 0 if size == 0 else -(-n_rows // br)
        if br < 1 or dig.shape != (n_blocks,):
            raise CheckpointError(f"{path}: block layout does not match its digests")
        if d.attrs["checksum"] != fmt.combine(kind, dig):
            raise CheckpointError(f"{path}: checksum of block digests mismatch")
        entries.append(_Entry(path, shape, d.dtype, str(d.attrs.get("semzo_kind", "array")),
                              fmt.BlockLayout(n_rows, br, n_blocks), dig))

    for g in ("params", "per_rank", "extras"):
        for name in f[g]:
            add(f"{g}/{name}")

    def walk(gpath: str) -> None:
        g = f[gpath]
        groups[gpath] = {k: fmt.from_attr(v) for k, v in g.attrs.items()}
        for k in json.loads(groups[gpath].get("semzo_keys", "[]")):
            if k in g.attrs:
                continue
            if isinstance(g.get(k), h5py.Group):
                walk(f"{gpath}/{k}")
            else:
                add(f"{gpath}/{k}")

    walk("state")
    groups["metrics"] = {k: fmt.from_attr(v) for k, v in f["metrics"].attrs.items()} \
        if "metrics" in f else {}
    return attrs, entries, groups


def read(path: Path, comm: MPI.Intracomm, keep: bool, verify: bool, transfer: str,
         distribute: str, allgather_rows) -> tuple[dict, dict, dict, dict]:
    """(attrs, arrays, groups, kinds) of a format-1 file, as :func:`.reader._read`."""
    attrs, arrays, groups, entries = _read(path, comm, keep, verify, transfer, distribute,
                                           allgather_rows)
    return attrs, arrays, groups, {e.path: e.kind for e in entries}


def _read(path: Path, comm: MPI.Intracomm, keep: bool, verify: bool, transfer: str,
          distribute: str, _allgather_rows):
    """Open, scan, read (and verify) every dataset. Collective; returns (attrs, arrays,
    groups) or raises CheckpointError on every rank.

    Each rank verifies its run of blocks (every block is checked once). With ``keep``, every
    rank ends with every array: ``allgather`` reads only its run and allgathers the runs;
    ``read`` reads every block itself.
    """
    rank, size = comm.Get_rank(), comm.Get_size()
    err, f = None, None
    try:
        f = h5py.File(path, "r", driver="mpio", comm=comm)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one reason to skip it
        err = f"cannot open: {exc}"
    err = _agree(comm, err)
    if err:
        if f is not None:
            f.close()
        raise CheckpointError(f"{path}: {err}")
    try:
        scanned, err = None, None
        try:
            scanned = _scan(f)
        except (CheckpointError, KeyError, OSError, ValueError, TypeError) as exc:
            err = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) \
                else str(exc)
        err = _agree(comm, err)
        if err:
            raise CheckpointError(f"{path}: {err}")
        attrs, entries, groups = scanned
        kind = attrs["checksum_kind"]
        dxpl = mpio.transfer_plist(transfer)
        arrays: dict[str, np.ndarray] = {}
        bad: list[str] = []
        shift = 0
        gather = keep and size > 1 and distribute == "allgather"
        read_all = keep and size > 1 and distribute == "read"
        for e in entries:
            lo, hi, b_lo, b_hi = fmt.rank_rows(e.layout, rank, size, shift)
            disk_shape = e.shape or (1,)
            full = np.empty(disk_shape, dtype=e.dtype) if keep else None
            if e.layout.n_blocks:
                if read_all:
                    mpio.read_rows_into(f[e.path], 0, full, dxpl)
                    rows = full[lo:hi]
                else:
                    rows = full[lo:hi] if keep else np.empty((hi - lo, *disk_shape[1:]),
                                                             e.dtype)
                    mpio.read_rows_into(f[e.path], lo, rows, dxpl)
                if verify:
                    got = fmt.block_digests(kind, rows, e.layout.block_rows)
                    want = e.digests[b_lo:b_hi]
                    if not np.array_equal(got, want):
                        b = b_lo + int(np.flatnonzero(got != want)[0])
                        r0, r1 = e.layout.block_range(b, b + 1)
                        bad.append(f"{e.path}: data checksum mismatch in block {b} "
                                   f"(rows {r0}..{r1 - 1})")
                if gather:
                    _allgather_rows(comm, full, fmt.all_rank_rows(e.layout, size, shift))
            shift += e.layout.n_blocks
            if keep:
                arrays[e.path] = full.reshape(()) if e.kind == "scalar" else full
        err = _agree(comm, bad[0] if bad else None)
        if err:
            raise CheckpointError(f"{path}: {err}")
        return attrs, arrays, groups, entries
    finally:
        f.close()


def describe_rows(path: Path, comm: MPI.Intracomm) -> tuple[dict, list, dict, int]:
    """(attrs, rows (path, shape, dtype, where), groups, blocks) of a format-1 file.
    Collective; raises CheckpointError on every rank."""
    f, err = None, None
    try:
        f = h5py.File(path, "r", driver="mpio", comm=comm)
        attrs, entries, groups = _scan(f)
    except Exception as exc:  # noqa: BLE001 - reported as one reason
        err = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
    finally:
        if f is not None:
            f.close()
    err = _agree(comm, err)
    if err:
        raise CheckpointError(f"{path}: {err}")
    rows = [(e.path, e.shape, e.dtype.str.lstrip("<|="),
             fmt.combine(attrs["checksum_kind"], e.digests)) for e in entries]
    return attrs, rows, groups, sum(e.layout.n_blocks for e in entries)
