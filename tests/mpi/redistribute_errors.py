"""Bad arguments on one rank: every rank raises ValueError from redistribute, none hangs,
and the communicator is still usable afterwards.

usage: redistribute_errors.py
"""

import numpy as np
from mpi4py import MPI

from semzo.place.redistribute import redistribute
from semzo.runtime import run_spmd


def expect_all_raise(comm, dest, columns, text=None, match=""):
    try:
        redistribute(comm, dest, columns, text=text, memory_cap_bytes=1000)
        raised = 0
    except ValueError as exc:
        assert match in str(exc), str(exc)
        raised = 1
    assert comm.allreduce(raised) == comm.Get_size(), "not every rank raised"


def main():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    assert size >= 2, "run with at least 2 ranks"
    last = rank == size - 1
    n = 50
    ids = np.arange(n, dtype=np.int64) + rank * n
    dest = ids % size
    bad_dest = dest.copy()
    if last:
        bad_dest[3] = size                        # out of range on one rank only
    expect_all_raise(comm, bad_dest, {"id": ids}, match="bad arguments")
    cols = {"id": ids, "x": np.zeros((n, 3), dtype=np.float32 if not last else np.float64)}
    expect_all_raise(comm, dest, cols, match="different column layouts")
    expect_all_raise(comm, dest, {"id": ids[: n - int(last)]}, match="bad arguments")
    texts = [str(i) for i in ids] if not last else None
    expect_all_raise(comm, dest, {"id": ids}, text=texts, match="different column layouts")
    # and a good call still works afterwards
    got, _ = redistribute(comm, dest, {"id": ids})
    assert np.all(got["id"] % size == rank) and got["id"].size == n
    if rank == 0:
        print(f"ok: errors agreed on {size} ranks", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
