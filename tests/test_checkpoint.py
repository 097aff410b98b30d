"""Checkpoints in one process: block layout, the cursor rule, round trip, corruption found,
incomplete files skipped, space check, deck keys, h5ls/h5dump, ``semzo inspect``.

The multi-rank cases (write at 4 / read at 2 and back, async, kill -9, full and unwritable
folders) are in test_checkpoint_mpi.py; ``semzo export`` in test_checkpoint_export.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from mpi4py import MPI
from mpiutil import ROOT

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
from ckpt_common import (
    BLOCK_KIB,
    extras,
    flip,
    locate,
    metrics,
    params,
    per_rank,
    reseal,
    same,
    state,
)

from semzo import deck as deckmod
from semzo.checkpoint import (
    Checkpointer,
    CheckpointError,
    find_resumable,
    list_checkpoints,
    load,
    manager,
    read_latest,
    remap_cursors,
    resume,
    verify,
)
from semzo.checkpoint import format as fmt
from semzo.deck import CheckpointSection, DeckError

COMM = MPI.COMM_SELF


def _save(d: Path, steps, keep: int = 5) -> list[Path]:
    cfg = CheckpointSection(dir=str(d), keep=keep, block_kib=BLOCK_KIB)
    with Checkpointer(COMM, cfg, deck_toml=deckmod.load(None).to_toml()) as ck:
        return [ck.save(s, params(s), state(s), per_rank(s, 0), extras(s), metrics(s))
                for s in steps]


def _flip(path: Path, tensor: str, frac: float = 0.5, *, sealed: bool = True) -> None:
    """Flip one byte inside ``tensor``'s data (not the metadata). ``sealed``: recompute the
    whole-file record afterwards, so that the block digests are what finds the change."""
    off, n = locate(path, tensor)
    flip(path, off + int(n * frac))
    if sealed:
        reseal(path)


# ----------------------------------------------------------------------------- layout
@pytest.mark.parametrize("shape,itemsize", [((1000, 33), 4), ((3,), 4), ((2, 5000), 4),
                                            ((40, 3, 7), 2), ((0, 4), 4), ((1,), 8),
                                            ((100000,), 4), ((7, 0), 4)])
def test_blocks_partition_rows_at_every_rank_count(shape, itemsize):
    lay = fmt.BlockLayout.of(shape, itemsize, 4096)
    assert lay.n_blocks <= fmt.MAX_BLOCKS
    if lay.n_blocks:
        assert (lay.n_blocks - 1) * lay.block_rows < lay.n_rows <= lay.n_blocks * lay.block_rows
    for p in (1, 2, 3, 4, 7):
        for shift in (0, 1, 5):
            parts = fmt.all_rank_rows(lay, p, shift)
            covered = sorted((lo, hi) for lo, hi in parts if hi > lo)
            pos = 0
            for lo, hi in covered:          # contiguous, disjoint, whole blocks
                assert lo == pos and lo % lay.block_rows == 0
                pos = hi
            assert pos == (lay.n_rows if lay.n_blocks else 0)


def test_blocks_are_whole_pages_when_rows_allow():
    lay = fmt.BlockLayout.of((30522, 384), 4, 1 << 20)
    assert (lay.block_rows * 384 * 4) % fmt.ALIGN_BYTES == 0
    assert 0.9 * (1 << 20) <= lay.block_rows * 384 * 4 <= (1 << 20)


def test_one_block_datasets_spread_over_ranks():
    lay = fmt.BlockLayout.of((5,), 4, 4096)
    def writes(r, s):
        lo, hi = fmt.rank_rows(lay, r, 4, s)[:2]
        return hi > lo

    owners = [[r for r in range(4) if writes(r, s)] for s in range(8)]
    assert all(len(o) == 1 for o in owners)
    owners = [o[0] for o in owners]
    assert owners == [0, 1, 2, 3, 0, 1, 2, 3]


# ----------------------------------------------------------------------------- cursors
def test_remap_cursors_keeps_samples_seen():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p_old, p_new = rng.integers(1, 9, size=2)
        n_old = rng.integers(0, 50, size=p_old)
        ep = rng.integers(0, 4, size=p_old)
        pos = np.array([rng.integers(0, max(1, n)) for n in n_old])
        old = np.stack([ep, pos], axis=1).astype(np.int64)
        new = remap_cursors(old, int(p_new), sizes_old=n_old)
        n = int(n_old.sum())
        m = np.array([n * (q + 1) // p_new - n * q // p_new for q in range(p_new)])
        assert new.shape == (p_new, 2) and new.dtype == np.int64
        if n:
            assert (new[:, 0] * m + new[:, 1]).sum() == (ep * n_old + pos).sum()
            assert ((new[:, 1] < np.maximum(m, 1)) | (m == 0)).all()
    old = np.array([[2, 5, 9], [1, 7, 9]], np.int64)
    assert np.array_equal(remap_cursors(old, 2, sizes_old=[10, 10]), old)   # same world: exact
    assert np.array_equal(remap_cursors(old, 3), [[2, 0, 0]] * 3)           # no sizes: fallback
    with pytest.raises(ValueError):
        remap_cursors(np.zeros((2,), np.int64), 3)


# ----------------------------------------------------------------------------- round trip
def test_round_trip_bit_for_bit_and_keep(tmp_path):
    paths = _save(tmp_path, [1, 2, 3, 4], keep=2)
    assert [p.name for _, p in list_checkpoints(tmp_path)] == [paths[2].name, paths[3].name]
    assert read_latest(tmp_path) == paths[3].name
    L = load(paths[3], COMM)
    assert same(L.params, params(4)) and list(L.params) == list(params(4))
    assert same(L.state, state(4)) and same(L.extras, extras(4))
    assert same(L.per_rank, {k: np.asarray(v) for k, v in per_rank(4, 0).items()})
    assert L.metrics == metrics(4) and L.step == 4 and not L.resharded
    assert verify(paths[3], COMM) == (True, "")


def test_xxh64_known_answers_and_any_alignment():
    from semzo.checkpoint.xxh64 import xxh64
    assert xxh64(b"") == 0xEF46DB3751D8E999 and xxh64(b"abc") == 0x44BC2CF5AD770999
    data = np.random.default_rng(5).integers(0, 256, 1000, dtype=np.uint8)
    ref = [xxh64(bytes(data[3:3 + n])) for n in (0, 1, 4, 7, 8, 31, 32, 33, 100, 997)]
    got = [xxh64(data[3:3 + n]) for n in (0, 1, 4, 7, 8, 31, 32, 33, 100, 997)]  # unaligned
    assert got == ref and len(set(ref)) == len(ref)


@pytest.mark.parametrize("kind", fmt.CHECKSUM_KINDS)
def test_every_checksum_kind_round_trips_and_catches_a_flip(tmp_path, kind):
    cfg = CheckpointSection(dir=str(tmp_path), block_kib=BLOCK_KIB, checksum=kind)
    with Checkpointer(COMM, cfg) as ck:
        p = ck.save(1, params(1), state(1))
    assert fmt.attrs_checksum(h5py.File(p, "r"), kind).startswith(kind + ":")
    assert same(load(p, COMM).params, params(1))
    _flip(p, "params/encoder.layer.0.half")
    why = verify(p, COMM)[1]
    assert "packed/float16: data checksum mismatch" in why and "encoder.layer.0.half" in why


def test_checkpointer_resume_and_never(tmp_path):
    _save(tmp_path, [3, 6])
    cfg = CheckpointSection(dir=str(tmp_path), block_kib=BLOCK_KIB, resume="auto")
    with Checkpointer(COMM, cfg) as ck:
        L = ck.resume(shard_size=103)
        assert L is not None and L.step == 6 and same(L.params, params(6))
        assert ck.save(6, params(6)) == L.path        # the step it holds: not written again
    import dataclasses
    with Checkpointer(COMM, dataclasses.replace(cfg, resume="never")) as ck:
        assert ck.resume() is None


def test_ranks_must_pass_replicated_structure(tmp_path):
    with Checkpointer(COMM, CheckpointSection(dir=str(tmp_path))) as ck:
        with pytest.raises(ValueError, match="state/bad"):
            ck.save(1, params(1), {"bad": None})
        with pytest.raises(ValueError, match="invalid name"):
            ck.save(1, {"a/b": np.zeros(2)})


def test_flipped_data_byte_detected_and_previous_used(tmp_path, caplog):
    paths = _save(tmp_path, [1, 2])
    _flip(paths[1], "params/embeddings.word_embeddings.weight", sealed=False)
    ok, why = verify(paths[1], COMM)
    assert not ok and f"{paths[1]}: whole-file checksum mismatch" in why
    with pytest.raises(CheckpointError, match="whole-file checksum mismatch"):
        load(paths[1], COMM)
    reseal(paths[1])                # as if damaged before sealing: the block digests see it
    ok, why = verify(paths[1], COMM)
    assert not ok and "data checksum mismatch in block" in why
    assert "embeddings.word_embeddings.weight" in why
    with pytest.raises(CheckpointError, match="data checksum mismatch"):
        load(paths[1], COMM)
    assert find_resumable(tmp_path, COMM) == paths[0]
    L = resume(tmp_path, COMM)
    assert L is not None and L.step == 1 and same(L.params, params(1))


def test_flipped_byte_in_a_small_state_dataset_detected(tmp_path):
    paths = _save(tmp_path, [1])
    _flip(paths[0], "state/seeds", 0.0)
    why = verify(paths[0], COMM)[1]
    assert "packed/uint64: data checksum mismatch" in why and "state/seeds" in why


def test_altered_metadata_detected(tmp_path):
    paths = _save(tmp_path, [1, 2])
    with h5py.File(paths[1], "r+") as f:
        f["state"].attrs["skips"] = 3
    ok, why = verify(paths[1], COMM)
    assert not ok and "whole-file checksum mismatch" in why
    assert find_resumable(tmp_path, COMM) == paths[0]
    reseal(paths[1])
    ok, why = verify(paths[1], COMM)
    assert not ok and "metadata checksum mismatch" in why


def test_incomplete_and_truncated_files_skipped(tmp_path):
    paths = _save(tmp_path, [1, 2, 3])
    with h5py.File(paths[2], "r+") as f:          # as if killed before the last attribute
        del f.attrs["attrs_checksum"]
    reseal(paths[2])
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) // 2])  # truncated
    assert "incomplete" in verify(paths[2], COMM)[1]
    ok, why = verify(paths[1], COMM)
    assert not ok and "truncated" in why
    assert find_resumable(tmp_path, COMM) == paths[0]
    assert find_resumable(tmp_path / "nothing-here", COMM) is None


def test_space_check_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(manager.shutil, "disk_usage",
                        lambda p: shutil._ntuple_diskusage(10 << 20, 10 << 20, 1 << 20))
    cfg = CheckpointSection(dir=str(tmp_path / "ck"))
    with Checkpointer(COMM, cfg) as ck, pytest.raises(manager.CheckpointDirError) as info:
        ck.save(1, {"w": np.zeros(1 << 20)})
    msg = str(info.value)
    assert str(tmp_path / "ck") in msg and "not enough free space" in msg
    assert info.value.exit_code == 2 and not list((tmp_path / "ck").iterdir())


def test_unwritable_folder_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(manager.CheckpointDirError, match="file/ck: cannot write"):
        Checkpointer(COMM, CheckpointSection(dir=str(tmp_path / "file" / "ck")))


# ----------------------------------------------------------------------------- deck, tools
def test_checkpoint_deck_section(tmp_path):
    d = deckmod.load(None)
    assert d.checkpoint.every_steps == 100 and d.checkpoint.resume == "never"
    assert "[checkpoint]" in d.to_toml()
    for bad in ("checkpoint.resume=sometimes", "checkpoint.keep=0", "checkpoint.async=true"):
        with pytest.raises(DeckError, match="checkpoint"):
            deckmod.load(None, [bad])
    ck = Checkpointer(COMM, d.checkpoint, outdir=tmp_path / "run")
    assert ck.dir == tmp_path / "run" / "checkpoints" and ck.dir.is_dir()


def test_h5ls_h5dump_and_inspect(tmp_path):
    paths = _save(tmp_path, [1, 2])
    ls = subprocess.run(["h5ls", "-r", str(paths[1])], check=False, capture_output=True,
                        text=True, timeout=30)
    assert ls.returncode == 0, ls.stderr
    n32 = sum(a.size for a in params(2).values() if a.dtype == np.float32)
    assert f"/packed/float32          Dataset {{{n32}}}" in ls.stdout
    assert "/index                   Dataset {16}" in ls.stdout
    dump = subprocess.run(["h5dump", "-a", "step", str(paths[1])], check=False,
                          capture_output=True, text=True, timeout=30)
    assert dump.returncode == 0 and "(0): 2" in dump.stdout
    idx = subprocess.run(["h5dump", "-d", "/index", str(paths[1])], check=False,
                         capture_output=True, text=True, timeout=30)
    assert idx.returncode == 0 and '"params/embeddings.word_embeddings.weight' in idx.stdout
    assert "[ 1000, 33, 0, 0, 0, 0, 0, 0 ]" in idx.stdout and '"per_rank/cursor' in idx.stdout
    # one tensor through the index's offset and count: h5dump -s OFFSET -c COUNT
    w = params(2)["classifier.weight"]          # float64, after the 0-d pooler.scale
    with h5py.File(paths[1], "r") as f:
        row = next(r for r in f["index"][()] if r["path"] == b"params/classifier.weight")
    assert row["packed"] == b"float64" and row["offset"] == 1 and row["count"] == w.size
    one = subprocess.run(["h5dump", "-d", "/packed/float64", "-s", "1", "-c", "3",
                          str(paths[1])], check=False, capture_output=True, text=True,
                         timeout=30)
    got = [float(x) for x in one.stdout.split("DATA {")[1].split("(1):")[1].split("}")[0]
           .split(",")]
    assert np.allclose(got, w.reshape(-1)[:3], rtol=1e-5), one.stdout
    run = [sys.executable, "-m", "semzo", "inspect"]
    ok = subprocess.run(run + [str(tmp_path)], check=False, capture_output=True, text=True,
                        timeout=60, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr
    assert "step 2" in ok.stdout and "loss = 0.333333" in ok.stdout
    assert "whole file OK" in ok.stdout and "[checkpoint]" in ok.stdout
    assert "packed/float32[0:33000]" in ok.stdout        # where the largest tensor lies
    _flip(paths[1], "params/classifier.weight", sealed=False)
    bad = subprocess.run(run + ["--no-deck", str(paths[1])], check=False, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and not bad.stdout, bad.stdout
    assert bad.stderr.strip().splitlines() == [
        f"error: damaged checkpoint: {paths[1]}: " + bad.stderr.split(f"{paths[1]}: ", 1)[1]
        .strip()]
    assert "whole-file checksum mismatch" in bad.stderr
    folder = subprocess.run(run + ["--no-deck", str(tmp_path)], check=False,
                            capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert folder.returncode == 0 and "INVALID" in folder.stdout and "step 1" in folder.stdout
    miss = subprocess.run(run + [str(tmp_path / "nope.h5")], check=False, capture_output=True,
                          text=True, timeout=60, cwd=ROOT)
    assert miss.returncode == 2 and "nope.h5" in miss.stderr
