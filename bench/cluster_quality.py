"""Cluster quality on real embeddings: semzo's k-means against scikit-learn KMeans.

    .venv/bin/python bench/cluster_quality.py runs/demo/embeddings.h5 [--k 64] [--seeds 3]

Peer: scikit-learn KMeans (lloyd, k-means++ init, n_init=1) on the same embeddings. Both are
scored against the corpus labels (fortunes: the category file of each quote) with NMI
(arithmetic normalization, as scikit-learn computes it) and purity, over several seeds; the
ratio column is semzo / scikit-learn. semzo runs in this one process (its MPI path with one
rank; the result does not depend on the number of ranks beyond rounding, see the tests).
"""

from __future__ import annotations

import argparse
import time

import h5py
import numpy as np
from mpi4py import MPI
from sklearn.cluster import KMeans
from sklearn.metrics import normalized_mutual_info_score
from threadpoolctl import threadpool_limits

from semzo.cluster import kmeans


def purity(labels: np.ndarray, classes: np.ndarray) -> float:
    k, c = labels.max() + 1, classes.max() + 1
    table = np.zeros((k, c), np.int64)
    np.add.at(table, (labels, classes), 1)
    return float(table.max(1).sum() / len(labels))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("embeddings")
    ap.add_argument("--k", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with h5py.File(args.embeddings, "r") as f:
        x = f["embeddings"][...].astype(np.float32)
        y = f["labels"][...]
    print(f"{x.shape[0]} embeddings of dimension {x.shape[1]}, {y.max() + 1} labels, "
          f"k = {args.k}, {args.seeds} seeds, {args.threads} threads")
    rows = []
    with threadpool_limits(args.threads):
        for seed in range(args.seeds):
            for name, spherical in (("semzo spherical", True), ("semzo euclidean", False)):
                t0 = time.perf_counter()
                r = kmeans(x, args.k, MPI.COMM_WORLD, global_offset=0, seed=seed,
                           spherical=spherical, max_iter=300, tol=1e-4)
                rows.append((name, seed, normalized_mutual_info_score(y, r.labels),
                             purity(np.asarray(r.labels), y), time.perf_counter() - t0))
            t0 = time.perf_counter()
            km = KMeans(args.k, n_init=1, random_state=seed, algorithm="lloyd", max_iter=300,
                        tol=1e-4).fit(x)
            rows.append(("scikit-learn", seed, normalized_mutual_info_score(y, km.labels_),
                         purity(km.labels_, y), time.perf_counter() - t0))
    print(f"{'method':<18}{'NMI mean':>10}{'NMI sd':>9}{'purity':>9}{'seconds':>9}"
          f"{'NMI ratio':>11}")
    ref = np.mean([r[2] for r in rows if r[0] == "scikit-learn"])
    for name in ("semzo spherical", "semzo euclidean", "scikit-learn"):
        sel = [r for r in rows if r[0] == name]
        nmi = np.array([r[2] for r in sel])
        print(f"{name:<18}{nmi.mean():>10.4f}{nmi.std():>9.4f}"
              f"{np.mean([r[3] for r in sel]):>9.4f}{np.mean([r[4] for r in sel]):>9.2f}"
              f"{nmi.mean() / ref:>11.3f}")


if __name__ == "__main__":
    main()
