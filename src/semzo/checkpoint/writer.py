"""Collective, atomic checkpoint writes.

Two steps, so that the second can run on a background thread:

1. :func:`prepare` (collective over ``comm``, main thread): checks that every rank passes the
   same names, shapes, dtypes and scalar values; gathers the per-rank arrays into (P, ...)
   tables; cuts every dataset into blocks and keeps, for each one, the rows this rank writes
   (views of the caller's arrays, or copies with ``copy=True`` for asynchronous saving: only
   this rank's 1/P of each tensor is copied).
2. :func:`write_file` (collective over the communicator given, which may be a duplicate used
   by a thread): creates ``NAME.tmp`` with the ``mpio`` driver, writes every dataset under
   collective I/O (each rank its run of blocks; a rank with none takes part with an empty
   selection), hashes its blocks, combines the digests with one allreduce, stores them as
   attributes, writes the attribute checksum last, flushes (``MPI_File_sync``), closes, and
   renames to ``NAME`` on rank 0 after every rank has closed.

I/O errors during the write raise :class:`~semzo.runtime.SemzoError` naming the file on the
rank that met them (under :func:`~semzo.runtime.run_spmd` that ends the world with exit 2); the
temporary file is never renamed, so the previous checkpoint stays the newest complete one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
from mpi4py import MPI

from .. import __version__
from ..h5io import require_mpi_h5py
from ..runtime import SemzoError, get_logger
from . import format as fmt
from . import mpio

log = get_logger(__name__)

#: test hook: seconds to sleep after each dataset is written (used to kill a write midway)
SLEEP_ENV = "SEMZO_CKPT_TEST_SLEEP"


@dataclass(frozen=True)
class WriteOptions:
    """File-level tuning: checksum kind, block size, HDF5 alignment and MPI-IO hints."""

    checksum: str = "xxh64"
    block_bytes: int = 1 << 20
    alignment_threshold: int = 65536
    alignment_interval: int = 4096
    transfer: str = "independent"
    hints: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_section(cls, cfg) -> WriteOptions:
        """From a :class:`~semzo.deck.CheckpointSection` (hints equal to 0 or "" are unset)."""
        hints = []
        if cfg.romio_cb_write != "automatic":
            hints.append(("romio_cb_write", cfg.romio_cb_write))
        for k in ("cb_buffer_size", "cb_nodes", "striping_factor", "striping_unit"):
            v = getattr(cfg, k)
            if v:
                hints.append((k, str(v)))
        return cls(checksum=cfg.checksum, block_bytes=int(cfg.block_kib) * 1024,
                   alignment_threshold=cfg.alignment_threshold,
                   alignment_interval=cfg.alignment_interval, transfer=cfg.transfer,
                   hints=tuple(hints))


@dataclass
class Item:
    """One dataset: where it goes, its global shape, and the rows this rank writes."""

    path: str
    shape: tuple          # global shape on disk (0-d arrays are stored as (1,))
    dtype: np.dtype
    kind: str             # "array", "scalar" (0-d), "list"
    layout: fmt.BlockLayout
    lo: int
    hi: int
    rows: np.ndarray      # rows [lo, hi), C-contiguous


@dataclass
class Payload:
    """What one checkpoint holds, as seen from this rank (see :func:`prepare`)."""

    step: int
    items: list[Item]
    group_attrs: dict[str, dict[str, Any]]      # group path -> scalar attributes
    root_attrs: dict[str, Any]
    nbytes: int                                 # bytes of all datasets (whole file's data)
    param_bytes: int = 0
    n_params: int = 0
    opts: WriteOptions = field(default_factory=WriteOptions)


# --------------------------------------------------------------------------- prepare
def _flatten_state(prefix: str, d: dict, arrays: list, attrs: dict) -> None:
    """Nested dict -> datasets (arrays, lists) and group attributes (scalars)."""
    g = attrs.setdefault(prefix, {})
    g["semzo_keys"] = json.dumps(list(d))
    for k, v in d.items():
        if not isinstance(k, str) or not k or "/" in k or k.startswith("semzo_"):
            raise ValueError(f"{prefix}: invalid key {k!r} (a non-empty string without '/')")
        path = f"{prefix}/{k}"
        if isinstance(v, dict):
            _flatten_state(path, v, arrays, attrs)
        elif isinstance(v, (list, tuple)):
            a = np.asarray(v)
            if a.dtype.kind not in "biuf":
                raise TypeError(f"{path}: a list must hold numbers, got {a.dtype}")
            arrays.append((path, a, "list"))
        elif isinstance(v, np.ndarray) or hasattr(v, "__cuda_array_interface__"):
            arrays.append((path, fmt.to_host(v), "array"))
        else:
            try:
                g[k] = fmt.scalar_attr(v)
            except TypeError as exc:
                raise TypeError(f"{path}: {exc}") from None


def _signature(items: list[tuple[str, np.ndarray, str]], group_attrs: dict, step: int) -> int:
    text = [f"step={step}"]
    text += [f"{p}:{a.shape}:{a.dtype.str}:{k}" for p, a, k in items]
    text += [f"{g}@{k}={v!r}" for g, d in group_attrs.items() for k, v in d.items()]
    return zlib.crc32("\n".join(text).encode())


def prepare(comm: MPI.Intracomm, step: int, params: dict, state: dict | None = None,
            per_rank: dict | None = None, extras: dict | None = None,
            metrics: dict | None = None, root_attrs: dict | None = None, *,
            opts: WriteOptions = WriteOptions(), copy: bool = False) -> Payload:
    """Build this rank's :class:`Payload`. Collective over ``comm``.

    ``params``: name -> array, the same names, shapes, dtypes and values on every rank
    (replicated). ``state``: nested dict of scalars (int, float, bool, str), arrays and lists
    of numbers, the same on every rank. ``per_rank``: name -> this rank's array (same shape
    and dtype on every rank), stored as a (P, ...) table. ``extras``: name -> array
    (replicated). ``metrics``: name -> number, the same on every rank (reduce a per-rank
    loss first). With ``copy``, the rows this rank writes are
    copied (a snapshot the caller may then modify). Raises ``ValueError`` on every rank when
    the ranks disagree on the structure.
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    arrays: list[tuple[str, np.ndarray, str]] = []
    group_attrs: dict[str, dict[str, Any]] = {}
    err = None
    try:
        for name, a in params.items():
            if not isinstance(name, str) or not name or "/" in name:
                raise ValueError(f"params: invalid name {name!r}")
            arrays.append((f"params/{name}", fmt.to_host(a), "array"))
        _flatten_state("state", dict(state or {}), arrays, group_attrs)
        local_rows = {k: fmt.to_host(v) for k, v in (per_rank or {}).items()}
        for k in local_rows:
            if "/" in k:
                raise ValueError(f"per_rank: invalid name {k!r}")
        for k, v in (extras or {}).items():
            if "/" in k:
                raise ValueError(f"extras: invalid name {k!r}")
            arrays.append((f"extras/{k}", fmt.to_host(v), "array"))
        group_attrs["metrics"] = {k: fmt.scalar_attr(v) for k, v in (metrics or {}).items()}
        sig = _signature(arrays + [(f"per_rank/{k}", v, "row") for k, v in local_rows.items()],
                         group_attrs, step)
    except (TypeError, ValueError) as exc:
        err, sig = f"rank {rank}: {exc}", 0
    errs = comm.allgather(err)
    if any(errs):
        raise ValueError(f"checkpoint at step {step}: {next(e for e in errs if e)}")
    sigs = comm.allgather(sig)
    if len(set(sigs)) != 1:
        bad = [r for r in range(size) if sigs[r] != sigs[0]]
        raise ValueError(f"checkpoint at step {step}: ranks {bad} pass other names, shapes, "
                         f"dtypes or scalar values than rank 0 (all must be replicated)")
    for k, v in local_rows.items():
        table = np.empty((size, *v.shape), dtype=v.dtype)
        comm.Allgather(np.ascontiguousarray(v).view(np.uint8).reshape(-1),
                       table.view(np.uint8).reshape(size, -1))
        arrays.append((f"per_rank/{k}", table, "array"))

    items, shift, nbytes, pbytes, nparams = [], 0, 0, 0, 0
    for path, a, kind in arrays:
        if a.dtype.kind not in "biuf" or a.dtype.byteorder == ">":
            raise ValueError(f"{path}: unsupported dtype {a.dtype}")
        if a.ndim == 0:
            a, kind = a.reshape(1), "scalar"
        layout = fmt.BlockLayout.of(a.shape, a.dtype.itemsize, opts.block_bytes)
        lo, hi, _, _ = fmt.rank_rows(layout, rank, size, shift)
        shift += layout.n_blocks
        rows = a[lo:hi]
        items.append(Item(path, a.shape, a.dtype, kind, layout, lo, hi,
                          rows.copy() if copy else rows))
        nbytes += a.nbytes
        if path.startswith("params/"):
            pbytes += a.nbytes
            nparams += a.size
    root = dict(root_attrs or {})
    return Payload(step=int(step), items=items, group_attrs=group_attrs, root_attrs=root,
                   nbytes=nbytes, param_bytes=pbytes, n_params=nparams, opts=opts)


# --------------------------------------------------------------------------- write
def _os_error(path: Path, exc: BaseException) -> SemzoError:
    """A one-line SemzoError naming the file; HDF5's long error text is cut to its reason."""
    reason = getattr(exc, "strerror", None)
    if not reason:
        m = re.search(r"error message = '([^']*)'", str(exc))
        reason = m.group(1) if m else str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    try:                    # MPI-IO often loses errno: say so when the file system is full
        free = shutil.disk_usage(path.parent).free
        if free < (1 << 20) and "space" not in reason:
            reason += f" (the file system is full: {free // 1024} KiB free)"
    except OSError:
        pass
    return SemzoError(f"checkpoint {path}: cannot write: {reason}")


def write_file(payload: Payload, path: str | Path, comm: MPI.Intracomm) -> Path:
    """Write ``payload`` to ``path`` atomically (``path.tmp``, then rename). Collective over
    ``comm``; returns ``path`` on every rank once the file is complete under its name."""
    require_mpi_h5py()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    opts = payload.opts
    sleep = float(os.environ.get(SLEEP_ENV, "0") or 0)
    info = mpio.info(opts.hints)
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm, info=info,
                      alignment_threshold=max(1, opts.alignment_threshold),
                      alignment_interval=max(1, opts.alignment_interval))
    except OSError as exc:
        raise _os_error(tmp, exc) from None
    finally:
        info.Free()
    try:
        _write_contents(f, payload, comm, sleep)
        f.flush()          # H5Fflush -> MPI_File_sync on every rank: data on the device
        f.close()
    except OSError as exc:
        # the other ranks may be inside a collective: do not close (run_spmd aborts the
        # world); drop the partial file so a full disk gets its space back
        if comm.Get_size() == 1:
            f.close()
        err = _os_error(tmp, exc)
        tmp.unlink(missing_ok=True)
        raise err from None
    err = None
    comm.Barrier()
    if comm.Get_rank() == 0:
        try:
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except OSError as exc:
            err = str(_os_error(path, exc))
    err = comm.bcast(err, root=0)
    if err:
        raise SemzoError(err)
    return path


def _write_contents(f: h5py.File, p: Payload, comm: MPI.Intracomm, sleep: float) -> None:
    kind = p.opts.checksum
    a = f.attrs
    a["format"] = fmt.FORMAT
    a["format_version"] = fmt.FORMAT_VERSION
    a["semzo_version"] = __version__
    a["world_size"] = comm.Get_size()
    a["step"] = p.step
    a["checksum_kind"] = kind
    a["block_bytes"] = p.opts.block_bytes
    a["n_params"] = p.n_params
    a["param_bytes"] = p.param_bytes
    for k, v in p.root_attrs.items():
        a[k] = v
    for g in fmt.GROUPS:
        f.create_group(g, track_order=True)
    for g in p.group_attrs:
        if g not in f:
            f.create_group(g, track_order=True)
    local: list[np.ndarray] = []
    dsets = []
    dxpl = mpio.transfer_plist(p.opts.transfer)
    independent = p.opts.transfer == "independent"
    for it in p.items:
        parent = it.path.rsplit("/", 1)[0]
        if parent not in f:
            f.create_group(parent, track_order=True)
        d = f.create_dataset(it.path, shape=it.shape, dtype=it.dtype, fill_time="never")
        # collective transfers: the same decision on every rank (all call, or none does);
        # independent ones: a rank with no rows has nothing to call
        if it.layout.n_blocks and (independent is False or it.hi > it.lo):
            mpio.write_rows(d, it.lo, it.rows, dxpl)
        local.append(fmt.block_digests(kind, it.rows, it.layout.block_rows))
        dsets.append(d)
        if sleep:
            time.sleep(sleep)
    # one allreduce combines every rank's block digests: each block has exactly one owner
    counts = [it.layout.n_blocks for it in p.items]
    starts = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    alld = np.zeros(int(starts[-1]), dtype=np.uint64)
    shift = 0
    for i, it in enumerate(p.items):
        _, _, b_lo, b_hi = fmt.rank_rows(it.layout, comm.Get_rank(), comm.Get_size(), shift)
        shift += it.layout.n_blocks
        alld[starts[i] + b_lo:starts[i] + b_hi] = local[i]
    comm.Allreduce(MPI.IN_PLACE, alld, op=MPI.SUM)
    for i, (it, d) in enumerate(zip(p.items, dsets)):
        dig = alld[starts[i]:starts[i + 1]]
        d.attrs["block_rows"] = it.layout.block_rows
        d.attrs["digests"] = dig
        d.attrs["checksum"] = fmt.combine(kind, dig)
        if it.kind != "array":
            d.attrs["semzo_kind"] = it.kind
    for g, attrs in p.group_attrs.items():
        for k, v in attrs.items():
            f[g].attrs[k] = v
    a["attrs_checksum"] = fmt.attrs_checksum(f, kind)   # last: its presence marks completion


def fsync_dir(d: Path) -> None:
    """fsync a directory so a rename in it survives a crash."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
