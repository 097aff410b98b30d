"""The whole-file record (semzo.checkpoint.filesum) and the packed format, in one process.

Property tests: any changed byte, truncation or extension of a real format-2 checkpoint is
found by the streaming check before HDF5 opens the file, and ``load``/``verify`` report it as
one CheckpointError. The packed layout round-trips many small and large tensors of every
dtype. XXH64 (the digest of blocks and of the whole file) equals the reference ``xxhash``.
Format-1 files (before the record) are read with a warning, and refused when their
superblock does not match their size.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mpi4py import MPI
from mpiutil import ROOT

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
from ckpt_common import BLOCK_KIB, extras, flip, metrics, params, per_rank, same, state

from semzo.checkpoint import Checkpointer, CheckpointError, filesum, load, verify
from semzo.checkpoint.xxh64 import xxh64
from semzo.deck import CheckpointSection

# the node-buffer files of this process (named by its pid): other tests may run beside this one
_MINE = f"semzo-ckpt-{os.getpid()}-*"

COMM = MPI.COMM_SELF
LEGACY = ROOT / "tests" / "data" / "checkpoint" / "format1-ckpt-000000003.h5"


@pytest.fixture(scope="module")
def sealed(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("filesum")
    cfg = CheckpointSection(dir=str(d), block_kib=BLOCK_KIB)
    with Checkpointer(COMM, cfg, deck_toml="# test deck\n") as ck:
        return ck.save(3, params(3), state(3), per_rank(3, 0), extras(3), metrics(3))


def _copy(src: Path, tmp: Path, name: str = "ckpt-000000003.h5") -> Path:
    tmp.mkdir(parents=True, exist_ok=True)
    dst = tmp / name
    shutil.copyfile(src, dst)
    return dst


def test_record_is_in_the_user_block_and_passes(sealed):
    head = sealed.read_bytes()[:filesum.USERBLOCK]
    assert head.startswith(filesum.MAGIC) and b'"kind":"xxh64"' in head
    assert head[4096 - 1] == 0
    assert filesum.check_file(sealed) == (2, None)
    assert verify(sealed, COMM) == (True, "")


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damage_is_found_before_hdf5(sealed, tmp_path_factory, data):
    """One to three changed bytes anywhere (the record, the superblock at 4096 + 40, the
    metadata, the data, the last bytes), a truncation at any length, or bytes appended."""
    size = sealed.stat().st_size
    case = data.draw(st.sampled_from(["flip", "flip", "hot", "truncate", "extend"]))
    p = _copy(sealed, tmp_path_factory.mktemp("dmg"))
    if case in ("flip", "hot"):
        hot = [40, 4096 + 40, 4096 + 8, size - 1, size - 2, size - 900, 200]
        offs = data.draw(st.lists(st.sampled_from(hot) if case == "hot"
                                  else st.integers(0, size - 1), min_size=1, max_size=3,
                                  unique=True))
        for off in offs:
            flip(p, off, data.draw(st.integers(1, 255)))
    elif case == "truncate":
        n = data.draw(st.integers(0, size - 1))
        with open(p, "r+b") as fh:
            fh.truncate(n)
    else:
        with open(p, "ab") as fh:
            fh.write(bytes(data.draw(st.integers(1, 64))))
    version, err = filesum.check_file(p)
    assert version == 2 or err is not None
    assert err is not None, f"{case}: damage not found"
    ok, why = verify(p, COMM)
    assert not ok and why.startswith(f"{p}: ") and "\n" not in why
    with pytest.raises(CheckpointError):
        load(p, COMM)


def test_streaming_check_reads_in_bounded_batches(sealed, tmp_path, monkeypatch):
    """The same verdicts when the read buffer is smaller than the file (many batches)."""
    monkeypatch.setattr(filesum, "READ_BYTES", 8192)
    assert filesum.check_file(sealed) == (2, None)
    p = _copy(sealed, tmp_path)
    flip(p, p.stat().st_size - 5000)
    assert "whole-file checksum mismatch" in filesum.check_file(p)[1]


def test_malformed_records_are_refused(sealed, tmp_path):
    raw = bytearray(sealed.read_bytes())
    cases = {
        "padding": (3000, b"x"),                       # a byte after the record
        "json": (len(filesum.MAGIC) + 2, b"X"),        # the JSON line
        "magic": (0, b"\x00"),
    }
    for name, (off, b) in cases.items():
        bad = bytearray(raw)
        bad[off:off + len(b)] = b
        p = tmp_path / f"{name}.h5"
        p.write_bytes(bytes(bad))
        err = filesum.check_file(p)[1]
        assert err is not None, name
    p = tmp_path / "short.h5"
    p.write_bytes(bytes(raw[:100]))
    assert filesum.check_file(p)[1] is not None
    p = tmp_path / "empty.h5"
    p.write_bytes(b"")
    assert filesum.check_file(p)[1] is not None


@pytest.mark.parametrize("seed", range(3))
def test_xxh64_matches_the_reference_package(seed):
    import xxhash  # the reference implementation (test extras)

    rng = np.random.default_rng(seed)
    for n in list(rng.integers(0, 10_000, size=40)) + [0, 1, 31, 32, 33, 63, 64, 65]:
        b = rng.integers(0, 256, int(n), dtype=np.uint8).tobytes()
        assert xxh64(b) == xxhash.xxh64_intdigest(b), n


# ----------------------------------------------------------------------------- packed format
DTYPES = [np.float16, np.float32, np.float64, np.int8, np.uint8, np.int16, np.uint16,
          np.int32, np.uint32, np.int64, np.uint64, np.bool_]


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_packed_round_trip_of_many_tensors(tmp_path_factory, data):
    """Small, empty, 0-d and large tensors of every dtype, in any order, bit for bit; float16
    is stored as itself (and bfloat16 travels as its uint16 bits)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    n = data.draw(st.integers(1, 40))
    p = {}
    for i in range(n):
        dt = np.dtype(data.draw(st.sampled_from(DTYPES)))
        shape = tuple(data.draw(st.lists(st.integers(0, 9), max_size=3)))
        if data.draw(st.integers(0, 9)) == 0:
            shape = (data.draw(st.integers(1000, 40_000)),)       # several blocks
        raw = rng.integers(0, 256, int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
        if dt == np.bool_:
            raw &= 1
        p[f"t{i}.{dt.name}"] = raw.view(dt).reshape(shape)
    d = tmp_path_factory.mktemp("packed")
    block = data.draw(st.sampled_from([4, 8, 64]))
    with Checkpointer(COMM, CheckpointSection(dir=str(d), block_kib=block)) as ck:
        path = ck.save(1, p, {"x": np.arange(3)})
    assert filesum.check_file(path) == (2, None)
    L = load(path, COMM)
    assert list(L.params) == list(p)
    for k, v in p.items():
        assert same(L.params[k], v), k


def test_bfloat16_bits_round_trip(tmp_path):
    """NumPy has no bfloat16: tensors travel as their uint16 bits (torch's .view)."""
    torch = pytest.importorskip("torch")
    t = torch.randn(7, 5).to(torch.bfloat16)
    bits = t.view(torch.int16).numpy().view(np.uint16)
    with Checkpointer(COMM, CheckpointSection(dir=str(tmp_path))) as ck:
        path = ck.save(1, {"w.bf16": bits})
    back = load(path, COMM).params["w.bf16"]
    assert back.dtype == np.uint16
    assert torch.equal(torch.from_numpy(back.view(np.int16)).view(torch.bfloat16), t)


# ----------------------------------------------------------------------------- format 1
def test_format1_file_is_read_with_a_warning(tmp_path, caplog):
    p = _copy(LEGACY, tmp_path)
    assert filesum.check_file(p) == (1, None)
    with caplog.at_level(logging.WARNING):
        L = load(p, COMM)
    assert "written before whole-file checksums (format 1)" in caplog.text
    assert same(L.params, params(3)) and same(L.state, state(3))
    assert same(L.extras, extras(3)) and L.metrics == metrics(3)
    assert verify(p, COMM) == (True, "")
    from semzo.checkpoint import tools

    text, ok = tools.summary(p, COMM, deck=False)
    assert ok and "no whole-file record (format 1)" in text and "step 3" in text


@pytest.mark.parametrize("damage", ["eof", "truncate"])
def test_format1_superblock_damage_is_refused(tmp_path, damage):
    """The defect-8 hang: a changed end-of-file address (offset 40) or a truncated file."""
    p = _copy(LEGACY, tmp_path)
    if damage == "eof":
        flip(p, 40, 0x01)
    else:
        with open(p, "r+b") as fh:
            fh.truncate(p.stat().st_size - 100)
    ok, why = verify(p, COMM)
    assert not ok and "HDF5 superblock says the file ends at byte" in why


@pytest.mark.parametrize("shared", [True, False])
def test_load_through_the_node_buffer_is_bit_identical_and_private(tmp_path, monkeypatch,
                                                                   shared):
    """distribute=read on one node: the data ranges go through one /dev/shm file mapped
    copy-on-write (or private buffers); the arrays are bit-identical, writable, and a write
    reaches neither the file nor a second load."""
    from mpi4py import MPI

    from semzo.checkpoint import Checkpointer, load
    from semzo.deck import CheckpointSection

    monkeypatch.setattr(filesum, "SHARED_MIN_BYTES", 0)
    monkeypatch.setenv("SEMZO_CHECKPOINT_SHM", "1" if shared else "0")
    rng = np.random.default_rng(5)
    params = {"w": rng.standard_normal((300, 77)).astype(np.float32),
              "h": rng.standard_normal(999).astype(np.float16),
              "i": np.arange(5, dtype=np.int64)}
    comm = MPI.COMM_WORLD
    with Checkpointer(comm, CheckpointSection(dir=str(tmp_path), block_kib=4)) as ck:
        p = ck.save(1, params)
    before = len(list(Path(filesum.SHM_DIR).glob(_MINE)))
    used = []
    real = filesum._NodeBuffer.private
    monkeypatch.setattr(filesum._NodeBuffer, "private",
                        lambda self: used.append(1) or real(self))
    a = load(p, comm, distribute="read")
    assert used == ([1] if shared else [])
    assert len(list(Path(filesum.SHM_DIR).glob(_MINE))) == before   # unlinked
    for k, v in params.items():
        assert a.params[k].dtype == v.dtype and a.params[k].tobytes() == v.tobytes()
    a.params["w"][:] = 7
    b = load(p, comm, distribute="read")
    assert b.params["w"].tobytes() == params["w"].tobytes()
    assert filesum.check_file(p) == (2, None)


def test_full_dev_shm_falls_back_to_private_buffers(tmp_path, monkeypatch):
    """A write into the node buffer that fails (a full /dev/shm: ENOSPC) is no SIGBUS and
    no error: the shared file is removed and every rank reads into private memory."""
    import errno

    from semzo.checkpoint import Checkpointer, load
    from semzo.deck import CheckpointSection

    monkeypatch.setattr(filesum, "SHARED_MIN_BYTES", 0)
    monkeypatch.setenv("SEMZO_CHECKPOINT_SHM", "1")
    params = {"w": np.random.default_rng(2).standard_normal((500, 61)).astype(np.float32)}
    comm = MPI.COMM_WORLD
    with Checkpointer(comm, CheckpointSection(dir=str(tmp_path), block_kib=4)) as ck:
        p = ck.save(1, params)
    before = len(list(Path(filesum.SHM_DIR).glob(_MINE)))
    calls = []

    def full(fd, data, off):
        calls.append(off)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(filesum.os, "pwrite", full)
    private, real = [], filesum._NodeBuffer.private
    monkeypatch.setattr(filesum._NodeBuffer, "private",
                        lambda self: private.append(1) or real(self))
    a = load(p, comm, distribute="read")
    assert calls and private == []                         # failed, never mapped
    assert len(list(Path(filesum.SHM_DIR).glob(_MINE))) == before
    assert a.params["w"].tobytes() == params["w"].tobytes()


@pytest.mark.parametrize("direct", ["1", "0"])
def test_file_reader_gives_the_bytes_cached_or_not(tmp_path, monkeypatch, direct):
    """_FileReader: any byte range, at any alignment, from the page cache or (pages
    evicted) with O_DIRECT where the file system allows it; None past the end."""
    import os

    monkeypatch.setenv(filesum.DIRECT_ENV, direct)
    data = np.random.default_rng(4).integers(0, 256, 3 * filesum.READ_BYTES // 4 + 12345,
                                             dtype=np.uint8).tobytes()
    f = tmp_path / "x.bin"
    f.write_bytes(data)
    fd = os.open(f, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # evict: the direct path
    os.close(fd)
    rd = filesum._FileReader(f)
    used = []
    fill = rd._fill
    rd._fill = lambda fd, *a: used.append(fd == rd.dfd) or fill(fd, *a)
    r = np.random.default_rng(7)
    cuts = [(0, 1), (1, 4095), (4095, 2), (8192, 4096), (len(data) - 1, 1), (0, len(data))]
    cuts += [(int(o), int(n)) for o, n in zip(r.integers(0, len(data), 30),
                                               r.integers(1, 3 << 20, 30))]
    try:
        for off, n in cuts:
            n = min(n, len(data) - off)
            got = rd.read(off, n)
            assert got is not None and bytes(got) == data[off:off + n], (off, n)
        assert rd.read(len(data) - 10, 11) is None
        plain = filesum._FileReader(f, direct=False)        # a check alone: the page cache
        assert plain.dfd < 0 and bytes(plain.read(5, 7)) == data[5:12]
        plain.close()
        if direct == "0":
            assert rd.dfd < 0 and not any(used)
        elif rd.dfd >= 0:                  # O_DIRECT allowed here: the evicted pages used it
            assert used[0]
    finally:
        rd.close()
