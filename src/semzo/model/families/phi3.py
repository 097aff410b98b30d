"""Phi-3 / Phi-4-mini family (``Phi3ForCausalLM``): Llama with fused projections
(``self_attn.qkv_proj`` = [q | k | v] rows, ``mlp.gate_up_proj`` = [gate | up] rows, kept
fused: LoRA targets ``qkv_proj`` / ``gate_up_proj``, as PEFT does), no biases, partial rotary
(``partial_rotary_factor``, in ``rope_parameters`` or top-level: the first
``head_dim * factor`` dims of each head rotate), sliding-window attention on every layer when
``sliding_window`` is set. "longrope" scaling (Phi-3-*-128k, Phi-4-mini) is refused by name."""

from semzo.model.families import llama
from semzo.model.spec import (
    ROPE_KEYS,
    DecoderSpec,
    Fields,
    Names,
    int_field,
    rope_from,
    window_field,
)

ARCHITECTURES = ("Phi3ForCausalLM", "Phi3Model")
MODEL_TYPE = "phi3"
PREFIXES = llama.PREFIXES
NAMES = Names(
    embed="embed_tokens.weight", layer_prefix="layers.{i}.", final_norm="norm",
    layer=(("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"),
           ("gate_up", "mlp.gate_up_proj"), ("down", "mlp.down_proj"),
           ("norm1", "input_layernorm"), ("norm2", "post_attention_layernorm")))
#: ``head_dim`` and ``partial_rotary_factor`` are not fields of Phi3Config, but transformers
#: reads them when config.json has them
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "sliding_window",
    "partial_rotary_factor"}) | ROPE_KEYS
#: only longrope scaling (refused) reads ``original_max_position_embeddings``
INERT = frozenset({"original_max_position_embeddings"})
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    n = int_field(f, "num_hidden_layers", req=True)
    win = f("sliding_window", None)
    win = None if win is None else window_field(f)
    rope = rope_from(f, int_field(f, "max_position_embeddings", 4096), partial=True)
    return llama.spec(f, "phi3", NAMES, qkv_bias=False, windows=(win,) * n, rope=rope,
                      model_type=MODEL_TYPE)
