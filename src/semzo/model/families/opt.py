"""OPT family (``OPTForCausalLM``, the model of MeZO and ZO2): LayerNorm blocks, pre-LN when
``do_layer_norm_before`` (post-LN otherwise, as OPT-350m), learned positions indexed by
``cumsum(mask) * mask - 1 + 2`` (offset 2), ReLU MLP ``fc2(act(fc1(x)))``, biases everywhere
(``enable_bias``), ``project_in`` / ``project_out`` when ``word_embed_proj_dim`` differs from
``hidden_size``, LM head tied to the token embeddings."""

from semzo.model.spec import DecoderSpec, Fields, Names, int_field

ARCHITECTURES = ("OPTForCausalLM", "OPTModel")
MODEL_TYPE = "opt"
PREFIXES = ("model.", "")
NAMES = Names(
    embed="decoder.embed_tokens.weight", pos="decoder.embed_positions.weight",
    project_in="decoder.project_in", project_out="decoder.project_out",
    final_norm="decoder.final_layer_norm", layer_prefix="decoder.layers.{i}.",
    layer=(("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
           ("o", "self_attn.out_proj"), ("norm1", "self_attn_layer_norm"), ("up", "fc1"),
           ("down", "fc2"), ("norm2", "final_layer_norm")))
HONOURED = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "ffn_dim", "max_position_embeddings",
    "do_layer_norm_before", "_remove_final_layer_norm", "word_embed_proj_dim",
    "num_attention_heads", "activation_function", "enable_bias",
    "layer_norm_elementwise_affine", "tie_word_embeddings"})
INERT: frozenset = frozenset()
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    h = int_field(f, "hidden_size", req=True)
    nh = int_field(f, "num_attention_heads", req=True)
    pre = bool(f("do_layer_norm_before", True))
    proj = int_field(f, "word_embed_proj_dim", h)
    bias = bool(f("enable_bias", True))
    affine = bool(f("layer_norm_elementwise_affine", True))
    return DecoderSpec(
        family="opt", model_type=MODEL_TYPE, vocab_size=int_field(f, "vocab_size", req=True),
        hidden_size=h, num_layers=int_field(f, "num_hidden_layers", req=True), num_heads=nh,
        num_kv_heads=nh, head_dim=h // max(nh, 1), intermediate_size=int_field(f, "ffn_dim", req=True),
        max_positions=int_field(f, "max_position_embeddings", 2048),
        norm="layernorm", norm_eps=1e-5, norm_affine=affine, norm_bias=affine,
        pre_norm=pre, final_norm=pre and not f("_remove_final_layer_norm", False),
        positions="learned", pos_offset=2, pos_from_mask=True,
        act=str(f("activation_function", "relu")), gated=False, qkv_bias=bias, o_bias=bias,
        mlp_bias=bias, tied=bool(f("tie_word_embeddings", True)),
        proj_dim=proj if proj != h else 0, names=NAMES, raw=f.raw)
