"""The experiment's report (rank 0, no MPI): ``report.md``, ``accuracy.png``, ``loss.png``,
``time.png`` and ``experiment.h5`` from the run folder written by :mod:`.runner`.

Definitions (also stated in the report):

* forward passes: ``2 x ranks x step`` (each step every rank evaluates the loss twice on its own
  batch of ``train.batch_size`` texts); every configuration gets the same budget.
* held-out accuracy / loss at a budget: the held-out evaluation at that step (linear
  interpolation between the two nearest evaluations when the budget falls between them);
  mean, sample standard deviation and min..max over seeds.
* forward passes to the target loss: first crossing of the held-out loss curve below the target
  (linear interpolation between evaluations), per seed; "not reached" seeds are counted.
* paired differences: configurations with the same seed share the held-out split, the initial
  head and the ZO seeds' schedule, so sharding A - sharding B is taken per seed; a paired
  t-test (scipy) gives the p-value.
* clustering overhead: (embed + k-means + placement with redistribution) / the configuration's
  whole run (topology + those + fine-tuning); communication share: rank 0's time in the ZO
  exchange collectives over its time in the steps (compute + exchange).
"""

from __future__ import annotations

import csv
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..deck import from_toml_text
from .runner import TIMINGS

SHARDING_COLOR = {"semantic": "C0", "shuffle": "C1", "random": "C2"}


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

    def group(self, sharding: str, mode: str) -> list[Run]:
        return [r for r in self.runs if r.sharding == sharding and r.mode == mode]

    def fp(self, steps):
        return 2 * self.ranks * np.asarray(steps)


def _float(s: str) -> float:
    return float(s) if s not in ("", None) else math.nan


def read_metrics(path: Path) -> dict:
    """Eval curve and step-time sums of one metrics.csv (see semzo.finetune.report)."""
    ev, comp, comm, skipped, n = [], 0.0, 0.0, 0, 0
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            if row["kind"] == "eval":
                ev.append((int(row["step"]), _float(row["heldout_loss"]),
                           _float(row["heldout_acc"])))
            elif row["kind"] == "train":
                comp += _float(row["compute_s"])
                comm += _float(row["comm_s"])
                skipped += int(row["skipped"] or 0)
                n += 1
    ev.sort()
    a = np.array(ev, dtype=np.float64).reshape(-1, 3)
    return {"steps": a[:, 0].astype(np.int64), "loss": a[:, 1], "acc": a[:, 2],
            "compute_s": comp, "comm_s": comm, "skipped": skipped, "n_steps": n}


def load(base: str | Path) -> Experiment:
    """Read an experiment folder. Raises FileNotFoundError naming a missing file."""
    import h5py

    base = Path(base)
    text = (base / "experiment.toml").read_text(encoding="utf-8")
    deck = from_toml_text(text, str(base / "experiment.toml"))
    head = dict(re.findall(r"^# (command|resolved semzo deck \(from) ?:? ?(.*?)\)?$", text,
                           flags=re.MULTILINE))
    command = head.get("command", "python -m semzo experiment DECK")
    cores = re.search(r"^# cores: (\d+)$", text, flags=re.MULTILINE)
    deck_path = head.get("resolved semzo deck (from", str(base / "experiment.toml"))
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
                runs.append(Run(sharding=s, mode=m, seed=deck.run.seed + i,
                                wall_s=walls.get((s, m, str(i), "finetune"), math.nan), **d))
    return Experiment(base=base, deck=deck, ranks=ranks, runs=runs, shared=shared, place=place,
                      budget=deck.train.steps, command=command, deck_path=deck_path,
                      cores=int(cores.group(1)) if cores else 0)


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


def stats(x) -> tuple[float, float, float, float]:
    """(mean, sample std, min, max) of the finite values; nans when there are none."""
    a = np.asarray([v for v in x if math.isfinite(v)], np.float64)
    if a.size == 0:
        return (math.nan,) * 4
    sd = float(a.std(ddof=1)) if a.size > 1 else math.nan
    return float(a.mean()), sd, float(a.min()), float(a.max())


def target_loss(exp: Experiment) -> tuple[float, str]:
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
    """Per-seed differences a - b at ``step`` and the paired t-test p-value."""
    ra = {r.seed: at_step(r, step, what) for r in exp.group(a, mode)}
    rb = {r.seed: at_step(r, step, what) for r in exp.group(b, mode)}
    d = np.array([ra[s] - rb[s] for s in sorted(ra) if s in rb], np.float64)
    p = math.nan
    if d.size >= 2 and float(np.ptp(d)) > 1e-9 * max(float(np.abs(d).max()), 1e-300):
        from scipy.stats import ttest_1samp

        p = float(ttest_1samp(d, 0.0).pvalue)
    elif d.size >= 2:                     # every seed gives the same difference
        p = 0.0 if d[0] != 0 else 1.0
    return d, p


# ----------------------------------------------------------------------------- report
def _pm(m: float, sd: float, scale: float = 1.0, fmt: str = "{:.4f}") -> str:
    if not math.isfinite(m):
        return "n/a"
    s = fmt.format(m * scale)
    return s + (f" ± {fmt.replace('+', '').format(sd * scale)}" if math.isfinite(sd) else "")


def _fp(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "n/a"


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
    are Holm-adjusted, each over the whole list."""
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
                         "p_acc": _ttest(da), "loss": dl, "p_loss": _ttest(dl)})
    for key in ("p_acc", "p_loss"):
        for r, h in zip(rows, holm([r[key] for r in rows])):
            r[key + "_holm"] = h
    return rows


def _ttest(d: np.ndarray) -> float:
    if d.size < 2:
        return math.nan
    from scipy.stats import ttest_1samp

    return float(ttest_1samp(d, 0.0).pvalue)


def semantic_cost(exp: Experiment) -> tuple[float, float] | None:
    """Seconds semantic sharding adds over shuffle (k-means + placement difference) and that as
    a share of a semantic configuration's mean fine-tuning time; None without both."""
    if "semantic" not in exp.place or "shuffle" not in exp.place:
        return None
    extra = exp.shared["cluster"] + exp.place["semantic"] - exp.place["shuffle"]
    ft = stats([r.wall_s for r in exp.runs if r.sharding == "semantic"])[0]
    return extra, extra / ft if ft else math.nan


def conclusion(exp: Experiment) -> list[str]:
    """Plain sentences from the paired comparisons at the full budget. A difference counts
    when its Holm-adjusted p (over every comparison of the table) is below 0.05."""
    e = exp.deck.experiment
    ref = e.shardings[0]
    rows = comparisons(exp)
    lines = []
    for other in e.shardings[1:]:
        mine = [r for r in rows if r["other"] == other]
        per = "; ".join(f"{r['mode']} {100 * r['acc'].mean():+.2f} points (p = "
                        f"{r['p_acc']:.2f}, Holm {r['p_acc_holm']:.2f})" for r in mine)
        sig = [r for r in mine if math.isfinite(r["p_acc_holm"]) and r["p_acc_holm"] < 0.05]
        if not sig:
            head = (f"no difference in final held-out accuracy that survives the correction "
                    f"for {len(rows)} comparisons")
        else:
            head = "; ".join(f"{ref} is {'better' if r['acc'].mean() > 0 else 'worse'} in "
                             f"{r['mode']} (Holm-adjusted p = {r['p_acc_holm']:.3f})"
                             for r in sig)
        signs = [np.sign(r["acc"].mean()) for r in mine if r["mode"] != "all modes"]
        lsigns = [np.sign(r["loss"].mean()) for r in mine if r["mode"] != "all modes"]
        lean = ""
        sizes = [abs(100 * r["acc"].mean()) for r in mine if r["mode"] != "all modes"]
        sd = 100 * float(np.nanmean([stats([r.acc[-1] for r in exp.group(s, m)])[1]
                                     for s in (ref, other) for m in e.modes]))
        for word, lw, sgn in (("higher", "lower", 1), ("lower", "higher", -1)):
            if signs and all(x == sgn for x in signs) and all(x == -sgn for x in lsigns):
                lean = (f" In every mode the mean accuracy is {word} and the mean loss {lw} "
                        f"with {ref} sharding, by {min(sizes):.2f} to {max(sizes):.2f} "
                        f"points; the seed-to-seed standard deviation of one configuration "
                        f"is {sd:.2f} points on average.")
        lsig = [r for r in mine if math.isfinite(r["p_loss_holm"]) and r["p_loss_holm"] < 0.05]
        start = float(np.mean([r.loss[0] for r in exp.runs]))
        if lsig:
            loss_txt = " Held-out loss: " + "; ".join(
                f"{'lower' if r['loss'].mean() < 0 else 'higher'} with {ref} in {r['mode']} "
                f"by {abs(r['loss'].mean()):.4f} ({100 * abs(r['loss'].mean()) / start:.2f}% "
                f"of the starting loss; Holm-adjusted p = {r['p_loss_holm']:.3f})"
                for r in lsig) + "."
        else:
            loss_txt = " No held-out loss difference survives the correction either."
        lines.append(f"- **{ref} vs {other}**: {head} ({per}).{loss_txt}{lean}")
    finals = {m: stats([r.acc[-1] for r in exp.group(ref, m)]) for m in e.modes}
    order = sorted(e.modes, key=lambda m: -finals[m][0])
    lines.append("- **ZO modes at the same forward-pass budget** (" + ref + " sharding, final "
                 "held-out accuracy): " +
                 ", ".join(f"{m} {_pm(finals[m][0], finals[m][1], 100, '{:.2f}')}%"
                           for m in order) + ".")
    over = []
    for s in e.shardings:
        shares = [_overhead(exp, r) for r in exp.runs if r.sharding == s]
        over.append(f"{s} {100 * stats(shares)[0]:.1f}%")
    cost = semantic_cost(exp)
    extra = ""
    if cost is not None:
        extra = (f" What semantic sharding adds over shuffling is k-means plus its placement: "
                 f"{cost[0]:.2f} s, {100 * cost[1]:.0f}% of one configuration's fine-tuning "
                 f"time here.")
    emb = stats([exp.shared["embed"] / sum(run_time(exp, r).values()) for r in exp.runs])[0]
    if d_head_only(exp):
        extra = (f" Embedding alone is {100 * emb:.1f}%; its output is also the features the "
                 f"head trains on, so every sharding needs it in this setup." + extra)
    lines.append("- **Clustering overhead** (embed + k-means + placement as a share of one "
                 "configuration's run): " + ", ".join(over) + "." + extra)
    lines.append(f"- With {e.seeds} seeds per configuration the paired tests resolve "
                 f"differences of about the size of the spread columns below, not smaller.")
    return lines


def d_head_only(exp: Experiment) -> bool:
    t = exp.deck.train
    return t.params == "head+last" and t.last_layers == 0


def scope(exp: Experiment) -> list[str]:
    """The limits of the run, from its deck and host."""
    d = exp.deck
    out = []
    if d_head_only(exp):
        out.append("- Only the classification head trains, on the frozen encoder's pooled "
                   "features (the embed stage's, reused), so a ZO step costs well under a "
                   "millisecond. Whether semantic sharding matters when ZO perturbs the "
                   "transformer itself (`train.last_layers` > 0, `params = \"lora\"` or "
                   "`\"all\"`) is not measured here: at about 1 s per step on this machine "
                   "that needs a larger machine or a longer job (same command, other deck).")
    else:
        out.append(f"- Trainable set: `{d.train.params}` (last_layers = "
                   f"{d.train.last_layers}).")
    if d.topology.ranks_per_node > 0:
        out.append(f"- The hierarchy is simulated on one host ({exp.cores or '?'} cores for "
                   f"{exp.ranks} ranks): no byte crosses a real switch, so what placement saves "
                   f"on the network does not show in these times, and the communication share "
                   f"includes waiting for ranks that share cores.")
    out.append(f"- One corpus (`{d.corpus.path}`), one model, one learning rate and eps for "
               f"every configuration (taken from the demo deck, not tuned for this "
               f"experiment), one budget. Other corpora, budgets or learning rates may rank "
               f"the configurations differently; rerun with another deck to check.")
    return out


def _overhead(exp: Experiment, r: Run) -> float:
    t = run_time(exp, r)
    total = sum(t.values())
    return (t["embed"] + t["k-means"] + t["placement"]) / total if total else math.nan


def write_report(base: str | Path) -> Path:
    """Write report.md, the plots and experiment.h5 into ``base``; returns report.md."""
    exp = load(base)
    base = exp.base
    d, e = exp.deck, exp.deck.experiment
    tgt, tgt_txt = target_loss(exp)
    bud = budgets(exp)
    plots = plot(exp, tgt)
    save_h5(exp, tgt)
    cmd, deck_path = exp.command, exp.deck_path
    split = d.train.split_seed if d.train.split_seed >= 0 else d.run.seed
    L = ["# semzo experiment: semantic sharding and ZO fine-tuning", ""]
    L += [f"Run folder `{base}`; {exp.ranks} ranks; corpus `{d.corpus.path}`; model "
          f"`{d.model.path or 'all-MiniLM-L6-v2'}`; trainable "
          f"`{d.train.params}" + (f":{d.train.last_layers}`" if d.train.params == "head+last"
                                  else "`") +
          f"; batch {d.train.batch_size} per rank; lr {d.zo.lr:g} ({d.train.schedule}, warm-up "
          f"{d.train.warmup_steps}), eps {d.zo.eps:g}, z {d.zo.dist}; k-means k = "
          f"{d.cluster.k}; topology ranks_per_node = {d.topology.ranks_per_node}, "
          f"nodes_per_switch = {d.topology.nodes_per_switch}.", "",
          (f"Budget: {exp.budget:,} steps = {_fp(exp.fp(exp.budget))} forward passes of "
          f"{d.train.batch_size} texts for every configuration (2 per rank per step). Seeds: "
          f"{', '.join(str(d.run.seed + i) for i in range(e.seeds))} (the seed sets the ZO "
          f"directions and the batch order; every run is scored on the same held-out split "
          f"(split seed {split}) and starts from the same model, so configurations with the "
          f"same seed are paired)."),
          "", ("Every configuration uses the same deck; only `place.mode`, `zo.mode` and "
          "`run.seed` change. Nothing was tuned per configuration."), ""]
    L += ["## Conclusion", ""] + conclusion(exp) + [""]
    L += ["## What this does and does not show", ""] + scope(exp) + [""]
    L += ["## Held-out accuracy at fixed budgets", "",
          ("Mean ± sample standard deviation over seeds, in percent; [min..max] of the final "
          "budget. Forward passes in the header."), ""]
    L += ["| sharding | mode | " + " | ".join(_fp(exp.fp(b)) for b in bud) + " | final "
          "[min..max] |", "|---|---|" + "---:|" * (len(bud) + 1)]
    for s in e.shardings:
        for m in e.modes:
            g = exp.group(s, m)
            cells = [_pm(*stats([at_step(r, b, "acc") for r in g])[:2], 100, "{:.2f}")
                     for b in bud]
            fm = stats([at_step(r, exp.budget, "acc") for r in g])
            L.append(f"| {s} | {m} | " + " | ".join(cells) +
                     f" | [{100 * fm[2]:.2f}..{100 * fm[3]:.2f}] |")
    start = stats([r.acc[0] for r in exp.runs])
    L += ["", f"Before fine-tuning: {_pm(start[0], start[1], 100, '{:.2f}')}% (all runs).", ""]
    L += ["## Held-out loss at fixed budgets", "", "| sharding | mode | " +
          " | ".join(_fp(exp.fp(b)) for b in bud) + " |", "|---|---|" + "---:|" * len(bud)]
    for s in e.shardings:
        for m in e.modes:
            g = exp.group(s, m)
            L.append(f"| {s} | {m} | " + " | ".join(
                _pm(*stats([at_step(r, b, "loss") for r in g])[:2]) for b in bud) + " |")
    start = stats([r.loss[0] for r in exp.runs])
    L += ["", f"Before fine-tuning: {_pm(start[0], start[1])} (all runs).", ""]
    L += ["## Forward passes to the target loss", "", f"Target held-out loss: {tgt_txt}.", "",
          "| sharding | mode | forward passes (mean ± sd) | seeds reaching it |", "|---|---|---:|---:|"]
    for s in e.shardings:
        for m in e.modes:
            g = exp.group(s, m)
            c = [crossing(r, tgt) for r in g]
            st = stats([exp.fp(x) for x in c if math.isfinite(x)])
            reach = sum(math.isfinite(x) for x in c)
            cell = "not reached" if reach == 0 else _pm(st[0], st[1], 1, "{:,.0f}")
            L.append(f"| {s} | {m} | {cell} | {reach}/{len(g)} |")
    L += ["", "## Paired differences at the full budget", "",
          (f"Per seed, {e.shardings[0]} minus the other sharding (same seed, same held-out split, "
          f"same initial model); accuracy in points. `all modes` pools the pairs of every mode. "
          f"p: two-sided one-sample t-test of the differences; Holm: p adjusted for all the "
          f"rows of this table (Holm-Bonferroni)."), "",
          ("| comparison | mode | accuracy diff (mean ± sd) | p | Holm | loss diff (mean ± sd) "
          "| p | Holm |"), "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in comparisons(exp):
        sa, sl = stats(r["acc"]), stats(r["loss"])
        L.append(f"| {e.shardings[0]} - {r['other']} | {r['mode']} | "
                 f"{_pm(sa[0], sa[1], 100, '{:+.2f}')} | {r['p_acc']:.3f} | "
                 f"{r['p_acc_holm']:.3f} | {_pm(sl[0], sl[1], 1, '{:+.4f}')} | "
                 f"{r['p_loss']:.3f} | {r['p_loss_holm']:.3f} |")
    L += ["", "## Time", "",
          ("Wall time of each stage on rank 0 (s). Topology, embed and k-means run once and are "
          "shared by every configuration; placement runs once per sharding; fine-tuning is the "
          "mean over seeds. Clustering overhead = (embed + k-means + placement) / the sum of "
          "the row. Communication share = time in the ZO exchange collectives / time in the "
          "steps (rank 0)."), "",
          ("| sharding | mode | topology | embed | k-means | placement | fine-tuning | "
          "clustering overhead | comm share of step time | skipped steps |"),
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in e.shardings:
        for m in e.modes:
            g = exp.group(s, m)
            t = run_time(exp, g[0])
            ft = stats([r.wall_s for r in g])
            ov = stats([_overhead(exp, r) for r in g])
            cs = stats([r.comm_s / (r.compute_s + r.comm_s) if r.compute_s + r.comm_s else
                        math.nan for r in g])
            L.append(f"| {s} | {m} | {t['topology']:.1f} | {t['embed']:.1f} | "
                     f"{t['k-means']:.2f} | {t['placement']:.2f} | {ft[0]:.1f} | "
                     f"{100 * ov[0]:.1f}% | {100 * cs[0]:.2f}% | "
                     f"{sum(r.skipped for r in g)} |")
    L += ["", "## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    L += ["## How this was made", "", "```", cmd, "```", "",
          (f"The resolved deck is `{base}/experiment.toml`; every configuration's metrics are "
          f"in `{base}/<sharding>/<mode>/seed<N>/metrics.csv`, the curves of all of them in "
          f"`{base}/experiment.h5`. `python -m semzo experiment {deck_path} --report-only` "
          f"rebuilds this report from those files."), ""]
    out = base / "report.md"
    out.write_text("\n".join(L), encoding="utf-8")
    return out


# ----------------------------------------------------------------------------- outputs
def plot(exp: Experiment, target: float) -> list[Path]:
    """accuracy.png and loss.png (one panel per ZO mode, one line per sharding, mean with a
    min..max band over seeds, against forward passes) and time.png (stacked stage times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    e = exp.deck.experiment
    paths = []
    for what, label in (("acc", "held-out accuracy"), ("loss", "held-out loss")):
        fig, axes = plt.subplots(1, len(e.modes), figsize=(4.6 * len(e.modes), 3.8),
                                 sharey=True, constrained_layout=True, squeeze=False)
        for ax, m in zip(axes[0], e.modes):
            for i, s in enumerate(e.shardings):
                g = exp.group(s, m)
                grid = np.unique(np.concatenate([r.steps for r in g]))
                ys = np.array([[at_step(r, x, what) for x in grid] for r in g])
                col = SHARDING_COLOR.get(s, f"C{i}")
                ax.plot(exp.fp(grid), ys.mean(0), color=col, lw=1.6, label=f"{s} (mean)")
                ax.fill_between(exp.fp(grid), ys.min(0), ys.max(0), color=col, alpha=0.2,
                                lw=0, label=f"{s} (min..max, {len(g)} seeds)")
            if what == "loss":
                ax.axhline(target, color="0.4", ls=":", lw=1, label="target loss")
            ax.set_title(f"ZO mode: {m}")
            ax.set_xlabel("forward passes (all ranks)")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel(label)
        axes[0][-1].legend(fontsize=8)
        fig.suptitle(f"semzo experiment: {label} vs forward passes, {exp.ranks} ranks, batch "
                     f"{exp.deck.train.batch_size} per rank")
        p = exp.base / ("accuracy.png" if what == "acc" else "loss.png")
        fig.savefig(p, dpi=100)
        plt.close(fig)
        paths.append(p)
    # time breakdown
    rows, parts = [], ("topology", "embed", "k-means", "placement", "fine-tuning: steps",
                       "fine-tuning: ZO exchange", "fine-tuning: other")
    for s in e.shardings:
        for m in e.modes:
            g = exp.group(s, m)
            t = run_time(exp, g[0])
            comp = stats([r.compute_s for r in g])[0]
            comm = stats([r.comm_s for r in g])[0]
            wall = stats([r.wall_s for r in g])[0]
            rows.append((f"{s} / {m}", [t["topology"], t["embed"], t["k-means"],
                                        t["placement"], comp, comm,
                                        max(wall - comp - comm, 0.0)]))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 2.2), constrained_layout=True)
    left = np.zeros(len(rows))
    for j, name in enumerate(parts):
        w = np.array([r[1][j] for r in rows])
        ax.barh(np.arange(len(rows)), w, left=left, color=f"C{j}", label=name)
        left += w
    ax.set_yticks(np.arange(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("wall time of one configuration's run [s] (rank 0)")
    ax.set_title("semzo experiment: time by stage (shared stages counted in every row)")
    ax.legend(fontsize=8, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    p = exp.base / "time.png"
    fig.savefig(p, dpi=100)
    plt.close(fig)
    paths.append(p)
    return paths


def save_h5(exp: Experiment, target: float) -> Path:
    """experiment.h5: one group per configuration and seed with its held-out curve."""
    import h5py

    p = exp.base / "experiment.h5"
    tmp = p.with_suffix(".h5.tmp")
    with h5py.File(tmp, "w") as f:
        f.attrs["semzo_deck"] = exp.deck.to_toml()
        f.attrs["ranks"] = exp.ranks
        f.attrs["target_loss"] = target
        for r in exp.runs:
            g = f.create_group(f"{r.sharding}/{r.mode}/seed{r.seed}")
            g["step"] = r.steps
            g["forward_passes"] = exp.fp(r.steps)
            g["heldout_loss"] = r.loss
            g["heldout_acc"] = r.acc
            g.attrs.update({"compute_s": r.compute_s, "comm_s": r.comm_s,
                            "skipped": r.skipped, "wall_s": r.wall_s})
    tmp.replace(p)
    return p
