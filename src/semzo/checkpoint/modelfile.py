"""``model.h5``, the finetune stage's final model, read by the checkpoint tools.

A run ends with ``model.h5`` (one dataset per saved tensor under its Hugging Face name; the
trained tensors, or every tensor with ``train.save = "all"``; attributes in
:func:`semzo.finetune.stage.save_model`), not a checkpoint: it carries no block checksums and
no optimizer state. `semzo generate`, `export` and `inspect` accept it wherever they accept a
checkpoint: :func:`read` turns it into a :class:`~semzo.checkpoint.reader.Loaded` whose
``attrs`` carry the same ``semzo_deck`` and ``model_meta`` a checkpoint stores.
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
from mpi4py import MPI

from .format import CheckpointError
from .reader import Loaded

#: root attributes every model.h5 has (and a checkpoint has not)
_MARKERS = ("trainable", "weight_storage", "semzo_deck")


def _text(v) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def is_model_file(path: str | Path) -> bool:
    """Whether ``path`` is a model.h5 (an HDF5 file with the model file's root attributes and
    no checkpoint format). Reads the root attributes only; False for anything unreadable."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with h5py.File(p, "r", driver=None) as f:
            a = f.attrs
            return all(k in a for k in _MARKERS) and "format" not in a
    except (OSError, ValueError, KeyError):
        return False


def read(path: str | Path, comm: MPI.Intracomm) -> Loaded:
    """The model file as a :class:`Loaded` (``step``: the steps trained; ``params``: its
    tensors). Every rank reads the file itself (read only). CheckpointError on every rank when
    a tensor cannot be read."""
    path = Path(path)
    err, params, attrs = None, {}, {}
    try:
        with h5py.File(path, "r", driver=None) as f:
            attrs = {k: (_text(v) if isinstance(v, (bytes, str)) else v)
                     for k, v in f.attrs.items()}
            for name, d in f.items():
                if isinstance(d, h5py.Dataset):
                    params[name] = np.ascontiguousarray(d[()])
    except (OSError, ValueError, KeyError) as exc:
        err = f"{path}: cannot read the model file ({exc})"
    errors = comm.allgather(err)
    first = next((e for e in errors if e), None)
    if first:
        raise CheckpointError(first)
    meta = json.loads(attrs.get("model_meta") or "{}")
    if not meta:                      # written before model.h5 stored model_meta
        names = [_text(x) for x in np.atleast_1d(attrs.get("label_names", []))]
        meta = {"task": attrs.get("task"), "trainable": json.loads(attrs.get("trainable", "[]"))}
        if "classifier.weight" in params:
            meta["head"] = {"n_classes": int(params["classifier.weight"].shape[0]),
                            "normalize": bool(attrs.get("head_normalize", False)),
                            "label_names": names}
    attrs["model_meta"] = json.dumps(meta, sort_keys=True)
    return Loaded(path=path, step=int(attrs.get("steps", 0)), params=params, state={},
                  per_rank={}, per_rank_tables={}, extras={}, metrics={}, attrs=attrs,
                  world_size_saved=int(attrs.get("world_size", 0)))


def summary(path: str | Path, comm: MPI.Intracomm, *, deck: bool = True) -> str:
    """What `semzo inspect` prints for a model file."""
    m = read(path, comm)
    a = m.attrs
    n = sum(int(np.prod(p.shape)) for p in m.params.values())
    lines = [(f"model file {m.path} (the run's final model, not a checkpoint: no checksums, "
             f"no optimizer state)"),
             (f"  task {a.get('task')}, {m.step} steps ({a.get('skips', 0)} skipped), written "
             f"by semzo {a.get('semzo_version')} on {a.get('world_size')} ranks, weights "
             f"{a.get('weight_storage')}"),
             (f"  held-out loss {a.get('heldout_loss_before', float('nan')):.4g} -> "
             f"{a.get('heldout_loss_after', float('nan')):.4g}, accuracy "
             f"{a.get('heldout_acc_before', float('nan')):.4g} -> "
             f"{a.get('heldout_acc_after', float('nan')):.4g}"),
             (f"  parameters: {len(m.params)} tensors, {n:,} values; base model "
             f"{a.get('model_source') or '(packaged MiniLM)'}")]
    big = sorted(m.params.items(), key=lambda kv: -kv[1].size)[:5]
    for name, arr in big:
        lines.append(f"    {name:<56} {tuple(arr.shape)!s:<14} {arr.dtype}")
    if len(m.params) > len(big):
        lines.append(f"    ... and {len(m.params) - len(big)} more tensors")
    if deck and a.get("semzo_deck"):
        lines.append("  deck:")
        lines.extend("    " + ln for ln in str(a["semzo_deck"]).rstrip().splitlines())
    return "\n".join(lines)
