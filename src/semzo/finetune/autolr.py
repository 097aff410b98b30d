"""``zo.lr = "auto"``: the learning rate picked by a short scan at the start of training.

The scan (collective over the world; every rank takes the same decisions because every loss
it compares is allreduced first):

1. Snapshot the trainable tensors (and the reference copy of ``zo.restore = "copy"``).
2. The scan batch: one training batch per rank from a cursor far from the run's (epoch
   :data:`PROBE_EPOCH` of the data order): the training cursor is not moved, the run's own
   batches and seeds are not used. Every scan step runs on it, and the probe loss is its
   loss (allreduced over the ranks, weighted by the batch sizes): a candidate's K steps must
   lower the loss of the batch they step on, which small steps do to first order and too
   large ones stop doing. (Probing other batches measures mostly how well a handful of random
   directions generalize, which is noise at this scale.)
3. One step at lr 0 measures the update's size per unit of lr, ``u = ||sum_k w_k z_k||``
   (``sqrt(d sum_k w_k^2)`` for independent z of squared norm d); the first candidate is
   ``lr0 = RHO ||theta|| / u``: a step that moves the parameters by RHO of their norm.
4. Each candidate lr runs ``K`` steps from the snapshot, on the same batches with the same
   seeds (step indices from :data:`SCAN_STEP0`: common random numbers, so candidates differ
   only by their lr), then the global probe loss is measured and the snapshot restored
   bit for bit. Candidates go up by :data:`FACTOR` while the probe loss falls below the
   start's and the last candidate's, else down by the same factor until one beats the start.
5. The lowest probe loss wins; the run uses it times :data:`SAFETY` (a handful of steps
   favour a step larger than a long run tolerates). None beats the start: the smallest
   candidate tried, times :data:`SAFETY`.

Cost: one forward pass per probe, one step at lr 0, ``K`` steps per candidate; K and
the number of candidates are sized so the whole stays within ``zo.lr_scan_fraction`` of the
run's forward passes (``K`` at least 1; with too small a budget fewer candidates run). The
chosen lr goes into the training state (``base_lr``), so a resumed run never scans again.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime import get_logger
from ..zo.engine import ZOEngine
from ..zo.perturb import ZTensor

log = get_logger(__name__)

PROBE_EPOCH = 1 << 30     # the probe's (and, + 1, the scan's) epoch of the data order
SCAN_STEP0 = 1 << 48      # the scan's step indices (seeds), far from the run's
RHO = 1e-2                # first candidate: this relative change of ||theta|| per step
FACTOR = 4.0              # between candidates
SAFETY = 0.5              # the winner times this
MAX_CANDIDATES = 6


def forwards_per_step(engine: ZOEngine) -> int:
    """Forward passes of one step on one rank: 2 (mezo), 1 + m (fzoo)."""
    return 1 + engine.dirs_per_group if engine.estimator == "fzoo" else 2


def plan(budget: int, per_step: int) -> tuple[int, int]:
    """(steps per candidate K, candidates C) fitting ``budget`` forward passes: a probe, a
    step at lr 0, and C times (K steps + a probe). C = 0: nothing fits."""
    for c in (MAX_CANDIDATES, 5, 4, 3, 2):
        k = (budget - per_step - 1 - c) // (c * per_step)
        if k >= 4 or (c == 2 and k >= 1):
            return int(min(k, 20)), c
    return 0, 0


def _norm(tensors: list[ZTensor]) -> float:
    s = 0.0
    for z in tensors:
        a = z.array
        a = a.get() if hasattr(a, "get") else a
        a = np.asarray(a)
        if a.dtype == np.uint16:                      # bfloat16 bits
            a = (a.astype(np.uint32) << 16).view(np.float32)
        s += float(np.dot(a.reshape(-1).astype(np.float64), a.reshape(-1).astype(np.float64)))
    return math.sqrt(s)


class _Snapshot:
    """Copies of the trainable tensors (and references) to go back to, bit for bit."""

    def __init__(self, engine: ZOEngine) -> None:
        engine.flush()
        engine.store.sync()
        self.engine = engine
        self.main = [z.array.copy() for z in engine.tensors]
        self.ref = [z.array.copy() for z in engine.ref] if engine.copy else []

    def restore(self) -> None:
        e = self.engine
        e.pending, e.pending_copy = None, False
        e.owed.clear()
        for z, a in zip(e.tensors, self.main):
            z.array[...] = a
        for z, a in zip(e.ref, self.ref):
            z.array[...] = a


def scan_lr(engine: ZOEngine, task, batcher, steps_left: int, frac: float, step_fn,
            loss_of) -> tuple[float, int]:
    """The scan above. ``step_fn(batch, step, lr)`` runs one ZO step (returns the
    StepResult); ``loss_of(batch)`` is a batch's loss at the current parameters (flushed).
    Returns (the chosen lr, forward passes it cost this rank). Collective over the world."""
    topo = engine.topo
    per = forwards_per_step(engine)
    budget = int(frac * max(steps_left, 0) * per)
    k, c_max = plan(budget, per)
    pos, _e, _p = batcher.next(PROBE_EPOCH, 0)
    scan = [task.batch(pos)] * max(k, 1)
    probes = scan[:1]
    probe_n = 1

    def weight(b) -> float:
        return float(task.batch_weight(b) if hasattr(task, "batch_weight") else b[3])

    def probe_loss() -> float:
        engine.flush()
        buf = np.zeros(3)
        for b in probes:
            v, n = float(loss_of(b)), weight(b)
            if math.isfinite(v):
                buf[0] += n * v
            else:
                buf[2] = 1.0
            buf[1] += n
        topo.allreduce(buf)
        return math.inf if buf[2] or buf[1] <= 0 else float(buf[0] / buf[1])

    used = 0
    snap = _Snapshot(engine)
    base = probe_loss()
    used += probe_n
    res = step_fn(scan[0], SCAN_STEP0, 0.0)
    used += per
    snap.restore()
    w = np.asarray(res.gs, np.float64)
    if engine.estimator == "mezo":
        w = w / max(len(w), 1)
    unit = math.sqrt(engine.n_trainable * float(np.dot(w, w))) if res.ok else 0.0
    theta = _norm(engine.tensors)
    if theta <= 0.0:
        theta = 1e-2 * math.sqrt(engine.n_trainable)
    if c_max == 0 or unit <= 0.0 or not math.isfinite(unit):
        lr = RHO * theta / unit * SAFETY if unit > 0 and math.isfinite(unit) else 1e-6
        log.warning("zo.lr = \"auto\": %s; lr %.3g from the size of one step (no scan)",
                    "the scan does not fit zo.lr_scan_fraction of this run's forward passes"
                    if c_max == 0 else "the first step's update is zero", lr)
        return lr, used
    lr0 = RHO * theta / unit
    tried: dict[float, float] = {}

    def run(lr: float) -> float:
        nonlocal used
        for i in range(k):
            step_fn(scan[i], SCAN_STEP0 + i, lr)
        used += k * per + probe_n
        loss = probe_loss()
        snap.restore()
        tried[lr] = loss
        log.info("zo.lr = \"auto\": lr %.3e, %d steps: probe loss %.5f (start %.5f)", lr, k,
                 loss, base)
        return loss

    lr, best = lr0, run(lr0)
    if best < base:                                 # up while it keeps improving
        while len(tried) < c_max:
            nxt = lr * FACTOR
            v = run(nxt)
            if not v < best:
                break
            lr, best = nxt, v
    else:                                           # down until one improves on the start
        while len(tried) < c_max and not best < base:
            lr /= FACTOR
            best = run(lr)
    win = min(tried, key=lambda x: (tried[x], x))
    if not tried[win] < base:
        win = min(tried)
    chosen = win * SAFETY
    log.info("zo.lr = \"auto\": lr %.3e (best candidate %.3e x %.2g; %d candidates, %d steps "
             "each, %d forward passes per rank, %.1f%% of the run's)", chosen, win, SAFETY,
             len(tried), k, used, 100.0 * used / max(steps_left * per, 1))
    return chosen, used
