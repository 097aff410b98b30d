"""The output folder of a run: every path the deck will write checked at start-up, and an
exclusive lock on ``run.output_dir`` for the whole run.

Start-up checks (:func:`check_writes`, collective): every folder the run will write
(``run.output_dir``, ``checkpoint.dir`` when fine-tuning, every configuration folder of
``semzo experiment``) must be creatable and writable *before any work starts*; otherwise every
rank raises the same one-line :class:`semzo.deck.DeckError` (exit 2) naming the deck file and
the key. A folder that does not exist yet is not created by the check: its nearest existing
ancestor must be a folder that accepts a new file (and every existing part of the path must be
a folder).

The lock (:class:`OutputLock`, rank 0): ``<run.output_dir>/.semzo.lock``, opened and locked
with ``fcntl.flock(LOCK_EX | LOCK_NB)``, holding one line ``<pid>@<host> started <ISO time>``. A
second run into the same folder finds it locked and stops at once (exit 2, one line naming
the folder and the holder). The kernel drops a flock when its process dies, so a lock file
whose lock nobody holds was left by a run that crashed: it is stale, taken over with a log
line saying so. Released (file removed, then unlocked) when the run ends. After taking the
lock the holder checks that the path still names the file it locked (a run releasing the
lock removes the file), so two runs never both believe they hold it. On file systems where
flock is not coherent across hosts (some NFS setups), the lock protects only runs started on
one host.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Self

from .deck import Deck, DeckError
from .runtime import get_logger

log = get_logger(__name__)

LOCK_NAME = ".semzo.lock"


def _probe(path: Path) -> str | None:
    """Why ``path`` cannot become a writable folder (None if it can). Creates nothing but a
    probe file it removes at once, in ``path`` or its nearest existing ancestor."""
    p = path if path.is_absolute() else Path.cwd() / path
    missing = []
    while not os.path.lexists(p):
        missing.append(p.name)
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return f"{path}: {p} is not a folder" if missing else f"{path}: not a folder"
    probe = p / f".semzo-write-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        where = "" if not missing else f" (its existing parent {p})"
        return f"{path}{where}: cannot write: {exc.strerror or exc}"
    return None


def planned_writes(deck: Deck, *, experiment: bool = False) -> list[tuple[str, Path]]:
    """``(deck key, folder)`` for every folder the run of ``deck`` writes, in the order they
    are checked. ``experiment``: the folders of ``semzo experiment`` (one per sharding and per
    configuration, each with its ``checkpoints``) instead of the single-run ones."""
    out = Path(deck.run.output_dir)
    writes: list[tuple[str, Path]] = [("run.output_dir", out)]
    if experiment:
        e = deck.experiment
        for sh in e.shardings:
            writes.append(("run.output_dir", out / sh))
            for m in e.modes:
                for s in range(e.seeds):
                    writes.append(("run.output_dir", out / sh / m / f"seed{s}" / "checkpoints"))
    elif "finetune" in deck.run.stages:
        ck = Path(deck.checkpoint.dir) if deck.checkpoint.dir else out / "checkpoints"
        writes.append(("checkpoint.dir", ck))
    return writes


def check_writes(deck: Deck, comm, *, experiment: bool = False) -> None:
    """Check every folder :func:`planned_writes` names (rank 0); every rank raises the same
    one-line DeckError naming the deck and the key if one fails. Collective over ``comm``."""
    err = None
    if comm.Get_rank() == 0:
        for key, path in planned_writes(deck, experiment=experiment):
            why = _probe(path)
            if why:
                err = f"{deck.source}: {key}: {why}"
                break
    err = comm.bcast(err, root=0)
    if err:
        raise DeckError(err)


class OutputLock:
    """The exclusive lock of one output folder, taken by rank 0 (see the module docstring).

    ``OutputLock.acquire(outdir, deck, comm)`` is collective over ``comm``: rank 0 tries the
    lock and broadcasts the outcome, so every rank raises the same DeckError (exit 2) when
    another run holds the folder. ``release()`` is local (a no-op on other ranks)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, outdir: Path, deck: Deck, comm) -> OutputLock:
        path = Path(outdir) / LOCK_NAME
        fd, err = None, None
        if comm.Get_rank() == 0:
            try:
                fd, err = _take(path)
            except OSError as exc:
                err = f"cannot lock {path}: {exc.strerror or exc}"
            if err:
                err = f"{deck.source}: run.output_dir: {err}"
        err = comm.bcast(err, root=0)
        if err:
            raise DeckError(err)
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file, then drop the lock (rank 0; idempotent)."""
        if self.fd is None:
            return
        try:
            self.path.unlink()
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    return os.read(fd, 4096).decode("utf-8", "replace").strip()


def _take(path: Path) -> tuple[int | None, str | None]:
    """Lock ``path`` (create it if needed): ``(fd, None)``, or ``(None, why)`` when another
    live process holds it."""
    for _ in range(20):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                os.close(fd)
                raise
            who = _holder(fd)
            if not who:                 # the holder has not written its line yet
                time.sleep(0.2)
                who = _holder(fd)
            os.close(fd)
            return None, (f"{path.parent} is in use by another semzo run, process "
                          f"{who or '(holder unknown)'}; wait for it to end or choose another "
                          f"run.output_dir")
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:                    # released (file removed) while we opened it: retry
            os.close(fd)
            continue
        stale = _holder(fd)
        if stale:
            log.warning("run.output_dir: %s: stale lock of %s taken over (that run ended "
                        "without releasing it; its process holds no lock)", path.parent, stale)
        record = (f"{os.getpid()}@{socket.gethostname()} started "
                  f"{time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n").encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        return fd, None
    raise OSError(errno.EBUSY, "lock file keeps changing")
