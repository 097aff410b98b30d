"""Parallel Parquet corpus reader (``corpus.path`` ending in ``.parquet``): the same records as
the JSONL reader (:mod:`.jsonl`, :mod:`.records`: the columns are the JSONL keys, ``text`` /
``label`` / ``id``, or ``prompt`` / ``completion``, ``messages`` (a list of structs with
``role`` and ``content``), or ``prompt`` / ``choices`` / ``answer``; other columns are not
read), as the ``datasets`` library saves them.

Split: with ``G`` row groups and ``P`` ranks, rank ``r`` reads row groups
``[r*G//P, (r+1)*G//P)`` (pyarrow, one row group at a time, only the columns the record format
uses); a file of one row group is read by rank 0 alone and the rows then travel to their ranks
in balanced blocks (later stages rebalance anyway). Global row and record numbers come from an
``Exscan`` of local counts as in the JSONL reader, and errors name the row (0-based, the index
``pandas`` and ``datasets`` show): ``PATH: row N (0-based): what``, the first bad row of the
file, on every rank.
"""

from __future__ import annotations

import os

from semzo.corpus.jsonl import (
    CorpusSlice,
    _Scan,
    add_record,
    gather_scan,
    parse_object,
    read_jsonl_slice,
)
from semzo.runtime import SemzoError

COLUMNS = {"text": ("text", "label", "id"), "sft": ("prompt", "completion", "messages", "id"),
           "choice": ("prompt", "choices", "answer", "id")}


def _fail(msg: str) -> SemzoError:
    exc = SemzoError(msg)
    exc.all_ranks = True
    return exc


def read_parquet_slice(path: str | os.PathLike, comm, kind: str = "text") -> CorpusSlice:
    """This rank's records of the Parquet corpus at ``path`` (see the module docstring).
    Collective over comm; a malformed record, a missing file or a file pyarrow cannot read is
    a :class:`SemzoError` raised on every rank."""
    path = os.fspath(path)
    rank, nranks = comm.Get_rank(), comm.Get_size()
    try:
        import pyarrow.parquet as pq  # a runtime dependency, needed only for Parquet input
    except ImportError:
        raise _fail(f"{path}: reading Parquet needs the pyarrow package (a runtime "
                    f"dependency: run make setup)") from None
    meta, err = None, None
    if rank == 0:
        try:
            if not os.path.isfile(path):
                err = f"{path}: no such file (or not a regular file)"
            else:
                meta = pq.ParquetFile(path).metadata
        except Exception as exc:            # noqa: BLE001 - pyarrow raises many kinds
            err = f"{path}: not a readable Parquet file ({exc})"
    err = comm.bcast(err, root=0)
    if err:
        raise _fail(err)
    n_groups = comm.bcast(meta.num_row_groups if rank == 0 else None, root=0)
    lo, hi = rank * n_groups // nranks, (rank + 1) * n_groups // nranks
    sc = _Scan(texts=[], labels=[], ids=[], embed=[], lines=[])
    rows: list = []
    if hi > lo:
        try:
            f = pq.ParquetFile(path)
            names = set(f.schema_arrow.names)
            cols = [c for c in COLUMNS[kind] if c in names]
            for g in range(lo, hi):
                rows += f.read_row_group(g, columns=cols).to_pylist()
        except Exception as exc:            # noqa: BLE001
            sc.error = (-1, f"not a readable Parquet file ({exc})")
    if n_groups == 1 and nranks > 1:             # every rank takes part (collective)
        rows = _spread(rows if sc.error is None else [], comm)
    sc.n_lines = len(rows)
    for i, obj in enumerate(rows):
        obj = {k: v for k, v in obj.items() if v is not None or k not in ("label", "id")}
        rec = parse_object(obj, kind)
        if isinstance(rec, str):
            sc.error = (i, rec)
            break
        add_record(sc, i, rec)
    return gather_scan(path, comm, sc, kind, unit="row")


def _spread(rows: list, comm) -> list:
    """Rank 0's rows in balanced contiguous blocks over the ranks (a file of one row group)."""
    n = comm.bcast(len(rows) if comm.Get_rank() == 0 else None, root=0)
    p = comm.Get_size()
    parts = [rows[r * n // p:(r + 1) * n // p] for r in range(p)] if comm.Get_rank() == 0 \
        else None
    return comm.scatter(parts, root=0)


def read_corpus_slice(path: str | os.PathLike, comm, kind: str = "text") -> CorpusSlice:
    """This rank's records of the corpus at ``path``: Parquet when it ends in ``.parquet``,
    else JSONL."""
    if os.fspath(path).endswith(".parquet"):
        return read_parquet_slice(path, comm, kind)
    return read_jsonl_slice(path, comm, kind)

