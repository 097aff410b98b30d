"""Does a smaller trainable set make ZO converge within 600 steps? The label words' rows of
SmolLM2's LM head (3 x 576 = 1,728 parameters, a delta from the zero-shot rows: a linear
classifier on the frozen model's last hidden state that starts at zero-shot) against
inputs/llm.toml's LoRA (30,720 parameters), on the prompt task of issue 32.

    .venv/bin/python bench/zo_label_rows.py [--labels law,education,drugs] [--seeds 0,1,2]
        [--opt fzoo|adam|sign|signmom] [--lrs 2e-5,5e-5,1e-4,1.5e-4] [--steps 600]
        [--batch 32] [--directions 4] [--cache FILE.npz] [--at 2,10,30]

The frozen model's final (normed) hidden state at each prompt's last position is computed once
with transformers (the features the label-word rows read); then per seed (the run's held-out
split for run.seed = S) the zero-shot held-out figures (they equal the run's "ZERO-SHOT" line),
first-order AdamW (lr 1e-2, batch 32, 30 epochs: the peer, the ceiling of this trainable
set), and an fzoo step on the delta in NumPy (Rademacher directions, the step divided by the
spread of the loss differences, cosine decay, eps 1e-2) at each lr of a grid for ``--steps``
steps of a ``--batch`` global batch, as 4 ranks of batch 8 take them. ``--opt`` puts the same
directions' plain estimate (mean of (L_i - L_0) / eps z_i) through another update instead:
Adam (0.9, 0.999), its sign, or the sign of its 0.9 moving average (the preconditioning that
sets first-order AdamW apart). Prints held-out accuracy and loss, and the gain in points over
zero-shot.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--labels", default="law,education,drugs")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--lrs", default="2e-5,5e-5,1e-4,1.5e-4")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--directions", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--opt", default="fzoo", choices=("fzoo", "adam", "sign", "signmom", "exact"))
    ap.add_argument("--cache", default="", help="npz file for the features")
    ap.add_argument("--at", default="", help="with --opt exact: also print the held-out "
                    "gain and loss after these steps (2,10,30: how soon the rows learn)")
    a = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM
    from zo_ceiling import prompts

    from semzo.preflight import heldout_mask
    torch.set_num_threads(a.threads)
    deck, seqs, words, y, ids = prompts(a.labels.split(","))
    t0 = time.time()
    cache = Path(a.cache) if a.cache else None
    if cache is not None and cache.exists():
        z = np.load(cache)
        h, w0 = z["h"], z["w0"]
    else:
        model = AutoModelForCausalLM.from_pretrained(
            str(ROOT / "models" / "smollm2-135m-instruct"), dtype=torch.float32).eval()
        with torch.no_grad():                 # the last hidden state (after the final norm)
            h = np.stack([model(input_ids=torch.tensor(s[None]), output_hidden_states=True)
                          .hidden_states[-1][0, -1].numpy() for s in seqs])
        w0 = model.lm_head.weight[torch.tensor(words)].detach().numpy()
        if cache is not None:
            np.savez(cache, h=h, w0=w0)
    h, w0 = h.astype(np.float64), w0.astype(np.float64)
    rms = float(np.sqrt((w0 ** 2).mean()))
    print(f"# {len(seqs)} prompts ({a.labels}), features {h.shape} in {time.time() - t0:.0f} s; "
          f"trainable: the label rows' delta {w0.shape} ({w0.size} parameters); ZO: "
          f"{a.directions} Rademacher directions, batch {a.batch}, {a.steps} steps, cosine, "
          f"eps 1e-2, update {a.opt}", flush=True)

    def ce_acc(d, rows):
        z = h[rows] @ (w0 + d).T
        z = z - z.max(1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(1, keepdims=True))
        return float(-lp[np.arange(len(rows)), y[rows]].mean()), float((z.argmax(1) == y[rows])
                                                                       .mean())

    at = {int(x) for x in a.at.split(",")} if a.at else set()
    for seed in [int(x) for x in a.seeds.split(",")]:
        held = heldout_mask(ids, seed, deck.train.heldout_fraction)
        tr, ho = np.flatnonzero(~held), np.flatnonzero(held)
        l0, a0 = ce_acc(np.zeros_like(w0), ho)
        d = torch.zeros(w0.shape, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.AdamW([d], lr=1e-2, weight_decay=0.0)
        ht, yt, wt = torch.tensor(h), torch.tensor(y), torch.tensor(w0)
        rng = np.random.default_rng(seed)
        fo = []
        for _ in range(30):
            for b in np.array_split(rng.permutation(tr), max(1, len(tr) // a.batch)):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(ht[b] @ (wt + d).T, yt[b]).backward()
                opt.step()
            fo.append(ce_acc(d.detach().numpy(), ho))
        line = (f"seed {seed}: zero-shot acc {a0:.4f} loss {l0:.3f}; first-order AdamW best "
                f"{max(x for _, x in fo):.4f} final {fo[-1][1]:.4f} "
                f"({100 * (fo[-1][1] - a0):+.1f}, loss {fo[-1][0]:.3f})")
        for lr in [float(x) for x in a.lrs.split(",")]:
            dz = np.zeros_like(w0)
            m, v = np.zeros_like(w0), np.zeros_like(w0)
            r = np.random.default_rng(100 + seed)
            eps = 1e-2
            for step in range(a.steps):
                b = r.choice(tr, a.batch, replace=False)
                cos = 0.5 * (1 + np.cos(np.pi * step / a.steps))
                if a.opt == "exact":          # the exact gradient, Adam, lr x the rows' rms
                    zz = h[b] @ (w0 + dz).T
                    p = np.exp(zz - zz.max(1, keepdims=True))
                    p /= p.sum(1, keepdims=True)
                    p[np.arange(len(b)), y[b]] -= 1.0
                    ghat = p.T @ h[b] / len(b)
                    m = 0.9 * m + 0.1 * ghat
                    v = 0.999 * v + 0.001 * ghat ** 2
                    upd = (m / (1 - 0.9 ** (step + 1))) / (
                        np.sqrt(v / (1 - 0.999 ** (step + 1))) + 1e-8)
                    dz -= lr * rms * cos * upd
                    if step + 1 in at:
                        lz, az = ce_acc(dz, ho)
                        line += (f"; lr {lr:g} after {step + 1} steps: {100 * (az - a0):+.1f} "
                                 f"(loss {lz:.3f})")
                    continue
                f0 = ce_acc(dz, b)[0]
                zs = r.choice([-1.0, 1.0], size=(a.directions,) + w0.shape)
                diff = np.array([ce_acc(dz + eps * z, b)[0] - f0 for z in zs])
                if a.opt == "fzoo":
                    g = diff / eps / (diff.std() + 1e-12)
                    dz -= lr * cos * np.tensordot(g, zs, 1) / a.directions
                    continue
                ghat = np.tensordot(diff / eps, zs, 1) / a.directions
                m = 0.9 * m + 0.1 * ghat
                if a.opt == "adam":
                    v = 0.999 * v + 0.001 * ghat ** 2
                    upd = (m / (1 - 0.9 ** (step + 1))) / (
                        np.sqrt(v / (1 - 0.999 ** (step + 1))) + 1e-8)
                else:
                    upd = np.sign(ghat if a.opt == "sign" else m)
                dz -= lr * cos * upd
            lz, az = ce_acc(dz, ho)
            line += f"; ZO lr {lr:g}: {az:.4f} ({100 * (az - a0):+.1f}, loss {lz:.3f})"
        print(line, flush=True)


if __name__ == "__main__":
    main()
