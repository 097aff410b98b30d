"""``zo.lr = "auto"``: the learning rate picked by line searches at the start of training.

The scan (collective over the world; every rank takes the same decisions because every loss
it compares is allreduced first):

1. Snapshot the trainable tensors (and the reference copy of ``zo.restore = "copy"``).
2. The scan batch: one training batch per rank from a cursor far from the run's (epoch
   :data:`PROBE_EPOCH` of the data order): the training cursor is not moved, the run's own
   batches and seeds are not used. Its loss, allreduced over the ranks (weighted by the batch
   sizes), is the probe loss.
3. For each of R directions: one ZO step at lr 0 (seeds from step :data:`SCAN_STEP0` + r, the
   estimator of the run) gives the update the step would apply per unit lr, ``u = sum_k w_k
   z_k``; then a line search along it on the scan batch: the probe loss at ``theta - lr u``
   for lr = lr0 x 4^j (lr0 moves theta by RHO of its norm), up while the loss keeps falling,
   else down until it falls below the start's; the minimizer is kept. Each candidate costs
   one forward pass (the update applied by the multi-update kernel, the snapshot restored bit
   for bit after it).
   The first line search starts at lr0; every later one starts :data:`FACTOR` squared below
   the minimizers found so far (their median) and takes at most :data:`LATER_CANDIDATES`
   probes, so a direction after the first costs a step at lr 0 and about 4 probes.
4. The run's lr is the weighted median (in log) of the R minimizers times :data:`SAFETY`, each
   minimizer weighted by the loss decrease it reached per unit lr (``(L0 - L(lr)) / lr``,
   about half the squared slope ``a`` below: the signal its line search had): a direction
   nearly orthogonal to the gradient lowers the loss by little more than the float32 noise of
   the loss, so its search stops early on a small lr that says nothing of the curvature
   (measured on SmolLM2, law/education/drugs seed 0: minimizers 1.9e-5 and 3.8e-5 with
   decreases of 1e-5 and 2e-4 beside 3.1e-4 to 2.5e-3 with 1e-3 to 0.12, which pulled the plain
   median down one grid step, and the run learned too slowly). A line
   search on the batch that gave its direction overshoots when that batch's own gradient
   dominates (measured on SmolLM2 with 16 prompts per step: single searches landed on 1.5e-3
   or on 6e-3, and runs at a quarter of the latter diverged), and the median of several
   directions is not pulled by one such search. Along a ZO
   direction the loss is ``L0 - lr a + lr^2 b / 2`` with b of the order of the trace of the
   Hessian (the curvature the noise of a d-dimensional random direction sees), so the
   minimizer a / b measures the largest step ZO-SGD tolerates at this point, whatever the
   model, the trainable set, the estimator's scale (fzoo's normalized step or mezo's) or the
   loss's.
   (Tried and dropped in the twentieth session: the optimum of the searches' summed
   parabolas, ``sum a / sum b``; docs/tuning.md.)

Cost: one probe, and per direction a step at lr 0 plus at most :data:`MAX_CANDIDATES` probes
(the first) or :data:`LATER_CANDIDATES` (the others); a direction starts only when its worst
case still fits, so the whole stays within ``zo.lr_scan_fraction`` of the run's forward
passes (R at most :data:`MAX_DIRECTIONS`). A run too short for one line search
takes lr0 of one step (a warning says so). The chosen lr goes into the training state
(``base_lr``), so a resumed run never scans again.
"""

from __future__ import annotations

import math

import numpy as np

from ..runtime import get_logger
from ..zo.engine import ZOEngine
from ..zo.perturb import ZTensor, multi_update

log = get_logger(__name__)

PROBE_EPOCH = 1 << 30     # the scan batch's epoch of the data order (far from the run's)
SCAN_STEP0 = 1 << 48      # the scan's step indices (seeds), far from the run's
RHO = 1e-3                # first candidate: this relative change of ||theta|| per step
FACTOR = 4.0              # between candidates
SAFETY = 0.25             # the line searches' minimizer times this
MAX_CANDIDATES = 12       # per direction: the first
LATER_CANDIDATES = 6      # the others (they start near the first's minimizer)
MAX_DIRECTIONS = 8
#: relative spacing of a storage format's grid: a step that changes the weights by less than
#: this (relative) is mostly rounded away, and what is left is the rounding of the few weights
#: near zero, whose loss change is noise (bfloat16: 8 significant bits; float16: 11). The line
#: searches never try a smaller step, and the first tries at least this.
GRID = {np.dtype(np.uint16): 2.0 ** -8, np.dtype(np.float16): 2.0 ** -11}
# True: the line searches on a batch apart from the directions' (measured: the same minimizers
# on SmolLM2 at 4 ranks; on the tiny test task the lr fell 10^4-fold, the direction's signal
# lost in the other batch's noise)
APART = False


def forwards_per_step(engine: ZOEngine) -> int:
    """Forward passes of one step on one rank: 2 (mezo), 1 + m (fzoo)."""
    return 1 + engine.dirs_per_group if engine.estimator == "fzoo" else 2


def plan(budget: int, per_step: int) -> int:
    """Directions R whose line searches fit ``budget`` forward passes: a probe, then per
    direction a step at lr 0 and up to :data:`MAX_CANDIDATES` probes. 0: not even one."""
    return int(max(0, min(MAX_DIRECTIONS, (budget - 1) // (per_step + MAX_CANDIDATES))))


def _median_log(xs: list[float]) -> float:
    """The median of positive numbers taken in log (two middle ones: their geometric mean)."""
    return float(np.exp(np.median(np.log(np.asarray(xs, np.float64)))))


def _weighted_median_log(xs: list[float], ws: list[float]) -> float:
    """The weighted median of positive numbers ``xs`` (weights ``ws`` >= 0, not all 0): the
    smallest x whose cumulative weight, in increasing order of x, reaches half the total;
    equal weights give the lower middle one (the plain median of an odd count)."""
    x = np.asarray(xs, np.float64)
    w = np.asarray(ws, np.float64)
    order = np.argsort(x, kind="stable")
    c = np.cumsum(w[order])
    return float(x[order][int(np.searchsorted(c, 0.5 * c[-1]))])


def storage_grid(tensors: list[ZTensor]) -> float:
    """The coarsest :data:`GRID` of the trainable tensors' storage (0.0: all float32)."""
    return max((GRID.get(np.dtype(z.array.dtype), 0.0) for z in tensors), default=0.0)


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


#: with a noisy loss (:func:`rounded_loss`) a line search ends before its cap only when the
#: loss rises this fraction above the start's (diverging: +15 % and more one factor past the
#: minimizer on the LLM demo, where the noise of the rounding is under 0.1 %)
NOISY_RISE = 0.02


def rounded_loss(task) -> bool:
    """Whether the task's loss is computed with activations rounded to bfloat16
    (``model.matmul = "bfloat16"``): piecewise constant at small scales, so a tiny step
    changes it by rounding noise (measured on the LLM demo: +-3e-4 to 8e-4 of 0.805 at steps
    that moved it by 3e-5 with float32 GEMMs)."""
    return getattr(getattr(task, "model", None), "matmul", "float32") == "bfloat16"


def scan_lr(engine: ZOEngine, task, batcher, steps_left: int, frac: float, step_fn,
            loss_of, noisy: bool | None = None) -> tuple[float, int]:
    """The scan above. ``step_fn(batch, step, lr)`` runs one ZO step (returns the
    StepResult); ``loss_of(batch)`` is a batch's loss at the current parameters (flushed).
    ``noisy`` (default: :func:`rounded_loss` of the task): the loss is rounding noise at
    small steps, so each line search goes up from its start through all its candidates
    (ending early only on a rise of :data:`NOISY_RISE`) and keeps the lowest loss it met: a
    rise or a dip of noise at a tiny step neither ends it nor sends it down.
    Returns (the chosen lr, forward passes it cost this rank). Collective over the world."""
    if noisy is None:
        noisy = rounded_loss(task)
    topo = engine.topo
    per = forwards_per_step(engine)
    budget = int(frac * max(steps_left, 0) * per)
    n_dirs = plan(budget, per)
    one = 1 + per + MAX_CANDIDATES                 # a probe and one line search
    if n_dirs == 0 and max(steps_left, 0) * per >= 4 * one:
        n_dirs = 1            # a short run still gets one line search (at most 25 % of it)
    pos, _e, _p = batcher.next(PROBE_EPOCH, 0)
    batch = task.batch(pos)
    dbatch = batch
    if APART:                 # the directions from another batch than the line searches'
        pos2, _e, _p = batcher.next(PROBE_EPOCH + 1, 0)
        dbatch = task.batch(pos2)
    n_b = float(task.batch_weight(batch) if hasattr(task, "batch_weight") else batch[3])

    def probe_loss() -> float:
        engine.flush()
        v = float(loss_of(batch))
        buf = np.array([n_b * v if math.isfinite(v) else 0.0, n_b,
                        0.0 if math.isfinite(v) else 1.0])
        topo.allreduce(buf)
        return math.inf if buf[2] or buf[1] <= 0 else float(buf[0] / buf[1])

    snap = _Snapshot(engine)
    base = probe_loss()
    used = 1
    # rank 0's norm for all: a BLAS dot's last bits depend on its thread count, which may
    # differ between ranks (run.threads = 0 on unlike nodes), and lr0 sets every candidate
    theta = float(topo.bcast(np.array([_norm(engine.tensors)], np.float64))[0])
    if theta <= 0.0:
        theta = 1e-2 * math.sqrt(engine.n_trainable)
    picks: list[float] = []
    weights: list[float] = []                       # loss decrease per unit lr of each pick
    grid = storage_grid(engine.tensors)
    for r in range(MAX_DIRECTIONS if n_dirs else 1):
        if r and used + per + LATER_CANDIDATES > budget:
            break                     # the next direction's worst case does not fit
        res = step_fn(dbatch, SCAN_STEP0 + r, 0.0)
        used += per
        snap.restore()
        if not res.ok:
            continue
        seeds = [int(x) for x in res.seeds]
        # the weights the step's update applies per unit lr (mezo: g_k n_k / n over the
        # seed groups, which differ when the ranks' batches do; fzoo: its normalized ones)
        w = np.asarray(res.w if res.w is not None else res.gs, np.float64)
        unit = math.sqrt(engine.n_trainable * float(np.dot(w, w)))
        if unit <= 0.0 or not math.isfinite(unit):
            continue
        lr0 = max(RHO, grid) * theta / unit
        lr_min = grid * theta / unit                # bfloat16 / float16: below, rounding noise
        if n_dirs == 0:
            picks.append(lr0)
            weights.append(1.0)
            break
        tried: dict[float, float] = {}
        cap = MAX_CANDIDATES if not picks else LATER_CANDIDATES

        def at(lr: float, seeds=seeds, w=w, tried=tried) -> float:
            nonlocal used
            for grp, th in engine._split(engine.tensors):
                multi_update(grp, seeds, w, lr, engine.wd, dist=engine.dist, threads=th)
            v = probe_loss()
            used += 1
            snap.restore()
            tried[lr] = v
            return v

        start = lr0 if not picks else max(_median_log(picks) / FACTOR ** 2, lr_min)
        lr, best = start, at(start)
        if noisy:           # up only, to the cap or a clear rise; the lowest loss met
            x = start
            while len(tried) < cap and not tried[x] > base + NOISY_RISE * abs(base):
                x *= FACTOR
                v = at(x)
                if v < best:
                    lr, best = x, v
        elif best < base:                            # up while the loss keeps falling
            while len(tried) < cap:
                v = at(lr * FACTOR)
                if not v < best:
                    break
                lr, best = lr * FACTOR, v
        else:                                        # down until one improves on the start
            while len(tried) < cap and not best < base and lr / FACTOR >= lr_min:
                lr /= FACTOR
                best = at(lr)
        if best < base:
            picks.append(lr)
            weights.append((base - best) / lr)
        log.info("zo.lr = \"auto\": direction %d: %s", r, ", ".join(
            f"lr {x:.2e} -> {v:.5f}" for x, v in sorted(tried.items())) + f" (start {base:.5f})")
    snap.restore()
    if not picks:
        lr = 1e-6
        log.warning("zo.lr = \"auto\": no step along the scanned directions lowered the loss; "
                    "lr %.3g", lr)
        return lr, used
    best_lr = _weighted_median_log(picks, weights)
    chosen = best_lr * (SAFETY if n_dirs else 1.0)
    if n_dirs == 0:
        log.warning("zo.lr = \"auto\": the line search does not fit zo.lr_scan_fraction of "
                    "this run's forward passes; lr %.3g from the size of one step", chosen)
    else:
        log.info("zo.lr = \"auto\": lr %.3e (the line searches' minimizers %s, their "
                 "median weighted by the decrease per unit lr %s, x %.2g; %d forward passes "
                 "per rank, %.1f%% of the run's)", chosen,
                 ", ".join(f"{x:.2e}" for x in picks), ", ".join(f"{x:.3g}" for x in weights),
                 SAFETY, used,
                 100.0 * used / max(steps_left * per, 1))
    return chosen, used


# ----------------------------------------------------------------------------- the guard
GUARD_Z = 4.0             # a window's mean loss this many standard errors above the best's
GUARD_REL = 0.05          # and this fraction above it: the loss rises
GUARD_FACTOR = 0.5        # the lr scale after a rise
GUARD_MIN_WINDOW = 5


def guard_window(setting, steps: int) -> int:
    """Steps per window of the loss guard: ``zo.lr_guard`` = an int (0 = off), or ``auto``
    (``max(5, steps // 30)``, so a run sees about 30 windows)."""
    if setting == "auto":
        return max(GUARD_MIN_WINDOW, steps // 30)
    return int(setting)


def guard_update(state, loss: float, window: int) -> str:
    """Feed one step's training loss (the global batch's mean at theta, the same on every
    rank) into the guard; at the end of a window compare the window's mean with the best
    window's: when it is both :data:`GUARD_Z` standard errors of their difference (the
    step-to-step variance pooled over all windows so far) and :data:`GUARD_REL`
    of the best above it the loss is rising (the step is too large for where training now is)
    and ``state.lr_scale`` is multiplied by :data:`GUARD_FACTOR`. (The best of K noisy windows
    lies about sqrt(2 ln K) standard errors below the true mean: hence 4, not 2 or 3, so a
    loss that merely stopped falling does not trip it over a run of some 30 windows.) Returns a message for the log when it acted, else "". Deterministic
    in the losses, so every rank takes the same decision without a collective."""
    if not math.isfinite(loss):
        return ""
    state.gw_n += 1
    state.gw_sum += loss
    state.gw_sq += loss * loss
    if state.gw_n < window:
        return ""
    n = state.gw_n
    mean = state.gw_sum / n
    var = max(state.gw_sq / n - mean * mean, 0.0) * n / max(n - 1, 1)
    state.gw_n, state.gw_sum, state.gw_sq = 0, 0.0, 0.0
    state.gw_windows += 1                  # the step-to-step variance, pooled over windows
    state.gw_var += (var - state.gw_var) / state.gw_windows
    se = math.sqrt(state.gw_var / n)
    if not math.isfinite(state.gw_best):
        state.gw_best = mean
        return ""
    lim = state.gw_best + max(GUARD_Z * math.sqrt(2.0) * se, GUARD_REL * abs(state.gw_best))
    if mean > lim:
        old = state.lr_scale
        state.lr_scale *= GUARD_FACTOR
        return (f"training loss rose: this window's mean {mean:.4f} > the best window's "
                f"{state.gw_best:.4f} by more than {GUARD_Z:g} standard errors and "
                f"{100 * GUARD_REL:g} %; lr scale {old:.3g} -> {state.lr_scale:.3g} "
                f"(zo.lr_guard)")
    state.gw_best = min(state.gw_best, mean)
    return ""


# ----------------------------------------------------------------------------- the held-out guard
ROLLBACK_FACTOR = 0.5     # the lr scale after a rollback


def heldout_update(state, loss: float, tol: float, name: str = "held-out") -> str:
    """Feed one periodic held-out loss (allreduced: the same on every rank) into the held-out
    guard (``zo.lr_rollback`` = ``tol``); call it after the best-model hook has seen the
    evaluation. ``state.hl_ref`` is the lowest held-out loss since the start or the last
    rollback (the rolled-back-to model's own loss after one). When this evaluation is not a
    new best (``state.best_step`` is not this step) and its loss exceeds ``hl_ref`` by more
    than ``tol`` of it, or is not finite, the training went astray: ``state.lr_scale`` is
    multiplied by :data:`ROLLBACK_FACTOR`, ``state.rollbacks`` counts it, ``hl_ref`` becomes
    the best model's loss, and a message for the log is returned: the caller then puts the
    best model's parameters back. Otherwise returns "". (The "newbob" rule of speech
    recognition's trainers: a held-out loss that got worse rejects the steps since the best
    and halves the step.) A new best never trips it, so with ``train.eval_every`` the run
    goes back at most to a model the best-model hook kept. Deterministic in allreduced
    numbers: every rank decides alike without a collective. ``name``: the split the loss is
    of, for the message (``"validation"`` with ``train.val_fraction``)."""
    if state.best_step < 0:
        return ""
    ref = state.hl_ref if math.isfinite(state.hl_ref) else state.best_loss
    if state.best_step == state.step:
        state.hl_ref = min(ref, loss) if math.isfinite(loss) else ref
        state.best_lr_scale, state.rb_since_best = state.lr_scale, 0
        return ""
    # no going back to a model whose own loss is higher than this one's: the best model is
    # chosen by accuracy and the lowest loss may belong to another step (law seed 1, step
    # 225: 0.4977 against a lowest 0.4478, and the best model's 0.5114: a rollback there
    # only undid progress and halved the lr)
    if math.isfinite(loss) and (loss <= ref + tol * abs(ref) or loss <= state.best_loss):
        state.hl_ref = min(ref, loss)
        return ""
    old = state.lr_scale
    # back to the best model, and to the lr scale it was made at, halved once per rollback
    # to it: a loss-guard cut in the steps now undone answered the same excursion and is
    # not compounded (seen: law/education/drugs seed 1, 600 steps, lr 3.99e-4: the loss guard
    # at step 119 and this guard at 125 left a quarter of the lr for 475 steps)
    state.rb_since_best += 1
    state.lr_scale = state.best_lr_scale * ROLLBACK_FACTOR ** state.rb_since_best
    state.rollbacks += 1
    state.hl_ref = state.best_loss
    state.gw_n, state.gw_sum, state.gw_sq = 0, 0.0, 0.0     # the loss guard's open window
    return (f"{name} loss {loss:.4f} is more than {100 * tol:g} % above the lowest so far "
            f"({ref:.4f}): back to the best {name} model (step {state.best_step}, {name} "
            f"loss {state.best_loss:.4f}); lr scale {old:.3g} -> {state.lr_scale:.3g} "
            f"(zo.lr_rollback)")
