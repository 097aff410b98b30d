"""One parameter pass with each z distribution against the plain read-modify-write pass.

    .venv/bin/python bench/zo_pass.py [--reps 9] [--threads 1] [--n 22700000]
    python bench/zo_pass.py --device gpu [--n 268435456] [--dtype bfloat16]

Issue 15's generator goal: a pass that generates z costs <= 1.2x a plain fused
read-modify-write pass over the same bytes. This times, over one flat float32 array of ``--n``
elements (22.7M = all-MiniLM-L6-v2's parameters), through the same kernel launch, chunks and
bytes: the plain pass (``kernels.PLAIN``: p <- p + a, no z; the peer figure) and the
perturbation p <- p + a z with Gaussian, Gaussian-fast and Rademacher z (our figures). The
four passes are interleaved, ``--reps`` rounds, best and median of each printed with the ratio
to the plain pass. Default 1 thread: on a shared machine the best of several 1-thread runs is a
steadier figure than 2 threads. Also timed: the same number of z generated alone, summed
in L1 and never written to memory (:func:`z_alone_s`): the generator's own cost, the floor
under any pass that makes z, whatever the memory does (``bench/zo_step.py`` turns it into a
floor under the step / (2 x forward) ratio). On a GPU (``--device gpu``) the plain pass is
CuPy's in-place ``p += a`` and the z passes the CUDA kernel (``kernels_gpu.perturb``), timed
with CUDA events; the GPU kit runs it (``zo_pass_gpu`` in tools/gpu-bench.py). Other
people's processes make timings noisy: say so.
"""

from __future__ import annotations  # noqa: I001 (semzo is imported before numpy)

import argparse
import os
import time

import semzo  # noqa: F401  (before numpy: the thread-pool defaults)
import numpy as np
from numba import njit, prange

from semzo.backend import cpu_model
from semzo.zo import kernels
from semzo import rng


# not cached: numba would keep the kernels.fill_z compiled into it after fill_z changed
@njit(parallel=True, error_model="numpy")
def _z_alone(n, dist, k0, k1, tab):
    """Sum of z(seed, 3, e) for e < n, made SUB at a time into an L1 buffer and never stored:
    tasks of CHUNK elements, as the fused pass runs them."""
    nt = (n + kernels.CHUNK - 1) // kernels.CHUNK
    part = np.zeros(nt)
    for c in prange(nt):
        z = np.empty(kernels.SUB, np.float64)
        acc = np.zeros(kernels.SUB, np.float64)
        ws = np.empty(kernels.WS, np.uint64)
        hi = min(n, (c + 1) * kernels.CHUNK)
        for i0 in range(c * kernels.CHUNK, hi, kernels.SUB):
            m = min(kernels.SUB, hi - i0)
            zz = z[:m]
            kernels.fill_z(zz, np.uint64(i0), np.uint64(3), k0, k1, dist, tab, ws)
            for i in range(m):          # element-wise (vectorized), not a serial sum
                acc[i] += zz[i]
        part[c] = acc.sum()
    return part.sum()


def z_alone_s(n: int, dist: str, threads: int, reps: int) -> float:
    """Best of ``reps`` times to generate ``n`` z of ``dist`` on ``threads`` threads with
    nothing read or written but an L1 buffer (the generator's floor; after a warm-up)."""
    code = rng.dist_code(dist)
    k0, k1 = rng.split_seed(12345)
    with kernels.num_threads(threads):
        _z_alone(kernels.CHUNK, code, k0, k1, kernels.FAST_TABLE)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            _z_alone(n, code, k0, k1, kernels.FAST_TABLE)
            best = min(best, time.perf_counter() - t0)
    return best


CASES = (("plain (no z)", None), ("gaussian", rng.GAUSSIAN),
         ("gaussian-fast", rng.GAUSSIAN_FAST), ("rademacher", rng.RADEMACHER))


def cpu_passes(n: int, threads: int, reps: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of each pass of :data:`CASES` over ``n`` float32 on the CPU kernels (``reps``
    interleaved rounds after a warm-up), and the threads used."""
    p = np.zeros(n, np.float32)
    ent = [(p, 0, 3, 0.0)]
    k0, k1 = rng.split_seed(12345)
    cases = [(name, kernels.PLAIN if d is None else kernels.PERTURB, d or 0)
             for name, d in CASES]
    res: dict[str, list[float]] = {c[0]: [] for c in cases}
    with kernels.num_threads(threads) as th:
        for _, mode, d in cases:                                   # compile, warm up
            kernels.run_pass(ent, mode, d, k0, k1, a=1e-3)
        for _ in range(reps):
            for name, mode, d in cases:
                t0 = time.perf_counter()
                kernels.run_pass(ent, mode, d, k0, k1, a=1e-3)
                res[name].append(time.perf_counter() - t0)
    return res, th


def gpu_passes(n: int, reps: int, dtype: str = "float32") -> dict[str, list[float]]:
    """The same on a GPU: the ZO kernel's perturbation pass (``kernels_gpu.perturb``, one
    launch) against the plain pass, CuPy's in-place ``p += a`` over the same array (the same
    bytes read and written, no z), each timed with CUDA events."""
    import cupy

    from semzo.model.storage import STORAGE
    from semzo.zo import kernels_gpu

    p = cupy.zeros(n, STORAGE[dtype])
    k0, k1 = rng.split_seed(12345)
    one = p.dtype.type(1 if p.dtype == np.uint16 else 1e-3)

    def run(d):
        if d is None:
            p.__iadd__(one)
        else:
            kernels_gpu.perturb(p, 0, 3, k0, k1, d, 1e-3)
    res: dict[str, list[float]] = {name: [] for name, _ in CASES}
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    for _, d in CASES:                                             # compile, warm up
        run(d)
    cupy.cuda.Device().synchronize()
    for _ in range(reps):
        for name, d in CASES:
            start.record()
            run(d)
            end.record()
            end.synchronize()
            res[name].append(cupy.cuda.get_elapsed_time(start, end) * 1e-3)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n", type=int, default=22_700_000)
    ap.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--dtype", default="float32", help="GPU: float32 or bfloat16 storage")
    args = ap.parse_args()
    if args.device == "gpu":
        res = gpu_passes(args.n, args.reps, args.dtype)
        where = f"{args.dtype} on the GPU"
    else:
        res, th = cpu_passes(args.n, args.threads, args.reps)
        where = f"float32, {th} thread(s)"
    best = {k: min(v) * 1e3 for k, v in res.items()}
    base = best["plain (no z)"]
    print(f"CPU: {cpu_model()}; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(f"one pass over {args.n:,} {where}, best of {args.reps} interleaved "
          "(shared machine: noisy)")
    for k, v in best.items():
        print(f"  {k:14s} best {v:7.3f} ms = {v / base:.2f}x plain (goal <= 1.2x), "
              f"median {np.median(res[k]) * 1e3:.3f} ms")
    print(f"  gaussian-fast / gaussian = {best['gaussian-fast'] / best['gaussian']:.2f}")
    if args.device == "gpu":
        return
    for d in ("gaussian", "gaussian-fast", "rademacher"):
        za = z_alone_s(args.n, d, args.threads, args.reps) * 1e3
        print(f"  {d:14s} z alone (made in L1, never stored) {za:7.1f} ms = "
              f"{za / base:.2f}x plain, {za * 1e6 / args.n * args.threads:.2f} ns per z "
              f"per thread")


if __name__ == "__main__":
    main()
