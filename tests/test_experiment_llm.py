"""`make experiment-llm` in miniature (issue 34): inputs/experiment-llm.toml with a tiny Llama
runs its two task decks (prompt classification and sft) as experiments of their own at 2 ranks
(2 shardings x 2 ZO modes x 2 seeds each); every configuration gets the same forward-pass
budget and ``zo.lr = "auto"`` with the fzoo estimator (the experiment deck's), perturbation mode
running the steps that give data mode's forward passes per rank; the frozen-prefix states are
computed once per rank and reused, and each report's paired differences are those of the
metrics.csv files. A missing task deck is refused by name (exit 2) before any work."""

from __future__ import annotations

import csv
import json
import re
import tomllib

import numpy as np
import pytest
from llmutil import tiny_llama
from mpiutil import ROOT, check, mpirun

from semzo.experiment.analysis import comparisons, load
from semzo.tomlw import _toml_value

ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
NOUNS = ["cat", "dog", "sun", "moon", "tree", "red", "blue", "green"]
TPL = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
       "{% if add_generation_prompt %}<|assistant|>{% endif %}")
STEPS, SEEDS = 6, 2
# fzoo, 4 directions, 2 ranks: data mode 1 + 4 passes per rank per step, perturbation mode
# (2 seed groups) 1 + 2: 6 x 5 = 10 x 3 forward passes per rank; the prompt task's label rows
# train alone in the first step (train.label_rows_warmup auto: 1 of 6, one pass in every
# mode), so its perturbation mode runs 1 + round(5 x 5 / 3) = 9 steps (1 + 24 passes, data
# mode 1 + 25)
WARM = {"prompt": 1, "sft": 0}
MODE_STEPS = {"prompt": {"data": STEPS, "perturbation": 9},
              "sft": {"data": STEPS, "perturbation": 10}}
SHARDINGS, MODES = ("semantic", "shuffle"), ("data", "perturbation")


def _write_deck(path, src, changes: dict):
    """``src`` (an inputs/ deck) with ``changes`` ({"section.key": value}) as a TOML file."""
    raw = tomllib.loads((ROOT / "inputs" / src).read_text())
    for k, v in changes.items():
        s, name = k.split(".")
        raw.setdefault(s, {})[name] = v
    path.write_text("".join(f"[{s}]\n" + "".join(f"{k} = {_toml_value(v)}\n"
                                                for k, v in t.items()) for s, t in raw.items()))
    return path


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("expllm")
    model = tiny_llama(tmp / "llama", chat_template=TPL)
    rng = np.random.default_rng(0)
    with open(tmp / "prompt.jsonl", "w") as f, open(tmp / "sft.jsonl", "w") as g:
        for i in range(96):
            lab = int(rng.integers(2))
            ws = " ".join(str(w) for w in rng.choice(NOUNS, 4))
            f.write(json.dumps({"id": i, "text": f"{ws} {['good', 'bad'][lab]}",
                                "label": ["pos", "neg"][lab]}) + "\n")
            g.write(json.dumps({"messages": [{"role": "user", "content": ws},
                                             {"role": "assistant",
                                              "content": ["good", "bad"][lab]}]}) + "\n")
    _write_deck(tmp / "prompt.toml", "llm.toml", {
        "corpus.path": str(tmp / "prompt.jsonl"), "corpus.labels": ["neg", "pos"],
        "prompt.template": "{text} It was", "prompt.label_words": [" bad", " good"]})
    _write_deck(tmp / "sft.toml", "sft.toml", {"corpus.path": str(tmp / "sft.jsonl")})
    out = tmp / "out"
    proc = check(mpirun(2, _args(out, tmp, model), timeout=400, env=ENV))
    return out, proc


def _args(out, tmp, model, *extra):
    return ["-m", "semzo", "experiment", "inputs/experiment-llm.toml",
            "--set", f"run.output_dir={out}",
            "--set", f'experiment.decks=["{tmp / "prompt.toml"}", "{tmp / "sft.toml"}"]',
            "--set", f"model.path={model}", "--set", "cluster.k=3",
            "--set", "topology.nodes_per_switch=1", "--set", "model.max_length=32",
            "--set", "train.max_length=32", "--set", "train.lora_layers=1",
            "--set", f"train.steps={STEPS}", "--set", f"experiment.seeds={SEEDS}",
            "--set", f"experiment.shardings={_toml_value(list(SHARDINGS))}",
            "--set", f"experiment.modes={_toml_value(list(MODES))}",
            "--set", "experiment.eval_points=4", "--set", "zo.lr=auto", *extra]


def _final(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    ev = [r for r in rows if r["kind"] == "eval"]
    return rows, float(ev[-1]["heldout_loss"]), float(ev[-1]["heldout_acc"])


def test_both_tasks_run_every_configuration_with_one_budget_and_lr_auto(experiment):
    out, proc = experiment
    for task, kind in (("prompt", "prompt"), ("sft", "sft")):
        stored = tomllib.loads((out / task / "experiment.toml").read_text())
        assert stored["train"]["task"] == kind and stored["zo"]["lr"] == "auto"
        assert stored["zo"]["estimator"] == "fzoo"      # the experiment deck's
        assert stored["train"]["steps"] == STEPS and stored["train"]["gen_samples"] == 0
        head = (out / task / "experiment.toml").read_text()
        assert all(f"# steps: {m} {n}\n" in head for m, n in MODE_STEPS[task].items()), \
            head[:400]
        assert stored["experiment"]["decks"] == []           # a task deck is a single task
        starts = {}
        for s in SHARDINGS:
            for m in MODES:
                for i in range(SEEDS):
                    rows, _, _ = _final(out / task / s / m / f"seed{i}" / "metrics.csv")
                    train = [r for r in rows if r["kind"] == "train"]
                    n, w = MODE_STEPS[task][m], WARM[task]
                    assert len(train) == n, (task, s, m, i)
                    ev = [r for r in rows if r["kind"] == "eval"]
                    assert int(ev[-1]["step"]) == n
                    # the same forward passes per rank in every mode (to a step's rounding):
                    # the run's passes (metrics.csv counts them, the line search's included)
                    # less its scan's (before step w, after the warm-up's w passes)
                    per = {"data": 5, "perturbation": 3}[m]
                    fw = [int(r["forwards"]) for r in train]
                    assert fw[:w] == list(range(1, w + 1)), (task, m, fw)
                    scan = fw[w] - (fw[w - 1] if w else 0) - per
                    passes = fw[-1] - scan
                    assert passes == w + per * (n - w), (task, m, fw)
                    assert abs(passes - (w + 5 * (STEPS - w))) <= per / 2, (task, m, fw)
                    starts.setdefault(s, set()).add(ev[0]["heldout_loss"])
        # one sharding = the same rows on each rank = the same cached states: the starting
        # held-out loss is identical in every mode and seed
        assert all(len(v) == 1 for v in starts.values()), starts
    # the prefix states were computed by the first configuration of each sharding only
    hits = [int(m[1]) for m in re.finditer(r"frozen-prefix cache: \d+ sequences computed in "
                                           r"[\d.]+ s \(rank 0\), (\d+) reused", proc.stderr)]
    assert len(hits) == 2 and all(h > 0 for h in hits), proc.stderr[-3000:]
    # and handed to every rank: only the first configuration of each task computed any (on
    # rank 0, which logs); the other sharding's ranks hold other rows and computed none
    # (the shared step-size scan of each task runs first: it fills the store)
    fills = re.findall(r"0/2 INFO .*finetune: frozen-prefix cache: (\d+) sequences computed", proc.stderr)
    assert len(fills) == 2 * (1 + len(SHARDINGS) * len(MODES) * SEEDS), fills
    assert sum(int(n) > 0 for n in fills) == 2 and int(fills[0]) > 0, fills
    assert "experiment report:" in proc.stdout


@pytest.mark.parametrize("task", ["prompt", "sft"])
def test_reports_paired_differences_match_the_metrics(experiment, task):
    out, _ = experiment
    text = (out / task / "report.md").read_text()
    for heading in ("## Held-out accuracy at fixed budgets", "## Held-out loss at fixed budgets",
                    "## Forward passes to the target loss", "## Paired differences",
                    "## Time", "energy to target, J", "Holm", f"task `{task}`",
                    'zo.lr = \\"auto\\"'.replace("\\", "")):
        assert heading in text, heading
    for m in MODES:
        acc, loss = [], []
        for i in range(SEEDS):
            _, la, aa = _final(out / task / "semantic" / m / f"seed{i}" / "metrics.csv")
            _, lb, ab = _final(out / task / "shuffle" / m / f"seed{i}" / "metrics.csv")
            acc.append(100 * (aa - ab))
            loss.append(la - lb)
        row = re.search(rf"^\| semantic - shuffle \| {m} \| ([+-][\d.]+)[^|]*\|[^|]*\|[^|]*\| "
                        rf"([+-][\d.]+)", text, flags=re.MULTILINE)
        assert row, (m, text)
        assert float(row[1]) == pytest.approx(np.mean(acc), abs=0.006)
        assert float(row[2]) == pytest.approx(np.mean(loss), abs=6e-5)
        # at full precision: the report's per-seed pairs are these (same seed, same mode)
        got = next(r for r in comparisons(load(out / task))
                   if r["other"] == "shuffle" and r["mode"] == m)
        assert np.array_equal(got["loss"], np.array(loss))
        assert np.allclose(got["acc"] * 100, acc, rtol=0, atol=1e-9)


def test_index_report_names_both_tasks_with_wall_times(experiment):
    out, _ = experiment
    text = (out / "report.md").read_text()
    assert "## Task `prompt`" in text and "## Task `sft`" in text
    assert "[prompt/report.md](prompt/report.md)" in text
    assert re.search(r"wall time of the whole experiment: [\d.]+ min", text)
    assert len(re.findall(r"wall time [\d.]+ min \(measured\)", text)) == 2
    assert "semantic vs shuffle" in text
    # --report-only rebuilds the index and both reports, keeping the measured wall times
    (out / "report.md").unlink()
    (out / "sft" / "report.md").unlink()
    decks = [str(out.parent / "prompt.toml"), str(out.parent / "sft.toml")]
    check(mpirun(1, ["-m", "semzo", "experiment", "inputs/experiment-llm.toml", "--report-only",
                     "--set", f"run.output_dir={out}",
                     "--set", f"experiment.decks={_toml_value(decks)}"], timeout=120, env=ENV))
    again = (out / "report.md").read_text()
    assert again == text
    assert "## Paired differences" in (out / "sft" / "report.md").read_text()


def test_missing_task_deck_is_refused_by_name(tmp_path):
    proc = mpirun(2, ["-m", "semzo", "experiment", "inputs/experiment-llm.toml",
                      "--set", f"run.output_dir={tmp_path / 'o'}",
                      "--set", f'experiment.decks=["{tmp_path / "nope.toml"}"]'], timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "experiment.decks: deck file not found" in lines[0] \
        and "nope.toml" in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()


def test_one_shared_scan_sets_every_configurations_lr(experiment):
    """experiment.shared_lr (the default with zo.lr = "auto"): one scan per task in
    OUT/lr-scan/, its lr in shared_lr.json, and every configuration's first step at exactly
    that lr (cosine from it, the schedule of lr auto; the prompt task's first ZO step is after
    its label rows' warm-up); the report says so."""
    out, proc = experiment
    for task in ("prompt", "sft"):
        lr = json.loads((out / task / "shared_lr.json").read_text())["lr"]
        assert 1e-7 < lr < 1.0
        assert (out / task / "lr-scan" / "metrics.csv").is_file()
        for s in SHARDINGS:
            for m in MODES:
                for i in range(SEEDS):
                    rows, _, _ = _final(out / task / s / m / f"seed{i}" / "metrics.csv")
                    train = [r for r in rows if r["kind"] == "train"]
                    w = WARM[task]                  # the label rows' warm-up: no ZO lr
                    assert all(float(r["lr"]) == 0.0 for r in train[:w])
                    assert float(train[w]["lr"]) == lr, (task, s, m, i)
                    assert float(train[-1]["lr"]) < lr          # cosine decay
        assert f"one scan shared by every configuration: {lr:.3e}" in \
            (out / task / "report.md").read_text()
    assert proc.stderr.count("experiment: every configuration runs at lr") == 2


def test_report_reads_every_mode_in_data_mode_steps(experiment):
    """Perturbation mode ran 10 steps (the prompt task 9) for data mode's 6: the analysis puts
    its evaluations on data-mode steps (its last one at the budget), so the fixed-budget
    tables compare equal forward passes, and the report says how many steps each mode ran."""
    out, _ = experiment
    for task in ("prompt", "sft"):
        exp = load(out / task)
        assert exp.budget == STEPS and \
            exp.mode_steps == {"perturbation": MODE_STEPS[task]["perturbation"]}
        for r in exp.runs:
            assert r.steps[-1] == STEPS and r.n_steps == MODE_STEPS[task][r.mode], \
                (r.mode, r.steps)
        if any(r.mode == "perturbation" for r in exp.runs):
            p = next(r for r in exp.runs if r.mode == "perturbation")
            csv_path = out / task / p.sharding / "perturbation" / f"seed{p.seed}" / "metrics.csv"
            with open(csv_path) as fh:
                raw = [int(x["step"]) for x in csv.DictReader(fh) if x["kind"] == "eval"]
            w, n = WARM[task], MODE_STEPS[task]["perturbation"]
            raw = np.array(raw, np.float64)      # the warm-up's steps map to themselves
            want = np.where(raw <= w, raw, w + (raw - w) * (STEPS - w) / (n - w))
            assert np.allclose(p.steps, want), (p.steps, raw)
        assert f"perturbation mode {MODE_STEPS[task]['perturbation']} steps" in \
            (out / task / "report.md").read_text()
