"""Checkpoint round trip under MPI, at the same or another world size.

usage: ckpt_roundtrip.py write DIR STEPS [async|TRANSFER]   save steps 1..STEPS (keep = 2)
                                                 (TRANSFER: independent, individual, collective)
       ckpt_roundtrip.py read DIR STEP P_SAVED      load STEP, check everything

``write`` checks: only the last two files remain, ``latest`` names the last, every rank
returns the same paths; with ``async`` the caller's arrays are modified right after each
save returns and the files must still hold the values at save time. ``read`` checks, on
every rank: parameters bit for bit (names in order, dtypes, shapes), the ZO state with its
types and nesting, metrics, extras; at the saved world size the per-rank rows exactly; at
another one the cursor rule (samples seen kept) and the dropped entries.
"""

import errno
import os
import sys
from pathlib import Path

import numpy as np
from ckpt_common import BLOCK_KIB, extras, metrics, params, per_rank, same, state
from mpi4py import MPI

from semzo.checkpoint import (
    Checkpointer,
    filesum,
    find_resumable,
    list_checkpoints,
    load,
    read_latest,
    remap_cursors,
    verify,
)
from semzo.deck import CheckpointSection
from semzo.runtime import run_spmd


def write(comm, d: Path, steps: int, how: str) -> None:
    rank = comm.Get_rank()
    use_async = how == "async"
    if use_async:       # exercise the background writer even where no core is free
        os.environ.setdefault("SEMZO_CHECKPOINT_ASYNC", "always")
    cfg = CheckpointSection(dir=str(d), keep=2, block_kib=BLOCK_KIB, async_save=use_async,
                            every_steps=1, transfer="independent" if use_async else how)
    with Checkpointer(comm, cfg, deck_toml="# test deck\n") as ck:
        for step in range(1, steps + 1):
            p = params(step)
            path = ck.maybe_save(step, p, state(step), per_rank(step, rank), extras(step),
                                 metrics(step))
            assert path is not None and path.name == f"ckpt-{step:09d}.h5"
            assert comm.allgather(str(path)) == [str(path)] * comm.Get_size()
            if use_async:          # the snapshot must not see these changes
                for a in p.values():
                    a += 1
            assert ck.save(step, p) == path           # same step again: a no-op
        ck.wait()
        assert len(ck.history) == steps
    names = [p.name for _, p in list_checkpoints(d)]
    assert names == [f"ckpt-{s:09d}.h5" for s in range(max(1, steps - 1), steps + 1)], names
    assert read_latest(d) == names[-1]
    assert not list(d.glob("*.tmp"))
    assert find_resumable(d, comm) == d / names[-1]
    for s in range(max(1, steps - 1), steps + 1):
        L = load(d / f"ckpt-{s:09d}.h5", comm)
        assert same(L.params, params(s)), f"step {s}: parameters differ"
    if rank == 0:
        print(f"ok: wrote {steps} checkpoints on {comm.Get_size()} ranks, {how}")


def read(comm, d: Path, step: int, p_saved: int) -> None:
    size, rank = comm.Get_size(), comm.Get_rank()
    path = d / f"ckpt-{step:09d}.h5"
    assert verify(path, comm) == (True, "")
    L = load(path, comm)
    want = params(step)
    assert list(L.params) == list(want), "parameter order differs"
    for k, v in want.items():
        assert same(L.params[k], v), f"{k}: differs"
    assert same(L.state, state(step)), (L.state, state(step))
    assert same(L.extras, extras(step))
    assert L.metrics == metrics(step)
    assert L.step == step and L.world_size_saved == p_saved
    assert L.deck_toml == "# test deck\n"
    tables = {k: np.stack([np.asarray(per_rank(step, r)[k]) for r in range(p_saved)])
              for k in per_rank(step, 0)}
    assert same(L.per_rank_tables, tables)
    for kw in ({"distribute": "allgather"}, {"distribute": "read"},   # (auto: read, 1 node)
               {"transfer": "collective"}, {"transfer": "individual"}):
        L2 = load(path, comm, **kw)
        assert same(L2.params, want) and same(L2.state, L.state), kw
    # the node buffer in /dev/shm whatever the size, the file's pages evicted first (the
    # O_DIRECT reads); then one rank's write into /dev/shm fails (full): all fall back
    filesum.SHARED_MIN_BYTES = 0
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    comm.Barrier()
    assert same(load(path, comm, distribute="read").params, want)
    real = os.pwrite

    def full(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    if rank == size - 1:
        os.pwrite = full
    try:
        assert same(load(path, comm, distribute="read").params, want)
    finally:
        os.pwrite = real
    pid0 = comm.bcast(os.getpid(), root=0)       # the node buffer's creator (one node)
    assert not list(Path(filesum.SHM_DIR).glob(f"semzo-ckpt-{pid0}-*"))
    if size == p_saved:
        assert not L.resharded and not L.dropped
        assert same(L.per_rank, {k: np.asarray(v) for k, v in per_rank(step, rank).items()})
    else:
        assert L.resharded and L.dropped == ["shard_size", "rng_counter"], L.dropped
        old = tables["cursor"]
        n_old = tables["shard_size"]
        new = remap_cursors(old, size, sizes_old=n_old)
        assert np.array_equal(L.per_rank["cursor"], new[rank])
        # the rule keeps the samples seen: sum(epoch * m + position) is unchanged
        n = int(n_old.sum())
        m = np.array([n * (q + 1) // size - n * q // size for q in range(size)])
        rows = np.array(comm.allgather(L.per_rank["cursor"]))
        seen_new = int((rows[:, 0] * m + rows[:, 1]).sum())
        assert seen_new == int((old[:, 0] * n_old + old[:, 1]).sum()), (rows, old)
        assert (rows[:, 1] < m).all()
        # with this rank's new shard size given, shard_size comes back too
        L2 = load(path, comm, shard_size=int(m[rank]))
        assert int(L2.per_rank["shard_size"]) == m[rank]
        assert np.array_equal(L2.per_rank["cursor"], new[rank])
    if rank == 0:
        print(f"ok: read step {step} saved at {p_saved} ranks on {size} ranks")


def main():
    comm = MPI.COMM_WORLD
    mode, d = sys.argv[1], Path(sys.argv[2])
    if mode == "write":
        write(comm, d, int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "independent")
    else:
        read(comm, d, int(sys.argv[3]), int(sys.argv[4]))


if __name__ == "__main__":
    run_spmd(main)
