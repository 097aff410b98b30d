"""k-means|| initialisation (Bahmani et al. 2012) whose result does not depend on the rank count.

Round 0 takes the point whose counter-based uniform ``u(seed, 0, g)`` is smallest (g: global row
index). Each later round r samples point g when ``u(seed, r, g) < min(1, l * d2_g / phi)``
(d2: squared distance to the nearest candidate so far, phi: its global sum, l: the
oversampling). Because u depends only on (seed, round, global index), the sample is the same
however the rows are split over ranks; sampled rows are gathered and ordered by global index.
The candidate count is bounded: when a round would exceed ``max_candidates``, only the points
with the smallest u / p are kept (priority sampling, again split-independent). Each candidate is
weighted by the number of points nearest to it, and rank 0 reduces the candidates to k centres
with greedy weighted k-means++ followed by a few weighted Lloyd steps, then broadcasts them.

Collectives per call: 2 for the first point, 2-4 per round, 1 for the weights, 1 broadcast.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime import get_logger
from .collectives import allgatherv, bcast_array

log = get_logger(__name__)

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
REFINE_ITERS = 5


def _splitmix(z, xp=np):
    z = z + _GOLDEN
    z = (z ^ (z >> xp.uint64(30))) * _M1
    z = (z ^ (z >> xp.uint64(27))) * _M2
    return z ^ (z >> xp.uint64(31))


def hash_uniform(seed: int, rnd: int, gidx, xp=np):
    """Uniforms in (0, 1), float64, one per global index: a pure function of (seed, rnd, g).

    splitmix64 applied to the index mixed with a key from (seed, rnd); 53 random bits.
    Works on numpy or cupy integer arrays (uint64 arithmetic wraps modulo 2**64).
    """
    with np.errstate(over="ignore"):
        key = _splitmix(_splitmix(np.array([seed], dtype=np.uint64)) ^ np.array([rnd], np.uint64))
        h = _splitmix(_splitmix(xp.asarray(gidx).astype(xp.uint64) ^ xp.asarray(key), xp), xp)
    return ((h >> xp.uint64(11)).astype(xp.float64) + 0.5) * (2.0 ** -53)


def _take_global(comm, data, local_idx: np.ndarray, gidx_local: np.ndarray) -> tuple:
    """Gather rows ``local_idx`` of every rank; returns (rows f32, their global indices), sorted
    by global index. Collective."""
    rows, _ = allgatherv(comm, data.take_rows(local_idx).astype(np.float32, copy=False)
                         .reshape(len(local_idx), data.d))
    g, _ = allgatherv(comm, gidx_local[local_idx].astype(np.int64))
    order = np.argsort(g, kind="stable")
    return rows[order], g[order]


def _smallest(keys: np.ndarray, g: np.ndarray, m: int) -> np.ndarray:
    """Global indices of the m smallest (key, g) pairs."""
    order = np.lexsort((g, keys))
    return g[order[:m]]


def kmeans_parallel(data, k: int, comm, allreduce, *, global_offset: int, n_total: int,
                    seed: int = 0, oversampling: float | None = None, rounds: int = 5,
                    max_candidates: int | None = None, spherical: bool = False) -> np.ndarray:
    """k initial centres (k, d) float32, identical on every rank. Collective over comm.

    ``data`` is the rank's :class:`semzo.cluster.cpu.LocalData` (or the GPU equivalent);
    ``n_total`` >= k is the global row count (the caller checked it on every rank).
    """
    ell = float(oversampling) if oversampling else 2.0 * k
    cap = int(max_candidates) if max_candidates else int(1 + rounds * math.ceil(ell))
    cap = max(cap, k)
    n, d = data.n, data.d
    gidx = global_offset + np.arange(n, dtype=np.int64)

    # round 0: the point with the smallest uniform
    u0 = hash_uniform(seed, 0, gidx)
    i0 = int(np.argmin(u0)) if n else -1
    pair, _ = allgatherv(comm, np.array([[u0[i0] if n else np.inf, gidx[i0] if n else -1]]))
    owner = int(np.lexsort((pair[:, 1], pair[:, 0]))[0])
    first = data.take_rows([i0]) if comm.Get_rank() == owner else np.empty((1, d), np.float32)
    cands = [bcast_array(comm, first.astype(np.float32), owner)]
    cand_g = [np.array([int(pair[owner, 1])], dtype=np.int64)]
    n_cand = 1

    d2 = np.full(n, np.inf, dtype=np.float64)
    nearest = np.zeros(n, dtype=np.int32)
    data.fold_candidates(cands[0], 0, d2, nearest)

    for r in range(1, rounds + 1):
        phi = np.array([d2.sum() if n else 0.0])
        allreduce(phi)
        if phi[0] <= 0.0 or n_cand >= cap:
            break
        p = np.minimum(1.0, ell * d2 / phi[0])
        u = hash_uniform(seed, r, gidx)
        sel = np.flatnonzero(u < p)
        keys, _ = allgatherv(comm, u[sel] / p[sel])
        g_all, _ = allgatherv(comm, gidx[sel])
        budget = cap - n_cand
        if g_all.shape[0] > budget:
            keep = np.isin(gidx[sel], _smallest(keys, g_all, budget))
            sel = sel[keep]
        rows, g = _take_global(comm, data, sel, gidx)
        if rows.shape[0] == 0:
            continue
        data.fold_candidates(rows, n_cand, d2, nearest)
        cands.append(rows)
        cand_g.append(g)
        n_cand += rows.shape[0]

    if n_cand < k:   # tiny or degenerate data: add the smallest-uniform points not yet taken
        taken = np.concatenate(cand_g)
        u = hash_uniform(seed, rounds + 1, gidx)
        free = np.flatnonzero(~np.isin(gidx, taken))
        need = k - n_cand
        loc = free[np.lexsort((gidx[free], u[free]))[:need]]
        keys, _ = allgatherv(comm, u[loc])
        g_all, _ = allgatherv(comm, gidx[loc])
        loc = loc[np.isin(gidx[loc], _smallest(keys, g_all, need))]
        rows, g = _take_global(comm, data, loc, gidx)
        data.fold_candidates(rows, n_cand, d2, nearest)
        cands.append(rows)
        cand_g.append(g)
        n_cand += rows.shape[0]

    cand = np.concatenate(cands, axis=0)
    weights = np.bincount(nearest, minlength=n_cand).astype(np.float64)
    allreduce(weights)
    log.info("k-means||: %d candidates for k=%d (%d rounds, oversampling %.0f)",
             n_cand, k, rounds, ell)
    if n_cand == k:
        centers = cand.copy()
    else:
        centers = np.empty((k, d), dtype=np.float32)
        if comm.Get_rank() == 0:
            rng = np.random.default_rng(np.random.SeedSequence([seed, 0x6B6D]))
            centers = weighted_kmeanspp(cand, weights, k, rng)
            centers = weighted_lloyd(cand, weights, centers, REFINE_ITERS, spherical)
        centers = bcast_array(comm, centers.astype(np.float32), 0)
    if spherical:
        centers = normalize_rows(centers)
    return centers


def normalize_rows(c: np.ndarray) -> np.ndarray:
    """Rows scaled to unit L2 norm (float32); zero rows stay zero."""
    c64 = c.astype(np.float64)
    nrm = np.sqrt(np.einsum("ij,ij->i", c64, c64))
    nrm[nrm == 0.0] = 1.0
    return (c64 / nrm[:, None]).astype(np.float32)


def _sq_dists(a: np.ndarray, b: np.ndarray, b_sq: np.ndarray) -> np.ndarray:
    a_sq = np.einsum("ij,ij->i", a, a)
    return np.maximum(a_sq[:, None] + b_sq[None, :] - 2.0 * (a @ b.T), 0.0)


def weighted_kmeanspp(points: np.ndarray, w: np.ndarray, k: int, rng) -> np.ndarray:
    """Greedy weighted k-means++ (scikit-learn's variant, 2 + log k trials per centre).

    points (m, d), w (m,) >= 0, m >= k. Returns (k, d) float32 rows of ``points``.
    """
    p = points.astype(np.float64)
    m = p.shape[0]
    w = np.asarray(w, dtype=np.float64)
    if not w.sum() > 0:
        w = np.ones(m)
    p_sq = np.einsum("ij,ij->i", p, p)
    trials = 2 + int(math.log(k))
    cw = np.cumsum(w)
    first = int(min(np.searchsorted(cw, rng.random() * cw[-1], side="right"), m - 1))
    chosen = [first]
    closest = _sq_dists(p[[first]], p, p_sq)[0]
    pot = float(w @ closest)
    for _ in range(1, k):
        if not pot > 0:   # every weighted point sits on a centre: take unused ones in order
            used = set(chosen)
            nxt = next(i for i in range(m) if i not in used)
            chosen.append(nxt)
            continue
        cum = np.cumsum(w * closest)
        idx = np.minimum(np.searchsorted(cum, rng.random(trials) * cum[-1], side="right"), m - 1)
        dist = np.minimum(closest[None, :], _sq_dists(p[idx], p, p_sq))
        pots = dist @ w
        b = int(np.argmin(pots))
        chosen.append(int(idx[b]))
        closest = dist[b]
        pot = float(pots[b])
    return points[chosen].astype(np.float32)


def weighted_lloyd(points: np.ndarray, w: np.ndarray, centers: np.ndarray, iters: int,
                   spherical: bool) -> np.ndarray:
    """A few weighted Lloyd steps on the candidate set (float64); empty centres stay put."""
    p = points.astype(np.float64)
    c = centers.astype(np.float64)
    c.shape[0]
    for _ in range(iters):
        c_sq = np.einsum("ij,ij->i", c, c)
        lab = np.argmin(c_sq[None, :] - 2.0 * (p @ c.T), axis=1)
        order = np.argsort(lab, kind="stable")
        lab_s = lab[order]
        starts = np.flatnonzero(np.r_[True, lab_s[1:] != lab_s[:-1]])
        sums = np.add.reduceat(p[order] * w[order, None], starts, axis=0)
        wsum = np.add.reduceat(w[order], starts)
        ids = lab_s[starts]
        ok = wsum > 0
        new = c.copy()
        new[ids[ok]] = sums[ok] / wsum[ok, None]
        if spherical:
            nrm = np.linalg.norm(new, axis=1)
            good = nrm > 0
            new[good] /= nrm[good, None]
        if np.array_equal(new, c):
            break
        c = new
    return c.astype(np.float32)
