"""Stage 2, embed: each rank embeds its byte-range slice of the corpus with the encoder and
all ranks write one ``embeddings.h5`` collectively."""

from .stage import read_embeddings, run_embed_stage

__all__ = ["read_embeddings", "run_embed_stage"]
