"""The block-streamed ZO step (ZO2's schedule, ``zo.schedule = "streamed"``): two parameter
passes per step instead of three, the update of step t deferred into step t+1's first pass.

For each stage k of the task (embeddings, each block, final norm + head; see
:mod:`semzo.model.base`)::

    pass 1 over stage k:  pending update of step t-1 (restore + update, or the P-seed
                          multi-update, or the undo of a skipped step), then + eps z_t
    the + branch's state goes through stage k
    pass 2 over stage k:  - 2 eps z_t
    the - branch's state goes through stage k

After the last stage each branch's loss is read (the + branch's before pass 2 of the last
stage: the head belongs to it). The step's update is then only recorded (:class:`Pending`);
:meth:`ZOEngine.flush` applies it to every tensor, which the loop does before any checksum,
evaluation, checkpoint, export and at the end, so what is saved is the updated model.

Every element goes through exactly the roundings of the three-pass step (pass 1 rounds the
update's result to the storage type, reads it back and adds eps z: two roundings in one memory
pass), so parameters and losses equal the three-pass step's bit for bit, in every mode and at
every rank count (tests/test_zo_streamed.py, tests/mpi/zo_streamed.py).

Tied LM heads (``task.tied_head``): the loss reads stage 0's embedding matrix, so stage 0 keeps
its +eps state until L+ is read: the + branch runs through every stage first (pass 2 of stages
1.. right after it), then stage 0's pass 2, then the - branch through every stage (all at
-eps). Still two passes per stage; one live branch state instead of two. When stage 0 has no
trainable tensor (LoRA, ``head+last``) the embedding matrix is never perturbed and the two
branches run in lockstep as for an untied head.

Offload (``zo.offload = "host"``, :mod:`.offload`): the store uploads stage k before pass 1,
prefetches stage k+1, and writes stage k back after the - branch; the passes run on the
device copy.

Rows the batch does not read (token embeddings of an untied model): stage 0 reads the token
embedding matrix only at the batch's token ids (``task.stage_rows``, ``model.gather_rows``),
and a row it does not read changes neither loss. Its + eps z and - 2 eps z of step t are
therefore deferred to step t+1's first pass, which applies, to that row alone and in the same
memory pass, + eps z_t, - 2 eps z_t (each rounded to the storage type and read back, as the
separate passes would) and step t's update, all with one generation of z_t, then + eps z_{t+1}
if batch t+1 reads the row (``kernels.PRE`` / ``kernels.POST`` row classes; the flush does the
same without the last). Pass 2 touches only the rows the batch reads. Every row goes through
the roundings of the three-pass step in the same order, so the bits do not change; a row not
read costs one z and one memory pass per step instead of three z and two passes (MiniLM's
word embeddings are half its parameters and a 16 x 64 batch reads about 1 % of their rows).
``engine.owed`` holds the rows that still owe step t's pair. A tied head is read by the loss
too: the prompt task's loss reads only the label words' rows, which then count as read (the
tied path above defers the rest the same way); a next-token loss reads every row, so nothing
is deferred. Not deferred either: ``zo.restore = "copy"`` with several groups, arrays on a GPU.

z cache (``zo.cache_z``, on by default): pass 1 stores the z it generates for stage k (float32,
exact), and pass 2 reads it instead of generating it again, the same bits (:class:`ZCache`). The
buffer holds one stage: the largest transformer block, so the embedding matrix (larger than a
block) and, with a tied head, stage 0 (whose pass 2 comes after every other stage's pass 1)
regenerate z. Only for Gaussian and Gaussian-fast z, on the CPU: a Rademacher z costs less to
make than to read back, and the GPU kernels regenerate.
"""

from __future__ import annotations

import math
import time

import numpy as np

from ..backend import is_device_array
from . import kernels
from .engine import StepResult, ZOEngine
from .perturb import (
    SMALL,
    Pending,
    apply_rows,
    apply_then_perturb,
    perturb_cached,
    perturb_rows,
    tensor_index,
)

#: distributions whose z costs more to generate than to read back from memory
CACHED_DISTS = ("gaussian", "gaussian-fast")


class ZCache:
    """The float32 z of one stage, stored by pass 1 and read by pass 2 (see the module
    docstring). ``sizes``: trainable elements per stage; ``tied``: stage 0's pass 2 is late."""

    def __init__(self, sizes: list[int], tied: bool) -> None:
        blocks = [n for n in sizes[1:-1] if n]
        limit = max(blocks) if blocks else min((n for n in sizes if n), default=0)
        self.stages = {k for k, n in enumerate(sizes) if 0 < n <= limit and not (tied and k == 0)}
        self.elements = max((sizes[k] for k in self.stages), default=0)
        self._buf: np.ndarray | None = None

    def views(self, k: int, tens) -> list[np.ndarray] | None:
        """One float32 view per tensor of stage k (numpy only), or None: regenerate."""
        if k not in self.stages or any(is_device_array(z.array) for z in tens):
            return None
        if self._buf is None:
            self._buf = np.empty(self.elements, np.float32)
        out, o = [], 0
        for z in tens:
            n = int(z.array.size)
            out.append(self._buf[o:o + n])
            o += n
        return out


def stage_groups(engine, task) -> list[list[int]]:
    """Indices into ``engine.tensors`` of the trainable tensors of each task stage; every
    trainable tensor in exactly one stage (ValueError otherwise). Cached per task on the
    engine."""
    got = engine._groups
    if got is None or got[0] is not task:
        got = engine._groups = (task, _stage_groups(engine, task))
    return got[1]


def _stage_groups(engine, task) -> list[list[int]]:
    pos = {z.t: i for i, z in enumerate(engine.tensors)}
    groups, seen = [], set()
    for k in range(task.stage_count()):
        g = []
        for name in task.stage_params(k):
            i = pos.get(tensor_index(name))
            if i is not None:
                if i in seen:
                    raise ValueError(f"trainable tensor {name} is in two stages")
                seen.add(i)
                g.append(i)
        groups.append(g)
    if len(seen) != len(engine.tensors):
        raise ValueError(f"{len(engine.tensors) - len(seen)} trainable tensors belong to no "
                         f"stage of the task: the streamed schedule cannot perturb them")
    return groups


def lazy_rows(engine, task, batch) -> dict[int, np.ndarray]:
    """``{index into engine.tensors: bool per row, True where the batch reads the row}`` for
    the trainable matrices that stage 0 reads only by token id (``task.stage_rows``; see the
    module docstring, "Rows the batch does not read"). Empty when rows cannot be deferred:
    ``zo.restore = "copy"`` with several groups, device arrays, a task that names no rows
    (a tied head whose loss reads every row)."""
    get = getattr(task, "stage_rows", None)
    if not engine.defer_rows or engine.copy or get is None or getattr(
            engine.store, "gpu", False) or any(is_device_array(z.array) for z in engine.tensors):
        return {}
    pos = {z.t: i for i, z in enumerate(engine.tensors)}
    out = {}
    for name, rows in get(batch).items():
        i = pos.get(tensor_index(name))
        if i is None:
            continue                                   # not trained
        z = engine.tensors[i]
        a = z.array
        rows = np.asarray(rows)
        if is_device_array(a) or a.ndim != 2 or int(z.offset) != 0 or rows.ndim != 1 or (
                rows.size and (int(rows.min()) < 0 or int(rows.max()) >= a.shape[0])):
            continue                                   # every row in the passes, as before
        m = np.zeros(a.shape[0], bool)
        m[rows] = True
        out[i] = m
    return out


def _threads(engine, z) -> int | None:
    """Kernel threads for one tensor: one below ``SMALL`` elements (engine._split's rule)."""
    return 1 if z.array.size < SMALL else engine.threads


def _lazy_first(engine, i: int, z, active: np.ndarray, seed: int, zc) -> None:
    """Pass 1 over the rows of engine tensor ``i`` (``z``: its array here): the pending
    operation on every row, preceded by the previous step's + eps and - 2 eps on the rows
    that step deferred, then + eps z on the rows this batch reads; the others are deferred."""
    owed = engine.owed.pop(i, None)
    code = active.astype(np.uint8) * np.uint8(kernels.POST)
    if owed is not None:
        code |= owed.astype(np.uint8) * np.uint8(kernels.PRE)
    apply_rows(z, code, engine.pending or Pending(), seed, engine.eps, pre=engine.eps,
               dist=engine.dist, threads=_threads(engine, z), zcache=zc)
    if not active.all():
        engine.owed[i] = ~active


def first_pass(engine, idx: list[int], seed: int, dev=None, zc=None, rows=None) -> None:
    """Pass 1 over the tensors ``idx``: the pending operation, then + eps z(seed).
    ``dev``: (tensors, refs) on the device (offload), else the engine's own; ``zc``: one
    float32 array per tensor that receives z (:class:`ZCache`), or None; ``rows``: from
    :func:`lazy_rows` (tensors in it take the row-wise pass)."""
    tens, refs = dev if dev is not None else (
        [engine.tensors[i] for i in idx], [engine.ref[i] for i in idx] if engine.copy else None)
    if rows:
        keep = []
        for n, i in enumerate(idx):
            if i in rows:
                _lazy_first(engine, i, tens[n], rows[i], seed, zc[n] if zc is not None else None)
            else:
                keep.append(n)
        tens = [tens[n] for n in keep]
        refs = [refs[n] for n in keep] if refs is not None else None
        zc = [zc[n] for n in keep] if zc is not None else None
    zmap = {id(z): b for z, b in zip(tens, zc)} if zc is not None else None
    op = engine.pending
    if op is not None and engine.pending_copy:
        for grp, th in engine.split_pairs(refs, tens):
            apply_then_perturb([r for r, _ in grp], op, seed, engine.eps,
                               dst=[z for _, z in grp], dist=engine.dist, threads=th,
                               zcache=None if zmap is None else [zmap[id(z)] for _, z in grp])
    else:
        for grp, th in engine._split(tens):
            apply_then_perturb(grp, op or Pending(), seed, engine.eps, dist=engine.dist,
                               threads=th,
                               zcache=None if zmap is None else [zmap[id(z)] for z in grp])


def second_pass(engine, idx: list[int], seed: int, dev=None, zc=None, rows=None) -> None:
    """Pass 2: - 2 eps z(seed), z read from ``zc`` (pass 1's) when given; tensors in ``rows``
    only on the rows the batch reads."""
    tens = dev[0] if dev is not None else [engine.tensors[i] for i in idx]
    if rows:
        keep = []
        for n, i in enumerate(idx):
            if i in rows:
                z = tens[n]
                perturb_rows(z, rows[i], seed, -2.0 * engine.eps, dist=engine.dist,
                             threads=_threads(engine, z),
                             zcache=zc[n] if zc is not None else None)
            else:
                keep.append(n)
        tens = [tens[n] for n in keep]
        zc = [zc[n] for n in keep] if zc is not None else None
    zmap = {id(z): b for z, b in zip(tens, zc)} if zc is not None else None
    for grp, th in engine._split(tens):
        if zmap is not None:
            perturb_cached(grp, [zmap[id(z)] for z in grp], -2.0 * engine.eps, threads=th)
        else:
            apply_then_perturb(grp, Pending("perturb", seed, -2.0 * engine.eps), None,
                               dist=engine.dist, threads=th)


def zcache_for(engine, task, groups: list[list[int]], tied: bool) -> ZCache | None:
    """The engine's :class:`ZCache` for this task (made once per task), or None when z is
    not cached (``engine.cache_z`` off, or a distribution not in :data:`CACHED_DISTS`)."""
    if not engine.cache_z or engine.dist not in CACHED_DISTS:
        return None
    got = engine._zcache
    if got is None or got[0] is not task:
        sizes = [sum(int(engine.tensors[i].array.size) for i in g) for g in groups]
        engine._zcache = got = (task, ZCache(sizes, tied))
    return got[1]


def step_streamed(engine: ZOEngine, task, batch, step: int, lr: float,
                  n_local: float) -> StepResult:
    """One ZO step of ``engine`` with the block-streamed schedule: ``task`` gives the stages
    (``stage_count``, ``stage_params``, ``stage_begin``, ``stage_fork``, ``stage_run``,
    ``loss_from_state``, ``tied_head``; see :class:`semzo.tasks.base.Task`), ``batch`` its
    prepared batch. The update is left pending (:meth:`ZOEngine.flush`). Collective over the
    world; the same results as :meth:`ZOEngine.step` bit for bit once flushed."""
    seed = engine.seed_for(step)
    t0 = time.perf_counter()
    lp, lm = run_branches(engine, task, batch, seed)
    return engine.finish(step, seed, lp, lm, n_local, lr, t0, streamed=True)


def run_branches(engine, task, batch, seed: int) -> tuple[float, float]:
    """Passes 1 and 2 over every stage and both branches' forward passes; returns (L+, L-).
    The engine's pending operation is consumed (applied to every stage's tensors)."""
    groups = stage_groups(engine, task)
    store = engine.store
    n = len(groups)
    lp = lm = math.nan
    # a tied head matters only when stage 0 trains: a frozen embedding matrix never carries
    # a perturbation, so LoRA on a tied model runs both branches in lockstep
    tied = bool(task.tied_head) and bool(groups[0])
    cache = zcache_for(engine, task, groups, tied)
    sp = task.stage_begin(batch)
    sm = None if tied else task.stage_fork(sp)
    rows = lazy_rows(engine, task, batch)
    for i, owed in engine.owed.items():
        if i not in rows:                   # rows owed from the last step, none deferred now
            rows[i] = np.ones(owed.size, bool)
    for k in range(n):
        dev = store.acquire(k, groups[k])
        zc = None
        if cache is not None:
            zc = cache.views(k, dev[0] if dev is not None else
                             [engine.tensors[i] for i in groups[k]])
        first_pass(engine, groups[k], seed, dev, zc, rows)
        sp = task.stage_run(k, sp)
        if k == n - 1:
            lp = float(task.loss_from_state(sp, batch))
        if tied and k == 0:
            continue                      # stage 0 stays at +eps until L+ is read
        second_pass(engine, groups[k], seed, dev, zc, rows)
        if not tied:
            sm = task.stage_run(k, sm)
            if k == n - 1:
                lm = float(task.loss_from_state(sm, batch))
        store.release(k, groups[k])
    engine.pending, engine.pending_copy = None, False
    if tied:
        sp = None
        dev = store.acquire(0, groups[0])
        second_pass(engine, groups[0], seed, dev, None, rows)
        sm = task.stage_begin(batch)
        for k in range(n):
            if k:
                store.acquire(k, groups[k])
            sm = task.stage_run(k, sm)
            if k:
                store.release(k, groups[k], dirty=False)
        lm = float(task.loss_from_state(sm, batch))
        store.release(0, groups[0])
    store.finish()
    return lp, lm


def _staged(store, task, batch, read):
    """``read(state, batch)`` of the last stage's state, every stage streamed through
    ``store`` (an offloading store). Stage 0 and the last stage stay on the device until the
    result is read (a tied head reads stage 0's embedding matrix); nothing is written back."""
    n = task.stage_count()
    state = task.stage_begin(batch)
    try:
        for k in range(n):
            store.acquire(k, [])
            state = task.stage_run(k, state)
            if 0 < k < n - 1:
                store.release(k, [], dirty=False)
        return read(state, batch)
    finally:
        for k in (n - 1, 0):
            store.release(k, [], dirty=False)
        store.finish()


def staged_score(store, task, batch) -> tuple[float, float]:
    """(loss, accuracy) of ``batch`` at the current parameters, every stage streamed through
    ``store`` (:func:`_staged`: the evaluation of ``zo.offload = "host"``)."""
    return _staged(store, task, batch, task.score_from_state)


def staged_loss(store, task, batch) -> float:
    """The training loss of ``batch`` at the current parameters, every stage streamed
    through ``store`` (:func:`_staged`: the forward passes of the fzoo estimator under
    ``zo.offload = "host"``)."""
    return float(_staged(store, task, batch, task.loss_from_state))
