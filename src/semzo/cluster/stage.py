"""The cluster stage: parallel k-means of embeddings.h5 -> ``clusters.h5`` (collective).

``clusters.h5``: ``centers (k, d)`` float32, ``labels (N,)`` int32 (cluster of each row of
embeddings.h5, global order), ``counts (k,)``; attrs: inertia, n_iter, converged, algorithm,
seconds, and (for labelled corpora) nmi and purity of the clusters against the labels.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..embed import read_embeddings
from ..h5check import CORPUS_KEYS, DAMAGED, agree, deck_drift, range_error, shape_error
from ..h5io import create_collective, open_collective, read_slab, write_rows
from ..preflight import check_k
from ..runtime import get_logger
from .kmeans import kmeans

log = get_logger(__name__)


def contingency(labels: np.ndarray, classes: np.ndarray, k: int, n_classes: int,
                comm: MPI.Intracomm) -> np.ndarray:
    """(k, n_classes) int64 counts of (cluster, class) pairs over all ranks. Collective."""
    c = np.zeros((k, max(n_classes, 1)), np.int64)
    ok = classes >= 0
    np.add.at(c, (labels[ok].astype(np.int64), classes[ok]), 1)
    comm.Allreduce(MPI.IN_PLACE, c, op=MPI.SUM)
    return c


def nmi_purity(c: np.ndarray) -> tuple[float, float]:
    """Normalized mutual information (arithmetic mean of entropies, scikit-learn's default)
    and purity of a (clusters x classes) contingency table."""
    n = c.sum()
    if n == 0:
        return float("nan"), float("nan")
    p = c / n
    pa, pb = p.sum(1), p.sum(0)
    nz = p > 0
    mi = float(np.sum(p[nz] * np.log(p[nz] / np.outer(pa, pb)[nz])))
    ha = -float(np.sum(pa[pa > 0] * np.log(pa[pa > 0])))
    hb = -float(np.sum(pb[pb > 0] * np.log(pb[pb > 0])))
    denom = (ha + hb) / 2
    nmi = mi / denom if denom > 0 else 1.0
    return nmi, float(c.max(1).sum() / n)


def run_cluster_stage(ctx) -> dict:
    """Collective. k-means over this rank's block of embeddings.h5; writes clusters.h5."""
    deck, topo = ctx.deck, ctx.topo
    comm = topo.world
    cfg = deck.cluster
    rows = read_embeddings(ctx.path("embeddings.h5"), comm, with_text=False)
    agree(comm, deck_drift(ctx.path("embeddings.h5"), rows.deck_toml, deck, CORPUS_KEYS,
                           "rerun the embed stage (run.stages) or set the key back"))
    check_k(deck, rows.n_total)
    t0 = time.perf_counter()
    x = ctx.xp.asarray(rows.embeddings)
    res = kmeans(x, cfg.k, comm, global_offset=rows.offset, allreduce=topo.allreduce,
                 max_iter=cfg.max_iter, tol=cfg.tol, spherical=cfg.spherical,
                 seed=deck.run.seed, oversampling=cfg.oversampling * cfg.k,
                 rounds=cfg.init_rounds, algorithm=cfg.algorithm)
    seconds = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    labels = np.asarray(res.labels.get() if hasattr(res.labels, "get") else res.labels,
                        dtype=np.int32)
    centers = np.asarray(res.centers.get() if hasattr(res.centers, "get") else res.centers,
                         dtype=np.float32)
    attrs = {"inertia": float(res.inertia), "n_iter": int(res.n_iter),
             "converged": bool(res.converged), "algorithm": res.algorithm,
             "seconds": seconds, "k": int(cfg.k), "spherical": bool(cfg.spherical),
             "embeddings_file_id": rows.file_id}
    if rows.label_names:
        c = contingency(labels, rows.labels, cfg.k, len(rows.label_names), comm)
        attrs["nmi"], attrs["purity"] = nmi_purity(c)
    sizes = np.asarray(res.counts)
    log.info("k-means (%s, k=%d, %s): %d iterations in %.2f s, converged %s, inertia %.6g; "
             "cluster sizes min %d / median %d / max %d%s", res.algorithm, cfg.k,
             "spherical" if cfg.spherical else "euclidean", res.n_iter, seconds,
             res.converged, res.inertia, sizes.min(), int(np.median(sizes)), sizes.max(),
             f"; against the {len(rows.label_names)} corpus labels: NMI {attrs['nmi']:.3f}, "
             f"purity {attrs['purity']:.3f}" if "nmi" in attrs else "")
    with create_collective(ctx.path("clusters.h5"), comm, deck.to_toml(), **attrs) as f:
        f.create_dataset("centers", data=centers)
        f.create_dataset("counts", data=sizes.astype(np.int64))
        write_rows(f, "labels", labels, rows.offset, rows.n_total)
    out = {"k": cfg.k, "iterations": res.n_iter, "seconds": seconds}
    if "nmi" in attrs:
        out.update(nmi=attrs["nmi"], purity=attrs["purity"])
    return out


def read_clusters(path, comm, lo: int, hi: int, n_total: int | None = None,
                  d: int | None = None) -> tuple[np.ndarray, np.ndarray, dict]:
    """(centers (k, d), labels of rows [lo, hi), attrs) from clusters.h5. Collective.

    Checked before use (one-line :class:`semzo.h5check.InputFileError` on every rank):
    ``centers`` is (k, d) with k >= 1 (``d`` given: that width) and finite, ``labels`` has
    ``n_total`` rows (given: the rows of embeddings.h5) and every label read lies in [0, k)."""
    with open_collective(path, comm, missing="run the cluster stage first") as f:
        err = shape_error(path, f, {"centers": (-1, 2), "labels": (-1 if n_total is None
                                                                  else n_total, 1)})
        if err is None:
            k, width = f["centers"].shape
            if k < 1 or (d is not None and width != d) or f["labels"].shape[0] < hi:
                err = (f"{path}: dataset centers/labels: shapes {f['centers'].shape} / "
                       f"{f['labels'].shape} do not fit {hi} rows of {d}-d embeddings: "
                       f"{DAMAGED}")
        agree(comm, err)
        centers = f["centers"][...]
        labels = read_slab(f["labels"], lo, hi)
        attrs = dict(f.attrs)
    k = centers.shape[0]
    err = None
    if centers.dtype.kind != "f" or not np.isfinite(centers).all():
        err = f"{path}: dataset centers: not finite floats ({centers.dtype}): {DAMAGED}"
    agree(comm, err or range_error(path, "labels", labels, 0, k, row0=lo,
                                   what=f"{k} clusters"))
    return centers, labels, attrs
