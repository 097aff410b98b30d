"""Trained label-word rows of a decoder's LM head (``train.label_rows = "exact"``, trained by
:mod:`semzo.finetune.label_rows`) as files hold them, and how a rebuilt model takes them:
model.h5 stores the delta (C, E) float32 and the word ids (C,) as the datasets
:data:`DELTA` and :data:`WORD_IDS`; a checkpoint's state as ``label_rows`` (4, C, E) float64
(delta, Adam's moments, step count) and ``label_row_ids``. Everything read is checked before
it indexes anything."""

from __future__ import annotations

import numpy as np

from ..runtime import SemzoError
from .storage import BF16, to_bits, to_float32

#: the datasets of model.h5 that hold the trained rows (not tensors of the model)
DELTA, WORD_IDS = "label_rows.delta", "label_rows.word_ids"


def take_from(params: dict, src: str):
    """Pop model.h5's ``label_rows.*`` datasets from ``params``: (word ids, delta) or None."""
    if DELTA not in params and WORD_IDS not in params:
        return None
    if DELTA not in params or WORD_IDS not in params:
        raise SemzoError(f"{src}: {DELTA} and {WORD_IDS} go together; one is missing")
    d, ids = np.asarray(params.pop(DELTA)), np.asarray(params.pop(WORD_IDS))
    if d.ndim != 2 or ids.ndim != 1 or ids.shape[0] != d.shape[0] or ids.dtype.kind not in "iu" \
            or d.dtype != np.float32 or not np.all(np.isfinite(d)):
        raise SemzoError(f"{src}: {DELTA} {d.dtype} {d.shape} and {WORD_IDS} {ids.dtype} "
                         f"{ids.shape} do not describe one float32 row per word")
    return ids.astype(np.int64), d


def from_state(state: dict, src: str):
    """A checkpoint's trained rows: (word ids, delta) or None (the state's ``label_rows``
    and ``label_row_ids``)."""
    a, ids = state.get("label_rows"), state.get("label_row_ids")
    if a is None or np.asarray(a).size == 0:
        return None
    a, ids = np.asarray(a), np.asarray(ids if ids is not None else [])
    if a.ndim != 3 or a.shape[0] != 4 or ids.ndim != 1 or ids.shape[0] != a.shape[1] or \
            ids.dtype.kind not in "iu" or not np.all(np.isfinite(a[0])):
        raise SemzoError(f"{src}: state/label_rows {a.shape} and state/label_row_ids "
                         f"{ids.shape} do not match")
    return ids.astype(np.int64), a[0].astype(np.float32)


def apply_to_model(model, ids: np.ndarray, delta: np.ndarray, src: str) -> None:
    """Add the trained ``delta`` (C, E) to rows ``ids`` of the decoder's LM head, in its
    storage (bfloat16 rounded once); a tied head is untied first (the embedding rows the
    inputs read keep their values). Checks the ids before they index anything."""
    if getattr(model, "kind", "") != "decoder" or not hasattr(model, "untie_head"):
        raise SemzoError(f"{src}: {DELTA}: trained label rows need a decoder's LM head")
    model.untie_head()
    w = model.params[model.head_weight_name()]
    vocab, hidden = int(w.shape[0]), int(w.shape[1])
    if delta.shape != (len(ids), hidden) or np.any(ids < 0) or np.any(ids >= vocab):
        raise SemzoError(f"{src}: {WORD_IDS}: ids must lie in [0, {vocab}) with one row of "
                         f"{hidden} values each, got {len(ids)} ids and rows {delta.shape}")
    xp = model.xp
    host = w.get() if hasattr(w, "get") else np.asarray(w)
    rows = to_float32(host[ids]).astype(np.float64) + delta.astype(np.float64)
    new = to_bits(rows.astype(np.float32)) if host.dtype == BF16 else rows.astype(host.dtype)
    w[xp.asarray(ids)] = xp.asarray(new)
