"""SmolLM2-135M forward (batch 8 x 128, logits included) of semzo's CausalLM against torch
(transformers LlamaForCausalLM, float32) at the same thread count, in the same run.

    python bench/decoder.py [--model PATH] [--threads 2] [--batch 8] [--seq 128] [--repeat 3]
                            [--dtype float32|bfloat16] [--padded]

``--model`` defaults to the named model ``smollm2`` (the folder ``make setup`` converts, via
``semzo.model.zoo``); any Llama/Qwen2/Mistral/OPT folder works. Runs alternate between the two
libraries in two rounds; in each, one library makes an untimed call then ``--repeat`` / 2
timed calls back to back (as a training loop calls its forward), then the other, with a short
pause at each switch (so one's idle workers stop spinning before the other runs). Calls
interleaved one by one measured each library in the memory state the other left behind: the
first call after torch's pays for faulting in memory torch had just given back (semzo's 0.2 GB
of logits took 450 ms after a torch call and 315 ms after its own). Prints both times (best and median), the ratio torch/semzo (> 1: semzo faster),
load times, and the largest relative logits difference on the batch (on real tokens), and
whether every timed call of each library returned the bits of its first call (one run at
commit 50107af printed a difference to transformers of 4.8e-4, 46x the usual 1.03e-5, on
2026-11-27, and none of 21 fresh processes since did: the check says which side moved if it
recurs); the
achieved GFLOP/s of each (2 x parameters x tokens, the issue-36 count: 275 GFLOP for SmolLM2
at 8 x 128) and its share of a NumPy float32 sgemm of the model's largest shape (tokens x
hidden x intermediate) measured in the same run on the same threads, and the CPU model. The
sgemm is probed (best of 3) just before every timed call as well as 20 times after them: the
reference is the best rate seen in the whole run, and each call's share of the probe just
before it is printed too ("paired"), since on a shared host the sgemm rate moved between 158
and 300 GFLOP/s within minutes (Intel Xeon, 2 cores, 2026-11-27), so a reference taken only
after the forwards could land in a slow spell the forwards did not see, or the reverse.
A probe of 3 calls lasts some 30 ms and the best of 36 of them lands in the host's quietest
moments, which a 1.3-s forward rarely sees whole; so a second reference is printed beside it:
the same sgemm run back to back for as many flops as one forward (about as long as a call),
once before every timed call, best and median (the "sustained" line).
``--profile``: one semzo forward under cProfile, the 20 functions with the most own time.

``--peer llamacpp`` (issue 36): llama.cpp's prompt processing as a second peer. The model is
written to GGUF by semzo's exporter (F32, F16 and BF16, under ``--gguf-dir``), and
``bench/llamacpp_peer.py`` times each in the separate environment ``make bench-llamacpp``
builds (``.venv-bench``: llama-cpp-python compiled from source here, never in ``make setup``
or ``make test``), on the same ids and threads, every position's logits kept as semzo's
are; each row is one sequence of ``--seq`` tokens decoded as one batch. Printed: its times,
GFLOP/s and the ratio llama.cpp/semzo (> 1: semzo faster), and the largest relative logits
difference of row 0 against semzo's.

``--padded``: row lengths drawn uniformly from ``seq / 4 .. seq``, right-padded (the
blocks of semzo's forward skip padded rows, torch computes them; both compute the logits of
every position, as ``logits`` returns them all).

``--dtype bfloat16``: semzo stores bfloat16 weights (upcast where read, float32 arithmetic)
and the peer is torch with the model in bfloat16 (``model.to(torch.bfloat16)``: bfloat16
weights *and* arithmetic). On random ids the weights' rounding alone moves SmolLM2's logits
by up to 0.18 of their largest (torch float32 on the rounded weights against torch float32:
0.185; semzo bfloat16 against semzo float32: 0.185), and torch's bfloat16 arithmetic adds to
that (semzo bfloat16 against torch bfloat16: 1.15, 2026-11-26).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import semzo  # noqa: F401, I001  (before numpy: the thread-pool defaults)
import numpy as np

from semzo.backend import cpu_model, sgemm_rate


def resolve(path: str | None) -> str:
    if path is not None and os.path.isdir(path):
        return path
    try:
        from semzo.model.zoo import resolve_model_path
    except ImportError:
        raise SystemExit("bench/decoder.py: give --model PATH (no semzo.model.zoo here)") from None
    return str(resolve_model_path(path or "smollm2"))



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--matmul", choices=("float32", "bfloat16"), default="float32",
                    help="semzo's model.matmul (bfloat16 needs --dtype bfloat16: the GPU's "
                         "tensor-core arithmetic, emulated on the CPU)")
    ap.add_argument("--profile", action="store_true", help="cProfile one semzo forward")
    ap.add_argument("--padded", action="store_true",
                    help="rows of random lengths (seq/4 .. seq), right-padded")
    ap.add_argument("--peer", choices=("torch", "llamacpp"), default="torch",
                    help="llamacpp: llama.cpp too, after torch (needs make bench-llamacpp)")
    ap.add_argument("--gguf-dir", default="build/gguf", help="--peer llamacpp: where the GGUF "
                    "files are written (kept between runs)")
    args = ap.parse_args()
    folder = resolve(args.model)

    import torch
    from transformers import AutoModelForCausalLM

    from semzo.model import load_model, set_threads

    t0 = time.perf_counter()
    ours = load_model(folder, dtype=args.dtype)
    ours.set_matmul(args.matmul)
    t_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, args.dtype)).eval()
    t_ref = time.perf_counter() - t0
    set_threads(args.threads)
    torch.set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, ours.config.vocab_size, size=(args.batch, args.seq))
    mask = np.ones_like(ids)
    if args.padded:
        lengths = rng.integers(max(1, args.seq // 4), args.seq + 1, size=args.batch)
        mask = (np.arange(args.seq)[None, :] < lengths[:, None]).astype(ids.dtype)
    valid = mask.astype(bool)
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)

    def run_ours():
        return ours.logits(ids, mask)

    def run_ref():
        with torch.inference_mode():
            return ref(input_ids=tids, attention_mask=tmask).logits

    z = run_ours()
    zr = run_ref().float().numpy()
    err = float(np.max(np.abs(z[valid] - zr[valid])) / np.max(np.abs(zr[valid])))
    exact = None
    if args.dtype == "bfloat16":
        # both against float32 arithmetic on the same bfloat16 weights (upcast exactly): what
        # each one's bfloat16 arithmetic costs in accuracy
        import copy
        f32 = copy.deepcopy(ref).float()
        with torch.inference_mode():
            z32 = f32(input_ids=tids, attention_mask=tmask).logits.numpy()
        del f32
        s32 = np.max(np.abs(z32[valid]))
        exact = (float(np.max(np.abs(z[valid] - z32[valid])) / s32),
                 float(np.max(np.abs(zr[valid] - z32[valid])) / s32))
        del z32
    first = {"semzo": z.copy(), "torch": zr}       # every timed call is compared with these
    drift: dict[str, list[float]] = {"semzo": [], "torch": []}
    del z
    n_par = ours.num_parameters(include_frozen=True)
    tokens = args.batch * args.seq
    c = ours.config
    inter = getattr(c, "intermediate_size", 4 * c.hidden_size)
    flop = 2.0 * n_par * tokens

    def probe() -> float:                           # the sgemm rate just before a timed call
        return sgemm_rate(tokens, c.hidden_size, inter, reps=3)

    one = 2.0 * tokens * c.hidden_size * inter
    n_sus = max(1, round(flop / one))
    sa = rng.standard_normal((tokens, c.hidden_size), dtype=np.float32)
    sw = rng.standard_normal((inter, c.hidden_size), dtype=np.float32)
    so = np.empty((tokens, inter), np.float32)

    def sustained() -> float:
        """GFLOP/s of as many sgemm calls back to back as make one forward's flops: a
        reference as long as a timed call, so the host's slow spells hit both alike."""
        t0 = time.perf_counter()
        for _ in range(n_sus):
            np.matmul(sa, sw.T, out=so)
        return n_sus * one / (time.perf_counter() - t0) / 1e9

    times: dict[str, list[float]] = {"semzo": [], "torch": []}
    paired: dict[str, list[float]] = {"semzo": [], "torch": []}   # share of the probe before
    probes: list[float] = []
    sus: list[float] = []
    sus_paired: dict[str, list[float]] = {"semzo": [], "torch": []}
    per_round = -(-args.repeat // 2)
    for r in range(2):
        for name, fn in (("semzo", run_ours), ("torch", run_ref)):
            time.sleep(0.3)
            fn()                                    # the first call after a switch: untimed
            for _ in range(min(per_round, args.repeat - r * per_round)):
                sg = sustained()
                sus.append(sg)
                g = probe()
                probes.append(g)
                t0 = time.perf_counter()
                out = fn()
                dt = time.perf_counter() - t0
                times[name].append(dt)
                paired[name].append(flop / dt / 1e9 / g)
                sus_paired[name].append(flop / dt / 1e9 / sg)
                out = np.asarray(out.float().numpy() if name == "torch" else out)
                if not np.array_equal(out, first[name]):
                    ref0 = first[name]
                    drift[name].append(float(np.max(np.abs(out - ref0)) /
                                             np.max(np.abs(ref0))))
                del out                             # semzo's next call may reuse the array
    gemm = max(probes + [sgemm_rate(tokens, c.hidden_size, inter, reps=10) for _ in range(2)])
    if args.profile:
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        run_ours()
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(20)
    best = {k: min(v) for k, v in times.items()}
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model {folder}: {ours.config.family} {n_par / 1e6:.1f}M parameters, "
          f"{ours.config.num_layers} layers; batch {args.batch} x {args.seq} "
          f"({1 - valid.mean():.0%} padding), "
          f"{args.threads} threads; weights {args.dtype} (semzo "
          f"{sum(a.nbytes for a in ours.params.values()) / 2**20:.0f} MiB), semzo "
          f"model.matmul {args.matmul}")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}")
    print(f"load: semzo {t_ours:.2f} s, transformers {t_ref:.2f} s")
    for k in ("semzo", "torch"):
        print(f"{k:6s} forward+logits: best {best[k] * 1e3:8.1f} ms, median {med[k] * 1e3:8.1f} "
              f"ms ({tokens / best[k]:.0f} tokens/s), {flop / best[k] / 1e9:.0f} GFLOP/s = "
              f"{flop / best[k] / 1e9 / gemm:.0%} of sgemm (median "
              f"{flop / med[k] / 1e9 / gemm:.0%}; paired with the sgemm just before each "
              f"call: best {max(paired[k]):.0%}, median {statistics.median(paired[k]):.0%})")
    print(f"numpy sgemm {tokens}x{c.hidden_size}x{inter} float32, same threads, same run: "
          f"{gemm:.0f} GFLOP/s, best of {len(probes)} probes between the timed calls and 20 "
          f"after (probes: min {min(probes):.0f}, median {statistics.median(probes):.0f}); "
          f"goal: semzo >= 85% of it; {flop / 1e9:.0f} GFLOP per forward")
    sbest = max(sus)
    print(f"numpy sgemm sustained ({n_sus} of those calls back to back, as many flops as one "
          f"forward; one such run before every timed call): best {sbest:.0f} GFLOP/s, median "
          f"{statistics.median(sus):.0f}; " + "; ".join(
              f"{k} best {flop / best[k] / 1e9 / sbest:.0%} of its best (median "
              f"{flop / med[k] / 1e9 / statistics.median(sus):.0%} of its median; paired with "
              f"the run just before each call: median "
              f"{statistics.median(sus_paired[k]):.0%})" for k in ("semzo", "torch")))
    print(f"ratio torch/semzo: best {best['torch'] / best['semzo']:.2f}x, "
          f"median {med['torch'] / med['semzo']:.2f}x (goal >= 1.0x)")
    print(f"logits max relative difference semzo vs transformers: {err:.2e}")
    if exact is not None:
        print(f"against transformers in float32 on the same bfloat16 weights (logits' largest "
              f"difference over their largest value): semzo {exact[0]:.2e}, torch bfloat16 "
              f"{exact[1]:.2e}")
    for k in ("semzo", "torch"):
        n = len(times[k])
        if drift[k]:
            print(f"REPEATABILITY: {k}'s logits differed from its first call's in "
                  f"{len(drift[k])} of {n} timed calls (largest relative difference "
                  f"{max(drift[k]):.2e})")
        else:
            print(f"repeatability: {k}'s logits bit-identical to its first call's in all {n} "
                  f"timed calls")
    del first
    if args.peer == "llamacpp":
        llamacpp_peer(args, ours, ids, best["semzo"], med["semzo"], flop, gemm)


def llamacpp_peer(args, ours, ids, best_s: float, med_s: float, flop: float,
                  gemm: float) -> None:
    """Time llama.cpp on the model's F32, F16 and BF16 GGUF (see the module text)."""
    import json
    import subprocess
    from pathlib import Path

    from semzo.model.gguf_export import export_gguf

    root = Path(__file__).resolve().parents[1]
    py = root / os.environ.get("BENCHVENV", ".venv-bench") / "bin" / "python"
    if not py.exists():
        raise SystemExit(f"bench/decoder.py --peer llamacpp: no {py} (run make "
                         "bench-llamacpp first)")
    if args.padded:
        raise SystemExit("bench/decoder.py: --peer llamacpp times full rows (no --padded)")
    out = Path(args.gguf_dir)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "ids.npy", ids)
    z0 = ours.logits(ids[:1], np.ones_like(ids[:1]))[0]
    for gt in ("f32", "f16", "bf16"):
        path = out / f"{Path(str(ours.source)).name}-{gt}.gguf"
        if not path.exists():
            export_gguf(ours, path, gguf_type=gt)
        r = subprocess.run([str(py), str(root / "bench" / "llamacpp_peer.py"), str(path),
                            str(out / "ids.npy"), "--threads", str(args.threads), "--repeat",
                            str(args.repeat), "--logits", str(out / "logits.npy")],
                           check=False, capture_output=True, text=True, timeout=1800)
        if r.returncode:
            print(f"llama.cpp {gt}: failed: {r.stderr.strip().splitlines()[-1:]}")
            continue
        res = json.loads(r.stdout.strip().splitlines()[-1])
        lz = np.load(out / "logits.npy")
        d = float(np.max(np.abs(lz - z0)) / np.max(np.abs(z0)))
        tb, tm = min(res["times"]), statistics.median(res["times"])
        print(f"llama.cpp {res['version']} {gt.upper():4s} forward+logits: best {tb * 1e3:8.1f} "
              f"ms, median {tm * 1e3:8.1f} ms, {flop / tb / 1e9:.0f} GFLOP/s = "
              f"{flop / tb / 1e9 / gemm:.0%} of sgemm; ratio llama.cpp/semzo ({args.dtype}): "
              f"best {tb / best_s:.2f}x, median {tm / med_s:.2f}x; logits of row 0 vs semzo: "
              f"max relative difference {d:.1e}")


if __name__ == "__main__":
    main()
