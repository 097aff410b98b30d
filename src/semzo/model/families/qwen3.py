"""Qwen3 family (``Qwen3ForCausalLM``): Llama with a per-head RMSNorm of q and k
(``q_norm``, ``k_norm``, weights (head_dim,)) after the projections (and their biases, when
``attention_bias``: q/k/v/o) and before rotary, an explicit ``head_dim``, and Qwen2's
optional sliding windows (``use_sliding_window``, ``max_window_layers``, ``layer_types``)."""

from semzo.model.families import llama, qwen2
from semzo.model.spec import ROPE_KEYS, DecoderSpec, Fields, Names

ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3Model")
MODEL_TYPE = "qwen3"
PREFIXES = llama.PREFIXES
NAMES = Names(
    embed="embed_tokens.weight", layer_prefix="layers.{i}.", final_norm="norm",
    layer=(("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.o_proj"), ("qnorm", "self_attn.q_norm"),
           ("knorm", "self_attn.k_norm"), ("gate", "mlp.gate_proj"), ("up", "mlp.up_proj"),
           ("down", "mlp.down_proj"), ("norm1", "input_layernorm"),
           ("norm2", "post_attention_layernorm")))
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"}) | ROPE_KEYS
INERT: frozenset = frozenset()
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    return llama.spec(f, "qwen3", NAMES, windows=qwen2.windows(f), qk_norm=True,
                      model_type=MODEL_TYPE)
