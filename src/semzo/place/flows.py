"""From a placement plan to sample movements: counts, per-sample destinations, figures.

Movement rule (identical on every rank, computed from ``where`` and ``quota`` alone, so no
communication is needed to decide destinations):

- keep: rank p keeps ``min(where[p, c], quota[c, p])`` samples of cluster c (the first ones in
  local order); the rest of its samples of c are its *excess*, the missing ones its *deficit*;
- match excess to deficit per cluster, level by level: inside each node, then inside each
  switch, then across the machine. At each level and in each group, excess and deficit are
  laid out in rank order on one axis (an exclusive prefix sum, like an ``Exscan``) and the
  first ``min(total excess, total deficit)`` units are matched by overlapping intervals, so
  no two sources fill the same slot. This moves the fewest samples the quota allows and, of
  those, sends the fewest across nodes, then across switches.

Excess samples of a cluster go, in local order, to the node-level targets first, then the
switch-level ones, then the rest (targets by rank number within a level).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from semzo.place.topology import rank_groups

LEVELS = ("node", "switch", "world")


def cluster_counts(labels_local: np.ndarray, k: int, comm) -> np.ndarray:
    """``where (P, k)`` int64: samples of each cluster on each rank, identical on all ranks.

    labels_local: (n_local,) ints in ``[0, k)``. Collective over comm (one Allgather). A label
    out of range on any rank makes every rank raise ValueError after the collective.
    """

    labels_local = np.asarray(labels_local).reshape(-1)
    bad = labels_local.size and (labels_local.min() < 0 or labels_local.max() >= k)
    local = np.full(k, -1, dtype=np.int64)
    if not bad:
        local = np.bincount(labels_local.astype(np.int64), minlength=k).astype(np.int64)
    where = np.empty((comm.Get_size(), k), dtype=np.int64)
    comm.Allgather([local, MPI.INT64_T], [where, MPI.INT64_T])
    bad_ranks = np.flatnonzero((where < 0).any(1))
    if bad_ranks.size:
        raise ValueError(f"cluster labels outside [0, {k}) on ranks {bad_ranks.tolist()}")
    return where


def _match_level(exc: np.ndarray, dfc: np.ndarray, groups: np.ndarray):
    """Match excess to deficit inside each group of ranks.

    exc, dfc: (P, k) int64. groups: (P,) group id per rank. Returns ``used_e, used_d`` (units
    matched, per rank and cluster) and the exclusive in-group prefixes ``pre_e, pre_d`` (all
    (P, k), rank order).
    """
    n_ranks = exc.shape[0]
    order = np.lexsort((np.arange(n_ranks), groups))
    gs = groups[order]
    starts = np.flatnonzero(np.r_[True, gs[1:] != gs[:-1]])
    gidx = np.cumsum(np.r_[False, gs[1:] != gs[:-1]])
    out = []
    tot = []
    pres = []
    for a in (exc, dfc):
        s = a[order]
        cum = np.cumsum(s, axis=0) - s
        pre = cum - cum[starts][gidx]
        pres.append(pre)
        tot.append(np.add.reduceat(s, starts, axis=0))
    matched = np.minimum(tot[0], tot[1])[gidx]
    for a, pre in zip((exc, dfc), pres):
        used = np.clip(matched - pre, 0, a[order])
        back = np.empty_like(used)
        back[order] = used
        out.append(back)
    pre_e = np.empty_like(pres[0])
    pre_d = np.empty_like(pres[1])
    pre_e[order] = pres[0]
    pre_d[order] = pres[1]
    return out[0], out[1], pre_e, pre_d


def _excess_deficit(where: np.ndarray, quota: np.ndarray):
    if not np.array_equal(quota.sum(1), where.sum(0)):
        raise ValueError("quota does not hold every sample exactly once (row sums != sizes)")
    keep = np.minimum(where, quota.T)
    return keep, where - keep, quota.T - keep


def movement(where: np.ndarray, quota: np.ndarray, rank_node, node_switch) -> dict:
    """Rows moved in total and rows leaving their node / switch under the movement rule."""
    _, exc, dfc = _excess_deficit(where, quota)
    moved = int(exc.sum())
    left = {}
    for name, groups in zip(LEVELS, rank_groups(rank_node, node_switch)):
        used_e, used_d, _, _ = _match_level(exc, dfc, groups)
        exc, dfc = exc - used_e, dfc - used_d
        left[name] = int(exc.sum())
    assert left["world"] == 0
    return {"moved": moved, "cross_node": left["node"], "cross_switch": left["switch"]}


def destinations(labels_local: np.ndarray, plan, comm) -> np.ndarray:
    """Destination rank of each local sample, meeting ``plan.quota`` exactly (globally).

    labels_local: (n_local,) cluster of each local sample; its counts must equal
    ``plan.where[rank]``. comm: the communicator (only its rank is used: not collective), or
    the rank as an int. Returns int64 (n_local,).
    """
    rank = int(comm) if isinstance(comm, (int, np.integer)) else comm.Get_rank()
    labels = np.asarray(labels_local, dtype=np.int64).reshape(-1)
    where, quota = plan.where, plan.quota
    k = quota.shape[0]
    if labels.size and (labels.min() < 0 or labels.max() >= k):
        raise ValueError(f"rank {rank}: cluster labels outside [0, {k})")
    if not np.array_equal(np.bincount(labels, minlength=k), where[rank]):
        raise ValueError(f"rank {rank}: local cluster counts differ from plan.where[{rank}]")
    keep, exc, dfc = _excess_deficit(where, quota)

    flows = []                                  # (cluster, level, dst, count) arrays
    for lev, groups in enumerate(rank_groups(plan.rank_node, plan.node_switch)):
        used_e, used_d, pre_e, pre_d = _match_level(exc, dfc, groups)
        cs = np.flatnonzero(used_e[rank])
        if cs.size:
            qs = np.flatnonzero(groups == groups[rank])
            a = pre_e[rank, cs][None, :]
            b = a + used_e[rank, cs][None, :]
            s = pre_d[qs][:, cs]
            e = s + used_d[qs][:, cs]
            ov = np.minimum(b, e) - np.maximum(a, s)
            qi, ci = np.nonzero(ov > 0)
            flows.append((cs[ci], np.full(ci.size, lev), qs[qi], ov[qi, ci]))
        exc, dfc = exc - used_e, dfc - used_d

    dest = np.full(labels.size, rank, dtype=np.int64)
    if not flows:
        return dest
    cl, lv, dq, cnt = (np.concatenate(x) for x in zip(*flows))
    o = np.lexsort((dq, lv, cl))
    targets = np.repeat(dq[o], cnt[o])
    order = np.argsort(labels, kind="stable")   # by cluster, then local order
    first = np.zeros(k + 1, dtype=np.int64)
    np.cumsum(np.bincount(labels, minlength=k), out=first[1:])
    pos = np.arange(labels.size) - first[labels[order]]
    leaving = order[pos >= keep[rank][labels[order]]]
    assert leaving.size == targets.size, "flows do not cover the local excess"
    dest[leaving] = targets
    return dest


def _pair_distance_sum(q: np.ndarray, x: np.ndarray, block: int = 2048) -> float:
    """``sum_ij q_i q_j |x_i - x_j|`` (float64), in row blocks to bound memory."""
    x = x.astype(np.float64)
    q = q.astype(np.float64)
    sq = (x * x).sum(1)
    total = 0.0
    for i in range(0, x.shape[0], block):
        d2 = sq[i:i + block, None] + sq[None, :] - 2.0 * x[i:i + block] @ x.T
        total += float(q[i:i + block] @ np.sqrt(np.maximum(d2, 0.0)) @ q)
    return total


def within_rank_distance(quota: np.ndarray, centroids: np.ndarray) -> float:
    """Mean distance between the centroids of two samples on the same rank (distinct
    samples), averaged over ranks weighted by their sample counts."""
    num = den = 0.0
    for p in range(quota.shape[1]):
        nz = np.flatnonzero(quota[:, p])
        q = quota[nz, p]
        n = float(q.sum())
        if n < 2:
            continue
        mean_p = _pair_distance_sum(q, centroids[nz]) / (n * n - n)
        num += n * mean_p
        den += n
    return num / den if den else 0.0


def global_distance(sizes: np.ndarray, centroids: np.ndarray) -> float:
    """Mean centroid distance between two distinct samples of the whole corpus."""
    return within_rank_distance(np.asarray(sizes, dtype=np.int64)[:, None], centroids)


def plan_figures(plan, centroids: np.ndarray, *, bytes_per_row: int,
                 baseline=None) -> dict:
    """Figures of a plan: balance, movement, crossing bytes, semantic compactness.

    Keys: n, k, ranks, load_max_over_mean, load_min_over_mean, moved_fraction, rows_cross_node,
    rows_cross_switch, bytes_cross_node, bytes_cross_switch, clusters_split_ranks /
    _nodes / _switches, centroid_dist (within rank, see :func:`within_rank_distance`),
    centroid_dist_global; with a ``baseline`` plan, the same keys prefixed ``random_`` and
    ``centroid_dist_ratio`` (plan over baseline; below 1 is better).
    """
    quota, where = plan.quota, plan.where
    k, n_ranks = quota.shape
    loads = quota.sum(0)
    n = int(loads.sum())
    mean = n / n_ranks
    mv = movement(where, quota, plan.rank_node, plan.node_switch)
    per_node = np.zeros((k, plan.node_switch.size), dtype=np.int64)
    np.add.at(per_node.T, plan.rank_node, quota.T)
    _, sw_of_node = np.unique(plan.node_switch, return_inverse=True)
    per_sw = np.zeros((k, int(sw_of_node.max()) + 1), dtype=np.int64)
    np.add.at(per_sw.T, sw_of_node, per_node.T)
    fig = {
        "n": n, "k": k, "ranks": n_ranks,
        "load_max_over_mean": float(loads.max() / mean) if n else 1.0,
        "load_min_over_mean": float(loads.min() / mean) if n else 1.0,
        "moved_fraction": mv["moved"] / n if n else 0.0,
        "rows_cross_node": mv["cross_node"],
        "rows_cross_switch": mv["cross_switch"],
        "bytes_cross_node": mv["cross_node"] * bytes_per_row,
        "bytes_cross_switch": mv["cross_switch"] * bytes_per_row,
        "clusters_split_ranks": int(((quota > 0).sum(1) > 1).sum()),
        "clusters_split_nodes": int(((per_node > 0).sum(1) > 1).sum()),
        "clusters_split_switches": int(((per_sw > 0).sum(1) > 1).sum()),
        "centroid_dist": within_rank_distance(quota, centroids),
        "centroid_dist_global": global_distance(quota.sum(1), centroids),
    }
    if baseline is not None:
        base = plan_figures(baseline, centroids, bytes_per_row=bytes_per_row)
        for key in ("load_max_over_mean", "load_min_over_mean", "moved_fraction",
                    "rows_cross_node", "rows_cross_switch", "bytes_cross_node",
                    "bytes_cross_switch", "clusters_split_ranks", "centroid_dist"):
            fig["random_" + key] = base[key]
        fig["centroid_dist_ratio"] = (fig["centroid_dist"] / base["centroid_dist"]
                                      if base["centroid_dist"] else 1.0)
    return fig


def format_figures(fig: dict) -> str:
    """A small two-column text table of :func:`plan_figures` (plan and random baseline)."""
    rows = [("load max/mean", "load_max_over_mean", "{:.3f}"),
            ("load min/mean", "load_min_over_mean", "{:.3f}"),
            ("moved fraction", "moved_fraction", "{:.3f}"),
            ("bytes crossing nodes", "bytes_cross_node", "{:,}"),
            ("bytes crossing switches", "bytes_cross_switch", "{:,}"),
            ("clusters split over ranks", "clusters_split_ranks", "{}"),
            ("within-rank centroid dist", "centroid_dist", "{:.4f}")]
    lines = [f"{'':<28}{'plan':>16}{'random':>16}"]
    for label, key, f in rows:
        base = fig.get("random_" + key)
        lines.append(f"{label:<28}{f.format(fig[key]):>16}"
                     f"{(f.format(base) if base is not None else '-'):>16}")
    lines.append(f"{'global centroid dist':<28}{fig['centroid_dist_global']:>16.4f}")
    return "\n".join(lines)
