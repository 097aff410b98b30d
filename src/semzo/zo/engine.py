"""The ZO-SGD step (MeZO) and its three parallel modes over a :class:`~semzo.topology.Topology`.

One step, for the rank's trainable tensors theta (a list of :class:`~.perturb.ZTensor`)::

    perturb(theta, s, +eps)        -> L+ = loss(batch)                 pass 1
    perturb(theta, s, -2 eps)      -> L- = loss(batch)                 pass 2
    g = (L+ - L-) / (2 eps)        one float64 scalar per rank
    exchange (seed, g) pairs       mode-dependent, scalars only
    restore + update               theta <- theta - lr (sum_k w_k g_k z_k + wd theta)   pass 3

z is never stored: the kernels regenerate it from (seed, tensor index, element). Weight decay
is off for biases and LayerNorm weights (``ZTensor.decay``).

Modes (``[zo] mode``):

* ``data``: every rank uses the step seed (group 0) on its own batch; one allreduce of
  ``[n g, n, n loss, bad]`` makes g the projected gradient of the global batch
  (``g = sum_r n_r g_r / sum_r n_r``); every rank applies the same fused restore+update.
* ``perturbation``: rank r draws the seed of group r; the records ``(seed, g, n, loss, bad)``
  of all ranks are allgathered and every rank applies the P updates in one multi-update pass,
  weights ``w_k = n_k / N``.
* ``hybrid`` (DistZO2's 2D parallelism on the node/switch communicators): ranks of node j share
  the seed of group j and average g inside the node (node allreduce); node leaders exchange the
  node records over ``node_leaders`` (inside a switch) and ``switch_leaders`` (across
  switches), then broadcast them inside the node; one multi-update pass applies the
  per-node updates, weights ``n_j / N``.

Replicas stay bit-identical: in ``data`` mode every rank makes the same operations; when
groups differ (perturbation, hybrid), the arithmetic restore of a rank's own perturbation
leaves rounding residue (up to ~1.5 ulp, see docs/finetune.md) that differs from rank to rank,
so ``restore = "copy"`` keeps a reference copy of the trainable tensors that only receives the
(identical) multi-update and is copied back into the model. ``restore = "fused"`` skips the
copy (restore fused into the multi-update, as in one memory pass) and re-synchronizes the
replicas from rank 0 at every checksum. A NaN/Inf loss on any rank skips the step on every
rank (the decision comes out of the same collective).

Schedules (``[zo] schedule``): ``three-pass`` (above) or ``streamed`` (:mod:`.streamed`:
the model runs stage by stage, both branches in lockstep, two passes per step, the update
deferred into the next step's first pass; :meth:`ZOEngine.flush` applies a deferred update).

Per-step seeds are a counter-based hash of (run seed, step, group), so a resumed run
regenerates them (:func:`step_seed`).

Estimators (``[zo] estimator``): ``mezo`` (above) or ``fzoo`` (:meth:`ZOEngine.step_fzoo`,
FZOO: a base loss L0 and N one-sided perturbations per step, the N-direction update divided
by the standard deviation of the differences L_i - L0). fzoo's N directions are spread over
the seed groups (``ceil(N / groups)`` each, direction q = group x m + i has the seed of
"group" q), each rank exchanges only its losses (one allreduce in data mode, one allgather
otherwise), and every rank applies the same multi-update; it runs whole forward passes
(``loss_fn``) under either schedule.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .. import rng
from ..backend import array_module, synchronize
from ..runtime import EXIT_FAILURE, SemzoError
from . import kernels
from .offload import ResidentStore
from .perturb import (
    SMALL,
    Pending,
    ZTensor,
    apply_rows,
    apply_then_perturb,
    multi_update,
    perturb,
    restore_update,
)

MODES = ("data", "perturbation", "hybrid")
SCHEDULES = ("three-pass", "streamed")
ESTIMATORS = ("mezo", "fzoo")
#: added to the spread of the fzoo losses before dividing by it
SIGMA_TINY = 1e-12
_DOMAIN_SEED = np.uint64(0x5EED)
_M32 = np.uint64(0xFFFFFFFF)
_U32 = np.uint64(32)


class ReplicaMismatch(SemzoError):
    """Replicas of the trainable parameters differ between ranks; raised on every rank."""

    all_ranks = True
    exit_code = EXIT_FAILURE


# ----------------------------------------------------------------------------- seeds
def step_seed(run_seed: int, step: int, group: int) -> int:
    """The seed of ``group`` at ``step`` (uint64 as int): Philox of (step, group) keyed by the run
    seed. Pure function: a resumed run regenerates every seed."""
    s = np.uint64(step)
    x0, x1 = rng.philox_hash(s & _M32, s >> _U32, np.uint64(group), _DOMAIN_SEED, run_seed)
    return int(x0) | (int(x1) << 32)


# ----------------------------------------------------------------------------- checksums
_CHUNK = 1 << 20


def param_checksum(tensors: Sequence[ZTensor]) -> np.ndarray:
    """uint64[3]: (sum of the bit patterns, position-weighted sum of the bit patterns, float64
    sum viewed as bits), computed on the arrays' device with integer arithmetic modulo 2**64.
    The first two words are order-independent and exact, the same on CPU and GPU: one ulp
    anywhere changes them. The third (for the message of a mismatch) depends on the device's
    summation order. On a GPU the sums stay on the device and are read once."""
    s1 = s2 = 0
    fsum = 0.0
    dev: dict = {}                  # cupy: [s1, s2, fsum] as device scalars, read at the end
    for z in tensors:
        a = z.array.reshape(-1)
        xp = array_module(a)
        bits_t = {2: xp.uint16, 4: xp.uint32, 8: xp.uint64}[a.dtype.itemsize]
        for i0 in range(0, a.size, _CHUNK):
            c = a[i0:i0 + _CHUNK]
            b = c.view(bits_t).astype(xp.uint64)
            pos = xp.arange(i0, i0 + c.size, dtype=xp.uint64) * xp.uint64(0x9E3779B97F4A7C15)
            pos ^= xp.uint64(z.t)
            pos |= xp.uint64(1)
            parts = (b.sum(dtype=xp.uint64), (b * pos).sum(dtype=xp.uint64),
                     c.astype(xp.float64).sum())
            if xp is np:
                s1 = (s1 + int(parts[0])) % 2**64
                s2 = (s2 + int(parts[1])) % 2**64
                fsum += float(parts[2])
            else:                   # uint64 device sums wrap modulo 2**64 as the host's do
                acc = dev.setdefault(xp, [xp.uint64(0), xp.uint64(0), xp.float64(0.0)])
                for k in range(3):
                    acc[k] = acc[k] + parts[k]
    for acc in dev.values():
        s1 = (s1 + int(acc[0])) % 2**64
        s2 = (s2 + int(acc[1])) % 2**64
        fsum += float(acc[2])
    return np.array([s1, s2, int(np.float64(fsum).view(np.uint64))], dtype=np.uint64)


def verify_replicas(tensors: Sequence[ZTensor], comm: MPI.Intracomm, step: int) -> np.ndarray:
    """Compare the checksum of ``tensors`` across the ranks of ``comm``; raise
    :class:`ReplicaMismatch` on every rank (after the collective) if any rank differs.
    Collective over comm. Returns this rank's checksum."""
    mine = param_checksum(tensors)
    everyone = np.empty((comm.Get_size(), mine.size), dtype=np.uint64)
    comm.Allgather(mine, everyone)
    bad = [r for r in range(everyone.shape[0]) if not np.array_equal(everyone[r], everyone[0])]
    if bad:
        sums = [float(everyone[r, 2].view(np.float64)) for r in [0, *bad]]
        raise ReplicaMismatch(
            f"replicas differ at step {step}: the trainable parameters of rank(s) "
            f"{', '.join(map(str, bad))} do not match rank 0's (float64 sums "
            f"{', '.join(f'{s:.17g}' for s in sums)}); the run cannot continue consistently")
    return mine


# ----------------------------------------------------------------------------- the engine
@dataclass
class StepResult:
    """What one ZO step did (identical on every rank except the local fields)."""

    step: int
    ok: bool               # False: a NaN/Inf loss somewhere, step skipped on every rank
    g: float               # projected gradient, n-weighted mean over the step's groups
    loss: float            # n-weighted mean of (L+ + L-) / 2 over all ranks
    seeds: np.ndarray      # uint64 (K,): the seeds applied (K groups)
    gs: np.ndarray         # float64 (K,): their projected gradients
    lp: float = math.nan   # this rank's L+ (local)
    lm: float = math.nan   # this rank's L- (local)
    compute_s: float = 0.0  # this rank: forward passes and parameter passes
    comm_s: float = 0.0     # this rank: time inside the exchange collectives
    n: float = 0.0          # the step's weight over all ranks (samples, or predicted tokens)
    sigma: float = math.nan  # fzoo: the spread (std) of the N loss differences
    forwards: int = 2        # forward passes this rank ran
    w: np.ndarray | None = None  # the update's weight per seed and unit lr (what it applied)


class ZOEngine:
    """ZO-SGD over a list of trainable tensors, replicated on every rank of ``topo.world``.

    tensors: the model's trainable arrays (modified in place); mode: one of :data:`MODES`;
    restore: "copy" or "fused" (see module docstring); threads: numba threads of the CPU
    kernels (None: numba's setting). Collective methods are marked so.
    """

    def __init__(self, tensors: Sequence[ZTensor], topo, *, mode: str = "data",
                 eps: float = 1e-3, weight_decay: float = 0.0, dist: str = "gaussian",
                 restore: str = "copy", run_seed: int = 0, threads: int | None = None,
                 schedule: str = "three-pass", store=None, cache_z: bool = True,
                 defer_rows: bool = True, estimator: str = "mezo",
                 directions: int = 4) -> None:
        if estimator not in ESTIMATORS:
            raise ValueError(f"unknown ZO estimator {estimator!r}")
        if mode not in MODES:
            raise ValueError(f"unknown ZO mode {mode!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"unknown ZO schedule {schedule!r}")
        if restore not in ("copy", "fused"):
            raise ValueError(f"unknown restore {restore!r}")
        self.tensors = list(tensors)
        self.topo = topo
        self.mode = mode
        self.eps = float(eps)
        self.wd = float(weight_decay)
        self.dist = dist
        self.run_seed = int(run_seed)
        self.threads = threads
        if mode == "data":
            self.group, self.n_groups = 0, 1
        elif mode == "perturbation":
            self.group, self.n_groups = topo.rank, topo.size
        else:
            self.group, self.n_groups = topo.node_id, topo.n_nodes
        self.estimator = estimator
        # fzoo: m directions per seed group, N = m x groups in all (at least 2: a spread)
        self.dirs_per_group = max(1, -(-int(directions) // self.n_groups))
        if estimator == "fzoo" and self.dirs_per_group * self.n_groups < 2:
            self.dirs_per_group = 2
        self.copy = restore == "copy" and self.n_groups > 1
        self.fused_groups = restore == "fused" and self.n_groups > 1
        self.ref: list[ZTensor] = []
        if self.copy:
            self.ref = [z._replace(array=z.array.copy()) for z in self.tensors]
        self.loss_hook: Callable[[int, float], float] | None = None   # tests: inject NaN
        self.schedule = schedule
        self.cache_z = bool(cache_z)           # streamed: pass 2 reads pass 1's z (streamed.py)
        self.defer_rows = bool(defer_rows)     # streamed: rows the batch does not read wait
        self._zcache: tuple | None = None      # (task, streamed.ZCache) once made
        self.pending: Pending | None = None    # streamed: the update not applied yet
        self.pending_copy = False              # ... and it runs on the reference copy
        # streamed: per engine tensor, the rows (bool) of a token embedding that the pending
        # step's batch did not read: they still owe that step's + eps and - 2 eps
        self.owed: dict[int, np.ndarray] = {}
        self._groups: tuple | None = None
        if store is None:
            store = ResidentStore()
        self.store = store

    # ------------------------------------------------------------------ public
    def seed_for(self, step: int, group: int | None = None) -> int:
        return step_seed(self.run_seed, step, self.group if group is None else group)

    @property
    def n_trainable(self) -> int:
        return sum(int(z.array.size) for z in self.tensors)

    def step(self, loss_fn: Callable[[], float], step: int, lr: float, n_local: int) -> StepResult:
        """One ZO step on the rank's batch (``loss_fn()`` evaluates it at the current
        parameters; ``n_local`` its size, the weight of this rank). Collective over the world."""
        if self.pending is not None:
            self.flush()
        if self.estimator == "fzoo":
            return self.step_fzoo(loss_fn, step, lr, n_local)
        seed = self.seed_for(step)
        t0 = time.perf_counter()
        self._perturb(seed, self.eps)
        lp = float(loss_fn())
        self._perturb(seed, -2.0 * self.eps)
        lm = float(loss_fn())
        return self.finish(step, seed, lp, lm, n_local, lr, t0, streamed=False)

    def finish(self, step, seed, lp, lm, n_local, lr, t0, *, streamed: bool) -> StepResult:
        """Exchange and update (three-pass) or record the update as pending (the streamed
        schedule, :func:`.streamed.step_streamed`). Collective over the world."""
        if self.loss_hook is not None:
            lp = self.loss_hook(step, lp)
        g = (lp - lm) / (2.0 * self.eps)
        bad = 0.0 if (math.isfinite(lp) and math.isfinite(lm) and math.isfinite(g)) else 1.0
        t1 = time.perf_counter()
        rec = np.array([g if not bad else 0.0, float(n_local),
                        0.5 * (lp + lm) if not bad else 0.0, bad], dtype=np.float64)
        seeds, gs, ns, losses, nbad = self._exchange(step, seed, rec)
        t2 = time.perf_counter()
        ok = nbad == 0
        n_tot = float(ns.sum())
        apply = ok and n_tot > 0
        w = gs * (ns / n_tot) if apply else gs
        if streamed:
            self.pending, self.pending_copy = pending_after(self, apply, seeds, w, seed, lr)
        elif apply:
            self._update(seeds, w, seed, lr)
        else:
            self._undo(seed)
        if apply:
            g_mean = float(w.sum())
            loss = float((losses * ns).sum() / n_tot)
        else:
            g_mean, loss = math.nan, math.nan
        t3 = time.perf_counter()
        return StepResult(step, ok, g_mean, loss, seeds, gs, lp, lm,
                          compute_s=(t1 - t0) + (t3 - t2), comm_s=t2 - t1, n=n_tot,
                          w=np.asarray(w, np.float64))

    # ------------------------------------------------------------------ fzoo
    @property
    def n_directions(self) -> int:
        """Directions per step: fzoo's N (m per seed group), mezo's one per group."""
        return self.dirs_per_group * self.n_groups if self.estimator == "fzoo" \
            else self.n_groups

    def fzoo_seeds(self, step: int, group: int | None = None) -> list[int]:
        """The seeds of seed group ``group``'s fzoo directions at ``step``: direction q =
        group x m + i (i < m) has :func:`step_seed` (run seed, step, q)."""
        g = self.group if group is None else group
        m = self.dirs_per_group
        return [step_seed(self.run_seed, step, g * m + i) for i in range(m)]

    def step_fzoo(self, loss_fn: Callable[[], float], step: int, lr: float,
                  n_local: float) -> StepResult:
        """One FZOO step (Dang et al. 2025, Algorithm 1): the loss L0 at theta, then m
        one-sided perturbations of this rank's group, L_i at theta + eps z_i (the restore of
        z_i and the perturbation by z_{i+1} in one pass); every rank's (L0, L_i) are exchanged
        (scalars only) and every rank applies

            theta <- theta - lr / (sigma + tiny) x sum_k w_k (L_k - L0_k) / eps z_k

        over the N = m x groups directions, w_k = n_k / sum_j n_j (1 / N in data mode) and
        sigma the standard deviation of the N differences L_k - L0_k (FZOO's spread of the
        perturbed losses: on one batch the same number), in one multi-update pass fused with
        the restore of the last perturbation. Collective over the world."""
        seeds = self.fzoo_seeds(step)
        t0 = time.perf_counter()
        l0 = float(loss_fn())
        losses = []
        for i, s in enumerate(seeds):
            if i == 0:
                self._perturb(s, self.eps)
            else:                               # restore z_{i-1} and perturb z_i, one pass
                for grp, th in self._split(self.tensors):
                    apply_then_perturb(grp, Pending("perturb", seeds[i - 1], -self.eps), s,
                                       self.eps, dist=self.dist, threads=th)
            lv = float(loss_fn())
            if self.loss_hook is not None:
                lv = self.loss_hook(step, lv)
            losses.append(lv)
        t1 = time.perf_counter()
        vals = np.array([l0, *losses], np.float64)
        bad = 0.0 if bool(np.all(np.isfinite(vals))) else 1.0
        allseeds, d, ns, l0s, nbad = self._exchange_fzoo(step, vals if not bad else
                                                        np.zeros_like(vals), float(n_local), bad)
        t2 = time.perf_counter()
        n_tot = float(ns.sum())
        n_batch = float(ns[::self.dirs_per_group].sum())      # the global batch, once
        apply = nbad == 0 and n_tot > 0
        sigma = float(np.std(d)) if apply else math.nan
        last = seeds[-1]
        if apply:
            g = d / self.eps
            w = g * (ns / n_tot) / (sigma + SIGMA_TINY)
            seeds_i = [int(x) for x in allseeds]
            if self.copy:
                for grp, th in self._split(self.ref):
                    multi_update(grp, seeds_i, w, lr, self.wd, dist=self.dist, threads=th)
                self._copy_back()
            else:
                for grp, th in self._split(self.tensors):
                    multi_update(grp, seeds_i, w, lr, self.wd, eps=-self.eps,
                                 restore_seed=last, dist=self.dist, threads=th)
            g_mean = float((g * ns).sum() / n_tot)
            rows = ns[::self.dirs_per_group]
            loss = float((l0s[::self.dirs_per_group] * rows).sum() / rows.sum())
        else:
            if self.copy:
                self._copy_back()
            else:
                self._perturb(last, -self.eps)
            w, g_mean, loss = np.zeros(len(allseeds)), math.nan, math.nan
        t3 = time.perf_counter()
        return StepResult(step, apply, g_mean, loss, allseeds, np.asarray(w, np.float64),
                          l0, losses[-1], compute_s=(t1 - t0) + (t3 - t2), comm_s=t2 - t1,
                          sigma=sigma, forwards=1 + len(seeds), n=n_batch,
                          w=np.asarray(w, np.float64))

    def _exchange_fzoo(self, step: int, vals: np.ndarray, n: float, bad: float):
        """(seeds uint64 (N,), loss differences (N,), weights n (N,), base losses (N,),
        number of bad records), the directions in group order. data mode: one allreduce of
        the n-weighted losses; perturbation: one allgather of every rank's record;
        hybrid: a node allreduce, then one allgather (each node's record taken from its
        first rank). Scalars only."""
        m = self.dirs_per_group
        if self.mode == "data":
            buf = np.concatenate([vals * n, [n, bad]])
            self.topo.allreduce(buf)
            nt = buf[-2]
            mean = buf[:-2] / nt if nt > 0 else np.zeros(m + 1)
            seeds = np.array(self.fzoo_seeds(step, 0), np.uint64)
            return (seeds, mean[1:] - mean[0], np.full(m, nt), np.full(m, mean[0]),
                    int(buf[-1]))
        rec = np.concatenate([vals * n, [n, bad]])
        if self.mode == "hybrid" and self.topo.node.Get_size() > 1:
            self.topo.node.Allreduce(MPI.IN_PLACE, rec, op=MPI.SUM)
        out = np.concatenate([[float(step), float(self.group)], rec])
        allr = self.topo.allgather(out)
        first = {}
        for row in allr:                        # one record per group (hybrid: per node)
            first.setdefault(int(row[1]), row)
        if sorted(first) != list(range(self.n_groups)) or any(
                int(r[0]) != step for r in first.values()):
            raise ReplicaMismatch(f"step {step}: the exchanged fzoo records do not match "
                                  f"step {step} (a rank is out of step)")
        seeds, d, ns, l0s, nbad = [], [], [], [], 0
        for k in range(self.n_groups):
            r = first[k][2:]
            nk = r[-2]
            mean = r[:-2] / nk if nk > 0 else np.zeros(m + 1)
            seeds += self.fzoo_seeds(step, k)
            d.append(mean[1:] - mean[0])
            ns.append(np.full(m, nk))
            l0s.append(np.full(m, mean[0]))
            nbad += int(r[-1])
        return (np.array(seeds, np.uint64), np.concatenate(d), np.concatenate(ns),
                np.concatenate(l0s), nbad)

    def flush(self) -> None:
        """Apply the pending (deferred) update to every trainable tensor, so the parameters
        equal what the three-pass step leaves. Local (no communication); a no-op when nothing
        is pending. Call before any checksum, evaluation, checkpoint, export or cache build."""
        if self.pending is None:
            return
        self.store.sync()
        if self.pending_copy:
            for grp, th in self.split_pairs(self.ref, self.tensors):
                apply_then_perturb([r for r, _ in grp], self.pending, None,
                                   dst=[z for _, z in grp], dist=self.dist, threads=th)
        else:
            for grp, th in self._split(self.tensors):
                grp = flush_rows(self, grp)
                if grp:
                    apply_then_perturb(grp, self.pending, None, dist=self.dist, threads=th)
        self.pending, self.pending_copy = None, False
        self.owed.clear()

    def reload(self, arrays: dict[int, object]) -> None:
        """Overwrite the trainable tensors with ``arrays`` (position in ``self.tensors`` ->
        array of that tensor's shape: the best held-out model's, for the held-out guard's rollback), the
        reference copies too; a pending update is applied first and then overwritten. Local:
        every rank must pass the same arrays (they come from one checkpoint)."""
        self.flush()
        for i, z in enumerate(self.tensors):
            xp = array_module(z.array)
            xp.copyto(z.array, xp.asarray(arrays[i]).reshape(z.array.shape).astype(
                z.array.dtype, copy=False))
            if self.copy:
                xp.copyto(self.ref[i].array, z.array)

    def split_pairs(self, refs, tens):
        """:meth:`_split` of (ref, tensor) pairs by the tensor's size."""
        pairs = list(zip(refs, tens))
        small = [pr for pr in pairs if pr[1].array.size < SMALL or array_module(pr[1].array) is not np]
        large = [pr for pr in pairs if not (pr[1].array.size < SMALL
                                            or array_module(pr[1].array) is not np)]
        return [(g, th) for g, th in ((small, 1), (large, self.threads)) if g]

    def verify(self, step: int) -> None:
        """Check (or, with ``restore = "fused"`` and several groups, re-establish) identical
        replicas. Collective over the world; raises :class:`ReplicaMismatch` on every rank."""
        self.flush()
        if self.fused_groups:
            for z in self.tensors:
                synchronize(z.array)
                self.topo.bcast(z.array.reshape(-1), root=0)
        verify_replicas(self.tensors, self.topo.world, step)
        if self.copy:
            verify_replicas(self.ref, self.topo.world, step)

    # ------------------------------------------------------------------ exchange
    def _exchange(self, step: int, seed: int, rec: np.ndarray):
        """(seeds uint64 (K,), gs (K,), ns (K,), losses (K,), number of bad records)."""
        if self.mode == "data":
            w = np.array([rec[0] * rec[1], rec[1], rec[2] * rec[1], rec[3]])
            self.topo.allreduce(w)
            n = w[1]
            g = w[0] / n if n > 0 else 0.0
            loss = w[2] / n if n > 0 else 0.0
            return (np.array([seed], np.uint64), np.array([g]), np.array([n]), np.array([loss]),
                    int(w[3]))
        if self.mode == "perturbation":
            allr = self.topo.allgather(_pack(seed, self.group, rec))
        else:
            allr = self._hybrid_gather(seed, rec)
        allr = allr[np.argsort(allr[:, 1], kind="stable")]
        seeds = allr[:, 0].copy()
        # every rank sees the same records: a seed that is not the one the step's hash gives
        # (a rank out of step) fails here identically everywhere
        groups = [int(x) for x in allr[:, 1]]
        if groups != list(range(self.n_groups)) or any(
                int(s) != step_seed(self.run_seed, step, k) for k, s in zip(groups, seeds)):
            raise ReplicaMismatch(f"step {step}: the exchanged (seed, g) records do not match "
                                  f"the seeds of step {step} (a rank is out of step)")
        vals = allr[:, 2:].copy().view(np.float64)
        return seeds, vals[:, 0], vals[:, 1], vals[:, 2], int(vals[:, 3].sum())

    def _hybrid_gather(self, seed: int, rec: np.ndarray) -> np.ndarray:
        """Node allreduce of the n-weighted record, node leaders exchange the node records
        (allgather inside the switch over ``node_leaders``, allgatherv across switches over
        ``switch_leaders``, broadcast back over ``node_leaders``), then node broadcast."""
        topo = self.topo
        w = np.array([rec[0] * rec[1], rec[1], rec[2] * rec[1], rec[3]])
        if topo.node.Get_size() > 1:
            topo.node.Allreduce(MPI.IN_PLACE, w, op=MPI.SUM)
        n = w[1]
        node_rec = np.array([w[0] / n if n > 0 else 0.0, n, w[2] / n if n > 0 else 0.0, w[3]])
        out = np.empty((topo.n_nodes, 6), dtype=np.uint64)
        if topo.is_node_leader:
            nl = topo.node_leaders
            in_switch = np.empty((nl.Get_size(), 6), dtype=np.uint64)
            nl.Allgather(_pack(seed, topo.node_id, node_rec), in_switch)
            if topo.is_switch_leader:
                sl = topo.switch_leaders
                if sl.Get_size() > 1:
                    counts = np.bincount(topo.node_switch, minlength=topo.n_switches) * 6
                    displ = np.concatenate(([0], np.cumsum(counts)[:-1]))
                    sl.Allgatherv(in_switch, [out, counts, displ, MPI.UINT64_T])
                else:
                    out[:] = in_switch
            if nl.Get_size() > 1:
                nl.Bcast(out, root=0)
        if topo.node.Get_size() > 1:
            topo.node.Bcast(out, root=0)
        return out

    # ------------------------------------------------------------------ updates
    def _split(self, tensors: Sequence[ZTensor]):
        """(tensors, threads) groups: tensors below ``SMALL`` elements run on one thread (a
        parallel launch costs more than it saves there, much more on a shared machine)."""
        small = [z for z in tensors if z.array.size < SMALL or array_module(z.array) is not np]
        large = [z for z in tensors if not (z.array.size < SMALL or array_module(z.array) is not np)]
        return [(g, th) for g, th in ((small, 1), (large, self.threads)) if g]

    def _perturb(self, seed: int, scale: float) -> None:
        for group, th in self._split(self.tensors):
            perturb(group, seed, scale, dist=self.dist, threads=th)

    def _update(self, seeds: np.ndarray, w: np.ndarray, own_seed: int, lr: float) -> None:
        seeds_i = [int(s) for s in seeds]
        if self.n_groups == 1:
            # one direction, shared by every rank: restore and update in one pass
            for group, th in self._split(self.tensors):
                restore_update(group, own_seed, self.eps, lr, float(w[0]), self.wd,
                               dist=self.dist, threads=th)
        elif self.copy:
            for group, th in self._split(self.ref):
                multi_update(group, seeds_i, w, lr, self.wd, dist=self.dist, threads=th)
            self._copy_back()
        else:
            for group, th in self._split(self.tensors):
                multi_update(group, seeds_i, w, lr, self.wd, eps=self.eps,
                             restore_seed=own_seed, dist=self.dist, threads=th)

    def _undo(self, own_seed: int) -> None:
        """Skipped step: back to the state before it (exactly with a reference copy)."""
        if self.copy:
            self._copy_back()
        else:
            self._perturb(own_seed, self.eps)

    def _copy_back(self) -> None:
        for z, r in zip(self.tensors, self.ref):
            array_module(z.array).copyto(z.array, r.array)


def _pack(seed: int, group: int, rec: np.ndarray) -> np.ndarray:
    """A record as uint64[6]: seed, group, then the four float64 values' bits."""
    out = np.empty(6, dtype=np.uint64)
    out[0] = np.uint64(seed)
    out[1] = np.uint64(group)
    out[2:] = np.ascontiguousarray(rec, dtype=np.float64).view(np.uint64)
    return out


# ----------------------------------------------------------------------------- streamed
def pending_after(engine, ok: bool, seeds, w, own_seed: int, lr: float) -> tuple[Pending, bool]:
    """The step's deferred operation (what the three-pass step would apply now) and whether
    it runs on the reference copy (``zo.restore = "copy"``)."""
    if not ok:
        if engine.copy:
            return Pending("none"), True
        return Pending("perturb", own_seed, engine.eps), False
    if engine.n_groups == 1:
        return Pending("restore_update", own_seed, engine.eps, lr, float(w[0]), engine.wd), False
    seeds_t = tuple(int(s) for s in seeds)
    gs_t = tuple(float(x) for x in w)
    if engine.copy:
        return Pending("multi", 0, 0.0, lr, 0.0, engine.wd, seeds_t, gs_t), True
    return Pending("multi_restore", own_seed, engine.eps, lr, 0.0, engine.wd, seeds_t,
                   gs_t), False


def flush_rows(engine, grp) -> list:
    """The flush of the tensors with deferred rows among ``grp`` (ZTensors of
    ``engine.tensors``): the pending operation on every row, the deferred + eps and - 2 eps
    first where owed. Returns the other tensors of ``grp``."""
    if not engine.owed:
        return list(grp)
    pos = {id(z.array): i for i, z in enumerate(engine.tensors)}
    rest = []
    for z in grp:
        i = pos.get(id(z.array))
        owed = engine.owed.pop(i, None) if i is not None else None
        if owed is None:
            rest.append(z)
            continue
        apply_rows(z, owed.astype(np.uint8) * np.uint8(kernels.PRE), engine.pending, None,
                   pre=engine.eps, dist=engine.dist,
                   threads=1 if z.array.size < SMALL else engine.threads)
    return rest
