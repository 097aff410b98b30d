"""The experiment's report (rank 0, no MPI): ``report.md``, with the plots and
``experiment.h5`` of :mod:`.plots`, from a run folder written by :mod:`.runner`; the figures
come from :mod:`.analysis`."""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from ..finetune.loop import schedule_name
from .analysis import (
    TIMINGS,
    Experiment,
    at_step,
    budgets,
    comparisons,
    crossing,
    d_head_only,
    load,
    overhead,
    passes_per_step,
    run_time,
    semantic_cost,
    stats,
    target_loss,
    use_to_target,
)
from .plots import plot, save_h5


# ----------------------------------------------------------------------------- report
def _pm(m: float, sd: float, scale: float = 1.0, fmt: str = "{:.4f}") -> str:
    if not math.isfinite(m):
        return "n/a"
    s = fmt.format(m * scale)
    return s + (f" ± {fmt.replace('+', '').format(sd * scale)}" if math.isfinite(sd) else "")


def _p(x: float) -> str:
    """A p-value for the report: three decimals, or "n.d." where the test is not defined
    (see :func:`semzo.experiment.analysis.paired_p`)."""
    return f"{x:.3f}" if math.isfinite(x) else "n.d."


def _fp(x: float) -> str:
    return f"{x:,.0f}" if math.isfinite(x) else "n/a"


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
                        f"{_p(r['p_acc'])}, Holm {_p(r['p_acc_holm'])})" for r in mine)
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
        shares = [overhead(exp, r) for r in exp.runs if r.sharding == s]
        over.append(f"{s} {100 * stats(shares)[0]:.1f}%")
    cost = semantic_cost(exp)
    extra = ""
    if cost is not None:
        what = ("k-means plus its placement" if d_head_only(exp) else
                "embedding (its only use here: the fine-tuned model reads the texts), k-means "
                "and the placement")
        extra = (f" What semantic sharding adds over shuffling is {what}: "
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
    elif d.train.params != "lora":
        out.append(f"- Trainable set: `{d.train.params}` (last_layers = "
                   f"{d.train.last_layers}).")
    if d.topology.ranks_per_node > 0:
        out.append(f"- The hierarchy is simulated on one host ({exp.cores or '?'} cores for "
                   f"{exp.ranks} ranks): no byte crosses a real switch, so what placement saves "
                   f"on the network does not show in these times, and the communication share "
                   f"includes waiting for ranks that share cores.")
    if d.zo.lr == "auto" and math.isfinite(exp.shared_lr):
        lr = (f"one step size for every configuration (`zo.lr = \"auto\"` scanned once before "
              f"them, `experiment.shared_lr`: {exp.shared_lr:.3e}, cosine decay and the loss "
              f"guard in every run, so no configuration wins by a learning rate tuned for it "
              f"or by a luckier scan) and one eps")
    elif d.zo.lr == "auto":
        lr = ("one step-size rule for every configuration (`zo.lr = \"auto\"`: each run sets "
              "its own step size by the same rule, so no configuration wins by a learning "
              "rate tuned for it) and one eps")
    else:
        lr = ("one learning rate and eps for every configuration (taken from the demo deck, "
              "not tuned for this experiment)")
    out.append(f"- One corpus (`{d.corpus.path}`), one model, {lr}, one budget. Other "
               f"corpora, budgets or step sizes may rank the configurations differently; rerun "
               f"with another deck to check.")
    if d.train.task == "sft":
        out.append("- Task `sft`: the loss is the next-token cross-entropy on the completion "
                   "tokens; \"accuracy\" is the share of completion tokens whose greedy next "
                   "token is right (not exact match of whole answers).")
    if d.train.params == "lora":
        targets = ", ".join(d.train.lora_targets) or "q_proj, v_proj"
        out.append(f"- LoRA (rank {d.train.lora_rank}) on `{targets}` "
                   f"of the last {d.train.lora_layers} blocks: the frozen blocks below run once "
                   f"per text (the frozen-prefix cache, computed by the first configuration "
                   f"of each sharding that needs it and reused by the others in the same job), "
                   f"so the fine-tuning time of the first seed of each sharding includes "
                   f"building it.")
    return out


def _other_modes(exp) -> str:
    """The modes that ran another number of steps for the same forward passes (fzoo)."""
    if not exp.mode_steps:
        return ""
    return ("; " + ", ".join(f"{m} mode {n:,} steps" for m, n in exp.mode_steps.items()) +
            " (fzoo spreads its directions over the seed groups: fewer passes per rank per "
            "step, so more steps for the same forward passes; their curves are drawn and "
            "tabulated in data-mode steps)")


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
    L += [f"Run folder `{base}`; {exp.ranks} ranks; task `{d.train.task}`; corpus "
          f"`{d.corpus.path}`; model "
          f"`{d.model.path or 'all-MiniLM-L6-v2'}`; trainable "
          f"`{d.train.params}" + (f":{d.train.last_layers}`" if d.train.params == "head+last"
                                  else "`") +
          f"; batch {d.train.batch_size} per rank; lr {_lr_text(d.zo.lr, exp.shared_lr)} ({schedule_name(d)}, warm-up "
          f"{d.train.warmup_steps}), eps {d.zo.eps:g}, z {d.zo.dist_name}; k-means k = "
          f"{d.cluster.k}; topology ranks_per_node = {d.topology.ranks_per_node}, "
          f"nodes_per_switch = {d.topology.nodes_per_switch}.", "",
          (f"Budget: {exp.budget:,} steps = {_fp(exp.fp(exp.budget))} forward passes of "
          f"{d.train.batch_size} texts for every configuration ({passes_per_step(d)} per rank "
          f"per step, estimator {d.zo.estimator_name})" + _other_modes(exp) + ". Seeds: "
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
          ("Energy to the target: joules used until the crossing, all ranks and machines "
           "(RAPL CPU packages and NVML GPUs where readable); \"not measured\" where the "
           "machine exposed neither meter (never an estimate); CPU core-seconds of all ranks "
           "are given always. Both over the seeds that reached the target."), "",
          ("| sharding | mode | forward passes (mean ± sd) | seeds reaching it | energy to "
           "target, J | CPU core-s to target |"), "|---|---|---:|---:|---:|---:|"]
    for s in e.shardings:
        for m in e.modes:
            g = exp.group(s, m)
            c = [crossing(r, tgt) for r in g]
            st = stats([exp.fp(x) for x in c if math.isfinite(x)])
            reach = sum(math.isfinite(x) for x in c)
            cell = "not reached" if reach == 0 else _pm(st[0], st[1], 1, "{:,.0f}")
            L.append(f"| {s} | {m} | {cell} | {reach}/{len(g)} | "
                     f"{_use(g, tgt, 'energy_j', reach)} | {_use(g, tgt, 'core_s', reach)} |")
    L += ["", "## Paired differences at the full budget", "",
          (f"Per seed, {e.shardings[0]} minus the other sharding (same seed, same held-out split, "
          f"same initial model); accuracy in points. `all modes` pools the pairs of every mode. "
          f"p: two-sided one-sample t-test of the differences; Holm: p adjusted for all the "
          f"rows of this table (Holm-Bonferroni). n.d.: not defined (fewer than 2 seeds, or "
          f"every seed gives the same difference: no seed-to-seed variance to test against); "
          f"such rows are left out of the Holm family."), "",
          ("| comparison | mode | accuracy diff (mean ± sd) | p | Holm | loss diff (mean ± sd) "
          "| p | Holm |"), "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in comparisons(exp):
        sa, sl = stats(r["acc"]), stats(r["loss"])
        L.append(f"| {e.shardings[0]} - {r['other']} | {r['mode']} | "
                 f"{_pm(sa[0], sa[1], 100, '{:+.2f}')} | {_p(r['p_acc'])} | "
                 f"{_p(r['p_acc_holm'])} | {_pm(sl[0], sl[1], 1, '{:+.4f}')} | "
                 f"{_p(r['p_loss'])} | {_p(r['p_loss_holm'])} |")
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
            ov = stats([overhead(exp, r) for r in g])
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


def _use(g, tgt: float, what: str, reach: int) -> str:
    """Mean ± sd of ``what`` to the target over the runs that reached it; "not measured" when
    one of them has no reading (energy on a machine without RAPL/NVML)."""
    if reach == 0:
        return "not reached"
    u = [use_to_target(r, tgt, what) for r in g if math.isfinite(crossing(r, tgt))]
    if not all(math.isfinite(x) for x in u):
        return "not measured"
    st = stats(u)
    return _pm(st[0], st[1], 1, "{:,.0f}" if what == "energy_j" else "{:,.1f}")


def _lr_text(lr, shared: float = math.nan) -> str:
    """``zo.lr`` as written: a number, or "auto" (with the shared scan's lr when there was
    one: experiment.shared_lr)."""
    if isinstance(lr, str):
        return lr + (f" (one scan shared by every configuration: {shared:.3e})"
                     if math.isfinite(shared) else "")
    return f"{lr:g}"


# ----------------------------------------------------------------------------- index
def write_index(base: str | Path, stems: list[str], walls: dict[str, float] | None,
                total: float | None) -> Path:
    """``base``/report.md: one section per task experiment (``base``/<stem>/, written by
    :mod:`.runner`): its settings, its conclusion, its wall time. ``walls`` (task -> s) and
    ``total`` as measured by this run, else read back from ``base``/tasks.csv (written by the
    run that measured them), else the sum of the task's stage times. Rank 0, no MPI."""
    base = Path(base)
    keep = base / "tasks.csv"
    if walls is not None:
        with open(keep, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(("task", "wall_s"))
            w.writerows([(k, repr(v)) for k, v in walls.items()] +
                        ([("total", repr(total))] if total is not None else []))
    elif keep.is_file():
        with open(keep, newline="", encoding="utf-8") as f:
            got = {r["task"]: float(r["wall_s"]) for r in csv.DictReader(f)}
        total = got.pop("total", None)
        walls = got
    head = (base / "experiment-tasks.toml")
    cmd = ""
    if head.is_file():
        first = head.read_text(encoding="utf-8").splitlines()[:1]
        cmd = first[0].removeprefix("# command: ") if first else ""
    L = ["# semzo experiment: semantic sharding and ZO fine-tuning, one section per task", ""]
    exps = [load(base / s) for s in stems]
    tot_txt = (f"{total / 60:.1f} min" if total is not None else
               "not recorded (report rebuilt without the run's tasks.csv)")
    names = ", ".join(f"`{s}`" for s in stems)
    L += [(f"Run folder `{base}`; tasks {names}; wall time of the whole experiment: "
           f"{tot_txt}."), ""]
    for stem, exp in zip(stems, exps):
        d, e = exp.deck, exp.deck.experiment
        if walls and stem in walls:
            wall = f"{walls[stem] / 60:.1f} min (measured)"
        else:
            with open(exp.base / TIMINGS, newline="", encoding="utf-8") as f:
                wall = (f"{sum(float(r['wall_s']) for r in csv.DictReader(f)) / 60:.1f} min "
                        f"(sum of the stage times)")
        n_cfg = len(e.shardings) * len(e.modes) * e.seeds
        L += [f"## Task `{d.train.task}` (`{stem}`: corpus `{d.corpus.path}`)", "",
              (f"{n_cfg} fine-tuning runs ({', '.join(e.shardings)} x {', '.join(e.modes)} x "
               f"{e.seeds} seeds) of {_fp(exp.fp(exp.budget))} forward passes each ("
               f"{exp.budget:,} steps{_other_modes(exp).split(' (')[0]}) on {exp.ranks} ranks; lr {_lr_text(d.zo.lr, exp.shared_lr)}, eps {d.zo.eps:g}; "
               f"wall time {wall}. Full report: [{stem}/report.md]({stem}/report.md)."), ""]
        L += conclusion(exp) + [""]
    if cmd:
        L += ["## How this was made", "", "```", cmd, "```", ""]
    out = base / "report.md"
    out.write_text("\n".join(L), encoding="utf-8")
    return out
