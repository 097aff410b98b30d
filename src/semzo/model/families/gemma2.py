"""Gemma 2 family (``Gemma2ForCausalLM``): RMSNorm scaled by (1 + w), embeddings times
sqrt(hidden_size), four norms per block (``input_layernorm`` before attention,
``post_attention_layernorm`` on its output before the residual add,
``pre_feedforward_layernorm`` before the MLP, ``post_feedforward_layernorm`` on its output),
GeGLU MLP (``hidden_activation``, tanh GELU), scores scaled by ``query_pre_attn_scalar**-0.5``
and soft-capped (``attn_logit_softcapping``: c * tanh(s / c)), logits soft-capped
(``final_logit_softcapping``), sliding-window attention on the layers ``layer_types`` marks
"sliding_attention" (default: every other layer, from the first), tied LM head."""

from semzo.model.families import llama
from semzo.model.spec import (
    ROPE_KEYS,
    DecoderSpec,
    Fields,
    Names,
    RopeSpec,
    int_field,
    rope_from,
    window_field,
)

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma2Model")
MODEL_TYPE = "gemma2"
PREFIXES = llama.PREFIXES
_ATTN = (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
         ("o", "self_attn.o_proj"))
_REST = (("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"), ("down", "mlp.down_proj"),
         ("norm1", "input_layernorm"), ("norm_pa", "post_attention_layernorm"),
         ("norm2", "pre_feedforward_layernorm"), ("norm_pm", "post_feedforward_layernorm"))
NAMES = Names(embed="embed_tokens.weight", layer_prefix="layers.{i}.", final_norm="norm",
              layer=_ATTN + _REST)
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "query_pre_attn_scalar", "sliding_window", "layer_types", "final_logit_softcapping",
    "attn_logit_softcapping"}) | ROPE_KEYS
#: ``hidden_act``: Gemma 1's key, which Gemma 2 configs may still carry (``hidden_activation``
#: is the one transformers reads)
INERT = frozenset({"hidden_act"})
#: bidirectional attention (EmbeddingGemma) is not a causal LM
REFUSED: dict = {"use_bidirectional_attention": (None, False)}


def windows(f: Fields, n: int, every: int) -> tuple:
    """Window per layer from ``layer_types`` (default: "sliding_attention" unless
    (i + 1) % every == 0, as transformers fills it)."""
    types = f("layer_types", None)
    if types is None:
        types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        f.refuse("layer_types", f"need {n} of full_attention / sliding_attention")
    win = f("sliding_window", None)
    if win is None and "sliding_attention" in types:
        f.refuse("sliding_window", "sliding_attention layers need a window")
    win = None if win is None else window_field(f)
    return tuple(win if t == "sliding_attention" else None for t in types)


def spec(f: Fields, family: str = "gemma2", names: Names = NAMES, every: int = 2,
         rope: RopeSpec | None = None, **more) -> DecoderSpec:
    """The Gemma 2 spec; Gemma 3 calls it with its differences."""
    h = int_field(f, "hidden_size", req=True)
    nh = int_field(f, "num_attention_heads", req=True)
    n = int_field(f, "num_hidden_layers", req=True)
    npos = int_field(f, "max_position_embeddings", 8192)
    d = int_field(f, "head_dim", 256)
    bias = bool(f("attention_bias", False))
    return DecoderSpec(
        family=family, model_type=more.pop("model_type", MODEL_TYPE),
        vocab_size=int_field(f, "vocab_size", req=True), hidden_size=h, num_layers=n,
        num_heads=nh, num_kv_heads=int_field(f, "num_key_value_heads", nh), head_dim=d,
        intermediate_size=int_field(f, "intermediate_size", req=True), max_positions=npos,
        norm="rmsnorm", norm_eps=float(f("rms_norm_eps", 1e-6)), norm_affine=True,
        norm_bias=False, pre_norm=True, final_norm=True, positions="rotary",
        rope=rope or rope_from(f, npos), act=str(f("hidden_activation", "gelu_pytorch_tanh")),
        gated=True, qkv_bias=bias, o_bias=bias, mlp_bias=False,
        tied=bool(f("tie_word_embeddings", True)), names=names,
        sliding_window=windows(f, n, every), norm_plus_one=True, sandwich=True,
        embed_scale=float(h) ** 0.5,
        attn_scale=float(f("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=float(f("attn_logit_softcapping", 0.0) or 0.0),
        final_softcap=float(f("final_logit_softcapping", 0.0) or 0.0), raw=f.raw, **more)
