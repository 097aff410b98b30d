"""The label words' rows of the LM head, trained by their exact gradient (``train.label_rows``).

The prompt task's loss is a softmax over C label words' logits z = h W_c^T at each prompt's
last position (h: the final hidden state, W_c: the C rows of the LM head). Its gradient with
respect to those rows needs no backward pass: dL/dW_c = (softmax(z) - onehot(y))^T h / B, from
numbers every ZO forward pass already has. So besides the ZO-trained tensors (LoRA), a delta
D (C, E) on the label rows trains by that gradient: a linear probe that starts at zero-shot
and moves with the model under it (linear probing before or beside MeZO is MeZO's own
recommendation). It costs no forward pass: every training loss of a step (the fzoo base loss
and its N perturbed losses; mezo's L+ and L-) adds its rows' gradient, the step's gradient
is their mean over all ranks (one Allgather of C x E + 1 float64 values, summed in rank
order, so every rank applies the same update bit for bit), and Adam (0.9, 0.999) moves D by
``train.label_rows_lr`` x the rows' root-mean-square value x the ZO schedule's factor (the
scanned lr's decay and the guards' halvings).

State (D, Adam's two moments, its step count, the word ids) travels in :class:`TrainState`
(``label_rows``), so checkpoints, ``best.h5``, the held-out guard's rollback and a resume
carry it; ``model.h5`` stores D and the word ids as ``label_rows.delta`` and
``label_rows.word_ids``, and `semzo export` / `generate` add D to the head's rows (a tied
head is untied first: :func:`semzo.model.label_rows.apply_to_model`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..model.label_rows import DELTA, WORD_IDS  # noqa: F401  (model.h5's names)
from ..model.storage import to_float32
from ..runtime import SemzoError
from ..tasks.prompt import lm_head_weight


class LabelRows:
    """The trained delta of the label rows and its Adam state. ``w0`` (C, E): the label
    rows as stored (float32 view); ``lr``: Adam's step as a fraction of their RMS."""

    B1, B2, EPS = 0.9, 0.999, 1e-8

    def __init__(self, xp, w0, word_ids, lr: float) -> None:
        self.xp = xp
        w = np.asarray(w0.get() if hasattr(w0, "get") else w0, np.float64)
        self.word_ids = np.asarray(word_ids, np.int64)
        self.rms = float(np.sqrt((w ** 2).mean()))
        self.lr = float(lr)
        self.delta = xp.zeros(w.shape, xp.float32)           # what the scores add
        self.m = np.zeros(w.shape, np.float64)
        self.v = np.zeros(w.shape, np.float64)
        self.t = 0
        self._g = np.zeros(w.size + 1, np.float64)            # gradient sum, row count

    @classmethod
    def of_model(cls, model, word_ids, lr: float) -> LabelRows:
        """The trainer of a decoder's label rows ``word_ids`` as its LM head stores them (on
        the device, or NumPy with host parameters), at Adam step ``lr`` x their RMS."""
        xp, head = model.xp, lm_head_weight(model)
        mod = xp if isinstance(head, xp.ndarray) else np      # host_params: NumPy arrays
        return cls(xp, to_float32(head[mod.asarray(word_ids)]), word_ids, lr)

    # ------------------------------------------------------------------ gradient
    def begin(self) -> None:
        """A new step: forget the gradients of earlier losses (the lr scan's too)."""
        self._g[:] = 0.0

    def add(self, h, z, y, cap: float = 0.0) -> None:
        """Add the gradient sum of one loss: ``h`` (B, E) the hidden states the scores read,
        ``z`` (B, C) the scores, ``y`` (B,) the classes; ``cap``: the soft cap the scores
        went through (z = cap tanh(u / cap): dz/du = 1 - (z / cap)^2). Sum over rows, not
        the mean: :meth:`step` divides by the count."""
        xp = self.xp
        zz = z.astype(xp.float64)
        p = xp.exp(zz - zz.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p[xp.arange(len(y)), y] -= 1.0
        if cap:
            p *= 1.0 - (zz / cap) ** 2
        g = p.T @ h.astype(xp.float64)
        g = g.get() if hasattr(g, "get") else np.asarray(g)
        self._g[:-1] += g.reshape(-1)
        self._g[-1] += len(y)

    def step(self, comm: MPI.Intracomm, frac: float) -> bool:
        """The Adam step on the mean gradient of this step's losses over all ranks of
        ``comm`` (collective: one Allgather); ``frac``: the ZO schedule's factor. False
        (no update) when no rank had a row."""
        allg = np.empty((comm.Get_size(), self._g.size), np.float64)
        comm.Allgather(self._g, allg)
        tot = allg[0].copy()
        for r in range(1, allg.shape[0]):          # rank order: the same sum on every rank
            tot += allg[r]
        n = tot[-1]
        if n <= 0:
            return False
        g = (tot[:-1] / n).reshape(self.m.shape)
        self.t += 1
        self.m = self.B1 * self.m + (1 - self.B1) * g
        self.v = self.B2 * self.v + (1 - self.B2) * g * g
        mh = self.m / (1 - self.B1 ** self.t)
        vh = self.v / (1 - self.B2 ** self.t)
        upd = (self.lr * self.rms * frac) * mh / (np.sqrt(vh) + self.EPS)
        d = np.asarray(self.delta.get() if hasattr(self.delta, "get") else self.delta,
                       np.float64) - upd
        self.delta[...] = self.xp.asarray(d.astype(np.float32))
        return True

    # ------------------------------------------------------------------ state
    def pack(self) -> np.ndarray:
        """(4, C, E) float64: D, m, v and (in [3, 0, 0]) the step count, for TrainState."""
        out = np.zeros((4, *self.m.shape), np.float64)
        out[0] = self.delta.get() if hasattr(self.delta, "get") else self.delta
        out[1], out[2] = self.m, self.v
        out[3, 0, 0] = self.t
        return out

    def unpack(self, a: np.ndarray, src: str) -> None:
        """Back from :meth:`pack` (a checkpoint's state: checked, never trusted)."""
        a = np.asarray(a)
        if a.shape != (4, *self.m.shape) or a.dtype != np.float64 or \
                not np.all(np.isfinite(a)):
            raise SemzoError(f"{src}: state/label_rows: expected finite float64 of shape "
                             f"{(4, *self.m.shape)}, got {a.dtype} {a.shape}")
        self.delta[...] = self.xp.asarray(a[0].astype(np.float32))
        self.m, self.v = a[1].copy(), a[2].copy()
        self.t = int(a[3, 0, 0])
