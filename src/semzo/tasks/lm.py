"""Language modelling: next-token prediction with a decoder, loss and accuracy per predicted
token (:class:`LMTask`).

Frozen-prefix cache (:mod:`.prefix`, ``layer > 0``): when nothing below block ``layer`` trains
(LoRA or ``head+last`` in the top blocks), the residual stream entering it is computed once
per sequence and kept; a batch then carries its rows last (``(ids, mask, labels, n, rows)``)
so that the loss gathers their cached states and runs only the trained blocks. Without the
cache a batch of four (``(ids, mask, labels, n)``, as the benchmarks build by hand) works too.
"""

from __future__ import annotations

import numpy as np

from ..model import Tokenizer
from ..runtime import get_logger
from .base import Task, pad_batch
from .prefix import PrefixCached
from .prefix_store import PrefixStore, store_args
from .prompt import cache_layer

log = get_logger(__name__)


class LMTask(PrefixCached, Task):
    """Next-token prediction with a decoder: loss and accuracy per predicted token.
    ``layer > 0``: the frozen-prefix cache (the caller checks that nothing below block
    ``layer`` trains)."""

    kind = "lm"

    def __init__(self, model, seqs, labels, train_rows, heldout_rows, pad_id: int,
                 eval_batch_size: int, *, layer: int = 0, store: PrefixStore | None = None,
                 store_key: tuple = ()) -> None:
        super().__init__(model, seqs, labels, train_rows, heldout_rows, pad_id, eval_batch_size)
        self._init_cache(layer, eval_batch_size, store, store_key)

    def _rows_batch(self, rows):
        rows = np.asarray(rows, np.int64)
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return ids, mask, self.labels[rows], len(rows), rows

    def batch(self, positions: np.ndarray):
        return self._rows_batch(self.train_rows[positions])

    def eval_inputs(self, rows):
        return self._rows_batch(rows)

    def loss(self, batch) -> float:
        ids, mask, n = batch[0], batch[1], batch[3]
        if n == 0:
            return 0.0
        if self.cache is None:
            return self.model.next_token_loss(ids, mask)
        return self.loss_from_state(self._full(batch), batch)

    def loss_from_state(self, state, batch) -> float:
        if state is None:
            return 0.0
        return self.model.next_token_loss_from_hidden(state.hidden, state.ids, state.maskf)

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self.model.next_token_loss_from_hidden(state.hidden, state.ids, state.maskf,
                                                      return_accuracy=True)

    def eval_sums(self, run=None) -> np.ndarray:
        out = np.zeros(3)
        for rows in self.eval_batches:
            b = self.eval_inputs(rows)
            cnt = self.batch_weight(b)
            if cnt == 0:
                continue
            loss, acc = self._score(b) if run is None else run(b)     # b: padded once
            out += (loss * cnt, round(acc * cnt), cnt)
        return out

    def _score(self, b) -> tuple[float, float]:
        if self.cache is None:
            return self.model.next_token_loss(b[0], b[1], return_accuracy=True)
        return self.score_from_state(self._full(b), b)

    def eval_batch(self, rows) -> tuple[float, float]:
        """Mean loss and accuracy per predicted token of held-out rows ``rows``."""
        return self._score(self._rows_batch(rows))

    def batch_weight(self, batch) -> float:
        return float(batch[1][:, 1:].sum())


def build_lm_task(ctx, model, names, rows, train_idx, held_idx, max_len: int,
                  cache: bool = True) -> LMTask:
    """The run's :class:`LMTask` from the shard's texts, with the frozen-prefix cache when
    ``cache`` and the trainable set allows it. Collective (one allreduce)."""
    t = ctx.deck.train
    tok = Tokenizer.from_folder(ctx.deck.model.path or None, max_length=max_len)
    seqs = tok.encode_batch(rows.texts)
    layer = cache_layer(ctx, model, names, seqs, cache)
    if layer:
        log.info("finetune: lm task: blocks 0..%d frozen: their output is computed once per "
                 "text (%.0f MiB on rank %d); each step runs blocks %d..%d", layer - 1,
                 sum(len(q) for q in seqs) * model.config.hidden_size
                 * np.dtype(model.dtype).itemsize / 2**20, ctx.topo.rank, layer,
                 model.config.num_layers - 1)
    return LMTask(model, seqs, rows.labels, train_idx, held_idx, tok.pad_id,
                  t.eval_batch_size, layer=layer, **store_args(ctx))
