"""Gemma 3 text family (``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 2 plus a
per-head (1 + w) RMSNorm of q and k before rotary (``q_norm``, ``k_norm``), sliding windows
on the layers ``layer_types`` marks "sliding_attention" (default: all but every 6th,
``sliding_window_pattern``) with their own rotary base: ``rope_parameters`` per layer type
(transformers 5: {"sliding_attention": {...}, "full_attention": {...}}) or, in transformers 4
files, ``rope_local_base_freq`` for the sliding layers and ``rope_theta`` / ``rope_scaling``
for the full ones. No soft-capping by default (``attn_logit_softcapping``,
``final_logit_softcapping`` honoured when set)."""

from semzo.model.families import gemma2
from semzo.model.spec import DecoderSpec, Fields, Names, int_field, rope_from

ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3TextModel")
MODEL_TYPE = "gemma3_text"
CONFIG_CLASS = "Gemma3TextConfig"           # Gemma3Config is the multimodal one
PREFIXES = gemma2.PREFIXES
NAMES = Names(embed="embed_tokens.weight", layer_prefix="layers.{i}.", final_norm="norm",
              layer=gemma2._ATTN + (("qnorm", "self_attn.q_norm"),
                                    ("knorm", "self_attn.k_norm")) + gemma2._REST)
HONOURED = gemma2.HONOURED | {"rope_local_base_freq", "sliding_window_pattern"}
#: ``_sliding_window_pattern``: transformers writes it, ``layer_types`` carries its effect
INERT = gemma2.INERT | {"_sliding_window_pattern"}
REFUSED = gemma2.REFUSED
_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def spec(f: Fields) -> DecoderSpec:
    npos = int_field(f, "max_position_embeddings", 131072)
    p = f("rope_parameters", None)
    ropes = {}
    for kind in ("full_attention", "sliding_attention"):
        if isinstance(p, dict) and isinstance(p.get(kind), dict):     # transformers 5
            ropes[kind] = rope_from(f, npos, p[kind], _THETA[kind])
        elif p is not None:
            f.refuse("rope_parameters", "need one object per layer type")
        elif kind == "full_attention":                                 # transformers 4
            ropes[kind] = rope_from(f, npos, theta=float(f("rope_theta", _THETA[kind])))
        else:
            ropes[kind] = rope_from(f, npos, {"rope_theta": float(
                f("rope_local_base_freq", _THETA[kind]))})
    every = int_field(f, "sliding_window_pattern", 6)
    return gemma2.spec(f, "gemma3", NAMES, every=max(every, 1),
                       rope=ropes["full_attention"], rope_local=ropes["sliding_attention"],
                       qk_norm=True, model_type=MODEL_TYPE)
