"""Shuffle placement: every sample on a rank chosen by a hash of its id, exactly balanced.

The i.i.d. data-parallel baseline. The key of a sample is a 64-bit Philox-4x32-10 hash of its
id keyed by the run seed (:func:`shuffle_keys`); sort all N samples by ``(key, id)`` and give
the sample at global position ``g`` the destination ``floor(g * P / N)``. Rank ``p`` thus
receives ``ceil((p+1) N / P) - ceil(p N / P)`` samples, i.e. ``N//P`` or ``N//P + 1``, and the
id -> destination map depends only on ``(ids, seed, P)``: not on which rank holds which id,
nor on clusters.

Computed without gathering the keys (:func:`destinations_from_keys`):

1. Cut the key space by the top ``b`` bits into ``B = 2**b`` buckets (``B`` the power of two
   at or above ``64 P``, at most ``2**20``); one ``Allreduce`` of the bucket counts gives every
   bucket's global position range (prefix sums of the counts in key order, which do not depend
   on the layout). A bucket whose whole range lies in one destination's range sends all its
   samples there: no order inside it is needed.
2. At most ``P - 1`` buckets straddle a destination boundary. While they hold more than
   ``gather_limit`` samples in total, they are cut again by their next bits (one more
   ``Allreduce`` per round, over the straddling buckets only).
3. The samples of the remaining straddling buckets (about ``N / 64`` at most after step 1,
   far fewer after refinement) are ``Allgatherv``-ed as (key, id), sorted, and assigned by
   their exact global position.

Ids should be unique. Equal ids still get exact balance, but which copy goes where among equal
(key, id) pairs follows the gather order (source rank, then local order).
"""

from __future__ import annotations

import numpy as np

from semzo.place.weights import apportion
from semzo.rng import philox_hash
from semzo.runtime import get_logger

log = get_logger(__name__)

_DOMAIN_SHUFFLE = 0x5F1E          # Philox counter word 3: independent of the other streams
_M32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)
FIRST_BITS_MAX = 20               # first round: at most 2**20 buckets
REFINE_CELLS_MAX = 1 << 20        # later rounds: at most this many cells in one Allreduce
GATHER_LIMIT = 1 << 16            # gather straddling samples once at most this many remain


def shuffle_keys(ids: np.ndarray, seed: int) -> np.ndarray:
    """``(n,)`` uint64 keys: Philox-4x32-10 of counter ``(id low 32 bits, id high 32 bits, 0,
    _DOMAIN_SHUFFLE)`` under the 64-bit key ``seed``; word 1 is the high half, word 0 the low.
    Same ids and seed give the same keys on every machine (integer arithmetic only)."""

    u = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1).view(np.uint64)
    x0, x1 = philox_hash(u & _M32, u >> _U32, 0, _DOMAIN_SHUFFLE, seed)
    return (np.asarray(x1, np.uint64) << _U32) | np.asarray(x0, np.uint64)


def shuffle_destinations(ids_local: np.ndarray, n_ranks: int, seed: int, comm, *,
                         gather_limit: int = GATHER_LIMIT, weights=None) -> np.ndarray:
    """Destination rank of each local sample under shuffle placement (module docstring).

    ids_local: (n_local,) integer sample ids. n_ranks: number of destinations P (usually
    ``comm.Get_size()``; any P >= 1 works, e.g. with a single-rank comm to compute the map of a
    P-rank job serially). seed: the run seed. n_ranks, seed and gather_limit must be the
    same on every rank. Collective over comm (Allreduce, Allgather, Allgatherv). Returns
    int64 (n_local,) in ``[0, P)``. Non-integer ids on any rank make every rank raise
    ValueError after the first collective. weights: None, or (n_ranks,) positive weights
    (heterogeneous ranks): destination p then receives
    ``apportion(N, weights)[p]`` samples (largest remainder, :mod:`semzo.place.weights`),
    positions in order: the first ``targets[0]`` keys to rank 0, and so on.
    """
    ids = np.asarray(ids_local).reshape(-1)
    bad = not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0)
    ids = ids.astype(np.int64) if not bad else np.zeros(0, np.int64)
    keys = shuffle_keys(ids, seed) if ids.size else np.zeros(0, np.uint64)
    return destinations_from_keys(keys, ids, n_ranks, comm, gather_limit=gather_limit,
                                  bad=bad, weights=weights)


def _prefix(keys: np.ndarray, depth: int) -> np.ndarray:
    """Top ``depth`` bits of uint64 keys (0 <= depth <= 64)."""
    if depth == 0:
        return np.zeros(keys.shape, np.uint64)
    return keys >> np.uint64(64 - depth)


def _round_bits(depth: int, n_ranks: int, n_active: int, total: int) -> int:
    if depth == 0:
        b = int(np.ceil(np.log2(64 * n_ranks)))
        return max(1, min(b, FIRST_BITS_MAX))
    want = int(np.ceil(np.log2(max(total / n_active / 8.0, 2.0))))   # ~8 samples per cell
    budget = int(np.floor(np.log2(max(REFINE_CELLS_MAX // n_active, 2))))
    return max(1, min(want, budget, 64 - depth))


def _position_map(n: int, n_ranks: int, weights):
    """Destination of global positions (int64 array -> int64 array): ``g * P // N`` (equal),
    or the rank whose apportioned range holds ``g`` (weights)."""
    if weights is None:
        return lambda g: g * n_ranks // n
    ends = np.cumsum(apportion(n, weights))
    return lambda g: np.searchsorted(ends, g, side="right").astype(np.int64)


def destinations_from_keys(keys: np.ndarray, ids: np.ndarray, n_ranks: int, comm, *,
                           gather_limit: int = GATHER_LIMIT, bad: bool = False,
                           weights=None) -> np.ndarray:
    """Destinations from explicit keys: sort all samples by ``(key, id)`` and send global
    position ``g`` to ``floor(g * n_ranks / N)`` (module docstring, steps 1-3).

    keys: (n_local,) uint64. ids: (n_local,) int64 (tie break). bad: this rank's input is
    invalid (every rank raises ValueError after the first collective). weights: see
    :func:`shuffle_destinations`. Collective over comm. Returns int64 (n_local,).
    """
    n_ranks = int(n_ranks)
    if n_ranks < 1:
        raise ValueError(f"n_ranks must be >= 1, got {n_ranks}")
    keys = np.ascontiguousarray(keys, dtype=np.uint64).reshape(-1)
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    bad = bool(bad) or keys.size != ids.size
    head = np.array([keys.size, int(bad)], dtype=np.int64)
    tot = np.empty_like(head)
    comm.Allreduce(head, tot)
    if tot[1]:
        raise ValueError(f"shuffle_destinations: ids must be a 1-D integer array (with one key "
                         f"per id) on every rank; {int(tot[1])} rank(s) passed something else")
    n = int(tot[0])
    dest = np.full(keys.size, -1, dtype=np.int64)
    if n_ranks == 1 or n == 0:
        dest[:] = 0
        return dest
    to_rank = _position_map(n, n_ranks, weights)

    # active (straddling) intervals: key prefixes of ``depth`` bits, sorted, with their start
    # position in the global order and their global count
    act_prefix = np.zeros(1, np.uint64)
    act_start = np.zeros(1, np.int64)
    act_count = np.array([n], np.int64)
    depth, rounds = 0, 0
    live = np.arange(keys.size)
    while act_count.size and depth < 64 and (depth == 0 or act_count.sum() > gather_limit):
        s = _round_bits(depth, n_ranks, act_count.size, int(act_count.sum()))
        n_cells = act_count.size << s
        lk = keys[live]
        a = np.searchsorted(act_prefix, _prefix(lk, depth))
        sub = (lk >> np.uint64(64 - depth - s)) & np.uint64((1 << s) - 1)
        cell = (a.astype(np.int64) << s) + sub.astype(np.int64)
        local = np.bincount(cell, minlength=n_cells).astype(np.int64)
        count = np.empty_like(local)
        comm.Allreduce(local, count)
        c2 = count.reshape(-1, 1 << s)
        start = (act_start[:, None] + np.cumsum(c2, axis=1) - c2).reshape(-1)
        lo = to_rank(start)
        hi = to_rank(start + np.maximum(count, 1) - 1)
        cell_dest = np.where(lo == hi, lo, -1)
        d = cell_dest[cell]
        done = d >= 0
        dest[live[done]] = d[done]
        live = live[~done]
        strad = np.flatnonzero(lo != hi)
        act_prefix = ((act_prefix[strad >> s] << np.uint64(s))
                      | (strad & ((1 << s) - 1)).astype(np.uint64))
        act_start, act_count = start[strad], count[strad]
        depth += s
        rounds += 1

    gathered = int(act_count.sum())
    if act_count.size:
        dest[live] = _gather_assign(keys[live], ids[live], act_prefix, act_start, act_count,
                                    depth, to_rank, comm)
    log.debug("shuffle destinations: %d samples, %d ranks, %d bucket round(s) to depth %d, "
              "%d straddling samples gathered", n, n_ranks, rounds, depth, gathered)
    assert (dest >= 0).all()
    return dest


def _gather_assign(lk, li, act_prefix, act_start, act_count, depth, to_rank, comm):
    """Allgatherv the straddling samples, sort them by (key, id), return this rank's dests."""
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = np.empty(size, np.int64)
    comm.Allgather(np.array([lk.size], np.int64), counts)
    displs = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    m = int(counts.sum())
    gk = np.empty(m, np.uint64)
    gi = np.empty(m, np.int64)
    cl, dl = counts.tolist(), displs.tolist()
    comm.Allgatherv(lk, [gk, (cl, dl)])
    comm.Allgatherv(li, [gi, (cl, dl)])
    order = np.lexsort((gi, gk))                     # stable: equal pairs by gather order
    a = np.searchsorted(act_prefix, _prefix(gk[order], depth))
    per = np.bincount(a, minlength=act_count.size)
    if not np.array_equal(per, act_count):          # same on every rank: all raise together
        raise RuntimeError("shuffle destinations: gathered samples do not match the bucket "
                           "counts")
    first = np.concatenate(([0], np.cumsum(per)[:-1]))
    g = act_start[a] + (np.arange(m) - first[a])
    gdest = np.empty(m, np.int64)
    gdest[order] = to_rank(g)
    return gdest[displs[rank]:displs[rank] + lk.size]


def movement_from_dest(dest: np.ndarray, rank_node: np.ndarray, node_switch: np.ndarray,
                       comm) -> dict:
    """Rows actually moved, leaving their node, leaving their switch, when this rank's rows
    go to ``dest`` (summed over ranks). Collective over comm (one Allreduce of 3 int64)."""
    rank = comm.Get_rank()
    rank_node = np.asarray(rank_node, np.int64)
    sw = np.asarray(node_switch)[rank_node]
    dest = np.asarray(dest, np.int64)
    local = np.array([(dest != rank).sum(), (rank_node[dest] != rank_node[rank]).sum(),
                      (sw[dest] != sw[rank]).sum()], dtype=np.int64)
    tot = np.empty_like(local)
    comm.Allreduce(local, tot)
    return {"moved": int(tot[0]), "cross_node": int(tot[1]), "cross_switch": int(tot[2])}
