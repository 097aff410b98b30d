"""Read a malformed corpus: must end every rank (exit 2), reporting PATH:LINE once.

usage: corpus_error.py PATH
"""

import sys

from mpi4py import MPI

from semzo.corpus import read_jsonl_slice
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    read_jsonl_slice(sys.argv[1], comm)
    comm.Barrier()            # a rank that did not raise would wait here forever
    print("no error raised", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
