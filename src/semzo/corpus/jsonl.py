"""Parallel JSONL corpus reader: each rank reads only its byte range of the file.

Format: one JSON object per line, ``{"text": str, "label": str | int (optional),
"id": int (optional)}``; other keys are ignored. Blank lines (only whitespace) are allowed and
skipped: they count for line numbers but are not records. ``label`` and ``id`` are all-or-none:
either every record has one or none does. ``null`` is not a valid label or id. Integer labels
are turned into strings (``7`` -> ``"7"``); ids must lie in ``[0, 2**63)``. Ids are not checked
for uniqueness (that would need a global sort); default ids are the global record numbers.

Split: with file size ``S`` and ``P`` ranks, rank ``r`` owns the lines whose first byte lies in
``[r*S//P, (r+1)*S//P)``. It seeks to its start, skips the partial line there, and reads up to
the end of the last line that starts before its end. Global record and line numbers come from
an ``Exscan`` of local counts, so a rank counts only its own lines.

Errors: a malformed line is reported as ``SemzoError("PATH:LINE: what")`` (LINE 1-based). The
ranks agree on the error before raising: after the count collectives, an ``Allreduce(MIN)``
finds the first bad line of the whole file, the rank that read it broadcasts the message, and
every rank raises the same :class:`~semzo.runtime.SemzoError` (with ``all_ranks = True``), so
``run_spmd`` prints it once (rank 0) and every rank exits 2 without anyone waiting in a
collective. The reported line is the first bad line in the file, whatever the rank count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from semzo.corpus.records import SURROGATE, canonical, check_record, embed_text, is_unicode
from semzo.corpus.strings import allgather_strings
from semzo.runtime import SemzoError, get_logger

log = get_logger(__name__)

_NONE = np.iinfo(np.int64).max     # "no such line" in MIN reductions
_ID_MAX = 2**63 - 1


@dataclass
class CorpusSlice:
    """This rank's records of a JSONL corpus.

    texts: ``n_local`` strings. labels: ``n_local`` strings, or ``None`` when the corpus has no
    labels (the same on every rank). ids: int64 ``(n_local,)``. first_record: global number
    (0-based) of this rank's first record. n_total: records in the whole file.
    """

    texts: list[str]
    labels: list[str] | None
    ids: np.ndarray
    first_record: int
    n_total: int
    embed: list[str] | None = None     # what to embed when it is not ``texts`` (sft, choice)
    lines: np.ndarray | None = None    # 1-based line (JSONL) or row (Parquet) of each record

    def __len__(self) -> int:
        return len(self.texts)


@dataclass
class _Scan:
    n_lines: int = 0                      # physical lines read (blank ones included)
    texts: list | None = None
    labels: list | None = None
    embed: list | None = None
    lines: list | None = None
    ids: list | None = None
    error: tuple[int, str] | None = None  # (local line index, or -1 for the file; message)
    first_labelled: int = -1              # local line index of first record with/without...
    first_unlabelled: int = -1
    first_with_id: int = -1
    first_without_id: int = -1


def _byte_range(size: int, rank: int, nranks: int) -> tuple[int, int]:
    return rank * size // nranks, (rank + 1) * size // nranks


def read_lines(path: str, start: int, end: int) -> list[bytes]:
    """The lines (without ``\\n``) whose first byte lies in ``[start, end)`` of ``path``."""
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            if f.read(1) != b"\n":
                f.readline()              # we are inside a line owned by the previous rank
        pos = f.tell()
        if pos >= end:
            return []
        chunk = f.read(end - pos)
        if chunk and not chunk.endswith(b"\n"):
            chunk += f.readline()         # finish the last line, which starts before end
    lines = chunk.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


def parse_line(raw: bytes, kind: str = "text") -> tuple | str | None:
    """Parse one line: ``None`` if blank, ``(text, label, id)`` (missing -> ``...``) if valid,
    else an error message (str). ``kind``: the record format (:mod:`.records`); for ``sft`` and
    ``choice`` the text is the record's canonical JSON and a fourth item is what to embed."""
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 ({exc.reason} at byte {exc.start})"
    except json.JSONDecodeError as exc:
        return f"invalid JSON ({exc.msg} at column {exc.colno})"
    except RecursionError:
        return "invalid JSON (nested too deeply)"
    except ValueError:                    # an integer of more than sys.get_int_max_str_digits()
        return "invalid JSON (an integer with too many digits)"
    return parse_object(obj, kind)


def parse_object(obj, kind: str = "text") -> tuple | str:
    """A parsed JSON object (or a Parquet row) as :func:`parse_line` returns it."""
    if not isinstance(obj, dict):
        return f"expected a JSON object, got {type(obj).__name__}"
    if kind != "text":
        rec = check_record(obj, kind)
        if isinstance(rec, str):
            return rec
        ident = _check_id(obj)
        if isinstance(ident, str):
            return ident
        return canonical(rec), ..., ident, embed_text(rec)
    if "text" not in obj:
        return "missing 'text'"
    text = obj["text"]
    if not isinstance(text, str):
        return f"'text' must be a string, got {_jtype(text)}"
    if not is_unicode(text):
        return f"'text' {SURROGATE}"
    label = obj.get("label", ...)
    if label is not ...:
        if isinstance(label, bool) or not isinstance(label, (str, int)):
            return f"'label' must be a string or an integer, got {_jtype(label)}"
        if isinstance(label, str) and not is_unicode(label):
            return f"'label' {SURROGATE}"
        label = str(label)
    ident = _check_id(obj)
    if isinstance(ident, str):
        return ident
    return text, label, ident


def _check_id(obj: dict):
    """``obj["id"]`` (``...`` when missing) or an error message."""
    ident = obj.get("id", ...)
    if ident is not ...:
        if ident is None:
            return ...                    # a Parquet column with nulls: no id
        if isinstance(ident, bool) or not isinstance(ident, int):
            return f"'id' must be an integer, got {_jtype(ident)}"
        if not 0 <= ident <= _ID_MAX:
            return f"'id' must lie in [0, 2**63), got {ident}"
    return ident


def _jtype(v: object) -> str:
    return {type(None): "null", bool: "boolean", int: "integer", float: "number",
            str: "string", list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _scan(path: str, start: int, end: int, kind: str = "text") -> _Scan:
    sc = _Scan(texts=[], labels=[], ids=[], embed=[], lines=[])
    try:
        lines = read_lines(path, start, end)
    except OSError as exc:
        sc.error = (-1, f"cannot read: {exc.strerror or exc}")
        return sc
    sc.n_lines = len(lines)
    for i, raw in enumerate(lines):
        rec = parse_line(raw, kind)
        if rec is None:
            continue
        if isinstance(rec, str):
            sc.error = (i, rec)
            break
        add_record(sc, i, rec)
    return sc


def add_record(sc: _Scan, i: int, rec: tuple) -> None:
    """Append a parsed record (local line or row index ``i``) to the scan."""
    text, label, ident = rec[:3]
    sc.texts.append(text)
    sc.lines.append(i)
    if len(rec) > 3:
        sc.embed.append(rec[3])
    if label is ...:
        if sc.first_unlabelled < 0:
            sc.first_unlabelled = i
    else:
        sc.labels.append(label)
        if sc.first_labelled < 0:
            sc.first_labelled = i
    if ident is ...:
        if sc.first_without_id < 0:
            sc.first_without_id = i
    else:
        sc.ids.append(ident)
        if sc.first_with_id < 0:
            sc.first_with_id = i


def read_jsonl_slice(path: str | os.PathLike, comm, kind: str = "text") -> CorpusSlice:
    """Read this rank's byte range of the JSONL corpus at ``path`` (see the module docstring);
    ``kind``: the record format (:mod:`.records`: ``text``, ``sft``, ``choice``).

    Collective over comm (Bcast of the file size from rank 0, Exscan and Allreduce of line and
    record counts, Allreduce(MIN) of error positions, a Bcast of the message on error). On a
    malformed file every rank raises the same ``SemzoError("PATH:LINE: ...")``.
    """

    path = os.fspath(path)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    size = np.array([-1], dtype=np.int64)
    if rank == 0:
        try:
            st = os.stat(path)
            if os.path.isfile(path):
                size[0] = st.st_size
        except OSError:
            pass
    comm.Bcast([size, MPI.INT64_T], root=0)
    if size[0] < 0:
        exc = SemzoError(f"{path}: no such file (or not a regular file)")
        exc.all_ranks = True
        raise exc

    start, end = _byte_range(int(size[0]), rank, nranks)
    return gather_scan(path, comm, _scan(path, start, end, kind), kind)


def gather_scan(path: str, comm, sc: _Scan, kind: str, unit: str = "line") -> CorpusSlice:
    """The slice from this rank's scan: global line (or row) and record numbers, the first
    error of the whole file raised on every rank. Collective. ``unit``: ``"line"`` (JSONL,
    1-based ``PATH:LINE: ...``) or ``"row"`` (Parquet, ``PATH: row N (0-based): ...``)."""
    rank, nranks = comm.Get_rank(), comm.Get_size()

    counts = np.array([sc.n_lines, len(sc.texts)], dtype=np.int64)
    before = np.zeros(2, dtype=np.int64)
    comm.Exscan([counts, MPI.INT64_T], [before, MPI.INT64_T], op=MPI.SUM)
    if rank == 0:
        before[:] = 0                      # Exscan leaves rank 0's buffer undefined
    totals = np.empty(2, dtype=np.int64)
    comm.Allreduce([counts, MPI.INT64_T], [totals, MPI.INT64_T], op=MPI.SUM)
    first_line, first_record = int(before[0]), int(before[1])

    def glob(i: int) -> int:               # local line index -> global 0-based line number
        return _NONE if i < 0 else first_line + i

    err_key = _NONE
    if sc.error is not None:
        err_key = (sc.error[0] + 1 + (first_line if sc.error[0] >= 0 else 0)) * nranks + rank
    local = np.array([err_key, glob(sc.first_labelled), glob(sc.first_unlabelled),
                      glob(sc.first_with_id), glob(sc.first_without_id)], dtype=np.int64)
    first = np.empty_like(local)
    comm.Allreduce([local, MPI.INT64_T], [first, MPI.INT64_T], op=MPI.MIN)
    _raise_first_error(path, comm, first, sc, err_key, unit)

    texts = sc.texts
    labels = sc.labels if first[1] != _NONE else None
    if first[3] != _NONE:
        ids = np.array(sc.ids, dtype=np.int64)
    else:
        ids = np.arange(first_record, first_record + len(texts), dtype=np.int64)
    if rank == 0:
        log.info("read %s: %d records (%d %ss) on %d ranks", path, int(totals[1]),
                 int(totals[0]), unit, nranks)
    return CorpusSlice(texts=texts, labels=labels, ids=ids, first_record=first_record,
                       n_total=int(totals[1]), embed=sc.embed if kind != "text" else None,
                       lines=np.array(sc.lines, np.int64) + first_line
                       + (1 if unit == "line" else 0))


def _raise_first_error(path: str, comm, first: np.ndarray, sc: _Scan, err_key: int,
                       unit: str = "line") -> None:
    """Raise, identically on every rank, the error at the first bad line of the file (if any).

    ``first`` is the MIN-reduced ``[error key, first labelled, first unlabelled, first with id,
    first without id]`` (global 0-based lines; error key = (line+1)*nranks + rank).
    """

    nranks = comm.Get_size()
    cands: list[tuple[int, str]] = []      # (global 0-based line, message)
    for name, a, b in (("label", first[1], first[2]), ("id", first[3], first[4])):
        if a != _NONE and b != _NONE:
            if a < b:
                msg = f"record has no '{name}' but {_where(unit, a)} has one"
                cands.append((int(b), f"{msg} (give every record a '{name}' or none)"))
            else:
                msg = f"record has a '{name}' but {_where(unit, b)} has none"
                cands.append((int(a), f"{msg} (give every record a '{name}' or none)"))
    key = int(first[0])
    if key != _NONE:
        line, root = key // nranks - 1, key % nranks
        buf = np.zeros(1, dtype=np.int64)
        if err_key == key:
            msg_bytes = np.frombuffer(sc.error[1].encode("utf-8"), dtype=np.uint8).copy()
            buf[0] = msg_bytes.size
        comm.Bcast([buf, MPI.INT64_T], root=root)
        if err_key != key:
            msg_bytes = np.empty(int(buf[0]), dtype=np.uint8)
        comm.Bcast([msg_bytes, MPI.BYTE], root=root)
        cands.append((line, msg_bytes.tobytes().decode("utf-8")))
    if not cands:
        return
    line, msg = min(cands)
    if line < 0:
        exc = SemzoError(f"{path}: {msg}")
    elif unit == "line":
        exc = SemzoError(f"{path}:{line + 1}: {msg}")
    else:
        exc = SemzoError(f"{path}: {_where(unit, line)}: {msg}")
    exc.all_ranks = True                   # every rank raises it; run_spmd prints it once
    raise exc


def _where(unit: str, i: int) -> str:
    """Line ``i`` (0-based) as the error messages name it."""
    return f"line {i + 1}" if unit == "line" else f"row {i} (0-based)"


def label_vocab(labels_local: Sequence[str] | None, comm) -> list[str]:
    """Sorted union of every rank's labels, identical on all ranks (``[]`` if none anywhere).

    Collective over comm (allgather of each rank's unique labels as UTF-8 buffers).
    """
    mine = sorted(set(labels_local)) if labels_local else []
    union: set[str] = set()
    for part in allgather_strings(mine, comm):
        union.update(part)
    return sorted(union)


def label_codes(labels: Sequence[str], vocab: Sequence[str]) -> np.ndarray:
    """int64 codes of ``labels`` as positions in ``vocab`` (KeyError for an unknown label)."""
    index = {lab: i for i, lab in enumerate(vocab)}
    return np.fromiter((index[lab] for lab in labels), dtype=np.int64, count=len(labels))
