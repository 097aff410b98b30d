"""Parallel k-means over MPI ranks: k-means|| initialisation, then Lloyd iterations.

Each rank holds a contiguous slice of the global rows (``global_offset`` is the global index of
its first row). An iteration is: local E-step (blocked GEMM + numba argmin/accumulate, see
:mod:`semzo.cluster.cpu`), ONE in-place sum-allreduce of a float64 buffer packing the
per-cluster sums (k*d), counts (k), and three scalars (labels changed, approximate inertia,
rows whose distances were computed), then the M-step, which every rank does identically on the
identical reduced buffer. Repairing empty clusters needs two more collectives, only in the
iterations that have one (every rank sees the same counts, so every rank takes that path).

Semantics follow scikit-learn's Lloyd: stop when no label changed ("strict convergence") or when
the squared centre shift summed over centres is <= tol * mean per-feature variance of the data;
after the loop, one more E-step without update so labels match the returned centres; the
inertia is then computed exactly (float64 sum of squared differences, not the GEMM expansion).
Empty clusters take the points farthest from their centres (largest exact squared distance, ties
to the smaller global index), which are removed from their old cluster's sum, as scikit-learn
does. The spherical variant assigns by largest dot product, re-normalises the centres to unit
length and reports ``sum(1 - x.c)`` as inertia.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..runtime import get_logger
from . import cpu
from .collectives import allgatherv, default_allreduce, patient_barrier
from .init import kmeans_parallel, normalize_rows

log = get_logger(__name__)

ALGORITHMS = ("lloyd", "pruned")


@dataclass(frozen=True)
class KMeansResult:
    """Result of :func:`kmeans` (identical on every rank, except ``labels``).

    centers (k, d) float32; labels (n_local,) int32, this rank's rows; inertia: global sum of
    squared distances to the assigned centres (spherical: sum of 1 - x.c); n_iter: Lloyd
    iterations run; counts (k,) int64 global cluster sizes; converged: stopped before max_iter
    (no label changed, or centre shift within tol). ``stats``: timings and work counters.
    """

    centers: np.ndarray
    labels: np.ndarray
    inertia: float
    n_iter: int
    counts: np.ndarray
    converged: bool
    algorithm: str = "lloyd"
    stats: dict = field(default_factory=dict)


def _is_cupy(a) -> bool:
    return type(a).__module__.split(".")[0] == "cupy"


def _check_args(k, init, max_iter, tol, algorithm, rounds):
    if int(k) < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if max_iter < 1:
        raise ValueError(f"max_iter must be >= 1, got {max_iter}")
    if tol < 0:
        raise ValueError(f"tol must be >= 0, got {tol}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if isinstance(init, str) and init != "k-means||":
        raise ValueError(f"init must be 'k-means||' or a (k, d) array, got {init!r}")
    if rounds < 0:
        raise ValueError(f"rounds must be >= 0, got {rounds}")


def kmeans(x_local, k: int, comm, *, global_offset: int, allreduce=None, init="k-means||",
           max_iter: int = 100, tol: float = 1e-4, spherical: bool = False, seed: int = 0,
           oversampling: float | None = None, rounds: int = 5, max_candidates: int | None = None,
           algorithm: str = "lloyd", block_rows: int = 1024, n_groups: int | None = None,
           max_movers: int | None = None, patient: bool = True) -> KMeansResult:
    """k-means of the rows of all ranks. Collective over ``comm``; every rank passes the same
    keyword arguments (only ``x_local`` and ``global_offset`` differ).

    x_local: (n_local, d) float32 (other dtypes are converted), n_local may be 0; a CuPy array
    selects the GPU path (plain Lloyd). global_offset: global index of the first local row
    (row blocks of the ranks are disjoint; they fix the k-means|| sample). allreduce:
    ``f(buf)`` summing a contiguous float64 numpy buffer in place over comm (default
    ``comm.Allreduce(IN_PLACE, buf, SUM)``); called once per iteration. init: "k-means||" or
    the (k, d) initial centres (identical on every rank). tol: see the module docstring.
    spherical: rows should be L2-normalised; cosine k-means. oversampling (default 2k),
    rounds, max_candidates (default 1 + rounds * oversampling): k-means||. algorithm: "lloyd"
    or "pruned" (exact: the same labels as "lloyd", fewer distances). block_rows: rows per
    GEMM block. n_groups, max_movers: tuning of "pruned" (lower bounds per row, default k // 16;
    most centres given fresh distances per iteration, default k // 8). patient: wait for the
    slowest rank in a barrier that sleeps between polls before each iteration's allreduce
    (:func:`~semzo.cluster.collectives.patient_barrier`), instead of MPI's spinning wait.
    """
    _check_args(k, init, max_iter, tol, algorithm, rounds)
    k = int(k)
    if allreduce is None:
        allreduce = default_allreduce(comm)
    t_start = time.perf_counter()
    data, bad = _local_data(x_local, block_rows, k)
    if _is_cupy(x_local):
        if algorithm != "lloyd":
            log.warning("algorithm %r has no GPU path; running plain Lloyd", algorithm)
            algorithm = "lloyd"
        from . import gpu  # loaded by _local_data already
        make = gpu.LloydGPU
    else:
        make = cpu.LloydCPU if algorithm == "lloyd" else cpu.PrunedCPU
    n_local, d = data.n, data.d
    n_total = _agree_shape(comm, allreduce, n_local, d, bad)
    if n_total < k:
        raise ValueError(f"k={k} clusters need at least k rows; there are {n_total}")
    tol_abs = _tolerance(data, n_total, tol, allreduce) if tol > 0 else 0.0

    # -- initial centres -----------------------------------------------------------------
    t0 = time.perf_counter()
    if isinstance(init, str):
        centers = kmeans_parallel(data, k, comm, allreduce, global_offset=global_offset,
                                  n_total=n_total, seed=seed, oversampling=oversampling,
                                  rounds=rounds, max_candidates=max_candidates,
                                  spherical=spherical)
    else:
        centers = np.array(init.get() if _is_cupy(init) else init, dtype=np.float32, copy=True)
        if centers.shape != (k, d):
            raise ValueError(f"init has shape {centers.shape}, expected {(k, d)}")
        if spherical:
            centers = normalize_rows(centers)
    t_init = time.perf_counter() - t0

    if algorithm == "pruned":
        assigner = make(data, k, spherical, n_groups, max_movers)
    else:
        assigner = make(data, k, spherical)
    buf = np.zeros(k * d + k + 3, dtype=np.float64)
    sums = buf[:k * d].reshape(k, d)
    counts = buf[k * d:k * d + k]
    scal = buf[k * d + k:]
    strict = converged = False
    n_iter = 0
    rows_computed = 0.0
    t_comm = 0.0
    t0 = time.perf_counter()
    for it in range(max_iter):
        buf[:] = 0.0
        changed, inertia, n_rows = assigner.estep(centers, sums, counts, True)
        scal[:] = (changed, inertia, n_rows)
        tc = time.perf_counter()
        if patient:
            patient_barrier(comm)
        allreduce(buf)
        t_comm += time.perf_counter() - tc
        rows_computed += scal[2]
        if np.any(counts == 0):
            _repair_empty(comm, allreduce, data, assigner, centers, sums, counts,
                          global_offset, spherical)
        new = _m_step(sums, counts, centers, spherical)
        shift = float(((new.astype(np.float64) - centers) ** 2).sum())
        centers = new
        n_iter = it + 1
        log.debug("iter %d: %d labels changed, inertia~%.6g, shift %.3g, rows computed %d",
                  n_iter, int(scal[0]), scal[1], shift, int(scal[2]))
        if scal[0] == 0:
            strict = converged = True
            break
        if shift <= tol_abs:
            converged = True
            break
    t_iter = time.perf_counter() - t0

    # -- labels for the returned centres; exact inertia and counts -------------------------
    fin = np.zeros(k + 2, dtype=np.float64)
    if not strict:
        _, _, n_rows = assigner.estep(centers, None, None, False)
        fin[k + 1] = n_rows
    _, inertia = data.exact_cost(assigner.labels, centers, fin[:k], spherical)
    fin[k] = inertia
    allreduce(fin)
    rows_computed += fin[k + 1]
    passes = n_iter + (0 if strict else 1)
    stats = {"t_init": t_init, "t_iter": t_iter, "t_comm": t_comm,
             "t_total": time.perf_counter() - t_start, "n_total": n_total,
             "distance_fraction": rows_computed / max(1.0, passes * n_total)}
    log.info("k-means (%s%s): k=%d n=%d d=%d, %d iterations%s, inertia %.6g, "
             "%.3f s/iter, distances computed for %.1f%% of rows",
             algorithm, ", spherical" if spherical else "", k, n_total, d, n_iter,
             " (converged)" if converged else "", fin[k], t_iter / max(n_iter, 1),
             100 * stats["distance_fraction"])
    labels = assigner.labels
    return KMeansResult(centers=centers, labels=labels, inertia=float(fin[k]), n_iter=n_iter,
                        counts=np.rint(fin[:k]).astype(np.int64), converged=converged,
                        algorithm=algorithm, stats=stats)


def init_centers(x_local, k: int, comm, *, global_offset: int, allreduce=None, seed: int = 0,
                 oversampling: float | None = None, rounds: int = 5,
                 max_candidates: int | None = None, spherical: bool = False,
                 block_rows: int = 1024) -> np.ndarray:
    """Only the k-means|| initial centres (k, d) float32 that :func:`kmeans` would start from,
    identical on every rank. Collective over ``comm``; arguments as for :func:`kmeans`."""
    if allreduce is None:
        allreduce = default_allreduce(comm)
    data, bad = _local_data(x_local, block_rows, int(k))
    n_total = _agree_shape(comm, allreduce, data.n, data.d, bad)
    if n_total < k:
        raise ValueError(f"k={k} clusters need at least k rows; there are {n_total}")
    return kmeans_parallel(data, int(k), comm, allreduce, global_offset=global_offset,
                           n_total=n_total, seed=seed, oversampling=oversampling,
                           rounds=rounds, max_candidates=max_candidates, spherical=spherical)


def _local_data(x_local, block_rows: int, k: int):
    """(this rank's LocalData, whether ``x_local`` is malformed). Raises nothing on a bad shape:
    a rank whose rows are not 2-D gets an empty (0, 0) LocalData of its device and says so in
    :func:`_agree_shape`, so every rank raises the same error after the same collective
    instead of one rank raising while the others wait in ``allreduce`` (both devices)."""
    bad = getattr(x_local, "ndim", np.ndim(x_local)) != 2
    if _is_cupy(x_local):
        from . import gpu  # imports cupy: only when a GPU array is given
        # a bad rank's placeholder from its own module (CuPy's ascontiguousarray takes no
        # NumPy array): no rows, no columns
        empty = x_local.reshape(-1)[:0].reshape(0, 0) if bad else x_local
        return gpu.LocalData(empty, block_rows, k), bad
    x = np.zeros((0, 0), np.float32) if bad else np.ascontiguousarray(x_local,
                                                                       dtype=np.float32)
    return cpu.LocalData(x, block_rows), bad


def _agree_shape(comm, allreduce, n_local: int, d: int, bad: bool) -> int:
    """The global row count; raises the same ValueError on every rank if some rank's rows
    are not 2-D or the column counts differ. The first collective of :func:`kmeans` and
    :func:`init_centers`, on a host buffer whatever the device."""
    head = np.array([n_local, d, d * d, float(bad)], dtype=np.float64)
    allreduce(head)
    size = comm.Get_size()
    if head[3] > 0:
        raise ValueError("x_local must be 2-D (n_local, d) on every rank (use shape (0, d) "
                         "for a rank without rows)")
    # d from the ranks that are not bad: sum d == P d and sum d^2 == P d^2 iff all equal
    if head[1] != size * d or head[2] != size * d * d:
        raise ValueError("x_local has a different number of columns on some ranks")
    return int(head[0])


def _tolerance(data, n_total, tol, allreduce) -> float:
    """tol * mean over features of the global variance (two passes, float64). Collective."""
    s = data.column_sums()
    allreduce(s)
    v = data.column_sq_dev(s / max(n_total, 1))
    allreduce(v)
    return float(tol * (v / max(n_total, 1)).mean())


def _m_step(sums, counts, old, spherical) -> np.ndarray:
    """New centres (k, d) float32 from the reduced sums/counts; an empty cluster keeps its
    centre (only after a repair that emptied it again)."""
    new = old.astype(np.float64)
    nz = counts > 0
    if spherical:
        nrm = np.sqrt(np.einsum("ij,ij->i", sums, sums))
        ok = nz & (nrm > 0)
        new[ok] = sums[ok] / nrm[ok, None]
    else:
        new[nz] = sums[nz] / counts[nz, None]
    return new.astype(np.float32)


def _repair_empty(comm, allreduce, data, assigner, centers, sums, counts, global_offset,
                  spherical) -> None:
    """Give each empty cluster one of the points farthest from their centres. Collective
    (two collectives); all ranks see the same counts so all of them call it."""
    empty = np.flatnonzero(counts == 0)
    m = empty.shape[0]
    e2, _ = data.exact_cost(assigner.labels, centers, np.zeros(0), spherical)
    e2 = np.asarray(e2.get() if hasattr(e2, "get") else e2)
    loc = np.lexsort((np.arange(e2.shape[0]), -e2))[:m]
    vals, _ = allgatherv(comm, e2[loc])
    gids, _ = allgatherv(comm, global_offset + loc.astype(np.int64))
    chosen = gids[np.lexsort((gids, -vals))[:m]]
    d = data.d
    rows = np.zeros((m, d + 1), dtype=np.float64)
    labels = assigner.labels
    labels = labels.get() if hasattr(labels, "get") else labels
    for slot, g in enumerate(chosen):
        i = int(g) - global_offset
        if 0 <= i < data.n and (i in loc):
            rows[slot, :d] = data.take_rows([i])[0]
            rows[slot, d] = labels[i]
    allreduce(rows)
    for slot in range(chosen.shape[0]):
        new, old = int(empty[slot]), int(rows[slot, d])
        sums[old] -= rows[slot, :d]
        counts[old] -= 1.0
        sums[new] = rows[slot, :d]
        counts[new] = 1.0
    log.info("repaired %d empty cluster(s) with the farthest points", m)


def predict(x, centers, spherical: bool = False, block_rows: int = 1024):
    """Labels (n,) int32 of rows x (n, d) for the centres (k, d): nearest by the same float32
    score as the Lloyd E-step (largest dot product when ``spherical``). Local, no collectives.

    The labels live where ``x`` lives: a NumPy array for NumPy rows, a CuPy array (on the
    current device) for CuPy rows; ``semzo.backend.array_module(labels)`` tells which.
    """
    if _is_cupy(x):
        from . import gpu  # imports cupy: only when a GPU array is given
        return gpu.predict(x, centers, spherical, block_rows)
    data = cpu.LocalData(np.ascontiguousarray(x, dtype=np.float32), block_rows)
    c = np.ascontiguousarray(centers, dtype=np.float32)
    a = cpu.LloydCPU(data, c.shape[0], spherical)
    a.estep(c, None, None, False)
    return a.labels
