"""Keep mode of the semantic placement (see :mod:`semzo.place.plan`, step 3): measures of a
grouping (centroid spread, samples kept in place, balance) and the groupings that keep the
data where they are: the current layout itself (:func:`_current`) and the sticky one
(:func:`_sticky`, slivers sent home, overloaded children rebalanced).

A grouping is a list, one entry per child of a tree node, of pieces ``(pc, pa)``: cluster ids
(int64, distinct) and sample counts (int64, > 0). ``held (children, k)`` int64: samples of each
cluster each child holds now. Pure numpy, not collective.
"""

from __future__ import annotations

import numpy as np

SLACK_SHARE = 0.5   # share of the remaining balance slack one bisection cut may use
HOME_SHARE = 0.25   # keep mode: a child holding this share of a piece keeps its part,
HOME_LOAD_SHARE = 0.05   # ... and so does one where it is this share of the child's load


def _spread(groups: list[tuple], centroids: np.ndarray) -> float:
    """Weighted within-group sum of squared centroid deviations (lower = more compact)."""
    total = 0.0
    for pc, pa in groups:
        if pc.size < 2:
            continue
        x = centroids[pc]
        w = pa.astype(np.float64)
        mu = (w[:, None] * x).sum(0) / w.sum()
        total += float((w * ((x - mu) ** 2).sum(1)).sum())
    return total


def _kept(groups: list[tuple], held: np.ndarray) -> int:
    """Samples that stay in their child if group g goes to child g."""
    return sum(int(np.minimum(pa, held[g, pc]).sum()) for g, (pc, pa) in enumerate(groups))


def _sticky(pc, pa, held, caps, lo, hi, mean, centroids) -> list[tuple] | None:
    """Groups that keep the data where it is: each piece stays, up to what they hold, on the
    children that hold a sizeable part of it (a quarter of the piece, or a twentieth of the
    child's mean load); the rest goes to its main holder (stray samples go home). A child
    whose load leaves the balance range is rebalanced (:func:`_rebalance`). None if a piece is
    held nowhere below or rebalancing fails."""
    n_child = held.shape[0]
    q = np.zeros((n_child, pc.size), dtype=np.int64)
    floor = HOME_LOAD_SHARE * np.asarray(caps, dtype=np.float64) * mean
    for i, (c, a) in enumerate(zip(pc.tolist(), pa.tolist())):
        h = held[:, c]
        tot = int(h.sum())
        if tot == 0:
            return None
        left = a
        for j in np.lexsort((np.arange(n_child), -h)):
            if left == 0 or (h[j] < HOME_SHARE * min(a, tot) and h[j] < floor[j]):
                break
            take = min(int(h[j]), left)
            q[j, i] += take
            left -= take
        q[int(np.argmax(h)), i] += left
    if mean > 0 and pa.sum() > 0:
        ratio = q.sum(1) / (np.asarray(caps, dtype=np.float64) * mean)
        out_of_range = ratio.min() < lo - 1e-12 or ratio.max() > hi + 1e-12   # all slack
        if out_of_range and not _rebalance(q, pc, pa, caps, lo, hi, mean, centroids):
            return None
    return [(pc[q[j] > 0], q[j][q[j] > 0]) for j in range(n_child)]


def _rebalance(q, pc, pa, caps, lo, hi, mean, centroids) -> bool:
    """Move samples (in place in ``q``) from children above their share to children below
    it until every child is inside the range a bisection cut would allow; each move takes the
    piece whose centroid is nearest the receiving group's mean. False if that fails."""
    cap = np.asarray(caps, dtype=np.float64) * mean
    rho = float(pa.sum()) / cap.sum()
    lo_n = np.ceil((rho - SLACK_SHARE * max(rho - lo, 0.0)) * cap - 1e-9).astype(np.int64)
    hi_n = np.floor((rho + SLACK_SHARE * max(hi - rho, 0.0)) * cap + 1e-9).astype(np.int64)
    if (lo_n > hi_n).any():
        return False
    x = centroids[pc]
    loads = q.sum(1)
    for _ in range(4 * q.size + 4):
        over, under = loads - hi_n, lo_n - loads
        if over.max() <= 0 and under.max() <= 0:
            return True
        if over.max() > 0:
            src = int(np.argmax(over))
            dst = int(np.argmax(hi_n - loads))
            need = min(int(over[src]), int(hi_n[dst] - loads[dst]))
        else:
            dst = int(np.argmax(under))
            src = int(np.argmax(loads - lo_n))
            need = min(int(under[dst]), int(loads[src] - lo_n[src]))
        if need <= 0:
            return False
        cand = np.flatnonzero(q[src])
        w = q[dst].astype(np.float64)
        mu = (w @ x) / w.sum() if w.sum() > 0 else (q[src] @ x) / max(loads[src], 1)
        i = int(cand[np.argmin(((x[cand] - mu) ** 2).sum(1))])
        m = min(need, int(q[src, i]))
        q[src, i] -= m
        q[dst, i] += m
        loads[src] -= m
        loads[dst] += m
    return False


def _current(pc, pa, held) -> list[tuple] | None:
    """The pieces exactly as the children hold them now (group j = what child j holds of each
    piece), or None unless the children hold every piece's samples exactly (pieces sent here
    from elsewhere, or samples of a piece held outside this subtree)."""
    part = held[:, pc]                                      # (children, pieces)
    if not np.array_equal(part.sum(0), pa):
        return None
    return [(pc[part[j] > 0], part[j][part[j] > 0]) for j in range(held.shape[0])]


def _worst(groups: list[tuple], caps, mean: float) -> float:
    """Largest relative deviation of a child's load from its share (0 for no samples)."""
    if mean <= 0:
        return 0.0
    loads = np.array([int(pa.sum()) for _, pa in groups], dtype=np.float64)
    return float(np.abs(loads / (np.asarray(caps, dtype=np.float64) * mean) - 1.0).max())
