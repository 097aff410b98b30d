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

import bisect
import ctypes
import errno
import json
import mmap
import os
import time
from dataclasses import dataclass
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
SHM_DIR = "/dev/shm"
SHARED_MIN_BYTES = 64 << 20          # smaller loads use private buffers
ALIGN = 4096                         # O_DIRECT offsets, lengths and buffers: whole pages
DIRECT_ENV = "SEMZO_CHECKPOINT_DIRECT"   # "0": never read with O_DIRECT
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


def _head_error(head: bytes, size: int):
    """(format, error or None, parsed record or None) of a file's first USERBLOCK bytes."""
    if head.startswith(HDF5_SIGNATURE):
        return 1, _legacy_superblock(head, size), None
    if not head.startswith(MAGIC):
        return 2, "not a semzo checkpoint, or its first bytes are damaged", None
    if len(head) < USERBLOCK:
        return 2, f"truncated: {size} bytes", None
    try:
        return 2, None, _parse(head, size)
    except _SizeError as exc:
        return 2, str(exc), None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        return 2, f"whole-file record unreadable ({type(exc).__name__}: {exc})", None


def check_file(path: str | Path) -> tuple[int, str | None]:
    """(format, error) of ``path`` from its bytes alone, never parsed by HDF5: format 2 (a
    whole-file record) or 1 (no record: an HDF5 file written before records existed);
    error is None when the file passes, else the reason. One streaming read on the calling
    rank; memory stays under :data:`READ_BYTES`."""
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(USERBLOCK)
            version, err, rec = _head_error(head, size)
            if err or version == 1:
                return version, err
            kind, block, ranges, text, want = rec
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


def empty_bytes(nbytes: int) -> np.ndarray:
    """An uninitialized uint8 array; large ones on transparent huge pages where the system
    allows it. Faulting in fresh 4 KiB pages dominated a load on a virtual machine: reading
    0.45 GiB per rank into np.empty took 18 s, 8 s on huge pages, 1.5 s into touched memory
    (4 ranks, 2 cores)."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < (64 << 20) or advice is None:
        return np.empty(nbytes, dtype=np.uint8)
    m = mmap.mmap(-1, nbytes)
    try:
        m.madvise(advice)
    except OSError:
        pass
    return np.frombuffer(m, dtype=np.uint8, count=nbytes)


@dataclass
class Verified:
    """The outcome of :func:`read_collective` on a format-2 file (the same on every rank but
    ``bufs`` and ``held``). ``seg``: every segment digest of the file, in order;
    ``range_seg[i]``: the index in ``seg`` of data range ``i``'s first block (its block
    digests are ``seg[range_seg[i]:range_seg[i] + n_blocks]``); ``bufs[i]``: data range
    ``i``'s bytes (all of them with ``keep="all"``; with ``keep="mine"`` only
    ``held[i]``, relative to the range start, is filled in); ``parts[r][i]``: the bytes of
    range ``i`` that rank ``r`` read and hashed."""

    kind: str
    block: int
    ranges: list[tuple[int, int]]
    seg: np.ndarray
    range_seg: list[int]
    bufs: list[np.ndarray | None]
    parts: list[list[tuple[int, int]]]


class _NodeBuffer:
    """The data ranges in one shared-memory file per node (``/dev/shm``): the ranks of a
    node write disjoint parts of it with ``pwrite`` (each byte once per node, not once per
    rank), then each maps it copy-on-write (``MAP_PRIVATE``): every rank's arrays are
    private (a write never reaches another rank) but share the node's pages until written,
    so a load costs one copy of the file per node and a rank pays for a private page only
    when it writes one (frozen parameters are never copied). Written with ``pwrite``, not
    through a mapping: the file's pages are allocated by the write without being zeroed
    first or faulted in one by one, and a full ``/dev/shm`` is an ``ENOSPC`` error
    (:attr:`failed`, then private buffers on every rank: :func:`read_collective`), never a
    SIGBUS. The file is unlinked as soon as every rank has mapped it."""

    def __init__(self, node: MPI.Intracomm, ranks: list[int], name: str, fd: int,
                 sizes: list[int], starts: list[int], total: int):
        self.node, self.ranks, self.name, self.fd = node, ranks, name, fd
        self.sizes, self.starts = sizes, starts
        self.total = total
        self.failed: str | None = None

    def write(self, i: int, lo: int, view: memoryview) -> None:
        """Bytes ``lo ..`` of data range ``i``; after a failed write (:attr:`failed`), none."""
        if self.failed is not None:
            return
        pos, done = self.starts[i] + lo, 0
        try:
            while done < len(view):
                done += os.pwrite(self.fd, view[done:], pos + done)
        except OSError as exc:
            self.failed = f"{self.name}: {exc.strerror or exc}"

    def discard(self) -> None:
        """Close and remove the file without mapping it. Collective over the node."""
        os.close(self.fd)
        self.node.Barrier()
        if self.node.Get_rank() == 0:
            os.unlink(self.name)
        self.node.Free()

    @classmethod
    def open(cls, comm: MPI.Intracomm, sizes: list[int]) -> _NodeBuffer | None:
        """Collective over ``comm``; None (on every rank) when shared memory is unusable
        or the data is small."""
        starts, pos = [], 0
        for n in sizes:
            starts.append(pos)
            pos += -(-n // mmap.PAGESIZE) * mmap.PAGESIZE
        total = pos
        use = (total >= SHARED_MIN_BYTES and os.path.isdir(SHM_DIR)
               and os.environ.get("SEMZO_CHECKPOINT_SHM", "1") != "0")
        if not comm.allreduce(int(use), op=MPI.MIN):
            return None
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        name, fd, err, created = None, -1, None, None
        if node.Get_rank() == 0:
            name = os.path.join(SHM_DIR, f"semzo-ckpt-{os.getpid()}-{os.urandom(6).hex()}")
            try:
                fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                created = name
                os.ftruncate(fd, total)       # pages: allocated by the writes
            except OSError as exc:
                err = str(exc)
        name = node.bcast(name if err is None else None, root=0)
        if name is not None and node.Get_rank() != 0:
            try:
                fd = os.open(name, os.O_RDWR)
            except OSError as exc:
                err = str(exc)
        ranks = node.allgather(comm.Get_rank())
        buf = None
        if name is not None and err is None:
            try:
                buf = cls(node, ranks, name, fd, sizes, starts, total)
            except (OSError, ValueError) as exc:    # mapping failed: agree and fall back
                err = str(exc)
        ok = comm.allreduce(int(buf is not None), op=MPI.MIN)
        if not ok:
            if fd >= 0:
                os.close(fd)
            node.Barrier()
            if created is not None:
                os.unlink(created)
            node.Free()
            log.debug("checkpoint read: no shared node buffer (%s); private buffers", err)
            return None
        return buf

    def rest(self, parts: list[list[tuple[int, int]]]) -> list[tuple[int, int, int]]:
        """(range, lo, hi) that this rank fills beyond its own segments: the bytes no rank
        of this node reads while hashing, split evenly over the node's ranks."""
        m, k = self.node.Get_size(), self.node.Get_rank()
        mine: list[tuple[int, int, int]] = []
        for i, n in enumerate(self.sizes):
            covered = sorted(parts[r][i] for r in self.ranks if parts[r][i][1] > parts[r][i][0])
            pos, gaps = 0, []
            for lo, hi in covered:
                if lo > pos:
                    gaps.append((pos, lo))
                pos = max(pos, hi)
            if pos < n:
                gaps.append((pos, n))
            for lo, hi in gaps:
                a, b = lo + (hi - lo) * k // m, lo + (hi - lo) * (k + 1) // m
                if b > a:
                    mine.append((i, a, b))
        return mine

    def private(self) -> list[np.ndarray]:
        """Every rank's copy-on-write views, after the node's ranks have filled the file.
        Collective over the node."""
        self.node.Barrier()
        m = mmap.mmap(self.fd, self.total, flags=mmap.MAP_PRIVATE,
                      prot=mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(self.fd)
        self.node.Barrier()
        if self.node.Get_rank() == 0:
            os.unlink(self.name)
        self.node.Free()
        whole = np.frombuffer(m, dtype=np.uint8)
        return [whole[s:s + n] for s, n in zip(self.starts, self.sizes)]


def _owned(n_seg: int, rank: int, size: int) -> tuple[int, int]:
    return n_seg * rank // size, n_seg * (rank + 1) // size


def _rank_parts(segs, ranges, size: int) -> list[list[tuple[int, int]]]:
    """parts[r][i]: (lo, hi) bytes of data range i (relative to its start) in rank r's
    segments; (0, 0) when none."""
    starts = {off: i for i, (off, _) in enumerate(ranges)}
    where = []                                 # data range of every segment, or -1
    cur = -1
    for s, e, data in segs:
        if data and s in starts:
            cur = starts[s]
        where.append(cur if data else -1)
    out = []
    for r in range(size):
        a, b = _owned(len(segs), r, size)
        part = [[None, None] for _ in ranges]
        for k in range(a, b):
            i = where[k]
            if i < 0:
                continue
            lo, hi = segs[k][0] - ranges[i][0], segs[k][1] - ranges[i][0]
            p = part[i]
            p[0] = lo if p[0] is None else p[0]
            p[1] = hi
        out.append([(p[0], p[1]) if p[0] is not None else (0, 0) for p in part])
    return out


def _libc_mincore():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.mincore
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    f.restype = ctypes.c_int
    return f


_MINCORE = _libc_mincore()


class _FileReader:
    """Byte ranges of a file into one page-aligned scratch buffer, each from where it is
    cheapest: pages already in the page cache (``mincore``) with a plain ``pread``, the
    others with ``O_DIRECT`` (the disk writes straight into the scratch buffer: no page-cache
    pages to allocate, fill and copy out, which cost more CPU than the copy it saves on a
    cold 1 GiB load at 4 ranks on 2 cores). Where ``O_DIRECT`` is refused (tmpfs, some
    network file systems), ``direct`` is False or ``SEMZO_CHECKPOINT_DIRECT=0``, every read
    is a plain one."""

    def __init__(self, path, direct: bool = True):
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size
        self.dfd, self.map, self.addr = -1, None, 0
        self.buf = None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        if (direct and hasattr(os, "O_DIRECT") and _MINCORE is not None and self.size
                and os.environ.get(DIRECT_ENV, "1") != "0"):
            try:
                self.dfd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.map = mmap.mmap(self.fd, self.size, prot=mmap.PROT_READ)
                self.addr = np.frombuffer(self.map, dtype=np.uint8).ctypes.data
            except (OSError, ValueError):
                self.close()
                self.dfd = -1

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        for fd in (self.dfd, self.fd):
            if fd >= 0:
                os.close(fd)
        self.dfd = self.fd = -1

    def _cached(self, off: int, n: int) -> bool:
        """True when every page of bytes [off, off + n) is in the page cache."""
        pages = -(-n // mmap.PAGESIZE)
        vec = np.zeros(pages, dtype=np.uint8)
        if _MINCORE(self.addr + off, n, vec.ctypes.data) != 0:
            return True                       # unknown: a plain read is always correct
        return bool(np.all(vec & 1))

    def _fill(self, fd: int, view: memoryview, off: int, need: int) -> int:
        got = 0
        while got < need:
            n = os.preadv(fd, [view[got:]], off + got)
            if n <= 0:
                break
            got += n
        return got

    def read(self, off: int, n: int) -> memoryview | None:
        """A view of bytes [off, off + n) of the file (valid until the next call), or None
        when the file ends before them."""
        if off + n > self.size:
            return None                       # the file ends before them
        a = off - off % ALIGN
        length = -(-(off + n - a) // ALIGN) * ALIGN
        if self.buf is None or self.buf.size < length:
            self.buf = np.frombuffer(mmap.mmap(-1, max(length, READ_BYTES + 2 * ALIGN)),
                                     dtype=np.uint8)      # mmap: page-aligned
        view = memoryview(self.buf)[:length]
        got = -1
        if self.dfd >= 0 and not self._cached(a, min(length, self.size - a)):
            try:
                got = self._fill(self.dfd, view, a, off + n - a)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.dfd = -1                 # O_DIRECT refused here: plain reads
        if got < 0:
            got = self._fill(self.fd, view[off - a:off - a + n], off, n) + (off - a)
        if got < off + n - a:
            return None
        return view[off - a:off - a + n]


def read_collective(path: str | Path, comm: MPI.Intracomm, keep: str = "none"
                    ) -> tuple[int, Verified | None]:
    """The whole-file check, split over the ranks of ``comm``, before HDF5 parses a byte:
    rank ``r`` reads and hashes the ``r``-th run of the file's segments (one read of every
    byte in all, no rank waits for another's whole-file pass), the segment digests are
    allgathered and every rank combines them and compares with the record. Collective;
    returns ``(format, Verified or None)``: format 1 (no record; its superblock checked as
    in :func:`check_file`) gives None. Raises the same :class:`CheckpointError` on every
    rank when the file is damaged, truncated or unreadable.

    ``keep``: ``none`` (hash only; bounded memory), ``mine`` (each rank keeps the data-range
    bytes it hashed, in a buffer per range), ``all`` (each rank also reads the rest of every
    data range into its buffers: every rank holds every data byte; on one node the page
    cache serves the bytes another rank already read). The block digests of the data ranges
    are the packed datasets' block digests, so the caller compares them with the stored ones
    instead of hashing the data a second time.
    """
    if keep not in ("none", "mine", "all"):
        raise ValueError(f"keep: {keep!r}")
    rank, size = comm.Get_rank(), comm.Get_size()
    head_size = None
    if rank == 0:
        try:
            with open(path, "rb") as fh:
                head_size = (fh.read(USERBLOCK), os.fstat(fh.fileno()).st_size, None)
        except OSError as exc:
            head_size = (b"", 0, f"cannot read: {exc.strerror or exc}")
    head, size_b, err = comm.bcast(head_size, root=0)
    rec = None
    if err is None:
        version, err, rec = _head_error(head, size_b)
    else:
        version = 2
    if rank == 0 and version == 1 and err is None and str(path) not in _WARNED:
        _WARNED.add(str(path))
        log.warning("%s: written before whole-file checksums (format 1): accepted, but its "
                    "HDF5 metadata is parsed unverified; a new save replaces it", path)
    if err:
        raise CheckpointError(f"{path}: {err}")
    if version == 1:
        return 1, None
    kind, block, ranges, text, want = rec
    segs = list(_segments(size_b, block, ranges))
    a, b = _owned(len(segs), rank, size)
    parts = _rank_parts(segs, ranges, size)
    range_seg, starts = [], {off: i for i, (off, _) in enumerate(ranges)}
    for k, (s, _, data) in enumerate(segs):
        if data and s in starts:
            range_seg.append(k)
    bufs: list[np.ndarray | None] = [None] * len(ranges)
    rest: list[tuple[int, int, int]] = []
    shared = None
    if keep == "all":
        shared = _NodeBuffer.open(comm, [n for _, n in ranges])
        if shared is not None:              # one copy per node: read each byte once
            rest = shared.rest(parts)
        else:                               # a private copy: every byte, own and rest
            bufs = [empty_bytes(n) for _, n in ranges]
            for i, (lo, hi) in enumerate(parts[rank]):
                n = ranges[i][1]
                rest += [(i, hi, n), (i, 0, lo)] if hi > lo else [(i, 0, n)]
    elif keep == "mine":
        bufs = [empty_bytes(n) for _, n in ranges]

    def to_bufs(i: int, lo: int, view: memoryview) -> None:
        bufs[i][lo:lo + len(view)] = np.frombuffer(view, dtype=np.uint8)

    sink = shared.write if shared is not None else to_bufs
    mine = np.empty(b - a, dtype=np.uint64)
    err = None
    try:
        err = _read_segments(path, segs[a:b], ranges, sink if keep != "none" else None,
                             mine, kind, rest)
    except OSError as exc:
        err = f"cannot read: {exc.strerror or exc}"
    if shared is not None:
        if comm.allreduce(int(shared.failed is not None), op=MPI.MAX):
            log.debug("checkpoint read: shared node buffer not written (%s); private "
                      "buffers", shared.failed or "another rank failed")
            shared.discard()                # collective over the node
            bufs = [empty_bytes(n) for _, n in ranges]
            if err is None:                 # every data byte again, into private memory
                try:
                    err = _read_segments(path, [], ranges, to_bufs, mine[:0], kind,
                                         [(i, 0, n) for i, (_, n) in enumerate(ranges)])
                except OSError as exc:
                    err = f"cannot read: {exc.strerror or exc}"
        else:
            bufs = shared.private()         # collective over the node
    got = comm.allgather((err, mine))
    err = next((e for e, _ in got if e), None)
    if err:
        raise CheckpointError(f"{path}: {err}")
    seg = np.concatenate([m for _, m in got]) if got else mine
    total = _combine(kind, text, seg)
    if total != want:
        raise CheckpointError(f"{path}: whole-file checksum mismatch (damaged: {total}, "
                              f"recorded {want[:40]!r})")
    return 2, Verified(kind, block, ranges, seg, range_seg, bufs, parts)


def _read_segments(path, segs, ranges, sink, out: np.ndarray, kind: str,
                   rest: list[tuple[int, int, int]]) -> str | None:
    """Read and hash ``segs`` (this rank's run) into ``out``, in reads of up to
    :data:`READ_BYTES` (:class:`_FileReader`); ``sink(range, lo, bytes)`` receives the
    data ranges' bytes (None: hash only). Then the byte intervals ``rest`` ((range, lo,
    hi): what else this rank fills in) are read and passed to ``sink`` unhashed. Returns an
    error text or None."""
    starts = {off: i for i, (off, _) in enumerate(ranges)}
    offs = [off for off, _ in ranges]
    # O_DIRECT only where the bytes are kept (a load): a check alone (verify, resume's
    # search) reads through the page cache, where four ranks' read-ahead keeps more
    # requests in flight and a load that follows finds the pages
    rd = _FileReader(path, direct=sink is not None)
    try:
        k = 0
        while k < len(segs):
            s, _, data = segs[k]
            j = k               # a batch: data segments of one range, or metadata gaps
            while (j + 1 < len(segs) and segs[j + 1][1] - s <= READ_BYTES
                   and segs[j + 1][2] == data and not (data and segs[j + 1][0] in starts)):
                j += 1
            view = rd.read(s, segs[j][1] - s)
            if view is None:
                return "truncated while reading"
            for t in range(k, j + 1):
                out[t] = fmt.digest(kind, view[segs[t][0] - s:segs[t][1] - s])
            if data and sink is not None:
                cur = bisect.bisect_right(offs, s) - 1
                sink(cur, s - ranges[cur][0], view)
            k = j + 1
        for i, lo, hi in rest:
            for c in range(lo, hi, READ_BYTES):
                d = min(hi, c + READ_BYTES)
                view = rd.read(ranges[i][0] + c, d - c)
                if view is None:
                    return "truncated while reading"
                sink(i, c, view)
    finally:
        rd.close()
    return None


def check_collective(path: str | Path, comm: MPI.Intracomm) -> int:
    """The whole-file check split over the ranks (:func:`read_collective`, nothing kept):
    returns the format (1 or 2) on every rank, or raises the same :class:`CheckpointError`
    on every rank. Collective. A format-1 file that passes is reported once in a warning
    (rank 0)."""
    return read_collective(path, comm, "none")[0]
