"""Llama family (``LlamaForCausalLM``: Llama 2/3, SmolLM, SmolLM2): pre-RMSNorm blocks, rotary
positions (``rope_theta``, "linear" and "llama3" scaling), SwiGLU MLP, grouped-query attention,
optional biases (``attention_bias`` on q/k/v/o, ``mlp_bias``), tied or untied LM head."""

from semzo.model.spec import (
    ROPE_KEYS,
    DecoderSpec,
    Fields,
    Names,
    RopeSpec,
    int_field,
    rope_from,
)

ARCHITECTURES = ("LlamaForCausalLM", "LlamaModel")
MODEL_TYPE = "llama"
PREFIXES = ("model.", "")
NAMES = Names(
    embed="embed_tokens.weight", layer_prefix="layers.{i}.", final_norm="norm",
    layer=(("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.o_proj"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
           ("down", "mlp.down_proj"), ("norm1", "input_layernorm"),
           ("norm2", "post_attention_layernorm")))
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "attention_bias", "mlp_bias",
    "tie_word_embeddings"}) | ROPE_KEYS
#: pretraining_tp only splits the same GEMMs into slices (same result)
INERT = frozenset({"pretraining_tp"})
REFUSED: dict = {}


def spec(f: Fields, family: str = "llama", names: Names = NAMES, qkv_bias: bool | None = None,
         windows: tuple = (), rope: RopeSpec | None = None, **more) -> DecoderSpec:
    """The Llama spec; Qwen2, Mistral and the later families call it with their differences
    (``more``: further :class:`DecoderSpec` fields)."""
    h = int_field(f, "hidden_size", req=True)
    nh = int_field(f, "num_attention_heads", req=True)
    npos = int_field(f, "max_position_embeddings", 2048)
    bias = bool(f("attention_bias", False)) if qkv_bias is None else qkv_bias
    more.setdefault("model_type", MODEL_TYPE)
    return DecoderSpec(
        family=family, vocab_size=int_field(f, "vocab_size", req=True),
        hidden_size=h, num_layers=int_field(f, "num_hidden_layers", req=True), num_heads=nh,
        num_kv_heads=int_field(f, "num_key_value_heads", nh),
        head_dim=int(f.maybe("head_dim") or h // max(nh, 1)),
        intermediate_size=int_field(f, "intermediate_size", req=True), max_positions=npos,
        norm="rmsnorm", norm_eps=float(f("rms_norm_eps", 1e-6)), norm_affine=True,
        norm_bias=False, pre_norm=True, final_norm=True, positions="rotary",
        rope=rope or rope_from(f, npos), act=str(f("hidden_act", "silu")), gated=True,
        qkv_bias=bias, o_bias=bias if qkv_bias is None else False,
        mlp_bias=bool(f.maybe("mlp_bias", False)),
        tied=bool(f("tie_word_embeddings", False)), names=names, sliding_window=windows,
        raw=f.raw, **more)
