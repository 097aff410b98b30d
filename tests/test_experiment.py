"""`semzo experiment`: the statistics of the report on known curves, and a small real
experiment under mpirun (2 ranks, 2 shardings x 3 ZO modes x 2 seeds) whose outputs, budgets
and report are checked."""

import csv
import dataclasses
import math
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest
from mpiutil import ROOT, check, mpirun

from semzo.experiment.analysis import Run, crossing, holm, paired, stats
from semzo.experiment.runner import config_deck, eval_every

CORPUS = ROOT / "data" / "fortunes.jsonl"


def _run(seed, steps, loss, acc=None, sharding="semantic", mode="data"):
    steps = np.asarray(steps)
    loss = np.asarray(loss, np.float64)
    acc = np.zeros_like(loss) if acc is None else np.asarray(acc, np.float64)
    return Run(sharding=sharding, mode=mode, seed=seed, steps=steps, loss=loss, acc=acc,
               compute_s=1.0, comm_s=0.5, skipped=0, n_steps=int(steps[-1]))


def test_eval_every_hits_every_report_budget():
    for steps, pts in ((4000, 4), (400, 4), (1000, 3), (12, 4), (7, 7), (100, 1)):
        ev = eval_every(steps, pts)
        assert ev >= 1
        for j in range(1, pts + 1):
            if steps % pts == 0:
                assert (steps * j // pts) % ev == 0, (steps, pts, ev)
    assert eval_every(4000, 4) == 100           # 40 evaluations
    assert eval_every(0, 4) == 0


def test_crossing_interpolates_and_reports_never():
    r = _run(0, [0, 10, 20, 30], [2.0, 1.8, 1.4, 1.2])
    assert crossing(r, 1.6) == pytest.approx(15.0)
    assert crossing(r, 2.5) == 0.0
    assert math.isnan(crossing(r, 1.0))


def test_stats_and_paired_differences():
    m, sd, lo, hi = stats([1.0, 2.0, 3.0, math.nan])
    assert (m, lo, hi) == (2.0, 1.0, 3.0) and sd == pytest.approx(1.0)
    assert all(math.isnan(x) for x in stats([]))

    class E:
        def __init__(self):
            self.runs = [_run(s, [0, 10], [2.0, 1.0 + 0.1 * s], [0.4, 0.5 + 0.01 * s],
                              "semantic") for s in range(3)]
            self.runs += [_run(s, [0, 10], [2.0, 1.2 + 0.1 * s], [0.4, 0.4 + 0.01 * s],
                               "shuffle") for s in range(3)]

        def group(self, s, m):
            return [r for r in self.runs if r.sharding == s and r.mode == m]

    d, p = paired(E(), "semantic", "shuffle", "data", "acc", 10)
    assert np.allclose(d, 0.1) and math.isnan(p)   # identical differences: p not defined
    d, p = paired(E(), "semantic", "shuffle", "data", "loss", 5)
    assert np.allclose(d, -0.1)                  # interpolated half way: -0.2 / 2


def test_holm_adjustment():
    # sorted p 0.01, 0.02, 0.04 -> 3*0.01, max(0.03, 2*0.02), max(0.04, 1*0.04)
    assert holm([0.04, 0.01, 0.02]) == pytest.approx([0.04, 0.03, 0.04])
    out = holm([0.5, math.nan, 0.9])
    assert out[0] == pytest.approx(1.0) and math.isnan(out[1]) and out[2] == pytest.approx(1.0)


def test_config_deck_changes_only_the_compared_keys():
    from semzo.deck import load

    base = load(ROOT / "inputs" / "experiment.toml", check_inputs=False)
    c = config_deck(base, "shuffle", "hybrid", 2)
    assert c.place.mode == "shuffle" and c.zo.mode == "hybrid"
    assert c.run.seed == base.run.seed + 2
    assert c.train.split_seed == base.run.seed          # the same held-out split for all
    assert c.run.output_dir.endswith("shuffle/hybrid/seed2")
    assert c.train.max_epochs == 0 and c.train.steps == base.train.steps
    assert c.zo.lr == base.zo.lr and c.zo.eps == base.zo.eps
    assert c.cluster == base.cluster and c.model == base.model
    # with zo.lr = "auto" and the shared scan's lr: the estimator and z the scan measured
    auto = base.replace(zo=dataclasses.replace(base.zo, lr="auto", estimator="auto",
                                               dist="auto"),
                        train=dataclasses.replace(base.train, schedule="auto"))
    c = config_deck(auto, "shuffle", "data", 1, lr=3e-4)
    assert c.zo.lr == 3e-4 and c.zo.estimator_name == "fzoo" and c.zo.dist_name == "rademacher"
    assert c.zo.lr_guard_name != 0 and c.train.schedule == "cosine"


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    if not CORPUS.is_file():
        CORPUS.parent.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "semzo", "corpus", "fortunes", str(CORPUS)],
                       check=True, cwd=ROOT)
    out = tmp_path_factory.mktemp("exp")
    proc = check(mpirun(2, _args(out), timeout=400))
    return out, proc


def _args(out, *extra):
    return ["-m", "semzo", "experiment", "inputs/experiment.toml",
            "--set", f"run.output_dir={out}",
            "--set", "corpus.max_records=400", "--set", "cluster.k=8",
            "--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1",
            "--set", "train.steps=40", "--set", "experiment.seeds=2",
            "--set", 'experiment.shardings=["semantic", "shuffle"]', *extra]


def _metrics(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_experiment_runs_every_configuration_with_the_same_budget(experiment):
    out, proc = experiment
    starts = set()
    for s in ("semantic", "shuffle"):
        assert (out / s / "shards.h5").is_file()
        for m in ("data", "perturbation", "hybrid"):
            for i in range(2):
                rows = _metrics(out / s / m / f"seed{i}" / "metrics.csv")
                train = [r for r in rows if r["kind"] == "train"]
                ev = [r for r in rows if r["kind"] == "eval"]
                assert len(train) == 40, (s, m, i)          # same steps = same budget
                assert [int(r["step"]) for r in ev] == list(range(41))   # eval_every 1
                starts.add((i, ev[0]["heldout_loss"]))
    # the same held-out split and initial head in every configuration: one starting loss, up
    # to rounding (each sharding puts the held-out rows on other ranks, so the per-rank sums
    # are added in another order; 1e-12 relative is a few ulp of float64)
    vals = sorted(float(v) for _, v in starts)
    assert vals[-1] - vals[0] <= 1e-12 * abs(vals[0]), vals
    with h5py.File(out / "semantic" / "shards.h5") as a, h5py.File(out / "shuffle" /
                                                                   "shards.h5") as b:
        assert a.attrs["mode"] == "semantic" and b.attrs["mode"] == "shuffle"
        assert sorted(a["ids"][...]) == sorted(b["ids"][...])
    assert "experiment report:" in proc.stdout


def test_experiment_report_and_plots(experiment):
    out, _ = experiment
    text = (out / "report.md").read_text()
    for heading in ("## Conclusion", "## Held-out accuracy at fixed budgets",
                    "## Held-out loss at fixed budgets", "## Forward passes to the target loss",
                    "## Paired differences", "## Time", "## What this does and does not show",
                    "Holm", "mpirun -n 2 python -m semzo experiment"):
        assert heading in text, heading
    assert "semantic vs shuffle" in text
    table = [ln for ln in text.splitlines() if ln.startswith("| shuffle | hybrid |")]
    assert len(table) == 4                 # accuracy, loss, forward passes to target, time
    # energy to the target: joules where the machine has a readable meter, else "not
    # measured"; core-seconds always, over the seeds that reached the target
    assert "| energy to target, J | CPU core-s to target |" in text
    runs = [_metrics(p) for p in out.glob("*/*/seed*/metrics.csv")]
    measured = all(r[-1]["energy_j"] != "" for r in runs)
    rows = 0
    for ln in text.splitlines():
        m = re.fullmatch(r"\| (?:semantic|shuffle) \| \w+ \| [^|]+ \| ([12])/2 \| ([^|]+) \| "
                         r"([^|]+) \|", ln)
        if m:
            rows += 1
            assert re.fullmatch(r"[\d,]+\.\d( ± [\d,]+\.\d)?", m[3].strip()), ln
            assert (m[2].strip() != "not measured") == measured, ln
    assert rows >= 1           # the target lies halfway to the best final loss: reached
    for png in ("accuracy.png", "loss.png", "time.png"):
        assert (out / png).stat().st_size > 10_000
    with h5py.File(out / "experiment.h5") as f:
        g = f["semantic/data/seed0"]
        assert g["forward_passes"][-1] == 2 * 2 * 40            # 2 ranks x 2 passes x steps
        assert np.all(np.isfinite(g["heldout_loss"][...]))


def test_report_only_rebuilds_and_missing_folder_is_exit_2(experiment, tmp_path):
    out, _ = experiment
    (out / "report.md").unlink()
    check(mpirun(1, ["-m", "semzo", "experiment", "inputs/experiment.toml", "--report-only",
                     "--set", f"run.output_dir={out}"], timeout=120))
    assert "## Conclusion" in (out / "report.md").read_text()
    proc = mpirun(2, ["-m", "semzo", "experiment", "inputs/experiment.toml", "--report-only",
                      "--set", f"run.output_dir={tmp_path / 'nothing'}"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("error:") == 1 and "run.output_dir" in proc.stderr


def test_run_stages_other_than_all_is_refused(tmp_path):
    """The experiment runs every stage whatever run.stages says, so a deck that sets another
    list is refused by name (exit 2, one line, before any work) rather than ignored; every
    stage listed explicitly is the default and passes this check."""
    out = tmp_path / "exp"
    proc = mpirun(2, _args(out, "--set", 'run.stages=["place", "finetune"]'), timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "inputs/experiment.toml: run.stages: `semzo experiment` runs " \
        "every stage" in lines[0] and "['place', 'finetune']" in lines[0], proc.stderr
    assert not out.exists()
    every = '["topology", "embed", "cluster", "place", "finetune"]'
    proc = mpirun(2, _args(out, "--set", f"run.stages={every}", "--set", "train.steps=1"),
                  timeout=60)
    assert proc.returncode == 2 and "train.steps: the experiment needs" in proc.stderr


def test_resume_reruns_only_what_is_missing(experiment):
    out, _ = experiment
    redo = out / "shuffle" / "hybrid" / "seed1" / "metrics.csv"
    kept = out / "semantic" / "data" / "seed0" / "metrics.csv"
    before = kept.read_bytes()
    redo.write_text(redo.read_text().rsplit("\neval,40,", 1)[0] + "\n")   # cut the last eval
    emb = (out / "embeddings.h5").stat().st_mtime_ns
    proc = check(mpirun(2, _args(out, "--resume"), timeout=300))
    assert "11 of 12 configurations and 4 earlier stages are complete" in proc.stderr
    assert proc.stderr.count("experiment: 12/12 done") == 1       # only the missing one ran
    assert (out / "embeddings.h5").stat().st_mtime_ns == emb       # not embedded again
    assert kept.read_bytes() == before
    assert "eval,40," in redo.read_text()
    text = (out / "report.md").read_text()
    assert "| shuffle | hybrid |" in text
    # another deck in the same folder: refused, exit 2, one line
    proc = mpirun(2, _args(out, "--resume", "--set", "zo.lr=0.5"), timeout=120)
    assert proc.returncode == 2 and "holds an experiment of another deck" in proc.stderr
