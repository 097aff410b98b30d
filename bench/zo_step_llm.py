"""The ZO step on SmolLM2-135M-Instruct (``bench/zo_step.py --model smollm2``), LoRA and full
(issue 15's SmolLM2 figures; issue 14's LoRA figures).

    .venv/bin/python bench/zo_step.py --model smollm2 [--threads 2] [--batch 16] [--length 64]
                                      [--reps 3] [--sets lora,all] [--fill]

Loss: the next-token loss of a batch of the first ``--batch`` fortunes (SmolLM2's tokenizer,
padded to ``--length``; padding excluded: semzo skips padded rows, torch computes them as
MeZO's trainer does), or with ``--fill`` of ``--batch`` rows of ``--length`` consecutive
tokens of the fortunes (no padding: the figure without semzo's padding skip). Trainable sets: LoRA rank 8 on q_proj and v_proj of
every block (MeZO's choice, 460,800 parameters) and every parameter (134.5M). The semzo step is
the default block-streamed schedule (``zo.schedule = "streamed"``: the next-token task run stage
by stage, tied head) with Gaussian z; the three-pass step is timed too. Printed, each for both
sets:

1. semzo step time / (2 x semzo forward time) on that batch (issue 15's goal: <= 1.10 for the
   full model), streamed and three-pass; forward, streamed step and three-pass step run
   interleaved, ``--reps`` rounds after a warm-up round, best of each; the streamed step
   without the z cache (``zo.cache_z = false``) in the same rounds, and both passes over the
   stages the cache covers with and without it (interleaved, best of each);
2. semzo step vs a MeZO-style torch step (MeZO's trainer order, out of place like MeZO's
   trainer: perturb +eps with ``torch.normal`` per tensor, loss, -2 eps, loss, +eps restore,
   update with z regenerated from the seed), same model (transformers' LlamaForCausalLM from
   the same folder; LoRA by a small wrapper, B @ A added to q/v as PEFT does), same batch and
   threads;
3. the z floor: the fewest z a two-pass step that keeps no z between steps makes (two per
   trainable element), generated alone (bench/zo_pass.py), and the ratio that leaves;
4. with the full set, MeZO's prompt task (inputs/llm.toml's template and label words; tied
   head, whose loss reads only the label words' rows): the streamed step deferring the
   embedding rows neither prompts nor label words read, against every row, in alternating
   pairs (the same bits), and its step / (2 x forward);
5. memory, each in a fresh process: the transient peak above the parameters (tracemalloc:
   numpy's allocations) of a forward and of a streamed ZO step, (parameters + step peak) /
   (parameters + forward peak) (issue 15's goal: <= 1.15), what the lockstep's second branch
   state adds, and the RSS footprints (peak RSS during the operation minus the RSS before the
   model is loaded).

torch runs in processes of its own (its and numba's thread pools slow each other down).
Timings on a shared machine are noisy: say so when reporting.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPS, LR = 1e-3, 1e-7
RANK, ALPHA = 8, 16.0


def llm_batch(n: int, length: int, fill: bool = False):
    """The first ``n`` fortunes, each padded (or cut) to ``length`` tokens; ``fill``: ``n`` rows
    of ``length`` consecutive tokens of the fortunes one after the other (no padding)."""
    import numpy as np

    from semzo.model import Tokenizer

    tok = Tokenizer.from_folder("smollm2", max_length=length)
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        if not fill:
            texts = [json.loads(line)["text"] for line, _ in zip(f, range(n))]
            return tok.pad(tok.encode_batch(texts), length)
        stream = []
        for line in f:
            stream.extend(int(i) for i in tok.encode_batch([json.loads(line)["text"]])[0])
            if len(stream) >= n * length:
                break
    ids = np.asarray(stream[:n * length], np.int64).reshape(n, length)
    return ids, np.ones_like(ids)


def semzo_llm(which: str, threads: int, schedule: str = "streamed", dtype: str = "float32",
              matmul: str = "float32"):
    from zo_step import Solo

    from semzo.backend import set_threads
    from semzo.finetune.trainable import select_trainable
    from semzo.model import load_model
    from semzo.model import set_threads as split_forwards
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors

    set_threads(threads)

    split_forwards(threads)
    m = load_model("smollm2", dtype=dtype)
    m.set_matmul(matmul)
    names = select_trainable(m, "lora" if which == "lora" else "all", lora_rank=RANK,
                             lora_alpha=ALPHA)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), Solo(), eps=EPS,
                   threads=threads, dist="gaussian", schedule=schedule)
    return m, eng


def llm_step_fn(m, eng, ids, mask):
    """One ZO step of ``eng``'s schedule per call (fresh step index): the next-token task
    (stage interface for the streamed step) on the fixed batch. Also returns the task and
    batch."""
    import numpy as np

    from semzo.tasks.lm import LMTask
    from semzo.zo.streamed import step_streamed
    none = np.zeros(0, np.int64)
    task = LMTask(m, [], none, none, none, 0, 16)
    b = (ids, mask, None, len(ids))
    n = task.batch_weight(b)
    k = [0]

    def zo():
        k[0] += 1
        if eng.schedule == "streamed":
            step_streamed(eng, task, b, k[0], LR, n)
        else:
            eng.step(lambda: task.loss(b), k[0], LR, n)
    return zo, task, b


def torch_llm(which: str, threads: int, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    from semzo.model.zoo import resolve_model_path

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path("smollm2")),
                                                 dtype=getattr(torch, dtype)).eval()
    if which != "lora":
        return torch, model, [(n, p) for n, p in model.named_parameters()]

    class LoraLinear(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            dt = base.weight.dtype
            self.lora_A = torch.nn.Parameter(torch.empty(RANK, base.in_features, dtype=dt)
                                             .uniform_(-base.in_features ** -0.5,
                                                       base.in_features ** -0.5))
            self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, RANK, dtype=dt))

        def forward(self, x):
            return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * (ALPHA / RANK)

    params = []
    for i, layer in enumerate(model.model.layers):
        for p in ("q_proj", "v_proj"):
            w = LoraLinear(getattr(layer.self_attn, p))
            setattr(layer.self_attn, p, w)
            params += [(f"{i}.{p}.lora_A", w.lora_A), (f"{i}.{p}.lora_B", w.lora_B)]
    return torch, model, params


def torch_loss_fn(torch, model, ids, mask):
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
    labels = tids.masked_fill(tmask == 0, -100)
    return lambda: model(input_ids=tids, attention_mask=tmask, labels=labels).loss


def llm_timings(args, which: str) -> dict:
    ids, mask = llm_batch(args.batch, args.length, args.fill)
    m, eng = semzo_llm(which, args.threads, dtype=args.dtype, matmul=args.matmul)

    zo, task, b = llm_step_fn(m, eng, ids, mask)

    def streamed():
        eng.schedule, eng.cache_z = "streamed", True
        zo()

    def streamed_nocache():               # zo.cache_z = false: pass 2 generates z again
        eng.schedule, eng.cache_z = "streamed", False
        zo()

    def three_pass():
        eng.flush()                       # outside the timing: the streamed step's update
        eng.schedule = "three-pass"
        return zo
    # interleaved (forward, streamed step with and without the z cache, three-pass) x reps, best of each: a machine
    # whose load drifts during the run biases the three figures alike
    fwd = step = step3 = stepn = float("inf")
    for r in range(args.reps + 1):        # round 0: warm-up
        tf = best_once(lambda: m.next_token_loss(ids, mask))
        ts = best_once(streamed)
        tn = best_once(streamed_nocache)
        t3 = best_once(three_pass())
        if r:
            fwd, step, step3 = min(fwd, tf), min(step, ts), min(step3, t3)
            stepn = min(stepn, tn)
    eng.flush()
    pw, pwo, pn = cached_stage_passes(eng, task, args.reps)
    st = task.stage_begin(b)
    for k in range(task.stage_count()):
        st = task.stage_run(k, st)
    n = eng.n_trainable
    from zo_step import z_floor
    # the next-token loss reads every row of the tied embedding: no row can be deferred
    floor = z_floor(2 * n, args.threads, args.reps)
    t = _child(args, "--llm-torch", which)
    zc = eng._zcache
    return {"semzo_forward_s": fwd, "semzo_step_s": step, "semzo_step_3pass_s": step3,
            "semzo_step_nocache_s": stepn, "zcache_bytes": 4 * zc[1].elements if zc else 0,
            "passes_cached_s": pw, "passes_regen_s": pwo, "cached_elements": pn,
            "trainable": n, "branch_state_bytes": st.nbytes_live(),
            "padding": 1.0 - float(mask.mean()), "z_floor": floor, **t}


PROMPT_LABELS = ("food", "love", "sports")          # inputs/llm.toml's task
PROMPT_TEMPLATE = "{text}\nThis quote is about"


def prompt_pair(args) -> dict:
    """MeZO's prompt task (inputs/llm.toml's template and label words, the first ``--batch``
    fortunes of its three categories, at most ``--length`` prompt tokens), every parameter
    trained, tied head: the streamed step deferring the embedding rows neither the prompts nor
    the label words read, against every row in both passes (``engine.defer_rows``; the same
    bits), timed in alternating pairs (2 x ``--reps`` rounds after a warm-up; each step after
    a flush and an untimed step, so both carry a pending update), and the task's forward."""
    import numpy as np
    from zo_step import deferral_pairs

    from semzo.model import Tokenizer
    from semzo.preflight import label_word_ids
    from semzo.tasks.prompt import PromptTask, encode_prompts
    from semzo.zo.streamed import step_streamed

    m, eng = semzo_llm("all", args.threads, dtype=args.dtype, matmul=args.matmul)
    tok = Tokenizer.from_folder("smollm2", max_length=None)
    tok.tk.no_truncation()
    texts, labels = [], []
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r.get("label") in PROMPT_LABELS and len(texts) < args.batch:
                texts.append(r["text"])
                labels.append(PROMPT_LABELS.index(r["label"]))
    wid = label_word_ids(tok, list(PROMPT_LABELS), [], PROMPT_TEMPLATE, "bench")
    seqs = encode_prompts(tok, texts, PROMPT_TEMPLATE, args.length,
                          int(m.config.max_positions), "bench")
    n = len(seqs)
    task = PromptTask(m, seqs, np.array(labels), np.arange(n), np.arange(n), 0, n, wid)
    b = task.batch(np.arange(n))
    k = [0]

    def zo():
        k[0] += 1
        step_streamed(eng, task, b, k[0], LR, n)
    pair = deferral_pairs(eng, zo, 2 * args.reps, fwd=lambda: task.loss(b))
    rows = task.stage_rows(b)[m.head_weight_name()]
    return {"n": n, "tokens": int(b[1].sum()), "padding": 1.0 - float(b[1].mean()),
            "rows": int(rows.size), "vocab": int(m.params[m.head_weight_name()].shape[0]),
            "fwd": float(np.min(pair["fwd"])),
            "passes": [float(np.median(pair["pass"][f])) for f in (True, False)],
            **{k: [float(np.min(pair[f])), float(np.median(pair[f]))]
               for k, f in (("deferred", True), ("every_row", False))}}


def cached_stage_passes(eng, task, reps: int) -> tuple[float, float, int]:
    """Seconds of both passes (+eps z, then -2 eps z) over the stages the z cache covers, with
    the cache and regenerating (best of ``reps`` interleaved rounds after a warm-up), and the
    number of elements those stages hold."""
    from semzo.zo import streamed as S
    from semzo.zo.streamed import stage_groups
    groups = stage_groups(eng, task)
    eng.cache_z = True
    cache = S.zcache_for(eng, task, groups, bool(task.tied_head) and bool(groups[0]))
    ks = sorted(cache.stages)
    n = sum(int(eng.tensors[i].array.size) for k in ks for i in groups[k])

    def both(use: bool) -> float:
        t = 0.0
        for k in ks:
            zc = cache.views(k, [eng.tensors[i] for i in groups[k]]) if use else None
            t += best_once(lambda k=k, zc=zc: (S.first_pass(eng, groups[k], 7, None, zc),
                                               S.second_pass(eng, groups[k], 7, None, zc)))
        return t
    eng.flush()
    w = wo = float("inf")
    for r in range(reps + 1):
        a, b = both(True), both(False)
        if r:
            w, wo = min(w, a), min(wo, b)
    return w, wo, n


def best_once(f) -> float:
    """Seconds of one call of ``f``."""
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def llm_torch_times(args, which: str) -> None:
    from zo_step import best, mezo_step

    ids, mask = llm_batch(args.batch, args.length, args.fill)
    torch, model, params = torch_llm(which, args.threads, args.dtype)
    loss = torch_loss_fn(torch, model, ids, mask)
    with torch.no_grad():
        fwd = best(loss, args.reps)
    j = [0]

    def step():
        j[0] += 1
        mezo_step(torch, params, loss, j[0])
    print("JSON " + json.dumps({"torch_forward_s": fwd, "mezo_torch_step_s": best(step,
                                                                                   args.reps)}))


def llm_mem_child(args, what: str) -> None:
    import tracemalloc

    import numba  # noqa: F401 - imported before the baseline
    from zo_step import _reset_peak, _status

    ids, mask = llm_batch(args.batch, args.length, args.fill)
    rss0 = _status("VmRSS")
    which = "lora" if what.endswith("lora") else "all"
    m, eng = semzo_llm(which, args.threads, dtype=args.dtype, matmul=args.matmul)
    pb = sum(a.nbytes for a in m.params.values())
    if what.startswith("fwd"):
        def op():
            m.next_token_loss(ids, mask)
    else:
        op = llm_step_fn(m, eng, ids, mask)[0]
    op()
    tracemalloc.start()
    t0 = tracemalloc.get_traced_memory()[0]
    _reset_peak()
    op()
    peak = _status("VmHWM")
    traced = tracemalloc.get_traced_memory()[1] - t0
    tracemalloc.stop()
    print("JSON " + json.dumps({"param_bytes": pb, "footprint_bytes": peak - rss0,
                                "traced_peak_bytes": traced}))


def _child(args, flag: str, value: str) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "zo_step.py"), "--model",
                        "smollm2", flag, value, "--threads", str(args.threads), "--batch",
                        str(args.batch), "--length", str(args.length), "--reps",
                        str(args.reps), "--dtype", args.dtype, "--matmul", args.matmul]
                       + (["--fill"] if args.fill else []),
                       capture_output=True, text=True, timeout=1800,
                       check=False)
    line = [x for x in p.stdout.splitlines() if x.startswith("JSON ")]
    if not line:
        raise RuntimeError(f"{flag} {value} failed:\n{p.stderr[-3000:]}")
    return json.loads(line[0][5:])


def llm_main(args) -> None:
    """``--model smollm2``: both trainable sets, then the memory figures."""
    if args.llm_torch:
        llm_torch_times(args, args.llm_torch)
        return
    if args.llm_mem:
        llm_mem_child(args, args.llm_mem)
        return
    mib = 2.0 ** 20
    bad = set(args.sets.split(",")) - {"lora", "all"}
    if bad:
        raise SystemExit(f"--sets: unknown trainable set(s) {', '.join(sorted(bad))} "
                         f"(lora, all)")
    branch, zcache = {}, {}
    for which in args.sets.split(","):
        t = llm_timings(args, which)
        branch[which] = t["branch_state_bytes"]
        fw, step, s3 = t["semzo_forward_s"], t["semzo_step_s"], t["semzo_step_3pass_s"]
        r = step / (2 * fw)
        sp = t["mezo_torch_step_s"] / step
        print(f"ZO step, SmolLM2-135M-Instruct, {which} ({t['trainable']:,} trainable), "
              f"weights {args.dtype}, semzo model.matmul {args.matmul}, "
              f"batch {args.batch} x {args.length} tokens ({t['padding']:.0%} padding), "
              f"{args.threads} threads, Gaussian z, best of {args.reps}")
        print(f"  schedule streamed (the default): semzo forward {fw:.3f} s, step {step:.3f} s: "
              f"step / (2 x forward) = {r:.3f}" + (" (goal <= 1.10)" if which == "all" else ""))
        print(f"  schedule three-pass: step {s3:.3f} s, ratio {s3 / (2 * fw):.3f}; streamed / "
              f"three-pass = {step / s3:.3f}")
        sn = t["semzo_step_nocache_s"]
        zcache[which] = t["zcache_bytes"]
        print(f"  z cache (zo.cache_z, pass 2 reads pass 1's z; {zcache[which] / mib:.1f} MiB): "
              f"streamed step {step:.3f} s with, {sn:.3f} s without (ratio {sn / (2 * fw):.3f}); "
              f"both passes over the {t['cached_elements']:,} elements it covers "
              f"{t['passes_cached_s'] * 1e3:.0f} ms with, {t['passes_regen_s'] * 1e3:.0f} ms "
              f"without")
        zf = t["z_floor"]
        print(f"  z floor: at least {zf['count']:,} z per step (two per trainable element: the "
              f"last update's and this step's), made alone: Gaussian "
              f"{zf['gaussian'] * 1e3:.0f} ms, gaussian-fast {zf['gaussian-fast'] * 1e3:.0f} ms; "
              f"so step / (2 x forward) >= {1 + zf['gaussian'] / (2 * fw):.3f} with Gaussian "
              f"z, {1 + zf['gaussian-fast'] / (2 * fw):.3f} gaussian-fast, on this machine")
        print(f"  peer MeZO-style torch step {t['mezo_torch_step_s']:.3f} s (torch forward "
              f"{t['torch_forward_s']:.3f} s): semzo is {sp:.2f}x faster")
    if "all" in args.sets.split(","):
        p = prompt_pair(args)
        (db, dm), (ab, am) = p["deferred"], p["every_row"]
        print(f"ZO step, SmolLM2-135M-Instruct, all, MeZO's prompt task (inputs/llm.toml's "
              f"template and label words, {p['n']} fortunes, {p['tokens']} tokens, "
              f"{p['padding']:.0%} padding), tied head: the prompts and label words read "
              f"{p['rows']} of {p['vocab']} embedding rows; paired, alternating "
              f"({2 * args.reps} rounds)")
        print(f"  deferring the other rows {db:.3f} s best, {dm:.3f} s median; every row in "
              f"both passes {ab:.3f} s best, {am:.3f} s median: {ab / db:.3f}x best, "
              f"{am / dm:.3f}x median; forward {p['fwd']:.3f} s, step / (2 x forward) = "
              f"{db / (2 * p['fwd']):.3f} deferring, {ab / (2 * p['fwd']):.3f} every row")
        p1, p0 = p["passes"]
        print(f"  the step's parameter passes alone (time in the kernel launches, median): "
              f"{p1 * 1e3:.0f} ms deferring, {p0 * 1e3:.0f} ms every row: "
              f"{(p0 - p1) * 1e3:.0f} ms less per step")
    for which in args.sets.split(","):
        f = _child(args, "--llm-mem", f"fwd-{which}")
        s = _child(args, "--llm-mem", f"step-{which}")
        pb, fa, sa = s["param_bytes"], f["traced_peak_bytes"], s["traced_peak_bytes"]
        zb = zcache[which]
        print(f"  memory ({which}, streamed step): parameters {pb / mib:.0f} MiB; transient "
              f"peak above the parameters (tracemalloc): forward {fa / mib:.1f} MiB, ZO step "
              f"{sa / mib:.1f} MiB, z cache {zb / mib:.1f} MiB (kept); (parameters + ZO step "
              f"peak + z cache) / (parameters + forward peak) = {(pb + sa + zb) / (pb + fa):.3f} "
              f"(goal <= 1.15); the second branch state adds {branch[which] / mib:.2f} MiB")
        print(f"    RSS footprint (peak RSS minus RSS before the model): forward "
              f"{f['footprint_bytes'] / mib:.0f} MiB, ZO step {s['footprint_bytes'] / mib:.0f} "
              f"MiB: ratio {s['footprint_bytes'] / f['footprint_bytes']:.3f}")


def add_args(ap) -> None:
    ap.add_argument("--model", default="minilm", choices=("minilm", "smollm2"),
                    help="smollm2: the SmolLM2 benchmark (bench/zo_step_llm.py)")
    ap.add_argument("--sets", default="lora,all",
                    help="smollm2: trainable sets to measure (comma-separated: lora, all)")
    ap.add_argument("--fill", action="store_true",
                    help="smollm2: rows of consecutive tokens, no padding (default: one "
                         "fortune per row, padded)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="smollm2: weight storage of semzo's model and torch's (torch then "
                         "computes in bfloat16)")
    ap.add_argument("--matmul", default="float32", choices=("float32", "bfloat16"),
                    help="smollm2: semzo's model.matmul (bfloat16 needs --dtype bfloat16)")
    ap.add_argument("--llm-torch", default=None, help=__import__("argparse").SUPPRESS)
    ap.add_argument("--llm-mem", default=None, help=__import__("argparse").SUPPRESS)
