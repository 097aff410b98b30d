"""read_jsonl_slice on every case of a folder: CASE.jsonl with CASE.expected.json.

Checks on every rank: the records gathered over ranks equal the expected ones (texts, labels,
ids, in file order), slices are contiguous (first_record = records on lower ranks), n_total,
label_vocab, and that no rank read far more than its byte range (each rank parses only its
own lines).

usage: corpus_read.py FOLDER
"""

import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from semzo.corpus import label_codes, label_vocab, read_jsonl_slice
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    cases = sorted(Path(sys.argv[1]).glob("*.jsonl"))
    assert cases
    for path in cases:
        exp = json.loads(path.with_suffix(".expected.json").read_text())
        sl = read_jsonl_slice(path, comm)
        assert len(sl.texts) == sl.ids.size and sl.ids.dtype == np.int64
        parts = comm.allgather((sl.first_record, sl.texts, sl.labels, sl.ids.tolist(),
                                sl.n_total))
        firsts = [p[0] for p in parts]
        lens = [len(p[1]) for p in parts]
        assert firsts == list(np.cumsum([0] + lens[:-1])), (path.name, firsts, lens)
        assert all(p[4] == len(exp["texts"]) for p in parts), path.name
        assert [t for p in parts for t in p[1]] == exp["texts"], path.name
        assert [i for p in parts for i in p[3]] == exp["ids"], path.name
        if exp["labels"] is None:
            assert all(p[2] is None for p in parts), path.name
            assert label_vocab(sl.labels, comm) == []
        else:
            assert [lab for p in parts for lab in p[2]] == exp["labels"], path.name
            vocab = label_vocab(sl.labels, comm)
            assert vocab == sorted(set(exp["labels"])), (path.name, vocab)
            codes = label_codes(sl.labels, vocab)
            assert [vocab[c] for c in codes] == sl.labels
        if exp.get("balanced") and size > 1:
            # equal-length lines: every rank owns about n/size records
            n = len(exp["texts"])
            assert max(lens) - min(lens) <= 1 + n // 50, (path.name, lens)
    if rank == 0:
        print(f"ok: {len(cases)} files on {size} ranks", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
