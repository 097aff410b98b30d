"""Numba kernels of the CPU k-means path.

All kernels are serial, ``nogil`` and cached. They work on one block of rows whose
distances to the centres were produced by one float32 GEMM, stored transposed
(``dT = centers @ x_block.T``, (k, b)) so that the argmin runs as vectorised compare/select
along each centre's row; the score that is minimised is ``c_sq[j] - 2 * dT[j, r]``, float32, exactly as
scikit-learn's Lloyd does (with ``c_sq = 0`` it is the spherical ``argmax`` of the dot).
Ties go to the lowest centre index.

Sums of points per cluster are accumulated in float64, one row after the other in row order,
so the same labels give bit-identical sums whatever kernel produced them (plain Lloyd and the
pruned variant share :func:`accumulate_rows` semantics exactly).

Only :func:`sq_dist_rows` uses ``fastmath`` (a reassociated float64 reduction): its results are
reproducible on one machine for one build, and callers that need bounds add a relative slack.
"""

from __future__ import annotations

import math

import numba as nb
import numpy as np

_TWO32 = np.float32(2.0)


@nb.njit(cache=True, nogil=True)
def _down32(v):
    """A float32 that is <= v (v >= 0): lower bounds must never round up."""
    return np.float32(v * (1.0 - 2.0 ** -22))


@nb.njit(cache=True, nogil=True, fastmath=True)
def _sq_dist_row(x, c):
    """||x - c||^2 in float64 for two float32 vectors (reassociated: vectorised)."""
    acc = 0.0
    for t in range(x.shape[0]):
        diff = np.float64(x[t]) - np.float64(c[t])
        acc += diff * diff
    return acc


@nb.njit(cache=True, nogil=True, fastmath=True)
def _dot_row(x, c):
    acc = 0.0
    for t in range(x.shape[0]):
        acc += np.float64(x[t]) * np.float64(c[t])
    return acc


@nb.njit(cache=True, nogil=True)
def argmin_cols(dT, c_sq, best, bj):
    """For each column r of dT (k, b): bj[r] = argmin_j (c_sq[j] - 2 dT[j, r]) (first index on
    ties), best[r] = that float32 score. Loops run along rows of dT so they vectorise (no
    reduction: compare and select per column)."""
    k, b = dT.shape
    for r in range(b):
        best[r] = np.inf
        bj[r] = 0
    for j in range(k):
        cj = c_sq[j]
        for r in range(b):
            s = cj - _TWO32 * dT[j, r]
            bv = best[r]
            lt = s < bv
            best[r] = s if lt else bv
            bj[r] = j if lt else bj[r]


@nb.njit(cache=True, nogil=True)
def assign_block(dT, c_sq, x, x_sq, labels, sums, counts, accumulate, best, bj):
    """Plain Lloyd E-step on one block of b rows.

    dT (k, b) f32: ``centers @ x.T``; c_sq (k,) f32: squared centre norms (zeros for the
    spherical variant); x (b, d) f32: the rows; x_sq (b,) f64: squared row norms (only used
    for the approximate inertia); labels (b,) int32: previous labels in, new labels out;
    sums (k, d) f64 and counts (k,) f64: accumulated into when ``accumulate``; best (>= b,)
    f32 and bj (>= b,) int32: scratch. Returns (number of changed labels, approximate
    inertia of the block from the expansion ``x_sq + best score``).
    """
    b = dT.shape[1]
    d = x.shape[1]
    argmin_cols(dT, c_sq, best[:b], bj[:b])
    changed = 0
    inertia = 0.0
    for r in range(b):
        j = bj[r]
        if labels[r] != j:
            changed += 1
            labels[r] = j
        inertia += x_sq[r] + np.float64(best[r])
        if accumulate:
            counts[j] += 1.0
            for t in range(d):
                sums[j, t] += np.float64(x[r, t])
    return changed, inertia


@nb.njit(cache=True, nogil=True, fastmath=True)
def row_sq_norms(x, out):
    """out[i] = ||x[i]||^2 in float64 (reassociated sum)."""
    for i in range(x.shape[0]):
        acc = 0.0
        for t in range(x.shape[1]):
            v = np.float64(x[i, t])
            acc += v * v
        out[i] = acc


@nb.njit(cache=True, nogil=True)
def accumulate_rows(x, labels, sums, counts):
    """sums[labels[i]] += x[i] (float64, row order) and counts[labels[i]] += 1 for all rows."""
    n, d = x.shape
    for i in range(n):
        a = labels[i]
        counts[a] += 1.0
        for t in range(d):
            sums[a, t] += np.float64(x[i, t])


@nb.njit(cache=True, nogil=True)
def sq_dist_rows(x, labels, centers, e2, counts, spherical):
    """Exact (float64) per-row cost against the assigned centre.

    e2[i] = ||x[i] - centers[labels[i]]||^2; counts[labels[i]] += 1 (if counts has length > 0).
    Returns the summed inertia: sum of e2, or, when ``spherical``, sum of 1 - x.c.
    """
    n = x.shape[0]
    inertia = 0.0
    do_counts = counts.shape[0] > 0
    for i in range(n):
        a = labels[i]
        e = _sq_dist_row(x[i], centers[a])
        e2[i] = e
        if do_counts:
            counts[a] += 1.0
        if spherical:
            inertia += 1.0 - _dot_row(x[i], centers[a])
        else:
            inertia += e
    return inertia


# --------------------------------------------------------------------------------------------
# pruned exact variant (Hamerly's centre bound + Yinyang group bounds, GEMM for the rest)
# --------------------------------------------------------------------------------------------

@nb.njit(cache=True, nogil=True)
def _passes(lower, u, delta2):
    return lower > u and (lower - u) * (lower + u) > delta2


@nb.njit(cache=True, nogil=True)
def prune_block(x, row0, b, dM, direct, movers, mover_of, cm_sq, sq_offset, centers, labels,
                ub, lb, drift, gdrift, group_of, s_half, x_sq, x_norm, c_max, coef_xc, coef_cc,
                c_dev, gmin, gdist, out_idx, n_out):
    """Decide which rows of the block [row0, row0 + b) may keep their label.

    Bounds are on TRUE Euclidean distances: ub (n,) f64 bounds the distance to the assigned
    centre from above, lb (n, t) f32 the distance to the closest non-assigned centre of each
    of t centre groups from below. The m "movers" (the centres that moved most; mover_of (k,):
    position in ``movers`` or -1) get fresh distances: when ``direct``, exact float64 distances
    computed here row by row; otherwise from float32 GEMM scores dM (b, m) =
    x_block @ centers[movers].T with score norms cm_sq (m,), widened by the rounding bound.
    Every other centre j moved by drift[j] (group maximum gdrift[g]). New bounds: ub = fresh
    distance if the own centre moved, else ub + drift; lb_g = min(lb_g - gdrift[g], fresh
    distances to the movers of g). A row keeps its label when L^2 - U^2 > 2 delta_i for
    L = max(2 s_half[a] - U, min_g lb_g), where delta_i bounds the float32 rounding of a GEMM
    score: then plain Lloyd's float32 argmin picks the same centre. Otherwise U is tightened
    to the exact distance and the test repeated; rows that still fail are appended to out_idx
    from position n_out. gmin (t, >= b) f32 and gdist (t,) f64 are scratch. Returns n_out.
    """
    m = movers.shape[0]
    t = lb.shape[1]
    if not direct:
        for g in range(t):
            for r in range(b):
                gmin[g, r] = np.inf
        for r in range(b):
            a = labels[row0 + r]
            for p in range(m):
                j = movers[p]
                g = group_of[j]
                s = cm_sq[p] - _TWO32 * dM[r, p]
                if s < gmin[g, r] and a != j:
                    gmin[g, r] = s
    for r in range(b):
        i = row0 + r
        a = labels[i]
        delta = coef_xc * x_norm[i] * c_max + coef_cc * c_max * c_max + c_dev
        base = x_sq[i] + sq_offset
        for g in range(t):
            gdist[g] = np.inf
        exact = False
        if direct:
            u = ub[i] + drift[a]
            for p in range(m):
                j = movers[p]
                e = math.sqrt(_sq_dist_row(x[i], centers[j]))
                if j == a:
                    u = e * (1.0 + 1e-9) + 1e-300
                    exact = True
                else:
                    w = e * (1.0 - 1e-9)
                    g = group_of[j]
                    gdist[g] = min(gdist[g], w)
        else:
            p = mover_of[a]
            if p >= 0:
                sa = np.float64(cm_sq[p] - _TWO32 * dM[r, p])
                u = math.sqrt(max(base + sa + delta, 0.0)) * (1.0 + 1e-9) + 1e-300
            else:
                u = ub[i] + drift[a]
            for g in range(t):
                gm = gmin[g, r]
                if gm < np.inf:
                    gdist[g] = math.sqrt(max(base + np.float64(gm) - delta, 0.0)) * (1.0 - 1e-9)
        lmin = np.inf
        for g in range(t):
            v = np.float64(lb[i, g]) - gdrift[g]
            v = max(v, 0.0)
            v = min(v, gdist[g])
            w32 = _down32(v)
            lb[i, g] = w32
            if w32 < lmin:
                lmin = np.float64(w32)
        if _passes(max(2.0 * s_half[a] - u, lmin), u, 2.0 * delta):
            ub[i] = u
            continue
        if not exact:
            u = math.sqrt(_sq_dist_row(x[i], centers[a])) * (1.0 + 1e-9) + 1e-300
            if _passes(max(2.0 * s_half[a] - u, lmin), u, 2.0 * delta):
                ub[i] = u
                continue
        ub[i] = u
        out_idx[n_out] = i
        n_out += 1
    return n_out


@nb.njit(cache=True, nogil=True)
def assign_block_bounds(dT, c_sq, sq_offset, idx, x_sq, x_norm, c_max, coef_xc, coef_cc,
                        c_dev, group_of, labels, ub, lb, best, bj, gmin):
    """Full assignment of the gathered rows ``idx`` (dT (k, b) = centers @ x[idx].T).

    Chooses labels exactly as :func:`assign_block` and sets fresh bounds: with the computed
    squared distance D_j = x_sq + sq_offset + score_j, true distances lie in D_j -+ delta_i.
    best, bj (>= b,) and gmin (t, >= b) f32 are scratch. Returns the number of changed labels.
    """
    k, b = dT.shape
    t = lb.shape[1]
    argmin_cols(dT, c_sq, best[:b], bj[:b])
    for g in range(t):
        for r in range(b):
            gmin[g, r] = np.inf
    for j in range(k):
        cj = c_sq[j]
        g = group_of[j]
        for r in range(b):
            s = cj - _TWO32 * dT[j, r]
            gv = gmin[g, r]
            take = (s < gv) and (bj[r] != j)
            gmin[g, r] = s if take else gv
    changed = 0
    for r in range(b):
        i = idx[r]
        delta = coef_xc * x_norm[i] * c_max + coef_cc * c_max * c_max + c_dev
        base = x_sq[i] + sq_offset
        ub[i] = math.sqrt(max(base + np.float64(best[r]) + delta, 0.0)) * (1.0 + 1e-9) + 1e-300
        for g in range(t):
            lb[i, g] = _down32(math.sqrt(max(base + np.float64(gmin[g, r]) - delta, 0.0))
                               * (1.0 - 1e-9))
        if labels[i] != bj[r]:
            changed += 1
            labels[i] = bj[r]
    return changed


@nb.njit(cache=True, nogil=True, fastmath=True)
def _dot32(x, c):
    """x . c in float32 (reassociated and fused: vectorised). Whatever the order, the error is
    at most gamma_d * sum |x_t c_t|, the bound the GEMM score's ``delta`` already covers."""
    acc = np.float32(0.0)
    for t in range(x.shape[0]):
        acc += x[t] * c[t]
    return acc


@nb.njit(cache=True, nogil=True)
def local_assign(x, idx, centers, c_sq, sq_offset, gstart, members, group_of, drift, gdrift,
                 mover_of,
                 labels, ub, lb, x_sq, x_norm, c_max, coef_xc, coef_cc, c_dev, max_centres,
                 need, gm1, gm2, ga1, gsk, out_idx):
    """Yinyang's local filter for the rows ``idx`` that failed :func:`prune_block`.

    Group g holds centres members[gstart[g]:gstart[g + 1]] (t groups, gstart (t + 1,) and
    members (k,) int64; group_of (k,) the inverse map).
    For row i (ub[i]: upper bound on its true distance to centre a = labels[i]; lb[i, g]
    (float32, drift already applied): lower bounds on the distance to the other centres of
    group g), only the groups with lb[i, g] <= ub[i] can hold a nearer centre. When there are
    at most ``max_groups`` of them, their centres (and a itself) get float32 scores, except a
    non-mover centre j (mover_of[j] < 0) of drift[j] whose own bound lb[i, g] + gdrift[g] -
    drift[j] (valid when lb[i, g] > 0: lb was lowered by the group's largest non-mover drift
    gdrift[g]) clears ub[i] by the margin (it is skipped, its bound kept for the test below);
    the computed ones get float32 scores
    h_j = c_sq[j] - 2 x.c_j from :func:`_dot32`, whose error is at most delta_i like the GEMM
    score's. The best candidate b is plain Lloyd's float32 GEMM argmin for certain when every
    other candidate's h exceeds h_b by more than 4 delta_i and every skipped group's L satisfies
    L^2 - (x_sq + sq_offset + h_b) > 4 delta_i (no other score can come within the two
    rounding errors; ties go to the lower index). Such rows take label b and fresh bounds (ub from h_b, lb of the
    computed groups from their best non-b score, lb of a's group lowered to a's distance when a
    stops being the label; the other groups keep theirs). Rows whose groups hold more than
    ``max_centres`` centres or that fail the test are appended to ``out_idx`` (for the full GEMM of
    :func:`assign_block_bounds`) with their bounds untouched.

    need (t,) int64, gm1/gm2/gsk (t,) f64, ga1 (t,) int64: scratch. Returns (rows appended to
    out_idx, labels changed, centre scores computed).
    """
    t = lb.shape[1]
    n_out = 0
    changed = 0
    work = 0
    for q in range(idx.shape[0]):
        i = idx[q]
        a = labels[i]
        u = ub[i]
        ng = 0
        nc = 0
        for g in range(t):
            if np.float64(lb[i, g]) <= u:
                need[ng] = g
                ng += 1
                nc += gstart[g + 1] - gstart[g]
        if nc > max_centres:
            out_idx[n_out] = i
            n_out += 1
            continue
        xi = x[i]
        ga = group_of[a]
        own_done = False
        best = np.inf
        bj = -1
        delta = coef_xc * x_norm[i] * c_max + coef_cc * c_max * c_max + c_dev
        skip2 = u * u + 5.0 * delta
        for p in range(ng):
            g = need[p]
            own_done = own_done or g == ga
            m1 = np.inf
            m2 = np.inf
            a1 = -1
            lbg = np.float64(lb[i, g])
            lsk = np.inf
            for jj in range(gstart[g], gstart[g + 1]):
                j = members[jj]
                if lbg > 0.0 and j != a and mover_of[j] < 0:
                    lj = (lbg + gdrift[g] - drift[j]) * (1.0 - 1e-12)
                    if lj * lj > skip2:
                        lsk = min(lsk, lj)
                        continue
                work += 1
                h = np.float64(c_sq[j] - _TWO32 * _dot32(xi, centers[j]))
                if h < m1 or (h == m1 and j < a1):
                    m2 = m1
                    m1 = h
                    a1 = j
                elif h < m2:
                    m2 = h
            gm1[p] = m1
            gm2[p] = m2
            ga1[p] = a1
            gsk[p] = lsk
            if m1 < best or (m1 == best and a1 < bj):
                best = m1
                bj = a1
        h_a = np.inf
        if not own_done:
            h_a = np.float64(c_sq[a] - _TWO32 * _dot32(xi, centers[a]))
            work += 1
            if h_a < best or (h_a == best and a < bj):
                best = h_a
                bj = a
        gap = 4.0 * delta
        second = np.inf
        for p in range(ng):
            v = gm2[p] if ga1[p] == bj else gm1[p]
            second = min(second, v)
        if not own_done and a != bj:
            second = min(second, h_a)
        ok = second - best > gap
        base = x_sq[i] + sq_offset
        if ok:
            lskip = np.inf
            p = 0
            for g in range(t):
                if p < ng and need[p] == g:
                    lskip = min(lskip, gsk[p])
                    p += 1
                else:
                    lskip = min(lskip, np.float64(lb[i, g]))
            if lskip < np.inf:
                ok = lskip * lskip - (base + best) > gap
        if not ok:
            out_idx[n_out] = i
            n_out += 1
            continue
        ub[i] = math.sqrt(max(base + best + delta, 0.0)) * (1.0 + 1e-9) + 1e-300
        for p in range(ng):
            v = gm2[p] if ga1[p] == bj else gm1[p]
            w = math.sqrt(max(base + v - delta, 0.0)) * (1.0 - 1e-9)
            lb[i, need[p]] = _down32(min(w, gsk[p]))
        if not own_done and a != bj:
            w = _down32(math.sqrt(max(base + h_a - delta, 0.0)) * (1.0 - 1e-9))
            lb[i, ga] = min(lb[i, ga], w)
        if a != bj:
            labels[i] = bj
            changed += 1
    return n_out, changed, work


# --------------------------------------------------------------------------------------------
# k-means|| helpers
# --------------------------------------------------------------------------------------------

@nb.njit(cache=True, nogil=True)
def update_nearest(dT, b_sq, x_sq, d2, nearest, base):
    """Fold a batch of m candidates into each row's nearest-candidate distance.

    dT (m, n) f32 = cand @ x.T; b_sq (m,) f32; x_sq (n,) f64; d2 (n,) f64 and nearest (n,)
    int32 updated in place (candidate numbers start at ``base``). Strictly smaller wins, so the
    earlier candidate keeps ties.
    """
    m, n = dT.shape
    for j in range(m):
        bq = b_sq[j]
        for r in range(n):
            v = x_sq[r] + np.float64(bq - _TWO32 * dT[j, r])
            v = max(0.0, v)
            lt = v < d2[r]
            d2[r] = v if lt else d2[r]
            nearest[r] = base + j if lt else nearest[r]
