"""The training loop: tasks (classification, next-token), the training state, evaluation,
NaN guard, checksums, progress lines and metrics.

:class:`TrainState` holds everything a resumed run needs (step, run seed, data cursor, skip
count, last learning rate, the last M (step, seed, g) triples) as numbers and numpy arrays
(:meth:`TrainState.to_dict` / :meth:`TrainState.from_dict`); :func:`train` starts from any
such state and regenerates seeds, batches and learning rates from it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Self

import numpy as np

from ..model.base import cross_entropy
from ..model.storage import to_float32
from ..runtime import EXIT_FAILURE, SemzoError, get_logger
from .data import Batcher, pad_batch
from .engine import ZOEngine
from .schedule import lr_at

log = get_logger(__name__)


_PENDING = np.zeros(1, np.int64)     # a stop signal that came before training started


def hold_stop_signal() -> None:
    """Until training starts, SIGUSR1 (a batch system's warning that the time limit is near)
    is remembered instead of ending the process (its default action): training then stops
    after its first step, with a checkpoint. Main thread only (elsewhere: nothing)."""
    import signal
    import threading

    def remember(signum, _frame) -> None:
        _PENDING[0] = signum
        log.warning("%s received before training: the finetune stage will checkpoint and "
                    "stop after its first step", signal.Signals(signum).name)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGUSR1, remember)


class StopRequest:
    """A request to stop training early, by signal (a batch system about to end the job):
    ``SIGUSR1`` (what ``#SBATCH --signal=USR1@SECONDS`` sends, and what ``mpirun`` forwards
    to every rank) or ``SIGTERM`` (what ``scancel`` and preemption send first).

    Used as a context manager around :func:`train`: the handlers are installed only while the
    steps run (a signal during any other stage ends the process as before, but see
    :func:`hold_stop_signal`), and restored at exit. A rank that receives the signal only sets
    a flag. The ranks agree on it at check steps, by a nonblocking allreduce (MAX) on a
    duplicate of the world communicator, started when the check step starts and completed
    when it ends, so it overlaps the step. Checks are spaced about :attr:`PERIOD_S` apart:
    with the flag each rank proposes the number of steps to the next check from its own step
    time, and the smallest proposal is taken (the same allreduce), so every rank checks at the
    same steps and stops after the same one, at most about ``PERIOD_S`` plus a step after the
    signal. ``signum``: the signal the ranks agreed on (0: none). Collective over ``comm``
    (enter, exit and every check)."""

    PERIOD_S = 0.25

    def __init__(self, comm) -> None:
        self.world = comm
        self.signum = 0
        self._mine = np.zeros(1, np.int64)
        self._send = np.zeros(2, np.int64)     # (flag, -steps to the next check): MAX
        self._got = np.zeros(2, np.int64)
        self._req = None
        self._next: int | None = None           # step index of the next check
        self._last = (0, 0.0)                   # (step, time) of the last check
        self._old: dict = {}
        self.comm = None

    def __enter__(self) -> Self:
        import signal
        import threading

        self.comm = self.world.Dup()
        self._mine[0] = _PENDING[0]
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, _frame) -> None:
        self._mine[0] = signum

    def __exit__(self, *exc) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        # after an error every rank raised at the same step (TooManySkips, ReplicaMismatch),
        # every rank has started the same allreduce: complete it before MPI_Finalize; after
        # an error of one rank, leave it (run_spmd aborts the world)
        agreed = exc[0] is None or getattr(exc[1], "all_ranks", False)
        if self._req is not None and agreed:
            self._req.Wait()
        self._req = None
        if agreed:
            self.comm.Free()

    def start(self, step: int) -> None:
        """At the start of step ``step``: at a check step, share this rank's flag and its
        proposal for the next check (nonblocking)."""
        from mpi4py import MPI

        now = time.perf_counter()
        if self._next is None:
            self._next, self._last = step, (step, now)
        if step != self._next:
            return
        done, t = self._last
        per = (now - t) / (step - done) if step > done else 0.0
        k = 1 if per <= 0.0 else min(10_000, max(1, math.ceil(self.PERIOD_S / per)))
        self._last = (step, now)
        self._send[0], self._send[1] = self._mine[0], -k
        self._req = self.comm.Iallreduce(self._send, self._got, op=MPI.MAX)

    def agreed(self, step: int) -> int:
        """At the end of step ``step``: at a check step, the signal any rank had received when
        the check started (0: none), the same on every rank; else 0."""
        if self._req is None:
            return 0
        self._req.Wait()
        self._req = None
        self.signum = int(self._got[0])
        self._next = step + int(-self._got[1])
        return self.signum


class Preempted(SemzoError):
    """Training stopped early on a signal, after a checkpoint (every rank; exit 75, the
    ``EX_TEMPFAIL`` of sysexits.h: a job script may requeue the job on it)."""

    all_ranks = True
    exit_code = 75
    label = "stopped"


class TooManySkips(SemzoError):
    """More NaN/Inf steps than ``train.max_skips``; raised on every rank at the same step."""

    all_ranks = True
    exit_code = EXIT_FAILURE


# ----------------------------------------------------------------------------- state
@dataclass
class TrainState:
    """The whole training state of one rank (cursor fields differ between ranks)."""

    step: int = 0                  # next step to run
    run_seed: int = 0
    epoch: int = 0                 # data cursor: epoch and position in its permutation
    pos: int = 0
    skips: int = 0                 # steps skipped for a NaN/Inf loss
    lr: float = 0.0                # schedule: learning rate of the last step
    hist_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hist_seed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    hist_g: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))

    def record(self, step: int, seeds: np.ndarray, gs: np.ndarray, keep: int) -> None:
        """Append the step's (seed, g) pairs, keeping the last ``keep``."""
        k = len(seeds)
        self.hist_step = np.concatenate([self.hist_step, np.full(k, step, np.int64)])[-keep:]
        self.hist_seed = np.concatenate([self.hist_seed, np.asarray(seeds, np.uint64)])[-keep:]
        self.hist_g = np.concatenate([self.hist_g, np.asarray(gs, np.float64)])[-keep:]

    def to_dict(self) -> dict:
        """Numbers and numpy arrays only (copies)."""
        return {f.name: (getattr(self, f.name).copy() if isinstance(getattr(self, f.name),
                                                                     np.ndarray)
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        s = cls(step=int(d["step"]), run_seed=int(d["run_seed"]), epoch=int(d["epoch"]),
                pos=int(d["pos"]), skips=int(d["skips"]), lr=float(d["lr"]))
        s.hist_step = np.array(d["hist_step"], np.int64)
        s.hist_seed = np.array(d["hist_seed"], np.uint64)
        s.hist_g = np.array(d["hist_g"], np.float64)
        return s


# ----------------------------------------------------------------------------- tasks
class _Task:
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

    def __init__(self, model, seqs: list[np.ndarray], labels: np.ndarray,
                 train_rows: np.ndarray, heldout_rows: np.ndarray, pad_id: int,
                 eval_batch_size: int) -> None:
        self.model, self.seqs, self.labels = model, seqs, labels
        self.train_rows, self.heldout_rows = train_rows, heldout_rows
        self.pad_id = pad_id
        order = sorted(heldout_rows.tolist(), key=lambda r: -len(seqs[r]))
        self.eval_batches = [np.array(order[i:i + eval_batch_size], np.int64)
                             for i in range(0, len(order), eval_batch_size)]

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


class ClassifyTask(_Task):
    """Sequence classification: mean cross-entropy of the model's classification head."""

    kind = "classify"

    def loss(self, batch) -> float:
        ids, mask, labels, n = batch
        if n == 0:
            return 0.0
        return self.model.classify(ids, mask, labels)[0]

    def loss_from_state(self, state, batch) -> float:
        return self.score_from_state(state, batch)[0]

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self.model.classify_hidden(state.hidden, state.maskf, batch[2])[:2]

    def eval_batch(self, rows) -> tuple[float, float]:
        ids, mask = pad_batch([self.seqs[r] for r in rows], self.pad_id)
        return self.model.classify(ids, mask, self.labels[rows])[:2]


class LMTask(_Task):
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


class FeatureClassifyTask(_Task):
    """Classification when only the head trains: the frozen encoder's pooled, L2-normalized
    features of every row are computed once (``features`` (n, H) float32), and each loss is the
    head on them -- the same arithmetic as ``model.classify`` with ``head.normalize``."""

    kind = "classify"

    def __init__(self, model, features: np.ndarray, labels: np.ndarray,
                 train_rows: np.ndarray, heldout_rows: np.ndarray, eval_batch_size: int) -> None:
        xp = model.xp
        self.model, self.labels = model, labels
        self.feats = xp.asarray(np.ascontiguousarray(features, np.float32))
        self.train_rows, self.heldout_rows = train_rows, heldout_rows
        self.eval_batches = [heldout_rows[i:i + eval_batch_size]
                             for i in range(0, len(heldout_rows), eval_batch_size)]

    def batch(self, positions: np.ndarray):
        rows = self.train_rows[positions]
        return rows, None, self.labels[rows], len(rows)

    def _loss_acc(self, rows) -> tuple[float, float]:
        xp, p = self.model.xp, self.model.params
        w = to_float32(p["classifier.weight"])
        b = to_float32(p["classifier.bias"])
        logits = self.feats[xp.asarray(rows)] @ w.T + b
        return cross_entropy(xp, logits, xp.asarray(self.labels[rows]).astype(xp.int64))

    def loss(self, batch) -> float:
        rows, _, _, n = batch
        return self._loss_acc(rows)[0] if n else 0.0

    def stage_count(self) -> int:
        return 1

    def stage_params(self, k: int) -> list[str]:
        return ["classifier.weight", "classifier.bias"]

    def stage_rows(self, batch) -> dict:
        return {}                  # the features are fixed: no embedding matrix is read

    def stage_begin(self, batch):
        return batch[0] if batch[3] else None

    def stage_fork(self, state):
        return state

    def stage_run(self, k: int, state):
        return state

    def loss_from_state(self, state, batch) -> float:
        return self._loss_acc(state)[0] if state is not None else 0.0

    def score_from_state(self, state, batch) -> tuple[float, float]:
        return self._loss_acc(state) if state is not None else (0.0, 0.0)

    def eval_inputs(self, rows):
        return rows, None, self.labels[rows], len(rows)

    def eval_batch(self, rows) -> tuple[float, float]:
        return self._loss_acc(rows)


class PrefixCachedClassifyTask(_Task):
    """Classification when the lower ``layer`` blocks (and the embeddings) are frozen: the
    residual stream entering block ``layer`` is computed once per row (``model.hidden_at``) and
    kept, ``sum(len_i) x H`` values in the model dtype; each loss runs blocks ``layer .. L-1``,
    pooling and the head (``model.hidden_from``) -- the same arithmetic as
    :class:`ClassifyTask` (equal up to rounding: the cache is computed in other batches, with
    other padding lengths, so GEMM shapes differ), about ``L / (L - layer)`` times cheaper."""

    kind = "classify"

    def __init__(self, model, seqs: list[np.ndarray], labels: np.ndarray,
                 train_rows: np.ndarray, heldout_rows: np.ndarray, pad_id: int,
                 eval_batch_size: int, layer: int) -> None:
        super().__init__(model, seqs, labels, train_rows, heldout_rows, pad_id, eval_batch_size)
        xp = model.xp
        self.layer = layer
        lens = np.array([len(q) for q in seqs], np.int64)
        self.offs = np.concatenate(([0], np.cumsum(lens)))
        self.cache = xp.empty((int(self.offs[-1]), model.config.hidden_size), model.dtype)
        order = np.argsort(-lens, kind="stable")          # similar lengths share a batch
        for i in range(0, len(order), eval_batch_size):
            rows = order[i:i + eval_batch_size]
            ids, mask = pad_batch([seqs[r] for r in rows], pad_id)
            x = model.hidden_at(ids, mask, layer)
            for j, r in enumerate(rows):
                self.cache[self.offs[r]:self.offs[r + 1]] = x[j, :lens[r]]

    @staticmethod
    def nbytes(seqs: list[np.ndarray], hidden: int, itemsize: int) -> int:
        return sum(len(q) for q in seqs) * hidden * itemsize

    def _inputs(self, rows):
        xp = self.model.xp
        lens = self.offs[np.asarray(rows) + 1] - self.offs[np.asarray(rows)]
        t = int(lens.max()) if len(rows) else 0
        x = xp.zeros((len(rows), t, self.cache.shape[1]), self.cache.dtype)
        mask = np.zeros((len(rows), t), np.float32)
        for j, r in enumerate(rows):
            x[j, :lens[j]] = self.cache[self.offs[r]:self.offs[r + 1]]
            mask[j, :lens[j]] = 1.0
        return x, xp.asarray(mask)

    def batch(self, positions: np.ndarray):
        rows = self.train_rows[positions]
        x, mask = self._inputs(rows)
        return x, mask, self.labels[rows], len(rows)

    def _classify(self, x, mask, labels):
        hs = self.model.hidden_from(x, mask, self.layer)
        return self.model.classify_hidden(hs, mask, labels)

    def loss(self, batch) -> float:
        x, mask, labels, n = batch
        return self._classify(x, mask, labels)[0] if n else 0.0

    def stage_count(self) -> int:
        return self.model.n_stages - 1 - self.layer

    def stage_params(self, k: int) -> list[str]:
        return self.model.stage_names(self.layer + 1 + k)

    def stage_rows(self, batch) -> dict:
        return {}                  # stage 0 starts from the cached hidden states

    def stage_begin(self, batch):
        x, mask, _, n = batch
        return self.model.stage_start_from(x, mask, self.layer) if n else None

    def stage_run(self, k: int, state):
        return None if state is None else self.model.stage_forward(self.layer + 1 + k, state)

    def loss_from_state(self, state, batch) -> float:
        return self.score_from_state(state, batch)[0]

    def score_from_state(self, state, batch) -> tuple[float, float]:
        if state is None:
            return 0.0, 0.0
        return self.model.classify_hidden(state.hidden, batch[1], batch[2])[:2]

    def eval_inputs(self, rows):
        x, mask = self._inputs(rows)
        return x, mask, self.labels[rows], len(rows)

    def eval_batch(self, rows) -> tuple[float, float]:
        x, mask = self._inputs(rows)
        return self._classify(x, mask, self.labels[rows])[:2]


def evaluate(task: _Task, topo, store=None) -> tuple[float, float, int]:
    """Held-out (loss, accuracy, count) over all ranks. Collective over the world.

    ``store``: the engine's parameter store; an offloading one (``zo.offload = "host"``) keeps
    the parameters in host memory, so each evaluation batch then runs stage by stage through it
    (:func:`semzo.finetune.streamed.staged_score`)."""
    run = None
    if getattr(store, "offloads", False):
        from .streamed import staged_score

        def run(batch):
            return staged_score(store, task, batch)
    sums = task.eval_sums(run)
    topo.allreduce(sums)
    n = float(sums[2])
    return (float(sums[0]) / n if n else math.nan, float(sums[1]) / n if n else math.nan, int(n))


# ----------------------------------------------------------------------------- the loop
@dataclass
class LoopConfig:
    """What :func:`train` needs from the deck (``[zo]`` and ``[train]``)."""

    steps: int
    lr: float
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    eval_every: int = 0
    log_every: int = 10
    checksum_every: int = 50
    max_skips: int = 10
    history: int = 16

    @classmethod
    def from_deck(cls, deck) -> LoopConfig:
        t, z = deck.train, deck.zo
        return cls(steps=t.steps, lr=z.lr, schedule=t.schedule, warmup_steps=t.warmup_steps,
                   min_lr_ratio=t.min_lr_ratio, eval_every=t.eval_every, log_every=t.log_every,
                   checksum_every=z.checksum_every, max_skips=t.max_skips, history=z.history)


def train(engine: ZOEngine, task: _Task, batcher: Batcher, state: TrainState,
          cfg: LoopConfig, *, on_row: Callable[[dict], None] | None = None,
          on_comm: Callable[[float], None] | None = None,
          on_step: Callable[[TrainState], None] | None = None,
          stop: StopRequest | None = None) -> TrainState:
    """Run steps ``state.step .. cfg.steps - 1``. Collective over ``engine.topo.world``.

    ``stop``: an entered :class:`StopRequest`; training ends, on every rank, after the first
    check step at whose start any rank had received its signal (``stop.signum`` says which).

    ``on_row(row)`` receives every metrics row (train rows every step, eval rows every
    ``cfg.eval_every`` steps), on every rank. ``on_step(state)`` is called on every rank after
    every completed step (the hook for periodic checkpoints; it may be collective). Raises :class:`TooManySkips` (every rank, same
    step) and :class:`~.engine.ReplicaMismatch` (every rank, after the checksum collective).
    """
    topo = engine.topo
    t_start = time.perf_counter()
    first = state.step
    last_log = (t_start, first)
    while state.step < cfg.steps:
        step = state.step
        if stop is not None:
            stop.start(step)
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.schedule, cfg.warmup_steps, cfg.min_lr_ratio)
        positions, state.epoch, state.pos = batcher.next(state.epoch, state.pos)
        batch = task.batch(positions)
        weight = task.batch_weight(batch) if hasattr(task, "batch_weight") else batch[3]
        if engine.schedule == "streamed":
            res = engine.step_streamed(task, batch, step, lr, weight)
        else:
            res = engine.step(lambda b=batch: task.loss(b), step, lr, weight)
        if on_comm is not None:
            on_comm(res.comm_s)
        state.lr = lr
        state.step = step + 1
        if res.ok:
            state.record(step, res.seeds, res.gs, cfg.history)
        else:
            state.skips += 1
            if not (math.isfinite(res.lp) and math.isfinite(res.lm)):
                log.warning("step %d: non-finite loss on rank %d (L+ %.4g, L- %.4g); the step "
                            "is skipped on every rank (%d skipped so far, at most %d allowed)",
                            step, topo.rank, res.lp, res.lm, state.skips, cfg.max_skips)
            elif topo.rank == 0:
                log.info("step %d: skipped (non-finite loss on another rank; %d skipped so far, "
                         "at most %d allowed)", step, state.skips, cfg.max_skips)
            if state.skips > cfg.max_skips:
                raise TooManySkips(
                    f"stopping at step {step}: {state.skips} steps had a NaN or Inf loss "
                    f"(train.max_skips = {cfg.max_skips}); lower zo.lr or zo.eps, or check "
                    f"the data")
        if on_row is not None:
            on_row({"kind": "train", "step": step, "loss": res.loss, "g": res.g, "lr": lr,
                    "compute_s": res.compute_s, "comm_s": res.comm_s, "skipped": int(not res.ok)})
        done = state.step
        if cfg.checksum_every and done % cfg.checksum_every == 0 and done < cfg.steps:
            engine.verify(step)
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            engine.flush()                 # evaluation sees the updated model
            loss, acc, n = evaluate(task, topo, engine.store)
            if on_row is not None:
                on_row({"kind": "eval", "step": done, "heldout_loss": loss, "heldout_acc": acc,
                        "heldout_n": n})
            log.info("step %d: held-out loss %.4f, accuracy %.4f (%d samples)", done, loss,
                     acc, n)
        if done % cfg.log_every == 0 or done == cfg.steps:
            now = time.perf_counter()
            rate = (done - last_log[1]) / max(now - last_log[0], 1e-9)
            overall = (done - first) / max(now - t_start, 1e-9)
            eta = (cfg.steps - done) / max(overall, 1e-9)
            log.info("step %d/%d  loss %.4f  g %+.3e  lr %.2e  %.2f steps/s  ETA %s", done,
                     cfg.steps, res.loss, res.g, lr, rate, _fmt_eta(eta))
            last_log = (now, done)
        if on_step is not None:
            on_step(state)
        if stop is not None and stop.agreed(step):
            log.info("step %d: signal %d received: training stops here", done, stop.signum)
            break
    engine.verify(state.step)
    return state


def _fmt_eta(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
