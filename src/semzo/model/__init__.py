"""Transformer forward passes in NumPy/CuPy with real pretrained weights (no torch).

Public API::

    from semzo.model import load_model, Tokenizer, embed_texts, export_hf
    model = load_model()                     # packaged all-MiniLM-L6-v2 -> Encoder
    lm = load_model("llama-folder")          # any decoder family (Llama ... GPT-2) -> CausalLM
    tok = Tokenizer.from_folder()            # its tokenizer.json
    ids, mask = tok(["a sentence", "another one"])
    emb = model.embed(ids, mask)             # (B, 384) float32, L2-normalized
    vecs = embed_texts(model, tok, texts)    # (N, 384), bucketed by length, input order

See docs/model.md for the parameter contract the zeroth-order engine relies on.
"""

from semzo.model.base import HeadSpec, LoraSpec, TokenIdError, TransformerBase, is_no_decay
from semzo.model.causal import CausalLM, KVCache
from semzo.model.config import read_config
from semzo.model.embed import embed_ids, embed_texts, length_batches
from semzo.model.encoder import Encoder
from semzo.model.export import export_hf
from semzo.model.kernels import get_threads, set_threads
from semzo.model.loader import default_model_path, load_model
from semzo.model.spec import DecoderSpec, EncoderSpec
from semzo.model.tokenizer import Tokenizer
from semzo.model.weights import Checkpoint

__all__ = [
    "CausalLM",
    "Checkpoint",
    "DecoderSpec",
    "Encoder",
    "EncoderSpec",
    "HeadSpec",
    "KVCache",
    "LoraSpec",
    "TokenIdError",
    "Tokenizer",
    "TransformerBase",
    "default_model_path",
    "embed_ids",
    "embed_texts",
    "export_hf",
    "get_threads",
    "is_no_decay",
    "length_batches",
    "load_model",
    "read_config",
    "set_threads",
]
