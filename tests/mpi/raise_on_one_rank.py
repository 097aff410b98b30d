"""MPI test: rank BAD raises while every other rank waits in a collective; the world must end
promptly with that rank's message. usage: raise_on_one_rank.py BAD"""

import sys
import time

from mpi4py import MPI

from semzo.runtime import run_spmd


def main():
    bad = int(sys.argv[1])
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.Get_rank() == bad:
        time.sleep(0.2)
        raise ValueError(f"injected failure on rank {bad}")
    comm.Barrier()          # the others block here forever unless the world is aborted
    time.sleep(60)


if __name__ == "__main__":
    run_spmd(main)
