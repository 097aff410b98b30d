"""Whether two checkpoints hold the same training state, bit for bit.

usage: ckpt_same.py A.h5 B.h5     (one process; prints "same: STEP" or exits 1 naming the part)

Compared: step, saved world size, parameters (names in order, dtypes, shapes, bytes), the ZO
state with its types and nesting, the per-rank tables, extras and metrics. Not compared: root
attributes that name the run rather than its state (creation time, output paths, the stored
deck and the topology's host names).
"""

import sys

from ckpt_common import same
from mpi4py import MPI

from semzo.checkpoint import load


def main(a: str, b: str) -> int:
    la, lb = load(a, MPI.COMM_SELF), load(b, MPI.COMM_SELF)
    parts = {"step": (la.step, lb.step),
             "world_size_saved": (la.world_size_saved, lb.world_size_saved),
             "params": (la.params, lb.params), "state": (la.state, lb.state),
             "per_rank_tables": (la.per_rank_tables, lb.per_rank_tables),
             "extras": (la.extras, lb.extras), "metrics": (la.metrics, lb.metrics)}
    bad = [k for k, (x, y) in parts.items() if not same(x, y)]
    if bad:
        print(f"differ: {', '.join(bad)}")
        return 1
    print(f"same: step {la.step}, {len(la.params)} tensors")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
