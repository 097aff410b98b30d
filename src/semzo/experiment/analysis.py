"""The experiment's figures (rank 0, no MPI): read a run folder written by :mod:`.runner`
and compute what the report tabulates.

Definitions (also stated in the report):

* forward passes: ``passes x ranks x step`` with ``passes`` = 2 for the mezo estimator, 1 + N
  for fzoo in data mode (each step every rank evaluates the loss that many times on its own
  batch of ``train.batch_size`` texts); every configuration gets the same budget. fzoo spreads
  its N directions over the seed groups of the other modes (1 + ceil(N / groups) passes per
  rank per step), so there ``train.steps`` (the data mode's steps) is scaled to the same
  forward passes per rank (:func:`mode_steps`) and each run's evaluation steps are read in
  data-mode steps (``step x train.steps / the mode's steps``).
* held-out accuracy / loss at a budget: the held-out evaluation at that step (linear
  interpolation between the two nearest evaluations when the budget falls between them);
  mean, sample standard deviation and min..max over seeds.
* forward passes to the target loss: first crossing of the held-out loss curve below the target
  (linear interpolation between evaluations), per seed; "not reached" seeds are counted.
* energy to the target loss: the run's joules so far (``energy_j`` of metrics.csv: RAPL and
  NVML summed over machines, :mod:`semzo.energy`) at that crossing, interpolated between the
  evaluations around it like the step; CPU core-seconds (``core_s``, always recorded) alike.
  Where a run's machine exposed no meter the joules are not measured (nan, "not measured" in
  the report): never estimated from core-seconds.
* paired differences: configurations with the same seed share the held-out split, the initial
  head and the ZO seeds' schedule, so sharding A - sharding B is taken per seed; a paired
  t-test (scipy: two-sided one-sample t-test of the differences against 0) gives the p-value,
  per mode and pooled over modes alike (:func:`paired_p`). Degenerate cases, one definition
  everywhere: non-finite differences are dropped; the p-value is *not defined* (nan, "n.d."
  in the report, left out of the Holm family) with fewer than 2 differences (one seed, all
  nan) or zero sample variance (every difference equal within 1e-9 of the largest, zero
  included: the t statistic is 0/0 or infinite, and identical differences of a discrete
  accuracy say nothing about the seed-to-seed noise).
* clustering overhead: (embed + k-means + placement with redistribution) / the configuration's
  whole run (topology + those + fine-tuning); communication share: rank 0's time in the ZO
  exchange collectives over its time in the steps (compute + exchange).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from ..deck import from_toml_text
from ..deck.read import label_rows_warmup

#: the per-run stage times of an experiment, one row per run (written by :mod:`.runner`)
TIMINGS = "timings.csv"


@dataclass
class Run:
    """One configuration and seed: its held-out curve and step times."""

    sharding: str
    mode: str
    seed: int
    steps: np.ndarray            # evaluation steps
    loss: np.ndarray             # held-out loss at those steps
    acc: np.ndarray              # held-out accuracy
    compute_s: float             # rank 0: sum over steps
    comm_s: float
    skipped: int
    n_steps: int
    wall_s: float = math.nan     # the finetune stage's wall time
    # use so far at the evaluation steps (nan: not measured, or a file of an older release)
    energy_j: np.ndarray = field(default_factory=lambda: np.zeros(0))
    core_s: np.ndarray = field(default_factory=lambda: np.zeros(0))


@dataclass
class Experiment:
    base: Path
    deck: object
    ranks: int
    runs: list[Run]
    shared: dict[str, float]                      # embed, cluster, topology: wall s
    place: dict[str, float]                       # sharding -> wall s
    budget: int = 0                               # steps
    command: str = ""                             # how the experiment was launched
    deck_path: str = ""                           # the deck it was launched with
    cores: int = 0                                # cores of rank 0's host (0: unknown)
    mode_steps: dict = field(default_factory=dict)  # mode -> its steps where not `budget`
    shared_lr: float = math.nan                   # the shared scan's lr (experiment.shared_lr)

    def group(self, sharding: str, mode: str) -> list[Run]:
        return [r for r in self.runs if r.sharding == sharding and r.mode == mode]

    def fp(self, steps):
        return passes_per_step(self.deck) * self.ranks * np.asarray(steps)


def passes_per_step(deck, groups: int = 1) -> int:
    """Forward passes per rank per step: 2 (mezo, every mode); fzoo: 1 + its directions per
    seed group (``groups`` = 1 in data mode, the ranks in perturbation mode, the nodes in
    hybrid mode; at least 2 directions in all, as :class:`semzo.zo.engine.ZOEngine` does)."""
    if deck.zo.estimator_name != "fzoo":
        return 2
    m = max(1, -(-int(deck.zo.directions) // max(int(groups), 1)))
    if m * groups < 2:
        m = 2
    return 1 + m


def mode_steps(deck, groups: int) -> int:
    """Steps of a configuration whose mode has ``groups`` seed groups: ``train.steps`` with the
    same passes per step as data mode (mezo, or fzoo with one group's directions unchanged),
    else the steps that give data mode's forward passes per rank, rounded to the nearest. The
    label rows' warm-up (``train.label_rows_warmup`` resolved for ``train.steps``: one pass a
    step in every mode) is the same number of steps in every mode (:func:`.runner.config_deck`
    pins it), so only the ZO steps after it are scaled."""
    p0, p = passes_per_step(deck, 1), passes_per_step(deck, groups)
    steps = deck.train.steps
    if p == p0:
        return steps
    w = label_rows_warmup(deck, steps)
    return max(1, w + round((steps - w) * p0 / p))


def data_steps(steps: np.ndarray, n: int, deck) -> np.ndarray:
    """Steps of a run of ``n`` steps (another mode's, :func:`mode_steps`) as data-mode steps of
    the same forward passes: the label rows' warm-up (its w steps, one pass each in every
    mode) maps to itself, the ZO steps after it scale by (train.steps - w) / (n - w)."""
    total = deck.train.steps
    w = min(label_rows_warmup(deck, total), n)
    s = np.asarray(steps, np.float64)
    if n <= w:
        return s
    return np.where(s <= w, s, w + (s - w) * ((total - w) / (n - w)))


def _float(s: str) -> float:
    return float(s) if s not in ("", None) else math.nan


def read_metrics(path: Path) -> dict:
    """Eval curve and step-time sums of one metrics.csv (see semzo.finetune.report)."""
    ev, comp, comm, skipped, n = [], 0.0, 0.0, 0, 0
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["kind"] == "eval":
                ev.append((int(row["step"]), _float(row["heldout_loss"]),
                           _float(row["heldout_acc"]), _float(row.get("energy_j")),
                           _float(row.get("core_s"))))
            elif row["kind"] == "train":
                comp += _float(row["compute_s"])
                comm += _float(row["comm_s"])
                skipped += int(row["skipped"] or 0)
                n += 1
    ev.sort()
    a = np.array(ev, dtype=np.float64).reshape(-1, 5)
    return {"steps": a[:, 0].astype(np.int64), "loss": a[:, 1], "acc": a[:, 2],
            "energy_j": a[:, 3], "core_s": a[:, 4],
            "compute_s": comp, "comm_s": comm, "skipped": skipped, "n_steps": n}


def load(base: str | Path) -> Experiment:
    """Read an experiment folder. Raises FileNotFoundError naming a missing file."""

    base = Path(base)
    text = (base / "experiment.toml").read_text(encoding="utf-8")
    deck = from_toml_text(text, str(base / "experiment.toml"))
    head = dict(re.findall(r"^# (command|resolved semzo deck \(from) ?:? ?(.*?)\)?$", text,
                           flags=re.MULTILINE))
    command = head.get("command", "python -m semzo experiment DECK")
    cores = re.search(r"^# cores: (\d+)$", text, flags=re.MULTILINE)
    deck_path = head.get("resolved semzo deck (from", str(base / "experiment.toml"))
    steps_of = {m: int(n) for m, n in re.findall(r"^# steps: (\w+) (\d+)$", text,
                                                    flags=re.MULTILINE)}
    e = deck.experiment
    with h5py.File(base / e.shardings[0] / "shards.h5", "r") as f:
        ranks = int(f["rank_offsets"].shape[0]) - 1
    walls: dict[tuple, float] = {}
    with open(base / TIMINGS, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            walls[(row["sharding"], row["mode"], row["seed"], row["stage"])] = \
                walls.get((row["sharding"], row["mode"], row["seed"], row["stage"]), 0.0) + \
                float(row["wall_s"])
    shared = {st: walls.get(("-", "-", "-", st), math.nan)
              for st in ("topology", "embed", "cluster")}
    place = {s: walls.get((s, "-", "-", "place"), math.nan) for s in e.shardings}
    runs = []
    for s in e.shardings:
        for m in e.modes:
            for i in range(e.seeds):
                p = base / s / m / f"seed{i}" / "metrics.csv"
                if not p.is_file():
                    raise FileNotFoundError(f"{p}: missing (did the experiment finish?)")
                d = read_metrics(p)
                n = int(steps_of.get(m, deck.train.steps))
                if n != deck.train.steps:      # in data-mode steps: the same forward passes
                    d["steps"] = data_steps(d["steps"], n, deck)
                runs.append(Run(sharding=s, mode=m, seed=deck.run.seed + i,
                                wall_s=walls.get((s, m, str(i), "finetune"), math.nan), **d))
    return Experiment(base=base, deck=deck, ranks=ranks, runs=runs, shared=shared, place=place,
                      budget=deck.train.steps, command=command, deck_path=deck_path,
                      cores=int(cores.group(1)) if cores else 0,
                      mode_steps={m: n for m, n in steps_of.items() if n != deck.train.steps},
                      shared_lr=(json.loads((base / "shared_lr.json").read_text())["lr"]
                                 if (base / "shared_lr.json").is_file() else math.nan))


# ----------------------------------------------------------------------------- statistics
def at_step(run: Run, step: float, what: str) -> float:
    y = getattr(run, what)
    return float(np.interp(step, run.steps, y)) if run.steps.size else math.nan


def crossing(run: Run, target: float) -> float:
    """First step at which the held-out loss reaches ``target`` (interpolated); nan if never."""
    s, y = run.steps.astype(np.float64), run.loss
    hit = np.flatnonzero(y <= target)
    if hit.size == 0:
        return math.nan
    i = int(hit[0])
    if i == 0:
        return float(s[0])
    y0, y1 = y[i - 1], y[i]
    return float(s[i - 1] + (s[i] - s[i - 1]) * (y0 - target) / (y0 - y1))


def use_to_target(run: Run, target: float, what: str = "energy_j") -> float:
    """The run's ``what`` (``"energy_j"``: joules, ``"core_s"``: CPU core-seconds) used until
    its held-out loss first reached ``target`` (:func:`crossing`), interpolated between the
    evaluations around the crossing; nan when the target is never reached or the use was not
    measured there."""
    step = crossing(run, target)
    y = getattr(run, what)
    if not math.isfinite(step) or y.size != run.steps.size or y.size == 0:
        return math.nan
    s = run.steps.astype(np.float64)
    i = int(np.searchsorted(s, step))               # evaluations i-1, i bracket the step
    near = y[max(i - 1, 0):i + 1] if i < s.size and s[i] != step else y[i:i + 1]
    if not np.all(np.isfinite(near)):
        return math.nan
    return float(np.interp(step, s, y))


def stats(x) -> tuple[float, float, float, float]:
    """(mean, sample std, min, max) of the finite values; nans when there are none."""
    a = np.asarray([v for v in x if math.isfinite(v)], np.float64)
    if a.size == 0:
        return (math.nan,) * 4
    sd = float(a.std(ddof=1)) if a.size > 1 else math.nan
    return float(a.mean()), sd, float(a.min()), float(a.max())


def target_loss(exp: Experiment) -> tuple[float, str]:
    """The held-out loss whose first crossing the report gives: ``experiment.target_loss``
    when set (> 0), else halfway from the mean starting loss (first evaluation, all runs) to
    the lowest mean final loss of any (sharding, mode); the mean starting loss itself when no
    configuration lowered it. Returns (target, a sentence saying how it was chosen)."""
    e = exp.deck.experiment
    if e.target_loss > 0:
        return e.target_loss, f"{e.target_loss:.4f} (set by experiment.target_loss)"
    start = float(np.mean([r.loss[0] for r in exp.runs]))
    finals = [stats([r.loss[-1] for r in exp.group(s, m)])[0]
              for s in e.shardings for m in e.modes]
    best = float(np.nanmin(finals))
    if not best < start:
        return start, (f"{start:.4f}: the mean starting loss (no configuration lowered the "
                       f"held-out loss)")
    t = 0.5 * (start + best)
    return t, (f"{t:.4f}, halfway from the mean starting loss {start:.4f} to the best final "
               f"mean loss of any configuration {best:.4f}")


def paired(exp: Experiment, a: str, b: str, mode: str, what: str, step: int):
    """Per-seed differences a - b at ``step`` (seeds present in both) and their p-value
    (:func:`paired_p`, nan where not defined)."""
    ra = {r.seed: at_step(r, step, what) for r in exp.group(a, mode)}
    rb = {r.seed: at_step(r, step, what) for r in exp.group(b, mode)}
    d = np.array([ra[s] - rb[s] for s in sorted(ra) if s in rb], np.float64)
    return d, paired_p(d)


def budgets(exp: Experiment) -> list[int]:
    n = exp.deck.experiment.report_points
    return [round(exp.budget * j / n) for j in range(1, n + 1)]


def run_time(exp: Experiment, r: Run) -> dict[str, float]:
    t = {"topology": exp.shared["topology"], "embed": exp.shared["embed"],
         "k-means": exp.shared["cluster"], "placement": exp.place[r.sharding],
         "fine-tuning": r.wall_s}
    return t


def holm(p: list[float]) -> list[float]:
    """Holm-Bonferroni adjusted p-values (nan stays nan, excluded from the family size)."""
    idx = [i for i, v in enumerate(p) if math.isfinite(v)]
    m = len(idx)
    out = [math.nan] * len(p)
    run = 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: p[i])):
        run = max(run, min(1.0, (m - rank) * p[i]))
        out[i] = run
    return out


def comparisons(exp: Experiment) -> list[dict]:
    """Paired comparisons at the full budget of the first sharding against each other one:
    per ZO mode, and pooled over modes (pairs by mode and seed). Accuracy and loss p-values
    (:func:`paired_p`) are Holm-adjusted, each over the whole list (undefined p-values stay
    nan and do not count in the family).

    Rows: ``{"other", "mode", "acc", "p_acc", "p_acc_holm", "loss", "p_loss", "p_loss_holm"}``
    with ``acc``/``loss`` the per-seed differences (first sharding minus ``other``)."""
    e = exp.deck.experiment
    ref, step = e.shardings[0], exp.budget
    rows = []
    for other in e.shardings[1:]:
        per = []
        for m in e.modes:
            da, pa = paired(exp, ref, other, m, "acc", step)
            dl, pl = paired(exp, ref, other, m, "loss", step)
            per.append((da, dl))
            rows.append({"other": other, "mode": m, "acc": da, "p_acc": pa, "loss": dl,
                         "p_loss": pl})
        if len(e.modes) > 1:
            da = np.concatenate([a for a, _ in per])
            dl = np.concatenate([b for _, b in per])
            rows.append({"other": other, "mode": "all modes", "acc": da,
                         "p_acc": paired_p(da), "loss": dl, "p_loss": paired_p(dl)})
    for key in ("p_acc", "p_loss"):
        for r, h in zip(rows, holm([r[key] for r in rows])):
            r[key + "_holm"] = h
    return rows


def paired_p(d) -> float:
    """Two-sided one-sample t-test p-value of the paired differences ``d`` against 0, or nan
    where it is not defined: fewer than 2 finite differences, or zero sample variance (every
    finite difference equal within ``1e-9`` of the largest magnitude, all-zero included).
    Non-finite differences are dropped. The per-mode and the pooled rows both use it."""
    a = np.asarray(d, np.float64)
    a = a[np.isfinite(a)]
    if a.size < 2 or not float(np.ptp(a)) > 1e-9 * float(np.abs(a).max()):
        return math.nan
    from scipy.stats import ttest_1samp  # heavy: only for the report

    return float(ttest_1samp(a, 0.0).pvalue)


_ttest = paired_p        # the old name


def semantic_cost(exp: Experiment) -> tuple[float, float] | None:
    """Seconds semantic sharding adds over shuffle (k-means + placement difference, and the
    embedding unless the head trains on its features: then every sharding needs it) and that
    as a share of a semantic configuration's mean fine-tuning time; None without both."""
    if "semantic" not in exp.place or "shuffle" not in exp.place:
        return None
    extra = exp.shared["cluster"] + exp.place["semantic"] - exp.place["shuffle"]
    if not d_head_only(exp):
        extra += exp.shared["embed"]
    ft = stats([r.wall_s for r in exp.runs if r.sharding == "semantic"])[0]
    return extra, extra / ft if ft else math.nan


def d_head_only(exp: Experiment) -> bool:
    t = exp.deck.train
    return t.params == "head+last" and t.last_layers == 0


def overhead(exp: Experiment, r: Run) -> float:
    """Clustering overhead of run ``r``: (embed + k-means + placement) / (topology + embed +
    k-means + placement + its fine-tuning) wall seconds; nan when the total is 0."""
    t = run_time(exp, r)
    total = sum(t.values())
    return (t["embed"] + t["k-means"] + t["placement"]) / total if total else math.nan
