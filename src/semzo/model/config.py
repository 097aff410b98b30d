"""Model configurations parsed from a Hugging Face ``config.json``: one reader for every model.

:func:`read_config` finds the family of a folder's config.json (:mod:`semzo.model.families`,
by ``architectures`` then ``model_type``) and reads it key by key into a
:class:`~semzo.model.spec.DecoderSpec` (every decoder family, GPT-2 included) or an
:class:`~semzo.model.spec.EncoderSpec` (BERT). Anything else raises
:class:`semzo.runtime.SemzoError` with a one-line message naming the ``config.json`` and the
architecture.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from semzo.model import families
from semzo.model.spec import DecoderSpec, EncoderSpec
from semzo.runtime import SemzoError

#: model_type -> what semzo builds from it, for every family
MODEL_TYPES = {f.MODEL_TYPE: f"{families.kind(f)} ({' / '.join(f.ARCHITECTURES)})"
               for f in families.FAMILIES}
#: the two model types semzo started with (BERT, GPT-2): tests/test_gpu_model.py builds a tiny
#: model of each by hand (its other families need configs with ids inside a tiny vocabulary)
SUPPORTED = {k: MODEL_TYPES[k] for k in ("bert", "gpt2")}


def _arch(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    mt = raw.get("model_type", "?")
    return f"{archs[0]} (model_type {mt!r})" if archs else f"model_type {mt!r}"


def read_raw(folder: str | Path) -> dict[str, Any]:
    """``folder/config.json`` as a dict (SemzoError naming the file if it is not one)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SemzoError(f"{path}: not found (not a Hugging Face model folder)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise SemzoError(f"{path}: cannot read: {exc}") from None
    if not isinstance(raw, dict):
        raise SemzoError(f"{path}: not a JSON object")
    return raw


def find_family(raw: dict[str, Any], path: Path):
    """The family module of ``raw`` (config.json at ``path``); SemzoError listing the
    supported architectures when there is none."""
    fam = families.find(raw)
    if fam is None:
        sup = ", ".join(f"{k} ({v})" for k, v in MODEL_TYPES.items())
        raise SemzoError(f"{path}: unsupported architecture {_arch(raw)}; supported: {sup}")
    return fam


def read_config(folder: str | Path) -> DecoderSpec | EncoderSpec:
    """Parse ``folder/config.json`` into the spec of its family (``spec.kind``: "decoder" or
    "encoder")."""
    path = Path(folder) / "config.json"
    raw = read_raw(folder)
    return families.read_spec(find_family(raw, path), raw, path)
