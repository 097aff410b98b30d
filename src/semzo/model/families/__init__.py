"""Model families: one module each, mapping a transformers config class and its weight names
onto a :class:`~semzo.model.spec.DecoderSpec` (every decoder: Llama ... OPT, GPT-2) or an
:class:`~semzo.model.spec.EncoderSpec` (BERT). This is semzo's one config reader:
:func:`find` picks the family of a config.json, :func:`read_spec` reads it.

A family module defines ``ARCHITECTURES``, ``MODEL_TYPE``, ``PREFIXES`` (checkpoint name
prefixes tried in order), the config keys it ``HONOURED`` (reads into the spec), declares
``INERT`` (no effect on the forward computation) or ``REFUSED`` (key -> accepted values), and
``spec(fields)``; a decoder family also ``NAMES`` (:class:`~semzo.model.spec.Names`), an
encoder family ``KIND = "encoder"``; ``CONFIG_CLASS`` when transformers' config class is not
named after the first architecture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from semzo.model.families import (
    bert,
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
from semzo.model.spec import DecoderSpec, EncoderSpec, Fields
from semzo.runtime import SemzoError

FAMILIES = (llama, qwen2, mistral, opt, qwen3, gemma2, gemma3, phi3, smollm3, gpt2, bert)
SUPPORTED_ARCHS = tuple(f.ARCHITECTURES[0] for f in FAMILIES)


def kind(fam) -> str:
    """"decoder" or "encoder": the model a family module builds."""
    return getattr(fam, "KIND", "decoder")

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


def read_spec(fam, raw: dict[str, Any], path: Path) -> DecoderSpec | EncoderSpec:
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
    if s.kind == "encoder":
        return _check_encoder(s, f)
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


def _check_encoder(s: EncoderSpec, f: Fields) -> EncoderSpec:
    if s.hidden_act not in PLAIN_ACTS:
        f.refuse("hidden_act", f"supported: {', '.join(PLAIN_ACTS)}")
    for key, v in (("hidden_size", s.hidden_size), ("num_hidden_layers", s.num_layers),
                   ("num_attention_heads", s.num_heads), ("vocab_size", s.vocab_size)):
        if v <= 0:
            raise SemzoError(f"{f.path}: {key} must be positive, got {v}")
    if s.hidden_size % s.num_heads:
        raise SemzoError(f"{f.path}: hidden_size {s.hidden_size} is not a multiple of "
                         f"{s.num_heads} heads")
    return s
