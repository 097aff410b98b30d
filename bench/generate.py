"""Token generation (decoding) of SmolLM2-135M on the CPU: semzo's KV-cache loop, what
``semzo generate`` runs, against torch (transformers, its KV cache) and, with ``--peer
llamacpp``, llama.cpp, on the same prompt and threads, in one run.

    python bench/generate.py [--model PATH] [--threads 2] [--prompt 64] [--new 64]
                             [--repeat 3] [--peer torch|llamacpp]

A prompt of ``--prompt`` random token ids is processed once (not timed), then ``--new``
tokens are generated greedily one at a time (each a forward of one row through every block
and the LM head, reading every weight once): the timed part, best and median of
``--repeat``, in tokens per second. semzo runs three ways: float32 weights and bfloat16
weights with float32 products (``--dtype bfloat16``), both through ``gemm_cpu.gemv_f32`` for
a few rows (the weight read in place, bfloat16 bits widened in registers; any CPU);
and bfloat16 weights with bfloat16 GEMMs (``--dtype bfloat16 --matmul bfloat16``: on CPUs
with AVX512_BF16 the few-row GEMV form of :mod:`semzo.model.gemm_cpu`, the tile's bits, the
weight read in place); both cut the columns over the threads. The peers: torch in float32 and in bfloat16
(``model.to(torch.bfloat16)``), a loop of ``model(next, past_key_values=...)`` under
``inference_mode``; llama.cpp (``bench/llamacpp_peer.py --decode``, the separate
environment of ``make bench-llamacpp``) on the model written to F32 and BF16 GGUF by semzo's
exporter. Printed: tokens/s of each, the ratios peer time / semzo time (> 1: semzo faster)
for the matching storage, how many of the generated tokens equal semzo float32's (greedy:
an early difference of rounding changes what follows), and the CPU model; the bytes of
weights each token reads over its time, as GB/s, since decoding one row is bound by memory.
semzo's loop is checked to generate the tokens ``semzo.generate.generate_ids`` does.
``--batch B`` (default 8; 0 skips it): then B prompts generated together, semzo's
``generate_many`` (the ``semzo generate --prompt ... --prompt ...`` path) against
transformers' ``generate`` on the same batch, in float32 and bfloat16, aggregate tokens/s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import semzo  # noqa: F401, I001  (before numpy: the thread-pool defaults)
import numpy as np

from semzo.backend import cpu_model

ROOT = Path(__file__).resolve().parents[1]


def semzo_decode(model, prompt, n_new: int):
    """(seconds of the n_new greedy steps, tokens): generate_ids's cached loop, timed after
    the prompt."""
    cache = model.new_cache(1, len(prompt) + n_new)
    logits = model.forward_cached(np.array([prompt], np.int64), cache)[0, -1]
    out = []
    t0 = time.perf_counter()
    for _ in range(n_new):
        nxt = int(np.argmax(logits))
        out.append(nxt)
        logits = model.forward_cached(np.array([[nxt]], np.int64), cache)[0, -1]
    return time.perf_counter() - t0, out


def torch_decode(model, prompt, n_new: int):
    import torch
    with torch.inference_mode():
        res = model(input_ids=torch.tensor([prompt]), use_cache=True)
        pkv, logits = res.past_key_values, res.logits[0, -1]
        out = []
        t0 = time.perf_counter()
        for _ in range(n_new):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            res = model(input_ids=torch.tensor([[nxt]]), past_key_values=pkv, use_cache=True)
            pkv, logits = res.past_key_values, res.logits[0, -1]
    return time.perf_counter() - t0, out


def timed(fn, repeat: int):
    fn()                                        # warm-up: pages, buffers, compiled kernels
    runs = [fn() for _ in range(repeat)]
    times = [r[0] for r in runs]
    return min(times), statistics.median(times), runs[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--peer", choices=("torch", "llamacpp"), default="torch",
                    help="llamacpp: llama.cpp too, after torch (needs make bench-llamacpp)")
    ap.add_argument("--gguf-dir", default="build/gguf")
    ap.add_argument("--batch", type=int, default=8,
                    help="then B prompts at once: semzo's generate_many against torch's "
                         "generate on the same B prompts (0: skip)")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from semzo.backend import set_threads as limit_threads
    from semzo.generate import generate_ids
    from semzo.model import decode, gemm_cpu, load_model
    from semzo.model.zoo import resolve_model_path
    folder = args.model or str(resolve_model_path("smollm2"))
    limit_threads(args.threads)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    ours = {"float32": load_model(folder)}
    prompt = [int(i) for i in rng.integers(0, ours["float32"].config.vocab_size, args.prompt)]
    ours["bfloat16 weights"] = load_model(folder, dtype="bfloat16")
    ours["bfloat16 GEMMs"] = load_model(folder, dtype="bfloat16")
    ours["bfloat16 GEMMs"].set_matmul("bfloat16")
    n_params = sum(a.size for a in ours["float32"].params.values())
    print(f"model {folder}: {n_params / 1e6:.1f}M parameters; prompt {args.prompt} tokens, "
          f"{args.new} generated greedily, {args.threads} threads, best of {args.repeat}")
    print(f"CPU: {cpu_model()}; bfloat16 GEMMs by "
          f"{gemm_cpu.KINDS[gemm_cpu.kind()].split(' (')[0]}")

    res = {}
    for name, m in ours.items():
        best, med, toks = timed(lambda m=m: semzo_decode(m, prompt, args.new), args.repeat)
        want = generate_ids(m, prompt, args.new + 1, eos_ids=set())[:args.new]
        assert toks == want, f"{name}: the bench's loop is not generate_ids'"
        res["semzo " + name] = (best, med, toks, 4 if name == "float32" else 2)
    for dt in ("float32", "bfloat16"):
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dt)).eval()
        best, med, toks = timed(lambda ref=ref: torch_decode(ref, prompt, args.new),
                                args.repeat)
        res["torch " + dt] = (best, med, toks, 4 if dt == "float32" else 2)
        del ref
    if args.peer == "llamacpp":
        res.update(llamacpp(args, ours["float32"], prompt))

    base = res["semzo float32"][2]
    for name, (best, med, toks, nbytes) in res.items():
        same = next((i for i, (a, b) in enumerate(zip(toks, base)) if a != b), len(base))
        print(f"{name:28s} {args.new / best:7.1f} tokens/s best, {args.new / med:7.1f} median "
              f"({best / args.new * 1e3:6.2f} ms a token; weights {nbytes * n_params / best * args.new / 1e9:5.1f} GB/s); "
              f"first {same} of {args.new} tokens as semzo float32's")
    pairs = [("torch float32", "semzo float32"), ("torch bfloat16", "semzo bfloat16 GEMMs"),
             ("llama.cpp BF16", "semzo bfloat16 weights"),
             ("torch bfloat16", "semzo bfloat16 weights"),
             ("llama.cpp F32", "semzo float32"), ("llama.cpp BF16", "semzo bfloat16 GEMMs")]
    for peer, us in pairs:
        if peer in res:
            print(f"ratio {peer} / {us} (time a token): best {res[peer][0] / res[us][0]:.2f}x, "
                  f"median {res[peer][1] / res[us][1]:.2f}x")
    if args.batch > 1:
        batched(args, ours, folder, rng)
    for name in ("bfloat16 weights", "bfloat16 GEMMs"):
        print(f"semzo {name}: {res['semzo float32'][0] / res['semzo ' + name][0]:.2f}x "
              f"faster than semzo float32")
    print("semzo's blocks of a generated token: " + ", ".join(
        f"{name} {'compiled (semzo.model.decode)' if decode.takes(m) else 'block by block'}"
        for name, m in ours.items()))


def batched(args, ours, folder, rng) -> None:
    """B prompts of --prompt random ids each, --new tokens generated greedily for every one:
    semzo's ``generate_many`` (one KV cache, one row a prompt a step) against transformers'
    ``generate`` on the same batch (greedy, its KV cache), prompt processing included in
    both; aggregate tokens/s, and how many rows generate the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from semzo.generate import generate_many
    b = args.batch
    vocab = ours["float32"].config.vocab_size
    prompts = [[int(i) for i in rng.integers(0, vocab, args.prompt)] for _ in range(b)]
    tids = torch.tensor(prompts)
    print(f"batch of {b} prompts ({args.prompt} tokens each), {args.new} tokens each, greedy, "
          f"prompt processing included:")
    for dt, name in (("float32", "float32"), ("bfloat16", "bfloat16 weights")):
        def ours_run(m=ours[name]):
            t0 = time.perf_counter()
            out = generate_many(m, prompts, args.new, batch=b)
            return time.perf_counter() - t0, out
        ref = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dt)).eval()

        def ref_run(ref=ref):
            with torch.inference_mode():
                t0 = time.perf_counter()
                out = ref.generate(tids, attention_mask=torch.ones_like(tids), do_sample=False,
                                   max_new_tokens=args.new, min_new_tokens=args.new,
                                   pad_token_id=0)
                return time.perf_counter() - t0, out[:, args.prompt:].tolist()
        sb, sm, so = timed(ours_run, args.repeat)
        tb, tm, to = timed(ref_run, args.repeat)
        same = sum(a == c for a, c in zip(so, to))
        print(f"  {dt:8s}: semzo {b * args.new / sb:7.1f} tokens/s best ({b * args.new / sm:.1f} "
              f"median), torch {b * args.new / tb:7.1f} ({b * args.new / tm:.1f}); torch/semzo "
              f"time best {tb / sb:.2f}x, median {tm / sm:.2f}x; {same} of {b} rows the same "
              f"tokens")
        del ref


def llamacpp(args, model, prompt) -> dict:
    """llama.cpp's decoding of the same prompt on F32 and BF16 GGUF (see the module text)."""
    from semzo.model.gguf_export import export_gguf
    py = ROOT / os.environ.get("BENCHVENV", ".venv-bench") / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"bench/generate.py --peer llamacpp: no {py} (run make "
                         "bench-llamacpp first)")
    out = Path(args.gguf_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "prompt.npy", np.array([prompt]))
    res = {}
    for gt in ("f32", "bf16"):
        path = out / f"{Path(str(model.source)).name}-{gt}.gguf"
        if not path.exists():
            export_gguf(model, path, gguf_type=gt)
        r = subprocess.run([str(py), str(ROOT / "bench" / "llamacpp_peer.py"), str(path),
                            str(out / "prompt.npy"), "--threads", str(args.threads),
                            "--repeat", str(args.repeat), "--decode", str(args.new)],
                           check=False, capture_output=True, text=True, timeout=1800)
        if r.returncode:
            print(f"llama.cpp {gt}: failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        d = json.loads(r.stdout.strip().splitlines()[-1])
        res[f"llama.cpp {gt.upper()}"] = (min(d["times"]), statistics.median(d["times"]),
                                          d["tokens"], 4 if gt == "f32" else 2)
        print(f"llama.cpp {d['version']} {gt.upper()}: measured", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
