"""Forward passes and wall time to reach a held-out target: MeZO-SGD at the LLM demo's fixed lr
against the new defaults (``zo.lr = "auto"``, ``zo.estimator = "fzoo"``, Rademacher z), on the
LLM prompt task (issue 32); ``--task sft`` and ``--task choice``: the same on inputs/sft.toml's
and inputs/choice.toml's tasks (issue 31).

    .venv/bin/python bench/zo_convergence.py [--seeds 5] [--forwards 800] [--batch 8]
        [--eval-every 80] [--configs mezo-fixed,auto-fzoo] [--target-acc +0.10]
        [--target-loss -0.30] [--texts 0] [--task prompt|sft|choice] [--json out.json]
        [--labels A,B,C [--label-words x,y,z] [--template T]]
        [--from-log OUT.txt]

The task is inputs/llm.toml's: SmolLM2-135M-Instruct (models/smollm2-135m-instruct), the
fortunes of the labels food / love / sports, its template and label words, LoRA rank 8 on q
and v of the last 2 blocks (the frozen blocks run once per prompt: the prefix cache), prompts of
at most 48 tokens, 30 % held out by the deck's split, eps 1e-2. One process (``SoloTopo``),
built once; every run starts from the same LoRA initialization and differs by its run seed
(z stream and data order), the same seeds for every configuration (paired).

Configurations (``--configs``):

* ``mezo-fixed``: ``estimator = "mezo"``, Gaussian z, lr 2e-2 (the demo's), 2 passes per step,
  A and B of the adapters trained (MeZO's LoRA; ``lora_a=frozen`` in a configuration of
  keys: A kept at its start, ``train.lora_a = "frozen"``);
* ``auto-fzoo``: the deck defaults: lr auto (its scan counted in the budget), cosine
  decay, the loss guard, fzoo with
  4 directions, Rademacher z, 5 passes per step, the held-out guard (zo.lr_rollback 0.1),
  and on the prompt task the label words' rows of the LM head trained by their exact
  gradient (``train.label_rows = "auto"``; ``label_rows=frozen`` in a configuration of keys
  leaves them as MeZO does), the first 5 % of the steps training those rows alone at one
  forward pass each (``train.label_rows_warmup = "auto"``; ``rows_warmup=0``: ZO from the
  first step);
* ``mezo-auto``: MeZO with the automatic lr (and, as a deck resolves lr auto, cosine decay and
  both guards); ``fzoo-gauss``: auto-fzoo with Gaussian z;
  ``mezo-rad``: mezo-fixed with Rademacher z.

Every run gets the same budget of ZO forward passes (``--forwards``, per process: a pass is
one batch of ``--batch`` prompts; evaluation passes not counted); the held-out set is
evaluated every ``--eval-every`` forward passes (rounded to whole steps). Printed: per
configuration the mean over seeds of the final held-out accuracy and loss, the forward passes
and wall seconds to first reach the accuracy target (zero-shot + ``--target-acc`` when it
starts with + , else absolute) and the loss target (zero-shot + ``--target-loss`` when it
starts with -), how many seeds reached each, and the ratios against the first
configuration; then the paired per-seed final accuracies and the best accuracy on each
curve (what ``checkpoints/best.h5`` keeps). The targets are checked at the evaluations only
(every ``--eval-every`` forward passes): the figures are that coarse; ``--early EVERY:UNTIL``
adds evaluations at each multiple of EVERY forward passes up to UNTIL (after the first step
that reaches it), for every configuration alike. ``--from-log`` prints
the same tables from the per-run lines of an earlier invocation cut short.
Timings are on a shared 2-core machine: noisy, say so.

``--torch-peer`` (prompt task): the wall-time peer, MeZO as its reference trainer runs it in
torch (transformers' SmolLM2 with the same LoRA adapters on q and v of the last 2 blocks, per
tensor an out-of-place ``torch.normal`` perturbation from a seeded generator, +eps, forward,
-2 eps, forward, +eps restore, the update; the whole model forward each pass: MeZO has no
frozen-prefix cache), timed on the same batch of prompts and threads in a process of its own
(torch's and numba's thread pools never share one). Its wall time to the targets is MeZO's
forward passes to them (measured above: the same algorithm at the same lr takes the same
passes) times the torch step's measured time per pass: a product of two measurements,
printed as such.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "mpi"))

CONFIGS = {
    "mezo-fixed": {"estimator": "mezo", "dist": "gaussian", "lr": 2e-2, "lora_a": "train"},
    "auto-fzoo": {"estimator": "fzoo", "dist": "rademacher", "lr": "auto", "guard": "auto",
                  "schedule": "cosine", "rollback": "auto"},
    "mezo-auto": {"estimator": "mezo", "dist": "gaussian", "lr": "auto"},
    "fzoo-gauss": {"estimator": "fzoo", "dist": "gaussian", "lr": "auto", "guard": "auto",
                   "schedule": "cosine", "rollback": "auto"},
    "mezo-rad": {"estimator": "mezo", "dist": "rademacher", "lr": 2e-2},
}


def build(max_texts: int = 0, labels: list[str] | None = None, template: str = "",
          label_words: list[str] | None = None):
    """(model, trainable names, initial values, task) of inputs/llm.toml's prompt task
    (``labels``/``template``: other fortune categories and template than the deck's: data the
    deck was not tuned on; the label words are then the label names, or ``label_words``)."""
    from semzo.deck import load
    from semzo.finetune.trainable import select_trainable
    from semzo.model import Tokenizer, load_model
    from semzo.preflight import heldout_mask
    from semzo.tasks.prompt import PromptTask, encode_prompts, first_trained_block, label_word_ids

    deck = load(ROOT / "inputs" / "llm.toml", check_inputs=False)
    labels = list(labels or deck.corpus.labels)
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    recs = [r for r in recs if r.get("label") in labels]
    if max_texts:                    # every k-th record: the classes keep their shares
        recs = recs[::max(1, len(recs) // max_texts)][:max_texts]
    folder = ROOT / "models" / "smollm2-135m-instruct"
    m = load_model(str(folder))
    t = deck.train
    names = select_trainable(m, t.params, t.last_layers, t.lora_rank, t.lora_alpha, 0,
                             targets=t.lora_targets, lora_layers=t.lora_layers,
                             lora_a="train")   # all adapter tensors; configurations pick
    tok = Tokenizer.from_folder(str(folder), max_length=None)
    tok.tk.no_truncation()
    pr = deck.prompt
    tmpl = template or pr.template
    words = [] if template or labels != list(deck.corpus.labels) else pr.label_words
    words = label_words or words
    word_ids = label_word_ids(tok, labels, words, tmpl, "bench")
    seqs = encode_prompts(tok, [r["text"] for r in recs], tmpl, t.max_length,
                          int(m.config.max_positions), "bench")
    y = np.array([labels.index(r["label"]) for r in recs])
    held = heldout_mask(np.array([int(r["id"]) for r in recs]), deck.run.seed,
                        t.heldout_fraction)
    layer = first_trained_block(m, names)
    t0 = time.perf_counter()
    task = PromptTask(m, seqs, y, np.flatnonzero(~held), np.flatnonzero(held), tok.pad_id,
                      t.eval_batch_size, word_ids, layer=layer)
    print(f"# task: {len(recs)} prompts ({int((~held).sum())} train, {int(held.sum())} "
          f"held out), {len(names)} trainable tensors, "
          f"{sum(m.params[n].size for n in names)} parameters, prefix cache from block "
          f"{layer} built in {time.perf_counter() - t0:.1f} s", flush=True)
    init = {n: m.params[n].copy() for n in names}
    return deck, m, names, init, task


def build_records(kind: str, max_texts: int = 0, corpus: str = ""):
    """(deck, model, trainable names, initial values, task) of inputs/sft.toml's ``sft`` task
    (``kind = "sft"``: the chat records of data/debian-sft.jsonl; no generations scored, the
    held-out "accuracy" is the completion tokens' next-token accuracy) or inputs/choice.toml's
    ``choice`` task (data/debian-choice.jsonl, the deck's choice score): the deck's held-out
    split, its trainable set (LoRA on q, v of the last 2 blocks) and the frozen-prefix cache.
    ``corpus``: another JSONL file of the task's records."""
    from semzo.deck import load
    from semzo.finetune.trainable import select_trainable
    from semzo.model import load_model
    from semzo.model.chat import InstructTokenizer
    from semzo.preflight import heldout_mask
    from semzo.tasks.choice import ChoiceTask
    from semzo.tasks.prompt import first_trained_block
    from semzo.tasks.sft import SFTTask

    deck = load(ROOT / "inputs" / f"{kind}.toml", check_inputs=False)
    with open(corpus or ROOT / "data" / f"debian-{kind}.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    if max_texts:
        recs = recs[:max_texts]
    folder = ROOT / "models" / "smollm2-135m-instruct"
    m = load_model(str(folder))
    t = deck.train
    names = select_trainable(m, t.params, t.last_layers, t.lora_rank, t.lora_alpha, 0,
                             targets=t.lora_targets, lora_layers=t.lora_layers,
                             lora_a="train")   # all adapter tensors; configurations pick
    itok = InstructTokenizer.from_folder(str(folder))
    encode = itok.sft if kind == "sft" else itok.choice
    got = [encode(r, t.max_length) for r in recs]
    keep = [i for i, g in enumerate(got) if g is not None]
    recs, got = [recs[i] for i in keep], [got[i] for i in keep]
    held = heldout_mask(np.array([int(r["id"]) for r in recs]), deck.run.seed,
                        t.heldout_fraction)
    rows = (np.flatnonzero(~held), np.flatnonzero(held))
    layer = first_trained_block(m, names)
    t0 = time.perf_counter()
    if kind == "sft":
        task = SFTTask(m, [g[0] for g in got], [g[1] for g in got], *rows, itok.pad_id,
                       t.eval_batch_size, layer=layer)
    else:
        task = ChoiceTask(m, [g[0] for g in got], [g[1] for g in got],
                          [r["answer"] for r in recs], *rows, itok.pad_id, t.eval_batch_size,
                          mean=t.choice_score == "mean", layer=layer)
    print(f"# {kind} task: {len(recs)} records ({int((~held).sum())} train, "
          f"{int(held.sum())} held out), {len(names)} trainable tensors, "
          f"{sum(m.params[n].size for n in names)} parameters, prefix cache from block "
          f"{layer} built in {time.perf_counter() - t0:.1f} s", flush=True)
    init = {n: m.params[n].copy() for n in names}
    return deck, m, names, init, task


def _defaults():
    from semzo.finetune import autolr
    return autolr.SAFETY, autolr.APART


SAFETY, APART = _defaults()          # the shipped values, before any configuration sets them


def parse_config(name: str) -> dict:
    """A named configuration of :data:`CONFIGS`, or ``key=value`` pairs joined by ``:``
    (keys estimator, dist, lr, schedule, min_lr_ratio, eps, directions, lora_a (train: the
    deck's default, or frozen), label_rows (exact, frozen, auto), guard: the loss
    guard's window, or auto, the default with lr auto; rollback: the held-out guard's
    tolerance, zo.lr_rollback, auto = 0.1 with lr auto as in a run), e.g.
    ``estimator=fzoo:dist=rademacher:lr=auto:schedule=cosine``. Keys left out (lr: 2e-2) or
    "auto" resolve from lr as a deck resolves them: lr auto gives fzoo, Rademacher z, cosine
    decay and both guards; a number MeZO, Gaussian z, a constant lr, no loss guard."""
    if name in CONFIGS:
        cfg = dict(CONFIGS[name])
    else:
        cfg = {"lr": 2e-2}
        for kv in name.split(":"):
            k, v = kv.split("=", 1)
            cfg[k] = v if k in ("estimator", "dist", "schedule", "lora_a", "label_rows",
                                "rows_warmup") or \
                v == "auto" \
                else float(v)
    # what a deck resolves from zo.lr when a key is left out or "auto" (deck/sections.py's
    # estimator_name, dist_name, lr_guard_name; loop.schedule_name)
    auto = cfg["lr"] == "auto"
    if cfg.get("estimator", "auto") == "auto":
        cfg["estimator"] = "fzoo" if auto else "mezo"
    if cfg.get("dist", "auto") == "auto":
        cfg["dist"] = "rademacher" if cfg["estimator"] == "fzoo" else "gaussian"
    if cfg.get("schedule", "auto") == "auto":
        cfg["schedule"] = "cosine" if auto else "constant"
    # (safety: autolr.SAFETY; apart=1: the line searches on a batch apart from the direction's)
    cfg.setdefault("guard", "auto" if auto else 0)
    cfg.setdefault("lora_a", "train")          # the deck's default: A and B train
    cfg.setdefault("rollback", "auto")
    # train.label_rows "auto": the label words' rows of the head train by their exact
    # gradient with lr auto (the prompt task), else they stay frozen
    if cfg.get("label_rows", "auto") == "auto":
        cfg["label_rows"] = "exact" if auto else "frozen"
    # train.label_rows_warmup "auto": 5 % of the steps train the rows alone (when they train)
    w = cfg.get("rows_warmup", "auto")
    cfg["rows_warmup"] = 0 if cfg["label_rows"] != "exact" else w if w == "auto" else int(w)
    return cfg


def run_one(deck, m, names, init, task, cfg: dict, seed: int, budget: int, batch: int,
            eval_every: int, early: tuple[int, int] = (0, 0)) -> dict:
    from zo_common import SoloTopo

    from semzo.finetune import autolr
    from semzo.finetune.autolr import guard_window
    from semzo.finetune.data import Batcher
    from semzo.finetune.loop import LoopConfig, TrainState, evaluate, train
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors
    autolr.SAFETY = float(cfg.get("safety", SAFETY))
    autolr.APART = bool(cfg.get("apart", APART))
    for n in names:                      # every adapter tensor back to its start, A included
        np.copyto(m.params[n], init[n])
    if cfg.get("lora_a") == "frozen":    # train.lora_a = "frozen": A stays at its start
        names = [n for n in names if not n.endswith(".lora_A.weight")]
    topo = SoloTopo()
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), topo, eps=float(cfg.get("eps", deck.zo.eps)),
                   run_seed=seed, estimator=cfg["estimator"], dist=cfg["dist"],
                   directions=int(cfg.get("directions", deck.zo.directions)),
                   schedule="three-pass")
    per = 2 if cfg["estimator"] == "mezo" else 1 + eng.dirs_per_group
    steps = budget // per
    warm = 0
    if getattr(task, "kind", "") == "prompt" and cfg["rows_warmup"]:
        # the warm-up's steps cost one forward pass each: as many steps as fill the budget
        from semzo.deck.read import auto_rows_warmup
        for _ in range(3):
            warm = auto_rows_warmup(steps) if cfg["rows_warmup"] == "auto" else \
                min(int(cfg["rows_warmup"]), steps)
            steps = warm + (budget - warm) // per
    ev = max(1, round(eval_every / per))
    curve = []
    t0 = time.perf_counter()
    eval_s = [0.0]
    # the label rows as the configuration has them, before the zero-shot evaluation (a run
    # before this one may have left its trained rows on the task)
    rows0 = np.zeros(0)
    if getattr(task, "kind", "") == "prompt" and cfg.get("label_rows") == "exact":
        from semzo.finetune.label_rows import LabelRows
        task.label_rows = LabelRows.of_model(m, task.word_ids, deck.train.label_rows_lr)
        rows0 = task.label_rows.pack()
    elif hasattr(task, "label_rows"):
        task.label_rows = None
    loss0, acc0, _ = evaluate(task, topo)
    curve.append((0, 0.0, loss0, acc0))

    # the held-out guard (zo.lr_rollback) as a run has it: the best held-out model (by
    # accuracy) kept, here in memory where a run keeps checkpoints/best.h5
    rb = cfg.get("rollback", "auto")
    tol = (0.1 if cfg["lr"] == "auto" else 0.0) if rb == "auto" else float(rb)
    best = {i: init[n].copy() for i, n in enumerate(names)}
    st0 = TrainState(run_seed=seed, best_step=0, best_acc=acc0, best_loss=loss0)
    st0.label_rows = rows0
    best_rows = [rows0.copy()]

    def on_eval(state, loss, acc):
        curve.append((state.forwards, time.perf_counter() - t0 - eval_s[0], loss, acc))
        if tol and state.better(loss, acc, "acc"):
            state.best_step, state.best_acc, state.best_loss = state.step, acc, loss
            for i, n in enumerate(names):
                np.copyto(best[i], m.params[n])
            best_rows[0] = state.label_rows.copy()

    # --early EVERY:UNTIL: besides the loop's evaluations, the held-out set after the first
    # step at which the forward passes reach each multiple of EVERY up to UNTIL (the curve
    # only: neither the best model nor the guards see them)
    marks = list(range(early[0], early[1] + 1, early[0])) if early[0] > 0 else []

    def on_step(state):
        if marks and state.forwards >= marks[0]:
            while marks and state.forwards >= marks[0]:
                marks.pop(0)
            eng.flush()
            te = time.perf_counter()
            wall = te - t0 - eval_s[0]
            loss, acc, _ = evaluate(task, topo)
            eval_s[0] += time.perf_counter() - te
            curve.append((state.forwards, wall, loss, acc))

    def on_rollback(state):
        eng.reload(best)
        state.label_rows = best_rows[0].copy()       # the loop hands them to the task

    b = Batcher(task.train_rows.size, batch, seed, 0)
    lc = LoopConfig(steps=steps, lr=cfg["lr"], eval_every=ev, log_every=10**9,
                    checksum_every=0, schedule=cfg.get("schedule", "constant"),
                    min_lr_ratio=float(cfg.get("min_lr_ratio", 0.0)),
                    guard=guard_window(cfg.get("guard", 0), steps), rollback=tol,
                    rows_warmup=warm)
    # the held-out evaluations' time is not the optimizer's: timed and subtracted
    import semzo.finetune.loop as loop_mod
    real_eval = loop_mod.evaluate

    def timed_eval(*a, **k):
        te = time.perf_counter()
        out = real_eval(*a, **k)
        eval_s[0] += time.perf_counter() - te
        return out

    loop_mod.evaluate = timed_eval
    try:
        st = train(eng, task, b, st0, lc, on_eval=on_eval, on_rollback=on_rollback,
                   on_step=on_step)
    finally:
        loop_mod.evaluate = real_eval
    wall = time.perf_counter() - t0 - eval_s[0]
    loss, acc, _ = evaluate(task, topo)
    curve.append((st.forwards, wall, loss, acc))
    curve.sort(key=lambda p: p[0])               # the early points among the loop's
    return {"seed": seed, "lr": st.base_lr, "steps": steps, "curve": curve,
            "rollbacks": st.rollbacks,
            "zero_acc": acc0, "zero_loss": loss0, "final_acc": acc, "final_loss": loss}


def torch_mezo_step_s(batch: int, threads: int, reps: int = 4) -> dict:
    """The MeZO-style torch step on the prompt task (see the module text), in this process:
    mean seconds per step over ``reps`` steps after one warm-up; and per forward pass."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from semzo.deck import load
    from semzo.preflight import default_label_words
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    deck = load(ROOT / "inputs" / "llm.toml", check_inputs=False)
    folder = ROOT / "models" / "smollm2-135m-instruct"
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    t = deck.train
    r, scale = t.lora_rank, t.lora_alpha / t.lora_rank

    class LoRA(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.A = torch.nn.Parameter(torch.randn(r, base.in_features) / base.in_features ** .5)
            self.B = torch.nn.Parameter(torch.zeros(base.out_features, r))

        def forward(self, x):
            return self.base(x) + scale * (x @ self.A.T) @ self.B.T

    layers = model.model.layers[-t.lora_layers:]
    for layer in layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    params = [p for layer in layers for m in (layer.self_attn.q_proj, layer.self_attn.v_proj)
              for p in (m.A, m.B)]
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    recs = [x for x in recs if x.get("label") in deck.corpus.labels][:batch]
    texts = [deck.prompt.template.format(text=x["text"]) for x in recs]
    tok.padding_side = tok.truncation_side = "left"    # semzo keeps a prompt's end too
    enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=t.max_length)
    words = [tok(w, add_special_tokens=False)["input_ids"][0] for w in (
        deck.prompt.label_words or default_label_words(list(deck.corpus.labels),
                                                       deck.prompt.template))]
    y = torch.tensor([deck.corpus.labels.index(x["label"]) for x in recs])
    eps, lr = deck.zo.eps, 2e-2

    def loss_fn():
        logits = model(**enc).logits[:, -1, words]
        return torch.nn.functional.cross_entropy(logits, y)

    def perturb(seed, s):
        g = torch.Generator().manual_seed(seed)
        for p in params:
            z = torch.normal(mean=0, std=1, size=p.data.size(), generator=g)
            p.data = p.data + s * eps * z

    def step(k):
        seed = 1000 + k
        with torch.no_grad():
            perturb(seed, 1)
            lp = loss_fn()
            perturb(seed, -2)
            lm = loss_fn()
            perturb(seed, 1)
            gk = float((lp - lm) / (2 * eps))
            g = torch.Generator().manual_seed(seed)
            for p in params:
                z = torch.normal(mean=0, std=1, size=p.data.size(), generator=g)
                p.data = p.data - lr * gk * z
    step(0)
    t0 = time.perf_counter()
    for k in range(reps):
        step(k + 1)
    st = (time.perf_counter() - t0) / reps
    return {"step_s": st, "pass_s": st / 2, "tokens": int(enc["input_ids"].shape[1]),
            "threads": threads}


def first_reach(curve, ok) -> tuple[float, float]:
    for fw, s, loss, acc in curve:
        if ok(loss, acc):
            return fw, s
    return math.nan, math.nan


_LINE = re.compile(r"^(\S+)\s+seed (\d+): lr (\S+), (\d+) steps,(?: \d+ rollbacks,)? acc (\S+) -> "
                   r"(\S+), loss (\S+) -> "
                   r"(\S+), (\S+) s; curve \(fw, acc, loss\): (.*)$")


def from_log(path: str) -> dict[str, list[dict]]:
    """The runs a (possibly cut short) earlier invocation printed: its per-run lines. The
    curve's wall times are the run's, spread in proportion to the forward passes."""
    res: dict[str, list[dict]] = {}
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        pts = [tuple(float(x) for x in p.split(",")) for p in re.findall(r"\(([^)]*)\)",
                                                                            m.group(10))]
        wall, fw_end = float(m.group(9)), pts[-1][0] or 1.0
        curve = [(fw, wall * fw / fw_end, loss, acc) for fw, acc, loss in pts]
        res.setdefault(m.group(1), []).append(
            {"seed": int(m.group(2)), "lr": float(m.group(3)), "steps": int(m.group(4)),
             "zero_acc": float(m.group(5)), "final_acc": float(m.group(6)),
             "zero_loss": float(m.group(7)), "final_loss": float(m.group(8)), "curve": curve})
    seeds = set.intersection(*[{r["seed"] for r in v} for v in res.values()]) if res else set()
    return {c: [r for r in v if r["seed"] in seeds] for c, v in res.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0,
                    help="run seeds first-seed .. first-seed + seeds - 1 (more seeds later)")
    ap.add_argument("--forwards", type=int, default=800)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=80)
    ap.add_argument("--configs", default="mezo-fixed,auto-fzoo")
    ap.add_argument("--early", default="", help="EVERY:UNTIL: also evaluate after the step "
                    "at which the forward passes reach each multiple of EVERY up to UNTIL "
                    "(finer figures to the targets early in the run)")
    ap.add_argument("--target-acc", default="+0.10")
    ap.add_argument("--target-loss", default="-0.30", help="absolute, or relative to the "
                    "zero-shot held-out loss when it starts with -")
    ap.add_argument("--texts", type=int, default=0, help="only the first N labelled texts")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--labels", default="", help="comma-separated fortune categories other "
                    "than the deck's (data it was not tuned on)")
    ap.add_argument("--label-words", default="", help="with --labels: comma-separated words "
                    "for the labels, in their order, each given a leading space (red,green,"
                    "blue: words the model has no prior for)")
    ap.add_argument("--template", default="", help="the prompt template for --labels "
                    "(default: the deck's)")
    ap.add_argument("--task", default="prompt", choices=("prompt", "sft", "choice"),
                    help="prompt: inputs/llm.toml's task; sft: inputs/sft.toml's (chat records "
                    "of data/debian-sft.jsonl; accuracy = completion-token accuracy); choice: "
                    "inputs/choice.toml's (data/debian-choice.jsonl)")
    ap.add_argument("--corpus", default="", help="--task sft / choice: another JSONL corpus of "
                    "the task's records than the deck's (data it was not tuned on)")
    ap.add_argument("--torch-peer", action="store_true", help="prompt task: time the "
                    "MeZO-style torch step (the wall-time peer) in a child process")
    ap.add_argument("--torch-step", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default="")
    ap.add_argument("--from-log", default="", help="summarize the per-run lines of an earlier "
                    "invocation's output (the seeds every configuration finished)")
    a = ap.parse_args()
    if a.torch_step:                  # the child of --torch-peer
        print(json.dumps(torch_mezo_step_s(a.batch, a.threads or 1)))
        return
    if a.from_log:
        res = from_log(a.from_log)
        summarize(res, list(res), a)
        if a.torch_peer and "mezo-fixed" in res:
            torch_peer(res, a)
        return
    if a.threads:
        import numba
        numba.set_num_threads(a.threads)
    from semzo.runtime import get_logger
    get_logger("semzo").setLevel("WARNING")
    if a.task in ("sft", "choice"):
        deck, m, names, init, task = build_records(a.task, a.texts, a.corpus)
    else:
        deck, m, names, init, task = build(
            a.texts, a.labels.split(",") if a.labels else None, a.template,
            [" " + w for w in a.label_words.split(",")] if a.label_words else None)
    configs = a.configs.split(",")
    early = tuple(int(x) for x in a.early.split(":")) if a.early else (0, 0)
    res: dict[str, list[dict]] = {c: [] for c in configs}
    for seed in range(a.first_seed, a.first_seed + a.seeds):
        for c in configs:
            r = run_one(deck, m, names, init, task, parse_config(c), seed, a.forwards, a.batch,
                        a.eval_every, early)
            res[c].append(r)
            print(f"{c:11s} seed {seed}: lr {r['lr']:.3g}, {r['steps']} steps, "
                  f"{r['rollbacks']} rollbacks, acc "
                  f"{r['zero_acc']:.3f} -> {r['final_acc']:.3f}, loss {r['zero_loss']:.3f} -> "
                  f"{r['final_loss']:.3f}, {r['curve'][-1][1]:.1f} s; curve (fw, acc, loss): "
                  + " ".join(f"({fw},{acc:.3f},{loss:.3f})" for fw, _, loss, acc in r["curve"]),
                  flush=True)
    summarize(res, configs, a)
    if a.torch_peer and "mezo-fixed" in configs:
        torch_peer(res, a)
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))


def torch_peer(res: dict[str, list[dict]], a) -> None:
    """Print the torch MeZO step's time per pass and its wall time to the targets."""
    import os
    import subprocess
    threads = a.threads or len(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, __file__, "--torch-step", "--batch", str(a.batch),
                          "--threads", str(threads)], capture_output=True, text=True,
                         check=True)
    tp = json.loads(out.stdout.strip().splitlines()[-1])
    zero = res["mezo-fixed"][0]["zero_acc"]
    tacc = zero + float(a.target_acc) if a.target_acc.startswith("+") else float(a.target_acc)
    mz = [first_reach(r["curve"], lambda loss, acc: acc >= tacc) for r in res["mezo-fixed"]]
    fw = [x[0] for x in mz if math.isfinite(x[0])]
    sem = [r["curve"][-1][1] / max(r["curve"][-1][0], 1) for r in res["mezo-fixed"]]
    print(f"\ntorch MeZO peer ({tp['threads']} threads, batch {a.batch}, {tp['tokens']} "
          f"tokens): {tp['step_s']:.3f} s per step = {tp['pass_s']:.3f} s per forward pass; "
          f"semzo's mezo-fixed {np.mean(sem):.3f} s per pass (frozen-prefix cache): "
          f"{tp['pass_s'] / np.mean(sem):.1f}x")
    if not fw:
        print("torch MeZO: mezo-fixed never reached the accuracy target: no wall time")
        return
    tw = float(np.mean(fw)) * tp["pass_s"]
    for c, runs in res.items():
        if c == "mezo-fixed":
            continue
        ours = [first_reach(r["curve"], lambda loss, acc: acc >= tacc)[1] for r in runs]
        ours = [x for x in ours if math.isfinite(x)]
        if ours:
            print(f"wall time to the accuracy target: torch MeZO {tw:.1f} s (mezo-fixed's "
                  f"{np.mean(fw):.0f} passes x {tp['pass_s']:.3f} s) against {c} "
                  f"{np.mean(ours):.1f} s: {tw / np.mean(ours):.2f}x")


def _median_passes(runs: list[dict], tacc: float) -> float:
    """Median over the seeds of the forward passes to ``tacc``, a seed that never reached it
    counted as infinitely many (so a configuration that reaches it in fewer than half of the
    seeds has no finite median: the ratio of means over the seeds that reached it flatters
    such a configuration)."""
    fw = [first_reach(r["curve"], lambda loss, acc: acc >= tacc)[0] for r in runs]
    return float(np.median([x if math.isfinite(x) else math.inf for x in fw]))


def summarize(res: dict[str, list[dict]], configs: list[str], a) -> None:
    n_seeds = len(res[configs[0]])
    zero = res[configs[0]][0]["zero_acc"]
    tacc = zero + float(a.target_acc) if a.target_acc.startswith("+") else float(a.target_acc)
    zl = res[configs[0]][0]["zero_loss"]
    tl = str(a.target_loss)
    tloss = zl + float(tl) if tl.startswith("-") else float(tl)
    print(f"\n## {n_seeds} seeds, {a.forwards} forward passes of {a.batch} prompts per run; "
          f"targets: held-out accuracy >= {tacc:.3f} (zero-shot {zero:.3f}), held-out loss "
          f"<= {tloss:.3f} (zero-shot {zl:.3f})\n")
    print("| config | final acc (mean +- sd) | final loss | fw to acc target | s to acc "
          "target | reached | fw to loss target | s to loss target | reached |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = {}
    for c in configs:
        rs = res[c]
        fa = np.array([r["final_acc"] for r in rs])
        fl = np.array([r["final_loss"] for r in rs])
        ra = [first_reach(r["curve"], lambda loss, acc: acc >= tacc) for r in rs]
        rl = [first_reach(r["curve"], lambda loss, acc: loss <= tloss) for r in rs]

        def mean_reached(xs, i):
            v = [x[i] for x in xs if math.isfinite(x[i])]
            return float(np.mean(v)) if v else math.nan
        rows[c] = (mean_reached(ra, 0), mean_reached(ra, 1), mean_reached(rl, 0),
                   mean_reached(rl, 1))
        print(f"| {c} | {fa.mean():.3f} +- {fa.std(ddof=1) if len(fa) > 1 else 0:.3f} | "
              f"{fl.mean():.3f} | {rows[c][0]:.0f} | {rows[c][1]:.1f} | "
              f"{sum(math.isfinite(x[0]) for x in ra)}/{len(rs)} | {rows[c][2]:.0f} | "
              f"{rows[c][3]:.1f} | {sum(math.isfinite(x[0]) for x in rl)}/{len(rs)} |")
    base = configs[0]
    med = {c: _median_passes(res[c], tacc) for c in configs}
    for c in configs[1:]:
        r = med[base] / med[c] if math.isfinite(med[c]) else math.nan
        print(f"\nmedian forward passes to the accuracy target over all seeds (a seed that "
              f"never reached it counts as never): {base} {med[base]:.0f}, {c} {med[c]:.0f}: "
              f"{r:.2f}x")
        print(f"\n{base} / {c}: forward passes to the accuracy target "
              f"{rows[base][0] / rows[c][0]:.2f}x, wall {rows[base][1] / rows[c][1]:.2f}x; "
              f"to the loss target {rows[base][2] / rows[c][2]:.2f}x, wall "
              f"{rows[base][3] / rows[c][3]:.2f}x (means over the seeds that reached it)")
        d = np.array([r["final_acc"] for r in res[c]]) - np.array(
            [r["final_acc"] for r in res[base]])
        print(f"paired final accuracy {c} - {base} per seed: "
              + " ".join(f"{x:+.3f}" for x in d)
              + f"; mean {d.mean():+.3f}"
              + (f", sd {d.std(ddof=1):.3f}" if len(d) > 1 else ""))
        best = np.array([max(p[3] for p in r["curve"]) for r in res[c]])
        bbase = np.array([max(p[3] for p in r["curve"]) for r in res[base]])
        print(f"best held-out accuracy on the curve (what best.h5 keeps): {c} "
              f"{best.mean():.3f}, {base} {bbase.mean():.3f}; paired {c} - {base}: "
              + " ".join(f"{x:+.3f}" for x in best - bbase))


if __name__ == "__main__":
    main()
