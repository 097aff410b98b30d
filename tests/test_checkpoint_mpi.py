"""Checkpoints under MPI: write at 4 / read at 2 and back (and at 1), asynchronous saving
with snapshot semantics, kill -9 during a write, corrupt files, full and unwritable folders.
Scripts: tests/mpi/ckpt_roundtrip.py, tests/mpi/ckpt_fault.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import pytest
from mpiutil import MPI_ENV, MPIEXEC, ROOT, check, mpirun

sys.path.insert(0, str(ROOT / "tests" / "mpi"))
from ckpt_common import flip, locate

SCRIPTS = ROOT / "tests" / "mpi"
RT, FAULT = str(SCRIPTS / "ckpt_roundtrip.py"), str(SCRIPTS / "ckpt_fault.py")


def test_write_at_4_read_at_2_and_4(tmp_path):
    """Written with collective buffering at 4 ranks (the default, independent, is used by
    the other tests), read at 2 (cursor rule), at 4 (exact) and at 1."""
    out = check(mpirun(4, [RT, "write", str(tmp_path), "3", "collective"], timeout=90))
    assert "ok: wrote 3 checkpoints on 4 ranks, collective" in out.stdout
    out = check(mpirun(2, [RT, "read", str(tmp_path), "3", "4"], timeout=60))
    assert "ok: read step 3 saved at 4 ranks on 2 ranks" in out.stdout
    assert "were dropped" in out.stderr          # rng_counter has no rule: reported
    out = check(mpirun(4, [RT, "read", str(tmp_path), "2", "4"], timeout=60))
    assert "ok: read step 2 saved at 4 ranks on 4 ranks" in out.stdout
    out = check(mpirun(1, [RT, "read", str(tmp_path), "3", "4"], timeout=60))
    assert "ok: read step 3 saved at 4 ranks on 1 ranks" in out.stdout


def test_write_at_2_read_at_4_and_1(tmp_path):
    out = check(mpirun(2, [RT, "write", str(tmp_path), "2", "individual"], timeout=60))
    assert "ok: wrote 2 checkpoints on 2 ranks, individual" in out.stdout
    out = check(mpirun(4, [RT, "read", str(tmp_path), "2", "2"], timeout=60))
    assert "ok: read step 2 saved at 2 ranks on 4 ranks" in out.stdout
    out = check(mpirun(1, [RT, "read", str(tmp_path), "1", "2"], timeout=60))
    assert "ok: read step 1 saved at 2 ranks on 1 ranks" in out.stdout


def test_async_save_snapshots_the_arrays(tmp_path):
    out = check(mpirun(2, [RT, "write", str(tmp_path), "3", "async"], timeout=60))
    assert "ok: wrote 3 checkpoints on 2 ranks, async" in out.stdout


def test_async_without_thread_multiple_is_a_deck_error(tmp_path):
    proc = mpirun(4, [FAULT, "async-funneled", str(tmp_path), "0"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "checkpoint.async_save: needs MPI_THREAD_MULTIPLE" in proc.stderr
    assert proc.stderr.count("error:") == 1


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process of the session the launch started (mpirun and its ranks)."""
    sid = proc.pid                       # start_new_session: the session id is its pid
    for pid in [int(p) for p in os.listdir("/proc") if p.isdigit()]:
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait(timeout=30)


def test_kill_during_write_keeps_previous(tmp_path):
    check(mpirun(4, [FAULT, "write", str(tmp_path), "1"], timeout=60))
    env = dict(os.environ, **MPI_ENV, SEMZO_CKPT_TEST_SLEEP="0.4")
    proc = subprocess.Popen(["timeout", "-k", "5", "60", MPIEXEC, "-n", "2", sys.executable,
                             FAULT, "write", str(tmp_path), "2"], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    tmp = tmp_path / "ckpt-000000002.h5.tmp"
    t0 = time.time()
    try:
        while not (tmp.exists() and tmp.stat().st_size > 20000) and time.time() - t0 < 40:
            time.sleep(0.1)                 # a few datasets written: mid-write
        assert tmp.exists(), "the second write never started"
    finally:
        _kill_session(proc)
    assert not (tmp_path / "ckpt-000000002.h5").exists()
    assert (tmp_path / "latest").read_text().strip() == "ckpt-000000001.h5"
    out = check(mpirun(4, [FAULT, "check", str(tmp_path), "1"], timeout=60))
    assert "ok: resumable step 1" in out.stdout


def test_corrupt_newest_falls_back(tmp_path):
    for s in (1, 2, 3):
        check(mpirun(4, [FAULT, "write", str(tmp_path), str(s)], timeout=60))
    p2, p3 = tmp_path / "ckpt-000000002.h5", tmp_path / "ckpt-000000003.h5"
    off, _ = locate(p3, "params/embeddings.word_embeddings.weight")
    flip(p3, off + 12345, 1)             # one byte inside a parameter's data
    with h5py.File(p2, "r+") as f:       # and an altered attribute in the one before
        f.attrs["step"] = 7
    out = check(mpirun(4, [FAULT, "check", str(tmp_path), "1"], timeout=60))
    assert "ok: resumable step 1" in out.stdout
    # find_resumable and resume skip each one once, with one warning naming it
    assert out.stderr.count(f"skipping checkpoint {p3}: whole-file checksum mismatch") == 2
    assert out.stderr.count(f"skipping checkpoint {p2}: ") == 2     # h5py grew the file
    assert "Traceback" not in out.stderr


def test_unwritable_folder_exits_2(tmp_path):
    (tmp_path / "file").write_text("x")
    proc = mpirun(4, [FAULT, "write", str(tmp_path / "file" / "ck"), "1"], timeout=60)
    assert proc.returncode == 2
    assert f"error: checkpoint dir {tmp_path}/file/ck: cannot write: Not a directory" \
        in proc.stderr
    assert proc.stderr.count("error:") == 1


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1.5 MiB tmpfs (needs root: mount)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)],
                       check=False, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_full_folder_exits_2_and_keeps_previous(small_tmpfs):
    d = small_tmpfs / "ck"
    for s in (1, 2):                     # 0.2 MiB each
        check(mpirun(4, [FAULT, "write", str(d), str(s)], timeout=60))
    proc = mpirun(4, [FAULT, "write", str(d), "3"], timeout=60)
    assert proc.returncode == 2 and f"checkpoint dir {d}: not enough free space" in proc.stderr
    free = shutil.disk_usage(small_tmpfs).free
    (small_tmpfs / "filler").write_bytes(b"\0" * (free - 100_000))   # 0.1 MiB left
    # past the space check (as if the disk filled up meanwhile): ENOSPC inside the write
    proc = mpirun(4, [FAULT, "write", str(d), "4"], timeout=60,
                  env={"SEMZO_CKPT_SKIP_SPACE_CHECK": "1"})
    assert proc.returncode == 2, proc.stderr
    assert f"checkpoint {d}/ckpt-000000004.h5.tmp: cannot write" in proc.stderr
    assert not list(d.glob("*.tmp"))     # the rank that failed removed the partial file
    (small_tmpfs / "filler").unlink()
    assert (d / "latest").read_text().strip() == "ckpt-000000002.h5"
    out = check(mpirun(4, [FAULT, "check", str(d), "2"], timeout=60))
    assert "ok: resumable step 2" in out.stdout
