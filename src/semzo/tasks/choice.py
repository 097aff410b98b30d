"""Multiple choice with a decoder (``train.task = "choice"``, MeZO's COPA/ReCoRD style):
records ``{"prompt", "choices": [2..16 strings], "answer"}``.

* Score of a choice: the summed log-likelihood of its tokens after the prompt
  (``train.choice_score = "sum"``), or their mean per token (``"mean"``: no bias towards
  short choices).
* Loss: the cross-entropy of the answer over the record's choice scores (a softmax over the
  choices), averaged over the records of the batch; accuracy: the share of records whose
  answer scores highest.
* Batching: a batch of records becomes one row per (record, choice): the prompt's tokens then
  the choice's. Rows of different lengths are right-padded, and the decoder computes only the
  real tokens of each row (its packed rows, :meth:`CausalLM._pack_rows`), so padding costs
  little; only the positions that predict a choice token go through the LM head.
* Frozen-prefix cache (:mod:`.prefix`, ``layer > 0``): when nothing below block ``layer``
  trains, the residual stream entering it is computed once per (record, choice) row (the
  prompt then the choice) and kept; each batch row carries its row index (the batch's last
  element) so that the loss gathers its cached states and runs only the trained blocks.
* Truncation: the prompt is cut from the left so that the longest choice fits
  ``train.max_length``; a record whose longest choice alone does not fit follows
  ``train.overlong`` as in the ``sft`` task.
"""

from __future__ import annotations

import numpy as np

from ..model.chat import InstructTokenizer
from ..model.kernels import scratch
from ..model.kernels_lm import token_nll
from ..runtime import get_logger, together
from .base import Task, pad_batch
from .prefix import PrefixCached
from .prefix_store import PrefixStore, store_args
from .prompt import cache_layer
from .sft import _load_records, _overlong_error, encode_records

log = get_logger(__name__)


class ChoiceTask(PrefixCached, Task):
    """``prompts[r]``: prompt ids of record r; ``choices[r]``: list of choice ids; ``labels``
    the answers; ``mean``: score by the mean log-likelihood per token. ``layer > 0``: the
    frozen-prefix cache of every (record, choice) row (the caller checks that nothing below
    block ``layer`` trains)."""

    kind = "choice"

    def __init__(self, model, prompts, choices, answers, train_rows, heldout_rows,
                 pad_id: int, eval_batch_size: int, mean: bool = False, *, layer: int = 0,
                 store: PrefixStore | None = None, store_key: tuple = ()) -> None:
        seqs = [np.concatenate([p, *c]) for p, c in zip(prompts, choices)]   # sort key only
        super().__init__(model, seqs, np.asarray(answers, np.int64), train_rows, heldout_rows,
                         pad_id, eval_batch_size)
        self.prompts, self.choices, self.mean = prompts, choices, bool(mean)
        # the first (record, choice) row of each record: row row_off[r] + c is choice c of r
        self.row_off = np.concatenate(([0], np.cumsum([len(c) for c in choices]))) \
            .astype(np.int64)
        self._init_cache(layer, eval_batch_size, store, store_key)

    @property
    def cache_seqs(self) -> list[np.ndarray]:
        """The (record, choice) rows' token ids (the prompt then the choice), in row order."""
        return choice_rows(self.prompts, self.choices)

    def _rows_batch(self, rows):
        rows = np.asarray(rows, np.int64)
        seqs, rec, start, length, row = [], [], [], [], []
        for j, r in enumerate(rows):
            p = self.prompts[r]
            for i, c in enumerate(self.choices[r]):
                seqs.append(np.concatenate([p, c]))
                rec.append(j)
                start.append(len(p))
                length.append(len(c))
                row.append(self.row_off[r] + i)
        ids, mask = pad_batch(seqs, self.pad_id)
        # (ids (S, T), mask, answers (B,), B, the record of each row in the batch (S,), its
        # first choice token (S,), its choice tokens (S,), its (record, choice) row (S,): last,
        # as the prefix cache reads it)
        return (ids, mask, self.labels[rows], len(rows), np.array(rec, np.int64),
                np.array(start, np.int64), np.array(length, np.int64),
                np.array(row, np.int64))

    def batch(self, positions: np.ndarray):
        return self._rows_batch(self.train_rows[positions])

    def eval_inputs(self, rows):
        return self._rows_batch(rows)

    # ------------------------------------------------------------------ scores
    def choice_scores(self, hidden, batch) -> np.ndarray:
        """float64 (S,): each row's choice score (summed or mean log-likelihood)."""
        xp, model = self.model.xp, self.model
        start, length = batch[5], batch[6]
        srow = np.repeat(np.arange(len(start)), length)
        pos = np.concatenate([np.arange(s, s + n) for s, n in zip(start, length)])
        tgt = np.asarray(batch[0])[srow, pos]
        h = hidden[xp.asarray(srow), xp.asarray(pos - 1)]          # (M, E): predict pos
        w = model._head_w()
        out = np.empty(len(pos), np.float64)
        for a in range(0, len(pos), 256):
            ha = h[a:a + 256]
            if xp is np and ha.dtype == np.float32:
                # the CPU: float32 logits in a scratch buffer, their float64 log-sum-exp by
                # the Numba kernel of the next-token loss (no float64 copy of 256 x V)
                z = model._head(ha, w, out=scratch(np, "choice_head", (ha.shape[0],
                                                                      w.shape[0]), np.float32))
                nll, hit = np.empty(ha.shape[0]), np.empty(ha.shape[0])
                token_nll(z, tgt[a:a + 256], nll, hit)
                out[a:a + 256] = -nll
                continue
            z = model._head(ha, w).astype(xp.float64)
            m = z.max(axis=1, keepdims=True)
            lse = (m + xp.log(xp.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
            pick = z[xp.arange(z.shape[0]), xp.asarray(tgt[a:a + 256])]
            out[a:a + 256] = _host(pick - lse)
        sums = np.add.reduceat(out, np.concatenate(([0], np.cumsum(length)[:-1])))
        return sums / length if self.mean else sums

    def _loss_acc(self, hidden, batch) -> tuple[float, float]:
        answers, n, rec = batch[2], batch[3], batch[4]
        s = self.choice_scores(hidden, batch)
        k = np.bincount(rec, minlength=n)
        z = np.full((n, int(k.max())), -np.inf)
        col = np.arange(len(rec)) - np.concatenate(([0], np.cumsum(k)[:-1]))[rec]
        z[rec, col] = s
        m = z.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(z - m).sum(axis=1))
        ce = lse - z[np.arange(n), answers]
        hit = np.argmax(z, axis=1) == answers
        return float(ce.mean()), float(hit.mean())

    def loss(self, batch) -> float:
        if batch[3] == 0:
            return 0.0
        return self._loss_acc(self._full(batch).hidden, batch)[0]

    def loss_from_state(self, state, batch) -> float:
        return self.score_from_state(state, batch)[0]

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self._loss_acc(state.hidden, batch)

    def eval_batch(self, rows) -> tuple[float, float]:
        b = self._rows_batch(rows)
        return self._loss_acc(self._full(b).hidden, b)

    def predict(self, rows) -> np.ndarray:
        """The highest-scoring choice (n,) of records ``rows``."""
        b = self._rows_batch(rows)
        s = self.choice_scores(self._full(b).hidden, b)
        return np.array([int(np.argmax(s[b[4] == j])) for j in range(b[3])], np.int64)


def _host(a):
    return np.asarray(a.get() if hasattr(a, "get") else a)


def choice_rows(prompts, choices) -> list[np.ndarray]:
    """Every (record, choice) row's token ids: the prompt then the choice, record by record."""
    return [np.concatenate([p, c]) for p, cs in zip(prompts, choices) for c in cs]


def build_choice_task(ctx, model, names, rows, train_idx, held_idx, max_len: int,
                      cache: bool = True) -> ChoiceTask:
    """The run's :class:`ChoiceTask` from the shard's records, with the frozen-prefix cache of
    its (record, choice) rows when ``cache`` and the trainable set allows it. Collective."""
    deck, topo, t = ctx.deck, ctx.topo, ctx.deck.train
    itok = together(topo.allreduce, InstructTokenizer.from_folder, deck.model.path)
    recs = _load_records(ctx, rows, "choice")
    prompts, choices, answers = [], [], []
    over = np.zeros(len(recs), bool)
    stats = np.zeros(3, np.int64)              # cut records, tokens cut, choices
    encoded = encode_records(ctx, recs, rows.ids, itok.choice, max_len)
    for i, (rec, got) in enumerate(zip(recs, encoded)):
        if got is None:
            over[i] = True                   # left out: empty rows (none cached)
            prompts.append(np.zeros(0, np.int64))
            choices.append([np.zeros(0, np.int64)] * 2)
            answers.append(0)
            continue
        p, cs, cut = got
        stats += (cut > 0, cut, len(cs))
        prompts.append(p)
        choices.append(cs)
        answers.append(rec["answer"])
    n_over = _overlong_error(deck, topo, rows.ids, over, "longest choice", max_len)
    topo.allreduce(stats)
    train_idx, held_idx = train_idx[~over[train_idx]], held_idx[~over[held_idx]]
    layer = cache_layer(ctx, model, names, choice_rows(prompts, choices), cache)
    log.info("finetune: choice task: %s log-likelihood of each choice's tokens after the "
             "prompt, cross-entropy over the choices; %d choices in all; %d records had their "
             "prompt cut from the left (%d tokens)%s%s",
             "mean per-token" if t.choice_score == "mean" else "summed", int(stats[2]),
             int(stats[0]), int(stats[1]),
             f"; {n_over} records left out (train.overlong = \"skip\")" if n_over else "",
             f"; blocks 0..{layer - 1} frozen: their output is computed once per (record, "
             f"choice) row" if layer else "")
    return ChoiceTask(model, prompts, choices, answers, train_idx, held_idx, itok.pad_id,
                      t.eval_batch_size, mean=t.choice_score == "mean", layer=layer,
                      **store_args(ctx))
