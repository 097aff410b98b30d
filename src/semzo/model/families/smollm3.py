"""SmolLM3 family (``SmolLM3ForCausalLM``): Llama in which some layers have no rotary
positions (``no_rope_layers``: per layer 1 = rotary, 0 = none; default from
``no_rope_layer_interval``: every n-th layer has none), optional biases (``attention_bias`` on
q/k/v/o, ``mlp_bias``), optional sliding windows on the layers ``layer_types`` marks
"sliding_attention" when ``use_sliding_window`` (transformers' default: the no-rope layers)."""

from semzo.model.families import llama
from semzo.model.spec import ROPE_KEYS, DecoderSpec, Fields, int_field, window_field

ARCHITECTURES = ("SmolLM3ForCausalLM", "SmolLM3Model")
MODEL_TYPE = "smollm3"
PREFIXES = llama.PREFIXES
NAMES = llama.NAMES
#: ``head_dim`` is not a field of SmolLM3Config, but transformers reads it when present
HONOURED = frozenset({
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "attention_bias",
    "mlp_bias", "use_sliding_window", "sliding_window", "no_rope_layers",
    "no_rope_layer_interval", "layer_types"}) | ROPE_KEYS
INERT: frozenset = frozenset()
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    n = int_field(f, "num_hidden_layers", req=True)
    rope = f("no_rope_layers", None)
    if rope is None:
        every = int_field(f, "no_rope_layer_interval", 4)
        rope = [int((i + 1) % every != 0) if every else 1 for i in range(n)]
    if len(rope) != n or any(v not in (0, 1) for v in rope):
        f.refuse("no_rope_layers", f"need {n} values 0 / 1")
    win = f("sliding_window", None) if f("use_sliding_window", False) else None
    win = None if win is None else window_field(f)
    types = f("layer_types", None)
    if types is None:
        types = ["sliding_attention" if win is not None and not r else "full_attention"
                 for r in rope]
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        f.refuse("layer_types", f"need {n} of full_attention / sliding_attention")
    windows = tuple(win if t == "sliding_attention" else None for t in types)
    return llama.spec(f, "smollm3", NAMES, windows=windows,
                      no_rope=tuple(not r for r in rope), model_type=MODEL_TYPE)
