"""Move rows between ranks with ``Alltoallv``, in rounds bounded by a memory cap.

A row is a set of columns (numpy arrays sharing their first axis: embeddings ``(n, d)``
float32, ids int64, labels, clusters ...) and optionally a text. Fixed-size columns travel
packed in one byte buffer per round (one ``Alltoallv``); texts travel as UTF-8 bytes in a second
``Alltoallv``, their lengths as a hidden int64 column. No pickling.

Rounds: each rank may use at most ``memory_cap_bytes`` per round for its send plus receive
buffers: half for sending, half for receiving. Receiver d grants each source s a share of its
half proportional to the bytes s will send it; sender s gives each destination a share of its
own half proportional to what it sends there; each pair sends per round the longest prefix of
its remaining rows that fits the smaller of the two shares (at least one row, so a row larger
than its share exceeds the cap rather than stalling). Every pair then needs about
``max(bytes out of s, bytes into d) / (cap / 2)`` rounds. The round count is agreed with an
``Allreduce(MAX)``, so every rank calls every collective the same number of times.

Order of received rows: by source rank, then the order they had on the source.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from semzo.corpus.strings import decode_strings, encode_strings
from semzo.runtime import get_logger

log = get_logger(__name__)

DEFAULT_CAP = 256 * 2**20
_MAX_HALF = 2**30          # keeps every count and displacement inside MPI's int
_TEXT_LEN = "\0text_len"   # hidden column (sorts before any real name)


def _excl(a: np.ndarray) -> np.ndarray:
    out = np.zeros_like(a)
    np.cumsum(a[:-1], out=out[1:])
    return out


def _chunks(row_bytes: np.ndarray, rate: int) -> list[int]:
    """Ends of consecutive chunks of rows, each at most ``rate`` bytes (at least one row)."""
    m = row_bytes.size
    if m == 0:
        return []
    cum = np.cumsum(row_bytes)
    if cum[-1] == 0:
        return [m]
    ends, i, before = [], 0, 0
    while i < m:
        j = int(np.searchsorted(cum, before + rate, side="right"))
        j = max(j, i + 1)
        ends.append(j)
        before = int(cum[j - 1])
        i = j
    return ends


def _gather_bytes(data: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    total = int(lens.sum())
    if total == 0:
        return np.empty(0, dtype=np.uint8)
    pos = np.repeat(starts - _excl(lens), lens) + np.arange(total)
    return data[pos]


def redistribute(comm, dest: np.ndarray, columns: dict[str, np.ndarray], *,
                 text: Sequence[str] | None = None, memory_cap_bytes: int = DEFAULT_CAP,
                 stats: dict | None = None) -> tuple[dict[str, np.ndarray], list[str] | None]:
    """Send local row i to rank ``dest[i]``; return the received columns and texts.

    dest: (n_local,) integer ranks. columns: name -> array with first axis n_local (same
    names, dtypes and trailing shapes on every rank; no object dtype). text: n_local strings
    or None (on every rank alike). memory_cap_bytes: bound on send + receive buffers per
    round. stats: if a dict, filled with ``rounds``, ``bytes_sent``, ``bytes_received``,
    ``max_round_bytes`` (largest send + receive buffer of a round on this rank).

    Collective over comm: two Alltoall of totals and grants, one Allreduce, then per round one
    Alltoall of counts and one or two Alltoallv. Inconsistent arguments on any rank make
    every rank raise ValueError after the Allreduce (nobody is left waiting).
    """

    nranks, rank = comm.Get_size(), comm.Get_rank()
    dest = np.asarray(dest).reshape(-1)
    n = dest.size
    problems = []
    if n and not np.issubdtype(dest.dtype, np.integer):
        problems.append(f"dest must be integers, got {dest.dtype}")
    elif n and (dest.min() < 0 or dest.max() >= nranks):
        problems.append(f"dest outside [0, {nranks})")
    cols: dict[str, np.ndarray] = {}
    for name in sorted(columns):
        a = np.asarray(columns[name])
        if a.ndim == 0 or a.shape[0] != n or a.dtype.hasobject:
            problems.append(f"column {name!r}: shape {a.shape}, dtype {a.dtype}")
        cols[name] = a
    if text is not None and len(text) != n:
        problems.append(f"text has {len(text)} entries for {n} rows")
    layout = [(name, a.dtype.str, a.shape[1:]) for name, a in cols.items()]
    sig = zlib.crc32(repr((layout, text is not None)).encode()) if not problems else 0

    if text is not None and not problems:
        tdata, tlen = encode_strings(text)
        cols = {_TEXT_LEN: tlen, **cols}
    else:
        tdata, tlen = np.empty(0, dtype=np.uint8), np.zeros(n, dtype=np.int64)
    widths = [int(a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)))
              for a in cols.values()]
    fixed = sum(widths)
    row_bytes = fixed + tlen
    tstart = _excl(tlen) if tlen.size else tlen

    if problems:
        order = np.empty(0, dtype=np.int64)
        sdest = order
    else:
        order = np.argsort(dest, kind="stable")
        sdest = dest[order].astype(np.int64)
    pair_first = np.searchsorted(sdest, np.arange(nranks + 1))   # rows of dest d: [f[d], f[d+1])
    totals = np.zeros((nranks, 3), dtype=np.int64)   # rows, text bytes, bytes
    totals[:, 0] = np.diff(pair_first)
    np.add.at(totals[:, 1], sdest, tlen[order])
    np.add.at(totals[:, 2], sdest, row_bytes[order])
    incoming = np.empty_like(totals)
    comm.Alltoall([totals, MPI.INT64_T], [incoming, MPI.INT64_T])

    half = max(1, min(int(memory_cap_bytes) // 2, _MAX_HALF))
    grant = np.zeros(nranks, dtype=np.int64)          # what I allow each source per round
    if incoming[:, 2].sum() > 0:
        grant = (half * incoming[:, 2].astype(np.float64) / incoming[:, 2].sum()).astype(np.int64)
    granted = np.empty_like(grant)
    comm.Alltoall([grant, MPI.INT64_T], [granted, MPI.INT64_T])
    own = np.zeros(nranks, dtype=np.int64)
    if totals[:, 2].sum() > 0:
        own = (half * totals[:, 2].astype(np.float64) / totals[:, 2].sum()).astype(np.int64)
    rate = np.minimum(granted, own)
    ends = [_chunks(row_bytes[order[pair_first[d]:pair_first[d + 1]]], int(rate[d]))
            for d in range(nranks)]
    my_rounds = max((len(e) for e in ends), default=0)

    flags = np.array([my_rounds, len(problems) > 0, sig, -sig], dtype=np.int64)
    agreed = np.empty_like(flags)
    comm.Allreduce([flags, MPI.INT64_T], [agreed, MPI.INT64_T], op=MPI.MAX)
    if agreed[1]:
        raise ValueError(f"redistribute: bad arguments on some rank"
                         f"{'; here: ' + '; '.join(problems) if problems else ''}")
    if agreed[2] != -agreed[3]:
        raise ValueError(f"redistribute: ranks passed different column layouts "
                         f"(rank {rank}: {layout}, text={text is not None})")
    rounds = int(agreed[0])

    # outputs, in source order
    n_recv = int(incoming[:, 0].sum())
    out = {name: np.empty((n_recv,) + a.shape[1:], dtype=a.dtype) for name, a in cols.items()}
    out_text = np.empty(int(incoming[:, 1].sum()), dtype=np.uint8)
    row_at = _excl(incoming[:, 0])          # next free row for each source
    text_at = _excl(incoming[:, 1])
    done = np.zeros(nranks, dtype=np.int64)  # chunks already sent to each destination
    sent_rows = np.zeros(nranks, dtype=np.int64)
    offs = np.concatenate(([0], np.cumsum(widths))).astype(np.int64)
    max_round = bytes_sent = bytes_recv = 0

    for _ in range(rounds):
        cnt = np.zeros((nranks, 2), dtype=np.int64)     # rows, text bytes per destination
        pieces = []
        for d in range(nranks):
            if done[d] < len(ends[d]):
                lo, hi = int(sent_rows[d]), ends[d][done[d]]
                idx = order[pair_first[d] + lo: pair_first[d] + hi]
                pieces.append(idx)
                cnt[d, 0], cnt[d, 1] = hi - lo, int(tlen[idx].sum())
                sent_rows[d], done[d] = hi, done[d] + 1
        idx = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
        rcnt = np.empty_like(cnt)
        comm.Alltoall([cnt, MPI.INT64_T], [rcnt, MPI.INT64_T])

        sbuf = np.empty((idx.size, fixed), dtype=np.uint8)
        for (name, a), lo, hi in zip(cols.items(), offs[:-1], offs[1:]):
            if hi > lo:
                raw = np.ascontiguousarray(a[idx]).view(np.uint8)
                sbuf[:, lo:hi] = raw.reshape(idx.size, hi - lo)
        rrows = int(rcnt[:, 0].sum())
        rbuf = np.empty((rrows, fixed), dtype=np.uint8)
        scounts, rcounts = cnt[:, 0] * fixed, rcnt[:, 0] * fixed
        comm.Alltoallv([sbuf, (scounts, _excl(scounts)), MPI.BYTE],
                       [rbuf, (rcounts, _excl(rcounts)), MPI.BYTE])
        slots = np.repeat(row_at - _excl(rcnt[:, 0]), rcnt[:, 0]) + np.arange(rrows)
        for (name, a), lo, hi in zip(cols.items(), offs[:-1], offs[1:]):
            if hi > lo:
                vals = np.ascontiguousarray(rbuf[:, lo:hi]).view(a.dtype)
                out[name][slots] = vals.reshape((rrows,) + a.shape[1:])
        row_at += rcnt[:, 0]
        round_bytes = sbuf.nbytes + rbuf.nbytes

        if text is not None:
            stxt = _gather_bytes(tdata, tstart[idx], tlen[idx])
            rtxt = np.empty(int(rcnt[:, 1].sum()), dtype=np.uint8)
            comm.Alltoallv([stxt, (cnt[:, 1], _excl(cnt[:, 1])), MPI.BYTE],
                           [rtxt, (rcnt[:, 1], _excl(rcnt[:, 1])), MPI.BYTE])
            tslots = np.repeat(text_at - _excl(rcnt[:, 1]), rcnt[:, 1]) + np.arange(rtxt.size)
            out_text[tslots] = rtxt
            text_at += rcnt[:, 1]
            round_bytes += stxt.nbytes + rtxt.nbytes
        max_round = max(max_round, round_bytes)
        bytes_sent += sbuf.nbytes + (stxt.nbytes if text is not None else 0)
        bytes_recv += rbuf.nbytes + (rtxt.nbytes if text is not None else 0)

    texts = None
    if text is not None:
        texts = decode_strings(out_text, out.pop(_TEXT_LEN))
    if stats is not None:
        stats.update(rounds=rounds, bytes_sent=bytes_sent, bytes_received=bytes_recv,
                     max_round_bytes=max_round)
    if rank == 0:
        log.debug("redistributed rows in %d round(s) (cap %d bytes per rank)", rounds,
                  memory_cap_bytes)
    return out, texts
