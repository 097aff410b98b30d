"""GPU (CuPy) E-step of k-means: the same interface as :mod:`semzo.cluster.cpu`, plain Lloyd.

Imported only when :func:`semzo.cluster.kmeans` receives a CuPy array. Distances by one cuBLAS
SGEMM per row block, stored transposed as on the CPU (``centers @ rows.T``, (k, b)); then two
kernels of our own (:mod:`.kernels_cuda`): the argmin, which gives the CPU's labels from the
same scores, and the per-cluster sums in float64 **in row order**, from a sort of the labels:
given the same labels, the sums, counts and so the centres are the CPU path's bits, and they
do not change from run to run. With ``SEMZO_GPU_FUSED=0`` (or kernels that do not compile)
the generic E-step serves: CuPy's argmin over the (b, k) scores and ``cupy.add.at`` in
float64 (atomic adds: sums that are not bit-reproducible run to run).

A rank may hold no rows: counts never go through ``cp.bincount`` on an empty array, which
raises in CuPy releases without the fix for cupy issue 8116 (:func:`_bincount`). The reduced
buffer lives on the host (k*(d+1) numbers), so any ``allreduce`` on numpy buffers works; the
device is synchronised by the ``.get()`` copies before any MPI call.
tests/test_gpu_kmeans.py checks it against the CPU path (the reference) where a GPU is present
(the GPU kit), and runs this module's arithmetic on NumPy with the kernels' C build where
none is; row blocks are sized for the device (:attr:`LocalData.BLOCK_BYTES`), not for a CPU
cache.
"""

from __future__ import annotations

import cupy as cp
import numpy as np

from . import kernels_cuda
from .cpu import score_norms


def _bincount(labels, k: int):
    """``cp.bincount(labels, minlength=k)`` (int64, length k), also for an empty ``labels``:
    CuPy releases without the fix for cupy issue 8116 raise there instead of returning zeros."""
    if labels.size == 0:
        return cp.zeros(k, dtype=cp.int64)
    return cp.bincount(labels, minlength=k)


class LocalData:
    """A rank's rows (n, d) float32 on the device; methods mirror ``cpu.LocalData``."""

    #: bytes of the per-block temporaries the GPU may use (scores, a float64 copy of the rows)
    BLOCK_BYTES = 256 * 2**20

    def __init__(self, x, block_rows: int, k: int = 1024):
        self.x = cp.ascontiguousarray(x, dtype=cp.float32)
        self.n, self.d = self.x.shape
        # the CPU's cache-sized blocks would make a GPU iteration hundreds of small launches:
        # blocks as large as BLOCK_BYTES of temporaries allow (scores k x 4, rows d x 8 bytes)
        self.block_rows = max(1, int(block_rows), self.BLOCK_BYTES // (4 * k + 8 * self.d))
        self.x_sq = cp.empty(self.n, dtype=cp.float64)
        for s, e in self.blocks():
            blk = self.x[s:e].astype(cp.float64)
            self.x_sq[s:e] = (blk * blk).sum(axis=1)

    def blocks(self, cols: int | None = None):
        """(start, end) row blocks; ``cols``: score columns per row if not k (candidates)."""
        step = self.block_rows if cols is None else \
            max(1, min(self.block_rows, self.BLOCK_BYTES // (4 * cols + 8 * self.d)))
        for s in range(0, self.n, step):
            yield s, min(self.n, s + step)

    def take_rows(self, idx) -> np.ndarray:
        idx = cp.asarray(np.asarray(idx, dtype=np.int64))
        return cp.asnumpy(self.x[idx])

    def column_sums(self) -> np.ndarray:
        return cp.asnumpy(self.x.sum(axis=0, dtype=cp.float64))

    def column_sq_dev(self, mean: np.ndarray) -> np.ndarray:
        m = cp.asarray(mean)
        out = cp.zeros(self.d, dtype=cp.float64)
        for s, e in self.blocks():
            dev = self.x[s:e].astype(cp.float64) - m
            out += (dev * dev).sum(axis=0)
        return cp.asnumpy(out)

    def fold_candidates(self, cand, base, d2, nearest) -> None:
        if self.n == 0 or cand.shape[0] == 0:
            return
        kern = kernels_cuda.kernels()
        if kern is None:
            return self._fold_candidates_generic(cand, base, d2, nearest)
        cand = np.ascontiguousarray(cand, dtype=np.float32)
        m = int(cand.shape[0])
        c = cp.asarray(cand)
        b_sq = cp.asarray(score_norms(cand, False))
        d2_dev = cp.asarray(np.ascontiguousarray(d2, dtype=np.float64))
        near_dev = cp.asarray(np.ascontiguousarray(nearest, dtype=np.int32))
        buf = None
        for s, e in self.blocks(cols=m):
            b = e - s
            buf = cp.empty(m * b, dtype=cp.float32) if buf is None else buf
            d_t = cp.matmul(c, self.x[s:e].T, out=buf[:m * b].reshape(m, b))
            kern["km_update_nearest"]((kernels_cuda.blocks(b),),
                                      (kernels_cuda.THREADS_PER_BLOCK,),
                                      (d_t, b_sq, self.x_sq[s:e], np.int64(b), np.int32(m),
                                       d2_dev[s:e], near_dev[s:e], np.int32(base)))
        d2[:] = cp.asnumpy(d2_dev)
        nearest[:] = cp.asnumpy(near_dev)

    def _fold_candidates_generic(self, cand, base, d2, nearest) -> None:
        """fold_candidates in CuPy array code alone (the argmin of the float32 scores)."""
        c = cp.asarray(cand, dtype=cp.float32)
        c_sq = (c.astype(cp.float64) ** 2).sum(axis=1).astype(cp.float32)
        d2_dev = cp.asarray(d2)
        near_dev = cp.asarray(nearest)
        for s, e in self.blocks(cols=int(c.shape[0])):
            score = c_sq[None, :] - 2.0 * (self.x[s:e] @ c.T)
            j = cp.argmin(score, axis=1)
            v = cp.maximum(self.x_sq[s:e] + cp.take_along_axis(score, j[:, None], 1)[:, 0], 0.0)
            better = v < d2_dev[s:e]
            d2_dev[s:e] = cp.where(better, v, d2_dev[s:e])
            near_dev[s:e] = cp.where(better, (j + base).astype(cp.int32), near_dev[s:e])
        d2[:] = cp.asnumpy(d2_dev)
        nearest[:] = cp.asnumpy(near_dev)

    def exact_cost(self, labels, centers, counts, spherical):
        c = cp.asarray(centers, dtype=cp.float32)
        e2 = cp.empty(self.n, dtype=cp.float64)
        inertia = cp.zeros((), dtype=cp.float64)
        for s, e in self.blocks():
            xb = self.x[s:e].astype(cp.float64)
            cb = c[labels[s:e]].astype(cp.float64)
            e2[s:e] = ((xb - cb) ** 2).sum(axis=1)
            inertia += (1.0 - (xb * cb).sum(axis=1)).sum() if spherical else e2[s:e].sum()
        if counts.shape[0]:
            counts += cp.asnumpy(_bincount(labels, counts.shape[0]))
        return e2, float(inertia)


class LloydGPU:
    """Plain Lloyd E-step on the device (see ``cpu.LloydCPU`` for the contract)."""

    name = "lloyd"

    def __init__(self, data: LocalData, k: int, spherical: bool):
        self.data = data
        self.k = k
        self.spherical = spherical
        self.labels = cp.full(data.n, -1, dtype=cp.int32)

    def estep(self, centers, sums, counts, accumulate=True):
        kern = kernels_cuda.kernels()
        if kern is None:
            return self._estep_generic(centers, sums, counts, accumulate)
        data, k = self.data, self.k
        c = cp.asarray(centers, dtype=cp.float32)
        c_sq = cp.asarray(score_norms(np.asarray(centers, dtype=np.float32), self.spherical))
        changed = cp.zeros(1, dtype=cp.uint64)
        best = cp.empty(data.n, dtype=cp.float32)
        buf = cp.empty(k * min(data.n, data.block_rows), dtype=cp.float32)
        for s, e in data.blocks():
            b = e - s
            d_t = cp.matmul(c, data.x[s:e].T, out=buf[:k * b].reshape(k, b))
            kern["km_argmin"]((kernels_cuda.blocks(b),), (kernels_cuda.THREADS_PER_BLOCK,),
                              (d_t, c_sq, np.int64(b), np.int32(k), self.labels[s:e],
                               best[s:e], changed))
        inertia = float((data.x_sq + best.astype(cp.float64)).sum()) if data.n else 0.0
        if accumulate:
            self._cluster_sums(kern, sums, counts)
        if self.spherical:
            inertia = 0.5 * (inertia - float(data.x_sq.sum())) + data.n
        return int(cp.asnumpy(changed)[0]), inertia, data.n

    def _cluster_sums(self, kern, sums, counts) -> None:
        """sums (k, d) and counts (k,) (host float64) of the rows by their labels: every
        cluster's rows in row order (a sort of the keys label * n + row, unique, so any sort
        gives that order), summed by ``km_cluster_sums``."""
        data, k = self.data, self.k
        if data.n == 0:
            sums[...] = 0.0
            counts[...] = 0.0
            return
        # int64 spelled out: the kernel reads these as long long
        cnt = _bincount(self.labels, k).astype(cp.int64, copy=False)
        start = (cp.cumsum(cnt) - cnt).astype(cp.int64, copy=False)
        order = cp.argsort(self.labels.astype(cp.int64) * data.n +
                           cp.arange(data.n, dtype=cp.int64)).astype(cp.int64, copy=False)
        s_dev = cp.empty((k, data.d), dtype=cp.float64)
        kern["km_cluster_sums"]((kernels_cuda.blocks(k * data.d),),
                                (kernels_cuda.THREADS_PER_BLOCK,),
                                (data.x, order, start, cnt, np.int32(k), np.int32(data.d),
                                 s_dev))
        sums[...] = cp.asnumpy(s_dev)
        counts[...] = cp.asnumpy(cnt)

    def _estep_generic(self, centers, sums, counts, accumulate=True):
        """The E-step in CuPy array code alone (no kernels of ours; sums by atomics)."""
        data, k = self.data, self.k
        c = cp.asarray(centers, dtype=cp.float32)
        if self.spherical:
            c_sq = cp.zeros(k, dtype=cp.float32)
        else:
            c_sq = (c.astype(cp.float64) ** 2).sum(axis=1).astype(cp.float32)
        s_dev = cp.zeros((k, data.d), dtype=cp.float64) if accumulate else None
        n_dev = cp.zeros(k, dtype=cp.float64) if accumulate else None
        changed = cp.zeros((), dtype=cp.int64)
        inertia = cp.zeros((), dtype=cp.float64)
        for s, e in data.blocks():
            xb = data.x[s:e]
            score = c_sq[None, :] - cp.float32(2.0) * (xb @ c.T)
            lab = cp.argmin(score, axis=1).astype(cp.int32)
            best = cp.take_along_axis(score, lab[:, None].astype(cp.int64), 1)[:, 0]
            changed += (lab != self.labels[s:e]).sum()
            self.labels[s:e] = lab
            inertia += (data.x_sq[s:e] + best.astype(cp.float64)).sum()
            if accumulate:
                cp.add.at(s_dev, lab, xb.astype(cp.float64))
                n_dev += _bincount(lab, k).astype(cp.float64)
        if accumulate:
            sums[...] = cp.asnumpy(s_dev)
            counts[...] = cp.asnumpy(n_dev)
        inertia = float(inertia)
        if self.spherical:
            inertia = 0.5 * (inertia - float(data.x_sq.sum())) + data.n
        return int(changed), inertia, data.n


def predict(x, centers, spherical, block_rows):
    data = LocalData(x, block_rows, int(centers.shape[0]))
    a = LloydGPU(data, int(centers.shape[0]), spherical)
    a.estep(np.asarray(cp.asnumpy(centers) if hasattr(centers, "get") else centers,
                       dtype=np.float32), None, None, False)
    return a.labels
