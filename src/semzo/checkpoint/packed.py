"""The packed layout of format 2: every tensor in one flat dataset per dtype, and an index.

Writing 232 small and large tensors as 232 HDF5 datasets cost a collective object creation,
attributes and an H5Dwrite each; the file ran at 36 % of ``dd``. Format 2 concatenates the
tensors of each dtype, in order, into one 1-D dataset ``/packed/<dtype name>`` (contiguous
layout, aligned by HDF5's ``alignment_*``), so each rank writes a few large slabs. An index
dataset names every tensor::

    /index   compound (n,): path (S, "params/<name>", "state/...", "per_rank/...",
             "extras/..."), packed (S16, the dataset holding it), kind (S8: array, scalar,
             list), offset and count (int64, elements), ndim (int32), shape (int64[8])
    /packed/<dtype>    (n_elements,) of that dtype; attr ``checksum`` = digest of its digests
    /digests/<dtype>   (n_blocks,) uint64: one digest per block of ``block_bytes`` bytes

``h5dump -d /index FILE`` lists the tensors; ``h5dump -d /packed/float32 -s OFFSET -c COUNT
FILE`` prints one. Blocks are cut from the start of each packed dataset (``block_elems`` =
``block_bytes / itemsize`` elements); ranks own contiguous runs of whole blocks
(:func:`semzo.checkpoint.format.rank_blocks`, rotated from dataset to dataset), so a file
written at P ranks is read and verified at any other rank count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import format as fmt
from .format import CheckpointError

MAX_NDIM = 8
KINDS = ("array", "scalar", "list")


@dataclass(frozen=True)
class Entry:
    """One tensor: where it lies in its packed dataset (offset and count in elements)."""

    path: str
    packed: str
    kind: str
    offset: int
    count: int
    shape: tuple


@dataclass(frozen=True)
class Packed:
    """One packed dataset: its dtype, length (elements) and checksum blocks."""

    name: str
    dtype: np.dtype
    n: int
    block_elems: int

    @property
    def n_blocks(self) -> int:
        return -(-self.n // self.block_elems)

    def rank_range(self, rank: int, size: int, shift: int) -> tuple[int, int, int, int]:
        """(element lo, hi, block lo, hi) of ``rank``'s part."""
        b_lo, b_hi = fmt.rank_blocks(self.n_blocks, rank, size, shift)
        be = self.block_elems
        return min(self.n, b_lo * be), min(self.n, b_hi * be), b_lo, b_hi


def packed_name(dtype: np.dtype) -> str:
    """The packed dataset of a dtype: its NumPy name (``float32``, ``float16``, ``uint64``)."""
    return np.dtype(dtype).name


def block_elems(dtype: np.dtype, block_bytes: int) -> int:
    return max(1, int(block_bytes) // np.dtype(dtype).itemsize)


def plan(arrays: list[tuple[str, np.ndarray, str]], block_bytes: int
         ) -> tuple[list[Entry], list[Packed]]:
    """Entries in the given order and packed datasets in order of first appearance.
    ``arrays``: (path, C-contiguous array, kind); 0-d arrays have kind ``scalar``."""
    entries: list[Entry] = []
    fill: dict[str, int] = {}
    dtypes: dict[str, np.dtype] = {}
    for path, a, kind in arrays:
        if a.ndim > MAX_NDIM:
            raise ValueError(f"{path}: {a.ndim} dimensions, at most {MAX_NDIM} are stored")
        name = packed_name(a.dtype)
        dtypes.setdefault(name, a.dtype)
        off = fill.get(name, 0)
        entries.append(Entry(path, name, kind, off, int(a.size), tuple(int(s) for s in a.shape)))
        fill[name] = off + int(a.size)
    packs = [Packed(n, dtypes[n], fill[n], block_elems(dtypes[n], block_bytes)) for n in fill]
    return entries, packs


def index_array(entries: list[Entry]) -> np.ndarray:
    """The ``/index`` dataset's rows (fixed-length strings: HDF5 reads them everywhere)."""
    width = max([len(e.path.encode()) for e in entries] + [1])
    dt = np.dtype([("path", f"S{width}"), ("packed", "S16"), ("kind", "S8"),
                   ("offset", "<i8"), ("count", "<i8"), ("ndim", "<i4"),
                   ("shape", "<i8", (MAX_NDIM,))])
    out = np.zeros(len(entries), dtype=dt)
    for i, e in enumerate(entries):
        out[i]["path"] = e.path.encode()
        out[i]["packed"] = e.packed.encode()
        out[i]["kind"] = e.kind.encode()
        out[i]["offset"], out[i]["count"], out[i]["ndim"] = e.offset, e.count, len(e.shape)
        out[i]["shape"][:len(e.shape)] = e.shape
    return out


def read_index(rows: np.ndarray, packs: dict[str, Packed]) -> list[Entry]:
    """Entries from ``/index`` rows, every field checked against ``packs`` (the file is
    untrusted): raises :class:`CheckpointError` naming the row."""
    need = ("path", "packed", "kind", "offset", "count", "ndim", "shape")
    if rows.dtype.names is None or any(n not in rows.dtype.names for n in need):
        raise CheckpointError("index: not the expected table")
    out: list[Entry] = []
    seen: set[str] = set()
    for i, r in enumerate(rows):
        try:
            path = bytes(r["path"]).decode("utf-8")
            name = bytes(r["packed"]).decode("ascii")
            kind = bytes(r["kind"]).decode("ascii")
        except UnicodeDecodeError:
            raise CheckpointError(f"index row {i}: undecodable text") from None
        off, count, ndim = int(r["offset"]), int(r["count"]), int(r["ndim"])
        parts = path.split("/")
        bad = None
        if parts[0] not in fmt.GROUPS or len(parts) < 2 or not all(parts) or path in seen:
            bad = f"invalid or repeated path {path!r}"
        elif name not in packs:
            bad = f"{path}: packed dataset {name!r} not in the file"
        elif kind not in KINDS:
            bad = f"{path}: unknown kind {kind!r}"
        elif not 0 <= ndim <= MAX_NDIM:
            bad = f"{path}: ndim {ndim}"
        if bad is None:
            shape = tuple(int(s) for s in r["shape"][:ndim])
            if (any(s < 0 for s in shape) or math.prod(shape) != count or off < 0
                    or off + count > packs[name].n or (kind == "scalar") != (ndim == 0)):
                bad = f"{path}: shape {shape}, offset {off}, count {count} do not fit " \
                      f"{name} ({packs[name].n} elements)"
        if bad:
            raise CheckpointError(f"index row {i}: {bad}")
        seen.add(path)
        out.append(Entry(path, name, kind, off, count, shape))
    return out


def pieces(entries: list[Entry], flat: dict[str, np.ndarray], lo: int, hi: int
           ) -> list[tuple[int, np.ndarray]]:
    """(element offset, 1-D view) of the parts of ``entries`` (of one packed dataset, in
    offset order) that lie in [lo, hi); ``flat``: path -> the tensor raveled (a view)."""
    out = []
    for e in entries:
        a, b = max(lo, e.offset), min(hi, e.offset + e.count)
        if a < b:
            out.append((a, flat[e.path][a - e.offset:b - e.offset]))
    return out


def coalesce(parts: list[tuple[int, np.ndarray]], small: int,
             dtype: np.dtype) -> list[tuple[int, np.ndarray]]:
    """Runs of consecutive pieces under ``small`` bytes copied into one buffer each (fewer,
    larger writes); large pieces stay views of the caller's arrays (no copy)."""
    out: list[tuple[int, np.ndarray]] = []
    run: list[tuple[int, np.ndarray]] = []

    def flush() -> None:
        if len(run) == 1:
            out.append(run[0])
        elif run:
            out.append((run[0][0], np.concatenate([p for _, p in run])))
        run.clear()

    for off, p in parts:
        if p.nbytes >= small:
            flush()
            out.append((off, p))
        else:
            run.append((off, p))
    flush()
    return out


def slab_digests(kind: str, parts: list[tuple[int, np.ndarray]], lo: int, hi: int,
                 be: int, dtype: np.dtype) -> np.ndarray:
    """Digests of the blocks of ``be`` elements covering [lo, hi) (lo on a block boundary),
    from the pieces that tile it; a block spanning pieces is assembled in a scratch buffer."""
    n_blocks = -(-(hi - lo) // be)
    out = np.empty(n_blocks, dtype=np.uint64)
    scratch = np.empty(min(be, max(0, hi - lo)), dtype=dtype)
    k = 0
    for b in range(n_blocks):
        s, e = lo + b * be, min(hi, lo + (b + 1) * be)
        while parts[k][0] + parts[k][1].size <= s:
            k += 1
        off, p = parts[k]
        if off + p.size >= e:
            out[b] = fmt.digest(kind, p[s - off:e - off])
            continue
        j, pos = k, s
        while pos < e:
            off, p = parts[j]
            take = min(e, off + p.size) - pos
            scratch[pos - s:pos - s + take] = p[pos - off:pos - off + take]
            pos += take
            j += 1
        out[b] = fmt.digest(kind, scratch[:e - s])
    return out
