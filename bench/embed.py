"""Benchmark: embedding real documents with semzo (NumPy/Numba, CPU) against sentence-transformers
(torch CPU), same model (all-MiniLM-L6-v2), same documents, same threads, same run.

Documents: the Debian fortunes corpus (/usr/share/games/fortunes, quotes separated by lines
holding only "%"), a fixed random sample of N quotes. Prints documents per second of each (best
of --repeat timed passes, runs interleaved, plus the range), their ratio, semzo's achieved
GFLOP/s (multiply-adds of the padded batches it ran) against a measured NumPy float32 sgemm of
a similar shape, the smallest cosine between the two sets of embeddings, and the best time of
a fixed 16 x 64 forward of each.

Threads: torch.set_num_threads(--threads); semzo.model.set_threads(--threads) (batches split
into row blocks on that many threads, BLAS at one thread inside them); BLAS/OpenMP env and
threadpoolctl limits set to --threads for both.

    .venv/bin/python bench/embed.py --n 2000 --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="documents to embed (default 2000)")
    ap.add_argument("--threads", type=int, default=2, help="threads for both (default 2)")
    ap.add_argument("--batch-size", type=int, default=32,
                    help="batch size for both (default 32, sentence-transformers' default)")
    ap.add_argument("--repeat", type=int, default=3, help="timed passes of each (default 3)")
    ap.add_argument("--fortunes", default="/usr/share/games/fortunes")
    ap.add_argument("--no-torch", action="store_true", help="semzo only")
    ap.add_argument("--forward-reps", type=int, default=10,
                    help="timed 16x64 forward passes of each, same batch (default 10; 0: skip)")
    return ap.parse_args()


ARGS = parse()
# BLAS / OpenMP threads must be fixed before numpy or torch are imported
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np
from threadpoolctl import threadpool_limits


def read_fortunes(folder: str, n: int, seed: int = 0) -> list[str]:
    """A fixed random sample of ``n`` quotes (all of them if fewer)."""
    quotes: list[str] = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if "." in name or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            cur: list[str] = []
            for line in f:
                if line.rstrip("\n") == "%":
                    if cur:
                        quotes.append("".join(cur).strip())
                    cur = []
                else:
                    cur.append(line)
            if cur:
                quotes.append("".join(cur).strip())
    quotes = [q for q in quotes if q]
    if not quotes:
        sys.exit(f"no quotes under {folder}: install the Debian package 'fortunes'")
    rng = np.random.default_rng(seed)
    idx = rng.permutation(len(quotes))[:n]
    return [quotes[i] for i in idx]


def padded_flops(cfg, seqs, batch_size: int) -> float:
    """Floating point operations (2 per multiply-add) of the padded batches semzo runs."""
    from semzo.model import length_batches
    h, inter, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers
    lengths = [len(s) for s in seqs]
    total = 0.0
    for idx in length_batches(lengths, batch_size):
        b, t = len(idx), max(lengths[j] for j in idx)
        per_layer = 2 * b * t * (4 * h * h + 2 * h * inter) + 4 * b * t * t * h
        total += layers * per_layer
    return total


def sgemm_rate(m: int, k: int, n: int, reps: int = 20) -> float:
    """GFLOP/s of NumPy float32 (m, k) @ (k, n) with a transposed (n, k) weight, best of reps."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    out = np.empty((m, n), dtype=np.float32)
    np.matmul(a, w.T, out=out)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.matmul(a, w.T, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * m * k * n / best / 1e9


#: pause when switching between semzo and torch, so the idle workers of one thread pool
#: (OpenBLAS spins ~0.1 s after a call, OpenMP a little) stop spinning before the other runs
SWITCH_PAUSE = 0.3


def fixed_batch_forward(model, st, nt: int, reps: int) -> tuple[float, float | None]:
    """Best time of one forward pass on the same 16 x 64 batch (no padding, no tokenizer):
    semzo ``hidden_states`` against the transformers module inside sentence-transformers."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, model.config.vocab_size, size=(16, 64))
    mask = np.ones_like(ids)
    t_sz, t_st = [], []
    hf = st[0].auto_model if st is not None else None
    for r in range(reps + 1):
        t0 = time.perf_counter()
        model.hidden_states(ids, mask)
        t_sz.append(time.perf_counter() - t0)
        if hf is not None:
            import torch
            time.sleep(SWITCH_PAUSE)
            ti, tm = torch.from_numpy(ids), torch.from_numpy(mask)
            with torch.inference_mode():
                t0 = time.perf_counter()
                hf(input_ids=ti, attention_mask=tm)
                t_st.append(time.perf_counter() - t0)
            time.sleep(SWITCH_PAUSE)
    return min(t_sz[1:]), (min(t_st[1:]) if t_st else None)


def main() -> int:
    from semzo.model import Tokenizer, default_model_path, embed_texts, load_model, set_threads
    nt = ARGS.threads
    docs = read_fortunes(ARGS.fortunes, ARGS.n)
    path = default_model_path()
    set_threads(nt)
    model = load_model(path)
    tok = Tokenizer.from_folder(path)
    seqs = tok.encode_batch(docs)
    ntok = sum(len(s) for s in seqs)
    print(f"documents: {len(docs)} fortunes, {ntok} tokens (mean {ntok / len(docs):.1f}, "
          f"max {max(len(s) for s in seqs)}), batch size {ARGS.batch_size}, threads {nt}")

    st = None
    if not ARGS.no_torch:
        import torch
        from sentence_transformers import SentenceTransformer
        torch.set_num_threads(nt)
        st = SentenceTransformer(str(path), device="cpu")
        st.max_seq_length = tok.max_length

    with threadpool_limits(limits=nt):
        embed_texts(model, tok, docs[:64], batch_size=ARGS.batch_size)      # compile / warm up
        if st is not None:
            st.encode(docs[:64], batch_size=ARGS.batch_size)
            time.sleep(SWITCH_PAUSE)
        t_sz, t_st = [], []
        e_sz = e_st = None
        for _ in range(ARGS.repeat):
            t0 = time.perf_counter()
            e_sz = embed_texts(model, tok, docs, batch_size=ARGS.batch_size)
            t_sz.append(time.perf_counter() - t0)
            if st is not None:
                time.sleep(SWITCH_PAUSE)
                t0 = time.perf_counter()
                e_st = st.encode(docs, batch_size=ARGS.batch_size, convert_to_numpy=True)
                t_st.append(time.perf_counter() - t0)
                time.sleep(SWITCH_PAUSE)
        fw = fixed_batch_forward(model, st, nt, ARGS.forward_reps) if ARGS.forward_reps else None
        gemm = sgemm_rate(ARGS.batch_size * 64, model.config.hidden_size,
                          model.config.intermediate_size)

    n = len(docs)
    flops = padded_flops(model.config, seqs, ARGS.batch_size)
    best_sz = min(t_sz)
    print(f"semzo                 {n / best_sz:9.1f} docs/s   (range {n / max(t_sz):.1f} .. "
          f"{n / min(t_sz):.1f} over {len(t_sz)} passes)")
    if st is not None:
        best_st = min(t_st)
        print(f"sentence-transformers {n / best_st:9.1f} docs/s   (range {n / max(t_st):.1f} .. "
              f"{n / min(t_st):.1f} over {len(t_st)} passes; torch {torch.__version__})")
        print(f"ratio semzo / torch   {best_st / best_sz:9.2f}x  (best vs best; "
              f"median vs median {np.median(t_st) / np.median(t_sz):.2f}x)")
        cos = (e_sz * e_st).sum(1) / np.linalg.norm(e_sz, axis=1) / np.linalg.norm(e_st, axis=1)
        print(f"embeddings agree: min cosine {cos.min():.8f}")
    print(f"semzo achieved        {flops / best_sz / 1e9:9.1f} GFLOP/s  "
          f"(numpy sgemm {ARGS.batch_size * 64}x{model.config.hidden_size}x"
          f"{model.config.intermediate_size}: {gemm:.1f} GFLOP/s, "
          f"{flops / best_sz / 1e9 / gemm:.0%} of it)")
    if fw is not None:
        f16 = 16 * 64 * model.config.num_layers * (
            2 * (4 * model.config.hidden_size ** 2 +
                 2 * model.config.hidden_size * model.config.intermediate_size) +
            4 * 64 * model.config.hidden_size)
        line = f"forward 16x64 (best of {ARGS.forward_reps}): semzo {fw[0] * 1e3:.1f} ms " \
               f"({f16 / fw[0] / 1e9:.1f} GFLOP/s)"
        if fw[1] is not None:
            line += f", torch {fw[1] * 1e3:.1f} ms ({f16 / fw[1] / 1e9:.1f} GFLOP/s), " \
                    f"ratio {fw[1] / fw[0]:.2f}x"
        print(line)
    print("note: the machine is shared; timings are noisy, compare within one run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
