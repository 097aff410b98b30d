"""GPT-2 family (``GPT2LMHeadModel``, ``GPT2Model``): pre-LayerNorm blocks, learned positions
0..T-1 (``wpe``), fused ``attn.c_attn`` = [q | k | v] (the fused qkv of Phi-3), ``gelu_new`` MLP
``c_proj(act(c_fc(x)))``, biases everywhere, LM head tied to ``wte`` unless
``tie_word_embeddings`` is false.

Weights stay in GPT-2's Conv1D layout (in, out) (``layout="in_out"``): the parameters, the
checkpoint tensors semzo writes and :func:`~semzo.model.export.export_hf` keep the file's
shapes, so transformers loads an export and checkpoints written before resume. LoRA targets the
attention projections only (``attn.c_attn``, ``attn.c_proj``: the MLP's ``mlp.c_proj`` shares the
suffix), as GPT-2 always did in semzo. ``scale_attn_weights`` (scores / sqrt(head_dim), else
unscaled) and ``scale_attn_by_inverse_layer_idx`` (scores of block i divided by i + 1) are
honoured."""

from semzo.model.spec import DecoderSpec, Fields, Names, int_field

ARCHITECTURES = ("GPT2LMHeadModel", "GPT2Model")
MODEL_TYPE = "gpt2"
CONFIG_CLASS = "GPT2Config"
PREFIXES = ("", "transformer.")
NAMES = Names(
    embed="wte.weight", pos="wpe.weight", layer_prefix="h.{i}.", final_norm="ln_f",
    layer=(("norm1", "ln_1"), ("qkv", "attn.c_attn"), ("o", "attn.c_proj"), ("norm2", "ln_2"),
           ("up", "mlp.c_fc"), ("down", "mlp.c_proj")))
HONOURED = frozenset({
    "vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "layer_norm_epsilon", "scale_attn_weights",
    "scale_attn_by_inverse_layer_idx", "tie_word_embeddings"})
#: summary_*: the multiple-choice head of GPT2DoubleHeadsModel (not the LM);
#: reorder_and_upcast_attn: computes attention scores in float32, which semzo always does
#: (float32 accumulation on every path); add_cross_attention: used only with encoder states
INERT = frozenset({
    "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
    "summary_first_dropout", "reorder_and_upcast_attn", "add_cross_attention"})
REFUSED: dict = {}


def spec(f: Fields) -> DecoderSpec:
    h = int_field(f, "n_embd", req=True)
    nh = int_field(f, "n_head", req=True)
    return DecoderSpec(
        family="gpt2", model_type=MODEL_TYPE, vocab_size=int_field(f, "vocab_size", req=True),
        hidden_size=h, num_layers=int_field(f, "n_layer", req=True), num_heads=nh,
        num_kv_heads=nh, head_dim=h // max(nh, 1), intermediate_size=int_field(f, "n_inner", 4 * h),
        max_positions=int_field(f, "n_positions", req=True), norm="layernorm",
        norm_eps=float(f("layer_norm_epsilon", 1e-5)), norm_affine=True, norm_bias=True,
        pre_norm=True, final_norm=True, positions="learned",
        act=str(f("activation_function", "gelu_new")), gated=False, qkv_bias=True, o_bias=True,
        mlp_bias=True, tied=bool(f("tie_word_embeddings", True)), names=NAMES,
        attn_scale=0.0 if f("scale_attn_weights", True) else 1.0,
        scale_by_layer=bool(f("scale_attn_by_inverse_layer_idx", False)),
        layout="in_out", lora_roles=("qkv", "o"), raw=f.raw)
