"""One parameter pass with each z distribution against the plain read-modify-write pass.

    .venv/bin/python bench/zo_pass.py [--reps 9] [--threads 1] [--n 22700000]

Issue 15's generator goal: a pass that generates z costs <= 1.2x a plain fused
read-modify-write pass over the same bytes. This times, over one flat float32 array of ``--n``
elements (22.7M = all-MiniLM-L6-v2's parameters), through the same kernel launch, chunks and
bytes: the plain pass (``kernels.PLAIN``: p <- p + a, no z; the peer figure) and the
perturbation p <- p + a z with Gaussian, Gaussian-fast and Rademacher z (our figures). The
four passes are interleaved, ``--reps`` rounds, best and median of each printed with the ratio
to the plain pass. Default 1 thread: on a shared machine the best of several 1-thread runs is a
steadier figure than 2 threads. Other people's processes make timings noisy: say so.
"""

from __future__ import annotations  # noqa: I001 (semzo is imported before numpy)

import argparse
import time

import semzo  # noqa: F401  (before numpy: the thread-pool defaults)
import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=22_700_000)
    args = ap.parse_args()
    from semzo.finetune import kernels, rng

    p = np.zeros(args.n, np.float32)
    ent = [(p, 0, 3, 0.0)]
    k0, k1 = rng.split_seed(12345)
    cases = [("plain (no z)", kernels.PLAIN, 0), ("gaussian", kernels.PERTURB, rng.GAUSSIAN),
             ("gaussian-fast", kernels.PERTURB, rng.GAUSSIAN_FAST),
             ("rademacher", kernels.PERTURB, rng.RADEMACHER)]
    res: dict[str, list[float]] = {c[0]: [] for c in cases}
    with kernels.num_threads(args.threads) as th:
        for _, mode, d in cases:                                   # compile, warm up
            kernels.run_pass(ent, mode, d, k0, k1, a=1e-3)
        for _ in range(args.reps):
            for name, mode, d in cases:
                t0 = time.perf_counter()
                kernels.run_pass(ent, mode, d, k0, k1, a=1e-3)
                res[name].append(time.perf_counter() - t0)
    best = {k: min(v) * 1e3 for k, v in res.items()}
    base = best["plain (no z)"]
    print(f"one pass over {args.n:,} float32, {th} thread(s), best of {args.reps} interleaved "
          "(shared machine: noisy)")
    for k, v in best.items():
        print(f"  {k:14s} best {v:7.1f} ms = {v / base:.2f}x plain (goal <= 1.2x), "
              f"median {np.median(res[k]) * 1e3:.1f} ms")
    print(f"  gaussian-fast / gaussian = {best['gaussian-fast'] / best['gaussian']:.2f}")


if __name__ == "__main__":
    main()
