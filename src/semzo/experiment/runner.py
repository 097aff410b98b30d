"""`semzo experiment DECK`: does semantic sharding help ZO fine-tuning?

One SPMD job runs, in ``run.output_dir`` (``OUT``)::

    topology, embed, cluster                    once         OUT/{topology,embeddings,clusters}.h5
    place                                        per sharding OUT/<sharding>/shards.h5, shards.png
    finetune                                     per (sharding, mode, seed)
                                                 OUT/<sharding>/<mode>/seed<s>/metrics.csv, ...
    report (rank 0)                              OUT/report.md, accuracy.png, loss.png, time.png,
                                                 experiment.h5

Every configuration gets the deck's settings with only ``place.mode``, ``zo.mode`` and
``run.seed`` changed, and the same budget: exactly ``train.steps`` steps (``train.max_epochs``
is ignored; a deck whose ``run.stages`` is not every stage is refused, exit 2), i.e.
``2 x ranks x steps`` forward passes of ``train.batch_size`` texts with the mezo estimator.
The fzoo estimator (the default with ``zo.lr = "auto"``) evaluates 1 + N losses per rank per
step in data mode and spreads its N directions over the seed groups in the other modes
(1 + ceil(N / groups) per rank per step): ``train.steps`` is then the data mode's steps and
every other mode runs the steps that give the same forward passes per rank
(:func:`semzo.experiment.analysis.mode_steps`, logged and recorded in ``experiment.toml``), so
every mode and sharding sees the same number of forward passes. Held-out evaluations are spaced so
that the report's budgets fall on them. ``timings.csv`` records the wall time of every stage of
every configuration as it finishes (rank 0); ``--report-only`` rebuilds the report from the
``metrics.csv`` files and ``timings.csv`` without MPI work; ``--resume`` skips what an
earlier, interrupted run of the same deck in the same folder completed.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from mpi4py import MPI

from ..deck import STAGES, Deck
from ..deck.read import label_rows_mode, label_rows_warmup
from ..finetune.autolr import guard_window
from ..finetune.loop import schedule_name
from ..pipeline import RunContext, run_stage, start
from ..runtime import SemzoError, StageTimer, get_logger
from ..tasks.prefix_store import PrefixStore
from .analysis import TIMINGS, mode_steps, passes_per_step
from .report import write_report
from .tasks import run_tasks

log = get_logger(__name__)

EVAL_POINTS = 40          # about this many held-out evaluations per configuration
TIMING_COLUMNS = ("sharding", "mode", "seed", "stage", "wall_s", "comm_s")


def eval_every(steps: int, report_points: int, points: int = EVAL_POINTS) -> int:
    """Steps between held-out evaluations: a divisor of ``steps / report_points`` when that is
    whole (so every report budget is an evaluation), giving about ``points`` evaluations
    (``experiment.eval_points``)."""
    if steps <= 0:
        return 0
    if steps % report_points == 0:
        seg = steps // report_points
        per = max(1, round(points / report_points))
        for n in range(per, seg + 1):          # smallest split of a segment at least `per`
            if seg % n == 0:
                return seg // n
        return 1
    return max(1, steps // points)


def config_deck(deck: Deck, sharding: str, mode: str | None, seed_index: int,
                steps: int | None = None, lr: float | None = None) -> Deck:
    """The deck of one configuration: the base deck with the sharding, mode and seed set,
    ``steps`` steps (default ``train.steps``), a folder of its own, no model.h5, checkpoints
    at the end only, no resume. ``lr``: the shared scan's step for a deck with ``zo.lr =
    "auto"`` (its schedule and loss guard resolved as lr auto resolves them)."""
    base = Path(deck.run.output_dir)
    out = base / sharding if mode is None else base / sharding / mode / f"seed{seed_index}"
    e = deck.experiment
    steps = deck.train.steps if steps is None else int(steps)
    zo = dataclasses.replace(deck.zo, mode=mode or deck.zo.mode)
    # the label rows as the base deck resolves them (a shared lr below would turn "auto" into
    # frozen), their warm-up the same number of steps in every mode (analysis.mode_steps)
    train = dataclasses.replace(deck.train, label_rows=label_rows_mode(deck),
                                label_rows_warmup=label_rows_warmup(deck, deck.train.steps))
    if lr is not None and deck.zo.lr == "auto":      # the shared scan's lr, as lr auto runs it
        # (a number in zo.lr would turn estimator and dist "auto" into MeZO and Gaussian z:
        # the scan measured the lr auto estimator's step, so that estimator runs)
        zo = dataclasses.replace(zo, lr=float(lr), estimator=deck.zo.estimator_name,
                                 dist=deck.zo.dist_name, lr_guard=(
            guard_window("auto", steps) if deck.zo.lr_guard == "auto" else deck.zo.lr_guard),
            lr_rollback=deck.zo.lr_rollback_value)
        train = dataclasses.replace(train, schedule=schedule_name(deck))
    return deck.replace(
        run=dataclasses.replace(deck.run, output_dir=str(out), seed=deck.run.seed + seed_index),
        place=dataclasses.replace(deck.place, mode=sharding),
        zo=zo,
        train=dataclasses.replace(train, steps=steps, max_epochs=0.0, save="none",
                                  split_seed=(deck.train.split_seed if deck.train.split_seed >= 0
                                              else deck.run.seed),
                                  eval_every=eval_every(steps, e.report_points,
                                                         e.eval_points)),
        checkpoint=dataclasses.replace(deck.checkpoint, every_steps=0, resume="never", dir=""),
    )


SHARED_LR = "shared_lr.json"
SCAN_FRACTION = 0.5        # the shared scan's budget: room for autolr.MAX_DIRECTIONS searches


def shared_lr(deck: Deck, ctx: RunContext, inputs: dict, steps: dict[str, int],
              timings: _Timings, done: bool) -> float | None:
    """``experiment.shared_lr`` with ``zo.lr = "auto"``: the step-size scan once, in
    ``OUT/lr-scan/`` (the first sharding's placement, ``run.seed``, data mode, the data mode's
    steps with ``zo.lr_scan_fraction`` = :data:`SCAN_FRACTION`: as many line searches as
    :mod:`semzo.finetune.autolr` takes, their median), its lr stored in ``OUT/shared_lr.json``
    and returned; None when the deck does not ask for it. ``done``: an earlier run of this
    experiment stored it (resume). Collective over the world."""
    if deck.zo.lr != "auto" or not deck.experiment.shared_lr:
        return None
    topo, path = ctx.topo, ctx.outdir / SHARED_LR
    if done:
        lr = json.loads(path.read_text(encoding="utf-8"))["lr"] if topo.rank == 0 else None
        lr = topo.world.bcast(lr, root=0)
        log.info("experiment: the shared step size lr %.3e kept from the earlier run", lr)
        return float(lr)
    mode = "data" if "data" in deck.experiment.modes else deck.experiment.modes[0]
    d = config_deck(deck, deck.experiment.shardings[0], mode, 0, steps[mode])
    d = d.replace(run=dataclasses.replace(d.run, output_dir=str(Path(deck.run.output_dir) /
                                                                "lr-scan")),
                  zo=dataclasses.replace(d.zo, lr_scan_fraction=SCAN_FRACTION),
                  train=dataclasses.replace(d.train, eval_every=0))
    log.info("experiment: zo.lr = \"auto\", experiment.shared_lr: one scan for every "
             "configuration (%s sharding, %s mode, seed %d) in %s", d.place.mode, mode,
             d.run.seed, d.run.output_dir)
    fig = run_stage(ctx.derive(d, inputs), "finetune", "lr scan")
    timings.add(ctx.timer, "lr scan", "-", "-", "-", "lr-scan")
    lr = float(fig["lr"])
    if topo.rank == 0:
        path.write_text(json.dumps({"lr": lr}) + "\n", encoding="utf-8")
    log.info("experiment: every configuration runs at lr %.3e (the shared scan's), %s "
             "schedule, loss guard as lr auto", lr, schedule_name(deck))
    return lr


class _Timings:
    """Rank 0 appends one row per finished stage to ``OUT/timings.csv``; ``keep`` rows of an
    earlier run (stages this run skips) are written first."""

    def __init__(self, path: Path, active: bool, keep: list[list[str]] = ()) -> None:
        self.path, self.active = path, active
        if active:
            with open(path, "w", newline="", encoding="utf-8") as f:
                w = csv.writer(f)
                w.writerow(TIMING_COLUMNS)
                w.writerows(keep)

    def add(self, timer: StageTimer, label: str, sharding: str, mode: str, seed: int | str,
            stage: str) -> None:
        if not self.active:
            return
        with open(self.path, "a", newline="", encoding="utf-8") as f:
            csv.writer(f).writerow([sharding, mode, seed, stage, repr(timer.wall.get(label, 0.0)),
                                    repr(timer.comm_time.get(label, 0.0))])


def _strip_comments(toml: str) -> str:
    return "\n".join(ln for ln in toml.splitlines() if not ln.startswith("#")).strip()


def _complete(metrics: Path, steps: int) -> bool:
    """metrics.csv holds the held-out evaluation after the last step."""
    try:
        with open(metrics, newline="", encoding="utf-8") as f:
            return any(r["kind"] == "eval" and r["step"] == str(steps)
                       for r in csv.DictReader(f))
    except (OSError, KeyError, csv.Error):
        return False


def groups_of(mode: str, ranks: int, nodes: int) -> int:
    """Seed groups of a ZO mode (as :class:`semzo.zo.engine.ZOEngine` forms them)."""
    return {"data": 1, "perturbation": ranks}.get(mode, nodes)


def steps_by_mode(deck: Deck, ranks: int, nodes: int) -> dict[str, int]:
    """Each mode of ``experiment.modes``: its steps at the experiment's budget."""
    return {m: mode_steps(deck, groups_of(m, ranks, nodes)) for m in deck.experiment.modes}


def finished_stages(deck: Deck, base: Path, steps: dict[str, int] | None = None
                    ) -> tuple[set[tuple], list[list[str]], str | None]:
    """What an earlier run of the same experiment in ``base`` completed (rank 0, no MPI).

    Returns ``(keys, rows, error)``: keys ``(sharding, mode, seed, stage)`` of timings.csv
    rows whose outputs are present and complete, in dependency order (a stage counts only if
    the stages it reads count too); the timings rows to keep; an error when ``base`` holds an
    experiment of another deck."""
    stored = base / "experiment.toml"
    if not stored.is_file() or not (base / TIMINGS).is_file():
        return set(), [], None
    if _strip_comments(stored.read_text(encoding="utf-8")) != _strip_comments(deck.to_toml()):
        return set(), [], (f"{deck.source}: run.output_dir: {base} holds an experiment of "
                           f"another deck (see {stored}); resume with that deck, or use "
                           f"another run.output_dir")
    with open(base / TIMINGS, newline="", encoding="utf-8") as f:
        rows = [r for r in csv.reader(f)][1:]
    listed = {tuple(r[:4]) for r in rows if len(r) == len(TIMING_COLUMNS)}
    keys: set[tuple] = set()
    e = deck.experiment
    if ("-", "-", "-", "embed") in listed and (base / "embeddings.h5").is_file():
        keys.add(("-", "-", "-", "embed"))
        if ("-", "-", "-", "cluster") in listed and (base / "clusters.h5").is_file():
            keys.add(("-", "-", "-", "cluster"))
            scan = ("-", "-", "-", "lr-scan")
            shared = deck.zo.lr == "auto" and e.shared_lr
            for sh in e.shardings:
                if (sh, "-", "-", "place") not in listed or \
                        not (base / sh / "shards.h5").is_file():
                    break             # the shared scan reads the first sharding's placement
                keys.add((sh, "-", "-", "place"))
                if shared and sh == e.shardings[0] and scan in listed and \
                        (base / SHARED_LR).is_file():
                    keys.add(scan)
                if shared and scan not in keys:
                    break             # every configuration ran at the scan's lr
                for m in e.modes:
                    for i in range(e.seeds):
                        k = (sh, m, str(i), "finetune")
                        if k in listed and _complete(
                                base / sh / m / f"seed{i}" / "metrics.csv",
                                (steps or {}).get(m, deck.train.steps)):
                            keys.add(k)
    return keys, [r for r in rows if tuple(r[:4]) in keys], None


def deck_error(deck: Deck) -> str | None:
    """Why ``deck`` cannot run as one experiment (one line naming the key), or None."""
    e = deck.experiment
    msg = None
    if deck.train.steps < e.report_points:
        msg = (f"{deck.source}: train.steps: the experiment needs at least "
               f"experiment.report_points = {e.report_points} steps, got {deck.train.steps}")
    elif tuple(deck.run.stages) != STAGES:
        msg = (f"{deck.source}: run.stages: `semzo experiment` runs every stage (topology, "
               f"embed and cluster once, place per sharding, finetune per configuration), got "
               f"{list(deck.run.stages)}; leave run.stages out of the deck (`--resume` keeps "
               f"what an interrupted experiment finished) or use `semzo run`")
    return msg


def run_experiment(deck: Deck, comm: MPI.Intracomm, resume: bool = False) -> Path:
    """The whole experiment. Collective over ``comm``. Returns the report's path.

    ``resume``: skip the stages and configurations that an earlier run of the same deck in
    ``run.output_dir`` completed (see :func:`finished_stages`); the report includes them with
    their recorded times. The output folder is locked for the whole run (exit 2 at once if
    another run holds it; see :mod:`semzo.outdir`)."""
    e = deck.experiment
    if e.decks:
        return run_tasks(deck, comm, resume, run_experiment, deck_error)
    msg = deck_error(deck)
    if msg:
        err = SemzoError(msg)
        err.all_ranks = True
        raise err
    timer = StageTimer()
    t0 = time.perf_counter()
    ctx = start(deck, comm, timer, experiment=True)
    # the frozen-prefix states of the LLM tasks depend on the model and the tokens only: one
    # store for every configuration of this job (semzo.tasks.prefix_store)
    ctx.prefix_store = PrefixStore(ctx.topo.world, deck.train.prefix_cache_mb * 2**20)
    with ctx.lock:                      # the output folder is this run's until it ends
        return _run_experiment(deck, ctx, resume, t0)


def _run_experiment(deck: Deck, ctx: RunContext, resume: bool, t0: float) -> Path:

    e, timer = deck.experiment, ctx.timer
    topo = ctx.topo
    base = ctx.outdir
    n_cfg = len(e.shardings) * len(e.modes) * e.seeds
    steps = steps_by_mode(deck, topo.size, topo.n_nodes)
    log.info("semzo experiment: %d ranks; shardings %s x ZO modes %s x %d seeds = %d "
             "fine-tuning runs of %d forward passes each (%s), output %s",
             topo.size, ", ".join(e.shardings), ", ".join(e.modes), e.seeds, n_cfg,
             passes_per_step(deck) * topo.size * deck.train.steps,
             "; ".join(f"{m} mode: {n} steps x {passes_per_step(deck, groups_of(m, topo.size, topo.n_nodes))} "
                       f"passes per rank" for m, n in steps.items()), base)
    short = [m for m, n in steps.items() if n < e.report_points]
    if short:
        err = SemzoError(f"{deck.source}: train.steps: {short[0]} mode gets {steps[short[0]]} "
                         f"steps at this budget, fewer than experiment.report_points = "
                         f"{e.report_points}; raise train.steps")
        err.all_ranks = True
        raise err
    done_keys, keep, err = set(), [], None
    if resume and topo.rank == 0:
        done_keys, keep, err = finished_stages(deck, base, steps)
    done_keys, keep, err = topo.world.bcast((done_keys, keep, err), root=0)
    if err:
        exc = SemzoError(err)
        exc.all_ranks = True
        raise exc
    if resume:
        n_ft = sum(1 for k in done_keys if k[3] == "finetune")
        log.info("experiment: resuming in %s: %d of %d configurations and %d earlier stages "
                 "are complete and kept", base, n_ft, n_cfg, len(done_keys) - n_ft)
    if topo.rank == 0:
        cmd = f"mpirun -n {topo.size} python -m semzo {shlex.join(sys.argv[1:])}"
        if os.environ.get("SEMZO_COMMAND"):            # set by `make experiment`
            cmd = f"{os.environ['SEMZO_COMMAND']}  # = {cmd}"
        (base / "experiment.toml").write_text(
            f"# command: {cmd}\n# cores: {os.cpu_count()}\n" +
            "".join(f"# steps: {m} {n}\n" for m, n in steps.items()) + deck.to_toml(),
            encoding="utf-8")
    timings = _Timings(base / TIMINGS, topo.rank == 0, keep)
    timings.add(timer, "topology", "-", "-", "-", "topology")
    # shared stages: the topology stage checks the communicators, embed and cluster run once
    for name in ("topology", "embed", "cluster"):
        if ("-", "-", "-", name) in done_keys:
            log.info("experiment: %s kept from the earlier run", name)
            continue
        label = name if name != "topology" else "topology check"
        run_stage(ctx, name, label)
        timings.add(timer, label, "-", "-", "-", name)
    shared = {"embeddings.h5": ctx.path("embeddings.h5"),
              "clusters.h5": ctx.path("clusters.h5")}
    done, lr = 0, None
    for sharding in e.shardings:
        sctx: RunContext = ctx.derive(config_deck(deck, sharding, None, 0), shared)
        label = f"place {sharding}"
        if (sharding, "-", "-", "place") not in done_keys:
            run_stage(sctx, "place", label)
            timings.add(timer, label, sharding, "-", "-", "place")
        inputs = {**shared, "shards.h5": sctx.path("shards.h5")}
        if sharding == e.shardings[0]:
            lr = shared_lr(deck, ctx, inputs, steps, timings,
                           ("-", "-", "-", "lr-scan") in done_keys)
        for mode in e.modes:
            for s in range(e.seeds):
                done += 1
                if (sharding, mode, str(s), "finetune") in done_keys:
                    continue
                fctx = ctx.derive(config_deck(deck, sharding, mode, s, steps[mode], lr),
                                  inputs)
                label = f"finetune {sharding} {mode} {s}"
                fig = run_stage(fctx, "finetune", label)
                timings.add(timer, label, sharding, mode, s, "finetune")
                elapsed = time.perf_counter() - t0
                log.info("experiment: %d/%d done (%s sharding, %s mode, seed %d): held-out "
                         "accuracy %.4f -> %.4f; %.0f s so far", done, n_cfg, sharding, mode,
                         fctx.deck.run.seed, fig.get("heldout acc before", math.nan),
                         fig.get("heldout acc after", math.nan), elapsed)
    st = ctx.prefix_store
    if st.computed or st.hits:
        log.info("experiment: frozen-prefix cache: %d sequences computed in %.1f s (rank 0), "
                 "%d reused by later configurations", st.computed, st.seconds, st.hits)
    topo.world.Barrier()
    report = base / "report.md"
    if topo.rank == 0:
        write_report(base)
    topo.world.Barrier()
    log.info("experiment done in %.1f s: %s", time.perf_counter() - t0, report)
    topo.free()
    return report
