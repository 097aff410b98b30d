"""The frozen-prefix cache for decoder tasks whose sequences are fixed (``sft``, ``choice``,
``lm``): when nothing below block ``layer`` trains (LoRA or ``head+last`` in the top blocks),
the residual stream entering block ``layer`` is computed once per sequence and kept, so each
loss runs only blocks ``layer .. L-1``, the final norm and the head (the
:class:`~.prompt.PromptTask` scheme).

:class:`PrefixCached` is a mixin for a :class:`~.base.Task` whose batches carry their row
indices last (``batch[-1]``: indices into ``task.cache_seqs`` when the task has them, the
choice task's (record, choice) rows, else into ``task.seqs``); :func:`cache_layer` decides
the layer on every rank alike.
"""

from __future__ import annotations

from .prefix_store import PrefixStore, fill_prefix_cache
from .prompt import PromptTask


class PrefixCached:
    """Stage protocol and forward pass over cached prefix states (``layer > 0``), or the whole
    model (``layer == 0``, no cache)."""

    layer = 0
    cache = None
    cache_use = (0, 0, 0.0)               # sequences reused, computed; seconds

    def _init_cache(self, layer: int, bs: int, store: PrefixStore | None = None,
                    store_key: tuple = ()) -> None:
        self.layer = int(layer)
        if self.layer > 0:
            self.cache_use = fill_prefix_cache(self, bs, store, (*store_key, self.layer))

    def _run(self, st, lo: int, hi: int):
        for k in range(lo, hi):
            st = self.model.stage_forward(k, st)
        return st

    # the batch's cached states, padded into the stage state entering block layer + 1
    _cached_state = PromptTask._cached_state

    def _first(self) -> int:
        return self.layer + 1 if self.cache is not None else 0

    def _full(self, batch):
        """The state after the last stage (from the cache when there is one)."""
        st = self.stage_begin(batch)
        return self._run(st, self._first(), self.model.n_stages)

    @property
    def tied_head(self) -> bool:
        return bool(getattr(self.model, "tied_head", False)) and self.cache is None

    def stage_count(self) -> int:
        return self.model.n_stages - self._first()

    def stage_params(self, k: int) -> list[str]:
        return self.model.stage_names(self._first() + k)

    def stage_rows(self, batch) -> dict:
        if self.cache is not None:
            return {}                 # stage 0 starts from cached states: no rows gathered
        return super().stage_rows(batch)

    def stage_begin(self, batch):
        ids, mask, n, rows = batch[0], batch[1], batch[3], batch[-1]
        if n == 0:
            return None
        if self.cache is None:
            return self.model.stage_start(ids, mask)
        return self._cached_state(rows, ids, mask)

    def stage_run(self, k: int, state):
        return None if state is None else self.model.stage_forward(self._first() + k, state)
