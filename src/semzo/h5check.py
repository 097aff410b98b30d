"""Checks of the arrays semzo reads back from its own HDF5 files (embeddings.h5, clusters.h5,
shards.h5), made where they are read, before any kernel or index sees them.

Everything read from a file is untrusted: a label, cluster id, sample id or row offset out of
range would otherwise reach ``np.add.at``/``bincount``/``take_along_axis`` (a traceback), a
CuPy gather on the GPU (no bounds check) or an HDF5 selection. A failed check is one line
naming the file, the dataset and the first bad row, raised on every rank as
:class:`InputFileError` (exit 2).

Readers call the ``*_error`` functions (pure, return ``None`` or the message) on the rows they
read, then :func:`agree` (collective: one allgather) so that every rank raises the same error
even when only one rank's rows are bad. Shape checks use file metadata only (the same on every
rank) but go through :func:`agree` too.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Sequence

import numpy as np

from .runtime import SemzoError

DAMAGED = "the file is damaged or was not written by this semzo"


class InputFileError(SemzoError):
    """A damaged or foreign input file; raised identically on every rank (exit 2)."""

    all_ranks = True


class OutputFileError(SemzoError):
    """An output file that cannot be created; raised identically on every rank (exit 2)."""

    all_ranks = True


def agree(comm, err: str | None) -> None:
    """Raise :class:`InputFileError` on every rank if any rank has an error (the lowest rank's
    message). Collective over ``comm`` (one allgather of the message or None)."""
    errors = comm.allgather(err) if comm is not None else [err]
    first = next((e for e in errors if e), None)
    if first is not None:
        raise InputFileError(first)


def _first(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def range_error(path, name: str, a: np.ndarray, lo: int, hi: int | None, *, row0: int = 0,
                what: str = "") -> str | None:
    """None if every value of the integer array ``a`` lies in ``[lo, hi)`` (``hi`` None: no
    upper bound); else the message (``row0``: global row of ``a[0]``; ``what``: why the
    range, for the message)."""
    a = np.asarray(a)
    if a.size and a.dtype.kind not in "iu":
        return f"{path}: dataset {name}: expected integers, got {a.dtype} ({DAMAGED})"
    if a.size == 0:
        return None
    bad = (a < lo) if hi is None else (a < lo) | (a >= hi)
    if not bad.any():
        return None
    i = _first(bad)
    rng = f"below {lo}" if hi is None else f"outside [{lo}, {hi})"
    return (f"{path}: dataset {name}: row {row0 + i} holds {int(a[i])}, {rng}"
            f"{f' ({what})' if what else ''}: {DAMAGED}")


def finite_error(path, name: str, a: np.ndarray, *, row0: int = 0) -> str | None:
    """None if every value of ``a`` (floats, rows from ``row0``) is finite."""
    a = np.asarray(a)
    if a.dtype.kind != "f":
        return f"{path}: dataset {name}: expected floats, got {a.dtype} ({DAMAGED})"
    if a.size == 0:
        return None
    bad = ~np.isfinite(a)
    if not bad.any():
        return None
    if bad.ndim > 1:
        bad = bad.reshape(bad.shape[0], -1).any(axis=1)
    i = _first(bad)
    return f"{path}: dataset {name}: row {row0 + i} is not finite (NaN or Inf): {DAMAGED}"


def offsets_error(path, name: str, offs: np.ndarray, lo: int, hi: int, *,
                  row0: int = 0) -> str | None:
    """None if ``offs`` (integers) is non-decreasing and within ``[lo, hi]``."""
    offs = np.asarray(offs)
    if offs.size and offs.dtype.kind not in "iu":
        return f"{path}: dataset {name}: expected integers, got {offs.dtype} ({DAMAGED})"
    err = range_error(path, name, offs, lo, hi + 1, row0=row0)
    if err:
        return err
    down = np.diff(offs.astype(np.int64)) < 0
    if down.any():
        i = _first(down) + 1
        return (f"{path}: dataset {name}: row {row0 + i} holds {int(offs[i])}, below the "
                f"previous row's {int(offs[i - 1])} (offsets must not decrease): {DAMAGED}")
    return None


def shape_error(path, f, rows: dict[str, tuple[int, int]]) -> str | None:
    """None if ``f`` (an open h5py File) has every dataset named in ``rows`` with the given
    ``(first dimension, number of dimensions)``; a dimension of -1 is not checked."""
    for name, (n, ndim) in rows.items():
        if name not in f:
            return f"{path}: dataset {name} is missing: {DAMAGED}"
        shape = f[name].shape
        if shape is None or len(shape) != ndim or (n >= 0 and shape[0] != n):
            want = f"{n} rows" if n >= 0 else f"{ndim} dimension(s)"
            return f"{path}: dataset {name}: shape {shape}, expected {want}: {DAMAGED}"
    return None


def attr_int(path, f, name: str) -> tuple[int | None, str | None]:
    """``(value, None)`` for a non-negative integer root attribute, else ``(None, message)``."""
    v = f.attrs.get(name)
    if v is None:
        return None, f"{path}: attribute {name} is missing: {DAMAGED}"
    try:
        iv = int(v)
    except (TypeError, ValueError):
        return None, f"{path}: attribute {name}: {v!r} is not an integer: {DAMAGED}"
    if iv < 0 or iv != v:
        return None, f"{path}: attribute {name}: {v!r} is not a non-negative integer: {DAMAGED}"
    return iv, None


#: deck keys of the stage that made a file, checked by the next stage when it reads the file:
#: a stage run alone (``run.stages``) after one of them changed would otherwise ignore the
#: change silently and store a deck in its own output that its data were not made with. Keys
#: of stages further up are left alone (a fine-tuning run may name another corpus or model
#: than the sharding stages used: it reads only shards.h5); the file ids catch a file made
#: again upstream.
CORPUS_KEYS = ("corpus.path", "corpus.max_records", "corpus.labels")
CLUSTER_KEYS = ("cluster.k", "cluster.max_iter", "cluster.tol", "cluster.spherical",
                "cluster.oversampling", "cluster.init_rounds", "cluster.algorithm")
SHARD_KEYS = ("place.mode", "place.balance_tol", "place.rank_weights")


def _same_path(a, b) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(str(a), str(b))
    except (OSError, TypeError, ValueError):
        return False


def deck_drift(path, stored, deck, keys: Sequence[str], hint: str) -> str | None:
    """None if each ``section.key`` of ``keys`` has the same value in ``deck`` as in the deck
    ``path`` was made with (``stored``: its ``semzo_deck`` attribute, TOML); else one line
    naming the first key that differs and what to do (``hint``). A key the stored deck lacks
    (a file from an older semzo) is not compared; paths that name the same file are equal."""
    if isinstance(stored, bytes):
        stored = stored.decode("utf-8", "replace")
    if not stored:
        return None
    try:
        made = tomllib.loads(str(stored))
    except tomllib.TOMLDecodeError:
        return f"{path}: attribute semzo_deck is not a TOML deck: {DAMAGED}"
    for key in keys:
        sec, name = key.split(".", 1)
        if not isinstance(made.get(sec), dict) or name not in made[sec]:
            continue
        old, new = made[sec][name], getattr(getattr(deck, sec), name)
        if isinstance(new, tuple):
            new = list(new)
        if name == "path" and _same_path(old, new):
            continue
        if old != new:
            return (f"{deck.source}: {key} = {new!r}, but {path} was made with {key} = "
                    f"{old!r}: {hint}")
    return None
