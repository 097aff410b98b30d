"""Frozen-prefix states kept across the runs of one process (`semzo experiment`).

The frozen-prefix cache of the prompt, sft, choice and lm tasks
(:class:`~.prompt.PromptTask`, :class:`~.prefix.PrefixCached`) holds, for every sequence of a rank, the residual stream that
enters the first trained block. It depends only on the model's frozen weights, that block and
the sequence's token ids: not on the sharding, the ZO mode, the seed or the learning rate. An
experiment runs dozens of configurations of one model in one MPI job, so a
:class:`PrefixStore` on the run context keeps every state computed once and hands it to the
next configuration whose rank holds the same sequence (the same rows under another mode or
seed; under another sharding, the rows it held before).

:func:`fill_prefix_cache` fills a task's cache from the store and computes only the missing
sequences; with a communicator on the store it then hands the new states to every rank
(collective: every rank builds its task, so every rank calls it). The states are the same computation as without a store
(the same blocks on the same tokens); a sequence computed in another batch can differ from
a recomputation by float rounding only (other padding, other matrix shapes).
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
from mpi4py import MPI

from ..runtime import get_logger
from .base import pad_batch

log = get_logger(__name__)


class PrefixStore:
    """States by (model key, sequence digest); ``model_key`` names the model, its weight
    storage, the backend and the cached block, so one store can serve several tasks.

    ``comm``: when given, every fill that computed states hands them to every rank
    (one allgather), as long as each rank's store then stays within ``cap_bytes``: the first
    configuration of an experiment computes each sequence once on the rank that holds it,
    and a later sharding, which puts the sequences on other ranks, computes none."""

    def __init__(self, comm=None, cap_bytes: int = 0) -> None:
        self._states: dict[tuple, dict[bytes, object]] = {}
        self.comm, self.cap_bytes = comm, int(cap_bytes)
        self.hits = 0
        self.computed = 0
        self.seconds = 0.0
        self.nbytes = 0

    @staticmethod
    def digest(seq: np.ndarray) -> bytes:
        a = np.ascontiguousarray(seq, np.int64)
        return hashlib.blake2b(a.tobytes(), digest_size=16).digest()

    def table(self, model_key: tuple) -> dict[bytes, object]:
        return self._states.setdefault(model_key, {})

    def __len__(self) -> int:
        return sum(len(t) for t in self._states.values())


def _share(store: PrefixStore, table: dict, new: dict, xp) -> None:
    """Give every rank the states the others just computed, if every rank's store then fits
    ``store.cap_bytes``. Collective over ``store.comm`` (every rank of a fill calls it)."""
    comm = store.comm
    added = comm.allreduce(sum(int(v.nbytes) for v in new.values()), op=MPI.SUM)
    fits = comm.allreduce(int(store.nbytes + added <= store.cap_bytes), op=MPI.MIN)
    if not added or not fits:
        return
    host = {k: (v.get() if hasattr(v, "get") else v) for k, v in new.items()}
    for r, got in enumerate(comm.allgather(host)):
        if r == comm.Get_rank():
            continue
        for k, v in got.items():
            if k not in table:
                table[k] = xp.asarray(v)
                store.nbytes += int(v.nbytes)


def store_args(ctx) -> dict:
    """The store of the run context (``ctx.prefix_store``: set by `semzo experiment`, None
    for a single run) and the key of its model: folder, weight storage, backend."""
    store = getattr(ctx, "prefix_store", None)
    m = ctx.deck.model
    return {"store": store, "store_key": (m.path, m.dtype, ctx.xp.__name__)}


def fill_prefix_cache(task, bs: int, store: PrefixStore | None, model_key: tuple) -> tuple:
    """Build ``task.cache`` (rows of all sequences, ``task.offs`` their offsets): the states
    entering block ``task.layer`` (stages ``0 .. layer`` of the model), from ``store`` where it
    has them, computed in batches of ``bs`` sequences (longest first) otherwise and then kept
    in the store. The sequences: ``task.cache_seqs`` when the task has them (the choice task's
    (record, choice) rows), else ``task.seqs``. Returns ``(reused, computed, seconds)`` for
    this task. One rank without a store or with ``store.comm`` None; collective over
    ``store.comm`` otherwise."""
    t0 = time.perf_counter()
    xp, model = task.model.xp, task.model
    seqs = getattr(task, "cache_seqs", None)
    seqs = task.seqs if seqs is None else seqs
    lens = np.array([len(q) for q in seqs], np.int64)
    task.offs = np.concatenate(([0], np.cumsum(lens)))
    task.cache = xp.empty((int(task.offs[-1]), model.config.hidden_size), model.dtype)
    table = store.table(model_key) if store is not None else None
    keys = [PrefixStore.digest(q) for q in seqs] if table is not None else None
    reused = 0
    todo = []
    for r in np.argsort(-lens, kind="stable"):
        if not lens[r]:
            continue
        got = table.get(keys[r]) if table is not None else None
        if got is not None:
            task.cache[task.offs[r]:task.offs[r + 1]] = got
            reused += 1
        else:
            todo.append(r)
    for i in range(0, len(todo), bs):
        rows = todo[i:i + bs]
        ids, mask = pad_batch([seqs[r] for r in rows], task.pad_id)
        x = task._run(model.stage_start(ids, mask), 0, task.layer + 1).hidden
        for j, r in enumerate(rows):
            task.cache[task.offs[r]:task.offs[r + 1]] = x[j, :lens[r]]
            if table is not None:
                table[keys[r]] = task.cache[task.offs[r]:task.offs[r + 1]].copy()
    if table is not None:
        store.nbytes += sum(int(table[keys[r]].nbytes) for r in todo)
        if store.comm is not None:
            _share(store, table, {keys[r]: table[keys[r]] for r in todo}, xp)
    dt = time.perf_counter() - t0
    if store is not None:
        store.hits += reused
        store.computed += len(todo)
        store.seconds += dt
    log.info("finetune: frozen-prefix cache: %d sequences computed in %.1f s%s", len(todo), dt,
             f", {reused} reused from earlier runs of this job" if store is not None else "")
    return reused, len(todo), dt
