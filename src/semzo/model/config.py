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

from semzo.model.families import SUPPORTED_ARCHS
from semzo.model.kernels import ACTIVATIONS
from semzo.model.spec import Fields
from semzo.runtime import SemzoError

SUPPORTED = {"bert": "encoder (BertModel)"}


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


def read_config(folder: str | Path) -> EncoderConfig:
    """Parse ``folder/config.json`` into an :class:`EncoderConfig` or :class:`DecoderConfig`
    (BERT and GPT-2; the decoder families of :mod:`semzo.model.families` have their own)."""
    path = Path(folder) / "config.json"
    raw = read_raw(folder)
    mt = raw.get("model_type")
    if mt not in SUPPORTED:
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


#: BertConfig keys read into :class:`EncoderConfig` (with the common keys of
#: :data:`semzo.model.spec.COMMON_INERT` and the refusals below, every key of the class)
BERT_HONOURED = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "pad_token_id", "position_embedding_type"})
#: an encoder has no LM head to tie
BERT_INERT = frozenset({"tie_word_embeddings"})
#: is_decoder makes BERT's self-attention causal: not implemented
BERT_REFUSED = {"is_decoder": (False,)}


def _build(mt: str, raw: dict[str, Any], path: Path) -> EncoderConfig:
    if mt == "bert":
        f = Fields(raw, path, _arch(raw), BERT_HONOURED, BERT_INERT, BERT_REFUSED)
        if f("position_embedding_type", "absolute") != "absolute":
            f.refuse("position_embedding_type", "semzo implements absolute positions")
        cfg = EncoderConfig(
            vocab_size=int(f("vocab_size", req=True)), hidden_size=int(f("hidden_size", req=True)),
            num_layers=int(f("num_hidden_layers", req=True)),
            num_heads=int(f("num_attention_heads", req=True)),
            intermediate_size=int(f("intermediate_size", req=True)),
            max_positions=int(f("max_position_embeddings", req=True)),
            type_vocab_size=int(f("type_vocab_size", 2)),
            layer_norm_eps=float(f("layer_norm_eps", 1e-12)),
            hidden_act=str(f("hidden_act", "gelu")),
            pad_token_id=int(f("pad_token_id", 0)), raw=raw)
        f.finish()
        return cfg
