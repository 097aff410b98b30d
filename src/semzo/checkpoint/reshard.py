"""Per-rank state at a new world size: the data-cursor rule.

Parameters are replicated and stored in their global shapes, so they load at any world size
unchanged. Per-rank tables (P_saved, ...) need a rule; two names have one:

``cursor``: integer row ``[epoch, position, extra...]``: the rank has made ``epoch`` full
passes over its shard and consumed ``position`` samples of the current pass. ``shard_size``:
the number of samples in the rank's shard (a scalar per rank).

Rule (:func:`remap_cursors`): keep the number of samples seen and make every new rank equally
far through its own shard. With old shard sizes ``n_r`` the run has seen
``S = sum(epoch_r * n_r + position_r)`` of ``N = sum(n_r)`` samples per epoch, so it is
``F = S / N`` epochs in. New rank ``q`` with shard size ``m_q`` (given, or ``N`` split evenly)
gets ``seen_q``: ``F * m_q`` rounded so that ``sum(seen_q) = round(F * sum(m_q))`` exactly
(largest remainders, ties to the lower rank), then ``epoch_q = seen_q // m_q`` and
``position_q = seen_q % m_q``. Extra columns are set to 0 (derive any shuffling state from
seed, epoch and rank). Without old shard sizes (no ``shard_size`` table) the fallback is
``epoch = max(old epochs), position = 0``: every new rank starts the most advanced rank's
epoch from its beginning (some samples are seen again). At the saved world size with unchanged shard sizes rows come back
exactly. Other per-rank names have no rule at a new world size and are dropped (reported).
"""

from __future__ import annotations

import numpy as np

from ..runtime import get_logger

log = get_logger(__name__)


def _even(n_total: int, p: int) -> np.ndarray:
    return np.array([n_total * (q + 1) // p - n_total * q // p for q in range(p)], np.int64)


def remap_cursors(old: np.ndarray, p_new: int, *, sizes_old=None, sizes_new=None) -> np.ndarray:
    """Cursors (P_old, C >= 2) saved at P_old ranks -> (p_new, C) by the rule above.

    ``sizes_old`` (P_old,) and ``sizes_new`` (p_new,) are shard sizes in samples; ``sizes_new``
    defaults to ``sum(sizes_old)`` split evenly. Deterministic, the same on every rank.
    """
    old = np.asarray(old)
    if old.ndim != 2 or old.shape[1] < 2 or old.dtype.kind not in "iu":
        raise ValueError(f"cursors must be an integer (P, C>=2) table [epoch, position, ...], "
                         f"got {old.dtype} {old.shape}")
    p_old = old.shape[0]
    out = np.zeros((p_new, old.shape[1]), dtype=old.dtype)
    if sizes_old is None:
        if p_new == p_old and sizes_new is None:
            return old.copy()
        out[:, 0] = old[:, 0].max() if p_old else 0
        return out
    n_old = np.asarray(sizes_old, dtype=np.int64).reshape(-1)
    if n_old.shape != (p_old,) or (n_old < 0).any():
        raise ValueError(f"sizes_old must be (P_old={p_old},) non-negative, got {n_old}")
    n_total = int(n_old.sum())
    m = _even(n_total, p_new) if sizes_new is None \
        else np.asarray(sizes_new, dtype=np.int64).reshape(-1)
    if m.shape != (p_new,) or (m < 0).any():
        raise ValueError(f"sizes_new must be (P_new={p_new},) non-negative, got {m}")
    if p_new == p_old and np.array_equal(m, n_old):
        return old.copy()
    seen = int((old[:, 0].astype(np.int64) * n_old + old[:, 1].astype(np.int64)).sum())
    if n_total == 0 or int(m.sum()) == 0:
        out[:, 0] = old[:, 0].max() if p_old else 0
        return out
    m_total = int(m.sum())
    target = (seen * m_total * 2 + n_total) // (2 * n_total)   # round(F * sum(m)), exact ints
    exact = [(seen * int(mq), n_total) for mq in m]             # F * m_q as a fraction
    base = np.array([a // b for a, b in exact], dtype=np.int64)
    rem = [a % b for a, b in exact]
    extra = int(target - base.sum())
    order = sorted(range(p_new), key=lambda q: (-rem[q], q))
    for q in order[:max(0, extra)]:
        base[q] += 1
    for q in order[::-1][:max(0, -extra)]:
        base[q] -= 1
    for q in range(p_new):
        if m[q] > 0:
            out[q, 0], out[q, 1] = divmod(int(base[q]), int(m[q]))
        else:
            out[q, 0] = int(base.sum()) // max(1, m_total)
    return out


def remap_per_rank(tables: dict[str, np.ndarray], p_new: int, rank: int, *,
                   shard_sizes_new: np.ndarray | None = None
                   ) -> tuple[dict[str, np.ndarray], list[str]]:
    """This rank's rows of the saved per-rank tables at world size ``p_new``.

    Returns (rows, names dropped). Exact rows when the world size and shard sizes are
    unchanged; otherwise ``cursor`` by :func:`remap_cursors`, ``shard_size`` from
    ``shard_sizes_new`` (dropped when not given), other names dropped.
    """
    if not tables:
        return {}, []
    p_old = next(iter(tables.values())).shape[0]
    old_sizes = tables.get("shard_size")
    same_sizes = shard_sizes_new is None or (
        old_sizes is not None and np.array_equal(np.asarray(old_sizes).reshape(-1),
                                                 np.asarray(shard_sizes_new).reshape(-1)))
    if p_old == p_new and same_sizes:
        return {k: np.array(t[rank]) for k, t in tables.items()}, []
    rows: dict[str, np.ndarray] = {}
    dropped: list[str] = []
    for k, t in tables.items():
        if k == "cursor":
            new = remap_cursors(t, p_new, sizes_new=shard_sizes_new,
                                sizes_old=None if old_sizes is None
                                else np.asarray(old_sizes).reshape(-1))
            rows[k] = new[rank]
        elif k == "shard_size" and shard_sizes_new is not None:
            rows[k] = np.array(shard_sizes_new[rank], dtype=t.dtype)
        else:
            dropped.append(k)
    return rows, dropped
