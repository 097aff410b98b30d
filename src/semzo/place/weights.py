"""Heterogeneous ranks (``[place] rank_weights``): how much of the data and of the global batch
each rank takes, and a test hook that slows chosen ranks.

* ``"equal"`` (the default): every rank the same share; the code paths of a homogeneous run
  (``weights = None`` everywhere), bit for bit.
* a list of P positive numbers: rank r's share is ``w_r / sum(w)``.
* ``"measured"``: every rank runs a fixed deterministic compute kernel
  (:func:`measure_rank_weights`: a float32 matrix product, the shape of a transformer's dense
  layer) at the start of the place stage, all ranks together for about a second; its
  throughput (runs per second) is agreed by one allreduce. The kernel, not the model: the place stage does not load the model it will
  fine-tune (which may be a decoder, while the sharding stages embed with an encoder), and a
  dense product is what a forward pass spends its time on. The weights are stored in
  ``shards.h5`` (dataset ``rank_weights``) and the finetune stage reads them from there, so a
  rerun of a later stage uses the same weights.

Weights are normalised to mean 1 (sum P). Sample counts and batch sizes are integers that sum
exactly to the total: largest remainder rounding (:func:`apportion`).

Test hook, not a user feature: ``SEMZO_SLOW_RANKS="1:2.0,3:1.5"`` makes rank 1 sleep after
every forward pass of the fine-tuning loss and every timing of the kernel so that each takes
2.0 times as long (rank 3: 1.5 times). It simulates a slower device on a homogeneous machine
(bench/rank_weights.py, tests).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from ..runtime import get_logger

log = get_logger(__name__)

SLOW_ENV = "SEMZO_SLOW_RANKS"
KERNEL_N = 256        # the measuring kernel: (KERNEL_N, KERNEL_N) @ (KERNEL_N, 4 KERNEL_N)
WINDOW_S = 0.3       # measuring: runs counted in windows of this many seconds ...
WINDOWS = 3          # ... this many (the median counts)


def apportion(total: int, weights) -> np.ndarray:
    """int64 ``(P,)`` shares of ``total`` in proportion to ``weights`` (positive, finite),
    summing exactly to ``total``: the floors of the exact shares, then one more to the ranks
    with the largest remainders (ties: the lower rank). Each share is within 1 of its exact
    value. Not collective."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size == 0 or not np.all(np.isfinite(w)) or w.min() <= 0:
        raise ValueError(f"weights must be positive finite numbers, got {w.tolist()}")
    total = int(total)
    exact = total * (w / w.sum())
    share = np.floor(exact).astype(np.int64)
    short = total - int(share.sum())
    if short > 0:
        order = np.lexsort((np.arange(w.size), -(exact - share)))
        share[order[:short]] += 1
    elif short < 0:                        # rounding of w / w.sum() (never more than a few)
        order = np.lexsort((np.arange(w.size), exact - share))
        share[order[:-short]] -= 1
    return share


def batch_shares(batch_size: int, weights, n_ranks: int) -> np.ndarray:
    """Per-rank batch sizes: the global batch ``batch_size * n_ranks`` apportioned by
    ``weights`` (None: ``batch_size`` each), every rank at least 1 (taken from the largest)."""
    if weights is None:
        return np.full(n_ranks, int(batch_size), np.int64)
    share = apportion(int(batch_size) * n_ranks, weights)
    while share.min() < 1:
        share[int(np.argmax(share))] -= 1
        share[int(np.argmin(share))] += 1
    return share


def normalised(weights) -> np.ndarray:
    """float64 weights scaled to mean 1."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    return w * (w.size / w.sum())


# ----------------------------------------------------------------------------- slow hook
def slow_factors(text: str | None = None) -> dict[int, float]:
    """``{rank: factor}`` from ``SEMZO_SLOW_RANKS`` (or ``text``): ``"r:f,r:f"``, f >= 1.
    ValueError naming the variable on a malformed value."""
    text = os.environ.get(SLOW_ENV, "") if text is None else text
    out: dict[int, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        try:
            r, f = item.split(":")
            rank, factor = int(r), float(f)
        except ValueError:
            raise ValueError(f"{SLOW_ENV}={text!r}: expected rank:factor[,rank:factor...], "
                             f"e.g. 1:2.0") from None
        if rank < 0 or not factor >= 1.0 or not np.isfinite(factor):
            raise ValueError(f"{SLOW_ENV}={text!r}: rank must be >= 0 and factor >= 1, got "
                             f"{item!r}")
        out[rank] = factor
    return out


def slowed(fn: Callable, factor: float) -> Callable:
    """``fn`` made ``factor`` times slower: after each call, sleep ``(factor - 1)`` times the
    time the call took. ``factor <= 1``: ``fn`` itself."""
    if factor <= 1.0:
        return fn

    def slow(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        time.sleep((factor - 1.0) * (time.perf_counter() - t0))
        return out

    return slow


# ----------------------------------------------------------------------------- measuring
def _kernel(n: int) -> Callable[[], float]:
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((n, 4 * n)).astype(np.float32)

    def run() -> float:
        return float((a @ b)[0, 0])

    return run


def measure_rank_weights(comm, *, n: int = KERNEL_N, window_s: float = WINDOW_S,
                         windows: int = WINDOWS) -> np.ndarray:
    """float64 ``(P,)`` weights, mean 1, the same on every rank: each rank's throughput, the
    kernel runs it completes per second in a time window (``windows`` windows of about
    ``window_s`` seconds, every one started by a barrier so all ranks run together; the
    median counts), shared by one allreduce. Counting runs in a window that all ranks share,
    rather than timing single runs, is fair where ranks share cores: each gets its slice of
    the window, and a rank that finishes early does not leave the others a free machine. The
    slow hook applies. Collective over comm."""
    rank, size = comm.Get_rank(), comm.Get_size()
    run = slowed(_kernel(n), slow_factors().get(rank, 1.0))
    run()                                             # warm-up (allocation, BLAS threads)
    rates = []
    for _ in range(windows):
        comm.Barrier()
        t0 = time.perf_counter()
        done, now = 0, t0
        while now - t0 < window_s:
            run()
            done += 1
            now = time.perf_counter()
        rates.append(done / (now - t0))
    speed = np.zeros(size, np.float64)
    speed[rank] = float(np.median(rates))
    comm.Allreduce(MPI.IN_PLACE, speed, op=MPI.SUM)
    return normalised(speed)


def resolve_rank_weights(spec, comm) -> np.ndarray | None:
    """The deck's ``place.rank_weights`` as weights (mean 1) for this world, or None for
    ``"equal"``. A list must have one positive entry per rank (the deck check does that,
    :func:`semzo.deck.check_world`). Collective over comm for ``"measured"``."""
    if spec == "equal":
        return None
    if spec == "measured":
        return measure_rank_weights(comm)
    w = np.asarray(spec, dtype=np.float64)
    if w.size != comm.Get_size():
        raise ValueError(f"rank_weights has {w.size} entries for {comm.Get_size()} ranks")
    return normalised(w)
