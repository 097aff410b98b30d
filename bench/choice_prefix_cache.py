"""ZO step time of the ``choice`` task with and without the frozen-prefix cache (issue 31).

    nice -n 10 .venv/bin/python bench/choice_prefix_cache.py [--records 6] [--steps 2]
        [--lora-layers 2] [--threads 2]

SmolLM2-135M-Instruct (models/smollm2-135m-instruct), LoRA rank 8 on q and v of the top
``--lora-layers`` blocks, ``--records`` synthetic records of 4 choices (a prompt of about 40
tokens, choices of 1 to 4 tokens: 4 rows per record), one batch of every record, the
streamed MeZO step (the default schedule). Prints the cache fill time, the median step time
of each and the loss of the first step (the same within rounding), and the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "mpi"))
TEXT = ("the river runs past an old house where a green tree grows beside the road and "
        "children play until the sun goes down over the blue hills while the dog sleeps")
WORDS = TEXT.split(" ")


def records(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS, 30)) + ". Question: what sleeps? Answer:"
        cs = [" " + " ".join(rng.choice(WORDS, int(rng.integers(1, 4)))) for _ in range(4)]
        out.append({"prompt": prompt, "choices": cs, "answer": int(rng.integers(4))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=6)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--lora-layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits
    from zo_common import SoloTopo

    from semzo.finetune.trainable import select_trainable
    from semzo.model import load_model
    from semzo.model.chat import InstructTokenizer
    from semzo.tasks.choice import ChoiceTask
    from semzo.tasks.prompt import first_trained_block
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors
    from semzo.zo.streamed import step_streamed

    folder = ROOT / "models" / "smollm2-135m-instruct"
    recs = records(args.records)
    it = InstructTokenizer.from_folder(str(folder))
    cc = [it.choice(r, 128) for r in recs]
    n = len(recs)
    rows = sum(len(c[1]) for c in cc)
    toks = sum(len(c[0]) * len(c[1]) + sum(len(x) for x in c[1]) for c in cc)
    print(f"{n} records, {rows} rows, {toks} tokens; load average before "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    out = {}
    with threadpool_limits(limits=args.threads):
        for cached in (False, True):
            m = load_model(str(folder))
            names = select_trainable(m, "lora", lora_rank=8, lora_alpha=16,
                                     lora_layers=args.lora_layers)
            layer = first_trained_block(m, names) if cached else 0
            t0 = time.perf_counter()
            task = ChoiceTask(m, [c[0] for c in cc], [c[1] for c in cc],
                              [r["answer"] for r in recs], np.arange(n), np.arange(n),
                              it.pad_id, 64, layer=layer)
            fill = time.perf_counter() - t0
            eng = ZOEngine(ztensors([(k, m.params[k]) for k in names]), SoloTopo(), eps=1e-3,
                           run_seed=1, schedule="streamed")
            b = task.batch(np.arange(n))
            times, losses = [], []
            for s in range(args.steps + 1):             # the first: warm-up
                t0 = time.perf_counter()
                r = step_streamed(eng, task, b, s, 1e-3, n)
                eng.flush()
                times.append(time.perf_counter() - t0)
                losses.append(r.lp)
            step = float(np.median(times[1:]))
            out[cached] = step
            what = f"cached (layer {layer})" if cached else "no cache"
            print(f"{what:>18}: step "
                  f"{step:.3f} s (steps {', '.join(f'{x:.3f}' for x in times)}), cache fill "
                  f"{fill:.2f} s, first L+ {losses[0]:.6f}; load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
    print(f"speed-up {out[False] / out[True]:.1f}x ({args.threads} BLAS threads)")


if __name__ == "__main__":
    main()
