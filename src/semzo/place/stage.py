"""The place stage: plan cluster -> rank placement, move rows with Alltoallv, write
``shards.h5`` (collective) and a PNG of cluster sizes per rank, node and switch.

Modes (``[place] mode``): ``semantic`` / ``random`` plan a quota from cluster counts
(:func:`semzo.place.place`) and move the fewest rows meeting it; ``shuffle`` sends every row to
the rank a hash of its id chooses (:func:`semzo.place.shuffle_destinations`), and its plan is
the quota that induces, with the actual movement as its movement figures.

``shards.h5``: rows grouped by the rank that now holds them (rank r's rows are
``rank_offsets[r]:rank_offsets[r+1]``): ``embeddings``, ``ids``, ``labels``, ``clusters``,
``text_offsets``/``text_bytes``; manifest: ``quota (k, P)`` (samples of cluster c on rank p),
``cluster_rank``, ``cluster_node``, ``cluster_switch`` (main holder of each cluster),
``rank_node``, ``node_switch``, ``rank_weights (P,)`` float64 (mean 1; all ones for
``place.rank_weights = "equal"``: what the finetune stage reads, :mod:`.weights`); attrs: mode
and the placement figures.
"""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..cluster.stage import read_clusters
from ..embed import read_embeddings
from ..h5check import CLUSTER_KEYS, agree, deck_drift
from ..h5io import create_collective, offsets, string_array, write_rows, write_texts
from ..runtime import InvariantError, get_logger
from . import (
    cluster_counts,
    destinations,
    format_figures,
    movement_from_dest,
    place,
    placement_from_quota,
    shuffle_destinations,
)
from .redistribute import redistribute
from .weights import resolve_rank_weights

log = get_logger(__name__)


def _fingerprint(ids: np.ndarray, comm: MPI.Intracomm) -> np.ndarray:
    """(count, sum, sum of squares, xor-hash) of ids over all ranks: equal before and after a
    move exactly when (with overwhelming probability) no id was lost or duplicated."""
    u = ids.astype(np.uint64)
    h = (u * np.uint64(0x9E3779B97F4A7C15)) ^ (u >> np.uint64(29))
    local = np.array([ids.size, int(ids.sum()), int((ids.astype(np.float64) ** 2).sum()),
                      0], dtype=np.float64)
    s = np.array([local[0], local[1], local[2]], dtype=np.float64)
    comm.Allreduce(MPI.IN_PLACE, s, op=MPI.SUM)
    x = np.array([np.bitwise_xor.reduce(h) if h.size else np.uint64(0)], dtype=np.uint64)
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.BXOR)
    return np.array([s[0], s[1], s[2], float(x[0] % np.uint64(2**52))])


def run_place_stage(ctx) -> dict:
    """Collective. Reads embeddings.h5 and clusters.h5 (this rank's block), plans, moves,
    and writes shards.h5."""
    deck, topo = ctx.deck, ctx.topo
    comm = topo.world
    rows = read_embeddings(ctx.path("embeddings.h5"), comm, with_text=True)
    lo, hi = rows.offset, rows.offset + rows.embeddings.shape[0]
    cpath = ctx.path("clusters.h5")
    centers, labels, cattrs = read_clusters(cpath, comm, lo, hi, rows.n_total,
                                            rows.embeddings.shape[1])
    # the inputs must belong together and to this deck (a stage run alone after a change
    # upstream would place other data, or store a deck its shards were not made with)
    made_from = cattrs.get("embeddings_file_id", "")
    made_from = made_from.decode() if isinstance(made_from, bytes) else str(made_from)
    err = None
    if made_from and rows.file_id and made_from != rows.file_id:
        err = (f"{cpath} was made from another embeddings.h5 than the one beside it (the "
               f"embed stage ran again since): rerun the cluster stage")
    agree(comm, err or deck_drift(cpath, cattrs.get("semzo_deck", ""), deck, CLUSTER_KEYS,
                                  "rerun the cluster stage (run.stages) or set the key back"))
    k = centers.shape[0]
    with ctx.timer.comm():
        where = cluster_counts(labels, k, comm)
    d = rows.embeddings.shape[1]
    bytes_per_row = 4 * d + 8 + 8 + 4 + int(np.mean([len(t) for t in rows.texts] or [0]))
    wts = resolve_rank_weights(deck.place.rank_weights, comm)
    if wts is not None:
        log.info("rank weights (%s): %s (shares of the samples and of the global batch)",
                 "measured: kernel throughput" if deck.place.rank_weights == "measured"
                 else "from the deck", " ".join(f"{w:.3f}" for w in wts))
    if deck.place.mode == "shuffle":
        plan, dest = _shuffle_plan(ctx, centers, where, labels, rows.ids, bytes_per_row, wts)
    else:
        plan = place(centers, where, topo.rank_node, topo.node_switch, mode=deck.place.mode,
                     balance_tol=deck.place.balance_tol, seed=deck.run.seed,
                     bytes_per_row=bytes_per_row, comm=comm, rank_weights=wts)
        dest = destinations(labels, plan, comm)
    log.info("placement (%s, %d clusters on %d ranks / %d nodes / %d switches):\n%s",
             plan.mode, k, topo.size, topo.n_nodes, topo.n_switches,
             format_figures(plan.figures))
    before = _fingerprint(rows.ids, comm)
    stats: dict = {}
    t0 = time.perf_counter()
    with ctx.timer.comm():
        cols, texts = redistribute(
            comm, dest, {"embeddings": rows.embeddings, "ids": rows.ids,
                         "labels": rows.labels, "clusters": labels.astype(np.int32)},
            text=rows.texts, memory_cap_bytes=int(deck.place.memory_cap_mb * 2**20),
            stats=stats)
    moved_s = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    after = _fingerprint(cols["ids"], comm)
    if not np.array_equal(before, after):
        raise InvariantError(f"redistribution lost or duplicated samples: ids fingerprint "
                           f"{before.tolist()} before, {after.tolist()} after")
    mine = np.bincount(cols["clusters"], minlength=k)
    if not np.array_equal(mine, plan.quota[:, topo.rank]):
        raise RuntimeError(f"rank {topo.rank} holds {mine.tolist()} samples per cluster, "
                           f"the plan says {plan.quota[:, topo.rank].tolist()}")
    rounds = comm.allreduce(stats.get("rounds", 0), op=MPI.MAX)
    log.info("redistribution: %d rows checked (none lost, none duplicated) in %.2f s, "
             "%d Alltoallv round(s) under a cap of %.0f MiB", int(after[0]), moved_s, rounds,
             deck.place.memory_cap_mb)
    _write_shards(ctx, plan, cols, texts, rows.label_names, wts)
    if topo.rank == 0:
        plot_sizes(plan, ctx.path("shards.png"))
    fig = plan.figures
    return {"mode": plan.mode, "load max/mean": fig["load_max_over_mean"],
            "moved": fig["moved_fraction"], "MB across switches": fig["bytes_cross_switch"] / 1e6,
            "centroid dist vs random": fig.get("centroid_dist_ratio", 1.0)}


def _shuffle_plan(ctx, centers, where, labels, ids, bytes_per_row, wts=None):
    """Shuffle mode: destinations by a hash of the ids (exactly balanced), the quota they
    induce (one Allreduce), and the plan's movement figures replaced by the actual movement
    (shuffle moves about ``1 - 1/P`` of the rows, far more than the minimal flows). Collective
    over the world communicator."""
    topo, seed = ctx.topo, ctx.deck.run.seed
    comm = topo.world
    k = centers.shape[0]
    with ctx.timer.comm():
        dest = shuffle_destinations(ids, topo.size, seed, comm, weights=wts)
        quota = np.bincount(labels.astype(np.int64) * topo.size + dest,
                            minlength=k * topo.size).astype(np.int64).reshape(k, topo.size)
        comm.Allreduce(MPI.IN_PLACE, quota, op=MPI.SUM)
        mv = movement_from_dest(dest, topo.rank_node, topo.node_switch, comm)
    plan = placement_from_quota(centers, where, quota, topo.rank_node, topo.node_switch,
                                mode="shuffle", bytes_per_row=bytes_per_row, seed=seed)
    fig = plan.figures
    n = fig["n"]
    fig.update(moved_fraction=mv["moved"] / n if n else 0.0,
               rows_cross_node=mv["cross_node"], rows_cross_switch=mv["cross_switch"],
               bytes_cross_node=mv["cross_node"] * bytes_per_row,
               bytes_cross_switch=mv["cross_switch"] * bytes_per_row)
    return plan, dest


def _write_shards(ctx, plan, cols, texts, label_names, wts=None) -> None:
    comm = ctx.topo.world
    n = cols["ids"].shape[0]
    off, total = offsets(n, comm)
    counts = np.array(comm.allgather(n), dtype=np.int64)
    rank_offsets = np.concatenate(([0], np.cumsum(counts)))
    fig = {f"fig_{k}": v for k, v in plan.figures.items()
           if isinstance(v, (int, float, np.integer, np.floating))}
    with create_collective(ctx.path("shards.h5"), comm, ctx.deck.to_toml(), mode=plan.mode,
                           n_total=total, label_names=string_array(label_names),
                           **fig) as f:
        for name in ("embeddings", "ids", "labels", "clusters"):
            write_rows(f, name, cols[name], off, total)
        write_texts(f, texts, off, total, comm)
        f.create_dataset("rank_offsets", data=rank_offsets)
        for name in ("quota", "cluster_rank", "cluster_node", "cluster_switch", "rank_node",
                     "node_switch"):
            f.create_dataset(name, data=np.asarray(getattr(plan, name), dtype=np.int64))
        f.create_dataset("rank_weights", data=np.ones(plan.n_ranks) if wts is None
                         else np.asarray(wts, dtype=np.float64))


def plot_sizes(plan, path) -> None:
    """PNG: samples per rank, per node and per switch, stacked by cluster (rank 0 only)."""
    import matplotlib  # heavy (a second), rank 0 only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    quota = plan.quota                                  # (k, P)
    k, P = quota.shape
    n_nodes = plan.node_switch.size
    per_node = np.zeros((k, n_nodes), np.int64)
    np.add.at(per_node.T, plan.rank_node, quota.T)
    n_sw = int(plan.node_switch.max()) + 1
    per_sw = np.zeros((k, n_sw), np.int64)
    np.add.at(per_sw.T, plan.node_switch, per_node.T)
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), constrained_layout=True)
    cmap = plt.get_cmap("tab20")
    for ax, mat, what in zip(axes, (quota, per_node, per_sw), ("rank", "node", "switch")):
        bottom = np.zeros(mat.shape[1])
        for c in range(k):
            if mat[c].any():
                ax.bar(np.arange(mat.shape[1]), mat[c], bottom=bottom, color=cmap(c % 20),
                       width=0.8, linewidth=0)
                bottom += mat[c]
        ax.set_xlabel(what)
        ax.set_ylabel("samples")
        ax.set_title(f"samples per {what}, stacked by cluster")
        ax.set_xticks(np.arange(mat.shape[1]))
    fig.suptitle(f"semzo placement ({plan.mode}): {k} clusters, {P} ranks, "
                 f"{n_nodes} nodes, {n_sw} switches")
    fig.savefig(path, dpi=100)
    plt.close(fig)
