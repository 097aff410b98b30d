"""One rank raises inside a collective HDF5 block while the others go on into a collective
write or read of the same file: the job must end promptly with that rank's error (exit 1),
never hang in the collective close (tests/test_pipeline.py runs it).

usage: mpirun -n N python tests/mpi/h5_one_rank_fails.py OUTDIR write|read|create
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from semzo.h5io import create_collective, open_collective, read_slab, write_rows
from semzo.runtime import run_spmd


def main() -> None:
    comm = MPI.COMM_WORLD
    out, where = Path(sys.argv[1]), sys.argv[2]
    rank, size = comm.Get_rank(), comm.Get_size()
    rows = np.full((4, 3), rank, np.float32)
    if where == "write":
        with create_collective(out / "x.h5", comm, "") as f:
            if rank == size - 1:
                raise RuntimeError(f"injected on rank {rank}")
            write_rows(f, "a", rows, 4 * rank, 4 * size)
    elif where == "read":
        with create_collective(out / "x.h5", comm, "") as f:
            write_rows(f, "a", rows, 4 * rank, 4 * size)
        with open_collective(out / "x.h5", comm) as f:
            if rank == size - 1:
                raise RuntimeError(f"injected on rank {rank}")
            read_slab(f["a"], 4 * rank, 4 * rank + 4)
            read_slab(f["a"], 0, 4)
    elif where == "create":        # the output's .tmp name is taken by a folder
        if rank == 0:
            (out / "x.h5.tmp").mkdir()
        comm.Barrier()
        with create_collective(out / "x.h5", comm, "") as f:
            write_rows(f, "a", rows, 4 * rank, 4 * size)


if __name__ == "__main__":
    run_spmd(main)
