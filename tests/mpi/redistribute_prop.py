"""Property test of semzo.place.redistribute, all cases in one mpirun.

Rank 0 runs hypothesis; each case (seed, sizes, skew, cap, text or not, ...) is broadcast as
an int64 vector, every rank builds every rank's rows from the seed, redistributes its own and
checks that it received exactly the rows meant for it, in order (by source, then original
order), with intact columns and texts, that every id arrived exactly once globally, and that
the round buffers respected the cap. The verdict is MIN-reduced back to rank 0, which asserts
inside hypothesis (so a failure is shrunk and reported with its case).

usage: redistribute_prop.py MAX_EXAMPLES
"""

import sys
import traceback

import numpy as np
from mpi4py import MPI

from semzo.place.redistribute import redistribute
from semzo.runtime import run_spmd

ALPHABET = np.array(list("abcxyz \n\"\\é€𝄞中"))
NPARAM = 9


def rows_of(case, src, nranks):
    seed, n_max, skew, hot, _, with_text, _, empty, _ = case
    rng = np.random.default_rng([seed, src])
    n = 0 if src == empty else int(rng.integers(0, n_max + 1))
    dest = np.where(rng.random(n) < skew / 100.0, hot % nranks, rng.integers(0, nranks, n))
    texts = None
    if with_text:
        lens = rng.integers(0, 30, n)
        texts = ["".join(ALPHABET[rng.integers(0, ALPHABET.size, m)]) for m in lens]
    return n, dest.astype(np.int64), texts


def columns_for(ids, dim):
    emb = (ids[:, None] * 0.25 + np.arange(dim)[None, :]).astype(np.float32)
    return {"id": ids.astype(np.int64), "emb": emb, "label": (ids % 7).astype(np.int16),
            "odd": (ids % 2 == 1)}


def check_case(case, comm):
    rank, nranks = comm.Get_rank(), comm.Get_size()
    cap, with_text, dim = int(case[4]), bool(case[5]), int(case[6])
    all_rows = [rows_of(case, s, nranks) for s in range(nranks)]
    starts = np.cumsum([0] + [r[0] for r in all_rows])
    ids = np.arange(starts[rank], starts[rank + 1], dtype=np.int64)
    _, dest, texts = all_rows[rank]
    stats = {}
    try:
        got, got_text = redistribute(comm, dest, columns_for(ids, dim), text=texts,
                                     memory_cap_bytes=cap, stats=stats)
    except Exception:  # noqa: BLE001 - any failure must end the world at once
        # peers may be inside a collective: end the world now (hypothesis would otherwise
        # go on to the next case on rank 0 alone and hang)
        print(f"rank {rank} case {case.tolist()}:", file=sys.stderr, flush=True)
        traceback.print_exc()
        sys.stderr.flush()
        comm.Abort(1)
    problems = []
    try:
        exp_ids = np.concatenate([np.arange(starts[s], starts[s + 1])[all_rows[s][1] == rank]
                                  for s in range(nranks)]).astype(np.int64)
        exp = columns_for(exp_ids, dim)
        for name, a in exp.items():
            if got[name].dtype != a.dtype or not np.array_equal(got[name], a):
                problems.append(f"column {name} differs")
        if with_text:
            exp_text = [t for s in range(nranks) for t, d in zip(all_rows[s][2] or [],
                                                                  all_rows[s][1]) if d == rank]
            if got_text != exp_text:
                problems.append("texts differ")
        elif got_text is not None:
            problems.append("texts returned without texts sent")
    except Exception as exc:  # noqa: BLE001 - a check that crashes is a failed check
        problems.append(f"check raised {exc!r}")
    # every id exactly once, globally
    got_ids = got.get("id", np.empty(0, dtype=np.int64)).astype(np.int64)
    cnt = np.array([got_ids.size], dtype=np.int64)
    cnts = np.empty(nranks, dtype=np.int64)
    comm.Allgather([cnt, MPI.INT64_T], [cnts, MPI.INT64_T])
    every = np.empty(int(cnts.sum()), dtype=np.int64)
    displs = np.concatenate(([0], np.cumsum(cnts)[:-1]))
    comm.Allgatherv([got_ids, MPI.INT64_T], [every, (cnts, displs), MPI.INT64_T])
    if not np.array_equal(np.sort(every), np.arange(starts[-1])):
        problems.append("ids not received exactly once")
    # the cap: exact when rows fit in their shares; never more than one row per pair over it
    text_max = max([len(t.encode()) for r in all_rows for t in (r[2] or [])], default=0)
    row_max = 4 * dim + 8 + 2 + 1 + (8 + text_max if with_text else 0)
    bound = cap + 2 * nranks * row_max
    if stats["max_round_bytes"] > bound:
        problems.append(f"round used {stats['max_round_bytes']} bytes > {bound}")
    fixed = 4 * dim + 8 + 2 + 1 + (8 if with_text else 0)
    total = int(starts[-1]) * fixed + sum(len(t.encode()) for r in all_rows for t in (r[2] or []))
    if cap // 2 >= 2 * total + 2 and stats["rounds"] != (1 if starts[-1] else 0):
        problems.append(f"{stats['rounds']} rounds although the cap holds everything")
    if problems:
        print(f"rank {rank} case {case.tolist()}: {'; '.join(problems)}", file=sys.stderr,
              flush=True)
    ok = np.array([0 if problems else 1], dtype=np.int64)
    allok = np.empty_like(ok)
    comm.Allreduce([ok, MPI.INT64_T], [allok, MPI.INT64_T], op=MPI.MIN)
    return bool(allok[0]), stats["rounds"]


def main():
    comm = MPI.COMM_WORLD
    max_examples = int(sys.argv[1])
    buf = np.zeros(NPARAM, dtype=np.int64)
    if comm.Get_rank() != 0:
        while True:
            comm.Bcast([buf, MPI.INT64_T], root=0)
            if buf[-1] == -1:
                return 0
            check_case(buf.copy(), comm)

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    rounds_seen = []

    @settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(seed=st.integers(0, 2**31 - 1), n_max=st.integers(0, 300),
           skew=st.integers(0, 100), hot=st.integers(0, 7),
           cap=st.one_of(st.integers(1, 4096), st.integers(4096, 2**22)),
           with_text=st.booleans(), dim=st.integers(0, 6), empty=st.integers(-1, 7))
    def run_case(seed, n_max, skew, hot, cap, with_text, dim, empty):
        buf[:] = [seed, n_max, skew, hot, cap, with_text, dim, empty, 0]
        comm.Bcast([buf, MPI.INT64_T], root=0)
        ok, rounds = check_case(buf.copy(), comm)
        rounds_seen.append(rounds)
        assert ok, f"case failed: {buf.tolist()}"

    try:
        run_case()
    finally:
        buf[-1] = -1
        comm.Bcast([buf, MPI.INT64_T], root=0)
    # the cases must have exercised multi-round exchanges, not only single rounds
    assert max(rounds_seen) > 3, rounds_seen
    print(f"ok: {len(rounds_seen)} cases on {comm.Get_size()} ranks, "
          f"rounds up to {max(rounds_seen)}", flush=True)
    return 0


if __name__ == "__main__":
    run_spmd(main)
