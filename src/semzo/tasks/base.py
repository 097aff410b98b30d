"""What the ZO optimizer optimizes: the :class:`Task` interface (training batches, the loss,
the held-out metric, and the stage protocol of the block-streamed schedule), which every task
of this package implements (:mod:`.classify`, :mod:`.lm`, :mod:`.prompt`).

A task knows the model and the rank's token sequences; it knows nothing of the optimizer
(:mod:`semzo.zo`) or of the stage that builds it (:mod:`semzo.finetune`).
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np


def pad_batch(seqs: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token id arrays to the longest: ids (B, T) int64, mask (B, T) float32."""
    t = max((len(s) for s in seqs), default=1)
    ids = np.full((len(seqs), max(t, 1)), pad_id, dtype=np.int64)
    mask = np.zeros(ids.shape, dtype=np.float32)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1.0
    return ids, mask


class Task:
    """Token sequences of the rank's rows, training batches and held-out evaluation.

    What a task gives the loop and the engine (a new task implements these):

    * ``batch(positions) -> batch``: a prepared training batch of ``train_rows[positions]``;
      ``batch[3]`` (or ``batch_weight(batch)``) its weight n in the n-weighted averages;
    * ``loss(batch) -> float``: the loss at the current parameters (three-pass schedule);
    * ``eval_sums(run=None)`` / ``eval_batch(rows)``: held-out sums (see :meth:`eval_sums`);
      ``eval_inputs(rows)`` (a batch of held-out rows) and ``score_from_state(state, batch) ->
      (loss, accuracy)`` let an offloading store run the evaluation stage by stage;
    * the streamed schedule (``zo.schedule = "streamed"``, :mod:`.streamed`) runs the loss
      stage by stage, two branches interleaved:

      - ``stage_count() -> int`` and ``stage_params(k) -> list[str]``: the stages and the
        names of ``model.params`` each reads (every trainable tensor in exactly one stage;
        by default the model's stages, see :mod:`semzo.model.base`);
      - ``stage_begin(batch) -> state`` (reads no parameter), ``stage_fork(state) -> state``
        (an independent copy for the other branch), ``stage_run(k, state) -> state`` (reads
        only stage k's parameters; stages run in order 0, 1, ...);
      - ``loss_from_state(state, batch) -> float``: the loss from the state after the last
        stage; it may read only the last stage's parameters, unless ``tied_head`` is True
        (it also reads stage 0's: the engine then keeps stage 0 at +eps until L+ is read).

      ``loss_from_state`` after running every stage must equal ``loss(batch)`` bit for bit
      (tests/test_zo_streamed.py checks this for every task). An empty batch (n = 0) may use
      ``None`` as its state; its loss is 0.0.
    """

    tied_head = False
    #: evaluation batches of the validation split (``train.val_fraction``; :meth:`split_eval`)
    val_batches: tuple | list = ()
    #: the split :meth:`eval_sums` reads now: "test" (the held-out one) or "val"
    evaluating = "test"

    def __init__(self, model, seqs: list[np.ndarray], labels: np.ndarray,
                 train_rows: np.ndarray, heldout_rows: np.ndarray, pad_id: int,
                 eval_batch_size: int) -> None:
        self.model, self.seqs, self.labels = model, seqs, labels
        self.train_rows, self.heldout_rows = train_rows, heldout_rows
        self.pad_id = pad_id
        order = sorted(heldout_rows.tolist(), key=lambda r: -len(seqs[r]))
        self.eval_batches = [np.array(order[i:i + eval_batch_size], np.int64)
                             for i in range(0, len(order), eval_batch_size)]

    def split_eval(self, is_val: np.ndarray) -> None:
        """Set the validation rows (``is_val[row]``) apart: the task was built with the
        held-out and the validation rows as its evaluation rows; ``eval_batches`` keeps the
        held-out ones, ``val_batches`` gets the others, each batch's rows in the task's own
        order (so a batch is never split across the two)."""
        test, val = [], []
        for b in self.eval_batches:
            b = np.asarray(b, np.int64)
            m = np.asarray(is_val, bool)[b]
            if (~m).any():
                test.append(b[~m])
            if m.any():
                val.append(b[m])
        self.eval_batches, self.val_batches = test, val

    @contextmanager
    def on_split(self, name: str):
        """Within the block, :meth:`eval_sums` reads the ``"val"`` (validation) batches
        instead of the held-out ones (``"test"``: no change)."""
        if name == "test":
            yield self
            return
        keep = self.eval_batches
        self.eval_batches, self.evaluating = self.val_batches, "val"
        try:
            yield self
        finally:
            self.eval_batches, self.evaluating = keep, "test"

    def batch(self, positions: np.ndarray):
        """Prepared inputs of training rows ``train_rows[positions]``."""
        rows = self.train_rows[positions]
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return ids, mask, self.labels[rows], len(rows)

    def loss(self, batch) -> float:
        raise NotImplementedError

    # ------------------------------------------------------------------ stages (streamed)
    def stage_count(self) -> int:
        return self.model.n_stages

    def stage_params(self, k: int) -> list[str]:
        return self.model.stage_names(k)

    def stage_begin(self, batch):
        ids, mask, _, n = batch
        return self.model.stage_start(ids, mask) if n else None

    def stage_rows(self, batch) -> dict:
        """``{name: rows}``: the rows of each matrix that stage 0 reads only by the batch's
        token ids (``model.gather_rows``); the streamed schedule defers the other rows'
        perturbations. Empty with a tied head (the loss reads every row) or when stage 0 is
        not the model's embedding stage."""
        if self.tied_head:
            return {}
        ids, _, _, n = batch[:4]
        if not n:                                      # no forward: no row is read
            return {k: np.zeros(0, np.int64)
                    for k in self.model.gather_rows(np.zeros(0, np.int64))}
        return self.model.gather_rows(ids)

    def stage_fork(self, state):
        return None if state is None else state.fork()

    def stage_run(self, k: int, state):
        return None if state is None else self.model.stage_forward(k, state)

    def loss_from_state(self, state, batch) -> float:
        raise NotImplementedError

    def eval_sums(self, run=None) -> np.ndarray:
        """float64 [sum of losses, sum of hits, count] over the rank's held-out rows: each
        evaluation batch's mean loss and accuracy (:meth:`eval_batch`) weighted by its rows.
        ``run(batch) -> (loss, accuracy)``: evaluate :meth:`eval_inputs` batches that way
        instead (the stages streamed through an offloading store; the same values)."""
        out = np.zeros(3)
        for rows in self.eval_batches:
            loss, acc = self.eval_batch(rows) if run is None else run(self.eval_inputs(rows))
            out += (loss * len(rows), round(acc * len(rows)), len(rows))
        return out

    def eval_inputs(self, rows):
        """A prepared batch (as :meth:`batch` gives) of held-out rows ``rows``."""
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return ids, mask, self.labels[rows], len(rows)

    def score_from_state(self, state, batch) -> tuple[float, float]:
        """(loss, accuracy) from the state after the last stage (the rule of
        :meth:`loss_from_state`); equals :meth:`eval_batch` of the same rows."""
        raise NotImplementedError

    def eval_batch(self, rows) -> tuple[float, float]:
        """Mean loss and accuracy of held-out rows ``rows``."""
        raise NotImplementedError
