"""Resume over many damaged copies of a real checkpoint folder, at any rank count.

usage: ckpt_damage.py CASES_DIR GOOD_STEP

Every subfolder of CASES_DIR is a checkpoint folder whose newest file is damaged and whose
older one (step GOOD_STEP) is intact. On every rank: ``resume`` must skip the damaged one
(no hang, no crash, no exception) and load GOOD_STEP with the same tensors, state and
cursors as an intact copy (the first case's older file, read before any damage check).
"""

import sys
from pathlib import Path

from ckpt_common import same
from mpi4py import MPI

from semzo.checkpoint import load, resume
from semzo.runtime import run_spmd


def main():
    comm = MPI.COMM_WORLD
    cases, good = Path(sys.argv[1]), int(sys.argv[2])
    folders = sorted(p for p in cases.iterdir() if p.is_dir())
    want = load(folders[0] / f"ckpt-{good:09d}.h5", comm)
    for d in folders:
        got = resume(d, comm)
        assert got is not None and got.step == good, (d, got and got.step)
        assert same(got.params, want.params) and same(got.state, want.state), d
        assert same(got.per_rank, want.per_rank), d
    if comm.Get_rank() == 0:
        print(f"ok: {len(folders)} damaged folders resumed from step {good}")


if __name__ == "__main__":
    run_spmd(main)
