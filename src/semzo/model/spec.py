"""What a model computes, as data: :class:`DecoderSpec` (one per decoder) or
:class:`EncoderSpec` (BERT), filled in by a family file (``semzo.model.families.*``) from
``config.json`` through the same reader (:class:`Fields`).

The spec-driven decoder (:mod:`semzo.model.causal`) reads only the spec, so a family differs
from another by the values below and by its weight names (:class:`Names`), nothing else:

- ``norm``: "rmsnorm" (x / rms(x) * g) or "layernorm" (with or without affine parameters);
- ``pre_norm``: pre-LN (x + f(norm(x))) or post-LN (norm(x + f(x)), OPT-350m);
- ``positions``: "rotary" (``rope``: theta and scaling) or "learned" (a table indexed by
  position + ``pos_offset``; ``pos_from_mask``: positions from the cumulative sum of the
  attention mask, as OPT computes them);
- ``act`` and ``gated``: MLP ``down(act(gate(x)) * up(x))`` (SwiGLU when act is "silu") or
  ``fc2(act(fc1(x)))``;
- ``num_heads`` / ``num_kv_heads`` (grouped-query attention), ``head_dim``;
- biases: ``qkv_bias``, ``o_bias``, ``mlp_bias``;
- ``sliding_window`` per layer (None: full causal attention);
- ``tied``: the LM head reads the token embedding matrix;
- ``proj_dim``: width of the token embeddings when it differs from ``hidden_size`` (OPT's
  ``project_in`` / ``project_out``);
- later families (:mod:`semzo.model.variants` runs them): ``norm_plus_one`` (Gemma's
  x / rms(x) * (1 + g)), ``qk_norm`` (per-head RMSNorm of q and k before rotary: Qwen3,
  Gemma 3), ``sandwich`` (Gemma 2/3: norms on the attention and MLP outputs too),
  ``embed_scale``, ``attn_scale`` (scores times it; 0: 1/sqrt(head_dim)), ``attn_softcap`` and
  ``final_softcap`` (c * tanh(x / c) on the scores / logits), ``rope_local`` (the rotary of
  sliding-window layers, Gemma 3), ``RopeSpec.partial`` (Phi-3: rotate the first
  ``head_dim * partial`` dims), ``no_rope`` (layers without rotary, SmolLM3);
- GPT-2: ``scale_by_layer`` (the scores of block i divided by i + 1 too), ``layout`` "in_out"
  (projection weights stored (in, out), Conv1D, as the checkpoint has them; default "out_in",
  torch.nn.Linear), ``lora_roles`` (the projection roles LoRA may target; empty: all).

:class:`Fields` reads ``config.json`` for a family: every key the family's transformers config
class has is honoured (read into the spec), declared inert (it does not change the forward
computation) or refused by name; a refusal raises :class:`SemzoError` in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from semzo.runtime import SemzoError, get_logger

log = get_logger(__name__)

#: keys of transformers' PretrainedConfig (every family has them) that do not change the
#: forward computation of a causal LM in eval mode, or that semzo handles elsewhere
COMMON_INERT = frozenset({
    "return_dict", "output_hidden_states", "output_attentions", "torchscript", "torch_dtype",
    "dtype", "use_bfloat16", "tf_legacy_loss", "architectures", "finetuning_task", "id2label",
    "label2id", "num_labels", "tokenizer_class", "prefix", "bos_token_id", "pad_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params",
    "problem_type", "_name_or_path", "transformers_version", "model_type", "is_encoder_decoder",
    "tie_encoder_decoder", "chunk_size_feed_forward", "cross_attention_hidden_size",
    "_attn_implementation_autoset", "_attn_implementation", "use_cache", "initializer_range",
    "init_std", "max_length", "min_length", "do_sample", "early_stopping", "num_beams",
    "num_beam_groups", "diversity_penalty", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "length_penalty", "no_repeat_ngram_size",
    "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens",
    "begin_suppress_tokens", "_commit_hash", "quantization_config", "keys_to_ignore_at_inference",
    "output_router_logits", "attention_dropout", "dropout", "hidden_dropout",
    "attention_probs_dropout_prob", "hidden_dropout_prob", "classifier_dropout",
    "embd_pdrop", "resid_pdrop", "attn_pdrop", "layerdrop", "embedding_dropout",
    "is_decoder", "add_cross_attention",
})
#: keys of PretrainedConfig refused unless they have their default (they change the model)
COMMON_REFUSED = {"pruned_heads": ({}, None)}


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embeddings (non-interleaved halves, as transformers' ``rotate_half``)."""

    theta: float
    kind: str = "default"            # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192
    partial: float = 1.0             # rotated share of head_dim (Phi-3 partial_rotary_factor)

    def dim(self, head_dim: int) -> int:
        """Rotated dims of a head (the first ones; the rest pass through)."""
        return int(head_dim * self.partial)

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """(dim // 2,) float32, computed in float32 as transformers does."""
        head_dim = self.dim(head_dim)
        exps = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
        inv = (np.float32(1.0) / (np.float32(self.theta) ** exps)).astype(np.float32)
        if self.kind == "linear":
            inv = (inv / np.float32(self.factor)).astype(np.float32)
        elif self.kind == "llama3":
            f, lo, hi = (np.float32(v) for v in (self.factor, self.low_freq_factor,
                                                  self.high_freq_factor))
            old = np.float32(self.original_max_positions)
            wavelen = np.float32(2 * math.pi) / inv
            scaled = np.where(wavelen > old / lo, inv / f, inv).astype(np.float32)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / f + smooth * scaled
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            inv = np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    def tables(self, head_dim: int, n_pos: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin (n_pos, dim // 2) float32 of positions 0..n_pos-1."""
        ang = np.arange(n_pos, dtype=np.float32)[:, None] * self.inv_freq(head_dim)[None, :]
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


# ---- llama3 rope scaling as llama.cpp stores it ---------------------------------------------
#: (original context, low, high) tried first when reading llama.cpp's factors back: Meta's
#: values for every Llama 3.1 / 3.2 / 3.3 model
LLAMA3_DEFAULTS = (8192, 1.0, 4.0)
#: relative agreement asked of factors recomputed from the recovered parameters
LLAMA3_FACTOR_RTOL = 2e-6


def llama3_rope_factors(theta: float, dim: int, factor: float, low: float, high: float,
                        old: int) -> np.ndarray:
    """llama.cpp's ``rope_freqs.weight`` for llama3 rope scaling: float32 (dim // 2,), the
    divisor of each rotary frequency (``convert_hf_to_gguf.py``, ``LlamaModel``): 1 where the
    wavelength is below ``old / high``, ``factor`` above ``old / low``, and
    ``1 / ((1 - s) / factor + s)`` between, ``s = (old / wavelength - low) / (high - low)``;
    computed in float32 as that script does."""
    freqs = RopeSpec(theta).inv_freq(dim)
    f32 = np.float32
    wavelen = f32(2 * math.pi) / freqs
    smooth = (f32(old) / wavelen - f32(low)) / f32(high - low)
    mid = (f32(1) / ((f32(1) - smooth) / f32(factor) + smooth)).astype(f32)
    out = np.where(wavelen < old / high, f32(1), np.where(wavelen > old / low, f32(factor), mid))
    return out.astype(f32)


def llama3_from_factors(factors: np.ndarray, theta: float, dim: int) -> dict | None:
    """The llama3 ``rope_scaling`` whose frequencies are ``theta``'s divided by ``factors``
    (a GGUF file's ``rope_freqs.weight``, :func:`llama3_rope_factors`) to
    :data:`LLAMA3_FACTOR_RTOL`; None when every factor is 1 (no scaling). ValueError saying
    why when the factors are not of that form.

    The file keeps the factors, not the four parameters. ``factor`` is the largest; each
    factor between 1 and it gives a point of the line ``s = old / (high - low) / wavelength -
    low / (high - low)``, and the groups at 1 and at ``factor`` bound where the line crosses
    0 and 1; (old, low, high) are known only up to a common scale. Candidates: Meta's
    (8192, 1, 4); with two points or more, the fitted line with an ``old`` for which low
    and high come out round (to 1/64; the one giving low 1, or a power of two; low nearest 1
    first), else ``old`` 8192; with one point, low 1
    and high 4 through it when that gives an integer ``old``, else ``old`` 8192 and a ratio
    high / low of 4, 3, 2, ...; with none, boundaries midway between the groups. Each is
    checked by both formulas (llama.cpp's factors, :meth:`RopeSpec.inv_freq`'s transformers
    frequencies); the first within four float32 ulps is taken, else the closest within the
    tolerance."""
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape[0] != dim // 2:
        raise ValueError(f"{f.shape[0]} values for {dim // 2} rotary frequencies")
    if not np.isfinite(f).all() or f.min() < 1.0:
        raise ValueError("values must be finite and at least 1 (llama3 divides the "
                         "frequencies)")
    if (f == 1.0).all():
        return None
    if (np.diff(f) < 0).any():
        raise ValueError("values decrease along the frequencies (llama3's rise from 1 to the "
                         "factor as the wavelength grows)")
    factor = float(np.float32(f.max()))
    base = RopeSpec(theta).inv_freq(dim).astype(np.float64)
    x = base / float(np.float32(2 * math.pi))                          # 1 / wavelength
    mid = (f > 1.0) & (f < factor)
    s = (1.0 / f[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)           # 0 < s < 1
    cands: list[tuple[float, float, float]] = [LLAMA3_DEFAULTS]
    if mid.sum() >= 2:
        a, b = np.polyfit(x[mid], s, 1)                                 # s = a x + b
        if a > 0 and b < 0:
            nice = []
            for old in [round(-a / b)] + [2 ** k for k in range(5, 21)]:
                low, high = -b * old / a, (1.0 - b) * old / a
                rl, rh = round(low * 64) / 64, round(high * 64) / 64
                if 0 < rl < rh and abs(rl - low) <= 1e-5 * low and abs(rh - high) <= 1e-5 * high:
                    nice.append((old, rl, rh))
            cands += sorted(nice, key=lambda c: abs(math.log(c[1])))    # low nearest 1 first
            cands.append((8192, -b * 8192 / a, (1.0 - b) * 8192 / a))
    elif mid.sum() == 1:
        old = (3.0 * s[0] + 1.0) / x[mid][0]
        if abs(old - round(old)) <= 1e-4 * old:
            cands.append((round(old), 1.0, 4.0))
        for ratio in (4.0, 3.0, 2.0, 1.5, 1.25, 1.1, 6.0, 8.0, 16.0):
            low = 8192 * x[mid][0] / (1.0 + (ratio - 1.0) * s[0])
            cands.append((8192, low, ratio * low))
    else:
        w = 1.0 / x
        hi_w = w[f == 1.0].max() if (f == 1.0).any() else w.min() / 2
        lo_w = w[f == factor].min()
        r = (lo_w / hi_w) ** (1 / 3)
        cands.append((8192, 8192 / lo_w * r, 8192 / hi_w / r))
    best, err_best = None, math.inf
    for old, low, high in cands:
        if not 0 < low < high:
            continue
        got = llama3_rope_factors(theta, dim, factor, low, high, old).astype(np.float64)
        hf = RopeSpec(theta, "llama3", factor, low, high, old).inv_freq(dim).astype(np.float64)
        err = max(float(np.max(np.abs(got - f) / f)), float(np.max(np.abs(hf * f / base - 1))))
        if err < err_best:
            best, err_best = (old, low, high), err
        if err <= 4.8e-7:
            break
    if best is None or err_best > LLAMA3_FACTOR_RTOL:
        raise ValueError("not the factors of llama3 rope scaling for any (factor, low, high, "
                         "original context)")
    old, low, high = best
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low),
            "high_freq_factor": float(high), "original_max_position_embeddings": int(old)}


@dataclass(frozen=True)
class Names:
    """Weight names relative to the checkpoint prefix; ``{i}`` is the layer index. A role the
    family lacks is None. Order of ``layer`` = module order of the family's decoder layer."""

    embed: str
    layer_prefix: str                      # e.g. "layers.{i}."
    layer: tuple[tuple[str, str], ...]     # (role, module name) of one layer, module order
    final_norm: str | None
    pos: str | None = None
    project_in: str | None = None
    project_out: str | None = None
    lm_head: str = "lm_head.weight"        # never prefixed


@dataclass(frozen=True)
class DecoderSpec:
    """One decoder model, block by block (see the module docstring)."""

    kind: ClassVar[str] = "decoder"
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    norm: str
    norm_eps: float
    norm_affine: bool
    norm_bias: bool
    pre_norm: bool
    final_norm: bool
    positions: str
    act: str
    gated: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tied: bool
    names: Names
    rope: RopeSpec | None = None
    pos_offset: int = 0
    pos_from_mask: bool = False
    sliding_window: tuple[int | None, ...] = ()
    proj_dim: int = 0
    model_type: str = ""
    norm_plus_one: bool = False
    qk_norm: bool = False
    sandwich: bool = False
    embed_scale: float = 0.0
    attn_scale: float = 0.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    rope_local: RopeSpec | None = None
    no_rope: tuple[bool, ...] = ()
    scale_by_layer: bool = False
    layout: str = "out_in"
    lora_roles: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)

    # names the base class and the finetune stage read
    @property
    def layer_norm_eps(self) -> float:
        return self.norm_eps

    @property
    def hidden_act(self) -> str:
        return self.act

    @property
    def tie_word_embeddings(self) -> bool:
        return self.tied

    @property
    def embed_dim(self) -> int:
        return self.proj_dim or self.hidden_size

    def window(self, layer: int) -> int | None:
        return self.sliding_window[layer] if self.sliding_window else None

    def layer_rope(self, layer: int) -> RopeSpec | None:
        """The rotary embedding of block ``layer``: None without rotary positions."""
        if self.positions != "rotary" or (self.no_rope and self.no_rope[layer]):
            return None
        return self.rope_local if self.rope_local and self.window(layer) else self.rope


@dataclass(frozen=True)
class EncoderSpec:
    """One BERT-family encoder (:class:`~semzo.model.encoder.Encoder`): post-LayerNorm blocks,
    learned absolute positions and token types, an ``hidden_act`` MLP, biases everywhere; the
    weight names are BERT's (``encoder.layer.{i}.``)."""

    kind: ClassVar[str] = "encoder"
    family: str
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


class Fields:
    """``config.json`` of one family, read key by key.

    ``honoured``: keys read into the spec; ``inert``: keys that do not change the forward
    computation; ``refused``: key -> accepted values (anything else is refused by name).
    :meth:`finish` checks the refusals and logs keys no list knows (they are ignored, as
    transformers ignores them).
    """

    def __init__(self, raw: dict[str, Any], path: Path, arch: str, honoured: frozenset,
                 inert: frozenset, refused: dict[str, tuple]) -> None:
        self.raw, self.path, self.arch = raw, path, arch
        self.honoured, self.inert = honoured, inert
        self.refused = {**COMMON_REFUSED, **refused}

    def __call__(self, key: str, default: Any = None, req: bool = False) -> Any:
        assert key in self.honoured, key
        if key not in self.raw or self.raw[key] is None:
            if req:
                raise SemzoError(f"{self.path}: missing key {key!r} for {self.arch}")
            return default
        return self.raw[key]

    def maybe(self, key: str, default: Any = None) -> Any:
        """``self(key, default)`` for a key this family honours, else ``default``."""
        return self(key, default) if key in self.honoured else default

    def refuse(self, key: str, why: str) -> None:
        raise SemzoError(f"{self.path}: unsupported {key}={self.raw.get(key)!r} in {self.arch} "
                         f"({why})")

    def finish(self) -> None:
        for key, ok in self.refused.items():
            if key in self.raw and self.raw[key] not in ok and not (
                    self.raw[key] in (None, [], {}) and None in ok):
                self.refuse(key, "semzo does not implement it; accepted: "
                            + ", ".join(repr(v) for v in ok))
        known = self.honoured | self.inert | COMMON_INERT | set(self.refused)
        unknown = sorted(k for k in self.raw if k not in known)
        if unknown:
            log.debug("%s: keys unknown to semzo's %s reader, ignored as transformers ignores "
                     "them: %s", self.path, self.arch, ", ".join(unknown))


def int_field(f: Fields, key: str, default: Any = None, req: bool = False) -> int:
    v = f(key, default, req)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise SemzoError(f"{f.path}: {key} must be a non-negative integer, got {v!r}")
    return int(v)


def window_field(f: Fields, key: str = "sliding_window", default: Any = None) -> int:
    """A sliding window: a positive integer (0 would let a query see no key at all, which
    the attention kernels would take for no window)."""
    v = int_field(f, key, default)
    if v < 1:
        f.refuse(key, f"a sliding window must be at least 1 token, got {v}")
    return v


#: config keys that describe rotary embeddings (transformers 5 ``rope_parameters``; older files
#: ``rope_theta`` and ``rope_scaling``)
ROPE_KEYS = frozenset({"rope_parameters", "rope_theta", "rope_scaling"})
_ROPE_PARAM_KEYS = {"rope_type", "type", "rope_theta", "factor", "low_freq_factor",
                    "high_freq_factor", "original_max_position_embeddings"}


def rope_from(f: Fields, max_positions: int, params: dict | None = None,
              theta: float | None = None, partial: bool = False) -> RopeSpec:
    """The :class:`RopeSpec` of a config: types "default", "linear" and "llama3" are honoured;
    any other type, ``partial_rotary_factor`` != 1 (unless ``partial``: then read from the
    parameters or the top-level key) or per-layer parameters are refused. ``params``: the
    parameters to read (one layer type's), ``theta``: the default base."""
    p = params if params is not None else (f("rope_parameters", None)
                                           or f("rope_scaling", None) or {})
    if not isinstance(p, dict):
        f.refuse("rope_parameters", "not an object")
    p = dict(p)
    key = "rope_parameters" if "rope_parameters" in f.raw else "rope_scaling"
    theta = float(p.get("rope_theta") or theta or f("rope_theta", 10000.0))
    kind = p.get("rope_type", p.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        f.refuse(key, f"rope type {kind!r}; semzo implements default, linear, llama3")
    frac = float(p.get("partial_rotary_factor", f.maybe("partial_rotary_factor", 1.0)))
    if frac != 1.0 and not partial:
        f.refuse(key, "partial_rotary_factor != 1")
    if not 0.0 < frac <= 1.0:
        f.refuse(key, f"partial_rotary_factor {frac} outside (0, 1]")
    other = sorted(set(p) - _ROPE_PARAM_KEYS - {"partial_rotary_factor"})
    if other and kind != "default" or any(isinstance(v, dict) for v in p.values()):
        f.refuse(key, f"parameters {', '.join(other)} unknown to semzo's {kind!r} rope")
    if kind == "default":
        return RopeSpec(theta, partial=frac)
    if kind == "linear":
        return RopeSpec(theta, "linear", factor=float(p["factor"]), partial=frac)
    try:
        return RopeSpec(theta, "llama3", float(p["factor"]), float(p["low_freq_factor"]),
                        float(p["high_freq_factor"]),
                        int(p.get("original_max_position_embeddings") or max_positions),
                        partial=frac)
    except KeyError as exc:
        raise SemzoError(f"{f.path}: {key} of type llama3 lacks {exc.args[0]!r}") from None


def expected_tensors(s: DecoderSpec, prefix: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, shape, stage) of every tensor the forward pass reads, in stage/module order."""
    nm, h, e, d, i_ = s.names, s.hidden_size, s.embed_dim, s.head_dim, s.intermediate_size
    nq, nk = s.num_heads * d, s.num_kv_heads * d
    out = [(prefix + nm.embed, (s.vocab_size, e), 0)]
    if s.positions == "learned":
        out.append((prefix + nm.pos, (s.max_positions + s.pos_offset, h), 0))
    if s.proj_dim:
        out.append((f"{prefix}{nm.project_in}.weight", (h, e), 0))
    shapes = {"q": ((nq, h), s.qkv_bias), "k": ((nk, h), s.qkv_bias), "v": ((nk, h), s.qkv_bias),
              "o": ((h, nq), s.o_bias), "gate": ((i_, h), s.mlp_bias),
              "up": ((i_, h), s.mlp_bias), "down": ((h, i_), s.mlp_bias),
              "qkv": ((nq + 2 * nk, h), s.qkv_bias), "gate_up": ((2 * i_, h), s.mlp_bias)}
    for li in range(s.num_layers):
        lp = prefix + nm.layer_prefix.format(i=li)
        for role, mod in nm.layer:
            if role in ("qnorm", "knorm"):                  # per-head norms (head_dim,)
                out.append((f"{lp}{mod}.weight", (d,), li + 1))
            elif role.startswith("norm"):
                out += _norm_tensors(s, lp + mod, li + 1)
            else:
                shape, bias = shapes[role]
                w = shape[::-1] if s.layout == "in_out" else shape   # Conv1D: (in, out)
                out.append((f"{lp}{mod}.weight", w, li + 1))
                if bias:
                    out.append((f"{lp}{mod}.bias", (shape[0],), li + 1))
    last = s.num_layers + 1
    if s.final_norm:
        out += _norm_tensors(s, prefix + nm.final_norm, last)
    if s.proj_dim:
        out.append((f"{prefix}{nm.project_out}.weight", (e, h), last))
    if not s.tied:
        out.append((nm.lm_head, (s.vocab_size, e), last))
    return out


def _norm_tensors(s: DecoderSpec, mod: str, stage: int) -> list:
    out = [(f"{mod}.weight", (s.hidden_size,), stage)] if s.norm_affine else []
    return out + ([(f"{mod}.bias", (s.hidden_size,), stage)] if s.norm_bias else [])
