"""Checkpoint faults: one save (to be killed, or to meet a full or unwritable folder), and the
check that the newest intact checkpoint is the one found and loaded.

usage: ckpt_fault.py write DIR STEP     save the test contents of STEP (keep = 5)
       ckpt_fault.py check DIR STEP     find_resumable and resume must give STEP, verified,
                                        with the test contents of STEP
       ckpt_fault.py async-funneled DIR 0   MPI initialized with MPI_THREAD_FUNNELED: an
                                        asynchronous Checkpointer is a deck error (exit 2)

The kill test sets SEMZO_CKPT_TEST_SLEEP so that ``write`` sleeps after every dataset.
"""

import sys
from pathlib import Path

import mpi4py

if sys.argv[1] == "async-funneled":
    mpi4py.rc.thread_level = "funneled"

from ckpt_common import BLOCK_KIB, extras, metrics, params, per_rank, same, state
from mpi4py import MPI

from semzo.checkpoint import Checkpointer, find_resumable, resume
from semzo.deck import CheckpointSection
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    mode, d, step = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    if mode == "async-funneled":
        Checkpointer(comm, CheckpointSection(dir=str(d), async_save=True))
        raise AssertionError("async_save without MPI_THREAD_MULTIPLE was accepted")
    if mode == "write":
        cfg = CheckpointSection(dir=str(d), keep=5, block_kib=BLOCK_KIB)
        with Checkpointer(comm, cfg, deck_toml="# test deck\n") as ck:
            path = ck.save(step, params(step), state(step), per_rank(step, comm.Get_rank()),
                           extras(step), metrics(step))
        if comm.Get_rank() == 0:
            print(f"ok: saved {path}")
        return
    found = find_resumable(d, comm)
    assert found == d / f"ckpt-{step:09d}.h5", found
    loaded = resume(d, comm)
    assert loaded is not None and loaded.step == step and loaded.path == found
    assert same(loaded.params, params(step)) and same(loaded.state, state(step))
    if comm.Get_rank() == 0:
        print(f"ok: resumable step {step}")


if __name__ == "__main__":
    run_spmd(main)
