"""Tokenization with the ``tokenizers`` library from a folder's ``tokenizer.json``.

Padding stored in ``tokenizer.json`` is switched off (batches are padded by semzo, to the
longest sequence of each length bucket); truncation is set to :attr:`Tokenizer.max_length`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from semzo.model.loader import default_model_path
from semzo.model.zoo import resolve_model_path
from semzo.runtime import SemzoError


def _json(path: Path) -> dict:
    """The JSON object in ``path``; {} when there is no such file. A file that is there but
    unreadable, not JSON or not an object is refused by name (it used to read as {}, so a
    damaged config silently lost its lengths and pad id)."""
    if not path.is_file():
        return {}
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SemzoError(f"{path}: not valid JSON: {str(exc).splitlines()[0][:160]}") from None
    if not isinstance(obj, dict):
        raise SemzoError(f"{path}: must hold a JSON object, got {type(obj).__name__}")
    return obj


class Tokenizer:
    """Wraps a ``tokenizers.Tokenizer``; ids are int64 NumPy arrays with special tokens added.

    ``max_length``: longest sequence (special tokens included) after truncation.
    ``pad_id``: id written at padded positions (the mask says which positions are real).
    """

    def __init__(self, tk, max_length: int | None, pad_id: int = 0) -> None:
        self.tk = tk
        self.max_length = max_length
        self.pad_id = int(pad_id)
        tk.no_padding()
        if max_length is not None:
            tk.enable_truncation(int(max_length))
        else:
            tk.no_truncation()

    @classmethod
    def from_folder(cls, path: str | Path | None = None,
                    max_length: int | None = None) -> Tokenizer:
        """Read ``path/tokenizer.json`` (None: the packaged MiniLM folder; a named model such
        as ``"smollm2"``: its converted folder).

        ``max_length`` None takes, in order: ``max_seq_length`` of ``sentence_bert_config.json``
        (256 for all-MiniLM-L6-v2, what sentence-transformers uses), the truncation length of
        ``tokenizer.json``, ``model_max_length`` of ``tokenizer_config.json``, then the model's
        ``max_position_embeddings`` / ``n_positions``.
        """

        folder = default_model_path() if path is None else resolve_model_path(path)
        f = folder / "tokenizer.json"
        if not f.is_file():
            raise SemzoError(f"{f}: not found (semzo needs a fast tokenizer.json)")
        try:
            tk = HFTokenizer.from_file(str(f))
        except Exception as exc:  # noqa: BLE001 - one-line report
            raise SemzoError(f"{f}: cannot read tokenizer: {exc}") from None
        if max_length is None:
            max_length = _default_max_length(folder, tk)
        pad = tk.padding
        return cls(tk, max_length, pad_id_for(_json(folder / "config.json"),
                                              pad.get("pad_id") if pad else None))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids (with special tokens, truncated) of each text, as int64 arrays."""
        encs = self.tk.encode_batch(list(texts))
        return [np.asarray(e.ids, dtype=np.int64) for e in encs]

    def pad(self, seqs: list[np.ndarray], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad to the longest sequence (or ``length``): ids (B, T) int64, mask (B, T) int64."""
        t = max((len(s) for s in seqs), default=0) if length is None else int(length)
        ids = np.full((len(seqs), t), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(seqs), t), dtype=np.int64)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = s
            mask[i, :len(s)] = 1
        return ids, mask

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize and pad a batch: (ids, mask)."""
        return self.pad(self.encode_batch(texts))


def pad_id_for(cfg: dict, tokenizer_pad: int | None = None) -> int:
    """The id written at padded positions: the first of the tokenizer's own pad id, the
    config's ``pad_token_id`` (0 counts as set), its ``eos_token_id`` (the first if a list)
    that lies inside the vocabulary (``vocab_size``), else 0. Padded positions are masked, so
    any valid id gives the same results, but an id outside the vocabulary is an error at
    the model's entry (a small-vocabulary GPT-2 keeps GPT2Config's eos 50256)."""
    vocab = cfg.get("vocab_size")
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    for cand in (tokenizer_pad, cfg.get("pad_token_id"), eos):
        if isinstance(cand, int) and not isinstance(cand, bool) and cand >= 0 and (
                not isinstance(vocab, int) or cand < vocab):
            return int(cand)
    return 0


_NO_LIMIT = 1_000_000     # model_max_length from this up: "no limit" (transformers' 1e30)


def _length(path: Path, key: str, v, no_limit: bool = False) -> int | None:
    """``v`` (``path``'s ``key``) as a positive length, None when absent; with ``no_limit``
    (``model_max_length``) also None from :data:`_NO_LIMIT` up, infinity included. Anything
    else (a negative, zero or fractional number, one of 2**63 or more, a string, NaN) is a
    :class:`SemzoError` naming the file and the key."""
    if v is None:
        return None
    if no_limit and not isinstance(v, bool) and isinstance(v, (int, float)) and v >= _NO_LIMIT:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 1 <= v < 2**63 or (
            isinstance(v, float) and not v.is_integer()):
        raise SemzoError(f"{path}: '{key}' must be a positive integer, got {repr(v)[:40]}")
    return int(v)


def _default_max_length(folder: Path, tk) -> int | None:
    f = folder / "sentence_bert_config.json"
    st = _length(f, "max_seq_length", _json(f).get("max_seq_length"))
    if st:
        return st
    tr = tk.truncation
    if tr and tr.get("max_length"):
        return int(tr["max_length"])
    f = folder / "tokenizer_config.json"
    mml = _length(f, "model_max_length", _json(f).get("model_max_length"), no_limit=True)
    if mml:
        return mml
    f = folder / "config.json"
    cfg = _json(f)
    key = "max_position_embeddings" if cfg.get("max_position_embeddings") is not None \
        else "n_positions"
    return _length(f, key, cfg.get(key))
