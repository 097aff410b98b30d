"""bfloat16 GEMMs on the CPU: semzo's kernel (semzo.model.gemm_cpu, what ``model.matmul =
"bfloat16"`` runs: AMX tiles where the CPU has them, else AVX512_BF16 dot products) against
torch's bfloat16 matmul (oneDNN) and NumPy's float32 sgemm, the same shapes, one thread
each, in one run; GFLOP/s and the ratios. With AMX, the AVX512_BF16 kernel is timed too.

    python bench/gemm_bf16.py [--rows 512] [--repeat 7]

The shapes are SmolLM2-135M's (hidden 576, MLP 1536, k/v 192, vocabulary 49152) at
``--rows`` activation rows: out (rows, N) = x (rows, K) @ W.T with W (N, K) stored as
bfloat16. semzo's figure includes rounding the float32 activations to bfloat16 once per call
(as the forward does once per shared input) only with ``--with-rounding``; torch's includes
nothing but its matmul of bfloat16 tensors. Also checks the three agree: semzo's largest
difference from the float64 product of the same bfloat16 values, relative to the largest
value, next to torch's. Exits 2 when the CPU has no AVX512_BF16.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np

SHAPES = [("q/o proj", 576, 576), ("k/v proj", 192, 576), ("gate/up", 1536, 576),
          ("down", 576, 1536), ("LM head", 49152, 576)]


def best_time(fn, repeat: int, flop: float) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        reps = max(1, int(2e9 / flop))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def one_shape(rng, name: str, n: int, k: int, args) -> dict:
    """Times (s) of the three on one shape; prints the shape's line."""
    import torch

    from semzo.model import gemm_cpu
    from semzo.model.storage import to_bits, to_float32
    x = rng.standard_normal((args.rows, k), dtype=np.float32)
    w = to_bits(rng.standard_normal((n, k), dtype=np.float32))
    xb = to_bits(x)
    out = np.empty((args.rows, n), np.float32)
    flop = 2.0 * args.rows * n * k

    def ours():
        gemm_cpu.matmul(to_bits(x) if args.with_rounding else xb, w, out)

    tx = torch.from_numpy(xb.view(np.int16).copy()).view(torch.bfloat16)
    tw = torch.from_numpy(w.view(np.int16).copy()).view(torch.bfloat16)

    def theirs():
        with torch.inference_mode():
            return tx @ tw.T

    xf, wf = to_float32(xb), to_float32(w)
    of = np.empty((args.rows, n), np.float32)

    def sgemm():
        np.matmul(xf, wf.T, out=of)

    def dot():
        gemm_cpu._gemm(xb.view(np.uint32), w.view(np.uint32), out)

    t = {"semzo": best_time(ours, args.repeat, flop),
         "torch": best_time(theirs, args.repeat, flop),
         "sgemm": best_time(sgemm, args.repeat, flop)}
    amx = gemm_cpu.kind() == "amx" and k % 32 == 0
    t["dot"] = best_time(dot, args.repeat, flop) if amx else t["semzo"]
    ours()
    ref = xf.astype(np.float64) @ wf.astype(np.float64).T
    scale = np.abs(ref).max()
    err_s = np.abs(out - ref).max() / scale
    err_t = np.abs(theirs().float().numpy() - ref).max() / scale
    print(f"{name:9s} N {n:6d} K {k:5d}: semzo {flop / t['semzo'] / 1e9:6.1f} GFLOP/s, "
          f"torch bfloat16 {flop / t['torch'] / 1e9:6.1f}, numpy sgemm "
          f"{flop / t['sgemm'] / 1e9:6.1f}; torch/semzo time {t['torch'] / t['semzo']:.2f}x;"
          f" largest difference from float64: semzo {err_s:.1e}, torch {err_t:.1e}"
          + (f"; semzo AVX512_BF16 kernel {flop / t['dot'] / 1e9:.1f} (AMX / it: "
             f"{t['dot'] / t['semzo']:.2f}x)" if amx else ""))
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--with-rounding", action="store_true",
                    help="time semzo's rounding of the activations inside each call")
    args = ap.parse_args()

    import torch

    from semzo.backend import cpu_model
    from semzo.model import gemm_cpu
    if not gemm_cpu.supported():
        print("bench/gemm_bf16.py: this CPU has no AVX512_BF16 (vdpbf16ps)", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; one thread each; {args.rows} rows; torch {torch.__version__}")
    rng = np.random.default_rng(0)
    print(f"semzo's kernel: {gemm_cpu.KINDS[gemm_cpu.kind()]}")
    tot = {"semzo": 0.0, "torch": 0.0, "sgemm": 0.0, "dot": 0.0}
    for name, n, k in SHAPES:
        t = one_shape(rng, name, n, k, args)
        for key in tot:
            tot[key] += t[key]
    print(f"all five shapes (one decoder layer's GEMMs with q/o and k/v counted once, plus the "
          f"head): semzo {tot['semzo'] * 1e3:.1f} ms, torch bfloat16 {tot['torch'] * 1e3:.1f} "
          f"ms, numpy sgemm {tot['sgemm'] * 1e3:.1f} ms; ratio torch/semzo "
          f"{tot['torch'] / tot['semzo']:.2f}x, sgemm/semzo {tot['sgemm'] / tot['semzo']:.2f}x, "
          f"semzo's AVX512_BF16 kernel/semzo {tot['dot'] / tot['semzo']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
