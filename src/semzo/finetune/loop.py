"""The training loop: tasks (classification, next-token), the training state, evaluation,
NaN guard, checksums, progress lines and metrics.

:class:`TrainState` holds everything a resumed run needs (step, run seed, data cursor, skip
count, last learning rate, the last M (step, seed, g) triples) as numbers and numpy arrays
(:meth:`TrainState.to_dict` / :meth:`TrainState.from_dict`); :func:`train` starts from any
such state and regenerates seeds, batches and learning rates from it.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Self

import numpy as np
from mpi4py import MPI

from ..deck.read import label_rows_warmup
from ..place.weights import slow_factors, slowed
from ..runtime import EXIT_FAILURE, SemzoError, get_logger
from ..tasks.base import Task
from ..zo.engine import StepResult, ZOEngine
from ..zo.streamed import staged_loss, staged_score, step_streamed
from .autolr import guard_update, guard_window, heldout_update, scan_lr
from .data import Batcher
from .schedule import lr_at

log = get_logger(__name__)


_PENDING = np.zeros(1, np.int64)     # a stop signal that came before training started


def hold_stop_signal() -> None:
    """Until training starts, SIGUSR1 (a batch system's warning that the time limit is near)
    is remembered instead of ending the process (its default action): training then stops
    after its first step, with a checkpoint. Main thread only (elsewhere: nothing)."""

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

        self.comm = self.world.Dup()
        self._mine[0] = _PENDING[0]
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGUSR1, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, _frame) -> None:
        self._mine[0] = signum

    def __exit__(self, *exc) -> None:

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
    base_lr: float = -1.0          # the peak lr (zo.lr, or what its "auto" scan chose); -1: none
    forwards: int = 0              # forward passes of ZO steps (and the lr scan) on this rank
    best_step: int = -1            # the best held-out evaluation so far (-1: none)
    best_acc: float = -1.0         # its figures on the split the choice reads (validation, if
    best_loss: float = math.inf    # train.val_fraction, else held-out)
    best_test_acc: float = -1.0    # and on the held-out split
    best_test_loss: float = math.inf
    lr_scale: float = 1.0          # the loss guard's factor on the schedule's lr (autolr.py)
    gw_n: int = 0                  # the guard's current window: steps, sum, sum of squares
    gw_sum: float = 0.0
    gw_sq: float = 0.0
    gw_best: float = math.inf      # the best window's mean loss
    gw_var: float = 0.0            # the step-to-step variance of the loss, pooled
    gw_windows: int = 0            # windows so far
    hl_ref: float = math.inf       # the held-out guard's reference loss (autolr.py)
    rollbacks: int = 0             # the held-out guard's rollbacks so far
    best_lr_scale: float = 1.0     # lr_scale when the best model was recorded, and the
    rb_since_best: int = 0         # rollbacks to that model since (autolr.heldout_update)
    hist_step: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    hist_seed: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    hist_g: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    # train.label_rows = "exact": the trained label rows' (4, C, E) state (label_rows.py) and
    # the word ids they belong to; empty otherwise
    label_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))
    label_row_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    def record(self, step: int, seeds: np.ndarray, gs: np.ndarray, keep: int) -> None:
        """Append the step's (seed, g) pairs, keeping the last ``keep``."""
        k = len(seeds)
        self.hist_step = np.concatenate([self.hist_step, np.full(k, step, np.int64)])[-keep:]
        self.hist_seed = np.concatenate([self.hist_seed, np.asarray(seeds, np.uint64)])[-keep:]
        self.hist_g = np.concatenate([self.hist_g, np.asarray(gs, np.float64)])[-keep:]

    def better(self, loss: float, acc: float, by: str) -> bool:
        """Whether a held-out (loss, accuracy) beats the best so far: ``by = "acc"``: the
        higher accuracy, a tie broken by the lower loss; ``"loss"``: the lower loss."""
        if not math.isfinite(loss):
            return False
        if self.best_step < 0:
            return True
        if by == "acc" and math.isfinite(acc) and acc != self.best_acc:
            return acc > self.best_acc
        return loss < self.best_loss

    def to_dict(self) -> dict:
        """Numbers and numpy arrays only (copies)."""
        return {f.name: (getattr(self, f.name).copy() if isinstance(getattr(self, f.name),
                                                                     np.ndarray)
                         else getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, d: dict) -> TrainState:
        s = cls(step=int(d["step"]), run_seed=int(d["run_seed"]), epoch=int(d["epoch"]),
                pos=int(d["pos"]), skips=int(d["skips"]), lr=float(d["lr"]),
                base_lr=float(d.get("base_lr", -1.0)), forwards=int(d.get("forwards", 0)),
                best_step=int(d.get("best_step", -1)),
                best_acc=float(d.get("best_acc", -1.0)),
                best_loss=float(d.get("best_loss", math.inf)),
                best_test_acc=float(d.get("best_test_acc", d.get("best_acc", -1.0))),
                best_test_loss=float(d.get("best_test_loss", d.get("best_loss", math.inf))),
                lr_scale=float(d.get("lr_scale", 1.0)), gw_n=int(d.get("gw_n", 0)),
                gw_sum=float(d.get("gw_sum", 0.0)), gw_sq=float(d.get("gw_sq", 0.0)),
                gw_best=float(d.get("gw_best", math.inf)),
                gw_var=float(d.get("gw_var", 0.0)), gw_windows=int(d.get("gw_windows", 0)),
                hl_ref=float(d.get("hl_ref", math.inf)), rollbacks=int(d.get("rollbacks", 0)),
                best_lr_scale=float(d.get("best_lr_scale", d.get("lr_scale", 1.0))),
                rb_since_best=int(d.get("rb_since_best", 0)))
        s.hist_step = np.array(d["hist_step"], np.int64)
        s.hist_seed = np.array(d["hist_seed"], np.uint64)
        s.hist_g = np.array(d["hist_g"], np.float64)
        if "label_rows" in d:
            s.label_rows = np.array(d["label_rows"], np.float64)
            s.label_row_ids = np.array(d["label_row_ids"], np.int64)
        return s




def perplexity(task, loss: float) -> dict:
    """``{"heldout_ppl": exp(loss)}`` for the lm task (its loss is a mean per token), else {}."""
    if getattr(task, "kind", "") != "lm" or not math.isfinite(loss):
        return {}
    return {"heldout_ppl": math.exp(min(loss, 700.0))}


def evaluate(task: Task, topo, store=None, split: str = "test") -> tuple[float, float, int]:
    """Held-out (loss, accuracy, count) over all ranks (``split = "val"``: of the validation
    split, :meth:`~semzo.tasks.base.Task.split_eval`). Collective over the world.

    ``store``: the engine's parameter store; an offloading one (``zo.offload = "host"``) keeps
    the parameters in host memory, so each evaluation batch then runs stage by stage through it
    (:func:`semzo.zo.streamed.staged_score`)."""
    run = None
    if getattr(store, "offloads", False):
        def run(batch):
            return staged_score(store, task, batch)
    if split == "test":
        sums = task.eval_sums(run)
    else:
        with task.on_split(split):
            sums = task.eval_sums(run)
    topo.allreduce(sums)
    n = float(sums[2])
    return (float(sums[0]) / n if n else math.nan, float(sums[1]) / n if n else math.nan, int(n))


# ----------------------------------------------------------------------------- the loop
def schedule_name(deck) -> str:
    """``train.schedule`` with ``auto`` resolved: cosine with ``zo.lr = "auto"``, else
    constant."""
    if deck.train.schedule != "auto":
        return deck.train.schedule
    return "cosine" if deck.zo.lr == "auto" else "constant"


@dataclass
class LoopConfig:
    """What :func:`train` needs from the deck (``[zo]`` and ``[train]``)."""

    steps: int
    lr: float | str                # a number, or "auto" (the scan of autolr.py)
    schedule: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    eval_every: int = 0
    log_every: int = 10
    checksum_every: int = 50
    max_skips: int = 10
    history: int = 16
    lr_scan_fraction: float = 0.1
    guard: int = 0                 # the loss guard's window in steps (0 = off)
    rollback: float = 0.0          # the held-out guard's tolerance (0 = off)
    validation: bool = False       # decisions on the validation split (train.val_fraction)
    rows_warmup: int = 0           # steps at the start that train the label rows alone

    @classmethod
    def from_deck(cls, deck, steps: int | None = None) -> LoopConfig:
        """``steps``: the steps the run takes (``train.steps``, or fewer under
        ``train.max_epochs``): the loss guard's window is a fraction of them."""
        t, z = deck.train, deck.zo
        steps = t.steps if steps is None else int(steps)
        return cls(steps=steps, lr=z.lr, schedule=schedule_name(deck),
                   warmup_steps=t.warmup_steps,
                   min_lr_ratio=t.min_lr_ratio, eval_every=t.eval_every, log_every=t.log_every,
                   checksum_every=z.checksum_every, max_skips=t.max_skips, history=z.history,
                   lr_scan_fraction=z.lr_scan_fraction,
                   guard=guard_window(z.lr_guard_name, steps),
                   rollback=z.lr_rollback_value, validation=t.val_fraction > 0,
                   rows_warmup=label_rows_warmup(deck, steps))


def train(engine: ZOEngine, task: Task, batcher: Batcher, state: TrainState,
          cfg: LoopConfig, *, on_row: Callable[[dict], None] | None = None,
          on_comm: Callable[[float], None] | None = None,
          on_step: Callable[[TrainState], None] | None = None,
          on_eval: Callable[[TrainState, float, float], None] | None = None,
          on_rollback: Callable[[TrainState], None] | None = None,
          stop: StopRequest | None = None) -> TrainState:
    """Run steps ``state.step .. cfg.steps - 1``. Collective over ``engine.topo.world``.

    ``stop``: an entered :class:`StopRequest`; training ends, on every rank, after the first
    check step at whose start any rank had received its signal (``stop.signum`` says which).

    ``on_row(row)`` receives every metrics row (train rows every step, eval rows every
    ``cfg.eval_every`` steps), on every rank. ``on_step(state)`` is called on every rank after
    every completed step (the hook for periodic checkpoints; it may be collective).
    ``on_eval(state, loss, acc)`` after every periodic held-out evaluation (collective: the
    best-checkpoint hook); with ``cfg.validation`` the loss and accuracy are the validation
    split's, which the best model and the held-out guard then follow, and the held-out
    split's come as ``test=(loss, acc)``. ``on_rollback(state)``: puts the best held-out model's parameters
    back (collective) when the held-out guard (``cfg.rollback``, :func:`.autolr.heldout_update`)
    trips after an evaluation; without it the guard is off.

    ``cfg.lr = "auto"``: unless the state already holds the chosen lr (``base_lr``, a resumed
    run), :func:`.autolr.scan_lr` picks it before the first ZO step. ``cfg.rows_warmup``
    (with the task's trained label rows, ``train.label_rows_warmup``): steps ``0 ..
    rows_warmup - 1`` train the label rows alone (:func:`rows_step`), ZO starts after them.
    Raises :class:`TooManySkips` (every rank, same step) and
    :class:`~.engine.ReplicaMismatch` (every rank, after the checksum collective).
    """
    topo = engine.topo
    t_start = time.perf_counter()
    first = state.step
    last_log = (t_start, first)
    per_s = "tokens_per_s" if getattr(task, "kind", "") == "lm" else "samples_per_s"

    def run_step(batch, step, lr):
        weight = task.batch_weight(batch) if hasattr(task, "batch_weight") else batch[3]
        if engine.schedule == "streamed" and engine.estimator == "mezo":
            return step_streamed(engine, task, batch, step, lr, weight)
        return engine.step(lambda b=batch: loss_of(b), step, lr, weight)

    def loss_of(batch):
        if getattr(engine.store, "offloads", False):
            return staged_loss(engine.store, task, batch)
        return task.loss(batch)

    # test hook (SEMZO_SLOW_RANKS): this rank's forward passes made slower, to simulate a
    # slower device (the streamed mezo schedule runs its own passes and is not slowed)
    loss_of = slowed(loss_of, slow_factors().get(topo.rank, 1.0))

    # train.label_rows = "exact": the label rows' delta trains beside the ZO step
    lrows = getattr(task, "label_rows", None)
    if lrows is not None and state.label_rows.size:
        lrows.unpack(state.label_rows, "the resumed checkpoint")
    warm = cfg.rows_warmup if lrows is not None else 0
    if cfg.lr != "auto":
        state.base_lr = float(cfg.lr)
    if warm > state.step and topo.rank == 0:
        log.info("steps %d..%d of %d train the label rows alone (train.label_rows_warmup = "
                 "%d: one forward pass each, no ZO update); %s", state.step, warm - 1,
                 cfg.steps, warm, f"ZO starts at step {warm}" if warm < cfg.steps
                 else "ZO never starts in this run")
    while state.step < cfg.steps:
        step = state.step
        zo_step = step >= warm
        if zo_step and cfg.lr == "auto" and state.base_lr < 0:
            state.base_lr, used = scan_lr(engine, task, batcher, cfg.steps - state.step,
                                          cfg.lr_scan_fraction, run_step, loss_of)
            state.forwards += used
        t_step = time.perf_counter()
        if stop is not None:
            stop.start(step)
        lr = 0.0
        if zo_step:
            # the schedule runs over the ZO steps, from the end of the rows' warm-up
            lr = state.lr_scale * lr_at(step - warm, cfg.steps - warm, state.base_lr,
                                        cfg.schedule, cfg.warmup_steps, cfg.min_lr_ratio)
        positions, state.epoch, state.pos = batcher.next(state.epoch, state.pos)
        batch = task.batch(positions)
        if lrows is not None:
            lrows.begin()
        if zo_step:
            res = run_step(batch, step, lr)
            frac = lr / state.base_lr if state.base_lr > 0 else 0.0
        else:
            res = rows_step(topo, task, batch, step, loss_of)
            frac = 1.0
        if lrows is not None and res.ok and lrows.step(topo.world, frac):
            state.label_rows = lrows.pack()
        state.forwards += res.forwards
        if on_comm is not None:
            on_comm(res.comm_s)
        state.lr = lr
        state.step = step + 1
        if res.ok and zo_step:
            state.record(step, res.seeds, res.gs, cfg.history)
            if cfg.guard:
                msg = guard_update(state, res.loss, cfg.guard)
                if msg and topo.rank == 0:
                    log.warning("step %d: %s", step, msg)
        elif not res.ok:
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
            now = time.perf_counter()
            # throughput over all ranks: the step's global weight (the samples, or for the lm
            # task the predicted tokens, of the global batch) per second of this step
            on_row({"kind": "train", "step": step, "loss": res.loss, "g": res.g, "lr": lr,
                    "compute_s": res.compute_s, "comm_s": res.comm_s, "skipped": int(not res.ok),
                    "elapsed_s": now - t_start, per_s: res.n / max(now - t_step, 1e-9),
                    "sigma": res.sigma, "forwards": state.forwards})
        done = state.step
        if cfg.checksum_every and done % cfg.checksum_every == 0 and done < cfg.steps:
            engine.verify(step)
        if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
            engine.flush()                 # evaluation sees the updated model
            loss, acc, n = evaluate(task, topo, engine.store)
            row = {"kind": "eval", "step": done, "heldout_loss": loss, "heldout_acc": acc,
                   "heldout_n": n, **perplexity(task, loss)}
            sel = (loss, acc)              # what the best model and the guard follow
            unit = {"lm": "tokens", "sft": "completion tokens"}.get(getattr(task, "kind", ""),
                                                                   "samples")
            if cfg.validation:
                vl, va, vn = evaluate(task, topo, engine.store, "val")
                row.update(val_loss=vl, val_acc=va, val_n=vn)
                sel = (vl, va)
                log.info("step %d: validation loss %.4f, accuracy %.4f (%d %s)", done, vl, va,
                         vn, unit)
            if on_row is not None:
                on_row({**row, "elapsed_s": time.perf_counter() - t_start,
                        "forwards": state.forwards})
            if on_eval is not None:
                if cfg.validation:
                    on_eval(state, *sel, test=(loss, acc))
                else:
                    on_eval(state, loss, acc)
            log.info("step %d: held-out loss %.4f, accuracy %.4f (%d %s)", done, loss,
                     acc, n, unit)
            if cfg.rollback and on_rollback is not None:
                msg = heldout_update(state, sel[0], cfg.rollback,
                                     "validation" if cfg.validation else "held-out")
                if msg:
                    if topo.rank == 0:
                        log.warning("step %d: %s", done, msg)
                    on_rollback(state)
                    if lrows is not None and state.label_rows.size:
                        lrows.unpack(state.label_rows, "best.h5")
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


def rows_step(topo, task, batch, step: int, loss_of) -> StepResult:
    """One step of ``train.label_rows_warmup`` (collective over the world): this rank's loss
    of its batch, whose label-row gradient the task hands to its LabelRows; the n-weighted
    mean loss over all ranks; no ZO update. ``ok`` is False on every rank when any rank's
    loss is not finite (the rows then do not move)."""
    t0 = time.perf_counter()
    n = float(task.batch_weight(batch) if hasattr(task, "batch_weight") else batch[3])
    v = float(loss_of(batch))
    fin = math.isfinite(v)
    buf = np.array([n * v if fin else 0.0, n, 0.0 if fin else 1.0])
    t1 = time.perf_counter()
    topo.allreduce(buf)
    t2 = time.perf_counter()
    ok = buf[2] == 0.0 and buf[1] > 0.0
    return StepResult(step=step, ok=bool(ok), g=0.0,
                      loss=float(buf[0] / buf[1]) if ok else math.nan,
                      seeds=np.zeros(0, np.uint64), gs=np.zeros(0, np.float64), lp=v, lm=v,
                      compute_s=t1 - t0, comm_s=t2 - t1, n=float(buf[1]), forwards=1)


def _fmt_eta(s: float) -> str:
    s = round(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
