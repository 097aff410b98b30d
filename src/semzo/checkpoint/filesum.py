"""The whole-file checksum of a checkpoint, checked before HDF5 parses a single byte of it.

libhdf5 trusts its metadata: one damaged byte of a superblock, an object header or a B-tree
can make it hang, crash or fail deep inside a collective (issue 12, defect 8). The block
digests inside the file cannot help, because HDF5 must parse the metadata to find them. So
every format-2 file carries, in its first :data:`USERBLOCK` bytes (an HDF5 *user block*,
which HDF5 and the HDF5 tools skip), a record of the digest of the whole file::

    SEMZO-CHECKPOINT-SUM 1\\n
    {"kind": "xxh64", "size": N, "block": B, "data": [[offset, length], ...]}\\n
    xxh64:0123456789abcdef\\n
    NUL bytes up to USERBLOCK

The bytes after the user block are cut into segments: the ``data`` ranges (the packed
datasets, see :mod:`semzo.checkpoint.packed`) and the gaps between them (HDF5 metadata), each
cut into pieces of ``B`` bytes from its own start. The digest is ``digest(kind, JSON line ||
segment digests as uint64 LE)``. A data range's pieces are exactly the blocks whose digests
the writer already computed from memory, so sealing a file reads back only the metadata gaps
(:func:`seal`, rank 0, after the file is closed and before it is renamed to its final name:
a checkpoint under its final name always has its record). Any changed, missing or added
byte anywhere fails the check: in the JSON line (it is hashed as written), in the digest
line, in the padding (it must be NUL), in the data or metadata (segment digests), or the
length (``size``). :func:`check_file` verifies with one streaming read (bounded memory);
:func:`check_collective` runs it on rank 0 and broadcasts the verdict.

Files written before this record existed (format 1) start with the HDF5 signature: they are
accepted with a warning after a cheaper check of the superblock (the end-of-file address
must equal the file size), see docs/checkpoint.md.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..runtime import get_logger
from . import format as fmt
from .format import CheckpointError

log = get_logger(__name__)

USERBLOCK = 4096
MAGIC = b"SEMZO-CHECKPOINT-SUM 1\n"
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
MAX_RANGES = 64
READ_BYTES = 16 << 20                # one read of the streaming check: bounded memory
_WARNED: set[str] = set()            # format-1 files already reported (one warning each)


def _segments(size: int, block: int, ranges: list[tuple[int, int]]):
    """(start, end, in data range) of every segment of bytes [USERBLOCK, size), in order."""
    pos = USERBLOCK
    for off, n in [*ranges, (size, 0)]:
        for s in range(pos, off, block):                      # a metadata gap
            yield s, min(off, s + block), False
        for s in range(off, off + n, block):                  # a data range
            yield s, min(off + n, s + block), True
        pos = off + n


def _n_segments(size: int, block: int, ranges) -> int:
    pos, n_seg = USERBLOCK, 0
    for off, n in [*ranges, (size, 0)]:
        n_seg += -(-(off - pos) // block) + -(-n // block)
        pos = off + n
    return n_seg


def _combine(kind: str, text: bytes, seg: np.ndarray) -> str:
    d = np.ascontiguousarray(seg, dtype="<u8")
    return fmt._hex(kind, fmt.digest(kind, text + d.tobytes()))


def _valid_ranges(ranges, size: int) -> list[tuple[int, int]]:
    """Sorted, disjoint ranges inside [USERBLOCK, size); raises ValueError otherwise."""
    if not isinstance(ranges, list) or len(ranges) > MAX_RANGES:
        raise ValueError("data ranges: not a list of at most 64")
    out, pos = [], USERBLOCK
    for r in ranges:
        if (not isinstance(r, list) or len(r) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise ValueError(f"data range {r!r}: not [offset, length]")
        off, n = r
        if off < pos or n < 1 or off + n > size:
            raise ValueError(f"data range {r!r}: overlaps, or outside the file")
        out.append((off, n))
        pos = off + n
    return out


def seal(path: str | Path, kind: str, block: int,
         data: list[tuple[int, int, np.ndarray]]) -> str:
    """Write the whole-file record into the user block of the closed file ``path``; returns
    the digest text. Call on one rank, after every rank closed the file.

    ``data``: (file offset, length in bytes, block digests) of every packed dataset whose
    blocks of ``block`` bytes (from its offset) were hashed with ``kind`` by the writer;
    the rest of the file is read back here. The record is fsynced before returning.
    """
    path = Path(path)
    data = sorted((int(o), int(n), d) for o, n, d in data if n > 0)
    ranges = [(o, n) for o, n, _ in data]
    known = {o: d for o, _, d in data}
    with open(path, "r+b") as fh:
        size = os.fstat(fh.fileno()).st_size
        _valid_ranges([list(r) for r in ranges], size)
        seg = np.empty(_n_segments(size, block, ranges), dtype=np.uint64)
        i, pos = 0, USERBLOCK
        for off, n in [*ranges, (size, 0)]:
            for s in range(pos, off, block):
                fh.seek(s)
                seg[i] = fmt.digest(kind, fh.read(min(off, s + block) - s))
                i += 1
            if n:
                d = np.asarray(known[off], dtype=np.uint64)
                if d.shape != (-(-n // block),):
                    raise ValueError(f"{path}: {d.size} digests for {n} bytes in blocks of "
                                     f"{block}")
                seg[i:i + d.size] = d
                i += d.size
            pos = off + n
        text = json.dumps({"kind": kind, "size": size, "block": block,
                           "data": [list(r) for r in ranges]}, separators=(",", ":")).encode()
        total = _combine(kind, text, seg)
        record = MAGIC + text + b"\n" + total.encode() + b"\n"
        if len(record) > USERBLOCK:
            raise ValueError(f"{path}: whole-file record of {len(record)} bytes does not fit "
                             f"the {USERBLOCK}-byte user block")
        fh.seek(0)
        fh.write(record.ljust(USERBLOCK, b"\0"))
        fh.flush()
        os.fsync(fh.fileno())
    return total


class _SizeError(ValueError):
    pass


def _parse(head: bytes, size: int) -> tuple[str, int, list[tuple[int, int]], bytes, str]:
    """(kind, block, ranges, JSON line, digest text) of a record; ValueError when malformed."""
    body = head[len(MAGIC):]
    lines = body.split(b"\n", 2)
    if len(lines) != 3:
        raise ValueError("record: not three lines")
    text, want, pad = lines
    if pad.strip(b"\0"):
        raise ValueError("record: bytes after the record are not NUL")
    rec = json.loads(text.decode("utf-8"))
    if not isinstance(rec, dict) or set(rec) != {"kind", "size", "block", "data"}:
        raise ValueError("record: unexpected fields")
    kind, rsize, block = rec["kind"], rec["size"], rec["block"]
    if kind not in fmt.CHECKSUM_KINDS:
        raise ValueError(f"record: unknown checksum kind {kind!r}")
    if not isinstance(block, int) or not 4096 <= block <= 1 << 30:
        raise ValueError(f"record: block size {block!r}")
    if rsize != size:
        raise _SizeError(f"the file has {size} bytes, its record says {rsize!r} "
                         f"(truncated or extended)")
    return kind, block, _valid_ranges(rec["data"], size), text, want.decode("ascii")


def check_file(path: str | Path) -> tuple[int, str | None]:
    """(format, error) of ``path`` from its bytes alone, never parsed by HDF5: format 2 (a
    whole-file record) or 1 (no record: an HDF5 file written before records existed);
    error is None when the file passes, else the reason. One streaming read on the calling
    rank; memory stays under :data:`READ_BYTES`."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(USERBLOCK)
            if head.startswith(HDF5_SIGNATURE):
                return 1, _legacy_superblock(head, size)
            if not head.startswith(MAGIC):
                return 2, "not a semzo checkpoint, or its first bytes are damaged"
            if len(head) < USERBLOCK:
                return 2, f"truncated: {size} bytes"
            try:
                kind, block, ranges, text, want = _parse(head, size)
            except _SizeError as exc:
                return 2, str(exc)
            except (ValueError, UnicodeDecodeError, RecursionError) as exc:
                return 2, f"whole-file record unreadable ({type(exc).__name__}: {exc})"
            seg = np.empty(_n_segments(size, block, ranges), dtype=np.uint64)
            buf = np.empty(READ_BYTES + block, dtype=np.uint8)
            i, batch = 0, []
            for s, e, _ in _segments(size, block, ranges):
                if batch and e - batch[0][0] > buf.size:
                    i = _hash_batch(fh, buf, batch, seg, i, kind)
                    batch = []
                batch.append((s, e))
            if batch:
                i = _hash_batch(fh, buf, batch, seg, i, kind)
            if i != seg.size:
                return 2, "truncated while reading"
    except OSError as exc:
        return 2, f"cannot read: {exc.strerror or exc}"
    got = _combine(kind, text, seg)
    if got != want:
        return 2, f"whole-file checksum mismatch (damaged: {got}, recorded {want[:40]!r})"
    return 2, None


def _hash_batch(fh, buf: np.ndarray, batch, seg: np.ndarray, i: int, kind: str) -> int:
    """Read the consecutive segments of ``batch`` with one read and hash each one."""
    start, end = batch[0][0], batch[-1][1]
    fh.seek(start)
    n = fh.readinto(memoryview(buf)[:end - start])
    for s, e in batch:
        if e - start > n:
            return i             # short read: the caller reports truncation
        seg[i] = fmt.digest(kind, buf[s - start:e - start])
        i += 1
    return i


def _legacy_superblock(head: bytes, size: int) -> str | None:
    """A format-1 file: the superblock's end-of-file address must be the file size (a
    damaged one made HDF5 hang in issue 12); None when it is."""
    if len(head) < 48:
        return f"truncated: {size} bytes"
    version = head[8]
    if version in (0, 1):
        o_size, eof_at, base_at = head[13], 40 if version == 0 else 44, 24 if version == 0 \
            else 28
    elif version in (2, 3):
        o_size, eof_at, base_at = head[9], 28, 12
    else:
        return f"unknown HDF5 superblock version {version}"
    if o_size != 8:
        return f"HDF5 superblock: offsets of {o_size} bytes (damaged)"
    base = int.from_bytes(head[base_at:base_at + 8], "little")
    eof = int.from_bytes(head[eof_at:eof_at + 8], "little")
    if base != 0 or eof != size:
        return (f"HDF5 superblock says the file ends at byte {eof} (base {base}), the file has "
                f"{size} bytes (truncated or damaged)")
    return None


def quiet_barrier(comm: MPI.Intracomm) -> None:
    """A barrier whose waiting ranks sleep between polls instead of spinning: while rank 0
    reads the file, the others leave it the CPU (ranks are often oversubscribed)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def check_collective(path: str | Path, comm: MPI.Intracomm) -> int:
    """:func:`check_file` on rank 0, the verdict broadcast: returns the format (1 or 2) on
    every rank, or raises the same :class:`CheckpointError` on every rank. Collective.
    A format-1 file that passes is reported once in a warning (rank 0)."""
    res = None
    if comm.Get_rank() == 0:
        res = check_file(path)
        if res[1] is None and res[0] == 1 and str(path) not in _WARNED:
            _WARNED.add(str(path))
            log.warning("%s: written before whole-file checksums (format 1): accepted, but its "
                        "HDF5 metadata is parsed unverified; a new save replaces it", path)
    quiet_barrier(comm)
    version, err = comm.bcast(res, root=0)
    if err:
        raise CheckpointError(f"{path}: {err}")
    return version
