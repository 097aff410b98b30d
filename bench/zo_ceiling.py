"""What the trainable set of inputs/llm.toml can learn at all: first-order training (torch,
AdamW) of the same LoRA adapters (rank 8 on q and v of SmolLM2's last 2 blocks; with
``--lora-a frozen`` B alone, A kept at its start), on the same prompts, the same held-out split
(run.seed = S), the same label-word loss, batch 8: the ceiling that the ZO runs of issue 32
are read against.

    .venv/bin/python bench/zo_ceiling.py [--labels law,education,drugs] [--seeds 0,1,2,3,4]
        [--lr 1e-3] [--epochs 8] [--threads 1] [--lora-a train|frozen] [--cache FILE.npz]

Per seed: the zero-shot held-out accuracy and loss (they equal the run's "ZERO-SHOT" line:
the same prompts, words and split), the held-out accuracy and loss after every epoch, the best
and the final accuracy and their gain in points. The hidden states entering the first trained
block are computed once with transformers (``--cache``: kept in a file for the next call);
each step runs the 2 trained blocks, the final norm and the label words' rows of the LM head,
forward and backward, one prompt at a time (no padding), the batch's gradients summed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def prompts(labels: list[str]):
    """(deck, token id sequences, label word ids, labels y, record ids) as the run makes them."""
    from semzo.deck import load
    from semzo.model import Tokenizer
    from semzo.tasks.prompt import encode_prompts, label_word_ids

    deck = load(ROOT / "inputs" / "llm.toml", check_inputs=False)
    with open(ROOT / "data" / "fortunes.jsonl", encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    recs = [r for r in recs if r.get("label") in labels]
    tok = Tokenizer.from_folder(str(ROOT / "models" / "smollm2-135m-instruct"), max_length=None)
    tok.tk.no_truncation()
    t = deck.train
    words = label_word_ids(tok, labels, [], deck.prompt.template, "bench")
    seqs = encode_prompts(tok, [r["text"] for r in recs], deck.prompt.template, t.max_length,
                          8192, "bench")
    y = np.array([labels.index(r["label"]) for r in recs])
    ids = np.array([int(r["id"]) for r in recs])
    return deck, seqs, words, y, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default="law,education,drugs")
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora-a", default="train", choices=("train", "frozen"))
    ap.add_argument("--cache", default="", help="npz file for the prefix states")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from semzo.preflight import heldout_mask
    torch.set_num_threads(a.threads)
    labels = a.labels.split(",")
    deck, seqs, words, y, ids = prompts(labels)
    t = deck.train
    model = AutoModelForCausalLM.from_pretrained(
        str(ROOT / "models" / "smollm2-135m-instruct"), dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    first = len(model.model.layers) - t.lora_layers
    t0 = time.time()
    cache = Path(a.cache) if a.cache else None
    if cache is not None and cache.exists():
        z = np.load(cache)
        hs = [torch.tensor(z[f"h{i}"]) for i in range(len(seqs))]
    else:
        with torch.no_grad():
            hs = [model(input_ids=torch.tensor(s[None]), output_hidden_states=True)
                  .hidden_states[first][0].clone() for s in seqs]
        if cache is not None:
            np.savez(cache, **{f"h{i}": h.numpy() for i, h in enumerate(hs)})
    print(f"# {len(seqs)} prompts ({','.join(labels)}), prefix states in {time.time() - t0:.0f} "
          f"s; AdamW lr {a.lr}, {a.epochs} epochs, batch {t.batch_size}, LoRA rank "
          f"{t.lora_rank} on q, v of the last {t.lora_layers} blocks, A {a.lora_a}, "
          f"{a.threads} threads", flush=True)
    r, scale = t.lora_rank, t.lora_alpha / t.lora_rank
    layers = model.model.layers[first:]
    qv = [(layer.self_attn, n) for layer in layers for n in ("q_proj", "v_proj")]
    base = {(id(m), n): getattr(m, n) for m, n in qv}

    class LoRA(torch.nn.Module):
        def __init__(self, b, g):
            super().__init__()
            self.b = b
            self.A = torch.nn.Parameter(torch.randn(r, b.in_features, generator=g)
                                        / b.in_features ** .5)
            self.B = torch.nn.Parameter(torch.zeros(b.out_features, r))

        def forward(self, x):
            return self.b(x) + scale * (x @ self.A.T) @ self.B.T

    rows_w = torch.tensor(words)

    def logits_of(i):
        h = hs[i][None]
        pos = torch.arange(h.shape[1])[None]
        pe = model.model.rotary_emb(h, position_ids=pos)
        for layer in layers:
            h = layer(h, position_ids=pos, position_embeddings=pe)
            h = h[0] if isinstance(h, tuple) else h
        return model.model.norm(h[:, -1]) @ model.lm_head.weight[rows_w].T

    def evaluate(rows):
        with torch.no_grad():
            lg = torch.cat([logits_of(i) for i in rows])
        yy = torch.tensor(y[rows])
        return (float(torch.nn.functional.cross_entropy(lg, yy)),
                float((lg.argmax(1) == yy).float().mean()))

    for seed in [int(x) for x in a.seeds.split(",")]:
        held = heldout_mask(ids, seed, t.heldout_fraction)
        tr, ho = np.flatnonzero(~held), np.flatnonzero(held)
        g = torch.Generator().manual_seed(seed)
        for m, n in qv:
            setattr(m, n, LoRA(base[(id(m), n)], g))
        mods = [getattr(m, n) for m, n in qv]
        params = [x.B for x in mods] + ([] if a.lora_a == "frozen" else [x.A for x in mods])
        opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
        l0, a0 = evaluate(ho)
        best, hist = a0, []
        rng = np.random.default_rng(seed)
        t1 = time.time()
        for ep in range(a.epochs):
            perm = rng.permutation(tr)
            for k in range(0, len(perm), t.batch_size):
                b = perm[k:k + t.batch_size]
                lg = torch.cat([logits_of(i) for i in b])
                loss = torch.nn.functional.cross_entropy(lg, torch.tensor(y[b]))
                opt.zero_grad()
                loss.backward()
                opt.step()
            lh, ah = evaluate(ho)
            hist.append((ep + 1, round(ah, 4), round(lh, 4)))
            best = max(best, ah)
        print(f"seed {seed}: {len(tr)} train / {len(ho)} held out; zero-shot acc {a0:.4f} loss "
              f"{l0:.4f}; best {best:.4f} ({100 * (best - a0):+.2f}); final {hist[-1][1]:.4f} "
              f"({100 * (hist[-1][1] - a0):+.2f}); {time.time() - t1:.0f} s; per epoch (epoch, "
              f"acc, loss): {hist}", flush=True)


if __name__ == "__main__":
    main()
