"""SPMD runtime: rank-aware logging, stage timers, and the error policy that never hangs.

Policy: an exception on any rank is reported once, by the rank that raised it, and then the
world is aborted (``MPI_Abort``), so ranks blocked in a collective do not wait for a peer that
will never arrive. Deck errors are detected identically on every rank before any work starts,
so they exit with code 2 without needing an abort.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator

EXIT_USAGE = 2     # bad deck, bad input file, bad command line
EXIT_FAILURE = 1   # anything else


class SemzoError(Exception):
    """An error caused by the user's input (deck, data file, command line): exit code 2.

    The message is one line naming the file and the key or line.
    """

    exit_code = EXIT_USAGE
    label = "error"       # the word before the message in the one line run_spmd prints


class AllRanksError(SemzoError):
    """A :class:`SemzoError` every rank raises together, after a collective agreed on it
    (a bcast or allgather of the message): rank 0 prints it once and every rank exits."""

    all_ranks = True


class InvariantError(AllRanksError):
    """A broken internal invariant that a collective check found on every rank at once
    (samples lost in a redistribution, replicas passing other arrays): one line, exit 1."""

    exit_code = EXIT_FAILURE


def raise_first(allreduce, key: int | None, msg: str | None) -> None:
    """Collective: when some rank has an error (``key`` not None: the record id, line or row it
    is about, ``msg`` its message), every rank raises the same :class:`AllRanksError`: the
    message of the smallest key (of the lowest rank holding it). ``allreduce``: a topology's
    (or :func:`semzo.preflight.check_samples`'s) in-place allreduce of NumPy buffers; one call
    when no rank has an error, three when one has (the message travels as UTF-8 bytes)."""
    import numpy as np
    from mpi4py import MPI

    none = np.iinfo(np.int64).max
    k = np.array([none if key is None else int(key)], np.int64)
    allreduce(k, op=MPI.MIN)
    if k[0] == none:
        return
    rank, size = _rank_size()
    mine = key is not None and int(key) == k[0]
    r = np.array([rank if mine else size], np.int64)
    allreduce(r, op=MPI.MIN)
    b = np.zeros(1024, np.uint8)
    if rank == r[0]:
        raw = str(msg).encode("utf-8", "replace")[:b.size]
        b[:len(raw)] = np.frombuffer(raw, np.uint8)
    allreduce(b, op=MPI.MAX)
    raise AllRanksError(b.tobytes().rstrip(b"\0").decode("utf-8", "replace"))


def together(allreduce, fn: Callable, *args, **kw):
    """``fn(*args, **kw)``; a :class:`SemzoError` it raises on any rank is raised on every rank
    together (:func:`raise_first`). Collective: for what every rank reads alike (a model
    folder's files) inside a collective stage."""
    try:
        out, key, msg = fn(*args, **kw), None, None
    except SemzoError as exc:
        out, key, msg = None, 0, str(exc)
    raise_first(allreduce, key, msg)
    return out


def _rank_size() -> tuple[int, int]:
    """Rank and size of the world, without initializing MPI if it is not initialized yet."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        return mpi.COMM_WORLD.Get_rank(), mpi.COMM_WORLD.Get_size()
    for r, s in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                 ("SLURM_PROCID", "SLURM_NTASKS")):
        if r in os.environ and s in os.environ:
            return int(os.environ[r]), int(os.environ[s])
    return 0, 1


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank, record.size = _rank_size()
        return True


_configured = False


def setup_logging(level: str | None = None, *, all_ranks: bool = False) -> None:
    """Configure the ``semzo`` logger: rank 0 at INFO (or ``level``), others at WARNING.

    Every record carries ``rank/size``. Idempotent.
    """
    global _configured
    rank, _ = _rank_size()
    root = logging.getLogger("semzo")
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(_RankFilter())
        handler.setFormatter(logging.Formatter(
            "%(asctime)s %(rank)d/%(size)d %(levelname)-7s %(name)s: %(message)s", "%H:%M:%S"))
        root.addHandler(handler)
        root.propagate = False
        _configured = True
    lvl = getattr(logging, (level or "INFO").upper())
    root.setLevel(lvl if (rank == 0 or all_ranks) else max(lvl, logging.WARNING))


def get_logger(name: str) -> logging.Logger:
    """A logger under the ``semzo`` hierarchy (configure once with :func:`setup_logging`)."""
    if not _configured:
        setup_logging()
    return logging.getLogger(name if name.startswith("semzo") else f"semzo.{name}")


class StageTimer:
    """Wall time per named stage (and, inside a stage, time spent communicating).

    ``with timer.stage("embed"): ...``; ``with timer.comm(): ...`` around MPI calls.
    """

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.comm_time: dict[str, float] = {}
        self._current: str | None = None

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        prev, self._current = self._current, name
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - t0
            self._current = prev

    @contextlib.contextmanager
    def comm(self) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            key = self._current or "-"
            self.comm_time[key] = self.comm_time.get(key, 0.0) + time.perf_counter() - t0

    def table(self) -> str:
        """A small text table of stage wall times and their communication share."""
        total = sum(self.wall.values()) or 1.0
        lines = [f"{'stage':<14}{'wall [s]':>10}{'share':>8}{'comm':>8}"]
        for name, t in self.wall.items():
            c = self.comm_time.get(name, 0.0)
            lines.append(f"{name:<14}{t:>10.3f}{t / total:>8.1%}{(c / t if t else 0):>8.1%}")
        return "\n".join(lines)


def abort_world(code: int) -> None:
    """Abort every rank of MPI_COMM_WORLD (used after an unhandled error on one rank)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if (mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
            and mpi.COMM_WORLD.Get_size() > 1):
        mpi.COMM_WORLD.Abort(code)
    sys.exit(code)


def run_spmd(main: Callable[[], int | None]) -> None:
    """Run ``main`` on every rank; on an exception, report once from that rank and abort all.

    A :class:`SemzoError` prints ``error: <message>`` (one line) and exits 2. Because deck
    errors are raised identically on every rank, each rank exits 2 on its own, but only rank 0
    prints. Any other exception prints ``rank R raised`` with the traceback and aborts the world
    (exit 1), so peers blocked in collectives end promptly.
    """
    rank, size = _rank_size()
    try:
        code = main() or 0
    except SemzoError as exc:
        if getattr(exc, "all_ranks", False):
            if rank == 0:
                print(f"{exc.label}: {exc}", file=sys.stderr, flush=True)
            sys.exit(exc.exit_code)
        print(f"error (rank {rank} of {size}): {exc}", file=sys.stderr, flush=True)
        abort_world(exc.exit_code)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - every failure must end the world
        tb = "".join(traceback.format_exception(exc))
        print(f"error: rank {rank} of {size} raised {type(exc).__name__}: {exc}\n{tb}",
              file=sys.stderr, flush=True)
        abort_world(EXIT_FAILURE)
    sys.exit(code)
