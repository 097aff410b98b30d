"""Strings as flat UTF-8 buffers, so they can travel through MPI buffer collectives.

A list of ``n`` strings becomes ``data`` (uint8, the concatenated UTF-8 bytes) and ``lengths``
(int64, ``(n,)``, bytes per string). No pickling anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI


def encode_strings(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(data uint8 (sum of lengths,), lengths int64 (n,))`` holding the UTF-8 of ``strings``."""
    encoded = [s.encode("utf-8") for s in strings]
    lengths = np.fromiter((len(b) for b in encoded), dtype=np.int64, count=len(encoded))
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return data, lengths


def decode_strings(data: np.ndarray, lengths: np.ndarray) -> list[str]:
    """Inverse of :func:`encode_strings` (``data`` uint8, ``lengths`` int64)."""
    raw = np.ascontiguousarray(data, dtype=np.uint8).tobytes()
    ends = np.cumsum(lengths, dtype=np.int64).tolist()
    out: list[str] = []
    start = 0
    for end in ends:
        out.append(raw[start:end].decode("utf-8"))
        start = end
    return out


def allgather_strings(strings: Sequence[str], comm) -> list[list[str]]:
    """Every rank's list of strings, on every rank (``result[r]`` is rank r's list).

    Collective over comm. Buffer collectives only (Allgather / Allgatherv of counts, lengths
    and bytes).
    """

    data, lengths = encode_strings(strings)
    size = comm.Get_size()
    mine = np.array([len(lengths), data.size], dtype=np.int64)
    counts = np.empty((size, 2), dtype=np.int64)
    comm.Allgather([mine, MPI.INT64_T], [counts, MPI.INT64_T])
    n_str, n_bytes = counts[:, 0], counts[:, 1]
    all_lengths = np.empty(int(n_str.sum()), dtype=np.int64)
    comm.Allgatherv([lengths, MPI.INT64_T],
                    [all_lengths, (n_str, _displs(n_str)), MPI.INT64_T])
    all_data = np.empty(int(n_bytes.sum()), dtype=np.uint8)
    comm.Allgatherv([data, MPI.BYTE], [all_data, (n_bytes, _displs(n_bytes)), MPI.BYTE])
    out: list[list[str]] = []
    s0 = b0 = 0
    for r in range(size):
        s1, b1 = s0 + int(n_str[r]), b0 + int(n_bytes[r])
        out.append(decode_strings(all_data[b0:b1], all_lengths[s0:s1]))
        s0, b0 = s1, b1
    return out


def _displs(counts: np.ndarray) -> np.ndarray:
    d = np.zeros_like(counts)
    np.cumsum(counts[:-1], out=d[1:])
    return d
