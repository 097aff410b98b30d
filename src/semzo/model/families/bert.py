"""BERT family (``BertModel``; all-MiniLM-L6-v2 is one): the encoder of
:class:`~semzo.model.encoder.Encoder`, described by an :class:`~semzo.model.spec.EncoderSpec`
read through the same :class:`~semzo.model.spec.Fields` as every decoder family. Absolute
positions only (``position_embedding_type`` other than "absolute" is refused by name), no
causal self-attention (``is_decoder`` refused)."""

from semzo.model.spec import EncoderSpec, Fields, int_field

KIND = "encoder"
ARCHITECTURES = ("BertModel", "BertForMaskedLM", "BertForSequenceClassification")
MODEL_TYPE = "bert"
CONFIG_CLASS = "BertConfig"
PREFIXES = ("", "bert.")
#: BertConfig keys read into the spec (with the common keys of
#: :data:`semzo.model.spec.COMMON_INERT` and the refusals below, every key of the class)
HONOURED = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "intermediate_size", "hidden_act", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "pad_token_id", "position_embedding_type"})
#: an encoder has no LM head to tie
INERT = frozenset({"tie_word_embeddings"})
#: is_decoder makes BERT's self-attention causal: not implemented
REFUSED = {"is_decoder": (False,)}


def spec(f: Fields) -> EncoderSpec:
    if f("position_embedding_type", "absolute") != "absolute":
        f.refuse("position_embedding_type", "semzo implements absolute positions")
    return EncoderSpec(
        family="bert", model_type=MODEL_TYPE, vocab_size=int_field(f, "vocab_size", req=True),
        hidden_size=int_field(f, "hidden_size", req=True),
        num_layers=int_field(f, "num_hidden_layers", req=True),
        num_heads=int_field(f, "num_attention_heads", req=True),
        intermediate_size=int_field(f, "intermediate_size", req=True),
        max_positions=int_field(f, "max_position_embeddings", req=True),
        type_vocab_size=int_field(f, "type_vocab_size", 2),
        layer_norm_eps=float(f("layer_norm_eps", 1e-12)), hidden_act=str(f("hidden_act", "gelu")),
        pad_token_id=int(f("pad_token_id", 0)), raw=f.raw)
