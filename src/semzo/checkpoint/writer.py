"""Collective, atomic checkpoint writes (format 2: packed datasets, whole-file record).

Two steps, so that the second can run on a background thread:

1. :func:`prepare` (collective over ``comm``, main thread): checks that every rank passes the
   same names, shapes, dtypes and scalar values; gathers the per-rank arrays into (P, ...)
   tables; lays every tensor out in one flat dataset per dtype (:mod:`.packed`) and keeps
   the pieces of this rank's run of blocks (views of the caller's arrays, or one copied slab
   with ``copy=True`` for asynchronous saving: only this rank's 1/P is copied).
2. :func:`write_file` (collective over the communicator given, which may be a duplicate used
   by a thread): creates ``NAME.tmp`` with the ``mpio`` driver and a user block, creates
   the few datasets (collective), writes this rank's slabs (independent by default: a few
   large H5Dwrite calls; with a collective transfer, one collective call per dataset, an
   empty selection on a rank with none), hashes its blocks, combines the digests with one
   allreduce, writes the index and the digests (rank 0), the attributes, the attribute
   checksum last, flushes (``MPI_File_sync``) and closes. Then rank 0 seals the closed file
   with its whole-file record (:mod:`.filesum`) and renames it to ``NAME``.

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
from ..runtime import AllRanksError, InvariantError, SemzoError, get_logger
from . import filesum, mpio, packed
from . import format as fmt

log = get_logger(__name__)


class PayloadError(InvariantError, ValueError):
    """The ranks passed a checkpoint payload that is invalid or not replicated (found by a
    collective check, raised on every rank: printed once, exit 1)."""

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
class Payload:
    """What one checkpoint holds, as seen from this rank (see :func:`prepare`).

    ``parts``: packed dataset name -> this rank's pieces (element offset, 1-D array) that
    tile its run of blocks [lo, hi) (``ranges``: name -> (lo, hi, block lo, block hi)).
    """

    step: int
    entries: list[packed.Entry]
    packs: list[packed.Packed]
    parts: dict[str, list[tuple[int, np.ndarray]]]
    ranges: dict[str, tuple[int, int, int, int]]
    group_attrs: dict[str, dict[str, Any]]      # group path -> scalar attributes
    root_attrs: dict[str, Any]
    nbytes: int                                 # bytes of all tensors (whole file's data)
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
            arrays.append((f"params/{name}", fmt.host_or_device(a), "array"))
        _flatten_state("state", dict(state or {}), arrays, group_attrs)
        local_rows = {k: fmt.to_host(v) for k, v in (per_rank or {}).items()}
        for k in local_rows:
            if "/" in k:
                raise ValueError(f"per_rank: invalid name {k!r}")
        for k, v in (extras or {}).items():
            if "/" in k:
                raise ValueError(f"extras: invalid name {k!r}")
            arrays.append((f"extras/{k}", fmt.host_or_device(v), "array"))
        group_attrs["metrics"] = {k: fmt.scalar_attr(v) for k, v in (metrics or {}).items()}
        sig = _signature(arrays + [(f"per_rank/{k}", v, "row") for k, v in local_rows.items()],
                         group_attrs, step)
    except (TypeError, ValueError) as exc:
        err, sig = f"rank {rank}: {exc}", 0
    errs = comm.allgather(err)
    if any(errs):
        raise PayloadError(f"checkpoint at step {step}: {next(e for e in errs if e)}")
    sigs = comm.allgather(sig)
    if len(set(sigs)) != 1:
        bad = [r for r in range(size) if sigs[r] != sigs[0]]
        raise PayloadError(f"checkpoint at step {step}: ranks {bad} pass other names, "
                           f"shapes, dtypes or scalar values than rank 0 (all must be "
                           f"replicated)")
    for k, v in local_rows.items():
        table = np.empty((size, *v.shape), dtype=v.dtype)
        comm.Allgather(np.ascontiguousarray(v).view(np.uint8).reshape(-1),
                       table.view(np.uint8).reshape(size, -1))
        arrays.append((f"per_rank/{k}", table, "array"))

    nbytes = pbytes = nparams = 0
    flat: dict[str, np.ndarray] = {}
    tensors = []
    for path, a, kind in arrays:
        if a.dtype.kind not in "biuf" or a.dtype.byteorder == ">":
            raise ValueError(f"{path}: unsupported dtype {a.dtype}")
        if a.ndim == 0:
            kind = "scalar"
        tensors.append((path, a, kind))
        flat[path] = a.reshape(-1)
        nbytes += a.nbytes
        if path.startswith("params/"):
            pbytes += a.nbytes
            nparams += a.size
    entries, packs = packed.plan(tensors, opts.block_bytes)
    parts, ranges, shift = {}, {}, 0
    for pk in packs:
        lo, hi, b_lo, b_hi = pk.rank_range(rank, size, shift)
        shift += pk.n_blocks
        mine = packed.pieces([e for e in entries if e.packed == pk.name], flat, lo, hi)
        # device tensors: only this rank's pieces come to the host (not whole models per rank)
        mine = [(o, p if isinstance(p, np.ndarray) else fmt.to_host(p)) for o, p in mine]
        if copy or opts.transfer != "independent":
            # a snapshot (async) or one collective call per dataset: one contiguous slab
            mine = [(lo, np.concatenate([p for _, p in mine]) if len(mine) != 1
                     else mine[0][1].copy() if copy else mine[0][1])] if hi > lo else []
        parts[pk.name] = mine
        ranges[pk.name] = (lo, hi, b_lo, b_hi)
    return Payload(step=int(step), entries=entries, packs=packs, parts=parts, ranges=ranges,
                   group_attrs=group_attrs, root_attrs=dict(root_attrs or {}), nbytes=nbytes,
                   param_bytes=pbytes, n_params=nparams, opts=opts)


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
    """Write ``payload`` to ``path`` atomically (``path.tmp``, sealed with the whole-file
    record, then renamed). Collective over ``comm``; returns ``path`` on every rank once the
    file is complete under its name."""
    require_mpi_h5py()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    opts = payload.opts
    sleep = float(os.environ.get(SLEEP_ENV, "0") or 0)
    info = mpio.info(opts.hints)
    f, err = None, None
    try:
        f = h5py.File(tmp, "w", driver="mpio", comm=comm, info=info,
                      userblock_size=filesum.USERBLOCK,
                      alignment_threshold=max(1, opts.alignment_threshold),
                      alignment_interval=max(1, opts.alignment_interval))
    except OSError as exc:
        err = str(_os_error(tmp, exc))
    finally:
        info.Free()
    # MPI_File_open is collective and fails on every rank alike (a read-only or full file
    # system): agree, so rank 0 prints one line
    first = next((e for e in comm.allgather(err) if e), None)
    if first:
        raise AllRanksError(first)
    try:
        data = _write_contents(f, payload, comm, sleep)
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
        try:        # the record covers the final bytes; the name appears only after it
            filesum.seal(tmp, opts.checksum, opts.block_bytes, data)
            os.replace(tmp, path)
            fsync_dir(path.parent)
        except OSError as exc:
            err = str(_os_error(path, exc))
    filesum.quiet_barrier(comm)      # the others sleep while rank 0 seals: no spinning
    err = comm.bcast(err, root=0)
    if err:
        raise AllRanksError(err)
    return path


def _write_contents(f: h5py.File, p: Payload, comm: MPI.Intracomm,
                    sleep: float) -> list[tuple[int, int, np.ndarray]]:
    """Create, write and describe everything; returns (file offset, bytes, block digests)
    of every non-empty packed dataset (for :func:`semzo.checkpoint.filesum.seal`)."""
    kind = p.opts.checksum
    rank = comm.Get_rank()
    a = f.attrs
    a["format"] = fmt.FORMAT
    a["format_version"] = fmt.FORMAT_VERSION
    a["layout"] = "packed"
    a["semzo_version"] = __version__
    a["world_size"] = comm.Get_size()
    a["step"] = p.step
    a["checksum_kind"] = kind
    a["block_bytes"] = p.opts.block_bytes
    a["n_params"] = p.n_params
    a["param_bytes"] = p.param_bytes
    for k, v in p.root_attrs.items():
        a[k] = v
    for g in (*fmt.GROUPS, "packed", "digests"):
        f.create_group(g, track_order=True)
    for g in p.group_attrs:
        if g not in f:
            f.create_group(g, track_order=True)
    index = packed.index_array(p.entries)
    f.create_dataset("index", data=None, shape=index.shape, dtype=index.dtype,
                     fill_time="never")
    dsets, digs = {}, {}
    for pk in p.packs:
        dsets[pk.name] = f["packed"].create_dataset(pk.name, shape=(pk.n,), dtype=pk.dtype,
                                                    fill_time="never")
        digs[pk.name] = f["digests"].create_dataset(pk.name, shape=(pk.n_blocks,),
                                                    dtype=np.uint64, fill_time="never")
    dxpl = mpio.transfer_plist(p.opts.transfer)
    independent = p.opts.transfer == "independent"
    local: list[np.ndarray] = []
    for pk in p.packs:
        d = dsets[pk.name]
        lo, hi, _, _ = p.ranges[pk.name]
        parts = p.parts[pk.name]
        if independent:
            for off, arr in packed.coalesce(parts, 1 << 20, pk.dtype):
                mpio.write_rows(d, off, arr, dxpl)
        elif pk.n:      # collective: every rank calls once (an empty selection if no rows)
            off, arr = parts[0] if parts else (0, np.zeros(0, pk.dtype))
            mpio.write_rows(d, off, arr, dxpl)
        local.append(packed.slab_digests(kind, parts, lo, hi, pk.block_elems, pk.dtype)
                     if hi > lo else np.zeros(0, np.uint64))
        if sleep:
            time.sleep(sleep)
    # one allreduce combines every rank's block digests: each block has exactly one owner
    starts = np.concatenate(([0], np.cumsum([pk.n_blocks for pk in p.packs]))).astype(np.int64)
    alld = np.zeros(int(starts[-1]), dtype=np.uint64)
    for i, pk in enumerate(p.packs):
        _, _, b_lo, b_hi = p.ranges[pk.name]
        alld[starts[i] + b_lo:starts[i] + b_hi] = local[i]
    comm.Allreduce(MPI.IN_PLACE, alld, op=MPI.SUM)
    one = mpio.transfer_plist("independent")
    if rank == 0:       # small datasets: rank 0 writes them (independent transfers)
        if index.size:
            mpio.write_rows(f["index"], 0, index, one)
        for i, pk in enumerate(p.packs):
            if pk.n_blocks:
                mpio.write_rows(digs[pk.name], 0, alld[starts[i]:starts[i + 1]], one)
    data = []
    for i, pk in enumerate(p.packs):
        dig = alld[starts[i]:starts[i + 1]]
        d = dsets[pk.name]
        d.attrs["block_elems"] = pk.block_elems
        d.attrs["checksum"] = fmt.combine(kind, dig)
        if pk.n:
            data.append((int(d.id.get_offset()), pk.n * pk.dtype.itemsize, dig))
    a["index_checksum"] = fmt._hex(kind, fmt.digest(kind, index.tobytes()))
    for g, attrs in p.group_attrs.items():
        for k, v in attrs.items():
            f[g].attrs[k] = v
    a["attrs_checksum"] = fmt.attrs_checksum(f, kind)   # last: its presence marks completion
    return data


def fsync_dir(d: Path) -> None:
    """fsync a directory so a rename in it survives a crash."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
