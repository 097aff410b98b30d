"""The SPMD pipeline driver: topology -> embed -> cluster -> place, each stage reading and
writing HDF5 in ``run.output_dir`` so any stage can be rerun alone."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

from mpi4py import MPI

from . import deck as deckmod
from . import preflight
from .backend import bind_gpu, device_module, set_threads
from .cluster.stage import run_cluster_stage
from .deck import Deck, DeckError
from .embed.stage import run_embed_stage
from .finetune.loop import hold_stop_signal
from .finetune.stage import run_finetune_stage
from .model.kernels import set_threads as split_forwards
from .outdir import OutputLock, check_writes
from .place.stage import run_place_stage
from .runtime import SemzoError, StageTimer, get_logger, together
from .topology import Topology, build_topology
from .topology.stage import run_topology_stage

log = get_logger(__name__)


@dataclass
class RunContext:
    """What every stage receives: the deck, the hierarchy, where to write, the clock."""

    deck: Deck
    topo: Topology
    outdir: Path
    timer: StageTimer
    xp: ModuleType
    threads: int = 1
    inputs: dict[str, Path] = field(default_factory=dict)
    lock: OutputLock | None = None
    # frozen-prefix states kept across the runs of one process (semzo.tasks.prefix_store;
    # set by `semzo experiment`, shared by every derived context)
    prefix_store: object | None = None

    def path(self, name: str) -> Path:
        """Where the file ``name`` of this run lives: ``outdir / name``, unless ``inputs``
        maps it elsewhere (`semzo experiment` shares one embeddings.h5 between runs)."""
        return Path(self.inputs[name]) if name in self.inputs else self.outdir / name

    def derive(self, deck: Deck, inputs: dict[str, str | Path] | None = None) -> RunContext:
        """A context for another deck (and its ``run.output_dir``) on the same topology, clock
        and backend; ``inputs`` maps file names (``"embeddings.h5"``) to paths outside the
        new folder. Collective (rank 0 creates the folder)."""
        ctx = RunContext(deck=deck, topo=self.topo, outdir=Path(deck.run.output_dir),
                         timer=self.timer, xp=self.xp, threads=self.threads,
                         inputs={k: Path(v) for k, v in (inputs or {}).items()},
                         prefix_store=self.prefix_store)
        prepare_outdir(ctx.outdir, deck, self.topo)
        return ctx


def load_deck_collective(path: str | None, overrides: list[str], comm: MPI.Intracomm, *,
                         check_inputs: bool = True, check_world: bool = True) -> Deck:
    """Load and validate the deck on every rank; if any rank fails, all raise the same error.

    Every rank reads the file itself (no broadcast of parsed objects); the outcome is agreed
    with one allgather so that a file visible on some ranks only cannot split the job.
    """
    deck, err = None, None
    try:
        deck = deckmod.load(path, overrides, check_inputs=check_inputs)
        if check_inputs:
            preflight.check_inputs(deck)
        if check_world:
            deckmod.check_world(deck, comm.Get_size())
    except DeckError as exc:
        err = str(exc)
    errors = comm.allgather(err)
    first = next((e for e in errors if e), None)
    if first is not None:
        raise DeckError(first)
    return deck


def _threads(deck: Deck, topo: Topology) -> int:
    """Threads per rank: ``run.threads``, else the cores this rank may run on divided by the
    ranks of its host whose CPU sets overlap its own. Ranks a launcher binds to disjoint
    cores (srun --cpu-bind, mpirun --map-by slot:PE=N) keep all their cores; unbound ranks
    sharing the host's cores split them. Collective over the world (one allgather)."""
    if deck.run.threads > 0:
        return deck.run.threads
    if hasattr(os, "sched_getaffinity"):
        mask = sorted(os.sched_getaffinity(0))
    else:
        mask = list(range(os.cpu_count() or 1))
    # simulated nodes share one host: compare with every rank of the same host
    host = topo.node_names[topo.node_id].split("/")[0]
    masks = topo.world.allgather((host, mask))
    mine = set(mask)
    sharers = sum(1 for h, m in masks if h == host and mine.intersection(m))
    return max(1, len(mask) // max(sharers, 1))


def prepare_outdir(outdir: Path, deck: Deck, topo: Topology) -> None:
    """Rank 0 creates ``outdir`` and checks it is writable; every rank raises the same
    DeckError if not. Collective over the world."""
    err = None
    if topo.rank == 0:
        try:
            outdir.mkdir(parents=True, exist_ok=True)
            probe = outdir / ".semzo-write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            err = f"{deck.source}: run.output_dir: cannot write to {outdir}: {exc.strerror}"
    err = topo.world.bcast(err, root=0)
    if err:
        raise DeckError(err)


def _bind_gpu(deck: Deck, local: int) -> int:
    """:func:`semzo.backend.bind_gpu`, its failure (no CuPy, no device) as the deck's one-line
    error: every rank exits 2 together (``together``), no traceback, no MPI abort."""
    try:
        return bind_gpu(local)
    except RuntimeError as exc:
        raise SemzoError(f"{deck.source}: {exc}") from None


def start(deck: Deck, comm: MPI.Intracomm, timer: StageTimer, *,
          experiment: bool = False) -> RunContext:
    """Build the topology (timed as the ``topology`` stage's first part), set threads, bind
    the GPU, create the output folder, lock it (:class:`semzo.outdir.OutputLock`, held until
    ``ctx.lock.release()`` or the process ends) and check every other folder the run will
    write (:func:`semzo.outdir.check_writes`; ``experiment``: the folders of `semzo
    experiment`), all before any work. Collective over ``comm``."""
    with timer.stage("topology"):
        topo = build_topology(comm, deck.topology, src=deck.source)
    threads = set_threads(_threads(deck, topo))
    split_forwards(threads)     # CPU forward passes: each batch in `threads` row blocks
    if deck.run.device == "gpu":
        # the physical node's local rank: a deck-simulated hierarchy (topology.ranks_per_node)
        # groups ranks into pretend nodes, which must not decide which real GPU a rank takes
        shm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        local = shm.Get_rank()
        shm.Free()
        dev = together(topo.allreduce, _bind_gpu, deck, local)
        log.info("rank %d bound to GPU %d (rank %d on its physical node)", topo.rank, dev, local)
    outdir = Path(deck.run.output_dir)
    prepare_outdir(outdir, deck, topo)
    lock = OutputLock.acquire(outdir, deck, topo.world)
    try:
        check_writes(deck, topo.world, experiment=experiment)
    except DeckError:
        lock.release()
        raise
    return RunContext(deck=deck, topo=topo, outdir=outdir, timer=timer,
                      xp=device_module(deck.run.device), threads=threads, lock=lock)


def run_stage(ctx: RunContext, name: str, label: str | None = None) -> dict:
    """Run one stage, timed under ``label`` (default: its name). Collective."""
    with ctx.timer.stage(label or name):
        return _stage_function(name)(ctx) or {}


def run(deck: Deck, comm: MPI.Intracomm) -> dict[str, float]:
    """Run the deck's stages. Collective over ``comm``. Returns stage wall times."""
    timer = StageTimer()
    t0 = time.perf_counter()
    ctx = start(deck, comm, timer)
    topo = ctx.topo
    log.info("semzo run: deck %s, %d ranks, %d threads per rank, device %s, output %s",
             deck.source, topo.size, ctx.threads, deck.run.device, ctx.outdir)
    summary: dict[str, dict] = {}
    if "finetune" in deck.run.stages:
        hold_stop_signal()      # SIGUSR1 before training: remembered, not fatal
    with ctx.lock:
        for name in deck.run.stages:
            summary[name] = run_stage(ctx, name)
        topo.world.Barrier()
    log.info("stage times (rank 0), total %.2f s:\n%s", time.perf_counter() - t0, timer.table())
    log.info("summary of %s:\n%s", ctx.outdir, format_summary(summary))
    topo.free()
    return dict(timer.wall)


# Where each stage lives: one module per stage.
STAGE_FUNCTIONS = {
    "topology": run_topology_stage,
    "embed": run_embed_stage,
    "cluster": run_cluster_stage,
    "place": run_place_stage,
    "finetune": run_finetune_stage,
}


def format_summary(summary: dict[str, dict]) -> str:
    """One line per stage: its headline figures (each stage returns a dict of them)."""
    lines = []
    for stage, figs in summary.items():
        parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in figs.items()]
        lines.append(f"  {stage:<10} " + ", ".join(parts))
    return "\n".join(lines)


def _stage_function(name: str):
    return STAGE_FUNCTIONS[name]
