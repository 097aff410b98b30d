"""Decoder families: one module each, mapping a transformers config class and its weight names
onto a :class:`~semzo.model.spec.DecoderSpec`.

A family module defines ``ARCHITECTURES``, ``MODEL_TYPE``, ``PREFIXES`` (checkpoint name
prefixes tried in order), ``NAMES`` (:class:`~semzo.model.spec.Names`), the config keys it
``HONOURED`` (reads into the spec), declares ``INERT`` (no effect on the forward computation)
or ``REFUSED`` (key -> accepted values), and ``spec(fields) -> DecoderSpec``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from semzo.model.families import (
    gemma2,
    gemma3,
    gpt2,
    llama,
    mistral,
    opt,
    phi3,
    qwen2,
    qwen3,
    smollm3,
)
from semzo.model.kernels import ACTIVATIONS
from semzo.model.kernels_lm import GATED_ACTS as GATED
from semzo.model.spec import DecoderSpec, Fields
from semzo.runtime import SemzoError

FAMILIES = (llama, qwen2, mistral, opt, qwen3, gemma2, gemma3, phi3, smollm3, gpt2)
SUPPORTED_ARCHS = tuple(f.ARCHITECTURES[0] for f in FAMILIES)
#: activations of the gated MLP (``kernels_lm.gated_act``) and of ``fc2(act(fc1(x)))``
#: (``kernels.bias_act``)
GATED_ACTS = tuple(GATED)
PLAIN_ACTS = ACTIVATIONS


def find(raw: dict[str, Any]):
    """The family module of a parsed config.json (by ``architectures``, then ``model_type``),
    or None."""
    archs = raw.get("architectures") or []
    for fam in FAMILIES:
        if archs and archs[0] in fam.ARCHITECTURES:
            return fam
    for fam in FAMILIES:
        if raw.get("model_type") == fam.MODEL_TYPE:
            return fam
    return None


def read_spec(fam, raw: dict[str, Any], path: Path) -> DecoderSpec:
    """The spec of ``raw`` (config.json at ``path``) for family module ``fam``; SemzoError
    naming the key for anything refused."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else fam.ARCHITECTURES[0]
    f = Fields(raw, path, arch, fam.HONOURED, fam.INERT, fam.REFUSED)
    try:
        s = fam.spec(f)
    except (TypeError, ValueError) as exc:
        raise SemzoError(f"{path}: bad value in {arch} config: {exc}") from None
    f.finish()
    acts = GATED_ACTS if s.gated else PLAIN_ACTS
    if s.act not in acts:
        key = "hidden_act" if "hidden_act" in fam.HONOURED else "activation_function"
        f.refuse(key, f"supported: {', '.join(acts)}")
    for key, v in (("hidden_size", s.hidden_size), ("num_hidden_layers", s.num_layers),
                   ("num_attention_heads", s.num_heads), ("vocab_size", s.vocab_size),
                   ("num_key_value_heads", s.num_kv_heads), ("head_dim", s.head_dim)):
        if v <= 0:
            raise SemzoError(f"{path}: {key} must be positive, got {v}")
    if s.num_heads % s.num_kv_heads:
        raise SemzoError(f"{path}: num_attention_heads {s.num_heads} is not a multiple of "
                         f"num_key_value_heads {s.num_kv_heads}")
    if s.positions == "rotary" and (s.head_dim % 2 or s.rope.dim(s.head_dim) % 2):
        raise SemzoError(f"{path}: head_dim {s.head_dim} (rotated: {s.rope.dim(s.head_dim)}) "
                         f"must be even for rotary positions")
    if s.positions == "learned" and s.num_heads * s.head_dim != s.hidden_size:
        raise SemzoError(f"{path}: hidden_size {s.hidden_size} is not a multiple of "
                         f"{s.num_heads} heads")
    return s
