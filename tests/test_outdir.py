"""Issue 12, defects 9 and 10: every folder the deck writes is checked at start-up (exit 2, one
line naming the deck and the key, before any work), and the output folder is locked for the
whole run (a second run stops at once naming the folder and the holder; a stale lock is taken).
"""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI
from mpiutil import MPI_ENV, ROOT, check, mpirun

from semzo import deck as deckmod
from semzo.deck import DeckError
from semzo.outdir import LOCK_NAME, OutputLock, check_writes, planned_writes

TOPO = ["--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1"]
UNWRITABLE = Path("/sys/kernel")          # exists, refuses new files even to root


def _deck(tmp_path, *sets):
    return deckmod.load(ROOT / "inputs" / "demo.toml",
                        [f"run.output_dir={tmp_path / 'out'}", *sets], check_inputs=False)


def _bad_checkpoint_dirs(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    return {"under a file": (afile / "ck", "is not a folder"),
            "a file": (afile, "not a folder"),
            "deep under a file": (afile / "a" / "b" / "ck", "is not a folder"),
            "unwritable folder": (UNWRITABLE, "cannot write"),
            "under an unwritable folder": (UNWRITABLE / "semzo-ck" / "x", "cannot write")}


def test_planned_writes_lists_every_folder(tmp_path):
    d = _deck(tmp_path, "checkpoint.dir=/x/ck")
    assert planned_writes(d) == [("run.output_dir", tmp_path / "out"),
                                 ("checkpoint.dir", Path("/x/ck"))]
    d = _deck(tmp_path, 'run.stages=["topology", "embed"]')
    assert planned_writes(d) == [("run.output_dir", tmp_path / "out")]
    d = _deck(tmp_path, 'experiment.shardings=["semantic"]', 'experiment.modes=["data"]',
              "experiment.seeds=2")
    got = planned_writes(d, experiment=True)
    out = tmp_path / "out"
    assert got == [("run.output_dir", p) for p in (
        out, out / "semantic", out / "semantic/data/seed0/checkpoints",
        out / "semantic/data/seed1/checkpoints")]


def test_check_writes_names_deck_and_key_and_creates_nothing(tmp_path):
    for case, (ck, why) in _bad_checkpoint_dirs(tmp_path).items():
        d = _deck(tmp_path, f"checkpoint.dir={ck}")
        with pytest.raises(DeckError) as exc:
            check_writes(d, MPI.COMM_SELF)
        msg = str(exc.value)
        assert msg.startswith(f"{d.source}: checkpoint.dir: {ck}"), (case, msg)
        assert why in msg and "\n" not in msg, (case, msg)
    good = tmp_path / "new" / "deeper" / "ck"
    check_writes(_deck(tmp_path, f"checkpoint.dir={good}"), MPI.COMM_SELF)
    assert not (tmp_path / "new").exists()            # the check creates nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # experiment: a configuration folder blocked by a file
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "semantic").write_text("x")
    d = _deck(tmp_path, 'experiment.shardings=["semantic"]')
    with pytest.raises(DeckError, match=r"run.output_dir: .*semantic: not a folder"):
        check_writes(d, MPI.COMM_SELF, experiment=True)


@pytest.mark.parametrize("case", ["under a file", "unwritable folder"])
def test_bad_checkpoint_dir_stops_before_any_work(tmp_path, case):
    """Issue 12: ran embed, cluster and place, then failed at fine-tuning after the work."""
    ck, why = _bad_checkpoint_dirs(tmp_path)[case]
    out = tmp_path / "out"
    t0 = time.monotonic()
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={out}",
                      "--set", f"checkpoint.dir={ck}", *TOPO], timeout=90)
    took = time.monotonic() - t0
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert errors == [f"error: inputs/demo.toml: checkpoint.dir: {ck}" + errors[0].split(
        str(ck), 1)[1]], proc.stderr[-3000:]
    assert why in errors[0] and "Traceback" not in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == [], list(out.iterdir())   # no stage output
    assert took < 60, took


def _hold(path: Path, record: str) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, record.encode())
    return fd


def test_lock_held_stale_and_released(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    d = _deck(tmp_path)
    me = f"{os.getpid()}@{socket.gethostname()} started now"
    fd = _hold(out / LOCK_NAME, me)
    try:
        with pytest.raises(DeckError) as exc:
            OutputLock.acquire(out, d, MPI.COMM_SELF)
        msg = str(exc.value)
        assert msg.startswith(f"{d.source}: run.output_dir: {out} is in use by another semzo "
                              f"run, process {me}"), msg
    finally:
        os.close(fd)                                    # the holder "crashes": file stays
    assert (out / LOCK_NAME).read_text() == me
    with OutputLock.acquire(out, d, MPI.COMM_SELF) as lock:   # stale: taken over
        rec = (out / LOCK_NAME).read_text()
        assert rec.startswith(f"{os.getpid()}@{socket.gethostname()} started "), rec
        assert lock.fd is not None
    assert not (out / LOCK_NAME).exists()              # released: removed


def test_second_run_into_a_held_folder_stops_at_once(tmp_path):
    """A holder outside semzo (this test) and a stale lock file, through `semzo run`."""
    out = tmp_path / "out"
    out.mkdir()
    holder = f"4242@{socket.gethostname()} started 2026-01-01T00:00:00"
    fd = _hold(out / LOCK_NAME, holder)
    try:
        proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set",
                          f"run.output_dir={out}", "--set", 'run.stages=["topology"]', *TOPO],
                      timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    want = (f"error: inputs/demo.toml: run.output_dir: {out} is in use by another semzo run, "
            f"process {holder}; wait for it to end or choose another run.output_dir")
    assert errors == [want], proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    # the holder died: its file is stale, the next run takes it, says so, and removes it
    proc = check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set",
                            f"run.output_dir={out}", "--set", 'run.stages=["topology"]', *TOPO],
                        timeout=60))
    assert f"stale lock of {holder} taken over" in proc.stderr
    assert (out / "topology.h5").is_file() and not (out / LOCK_NAME).exists()


def test_two_concurrent_runs(tmp_path):
    """Two 2-rank runs into one folder at once: the second exits 2 at once naming the first's
    rank 0 (pid@host); the first completes with its own files."""
    out = tmp_path / "out"
    env = {**os.environ, **MPI_ENV}
    cmd = ["timeout", "-k", "5", "240", "mpirun", "-n", "2", sys.executable, "-m", "semzo",
           "run", "inputs/demo.toml", "--set", f"run.output_dir={out}", "--set",
           'run.stages=["topology", "embed"]', "--set", "corpus.max_records=1500", *TOPO]
    first = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        lock = out / LOCK_NAME
        deadline = time.monotonic() + 120
        while not (lock.is_file() and lock.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        holder = lock.read_text().strip()
        assert first.poll() is None, "the first run ended before the second started"
        t0 = time.monotonic()
        second = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set",
                            f"run.output_dir={out}", "--set", "run.seed=1", *TOPO], timeout=60)
        took = time.monotonic() - t0
        running = first.poll() is None
    finally:
        _, se = first.communicate(timeout=260)
    assert running, "the first run ended while the second ran: the test proves nothing"
    assert second.returncode == 2, second.stderr[-3000:]
    errors = [ln for ln in second.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and f"{out} is in use by another semzo run, process {holder}" \
        in errors[0], second.stderr[-3000:]
    assert took < 45, took
    assert first.returncode == 0, se[-3000:]
    assert (out / "embeddings.h5").is_file() and not (out / LOCK_NAME).exists()


def test_experiment_into_a_held_folder_stops_at_once(tmp_path):
    """`semzo experiment` takes the same lock (and checks its configuration folders)."""
    out = tmp_path / "out"
    out.mkdir()
    holder = f"4343@{socket.gethostname()} started 2026-01-01T00:00:00"
    fd = _hold(out / LOCK_NAME, holder)
    try:
        proc = mpirun(2, ["-m", "semzo", "experiment", "inputs/demo.toml", "--set",
                          f"run.output_dir={out}", *TOPO], timeout=60)
    finally:
        os.close(fd)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and f"run.output_dir: {out} is in use by another semzo run, " \
        f"process {holder}" in errors[0], proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]
    (out / "semantic").write_text("not a folder")           # a configuration folder blocked
    proc = mpirun(2, ["-m", "semzo", "experiment", "inputs/demo.toml", "--set",
                      f"run.output_dir={out}", *TOPO], timeout=60)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    want = f"error: inputs/demo.toml: run.output_dir: {out / 'semantic'}: not a folder"
    assert errors == [want], proc.stderr[-3000:]
    assert "stale lock" in proc.stderr                        # the holder above is gone
    assert sorted(p.name for p in out.iterdir()) == ["semantic"]   # lock released, no output
