"""Language modelling: next-token prediction with a decoder, loss and accuracy per predicted
token (:class:`LMTask`)."""

from __future__ import annotations

import numpy as np

from .base import Task, pad_batch


class LMTask(Task):
    """Next-token prediction with a decoder: loss and accuracy per predicted token."""

    kind = "lm"

    def loss(self, batch) -> float:
        ids, mask, _, n = batch
        if n == 0:
            return 0.0
        return self.model.next_token_loss(ids, mask)

    @property
    def tied_head(self) -> bool:
        return bool(self.model.tied_head)

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
            loss, acc = self.model.next_token_loss(b[0], b[1], return_accuracy=True) \
                if run is None else run(b)                 # b: padded once
            out += (loss * cnt, round(acc * cnt), cnt)
        return out

    def eval_batch(self, rows) -> tuple[float, float]:
        """Mean loss and accuracy per predicted token of held-out rows ``rows``."""
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return self.model.next_token_loss(ids, mask, return_accuracy=True)

    def batch_weight(self, batch) -> float:
        return float(batch[1][:, 1:].sum())
