"""Fine-tuning outputs of rank 0: ``metrics.csv`` and PNG plots of loss and accuracy.

``metrics.csv`` columns: ``kind`` (``train`` or ``eval``), ``step``, ``loss`` (mean of L+ and
L- over the global batch), ``g`` (projected gradient), ``lr``, ``compute_s`` and ``comm_s``
(rank 0's time in forward/parameter passes and in the exchange collectives), ``skipped``
(1 for a NaN/Inf step), ``heldout_loss``, ``heldout_acc``, ``heldout_n`` (eval rows; step 0 is
the model before training), ``sigma`` (``zo.estimator = "fzoo"``: the spread of the step's loss
differences the update was divided by), ``forwards`` (rank 0's forward passes of ZO steps so
far, the ``zo.lr = "auto"`` scan included), and on eval rows the run's use so far
(:mod:`semzo.energy`), summed over ranks and machines: ``energy_j`` (joules of every meter
that is measured), ``cpu_energy_j`` (RAPL, CPU packages), ``gpu_energy_j`` (NVML), each empty
where it is not measured (never an estimate), and ``core_s`` (CPU core-seconds of all ranks,
always). Empty cells are fields a row does not have. Readers take a file of an older release
(fewer columns at the end) as having those cells empty.

While the stage runs the rows go to ``metrics.csv.tmp`` (follow progress there); only when the
stage has finished (``model.h5`` saved) do the plots and ``metrics.csv`` take their final
names, so a run that fails leaves the previous run's ``metrics.csv``, plots and ``model.h5``
together, plus the failed run's rows in ``metrics.csv.tmp``.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path

import numpy as np

from ..energy import EnergyMeter, Reading, powercap_root

COLUMNS = ("kind", "step", "loss", "g", "lr", "compute_s", "comm_s", "skipped",
           "heldout_loss", "heldout_acc", "heldout_n", "sigma", "forwards", "elapsed_s",
           "samples_per_s", "tokens_per_s", "heldout_ppl", "energy_j", "cpu_energy_j",
           "gpu_energy_j", "core_s", "val_loss", "val_acc", "val_n")


class Metrics:
    """Collects rows; rank 0 appends them to ``metrics.csv.tmp`` (flushed every
    ``flush_every`` rows), and :meth:`finish` draws the plots and renames it to
    ``metrics.csv``. Other ranks keep nothing."""

    def __init__(self, outdir: str | Path, active: bool, flush_every: int = 50,
                 keep_until: int | None = None) -> None:
        self.active = active
        self.path = Path(outdir) / "metrics.csv"
        self.tmp = self.path.with_name(self.path.name + ".tmp")    # the run in progress
        self.rows: list[dict] = []
        self._pending: list[dict] = []
        self.flush_every = flush_every
        if not active:
            return
        # a resumed run (``keep_until``: the checkpoint's step) continues the curve: the rows
        # the earlier run wrote up to that step (from metrics.csv.tmp, or metrics.csv when it
        # finished), so a requeued job keeps its history
        kept = _read_rows(self.tmp if self.tmp.is_file() else self.path,
                          keep_until) if keep_until is not None else []
        with open(self.tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(COLUMNS)
            for r in kept:
                w.writerow([r.get(c, "") for c in COLUMNS])
        self.rows = [{c: _parse(r.get(c, "")) for c in COLUMNS} for r in kept]

    def add(self, row: dict) -> None:
        if not self.active:
            return
        self.rows.append(row)
        self._pending.append(row)
        if len(self._pending) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.active or not self._pending:
            return
        with open(self.tmp, "a", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            for r in self._pending:
                w.writerow([_fmt(r.get(c)) for c in COLUMNS])
        self._pending = []

    def finish(self, title: str = "") -> list[Path]:
        """The run succeeded: write loss.png and accuracy.png next to metrics.csv, then
        rename ``metrics.csv.tmp`` to ``metrics.csv`` (each file appears whole). Returns the
        paths written."""
        if not self.active:
            return []
        self.flush()
        paths = plot_metrics(self.rows, self.path.parent, title)
        os.replace(self.tmp, self.path)
        return [self.path, *paths]


def _read_rows(path: Path, until: int) -> list[dict]:
    """The rows of a metrics file (as text) that a checkpoint at step ``until`` (the next step
    to run) covers: training rows of steps ``< until`` (a row's step is the step it ran), other
    rows (evaluations after ``step`` steps) ``<= until``; [] when the file is missing or has
    another header (an older release's header, a first part of today's, is read: the
    columns it lacks are empty)."""
    try:
        with open(path, newline="", encoding="utf-8") as f:
            r = csv.DictReader(f)
            head = tuple(r.fieldnames or ())
            if not head or head != COLUMNS[:len(head)]:
                return []
            return [row for row in r if row.get("step", "").isdigit() and
                    (int(row["step"]) < until if row.get("kind") == "train"
                     else int(row["step"]) <= until)]
    except OSError:
        return []


def _parse(v: str):
    """A metrics cell back as a number where it is one ("" -> None)."""
    if v == "":
        return None
    try:
        return int(v)
    except ValueError:
        try:
            return float(v)
        except ValueError:
            return v


def _fmt(v) -> str:
    if v is None:
        return ""
    if isinstance(v, (float, np.floating)):
        return "nan" if math.isnan(v) else repr(float(v))
    if isinstance(v, np.integer):
        return str(int(v))
    return str(v)


def _smooth(y: list[float], k: int) -> list[float]:
    out, acc, q = [], 0.0, []
    for v in y:
        q.append(v)
        acc += v
        if len(q) > k:
            acc -= q.pop(0)
        out.append(acc / len(q))
    return out


def _save(fig, path: Path) -> Path:
    """Save ``fig`` as PNG under ``path`` whole: written to ``path.tmp``, then renamed."""
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=100, format="png")
    os.replace(tmp, path)
    return path


def plot_metrics(rows: list[dict], outdir: Path, title: str = "") -> list[Path]:
    """loss.png (training loss, smoothed, and held-out loss) and accuracy.png (held-out
    accuracy) from metrics rows."""
    import matplotlib  # heavy (a second), rank 0 only

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    tr = [r for r in rows if r["kind"] == "train" and not r.get("skipped")
          and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    ev = [r for r in rows if r["kind"] == "eval"]
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    if tr:
        xs = [r["step"] for r in tr]
        ys = [r["loss"] for r in tr]
        k = len(ys) // 20                      # a running mean only where it averages
        ax.plot(xs, ys, color="0.7" if k >= 2 else "C0", lw=0.8 if k >= 2 else 1.2,
                marker="" if len(ys) > 60 else ".", label="training loss (global batch)")
        if k >= 2:
            ax.plot(xs, _smooth(ys, k), color="C0", lw=1.5,
                    label=f"training loss, running mean of {k} steps")
    if ev:
        ax.plot([r["step"] for r in ev], [r["heldout_loss"] for r in ev], "o-", color="C3",
                label="held-out loss")
    _plot_val(ax, ev, "val_loss", "validation loss", "C1")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("loss")
    ax.set_title(f"semzo ZO fine-tuning: loss {title}".strip())
    ax.legend()
    paths.append(_save(fig, outdir / "loss.png"))
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    if ev:
        ax.plot([r["step"] for r in ev], [r["heldout_acc"] for r in ev], "o-", color="C2",
                label="held-out accuracy")
    _plot_val(ax, ev, "val_acc", "validation accuracy (decides the best model)", "C1")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("accuracy")
    ax.set_ylim(-0.02, 1.02)                    # an accuracy lies in [0, 1]
    ax.set_yticks([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_title(f"semzo ZO fine-tuning: held-out accuracy {title}".strip())
    ax.legend()
    paths.append(_save(fig, outdir / "accuracy.png"))
    plt.close(fig)
    return paths


def _plot_val(ax, ev: list[dict], key: str, label: str, color: str) -> None:
    """The validation split's curve (train.val_fraction), where the rows have it."""
    pts = [(r["step"], r[key]) for r in ev if isinstance(r.get(key), (int, float))]
    if pts:
        ax.plot(*zip(*pts, strict=True), "s--", color=color, ms=4, label=label)


def energy_meter(ctx, metrics: Metrics) -> EnergyMeter:
    """The run's :class:`~semzo.energy.EnergyMeter` (RAPL; NVML on GPU runs, this rank's GPU
    by PCI bus id). A resumed run continues from the last use its kept rows recorded (rank 0
    has them; broadcast). Collective."""
    topo = ctx.topo
    gpu = None
    if ctx.deck.run.device == "gpu":
        gpu = str(ctx.xp.cuda.Device().pci_bus_id)
    meter = EnergyMeter(topo, gpu=gpu, powercap=powercap_root(),
                        gpu_run=ctx.deck.run.device == "gpu")
    last = None
    if topo.rank == 0:
        done = [r for r in metrics.rows if r.get("core_s") is not None]
        if done:
            r = done[-1]
            last = (r.get("cpu_energy_j"), r.get("gpu_energy_j"), float(r["core_s"]))
    last = topo.world.bcast(last, root=0)
    if last is not None:
        meter.offset = Reading(*last)
    return meter


def metered(add, meter: EnergyMeter):
    """``add`` (Metrics.add) with the energy so far on eval rows (a collective read: every
    rank passes every eval row, at the same steps) and a local poll of the counters on the
    others (the RAPL counters wrap within minutes at full power)."""

    def add_row(row: dict) -> None:
        if row.get("kind") == "eval":
            row = {**row, **meter.read().row()}
        else:
            meter.poll()
        add(row)
    return add_row
