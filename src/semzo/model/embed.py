"""Embed many texts: tokenize, bucket by length, run the encoder batch by batch, restore order."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


def length_batches(lengths: Sequence[int], batch_size: int,
                   max_tokens: int | None = None) -> Iterator[np.ndarray]:
    """Indices of batches of similar length: sorted by decreasing length, then cut into batches
    of at most ``batch_size`` rows and (if given) at most ``max_tokens`` padded tokens.

    Deterministic (stable sort); every index appears exactly once.
    """
    lengths = np.asarray(lengths)
    order = np.argsort(-lengths, kind="stable")
    i, n = 0, len(order)
    while i < n:
        rows = batch_size
        if max_tokens is not None:
            rows = max(1, min(rows, max_tokens // max(int(lengths[order[i]]), 1)))
        yield order[i:i + rows]
        i += rows


def embed_ids(model, seqs: list[np.ndarray], pad_id: int = 0, batch_size: int = 64,
              max_tokens: int | None = None, normalize: bool = True) -> np.ndarray:
    """Pooled embeddings (N, H) float32 NumPy of pre-tokenized sequences, in input order."""
    h = model.config.hidden_size
    out = np.empty((len(seqs), h), dtype=np.float32)
    lengths = [len(s) for s in seqs]
    for idx in length_batches(lengths, batch_size, max_tokens):
        t = max(lengths[j] for j in idx)
        ids = np.full((len(idx), t), pad_id, dtype=np.int64)
        mask = np.zeros((len(idx), t), dtype=np.float32)
        for r, j in enumerate(idx):
            ids[r, :lengths[j]] = seqs[j]
            mask[r, :lengths[j]] = 1.0
        e = model.pooled(ids, mask, normalize=normalize)
        out[idx] = e.get() if hasattr(e, "get") else e
    return out


def embed_texts(model, tokenizer, texts: Sequence[str], batch_size: int = 64,
                max_tokens: int | None = None, normalize: bool = True) -> np.ndarray:
    """Sentence embeddings (N, H) float32 NumPy of ``texts``, in input order.

    Texts are tokenized at once, sorted by token count and padded per batch to the batch's
    longest sequence, so padding waste is small; results go back to the input order.
    ``normalize``: L2-normalize (the sentence-transformers output of all-MiniLM-L6-v2).
    """
    seqs = tokenizer.encode_batch(list(texts))
    return embed_ids(model, seqs, tokenizer.pad_id, batch_size, max_tokens, normalize)
