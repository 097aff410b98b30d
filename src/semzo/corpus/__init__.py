"""Corpora: the parallel JSONL reader and converters from Debian corpora."""

from semzo.corpus.convert import CONVERTERS, debian, fortunes, write_jsonl_atomic
from semzo.corpus.jsonl import CorpusSlice, label_codes, label_vocab, read_jsonl_slice

__all__ = ["CONVERTERS", "CorpusSlice", "debian", "fortunes", "label_codes", "label_vocab",
           "read_jsonl_slice", "write_jsonl_atomic"]
