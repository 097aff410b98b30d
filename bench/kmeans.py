"""semzo parallel k-means vs scikit-learn's Lloyd and faiss, same data, same initial centres,
same run.

    timeout 600 mpirun -n 2 .venv/bin/python bench/kmeans.py [--threads 1] [--sk-threads 2]
        [--n 200000] [--d 384] [--k 256] [--iters 20] [--algorithms lloyd,pruned]
        [--embeddings file.h5]   (HDF5 with a dataset ``embeddings`` (n, d); default: the
                                  demo's runs/demo/embeddings.h5, else the fortunes corpus
                                  data/fortunes.jsonl embedded once by this script and cached
                                  in runs/bench/fortunes-embeddings.h5; ``none`` skips the case)
        [--skip-sklearn] [--skip-faiss]

The script is the MPI program. Every rank generates its slice of the planted data set (rows
around k random centres, overlapping, unequal sizes; chunk-seeded so the split does not matter),
semzo's k-means|| gives the initial centres, then:

- semzo: ``kmeans(..., init=C0, max_iter=iters, tol=0)`` over all ranks, ``--threads`` BLAS /
  numba threads per rank, once per algorithm (lloyd: every distance; pruned: exact bounds);
- scikit-learn (the peer): rank 0 alone runs ``KMeans(algorithm="lloyd", n_init=1, init=C0,
  max_iter=iters, tol=0)`` on all rows with ``--sk-threads`` threads, while the other ranks wait
  WITHOUT spinning (polled Ibarrier), so neither competes with the other for cores;
- faiss-cpu (the second peer, test extras): rank 0 alone runs ``faiss.Kmeans(d, k,
  niter=iters, max_points_per_centroid=10**9)`` (every row, no subsampling) trained from the
  same ``C0`` with ``faiss.omp_set_num_threads(--sk-threads)``, then one ``index.search`` for
  the final labels and inertia (semzo and scikit-learn time that label pass too). Like them it
  stops early only when an iteration no longer lowers the objective (``early_stop_threshold``
  0); its seconds per iteration divide by the iterations it ran;
- the sgemm reference: rank 0 times numpy ``X @ C.T`` of the full shape at ``--sk-threads``.

The "speed-up" column is relative to scikit-learn; the last lines give semzo's best algorithm
against the best peer of the same run.

Seconds per iteration = wall time of the whole fit (including the final label pass and the
exact inertia) / iterations run, the same for all; best of ``--repeat`` runs (sgemm: best of
5). GFLOP/s counts 2*n*k*d per iteration; for
the pruned algorithm that is an *effective* rate (it computes fewer distances; the share of
rows whose distances it did compute is printed). Other people's processes on the machine make
timings noisy: run it when the machine is quiet and say so when it was not.
"""

from __future__ import annotations

import os

# mpirun binds each rank to one core by default (Open MPI: --bind-to core for np <= 2). Rank 0
# must be able to run scikit-learn and sgemm on all cores, and OpenBLAS/OpenMP size their
# thread pools from the affinity mask when they load, so widen it before numpy is imported.
if hasattr(os, "sched_setaffinity"):
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except OSError:
        pass

import semzo  # noqa: F401, I001  (before numpy: the thread-pool defaults)
import argparse
import time

import numpy as np
from mpi4py import MPI

from semzo.runtime import run_spmd

CHUNK = 8192


def quiet_barrier(comm) -> None:
    """A barrier that sleeps instead of spinning, so a waiting rank leaves its core free."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def planted_rows(lo: int, hi: int, d: int, k: int, seed: int, spread: float) -> np.ndarray:
    """Rows [lo, hi) of the planted data set (float32); chunk-seeded, split-independent."""
    crng = np.random.default_rng([seed, 1 << 20])
    centers = crng.standard_normal((k, d)).astype(np.float32) * spread
    weights = crng.dirichlet(np.full(k, 2.0))
    scales = crng.uniform(0.7, 1.3, k).astype(np.float32)
    out = np.empty((hi - lo, d), dtype=np.float32)
    for c0 in range(lo // CHUNK * CHUNK, hi, CHUNK):
        rng = np.random.default_rng([seed, c0 // CHUNK])
        lab = rng.choice(k, size=CHUNK, p=weights)
        rows = centers[lab] + rng.standard_normal((CHUNK, d), dtype=np.float32) * scales[lab, None]
        a, b = max(lo, c0), min(hi, c0 + CHUNK)
        out[a - lo:b - lo] = rows[a - c0:b - c0]
    return out


def load_embeddings(path: str, comm) -> tuple[np.ndarray, np.ndarray | None, int]:
    """(local rows, all rows on rank 0 else None, global offset) of dataset ``embeddings``."""
    import h5py
    with h5py.File(path, "r") as f:
        ds = f["embeddings"]
        n = ds.shape[0]
        size, rank = comm.Get_size(), comm.Get_rank()
        lo, hi = rank * n // size, (rank + 1) * n // size
        full = ds[:].astype(np.float32) if rank == 0 else None
        local = full[lo:hi] if rank == 0 else ds[lo:hi].astype(np.float32)
    return np.ascontiguousarray(local), full, lo


def embed_corpus(corpus: str, cache: str, comm) -> None:
    """Collective. Embed every record of a JSONL corpus (all-MiniLM-L6-v2, L2-normalized, as the
    embed stage does), each rank a contiguous slice; rank 0 writes ``cache`` (dataset
    ``embeddings`` (n, 384) float32) through a temporary name."""
    import json

    from semzo.model import Tokenizer, default_model_path, embed_texts, load_model
    size, rank = comm.Get_size(), comm.Get_rank()
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    lo, hi = rank * len(texts) // size, (rank + 1) * len(texts) // size
    path = default_model_path()
    model, tok = load_model(path), Tokenizer.from_folder(path)
    t0 = time.perf_counter()
    emb = embed_texts(model, tok, texts[lo:hi], batch_size=64).astype(np.float32)
    emb /= np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    parts = comm.gather(emb, root=0)
    if rank == 0:
        import h5py
        os.makedirs(os.path.dirname(cache) or ".", exist_ok=True)
        with h5py.File(cache + ".tmp", "w") as f:
            f["embeddings"] = np.concatenate(parts)
        os.replace(cache + ".tmp", cache)
        print(f"embedded {len(texts)} records of {corpus} in {time.perf_counter() - t0:.0f} s "
              f"on {size} ranks: cached in {cache}")
    comm.Barrier()


def resolve_embeddings(arg: str | None, comm) -> str | None:
    """The embeddings file to use (see the module docstring), embedding the corpus if needed."""
    if arg == "none":
        return None
    if arg:
        return arg
    demo, cache, corpus = ("runs/demo/embeddings.h5", "runs/bench/fortunes-embeddings.h5",
                           "data/fortunes.jsonl")
    for cand in (demo, cache):
        if os.path.exists(cand):
            return cand
    if not os.path.exists(corpus):
        return None
    embed_corpus(corpus, cache, comm)
    return cache


def sgemm_rate(x: np.ndarray, c: np.ndarray, threads: int, reps: int = 3) -> float:
    """Best seconds of numpy X @ C.T at ``threads`` BLAS threads."""
    from threadpoolctl import threadpool_limits
    best = float("inf")
    with threadpool_limits(limits=threads):
        out = np.empty((x.shape[0], c.shape[0]), dtype=np.float32)
        for _ in range(reps):
            t0 = time.perf_counter()
            np.matmul(x, c.T, out=out)
            best = min(best, time.perf_counter() - t0)
    return best


def faiss_fit(x: np.ndarray, c0: np.ndarray, iters: int, threads: int):
    """faiss k-means from ``c0`` on every row, then the final label pass.
    Returns (seconds, iterations run, labels (n,) int64, inertia float64)."""
    import faiss
    faiss.omp_set_num_threads(threads)
    d = x.shape[1]
    t0 = time.perf_counter()
    km = faiss.Kmeans(d, c0.shape[0], niter=iters, max_points_per_centroid=10**9,
                      min_points_per_centroid=1, seed=0, verbose=False,
                      check_input_data_for_NaNs=False)
    km.train(x, init_centroids=np.ascontiguousarray(c0, dtype=np.float32))
    dist, lab = km.index.search(x, 1)
    wall = time.perf_counter() - t0
    return wall, len(km.obj), lab[:, 0], float(dist[:, 0].astype(np.float64).sum())


def run_case(name, comm, x_local, x_full, offset, args, rows):
    from semzo.cluster import init_centers, kmeans
    rank = comm.Get_rank()
    n_total = comm.allreduce(x_local.shape[0])
    d = x_local.shape[1]
    k = args.k
    quiet_barrier(comm)
    t0 = time.perf_counter()
    c0 = init_centers(x_local, k, comm, global_offset=offset, seed=args.seed,
                      block_rows=args.block_rows)
    t_init = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    flop_iter = 2.0 * n_total * k * d
    results = {alg: [float("inf"), None, None] for alg in args.algorithms}
    sk = None
    t_sk = gemm = float("inf")
    fz = None                     # faiss: [best seconds, labels, inertia]
    counts = comm.allgather(x_local.shape[0])
    # interleaved repetitions (semzo, scikit-learn, sgemm, again): each keeps its best time,
    # so a burst of load from other users hits all of them alike
    for _ in range(args.repeat):
        for alg in args.algorithms:
            quiet_barrier(comm)
            t0 = time.perf_counter()
            res = kmeans(x_local, k, comm, global_offset=offset, init=c0, max_iter=args.iters,
                         tol=0.0, algorithm=alg, block_rows=args.block_rows)
            wall = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
            labels = np.empty(n_total, np.int32) if rank == 0 else None
            comm.Gatherv(res.labels, [labels, counts] if rank == 0 else None, root=0)
            best = results[alg]
            if wall < best[0]:
                best[:] = [wall, res, labels]
        if rank == 0 and not args.skip_sklearn:
            from sklearn.cluster import KMeans
            from threadpoolctl import threadpool_limits
            with threadpool_limits(limits=args.sk_threads):
                t0 = time.perf_counter()
                sk = KMeans(k, init=c0, n_init=1, max_iter=args.iters, tol=0.0,
                            algorithm="lloyd").fit(x_full)
                t_sk = min(t_sk, time.perf_counter() - t0)
            gemm = min(gemm, sgemm_rate(x_full, c0, args.sk_threads, reps=3))
        if rank == 0 and not args.skip_faiss:
            fit = faiss_fit(x_full, c0, args.iters, args.sk_threads)
            if fz is None or fit[0] < fz[0]:
                fz = list(fit)
    if sk is None:
        gemm = None
    quiet_barrier(comm)
    if rank != 0:
        return
    load = os.getloadavg()
    print(f"\n[{name}] n={n_total} d={d} k={k}; k-means|| init {t_init:.2f} s "
          f"(semzo, {comm.Get_size()} ranks); load average now {load[0]:.1f} (1 min), "
          f"{load[1]:.1f} (5 min) on {os.cpu_count()} CPUs")
    if gemm is not None:
        print(f"sgemm reference: numpy matmul ({n_total}x{d}) @ ({d}x{k}) at {args.sk_threads} "
              f"threads: {gemm:.3f} s = {flop_iter / gemm / 1e9:.1f} GFLOP/s")
    hdr = (f"{'method':<28}{'iters':>6}{'s/iter':>9}{'speed-up':>10}{'GFLOP/s':>9}"
           f"{'of sgemm':>9}{'dist rows':>10}  agreement with sklearn")
    print(hdr)
    if sk is not None:
        per = t_sk / sk.n_iter_
        rows.append((name, "scikit-learn lloyd", per, 1.0))
        print(f"{'scikit-learn lloyd (' + str(args.sk_threads) + ' thr)':<28}{sk.n_iter_:>6}"
              f"{per:>9.4f}{1.0:>9.2f}x{flop_iter / per / 1e9:>9.1f}"
              f"{flop_iter / per / (flop_iter / gemm):>9.0%}{1.0:>10.0%}  -")
    if fz is not None:
        per = fz[0] / fz[1]
        sp = (t_sk / sk.n_iter_) / per if sk is not None else float("nan")
        agree = ""
        if sk is not None:
            agree = (f"labels {np.mean(fz[2] == sk.labels_):.4%}, inertia rel "
                     f"{abs(fz[3] / sk.inertia_ - 1):.1e}")
        of_gemm = f"{flop_iter / per / (flop_iter / gemm):>9.0%}" if gemm else f"{'-':>9}"
        rows.append((name, "faiss", per, sp))
        print(f"{'faiss (' + str(args.sk_threads) + ' thr)':<28}{fz[1]:>6}{per:>9.4f}"
              f"{sp:>9.2f}x{flop_iter / per / 1e9:>9.1f}{of_gemm}{1.0:>10.0%}  {agree}")
    for alg, (wall, res, labels) in results.items():
        per = wall / res.n_iter
        sp = (t_sk / sk.n_iter_) / per if sk is not None else float("nan")
        eff = "*" if alg != "lloyd" else " "
        agree = ""
        if sk is not None:
            agree = (f"labels {np.mean(labels == sk.labels_):.4%}, inertia rel "
                     f"{abs(res.inertia / sk.inertia_ - 1):.1e}")
        of_gemm = f"{flop_iter / per / (flop_iter / gemm):>8.0%}" if gemm else f"{'-':>8}"
        label = f"semzo {alg} ({comm.Get_size()}r x {args.threads}t)"
        print(f"{label:<28}{res.n_iter:>6}{per:>9.4f}{sp:>9.2f}x{flop_iter / per / 1e9:>8.1f}"
              f"{eff}{of_gemm} {res.stats['distance_fraction']:>9.1%}  {agree}")
        rows.append((name, f"semzo {alg}", per, sp))
    peers = {m: per for (nm, m, per, _) in rows if nm == name and not m.startswith("semzo")}
    ours = {m: per for (nm, m, per, _) in rows if nm == name and m.startswith("semzo")}
    if peers and ours:
        bp, bo = min(peers, key=peers.get), min(ours, key=ours.get)
        for m, per in peers.items():
            print(f"ratio {bo} / {m}: {per / ours[bo]:.2f}x (s/iter {ours[bo]:.4f} vs {per:.4f})")
        verdict = "ahead of" if ours[bo] < peers[bp] else "BEHIND"
        print(f"best semzo ({bo}) is {verdict} the best peer ({bp}): "
              f"{peers[bp] / ours[bo]:.2f}x")
    if any(a != "lloyd" for a in results):
        print("* effective rate: 2*n*k*d per iteration although only the 'dist rows' share of "
              "rows had their distances computed")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200_000)
    ap.add_argument("--d", type=int, default=384)
    ap.add_argument("--k", type=int, default=256)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="BLAS/numba threads per rank")
    ap.add_argument("--sk-threads", type=int, default=2, help="threads for scikit-learn/sgemm")
    ap.add_argument("--algorithms", default="lloyd,pruned")
    ap.add_argument("--block-rows", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2,
                    help="runs per method; the best wall time counts (the machine is shared)")
    ap.add_argument("--spread", type=float, default=0.25,
                    help="planted centre scale relative to the unit noise")
    ap.add_argument("--planted", default="",
                    help="comma list of planted cluster counts, one case each (default: k)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--embeddings", default=None,
                    help="HDF5 file with dataset 'embeddings' (default: see above; none: skip)")
    ap.add_argument("--skip-sklearn", action="store_true")
    ap.add_argument("--skip-faiss", action="store_true")
    args = ap.parse_args()
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    os.environ.setdefault("SEMZO_LOG", "WARNING")
    from semzo.runtime import setup_logging
    setup_logging("WARNING")
    from semzo.backend import set_threads
    set_threads(args.threads)
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()

    # compile / load the numba kernels outside the timings
    from semzo.cluster import kmeans
    warm = planted_rows(0, 2048, 8, 4, 1, 1.0)
    for alg in args.algorithms:
        kmeans(warm[rank::size], 4, comm, global_offset=0, algorithm=alg, max_iter=3)

    if rank == 0:
        import sklearn
        from sklearn.utils._openmp_helpers import _openmp_effective_n_threads
        print(f"semzo k-means benchmark: {size} ranks x {args.threads} thread(s); scikit-learn "
              f"{sklearn.__version__} on rank 0 with {args.sk_threads} thread(s) (OpenMP sees "
              f"{_openmp_effective_n_threads()} CPUs) while the others sleep; {args.iters} "
              f"iterations, tol=0; load average {os.getloadavg()[0]:.1f} on "
              f"{os.cpu_count()} CPUs")
        if not args.skip_faiss:
            import faiss
            print(f"faiss {faiss.__version__} on rank 0 with {args.sk_threads} thread(s) "
                  f"(omp_set_num_threads), every row (max_points_per_centroid=1e9)")
    rows = []
    lo, hi = rank * args.n // size, (rank + 1) * args.n // size
    for kp in [int(v) for v in args.planted.split(",") if v] or [args.k]:
        x_local = planted_rows(lo, hi, args.d, kp, args.seed, args.spread)
        x_full = None
        if rank == 0 and not (args.skip_sklearn and args.skip_faiss):
            x_full = planted_rows(0, args.n, args.d, kp, args.seed, args.spread)
            x_local = x_full[lo:hi]
        run_case(f"planted, {kp} clusters", comm, x_local, x_full, lo, args, rows)
        del x_local, x_full
    emb = resolve_embeddings(args.embeddings, comm)
    if emb:
        x_local, x_full, lo = load_embeddings(emb, comm)
        run_case(f"embeddings {emb}", comm, x_local, x_full, lo, args, rows)
    elif rank == 0:
        print("\n[embeddings] skipped: no runs/demo/embeddings.h5 and no data/fortunes.jsonl "
              "(make corpus), or --embeddings none")
    return 0


if __name__ == "__main__":
    run_spmd(main)
