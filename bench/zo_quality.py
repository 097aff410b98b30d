"""Held-out accuracy after a fixed budget of forward passes: semzo ZO (full and LoRA) against
the starting model and against first-order fine-tuning in torch of the same trainable subset.

    .venv/bin/python bench/zo_quality.py [--budget 200] [--classes 8] [--train 2000]
        [--heldout 400] [--length 32] [--batch 16] [--threads 2]

Data: the fortunes corpus (data/fortunes.jsonl), the ``--classes`` largest categories, a
hash-chosen held-out split. Model: all-MiniLM-L6-v2 with a classification head started from the
class means of the training embeddings (cosine, scale 20, log-prior bias: the finetune stage's
``class_means`` head), the same start for every method. Budget: ``--budget`` forward passes
per method (a ZO step costs two; a first-order step is counted as one, its backward pass
free). Methods:

* start: the initial model;
* semzo ZO full: every tensor, lr 2e-6, eps 1e-3 (MeZO's full-parameter range);
* semzo ZO LoRA: r = 8 on the attention projections + head, lr 1e-4, eps 1e-2 (MeZO's LoRA);
* torch first-order full / LoRA: AdamW (lr 2e-5 / 1e-3), same subsets, same batches.

Other people's processes on a shared machine make the wall times noisy; accuracies are not.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


class Solo:
    rank, size, node_id, n_nodes = 0, 1, 0, 1

    def allreduce(self, buf, op=None):
        return buf


def load_data(args):
    from semzo.preflight import heldout_mask
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    top = [c for c, _ in Counter(r["label"] for r in recs).most_common(args.classes)]
    recs = [r for r in recs if r["label"] in top]
    ids = np.array([r["id"] for r in recs])
    held = heldout_mask(ids, 0, 0.15)
    r = np.random.default_rng(0)
    tr = r.permutation(np.flatnonzero(~held))[:args.train]
    he = r.permutation(np.flatnonzero(held))[:args.heldout]
    lab = np.array([top.index(x["label"]) for x in recs])
    texts = [x["text"] for x in recs]
    return ([texts[i] for i in tr], lab[tr]), ([texts[i] for i in he], lab[he])


def semzo_model(params: str, args, head):
    from semzo.finetune.trainable import select_trainable
    from semzo.model import load_model

    m = load_model(None)
    m.add_classifier(args.classes, init="zeros", normalize=True)
    m.params["classifier.weight"][...] = head[0]
    m.params["classifier.bias"][...] = head[1]
    names = select_trainable(m, params, lora_rank=8, lora_alpha=16.0, seed=0)
    return m, names


def semzo_acc(m, tok, data, args) -> float:
    from semzo.tasks.base import pad_batch
    texts, lab = data
    seqs = tok.encode_batch(texts)
    hits = 0
    for i in range(0, len(texts), 64):
        ids, mask = pad_batch(seqs[i:i + 64], tok.pad_id)
        hits += round(m.classify(ids, mask, lab[i:i + 64])[1] * len(lab[i:i + 64]))
    return hits / len(texts)


def run_zo(params, lr, eps, args, head, tok, train, held, batches):
    from semzo.tasks.base import pad_batch
    from semzo.zo.engine import ZOEngine
    from semzo.zo.perturb import ztensors
    m, names = semzo_model(params, args, head)
    eng = ZOEngine(ztensors([(n, m.params[n]) for n in names]), Solo(), eps=eps,
                   threads=args.threads)
    seqs = tok.encode_batch(train[0])
    t0 = time.perf_counter()
    for s in range(args.budget // 2):
        rows = batches[s]
        ids, mask = pad_batch([seqs[i] for i in rows], tok.pad_id)
        lab = train[1][rows]
        eng.step(lambda ids=ids, mask=mask, lab=lab: m.classify(ids, mask, lab)[0], s, lr,
                 len(rows))
    return semzo_acc(m, tok, held, args), time.perf_counter() - t0, eng.n_trainable


def run_torch(params, lr, args, head, tok, train, held, batches):
    import torch
    from transformers import AutoModel

    from semzo.model import default_model_path
    from semzo.tasks.base import pad_batch

    torch.manual_seed(0)
    body = AutoModel.from_pretrained(str(default_model_path()))
    lin = torch.nn.Linear(body.config.hidden_size, args.classes)
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(head[0]))
        lin.bias.copy_(torch.from_numpy(head[1]))
    if params == "lora":
        for p in body.parameters():
            p.requires_grad_(False)
        for layer in body.encoder.layer:
            for mod, name in ((layer.attention.self, "query"), (layer.attention.self, "key"),
                              (layer.attention.self, "value"), (layer.attention.output, "dense")):
                setattr(mod, name, _Lora(getattr(mod, name), 8, 16.0))
    trainable = [p for p in list(body.parameters()) + list(lin.parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=lr)
    seqs = tok.encode_batch(train[0])

    def logits(ids, mask):
        # an integer mask: a float one sends transformers' SDPA down a very slow path
        out = body(input_ids=torch.from_numpy(ids),
                   attention_mask=torch.from_numpy(mask.astype(np.int64))).last_hidden_state
        m = torch.from_numpy(mask).unsqueeze(-1)
        pooled = (out * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return lin(torch.nn.functional.normalize(pooled, dim=-1))

    body.eval()    # no dropout, as the ZO forwards
    t0 = time.perf_counter()
    for s in range(args.budget):
        rows = batches[s]
        ids, mask = pad_batch([seqs[i] for i in rows], tok.pad_id)
        loss = torch.nn.functional.cross_entropy(logits(ids, mask),
                                                 torch.from_numpy(train[1][rows]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    secs = time.perf_counter() - t0
    hseqs = tok.encode_batch(held[0])
    hits = 0
    with torch.no_grad():
        for i in range(0, len(hseqs), 64):
            ids, mask = pad_batch(hseqs[i:i + 64], tok.pad_id)
            hits += int((logits(ids, mask).argmax(1).numpy() == held[1][i:i + 64]).sum())
    return hits / len(hseqs), secs, sum(p.numel() for p in trainable)


class _Lora:
    """Placeholder replaced at import time by a torch module (torch imported lazily)."""

    def __new__(cls, base, r, alpha):
        import torch

        class Lora(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.base = base
                g = torch.Generator().manual_seed(0)
                bound = 1.0 / base.in_features ** 0.5
                self.a = torch.nn.Parameter(
                    (torch.rand(r, base.in_features, generator=g) * 2 - 1) * bound)
                self.b = torch.nn.Parameter(torch.zeros(base.out_features, r))
                self.scale = alpha / r

            def forward(self, x):
                return self.base(x) + (x @ self.a.T) @ self.b.T * self.scale

        return Lora()


METHODS = {
    "zo-full": ("semzo ZO full (lr 2e-6, eps 1e-3)",
                lambda a, h, t, tr, he, b: run_zo("all", 2e-6, 1e-3, a, h, t, tr, he, b)),
    "zo-lora": ("semzo ZO LoRA r8 (lr 1e-4, eps 1e-2)",
                lambda a, h, t, tr, he, b: run_zo("lora", 1e-4, 1e-2, a, h, t, tr, he, b)),
    "fo-full": ("torch first-order full (AdamW 2e-5)",
                lambda a, h, t, tr, he, b: run_torch("all", 2e-5, a, h, t, tr, he, b)),
    "fo-lora": ("torch first-order LoRA r8 (AdamW 1e-3)",
                lambda a, h, t, tr, he, b: run_torch("lora", 1e-3, a, h, t, tr, he, b)),
}


def _threads(n: int, torch_only: bool = False) -> None:
    """Thread counts; a torch process leaves numba and threadpoolctl alone (two OpenMP
    runtimes configured in one process make torch's attention many times slower)."""
    if not torch_only:
        from semzo.backend import set_threads
        from semzo.model import set_threads as split_forwards

        set_threads(n)

        split_forwards(n)
    import torch
    torch.set_num_threads(n)


def child(args) -> None:
    """One method in a fresh process (numba's and torch's thread pools never share one), on
    the head and batches the parent saved."""
    from semzo.model import Tokenizer

    _threads(args.threads, torch_only=args.child.startswith("fo-"))
    st = np.load(args.state, allow_pickle=False)
    head = (st["w"], st["b"])
    batches = list(st["batches"])
    train, held = load_data(args)
    tok = Tokenizer.from_folder(None, max_length=args.length)
    acc, secs, n = METHODS[args.child][1](args, head, tok, train, held, batches)
    print("JSON " + json.dumps({"acc": acc, "secs": secs, "n": int(n)}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=int, default=200)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--train", type=int, default=2000)
    ap.add_argument("--heldout", type=int, default=400)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="zo-full,zo-lora,fo-full,fo-lora",
                    help="comma-separated subset of " + ", ".join(METHODS))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--state", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import subprocess
    import sys
    import tempfile

    from semzo.model import Tokenizer, embed_texts, load_model

    _threads(args.threads)
    train, held = load_data(args)
    tok = Tokenizer.from_folder(None, max_length=args.length)
    m0 = load_model(None)
    feats = embed_texts(m0, tok, train[0], batch_size=64).astype(np.float64)
    means = np.stack([feats[train[1] == c].mean(0) for c in range(args.classes)])
    means /= np.linalg.norm(means, axis=1, keepdims=True)
    counts = np.bincount(train[1], minlength=args.classes)
    head = ((20.0 * means).astype(np.float32), np.log(counts / counts.sum()).astype(np.float32))
    r = np.random.default_rng(1)
    batches = np.stack([r.choice(len(train[0]), args.batch, replace=False)
                        for _ in range(args.budget)])
    m, _ = semzo_model("all", args, head)
    start = semzo_acc(m, tok, held, args)
    print(f"fortunes, {args.classes} largest categories: {len(train[0])} training / "
          f"{len(held[0])} held-out texts, {args.length} tokens, batch {args.batch}, budget "
          f"{args.budget} forward passes per method, {args.threads} threads, each method in "
          f"its own process")
    print(f"  {'method':<40}{'trainable':>12}{'held-out acc':>14}{'wall [s]':>10}")
    print(f"  {'start (class-means head)':<40}{'-':>12}{start:>14.4f}{'-':>10}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state.npz"
        np.savez(state, w=head[0], b=head[1], batches=batches)
        for key in args.methods.split(","):
            cmd = [sys.executable, __file__, "--child", key, "--state", str(state)]
            for k in ("budget", "classes", "train", "heldout", "length", "batch", "threads"):
                cmd += [f"--{k}", str(getattr(args, k))]
            p = subprocess.run(cmd, capture_output=True, text=True, check=False)
            line = [x for x in p.stdout.splitlines() if x.startswith("JSON ")]
            if not line:
                raise RuntimeError(f"{key} failed:\n{p.stderr[-3000:]}")
            res = json.loads(line[0][5:])
            print(f"  {METHODS[key][0]:<40}{res['n']:>12,}{res['acc']:>14.4f}"
                  f"{res['secs']:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
