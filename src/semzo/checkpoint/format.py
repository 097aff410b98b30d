"""Checkpoint format constants, digests, names, and the block layout of format 1.

Format 2 (written now) is one HDF5 file (``ckpt-000000100.h5``) with a user block holding
the whole-file record (:mod:`.filesum`)::

    /                       attrs: format, format_version (2), layout ("packed"),
                            semzo_version, semzo_deck (resolved TOML), world_size, step,
                            created, topology (JSON), metrics (JSON), shards_path,
                            shards_manifest, model_meta, checksum_kind, block_bytes,
                            n_params, param_bytes, index_checksum; attrs_checksum last
    /index                  one row per tensor (see :mod:`.packed`)
    /packed/<dtype>         the tensors of that dtype, concatenated (1-D)
    /digests/<dtype>        one digest per block of block_bytes bytes of /packed/<dtype>
    /state                  the ZO state's scalars as attributes (nested dicts are subgroups;
                            attr semzo_keys lists the keys in order); its arrays are tensors
                            ``state/...`` of the index
    /params, /per_rank, /extras   (empty groups: their tensors are in the index)
    /metrics                attrs: loss and other figures at this step

Tensor paths: ``params/<hf name>`` (global shape), ``state/<key>[/<key>...]``,
``per_rank/<name>`` ((P, ...) one row per rank of the run that wrote it), ``extras/<name>``.

Format 1 (read only, :mod:`.legacy`) stored every tensor as its own dataset, cut along its
first axis into blocks of ``block_rows`` rows (:class:`BlockLayout`), its digests in the
attribute ``digests``. In both formats blocks, not ranks, are the unit of checksums, so a
file written at P ranks verifies at any other rank count: ranks own contiguous runs of whole
blocks (:func:`rank_blocks`).
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from .xxh64 import xxh64

FORMAT = "semzo-checkpoint"
FORMAT_VERSION = 2
MAX_BLOCKS = 4096          # keeps the digests attribute under HDF5's 64 KiB compact limit
ALIGN_BYTES = 4096         # blocks are whole pages where the row size allows
CHECKSUM_KINDS = ("xxh64", "crc32", "blake2b")
GROUPS = ("params", "state", "per_rank", "extras")


class CheckpointError(Exception):
    """A checkpoint file that is incomplete, corrupt or of an unknown format."""


# --------------------------------------------------------------------------- the manifest
#: the datasets of shards.h5 that fix which samples each rank holds (a resume checks them)
MANIFEST = ("rank_offsets", "quota", "cluster_rank", "cluster_node", "cluster_switch",
            "rank_node", "node_switch")


def manifest_checksum(shards_path: str | Path) -> str:
    """crc32 over the manifest datasets of a ``shards.h5`` (placement and rank offsets), as
    ``crc32:xxxxxxxx``. Reads on the calling rank only."""
    c = 0
    with h5py.File(shards_path, "r") as f:
        for name in MANIFEST:
            if name in f:
                a = np.ascontiguousarray(f[name][()])
                c = zlib.crc32(f"{name}:{a.dtype.str}:{a.shape};".encode(), c)
                c = zlib.crc32(a.tobytes(), c)
    return f"crc32:{c:08x}"


# --------------------------------------------------------------------------- digests
def digest(kind: str, buf) -> int:
    """Digest of a bytes-like object as an unsigned 64-bit integer: XXH64 (seed 0), crc32
    zero-extended, or the first 8 bytes of blake2b. All release the GIL for large buffers."""
    mv = memoryview(buf).cast("B")
    if kind == "xxh64":
        return xxh64(mv)
    if kind == "crc32":
        return zlib.crc32(mv)
    if kind == "blake2b":
        return int.from_bytes(hashlib.blake2b(mv, digest_size=8).digest(), "little")
    raise ValueError(f"unknown checksum kind {kind!r}")


def combine(kind: str, digests: np.ndarray) -> str:
    """The dataset checksum: ``kind:hex`` of the digest of its block digests (uint64 LE)."""
    d = np.ascontiguousarray(digests, dtype="<u8")
    return _hex(kind, digest(kind, d.view(np.uint8)))


def _hex(kind: str, value: int) -> str:
    return f"{kind}:{value:0{8 if kind == 'crc32' else 16}x}"


# --------------------------------------------------------------------------- block layout
@dataclass(frozen=True)
class BlockLayout:
    """How one dataset of ``shape``/``itemsize`` is cut into checksum blocks."""

    n_rows: int
    block_rows: int
    n_blocks: int

    @classmethod
    def of(cls, shape: tuple, itemsize: int, block_bytes: int) -> BlockLayout:
        shape = tuple(int(s) for s in shape) or (1,)
        n_rows = shape[0]
        row_bytes = itemsize * math.prod(shape[1:])
        if n_rows == 0 or row_bytes == 0:
            return cls(n_rows, 1, 0)
        # rows per block: a multiple of the rows that make whole pages, near block_bytes
        unit = ALIGN_BYTES // math.gcd(row_bytes, ALIGN_BYTES)
        if unit * row_bytes > block_bytes:
            unit = 1
        rows = max(unit, (block_bytes // row_bytes) // unit * unit)
        rows = max(rows, -(-n_rows // MAX_BLOCKS))
        rows = min(rows, n_rows)
        return cls(n_rows, rows, -(-n_rows // rows))

    def block_range(self, b_lo: int, b_hi: int) -> tuple[int, int]:
        """Rows [lo, hi) of blocks [b_lo, b_hi)."""
        return min(self.n_rows, b_lo * self.block_rows), min(self.n_rows, b_hi * self.block_rows)


def rank_blocks(n_blocks: int, rank: int, size: int, shift: int) -> tuple[int, int]:
    """Blocks [b_lo, b_hi) owned by ``rank``: balanced contiguous parts in rank order rotated
    by ``shift``, so that a run of one-block datasets is spread round-robin over the ranks."""
    part = (rank - shift) % size
    return -(-n_blocks * part // size), -(-n_blocks * (part + 1) // size)


def rank_rows(layout: BlockLayout, rank: int, size: int, shift: int) -> tuple[int, int, int, int]:
    """(row lo, row hi, block lo, block hi) of ``rank``'s part of a dataset."""
    b_lo, b_hi = rank_blocks(layout.n_blocks, rank, size, shift)
    lo, hi = layout.block_range(b_lo, b_hi)
    return lo, hi, b_lo, b_hi


def all_rank_rows(layout: BlockLayout, size: int, shift: int) -> list[tuple[int, int]]:
    """[(lo, hi)] of every rank (what each one reads or writes)."""
    return [rank_rows(layout, r, size, shift)[:2] for r in range(size)]


def block_digests(kind: str, rows: np.ndarray, block_rows: int) -> np.ndarray:
    """Digests (uint64) of consecutive blocks of ``block_rows`` rows of ``rows`` (C-contiguous,
    first row at a block boundary; the last block may be short)."""
    n = int(rows.shape[0])
    return np.array([digest(kind, np.ascontiguousarray(rows[s:s + block_rows]))
                     for s in range(0, n, block_rows)], dtype=np.uint64)


# --------------------------------------------------------------------------- attributes
def attrs_checksum(f: h5py.File, kind: str) -> str:
    """Digest over every attribute of every object in the file (sorted by path, then name),
    except the root ``attrs_checksum`` itself. Values are canonicalized as h5py reads them,
    so the writer (reading back its own attributes) and a reader compute the same text."""
    parts: list[bytes] = []

    def add(path: str, obj) -> None:
        for name in sorted(obj.attrs):
            if path == "/" and name == "attrs_checksum":
                continue
            parts.append(f"{path}@{name}=".encode() + _canon(obj.attrs[name]))

    add("/", f)
    names: list[str] = []
    f.visit(names.append)
    for n in sorted(names):
        add("/" + n, f[n])
    return _hex(kind, digest(kind, b"|".join(parts)))


def root_attrs(f: h5py.File, version: int, other: str) -> dict:
    """The root attributes of a checkpoint file of format ``version``, checked: the format
    name, the version (``other``: the rest of the message when it differs), the metadata
    checksum (written last, so its absence means an incomplete file) and its kind. Raises
    :class:`CheckpointError`."""
    attrs = {k: from_attr(v) for k, v in f.attrs.items()}
    if attrs.get("format") != FORMAT:
        raise CheckpointError(f"not a semzo checkpoint (format {attrs.get('format')!r})")
    if int(attrs.get("format_version", 0)) != version:
        raise CheckpointError(f"format version {attrs.get('format_version')}{other}")
    if "attrs_checksum" not in attrs:
        raise CheckpointError("incomplete: no attrs_checksum (written last)")
    kind = str(attrs.get("checksum_kind", ""))
    if kind not in CHECKSUM_KINDS:
        raise CheckpointError(f"unknown checksum kind {kind!r}")
    if attrs_checksum(f, kind) != attrs["attrs_checksum"]:
        raise CheckpointError("metadata checksum mismatch (attributes altered)")
    return attrs


def _canon(v) -> bytes:
    if isinstance(v, str):
        return b"s" + v.encode("utf-8")
    if isinstance(v, bytes):
        return b"b" + v
    a = np.asarray(v)
    if a.dtype.kind == "O":
        return b"o" + json.dumps([str(x) for x in a.ravel()]).encode()
    return f"{a.dtype.str}{a.shape}".encode() + a.tobytes()


# --------------------------------------------------------------------------- values
def to_host(a) -> np.ndarray:
    """A C-contiguous NumPy array of ``a`` (CuPy arrays are copied to the host)."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        a = a.get()
    a = np.asarray(a)      # (np.ascontiguousarray would turn 0-d arrays into 1-d ones)
    return a if a.flags.c_contiguous else a.copy(order="C")


def host_or_device(a):
    """``a`` as a C-contiguous array where it lives: a CuPy array stays on its device (the
    writer copies to the host only the rows this rank writes), anything else as
    :func:`to_host` gives it."""
    if hasattr(a, "get") and not isinstance(a, np.ndarray):
        import cupy  # a device array: cupy is loaded
        return cupy.ascontiguousarray(a)
    return to_host(a)


def scalar_attr(v):
    """A Python/NumPy scalar as the attribute value HDF5 stores exactly (None is refused)."""
    if isinstance(v, (bool, np.bool_)):
        return np.bool_(v)
    if isinstance(v, (int, np.integer)):
        if not -2**63 <= int(v) < 2**63:
            raise TypeError(f"integer {v} does not fit in int64")
        return np.int64(v) if isinstance(v, int) else v
    if isinstance(v, (float, np.floating, str)):
        return v
    raise TypeError(f"unsupported value {v!r} of type {type(v).__name__}")


def from_attr(v):
    """An attribute value back as Python int/float/bool/str (arrays stay arrays)."""
    if isinstance(v, np.bool_):
        return bool(v)
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.float64):
        return float(v)
    return v


def checkpoint_name(step: int) -> str:
    return f"ckpt-{int(step):09d}.h5"


def step_of(name: str) -> int | None:
    """The step of a checkpoint file name, or None for other names (temporaries included)."""
    if name.startswith("ckpt-") and name.endswith(".h5"):
        core = name[5:-3]
        if core.isdigit():
            return int(core)
    return None
