"""The experiment's plots and data file (rank 0): ``accuracy.png``, ``loss.png``,
``time.png`` and ``experiment.h5``."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np

from .analysis import Experiment, at_step, run_time, stats

SHARDING_COLOR = {"semantic": "C0", "shuffle": "C1", "random": "C2"}


# ----------------------------------------------------------------------------- outputs
def plot(exp: Experiment, target: float) -> list[Path]:
    """accuracy.png and loss.png (one panel per ZO mode, one line per sharding, mean with a
    min..max band over seeds, against forward passes) and time.png (stacked stage times)."""
    import matplotlib  # heavy (a second), rank 0 only

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
