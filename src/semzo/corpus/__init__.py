"""Corpora: the parallel JSONL and Parquet readers, the record formats (records.py) and converters from Debian corpora."""

from semzo.corpus.convert import CONVERTERS, debian, fortunes, write_jsonl_atomic
from semzo.corpus.jsonl import CorpusSlice, label_codes, label_vocab, read_jsonl_slice
from semzo.corpus.parquet import read_corpus_slice, read_parquet_slice

__all__ = ["CONVERTERS", "CorpusSlice", "debian", "fortunes", "label_codes", "label_vocab",
           "read_corpus_slice", "read_jsonl_slice", "read_parquet_slice", "write_jsonl_atomic"]
