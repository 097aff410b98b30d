"""CPU E-steps of k-means: blocked float32 GEMM (BLAS) + numba kernels.

Two assigners share one interface (see :class:`LloydCPU`):

- ``LloydCPU``: every iteration computes the distances of every row to every centre.
- ``PrunedCPU``: exact pruning. Per row an upper bound on the distance to its centre and t
  group lower bounds on the distance to the other centres (Yinyang's global filter) plus
  Hamerly's half-distance to the nearest other centre decide which rows keep their label;
  of the others, those whose group bounds leave few candidate centres are decided by the
  local filter (:func:`kernels.local_assign`: float32 dots to the candidates only, accepted
  when the winner leads by more than the rounding margin), the rest are gathered into dense
  blocks and go through the same GEMM and argmin as ``LloydCPU``. The bounds include the float32 rounding error of the GEMM score, so a skipped
  row is one whose float32 argmin could not have changed: the labels (and, because the sums
  are re-accumulated in row order, the centres) are those of plain Lloyd.

Nothing here communicates; the driver (:mod:`semzo.cluster.kmeans`) owns the collectives.
"""

from __future__ import annotations

import numpy as np

from . import kernels as kn

_U32 = 2.0 ** -24   # unit roundoff of float32
DIRECT_MOVERS = 8   # up to this many movers: exact distances in the prune kernel, not a GEMM
FULL_PASS_FRACTION = 0.6   # pruning kept fewer rows than this share: back off to full passes
LOCAL_MAX_SHARE = 0.25     # local filter: rows needing more centres than this share go to GEMM
HOPELESS_DRIFT = 0.5       # median centre drift / half-gap above this: full pass, no filter


class LocalData:
    """A rank's rows (n, d) float32 C-contiguous and what every E-step reuses."""

    def __init__(self, x: np.ndarray, block_rows: int):
        self.x = x
        self.n, self.d = x.shape
        self.block_rows = max(1, int(block_rows))
        self.x_sq = np.empty(self.n, dtype=np.float64)
        kn.row_sq_norms(x, self.x_sq)
        self.x_norm = np.sqrt(self.x_sq)

    def blocks(self):
        for s in range(0, self.n, self.block_rows):
            yield s, min(self.n, s + self.block_rows)

    def column_sums(self) -> np.ndarray:
        """Per-feature sums (d,) float64."""
        out = np.zeros(self.d, dtype=np.float64)
        for s in range(0, self.n, 65536):
            out += self.x[s:s + 65536].sum(axis=0, dtype=np.float64)
        return out

    def column_sq_dev(self, mean: np.ndarray) -> np.ndarray:
        """Per-feature sums of squared deviations from ``mean`` (d,) float64."""
        out = np.zeros(self.d, dtype=np.float64)
        for s in range(0, self.n, 65536):
            dev = self.x[s:s + 65536].astype(np.float64) - mean
            out += np.einsum("ij,ij->j", dev, dev)
        return out

    def take_rows(self, idx: np.ndarray) -> np.ndarray:
        """Rows ``idx`` (local indices) as a float32 (m, d) host array."""
        return self.x[np.asarray(idx, dtype=np.int64)]

    def fold_candidates(self, cand: np.ndarray, base: int, d2: np.ndarray,
                        nearest: np.ndarray) -> None:
        """Fold candidates (b, d) f32 numbered from ``base`` into (d2, nearest) of every row."""
        if self.n == 0 or cand.shape[0] == 0:
            return
        c64 = cand.astype(np.float64)
        b_sq = np.einsum("ij,ij->i", c64, c64).astype(np.float32)
        cand = np.ascontiguousarray(cand, dtype=np.float32)
        m = cand.shape[0]
        buf = np.empty(m * self.block_rows, dtype=np.float32)
        for s, e in self.blocks():
            dT = np.matmul(cand, self.x[s:e].T, out=buf[:m * (e - s)].reshape(m, e - s))
            kn.update_nearest(dT, b_sq, self.x_sq[s:e], d2[s:e], nearest[s:e], base)

    def exact_cost(self, labels: np.ndarray, centers: np.ndarray, counts: np.ndarray,
                   spherical: bool) -> tuple[np.ndarray, float]:
        """Per-row exact squared distance to the assigned centre (f64) and the summed inertia.

        ``counts`` (k,) f64 is incremented per label (pass an empty array to skip).
        """
        e2 = np.empty(self.n, dtype=np.float64)
        inertia = kn.sq_dist_rows(self.x, labels, centers, e2, counts, spherical)
        return e2, float(inertia)


def score_norms(centers: np.ndarray, spherical: bool) -> np.ndarray:
    """The c_sq term of the float32 score (zeros for the spherical variant)."""
    if spherical:
        return np.zeros(centers.shape[0], dtype=np.float32)
    c64 = centers.astype(np.float64)
    return np.einsum("ij,ij->i", c64, c64).astype(np.float32)


class LloydCPU:
    """Plain Lloyd E-step over all rows.

    ``estep(centers, sums, counts, accumulate)`` assigns every row to its nearest centre
    (labels kept in ``self.labels`` (n,) int32, -1 before the first step), adds the rows into
    ``sums`` (k, d) f64 / ``counts`` (k,) f64 when ``accumulate``, and returns
    ``(n_changed, approx_inertia, n_rows_computed)``.
    """

    name = "lloyd"

    def __init__(self, data: LocalData, k: int, spherical: bool):
        self.data = data
        self.k = k
        self.spherical = spherical
        self.labels = np.full(data.n, -1, dtype=np.int32)
        self._buf = np.empty(data.block_rows * k, dtype=np.float32)
        self._best = np.empty(data.block_rows, dtype=np.float32)
        self._bj = np.empty(data.block_rows, dtype=np.int32)
        self._zero_sums = np.zeros((k, data.d), dtype=np.float64)
        self._zero_counts = np.zeros(k, dtype=np.float64)

    def _gemm(self, centers, xb):
        """centers @ xb.T -> (k, b) float32 in the scratch buffer (one SGEMM)."""
        b = xb.shape[0]
        return np.matmul(centers, xb.T, out=self._buf[:self.k * b].reshape(self.k, b))

    def estep(self, centers, sums, counts, accumulate=True):
        data = self.data
        c_sq = score_norms(centers, self.spherical)
        if not accumulate:
            sums, counts = self._zero_sums, self._zero_counts
        changed = 0
        inertia = 0.0
        for s, e in data.blocks():
            dT = self._gemm(centers, data.x[s:e])
            c, i = kn.assign_block(dT, c_sq, data.x[s:e], data.x_sq[s:e], self.labels[s:e],
                                   sums, counts, accumulate, self._best, self._bj)
            changed += c
            inertia += i
        if self.spherical:   # x_sq + score = |x|^2 - 2 x.c: report 1 - x.c for unit rows
            inertia = 0.5 * (inertia - float(data.x_sq.sum())) + data.n
        return changed, inertia, data.n


class PrunedCPU(LloydCPU):
    """Exact pruned E-step (same labels as :class:`LloydCPU`); see the module docstring.

    ``n_groups`` centre groups (contiguous index ranges) carry one lower bound per row each
    (memory n * n_groups float32). Per iteration, the ``max_movers`` centres that moved most
    ("movers") get fresh distances to every row by one thin GEMM (n * movers * d flops), which
    keeps the bounds tight when a few centres move far and the rest stay (the common case
    after the first iterations, and the bane of group bounds in high dimension, where every
    centre is about equally far from every row); the other centres' drifts are subtracted.
    """

    name = "pruned"

    def __init__(self, data: LocalData, k: int, spherical: bool, n_groups: int | None = None,
                 max_movers: int | None = None, local: bool = True):
        super().__init__(data, k, spherical)
        t = max(1, min(k, n_groups if n_groups else max(1, k // 16)))
        self.n_groups = t
        self.max_movers = max(0, min(k, max_movers if max_movers is not None
                                     else max(1, k // 8)))
        self._set_groups(((np.arange(k, dtype=np.int64) * t) // k).astype(np.int32))
        self.ub = np.zeros(data.n, dtype=np.float64)
        self.lb = np.zeros((data.n, t), dtype=np.float32)
        self._prev = None
        self._skip = 0
        self._backoff = 0
        self._idx = np.empty(data.n, dtype=np.int64)
        self._xbuf = np.empty((data.block_rows, data.d), dtype=np.float32)
        self._gmin = np.empty((t, data.block_rows), dtype=np.float32)
        self._gdist = np.empty(t, dtype=np.float64)
        self.local_centres = max(1, int(LOCAL_MAX_SHARE * k)) if local else -1
        self._need = np.empty(t, dtype=np.int64)
        self._gm1 = np.empty(t, dtype=np.float64)
        self._gm2 = np.empty(t, dtype=np.float64)
        self._ga1 = np.empty(t, dtype=np.int64)
        self._gsk = np.empty(t, dtype=np.float64)
        self._drifts = None
        self._idx2 = np.empty(data.n, dtype=np.int64)
        d = data.d
        gamma = d * _U32 / (1.0 - d * _U32)
        # |computed score - true (|c|^2 - 2 x.c)| <= coef_xc |x| c_max + coef_cc c_max^2
        self._coef_xc = 1.01 * (2.0 * gamma + 2.0 * _U32)
        self._coef_cc = 1.01 * 2.0 * _U32

    def _set_groups(self, group_of):
        """group_of (k,) int32 -> members (centre ids sorted by group, stable) and gstart."""
        self.group_of = np.ascontiguousarray(group_of, dtype=np.int32)
        self.members = np.argsort(self.group_of, kind="stable").astype(np.int64)
        self.gstart = np.searchsorted(self.group_of[self.members],
                                      np.arange(self.n_groups + 1)).astype(np.int64)

    def _centre_geometry(self, centers):
        c64 = centers.astype(np.float64)
        c_sq = np.einsum("ij,ij->i", c64, c64)
        c_max = float(np.sqrt(c_sq.max())) if self.k else 0.0
        if self.k > 1:
            cc = c_sq[:, None] + c_sq[None, :] - 2.0 * (c64 @ c64.T)
            np.fill_diagonal(cc, np.inf)
            margin = 8.0 * (self.data.d + 2) * 2.0 ** -52 * c_max * c_max
            s_half = 0.5 * np.sqrt(np.maximum(cc.min(axis=1) - margin, 0.0))
        else:
            s_half = np.full(self.k, np.inf)
        c_dev = float(np.abs(c_sq - 1.0).max()) * 1.01 if self.spherical else 0.0
        return c64, c_max, s_half, c_dev

    def _filter(self, centers, c64, c_max, s_half, c_dev):
        """Rows that need all k distances this iteration (local indices, int64)."""
        data, k = self.data, self.k
        drift = np.sqrt(((c64 - self._prev) ** 2).sum(axis=1)) * (1.0 + 1e-9)
        moved = np.flatnonzero(drift > 0.0)
        if moved.shape[0] > self.max_movers:
            top = np.argsort(-drift[moved], kind="stable")[:self.max_movers]
            moved = np.sort(moved[top])
        movers = moved.astype(np.int32)
        mover_of = np.full(k, -1, dtype=np.int32)
        mover_of[movers] = np.arange(movers.shape[0], dtype=np.int32)
        small = drift.copy()
        small[movers] = 0.0
        gdrift = np.zeros(self.n_groups, dtype=np.float64)
        np.maximum.at(gdrift, self.group_of, small)
        self._drifts = (small, gdrift, mover_of)
        cm = np.ascontiguousarray(centers[movers])
        cm_sq = score_norms(cm, self.spherical)
        m = movers.shape[0]
        sq_offset = 1.0 if self.spherical else 0.0
        # few movers: exact distances row by row (one pass over x); many: one thin GEMM
        direct = m <= DIRECT_MOVERS
        no_dm = np.empty((0, 0), dtype=np.float32)
        n_out = 0
        for s, e in data.blocks():
            b = e - s
            # (b, m) orientation: OpenBLAS packs the thin movers' matrix, not the row block
            dM = no_dm if direct else np.matmul(data.x[s:e], cm.T,
                                                out=self._buf[:m * b].reshape(b, m))
            n_out = kn.prune_block(data.x, s, b, dM, direct, movers, mover_of, cm_sq, sq_offset,
                                   centers, self.labels, self.ub, self.lb, small, gdrift,
                                   self.group_of, s_half, data.x_sq, data.x_norm, c_max,
                                   self._coef_xc, self._coef_cc, c_dev, self._gmin,
                                   self._gdist, self._idx, n_out)
        return self._idx[:n_out], m

    def estep(self, centers, sums, counts, accumulate=True):
        data = self.data
        c64, c_max, s_half, c_dev = self._centre_geometry(centers)
        n_movers = 0
        changed = 0
        local_work = 0
        c_sq = score_norms(centers, self.spherical)
        sq_offset = 1.0 if self.spherical else 0.0
        if self._prev is not None and self._skip == 0 and self.k > 1:
            # centres that moved more than half the way to their nearest neighbour break
            # Hamerly's bound, and in high dimension every group bound with them: when that
            # is the typical centre (the first iterations), filtering is wasted work
            drift = np.sqrt(((c64 - self._prev) ** 2).sum(axis=1))
            if np.median(drift / np.maximum(s_half, 1e-300)) > HOPELESS_DRIFT:
                self._skip = 1
        if self._prev is None or self._skip > 0:
            idx = np.arange(data.n, dtype=np.int64)
            self._skip = max(0, self._skip - 1)
        else:
            idx, n_movers = self._filter(centers, c64, c_max, s_half, c_dev)
            if self.local_centres > 0 and idx.shape[0]:
                small, gdrift, mover_of = self._drifts
                n2, changed, local_work = kn.local_assign(
                    data.x, idx, centers, c_sq, sq_offset, self.gstart, self.members,
                    self.group_of, small, gdrift, mover_of, self.labels, self.ub, self.lb,
                    data.x_sq, data.x_norm, c_max, self._coef_xc, self._coef_cc, c_dev,
                    self.local_centres, self._need,
                    self._gm1, self._gm2, self._ga1, self._gsk, self._idx2)
                idx = self._idx2[:n2]
            if idx.shape[0] + local_work / self.k > FULL_PASS_FRACTION * data.n:
                # the bounds are not paying: full passes for a while (1, 2, 4, 8 iterations)
                self._backoff = min(2 * self._backoff, 8) if self._backoff else 1
                self._skip = self._backoff
            else:
                self._backoff = 0
        self._prev = c64
        B = data.block_rows
        m = idx.shape[0]
        for s in range(0, m, B):
            bi = idx[s:s + B]
            b = bi.shape[0]
            if bi[-1] - bi[0] == b - 1:      # a contiguous run: no copy
                xb = data.x[bi[0]:bi[0] + b]
            else:
                xb = np.take(data.x, bi, axis=0, out=self._xbuf[:b])
            dT = self._gemm(centers, xb)
            changed += kn.assign_block_bounds(dT, c_sq, sq_offset, bi, data.x_sq, data.x_norm,
                                              c_max, self._coef_xc, self._coef_cc, c_dev,
                                              self.group_of, self.labels, self.ub, self.lb,
                                              self._best, self._bj, self._gmin)
        if accumulate:
            kn.accumulate_rows(data.x, self.labels, sums, counts)
        # distance work in units of full rows: the full recomputations plus the movers' GEMM
        return changed, 0.0, m + (local_work + data.n * n_movers) / self.k
