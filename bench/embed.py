"""Benchmark: embedding real documents with semzo (NumPy/Numba, CPU) against sentence-transformers
(torch CPU) and ONNX Runtime (CPU), same model (all-MiniLM-L6-v2), same documents, same threads,
same run.

Documents: the Debian fortunes corpus (/usr/share/games/fortunes, quotes separated by lines
holding only "%"), a fixed random sample of N quotes. Prints documents per second of each (best
of --repeat timed passes, runs interleaved, plus the range), their ratio, semzo's achieved
GFLOP/s (multiply-adds of the padded batches it ran) against a measured NumPy float32 sgemm of
a similar shape (probed before every semzo pass and after them all, the best rate seen: on a
shared host the rate moves by a third within minutes, see bench/decoder.py), the smallest cosine between semzo's and each peer's embeddings, and the best
time of a fixed 16 x 64 forward of each. ``--profile REPS``: where that forward's CPU time goes,
part by part, for semzo and for ONNX Runtime (from its own per-node profile).

ONNX Runtime: the transformers BertModel of the same folder (eager attention by default,
``--ort-attention sdpa`` for the other export) exported by
``torch.onnx.export(..., dynamo=False, opset_version=17)`` (dynamic batch and length; inputs
input_ids and attention_mask, output last_hidden_state) into a temporary folder, run by an
``InferenceSession`` on the CPU provider with all graph optimizations. Its documents go through
the same tokenizer and the same length bucketing as semzo's (``semzo.model.length_batches``,
each batch padded to its longest row), then mean pooling over the mask and L2 normalization
in NumPy, as semzo does; tokenization is inside the timing for all three.

Threads: torch.set_num_threads(--threads); semzo.model.set_threads(--threads) (batches split
into row blocks on that many threads, BLAS at one thread inside them); ONNX Runtime
intra_op_num_threads=--threads, inter_op_num_threads=1; BLAS/OpenMP env and threadpoolctl
limits set to --threads for all.

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
    ap.add_argument("--no-torch", action="store_true", help="no sentence-transformers")
    ap.add_argument("--no-ort", action="store_true", help="no ONNX Runtime")
    ap.add_argument("--ort-attention", default="eager", choices=["eager", "sdpa"],
                    help="transformers attention used for the ONNX export (default eager: it "
                         "ran faster in ONNX Runtime here than sdpa)")
    ap.add_argument("--forward-reps", type=int, default=10,
                    help="timed 16x64 forward passes of each, same batch (default 10; 0: skip)")
    ap.add_argument("--profile", type=int, default=0, metavar="REPS",
                    help="also print where the 16x64 forward's CPU time goes, for semzo (its "
                         "kernels timed by wrappers) and ONNX Runtime (its own per-node "
                         "profile), over REPS forwards each (default 0: skip)")
    return ap.parse_args()


ARGS = parse()
# BLAS / OpenMP threads must be fixed before numpy or torch are imported
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import semzo  # noqa: F401, I001  (before numpy: the thread-pool defaults)
import numpy as np
from threadpoolctl import threadpool_limits

from semzo.backend import sgemm_rate


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



#: pause when switching between semzo and torch, so the idle workers of one thread pool
#: (OpenBLAS spins ~0.1 s after a call, OpenMP a little) stop spinning before the other runs
SWITCH_PAUSE = 0.3


def ort_session(path, nt: int, folder: str):
    """Export the model folder's BertModel to ONNX (legacy exporter, opset 17) under ``folder``
    and open it with ONNX Runtime at ``nt`` intra-op threads. Returns (session, export s)."""
    import onnxruntime as ort
    import torch
    from transformers import AutoModel

    class Hidden(torch.nn.Module):
        """(input_ids, attention_mask) -> last_hidden_state, positional for the exporter."""

        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    t0 = time.perf_counter()
    wrap = Hidden(AutoModel.from_pretrained(str(path),
                                            attn_implementation=ARGS.ort_attention)).eval()
    ids = torch.randint(1000, 20000, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0                    # a padded row, so the mask path is traced
    out = os.path.join(folder, "model.onnx")
    dyn = {0: "batch", 1: "tokens"}
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(wrap, (ids, mask), out, dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"],
                          dynamic_axes={"input_ids": dyn, "attention_mask": dyn,
                                        "last_hidden_state": dyn})
    so = ort.SessionOptions()
    so.intra_op_num_threads = nt
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = ort.InferenceSession(out, so, providers=["CPUExecutionProvider"])
    return sess, time.perf_counter() - t0


def ort_embed(sess, tok, texts, batch_size: int) -> np.ndarray:
    """Sentence embeddings (N, H) with ONNX Runtime, bucketed and pooled as semzo does."""
    from semzo.model import length_batches
    seqs = tok.encode_batch(list(texts))
    lengths = [len(s) for s in seqs]
    out = None
    for idx in length_batches(lengths, batch_size):
        t = max(lengths[j] for j in idx)
        ids = np.full((len(idx), t), tok.pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), t), dtype=np.int64)
        for r, j in enumerate(idx):
            ids[r, :lengths[j]] = seqs[j]
            mask[r, :lengths[j]] = 1
        hs = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
        m = mask[:, :, None].astype(np.float32)
        e = (hs * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        e /= np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
        if out is None:
            out = np.empty((len(seqs), e.shape[1]), dtype=np.float32)
        out[idx] = e
    return out


def fixed_batch_forward(model, st, sess, reps: int) -> tuple[dict, dict]:
    """Best wall time and best process CPU time of one forward pass on the same 16 x 64 batch
    (no padding, no tokenizer): semzo ``hidden_states``, the transformers module inside
    sentence-transformers, and the ONNX Runtime session, interleaved. The CPU time (all
    threads of the process) moves much less than the wall time when other processes load the
    machine; a spinning thread pool (torch, ONNX Runtime) counts its spinning in it."""
    ids, mask = _forward_batch(model)
    wall: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}

    def timed(name, fn):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.setdefault(name, []).append(time.perf_counter() - t0)
        cpu.setdefault(name, []).append(time.process_time() - c0)

    hf = st[0].auto_model if st is not None else None
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    if hf is not None:
        import torch
        ti, tm = torch.from_numpy(ids), torch.from_numpy(mask)
    for _ in range(reps + 1):
        timed("semzo", lambda: model.hidden_states(ids, mask))
        if hf is not None:
            time.sleep(SWITCH_PAUSE)
            with torch.inference_mode():
                timed("torch", lambda: hf(input_ids=ti, attention_mask=tm))
            time.sleep(SWITCH_PAUSE)
        if sess is not None:
            timed("onnxruntime", lambda: sess.run(None, feed))
            time.sleep(SWITCH_PAUSE)
    return ({k: min(v[1:]) for k, v in wall.items()}, {k: min(v[1:]) for k, v in cpu.items()})


def _forward_batch(model):
    """The fixed 16 x 64 batch of :func:`fixed_batch_forward` (no padding)."""
    rng = np.random.default_rng(1)
    ids = rng.integers(1000, model.config.vocab_size, size=(16, 64))
    return ids, np.ones_like(ids)


def profile_semzo(model, reps: int, nt: int) -> dict:
    """Seconds per 16 x 64 forward in each part of semzo's encoder blocks: every kernel the
    blocks call is wrapped to add its thread's CPU time (``time.thread_time``), summed over the
    split's threads and divided by their number ``nt`` (the threads run each part side by
    side, so this is the part's share of the wall time); the rest of the process CPU time is
    "other" (embeddings, packing, Python glue, thread hand-offs)."""
    import threading

    import semzo.model.encoder as enc
    ids, mask = _forward_batch(model)
    acc: dict[str, float] = {}
    lock, local = threading.Lock(), threading.local()

    def wrap(name, f):
        def g(*a, **k):
            if getattr(local, "inside", False):         # a GEMM inside the QKV projection
                return f(*a, **k)
            t0 = time.thread_time()
            local.inside = name == "projection GEMMs"
            try:
                return f(*a, **k)
            finally:
                local.inside = False
                with lock:
                    acc[name] = acc.get(name, 0.0) + time.thread_time() - t0
        return g

    saved = {n: getattr(enc, n) for n in ("matmul_into", "masked_softmax", "bias_act",
                                          "bias_residual_layernorm")}
    qkv, proj, by_len = enc.Encoder._qkv, enc.Encoder._proj, enc.Encoder._attention_by_length
    try:
        # attention per text length (right padding): its products, with its softmax inside
        enc.Encoder._attention_by_length = wrap("attention by length", by_len)
        enc.matmul_into = wrap("attention products", saved["matmul_into"])
        enc.masked_softmax = wrap("softmax", saved["masked_softmax"])
        enc.bias_act = wrap("bias + GELU", saved["bias_act"])
        enc.bias_residual_layernorm = wrap("bias + residual + LayerNorm",
                                           saved["bias_residual_layernorm"])
        enc.Encoder._qkv = wrap("projection GEMMs", qkv)
        enc.Encoder._proj = wrap("projection GEMMs", proj)
        model.hidden_states(ids, mask)
        acc.clear()
        c0 = time.process_time()
        for _ in range(reps):
            model.hidden_states(ids, mask)
        total = time.process_time() - c0
    finally:
        for n, f in saved.items():
            setattr(enc, n, f)
        enc.Encoder._qkv, enc.Encoder._proj = qkv, proj
        enc.Encoder._attention_by_length = by_len
    if "attention by length" in acc:       # its softmax is counted under "softmax" already
        acc["attention products"] = (acc.get("attention products", 0.0)
                                     + acc.pop("attention by length") - acc.get("softmax", 0.0))
    out = {k: v / reps / nt for k, v in acc.items()}
    out["other"] = max(total / reps / nt - sum(out.values()), 0.0)
    out["total"] = total / reps / nt
    return out


def profile_ort(onnx_path: str, nt: int, model, reps: int) -> dict:
    """Seconds per 16 x 64 forward in each ONNX Runtime operator, from the session's own
    profile (``enable_profiling``: each node's kernel time, wall clock, its intra-op threads
    working on it together), with the MatMul nodes split into the projections and the
    attention products by node name."""
    import json

    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = nt
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(os.path.dirname(onnx_path), "profile")
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    ids, mask = _forward_batch(model)
    feed = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for _ in range(reps):
        sess.run(None, feed)
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    acc: dict[str, float] = {}
    for e in events:
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op = e["args"].get("op_name", "?")
        if op == "MatMul":
            attn = "/attention/self/MatMul" in e["name"]
            op = "attention products" if attn else "projection GEMMs"
        elif op == "FusedMatMul":
            op = "attention products"
        acc[op] = acc.get(op, 0.0) + e["dur"] * 1e-6
    out = {k: v / reps for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}
    out["total"] = sum(out.values())
    return out


def print_profile(name: str, prof: dict) -> None:
    tot = prof["total"]
    parts = [f"{k} {v * 1e3:.1f} ms ({v / tot:.0%})" for k, v in prof.items()
             if k != "total" and v * 1e3 >= 0.05]
    print(f"  {name} (total {tot * 1e3:.1f} ms): " + ", ".join(parts))


def main() -> int:
    from semzo.model import Tokenizer, default_model_path, embed_texts, load_model, set_threads
    nt = ARGS.threads
    docs = read_fortunes(ARGS.fortunes, ARGS.n)
    path = default_model_path()
    set_threads(nt)
    model = load_model(path)
    model.inference_layout()         # as the embed stage does
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

    sess = None
    if not ARGS.no_ort:
        import tempfile

        import onnxruntime
        tmp = tempfile.TemporaryDirectory(prefix="semzo-bench-onnx-")
        sess, t_exp = ort_session(path, nt, tmp.name)
        print(f"ONNX Runtime {onnxruntime.__version__}: exported (opset 17) and loaded in "
              f"{t_exp:.1f} s")

    with threadpool_limits(limits=nt):
        embed_texts(model, tok, docs[:64], batch_size=ARGS.batch_size)      # compile / warm up
        if st is not None:
            st.encode(docs[:64], batch_size=ARGS.batch_size)
            time.sleep(SWITCH_PAUSE)
        if sess is not None:
            ort_embed(sess, tok, docs[:64], ARGS.batch_size)
            time.sleep(SWITCH_PAUSE)
        t_sz, t_st, t_ort = [], [], []
        e_sz = e_st = e_ort = None
        shape = (ARGS.batch_size * 64, model.config.hidden_size, model.config.intermediate_size)
        probes = []                     # the sgemm rate just before each semzo pass
        for _ in range(ARGS.repeat):
            probes.append(sgemm_rate(*shape, reps=5))
            t0 = time.perf_counter()
            e_sz = embed_texts(model, tok, docs, batch_size=ARGS.batch_size)
            t_sz.append(time.perf_counter() - t0)
            if st is not None:
                time.sleep(SWITCH_PAUSE)
                t0 = time.perf_counter()
                e_st = st.encode(docs, batch_size=ARGS.batch_size, convert_to_numpy=True)
                t_st.append(time.perf_counter() - t0)
                time.sleep(SWITCH_PAUSE)
            if sess is not None:
                t0 = time.perf_counter()
                e_ort = ort_embed(sess, tok, docs, ARGS.batch_size)
                t_ort.append(time.perf_counter() - t0)
                time.sleep(SWITCH_PAUSE)
        fw = fixed_batch_forward(model, st, sess, ARGS.forward_reps) if ARGS.forward_reps \
            else None
        gemm = max(probes + [sgemm_rate(*shape)])   # the best rate seen in the run

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
        print(f"embeddings agree: min cosine {cos.min():.8f} (semzo vs sentence-transformers)")
    if sess is not None:
        best_ort = min(t_ort)
        print(f"onnxruntime           {n / best_ort:9.1f} docs/s   (range {n / max(t_ort):.1f} .. "
              f"{n / min(t_ort):.1f} over {len(t_ort)} passes)")
        print(f"ratio semzo / ORT     {best_ort / best_sz:9.2f}x  (best vs best; "
              f"median vs median {np.median(t_ort) / np.median(t_sz):.2f}x; goal >= 1.0x)")
        cos = (e_sz * e_ort).sum(1) / np.linalg.norm(e_sz, axis=1) / np.linalg.norm(e_ort, axis=1)
        print(f"embeddings agree: min cosine {cos.min():.8f} (semzo vs ONNX Runtime)")
    print(f"semzo achieved        {flops / best_sz / 1e9:9.1f} GFLOP/s  "
          f"(numpy sgemm {ARGS.batch_size * 64}x{model.config.hidden_size}x"
          f"{model.config.intermediate_size}: {gemm:.1f} GFLOP/s, the best of {len(probes)} "
          f"probes before the semzo passes and 20 calls after, "
          f"{flops / best_sz / 1e9 / gemm:.0%} of it)")
    if fw is not None:
        f16 = 16 * 64 * model.config.num_layers * (
            2 * (4 * model.config.hidden_size ** 2 +
                 2 * model.config.hidden_size * model.config.intermediate_size) +
            4 * 64 * model.config.hidden_size)
        fw, fc = fw
        parts = [f"{k} {v * 1e3:.1f} ms ({f16 / v / 1e9:.1f} GFLOP/s)" for k, v in fw.items()]
        print(f"forward 16x64 (best of {ARGS.forward_reps}): " + ", ".join(parts))
        print("forward 16x64 process CPU time (best): " +
              ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in fc.items()))
        for k, v in fw.items():
            if k != "semzo":
                print(f"forward ratio semzo / {k}: {v / fw['semzo']:.2f}x wall "
                      f"(goal >= 1.0x), {fc[k] / fc['semzo']:.2f}x CPU time")
    if ARGS.profile:
        print(f"where the 16x64 forward's time goes (per forward, mean of {ARGS.profile}, "
              f"{nt} threads):")
        with threadpool_limits(limits=nt):
            print_profile("semzo (CPU time of each part / threads)",
                          profile_semzo(model, ARGS.profile, nt))
            if sess is not None:
                print_profile("onnxruntime (its per-node profile: kernel wall time)",
                              profile_ort(os.path.join(tmp.name, "model.onnx"), nt, model,
                                          ARGS.profile))
    print("note: the machine is shared; timings are noisy, compare within one run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
