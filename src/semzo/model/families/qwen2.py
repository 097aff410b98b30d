"""Qwen2 family (``Qwen2ForCausalLM``): Llama with biases on q/k/v (none on o, none in the
MLP) and optional sliding-window attention on the layers ``layer_types`` marks
"sliding_attention" (transformers: when ``use_sliding_window``, layers from
``max_window_layers`` on)."""

from semzo.model.families import llama
from semzo.model.spec import ROPE_KEYS, DecoderSpec, Fields, int_field, window_field

ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen2Model")
MODEL_TYPE = "qwen2"
PREFIXES = llama.PREFIXES
NAMES = llama.NAMES
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
    "rms_norm_eps", "tie_word_embeddings", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types"}) | ROPE_KEYS
INERT: frozenset = frozenset()
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    return llama.spec(f, "qwen2", NAMES, qkv_bias=True, windows=windows(f))


def windows(f: Fields) -> tuple:
    """The window of each layer (None: full attention); Qwen3 reads the same keys."""
    n = int_field(f, "num_hidden_layers", req=True)
    win = window_field(f, "sliding_window", 4096) if f("use_sliding_window", False) else None
    types = f("layer_types", None)
    if types is None:
        first = int_field(f, "max_window_layers", 28)
        types = ["sliding_attention" if win is not None and i >= first else "full_attention"
                 for i in range(n)]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        f.refuse("layer_types", f"need {n} of full_attention / sliding_attention")
    if win is None and "sliding_attention" in types:
        f.refuse("layer_types", "sliding_attention without use_sliding_window")
    return tuple(win if t == "sliding_attention" else None for t in types)
