"""The topology stage: report the hierarchy, verify the hierarchical collectives against the
flat ones, time them, and write ``topology.h5``."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from ..h5io import create_collective
from ..runtime import get_logger

log = get_logger(__name__)


def verify_collectives(topo, n: int = 4099, seed: int = 0) -> dict[str, float]:
    """Compare hierarchical allreduce/allgather/bcast with flat MPI on this run's hierarchy.

    Integers must agree bit for bit, float64 sums within 1e-12 relative. Returns the largest
    float difference and timings. Raises ``AssertionError`` on a mismatch (on every rank: the
    comparison results are agreed with an allreduce). Collective over ``topo.world``.
    """
    rng = np.random.default_rng([seed, topo.rank])
    ints = rng.integers(-2**40, 2**40, size=n, dtype=np.int64)
    flts = rng.standard_normal(n)
    flat_i = ints.copy()
    topo.world.Allreduce(MPI.IN_PLACE, flat_i, op=MPI.SUM)
    flat_f = flts.copy()
    topo.world.Allreduce(MPI.IN_PLACE, flat_f, op=MPI.SUM)
    t0 = time.perf_counter()
    hier_i = topo.allreduce(ints.copy())
    hier_f = topo.allreduce(flts.copy())
    t_ar = time.perf_counter() - t0
    max_i = topo.allreduce(ints.copy(), op=MPI.MAX)
    flat_max = ints.copy()
    topo.world.Allreduce(MPI.IN_PLACE, flat_max, op=MPI.MAX)
    gathered = topo.allgather(ints[:7].copy())
    flat_g = np.empty_like(gathered)
    topo.world.Allgather(ints[:7].copy(), flat_g)
    root = topo.size - 1
    b = ints[:5].copy() if topo.rank == root else np.zeros(5, np.int64)
    topo.bcast(b, root=root)
    ref = np.empty(5, np.int64)
    if topo.rank == root:
        ref[:] = ints[:5]
    topo.world.Bcast(ref, root=root)
    rel = float(np.max(np.abs(hier_f - flat_f)) / max(1e-300, np.max(np.abs(flat_f))))
    ok = np.array([np.array_equal(hier_i, flat_i), np.array_equal(max_i, flat_max),
                   np.array_equal(gathered, flat_g), np.array_equal(b, ref), rel <= 1e-12],
                  dtype=np.int32)
    topo.world.Allreduce(MPI.IN_PLACE, ok, op=MPI.MIN)
    names = ["allreduce int64 sum", "allreduce int64 max", "allgather", "bcast",
             "allreduce float64 sum"]
    failed = [nm for nm, good in zip(names, ok) if not good]
    if failed:
        raise AssertionError(f"hierarchical collectives differ from flat MPI: {failed}")
    return {"float_rel_diff": rel, "allreduce_seconds": t_ar}


def run_topology_stage(ctx) -> dict:
    """Collective. Logs the hierarchy and the collectives check; writes topology.h5."""
    topo = ctx.topo
    log.info("%s", topo.describe())
    with ctx.timer.comm():
        check = verify_collectives(topo, seed=ctx.deck.run.seed)
    log.info("hierarchical collectives agree with flat MPI: integers bit for bit, float sums "
             "within %.1e relative (allreduce of 2 x %d values: %.2f ms)",
             check["float_rel_diff"], 4099, 1e3 * check["allreduce_seconds"])
    with create_collective(ctx.path("topology.h5"), topo.world, ctx.deck.to_toml(),
                           node_source=topo.node_source,
                           switch_source=topo.switch_source) as f:
        f.create_dataset("rank_node", data=topo.rank_node)
        f.create_dataset("node_switch", data=topo.node_switch)
        f.create_dataset("node_names", data=np.array(topo.node_names, dtype="S"))
    return {"ranks": topo.size, "nodes": topo.n_nodes, "switches": topo.n_switches,
            "collectives": "verified"}
