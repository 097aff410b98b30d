"""Redistribution of rows: round chunking (no MPI) and the MPI property test."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpiutil import ROOT, check, mpirun

from semzo.corpus.strings import decode_strings, encode_strings
from semzo.place.redistribute import _chunks, _gather_bytes

SCRIPTS = ROOT / "tests" / "mpi"


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 50), max_size=40), rate=st.integers(0, 200))
def test_chunks_cover_rows_in_order_within_rate(sizes, rate):
    rb = np.array(sizes, dtype=np.int64)
    ends = _chunks(rb, rate)
    assert (ends[-1] if ends else 0) == rb.size
    start = 0
    for e in ends:
        assert e > start                                  # progress: at least one row
        assert rb[start:e].sum() <= rate or e - start == 1
        start = e


@given(st.lists(st.text(), max_size=20))
def test_strings_roundtrip_and_gather(strings):
    data, lengths = encode_strings(strings)
    assert decode_strings(data, lengths) == strings
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    pick = np.arange(len(strings))[::-1]
    got = _gather_bytes(data, starts[pick], lengths[pick])
    assert decode_strings(got, lengths[pick]) == [strings[i] for i in pick]


@pytest.mark.parametrize("nranks, examples", [(1, 25), (2, 30), (4, 30)])
def test_redistribute_property_mpi(nranks, examples):
    """Hypothesis runs inside one mpirun per rank count (cases broadcast from rank 0)."""
    proc = check(mpirun(nranks, [str(SCRIPTS / "redistribute_prop.py"), str(examples)],
                        timeout=90))
    assert f"ok: {examples} cases on {nranks} ranks" in proc.stdout


def test_redistribute_bad_arguments_agreed_mpi():
    proc = check(mpirun(3, [str(SCRIPTS / "redistribute_errors.py")], timeout=60))
    assert "ok: errors agreed on 3 ranks" in proc.stdout
