"""The ZO step on SmolLM2-135M-Instruct (``bench/zo_step.py --model smollm2``), LoRA and full.

    .venv/bin/python bench/zo_step.py --model smollm2 [--threads 2] [--batch 4] [--length 32]

Loss: the next-token loss of a batch of the first ``--batch`` fortunes (SmolLM2's tokenizer,
padded to ``--length``; padding excluded). Trainable sets: LoRA rank 8 on q_proj and v_proj of
every block (MeZO's choice, 460,800 parameters) and every parameter (134.5M). Printed, each for
both sets:

1. semzo step time / (2 x semzo forward time) on that batch;
2. semzo step vs a MeZO-style torch step (MeZO's trainer order, in place: perturb +eps with
   ``torch.normal`` per tensor, loss, -2 eps, loss, +eps restore, update with z regenerated
   from the seed), same model (transformers' LlamaForCausalLM from the same folder; LoRA by a
   small wrapper, B @ A added to q/v as PEFT does), same batch and threads;
3. peak memory: the RSS footprint (peak RSS during the operation minus the RSS before the
   model is loaded) of a semzo ZO step against parameters + one forward (the footprint of a
   forward), each in a fresh process.

torch runs in processes of its own (its and numba's thread pools slow each other down).
Timings on a shared machine are noisy: say so when reporting.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EPS, LR = 1e-3, 1e-7
RANK, ALPHA = 8, 16.0


def llm_batch(n: int, length: int):
    from semzo.model import Tokenizer

    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line, _ in zip(f, range(n))]
    tok = Tokenizer.from_folder("smollm2", max_length=length)
    return tok.pad(tok.encode_batch(texts), length)


def semzo_llm(which: str, threads: int):
    from zo_step import Solo

    from semzo.backend import set_threads
    from semzo.finetune.engine import ZOEngine, ztensors
    from semzo.finetune.stage import select_trainable
    from semzo.model import load_model

    set_threads(threads)
    m = load_model("smollm2")
    names = select_trainable(m, "lora" if which == "lora" else "all", lora_rank=RANK,
                             lora_alpha=ALPHA)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), Solo(), eps=EPS,
                   threads=threads)
    return m, eng


def torch_llm(which: str, threads: int):
    import torch
    from transformers import AutoModelForCausalLM

    from semzo.model.zoo import resolve_model_path

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model_path("smollm2")),
                                                 dtype=torch.float32).eval()
    if which != "lora":
        return torch, model, [(n, p) for n, p in model.named_parameters()]

    class LoraLinear(torch.nn.Module):
        def __init__(self, base):
            super().__init__()
            self.base = base
            self.lora_A = torch.nn.Parameter(torch.empty(RANK, base.in_features).uniform_(
                -base.in_features ** -0.5, base.in_features ** -0.5))
            self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, RANK))

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
    from zo_step import best

    ids, mask = llm_batch(args.batch, args.length)
    m, eng = semzo_llm(which, args.threads)

    def loss():
        return m.next_token_loss(ids, mask)
    fwd = best(loss, args.reps)
    k = [0]

    def zo():
        k[0] += 1
        eng.step(loss, k[0], LR, args.batch)
    step = best(zo, args.reps)
    n = eng.n_trainable
    t = _child(args, "--llm-torch", which)
    return {"semzo_forward_s": fwd, "semzo_step_s": step, "trainable": n, **t}


def llm_torch_times(args, which: str) -> None:
    from zo_step import best, mezo_step

    ids, mask = llm_batch(args.batch, args.length)
    torch, model, params = torch_llm(which, args.threads)
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
    import numba  # noqa: F401 - imported before the baseline
    from zo_step import _reset_peak, _status

    ids, mask = llm_batch(args.batch, args.length)
    rss0 = _status("VmRSS")
    which = "lora" if what.endswith("lora") else "all"
    m, eng = semzo_llm(which, args.threads)
    pb = sum(a.nbytes for a in m.params.values())

    def loss():
        return m.next_token_loss(ids, mask)
    if what.startswith("fwd"):
        op = loss
    else:
        def op():
            eng.step(loss, 1, LR, args.batch)
    op()
    _reset_peak()
    op()
    print("JSON " + json.dumps({"param_bytes": pb, "footprint_bytes": _status("VmHWM") - rss0}))


def _child(args, flag: str, value: str) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "zo_step.py"), "--model",
                        "smollm2", flag, value, "--threads", str(args.threads), "--batch",
                        str(args.batch), "--length", str(args.length), "--reps",
                        str(args.reps)], capture_output=True, text=True, timeout=1800,
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
    for which in ("lora", "all"):
        t = llm_timings(args, which)
        r = t["semzo_step_s"] / (2 * t["semzo_forward_s"])
        sp = t["mezo_torch_step_s"] / t["semzo_step_s"]
        print(f"ZO step, SmolLM2-135M-Instruct, {which} ({t['trainable']:,} trainable), "
              f"batch {args.batch} x {args.length} tokens, {args.threads} threads, best of "
              f"{args.reps}")
        print(f"  semzo forward {t['semzo_forward_s']:.3f} s, step {t['semzo_step_s']:.3f} s: "
              f"step / (2 x forward) = {r:.3f}")
        print(f"  peer MeZO-style torch step {t['mezo_torch_step_s']:.3f} s (torch forward "
              f"{t['torch_forward_s']:.3f} s): semzo / torch step time = "
              f"{t['semzo_step_s'] / t['mezo_torch_step_s']:.2f} (semzo {sp:.2f}x faster)")
    for which in ("lora", "all"):
        f = _child(args, "--llm-mem", f"fwd-{which}")
        s = _child(args, "--llm-mem", f"step-{which}")
        print(f"  memory ({which}): parameters {s['param_bytes'] / mib:.0f} MiB; footprint of "
              f"one forward (parameters + activations) {f['footprint_bytes'] / mib:.0f} MiB, "
              f"of a ZO step {s['footprint_bytes'] / mib:.0f} MiB: ratio "
              f"{s['footprint_bytes'] / f['footprint_bytes']:.3f}")


def add_args(ap) -> None:
    ap.add_argument("--model", default="minilm", choices=("minilm", "smollm2"),
                    help="smollm2: the SmolLM2 benchmark (bench/zo_step_llm.py)")
    ap.add_argument("--llm-torch", default=None, help=__import__("argparse").SUPPRESS)
    ap.add_argument("--llm-mem", default=None, help=__import__("argparse").SUPPRESS)
