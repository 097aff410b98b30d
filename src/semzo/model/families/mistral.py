"""Mistral family (``MistralForCausalLM``): Llama without biases, with sliding-window causal
attention on every layer when ``sliding_window`` is set (a query sees the ``sliding_window``
most recent keys, itself included)."""

from semzo.model.families import llama
from semzo.model.spec import ROPE_KEYS, DecoderSpec, Fields, int_field, window_field

ARCHITECTURES = ("MistralForCausalLM", "MistralModel")
MODEL_TYPE = "mistral"
PREFIXES = llama.PREFIXES
NAMES = llama.NAMES
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "sliding_window"}) | ROPE_KEYS
INERT: frozenset = frozenset()
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    n = int_field(f, "num_hidden_layers", req=True)
    win = f("sliding_window", None)
    win = None if win is None else window_field(f)
    return llama.spec(f, "mistral", NAMES, qkv_bias=False, windows=(win,) * n)
