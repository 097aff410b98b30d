"""Placement of k-means clusters on ranks: balanced, semantically compact, little movement.

Inputs (identical on every rank): ``centroids (k, d)`` float, ``where (P, k)`` int64 (samples of
cluster c on rank p now, e.g. from :func:`semzo.place.flows.cluster_counts`), and the topology
``rank_node (P,)``, ``node_switch (n_nodes,)``. Output: ``quota (k, P)`` int64, the number of
samples of each cluster each rank must hold afterwards.

Semantic mode, top down over the tree root -> switches -> nodes -> ranks (see topology.py):

1. Partition: the clusters (as pieces ``(cluster, count)``) are split among the children of a
   tree node by recursive bisection. The children list is cut in two halves (capacity = number
   of ranks); pieces are ordered along the weighted principal axis of their centroids, and the
   ordered list is cut where the left part holds its capacity's share. Within the balance slack
   the cut moves to the nearest cluster boundary (small clusters are packed whole); otherwise
   the straddling cluster is split, unless moving it wholly to the side holding most of it
   (and the pieces next to it across the cut instead) splits fewer samples: so a large
   cluster stays within one node when it fits there. Each cut may use half of the slack left
   for its children, so every rank ends within ``balance_tol`` of the mean (whenever
   integers allow).
2. Match: the groups made for children of equal capacity are permuted among those children to
   maximize the samples they already hold (sum over clusters of ``min(quota, held)``), by
   ``scipy.optimize.linear_sum_assignment`` (scipy is required). This is what keeps
   bytes from crossing switches, then nodes, then ranks; a plan applied and re-planned moves
   nothing.
3. Keep: if the data's current grouping at this level (each piece left on the children
   holding a sizeable part of it, stray samples sent to its main holder) is balanced, moves
   fewer samples, and is nearly as compact (it removes at least ``1 - keep_tol`` of the
   centroid spread that the fresh partition removes, spread = weighted sum of squared
   centroid deviations from the group mean), it is kept instead. After a small
   re-clustering the data then mostly stay put; a scattered layout (every child holding a
   bit of everything) removes no spread and is not kept.
0. Before all this (keep mode), if the current layout under a tree node is itself an acceptable
   plan (:func:`_current_holds`: at every level below it holds exactly the pieces, is within
   the balance range and nearly as compact as the fresh partition), it is kept as it is. A
   plan's own output passes, so a plan applied and re-planned moves nothing.

Random mode (the baseline): clusters in a seeded random order poured into ranks 0..P-1 with
exact integer targets (``N//P`` or ``N//P + 1``); ``where`` is ignored.

Shuffle mode (i.i.d. data-parallel sharding) is not planned from counts: every sample goes to a
rank chosen by a hash of its id, so it needs the ids
(:func:`semzo.place.shuffle.shuffle_destinations`). The quota it induces is turned into a
:class:`Placement` by :func:`placement_from_quota`; ``place(mode="shuffle")`` raises ValueError.

Everything is deterministic; floating point enters only through principal axes and spreads. Pass
``comm`` to compute on rank 0 and broadcast the quota, so ranks agree bit for bit even on
machines whose BLAS differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from semzo.place.flows import plan_figures
from semzo.place.keep import (
    SLACK_SHARE,
    _current,
    _kept,
    _spread,
    _sticky,
    _worst,
)
from semzo.place.topology import TreeNode, build_tree, check_topology
from semzo.place.weights import apportion, normalised
from semzo.runtime import get_logger

log = get_logger(__name__)



@dataclass
class Placement:
    """A placement plan. quota: (k, P) int64; where: (P, k) int64 (the input counts);
    cluster_rank / cluster_node / cluster_switch: (k,) int64, the rank / node id / switch id
    holding most of each cluster (-1 for empty clusters); figures: see flows.plan_figures."""

    quota: np.ndarray
    where: np.ndarray
    rank_node: np.ndarray
    node_switch: np.ndarray
    mode: str
    cluster_rank: np.ndarray
    cluster_node: np.ndarray
    cluster_switch: np.ndarray
    figures: dict = field(default_factory=dict)

    @property
    def k(self) -> int:
        return int(self.quota.shape[0])

    @property
    def n_ranks(self) -> int:
        return int(self.quota.shape[1])


# --- semantic partition ------------------------------------------------------------------

def _principal_order(pc: np.ndarray, pa: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Order of pieces along the weighted principal axis (ties: cluster id, then position)."""
    m = pc.size
    if m <= 1:
        return np.arange(m)
    x = centroids[pc].astype(np.float64)
    w = pa.astype(np.float64)
    mu = (w[:, None] * x).sum(0) / max(w.sum(), 1.0)
    y = x - mu
    yw = y * np.sqrt(w)[:, None]
    if m <= y.shape[1]:                    # top eigenvector of the smaller Gram matrix
        v = yw.T @ np.linalg.eigh(yw @ yw.T)[1][:, -1]
    else:
        v = np.linalg.eigh(yw.T @ yw)[1][:, -1]
    norm = np.linalg.norm(v)
    if not norm > 0:                       # all centroids equal: any axis will do
        return np.lexsort((np.arange(m), pc))
    v = v / norm
    i = int(np.argmax(np.abs(v)))
    if v[i] < 0:
        v = -v
    proj = y @ v
    return np.lexsort((np.arange(m), pc, proj))


def _choose_cut(pa: np.ndarray, cap_l: int, cap_r: int, lo: float, hi: float,
                mean: float) -> int:
    """Samples to send left: a cluster boundary inside the allowed range, nearest the ideal,
    else the ideal itself (rounded)."""
    w = int(pa.sum())
    cap = cap_l + cap_r
    ideal = w * cap_l / cap
    if mean <= 0:
        return int(np.floor(ideal + 0.5))
    rho = w / (cap * mean)
    lo2 = rho - SLACK_SHARE * max(rho - lo, 0.0)
    hi2 = rho + SLACK_SHARE * max(hi - rho, 0.0)
    lmin = max(lo2 * cap_l * mean, w - hi2 * cap_r * mean)
    lmax = min(hi2 * cap_l * mean, w - lo2 * cap_r * mean)
    bounds = np.concatenate(([0], np.cumsum(pa)))
    ok = bounds[(bounds >= lmin - 1e-9) & (bounds <= lmax + 1e-9)]
    if ok.size:
        return int(ok[np.argmin(np.abs(ok - ideal))])   # argmin: first (smaller) on ties
    return int(np.floor(ideal + 0.5))


def _straddle(pa: np.ndarray, cut: int) -> tuple[int, int]:
    """Index of the piece the cut falls inside (or -1 at a boundary), and the split's cost
    (samples on the smaller side of that piece)."""
    ends = np.cumsum(pa)
    j = int(np.searchsorted(ends, cut, side="right"))
    if j >= pa.size or ends[j] - pa[j] == cut:
        return -1, 0
    left = cut - int(ends[j] - pa[j])
    return j, min(left, int(pa[j]) - left)


def _keep_whole(pa: np.ndarray, cut: int, j: int) -> np.ndarray | None:
    """A reordering that puts piece ``j`` wholly on the side holding most of it, displacing
    the pieces next to it across the cut instead (None if it does not fit there)."""
    ends = np.cumsum(pa)
    m, w = pa.size, int(ends[-1])
    left = cut - int(ends[j] - pa[j])
    idx = np.arange(m)
    if 2 * left >= pa[j]:
        if pa[j] > cut:
            return None
        i = int(np.searchsorted(ends, cut - pa[j], side="right"))   # j goes before piece i
        return np.concatenate((idx[:i], [j], idx[i:j], idx[j + 1:]))
    if pa[j] > w - cut:
        return None
    rest = ends - pa[j]                                             # ends without piece j
    i = j + 1 + int(np.searchsorted(rest[j + 1:], cut, side="left"))   # j goes after piece i
    return np.concatenate((idx[:j], idx[j + 1:i + 1], [j], idx[i + 1:]))


def _bisect(pc, pa, caps: list[int], centroids, lo, hi, mean) -> list[tuple]:
    """Split pieces ``(pc, pa)`` into ``len(caps)`` groups with shares proportional to caps."""
    if len(caps) == 1:
        return [(pc, pa)]
    h = len(caps) // 2
    cap_l, cap_r = sum(caps[:h]), sum(caps[h:])
    order = _principal_order(pc, pa, centroids)
    pc, pa = pc[order], pa[order]
    cut = _choose_cut(pa, cap_l, cap_r, lo, hi, mean)
    j, cost = _straddle(pa, cut)
    for _ in range(16):               # a split cluster: try to keep it whole (cost decreases)
        if j < 0:
            break
        reorder = _keep_whole(pa, cut, j)
        if reorder is None:
            break
        cut2 = _choose_cut(pa[reorder], cap_l, cap_r, lo, hi, mean)
        j2, cost2 = _straddle(pa[reorder], cut2)
        if cost2 >= cost:
            break
        pc, pa, cut, j, cost = pc[reorder], pa[reorder], cut2, j2, cost2
    ends = np.cumsum(pa)
    if j >= 0:
        left_part = cut - (ends[j] - pa[j])
        pcl = pc[:j + 1]
        pal = np.concatenate((pa[:j], [left_part]))
        pcr, par = pc[j:], np.concatenate(([pa[j] - left_part], pa[j + 1:]))
    else:
        k = int(np.searchsorted(ends, cut, side="right"))
        pcl, pal, pcr, par = pc[:k], pa[:k], pc[k:], pa[k:]
    return (_bisect(pcl, pal, caps[:h], centroids, lo, hi, mean)
            + _bisect(pcr, par, caps[h:], centroids, lo, hi, mean))


def _group_matrix(groups: list[tuple], k: int) -> np.ndarray:
    q = np.zeros((len(groups), k), dtype=np.int64)
    for g, (pc, pa) in enumerate(groups):
        np.add.at(q[g], pc, pa)
    return q


def _assign(score: np.ndarray) -> np.ndarray:
    """Permutation ``perm[g] = child`` maximizing ``sum score[g, perm[g]]`` (ties: identity)."""
    n = score.shape[0]
    cost = -((n + 1) * score.astype(np.float64) + np.eye(n))   # identity only breaks ties
    from scipy.optimize import linear_sum_assignment  # 0.3-0.4 s to import: only when placing

    rows, cols = linear_sum_assignment(cost)
    perm = np.empty(n, dtype=np.int64)
    perm[rows] = cols
    return perm


def _caps(children: list[TreeNode], wts) -> list:
    """Capacities of tree nodes: their number of ranks, or (weighted ranks) the sum of their
    ranks' weights (mean 1, so ``cap * mean`` is still the node's share of the samples)."""
    if wts is None:
        return [c.n_ranks for c in children]
    return [float(wts[c.ranks].sum()) for c in children]


def _current_holds(node: TreeNode, pc, pa, centroids, where, lo, hi, mean, keep_tol,
                   wts=None) -> bool:
    """True if the current layout under ``node`` is itself an acceptable plan for the pieces
    ``(pc, pa)``: at every tree node below, the children hold exactly its pieces, their loads
    are within ``[lo, hi]`` of the mean (or no less balanced than the fresh partition's), and
    the grouping removes at least ``1 - keep_tol`` of the centroid spread the fresh partition
    removes (relative tolerance 1e-9 for rounding). A plan's own output passes by construction
    (its groups were the fresh partition or a kept grouping that passed the same tests), so a
    plan applied and re-planned moves nothing. Data relabelled by a new k-means fail where the
    relabelled samples make a level less compact, and are re-planned (kept where possible)."""
    if not node.children:
        return True
    children = node.children
    caps = _caps(children, wts)
    held = np.stack([where[c.ranks].sum(0) for c in children])
    current = _current(pc, pa, held)
    if current is None:
        return False
    if len(children) > 1:
        fresh = _bisect(pc, pa, caps, centroids, lo, hi, mean)
        loads = np.array([int(a.sum()) for _, a in current], dtype=np.float64)
        if mean > 0:
            ratio = loads / (np.asarray(caps, dtype=np.float64) * mean)
            if not ((ratio.min() >= lo - 1e-12 and ratio.max() <= hi + 1e-12)
                    or _worst(current, caps, mean) <= _worst(fresh, caps, mean) + 1e-12):
                return False
        whole = _spread([(pc, pa)], centroids)
        need = (1.0 - keep_tol) * (whole - _spread(fresh, centroids)) - 1e-9 * abs(whole)
        if whole - _spread(current, centroids) < need:
            return False
    return all(_current_holds(child, np.sort(gpc), gpa[np.argsort(gpc, kind="stable")],
                              centroids, where, lo, hi, mean, keep_tol, wts)
               for child, (gpc, gpa) in zip(children, current))


def _place_under(node: TreeNode, pc, pa, centroids, where, quota, lo, hi, mean,
                 keep_tol, wts=None) -> None:
    if not node.children:
        np.add.at(quota[:, int(node.ranks[0])], pc, pa)
        return
    order = np.argsort(pc, kind="stable")     # canonical: the plan depends on the pieces only,
    pc, pa = pc[order], pa[order]             # not on the order an upper level produced them in
    if keep_tol is not None and _current_holds(node, pc, pa, centroids, where, lo, hi, mean,
                                               keep_tol, wts):
        ranks = np.asarray(node.ranks, dtype=np.int64)
        quota[np.ix_(pc, ranks)] += where[np.ix_(ranks, pc)].T     # nothing moves below here
        return
    children = node.children
    caps = _caps(children, wts)
    groups = _bisect(pc, pa, caps, centroids, lo, hi, mean)
    if len(children) > 1:
        gq = _group_matrix(groups, where.shape[1])
        held = np.stack([where[c.ranks].sum(0) for c in children])
        target = list(range(len(children)))      # group g was made for child g
        for cap in sorted(set(caps)):
            idx = np.array([i for i, c in enumerate(caps) if c == cap])
            if idx.size < 2:
                continue
            score = np.empty((idx.size, idx.size), dtype=np.int64)
            held_t = np.ascontiguousarray(held[idx].T)      # (k, children)
            for a, g in enumerate(idx):          # sparse in clusters: O(children * k)
                nz = np.flatnonzero(gq[g])
                score[a] = np.minimum(gq[g, nz][:, None], held_t[nz]).sum(0)
            perm = _assign(score)
            for a, g in enumerate(idx):
                target[g] = int(idx[perm[a]])
        placed = [groups[target.index(j)] for j in range(len(children))]
        if keep_tol is not None:
            sticky = _sticky(pc, pa, held, caps, lo, hi, mean, centroids)
            if sticky is not None and _kept(sticky, held) > _kept(placed, held):
                whole = _spread([(pc, pa)], centroids)      # no partition at all
                gain_fresh = whole - _spread(placed, centroids)
                gain_kept = whole - _spread(sticky, centroids)
                if gain_kept >= (1.0 - keep_tol) * gain_fresh:
                    placed = sticky
        groups = placed
    for child, (gpc, gpa) in zip(children, groups):
        _place_under(child, gpc, gpa, centroids, where, quota, lo, hi, mean, keep_tol, wts)


def _quota_semantic(centroids, where, rank_node, node_switch, balance_tol,
                    keep_tol, wts=None) -> np.ndarray:
    n_ranks, k = where.shape
    sizes = where.sum(0)
    quota = np.zeros((k, n_ranks), dtype=np.int64)
    pc = np.flatnonzero(sizes).astype(np.int64)
    pa = sizes[pc].astype(np.int64)
    mean = float(sizes.sum()) / n_ranks
    tree = build_tree(rank_node, node_switch)
    _place_under(tree, pc, pa, np.asarray(centroids, dtype=np.float64), where, quota,
                 1.0 - balance_tol, 1.0 + balance_tol, mean, keep_tol, wts)
    return quota


def _quota_random(where, seed: int, wts=None) -> np.ndarray:
    n_ranks, k = where.shape
    sizes = where.sum(0)
    n = int(sizes.sum())
    if wts is None:
        targets = np.full(n_ranks, n // n_ranks, dtype=np.int64)
        targets[: n % n_ranks] += 1
    else:
        targets = apportion(n, wts)
    rank_end = np.cumsum(targets)
    order = np.random.default_rng(seed).permutation(k)
    quota = np.zeros((k, n_ranks), dtype=np.int64)
    start, p = 0, 0
    for c in order:
        left = int(sizes[c])
        while left > 0:
            room = int(rank_end[p]) - start
            take = min(room, left)
            quota[c, p] += take
            start += take
            left -= take
            if start == rank_end[p]:
                p += 1
    return quota


def _manifest(quota, rank_node, node_switch):
    k = quota.shape[0]
    empty = quota.sum(1) == 0
    cluster_rank = np.where(empty, -1, np.argmax(quota, axis=1)).astype(np.int64)
    n_nodes = node_switch.size
    per_node = np.zeros((k, n_nodes), dtype=np.int64)
    np.add.at(per_node.T, rank_node, quota.T)
    cluster_node = np.where(empty, -1, np.argmax(per_node, axis=1)).astype(np.int64)
    sw_ids, sw_of_node = np.unique(node_switch, return_inverse=True)
    per_sw = np.zeros((k, sw_ids.size), dtype=np.int64)
    np.add.at(per_sw.T, sw_of_node, per_node.T)
    cluster_switch = np.where(empty, -1, sw_ids[np.argmax(per_sw, axis=1)]).astype(np.int64)
    return cluster_rank, cluster_node, cluster_switch


def place(centroids: np.ndarray, where: np.ndarray, rank_node: np.ndarray,
          node_switch: np.ndarray, *, mode: str = "semantic", balance_tol: float = 0.05,
          seed: int = 0, keep_tol: float | None = 0.1, bytes_per_row: int | None = None,
          figures: bool = True, comm=None, rank_weights=None) -> Placement:
    """Plan where every cluster's samples go (see the module docstring).

    centroids: (k, d) float. where: (P, k) int64, identical on all ranks. rank_node: (P,).
    node_switch: (n_nodes,). mode: ``"semantic"`` or ``"random"`` (``"shuffle"`` needs the
    ids: see :mod:`semzo.place.shuffle`). keep_tol: at each tree
    level, keep the data's current grouping instead of the fresh partition when that moves
    fewer samples, stays balanced and achieves at least ``1 - keep_tol`` of the fresh one's
    reduction of centroid spread (None: always the fresh partition). bytes_per_row: for the
    crossing-bytes figures (default ``4*d + 16``: float32 embedding, id, cluster).
    figures: compute :func:`semzo.place.flows.plan_figures` (includes the random baseline).
    comm: if given, collective over comm: rank 0 computes the quota and broadcasts it.
    rank_weights: None (equal shares) or (P,) positive weights, rank r's share of the samples
    ``w_r / sum(w)`` (heterogeneous ranks, :mod:`semzo.place.weights`): random mode meets
    the shares exactly (largest remainder), semantic mode within ``balance_tol`` of them (a
    tree node's capacity is the sum of its ranks' weights). Identical on every rank.
    """
    centroids = np.asarray(centroids)
    where = np.ascontiguousarray(where, dtype=np.int64)
    rank_node, node_switch = check_topology(rank_node, node_switch)
    if centroids.ndim != 2:
        raise ValueError(f"centroids must be (k, d), got shape {centroids.shape}")
    if where.shape != (rank_node.size, centroids.shape[0]):
        raise ValueError(f"where must be (P, k) = ({rank_node.size}, {centroids.shape[0]}), "
                         f"got {where.shape}")
    if where.size and where.min() < 0:
        raise ValueError("where has negative counts")
    if mode == "shuffle":
        raise ValueError("place(): mode 'shuffle' assigns samples by a hash of their ids, not "
                         "from cluster counts: use semzo.place.shuffle.shuffle_destinations(ids, "
                         "P, seed, comm), then placement_from_quota() for the plan")
    if mode not in ("semantic", "random"):
        raise ValueError(f"mode must be 'semantic' or 'random', got {mode!r}")
    if not 0.0 <= balance_tol < 1.0:
        raise ValueError(f"balance_tol must lie in [0, 1), got {balance_tol}")
    wts = None
    if rank_weights is not None:
        wts = np.asarray(rank_weights, dtype=np.float64).reshape(-1)
        if wts.size != rank_node.size or not np.all(np.isfinite(wts)) or wts.min() <= 0:
            raise ValueError(f"rank_weights must be {rank_node.size} positive numbers, got "
                             f"{wts.tolist()}")
        wts = normalised(wts)

    quota = None
    if comm is None or comm.Get_rank() == 0:
        if mode == "semantic":
            quota = _quota_semantic(centroids, where, rank_node, node_switch, balance_tol,
                                    keep_tol, wts)
        else:
            quota = _quota_random(where, seed, wts)
    if comm is not None:
        if quota is None:
            quota = np.empty((centroids.shape[0], rank_node.size), dtype=np.int64)
        comm.Bcast([quota, MPI.INT64_T], root=0)
    return placement_from_quota(centroids, where, quota, rank_node, node_switch, mode=mode,
                                bytes_per_row=bytes_per_row, seed=seed, figures=figures)


def placement_from_quota(centroids: np.ndarray, where: np.ndarray, quota: np.ndarray,
                         rank_node: np.ndarray, node_switch: np.ndarray, *, mode: str,
                         bytes_per_row: int | None = None, seed: int = 0,
                         figures: bool = True) -> Placement:
    """A :class:`Placement` for a given ``quota (k, P)`` (e.g. the one shuffle placement
    induces): manifest from the quota, and :func:`semzo.place.flows.plan_figures` with the
    random baseline (``seed``) unless mode is ``"random"``. Not collective.

    The movement figures assume the minimal flows of :func:`semzo.place.flows.destinations`;
    a caller that moves rows otherwise (shuffle) overrides them with the actual movement.
    """
    centroids = np.asarray(centroids)
    where = np.ascontiguousarray(where, dtype=np.int64)
    quota = np.ascontiguousarray(quota, dtype=np.int64)
    rank_node, node_switch = check_topology(rank_node, node_switch)
    if quota.shape != (centroids.shape[0], rank_node.size):
        raise ValueError(f"quota must be (k, P) = ({centroids.shape[0]}, {rank_node.size}), "
                         f"got {quota.shape}")
    if where.shape != quota.T.shape:
        raise ValueError(f"where must be (P, k) = {quota.T.shape}, got {where.shape}")
    if not np.array_equal(quota.sum(1), where.sum(0)) or (quota.size and quota.min() < 0):
        raise ValueError("quota does not hold every sample exactly once (row sums != sizes)")
    cr, cn, cs = _manifest(quota, rank_node, node_switch)
    plan = Placement(quota=quota, where=where, rank_node=rank_node, node_switch=node_switch,
                     mode=mode, cluster_rank=cr, cluster_node=cn, cluster_switch=cs)
    if figures:
        if bytes_per_row is None:
            bytes_per_row = 4 * centroids.shape[1] + 16
        baseline = None
        if mode != "random":
            baseline = place(centroids, where, rank_node, node_switch, mode="random",
                             seed=seed, figures=False)
        plan.figures = plan_figures(plan, centroids, bytes_per_row=bytes_per_row,
                                    baseline=baseline)
    return plan
