"""Model configurations parsed from a Hugging Face ``config.json``.

Two families are supported: BERT-style encoders (``model_type`` "bert") and GPT-2-style
decoders (``model_type`` "gpt2"). Anything else raises :class:`semzo.runtime.SemzoError` with a
one-line message naming the ``config.json`` and the architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from semzo.model.kernels import ACTIVATIONS
from semzo.runtime import SemzoError

SUPPORTED = {"bert": "encoder (BertModel)", "gpt2": "decoder (GPT2Model / GPT2LMHeadModel)"}


@dataclass(frozen=True)
class EncoderConfig:
    """A BERT-family encoder (post-LayerNorm blocks, learned absolute positions)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    pad_token_id: int
    model_type: str = "bert"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class DecoderConfig:
    """A GPT-2-family decoder (pre-LayerNorm blocks, causal attention, tied LM head)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    layer_norm_eps: float
    hidden_act: str
    tie_word_embeddings: bool
    model_type: str = "gpt2"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


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


def read_config(folder: str | Path) -> EncoderConfig | DecoderConfig:
    """Parse ``folder/config.json`` into an :class:`EncoderConfig` or :class:`DecoderConfig`
    (BERT and GPT-2; the decoder families of :mod:`semzo.model.families` have their own)."""
    path = Path(folder) / "config.json"
    raw = read_raw(folder)
    mt = raw.get("model_type")
    if mt not in SUPPORTED:
        from semzo.model.families import SUPPORTED_ARCHS
        sup = ", ".join([f"{k} ({v})" for k, v in SUPPORTED.items()] + list(SUPPORTED_ARCHS))
        raise SemzoError(f"{path}: unsupported architecture {_arch(raw)}; supported: {sup}")
    try:
        cfg = _build(mt, raw, path)
    except KeyError as exc:
        raise SemzoError(f"{path}: missing key {exc.args[0]!r} for {_arch(raw)}") from None
    if cfg.hidden_act not in ACTIVATIONS:
        raise SemzoError(f"{path}: unsupported activation {cfg.hidden_act!r} in {_arch(raw)}; "
                         f"supported: {', '.join(ACTIVATIONS)}")
    if cfg.hidden_size % cfg.num_heads:
        raise SemzoError(f"{path}: hidden size {cfg.hidden_size} is not a multiple of "
                         f"{cfg.num_heads} heads")
    return cfg


def _build(mt: str, raw: dict[str, Any], path: Path) -> EncoderConfig | DecoderConfig:
    if mt == "bert":
        pe = raw.get("position_embedding_type", "absolute")
        if pe != "absolute":
            raise SemzoError(f"{path}: unsupported position_embedding_type {pe!r} "
                             f"in {_arch(raw)}")
        return EncoderConfig(
            vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            num_layers=int(raw["num_hidden_layers"]), num_heads=int(raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            max_positions=int(raw["max_position_embeddings"]),
            type_vocab_size=int(raw.get("type_vocab_size", 2)),
            layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
            hidden_act=str(raw.get("hidden_act", "gelu")),
            pad_token_id=int(raw.get("pad_token_id") or 0), raw=raw)
    h = int(raw["n_embd"])
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if raw.get(flag):
            raise SemzoError(f"{path}: unsupported option {flag}=true in {_arch(raw)}")
    return DecoderConfig(
        vocab_size=int(raw["vocab_size"]), hidden_size=h, num_layers=int(raw["n_layer"]),
        num_heads=int(raw["n_head"]), intermediate_size=int(raw.get("n_inner") or 4 * h),
        max_positions=int(raw["n_positions"]),
        layer_norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
        hidden_act=str(raw.get("activation_function", "gelu_new")),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), raw=raw)
