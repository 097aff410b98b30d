"""Shuffle placement under MPI.

usage: place_shuffle.py map
    Every rank checks, for several initial layouts of the same ids (contiguous blocks, a
    random uneven split with an empty rank, everything on the last rank), seeds and gather
    limits (0 forces bucket refinement to the end): the id -> destination map equals the one
    computed serially (MPI.COMM_SELF) for this P and the one of a full sort of (key, id);
    every rank gets N//P or N//P + 1 samples; a different seed gives a different map; ties
    of the keys are broken by id; non-integer ids on one rank make every rank raise.

usage: place_shuffle.py stage OUTDIR MODE
    Writes a small synthetic embeddings.h5 / clusters.h5 in OUTDIR, runs the place stage with
    ``place.mode = MODE`` through semzo.pipeline.run, and checks shards.h5 (every id once,
    rank loads, and for shuffle: the rows sit on the ranks the serial map says, the moved
    fraction is the actual one). Prints the stage's figures.
"""

import sys

import numpy as np
from mpi4py import MPI

from semzo.place.shuffle import destinations_from_keys, shuffle_destinations, shuffle_keys
from semzo.runtime import run_spmd

N = 5003


def reference(keys, ids, n_ranks):
    order = np.lexsort((ids, keys))
    ref = np.empty(ids.size, np.int64)
    ref[order] = np.arange(ids.size) * n_ranks // max(ids.size, 1)
    return ref


def layouts(n, size, rng):
    """Lists of index arrays (one per rank) splitting range(n) three ways."""
    bounds = np.linspace(0, n, size + 1).astype(int)
    contiguous = [np.arange(bounds[r], bounds[r + 1]) for r in range(size)]
    perm = rng.permutation(n)
    cuts = np.sort(rng.integers(0, n, size - 1)) if size > 1 else np.zeros(0, int)
    uneven = np.split(perm, cuts)
    if size > 1:                                   # rank 0 empty, its share to rank 1
        uneven[1] = np.concatenate((uneven[0], uneven[1]))
        uneven[0] = perm[:0]
    last = [perm[:0]] * (size - 1) + [perm]
    return {"contiguous": contiguous, "uneven": uneven, "last": last}


def gather_map(ids, dest, comm):
    all_ids = np.concatenate(comm.allgather(ids))
    all_dest = np.concatenate(comm.allgather(dest))
    order = np.argsort(all_ids)
    return all_ids[order], all_dest[order]


def check_map():
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(5)
    ids = np.unique(rng.integers(-2**62, 2**62, N + 50))[:N]     # sparse, negative too
    ids = rng.permutation(ids)
    sorted_ids = np.sort(ids)
    for seed in (0, 12345):
        serial = shuffle_destinations(ids, size, seed, MPI.COMM_SELF)
        assert np.array_equal(serial, reference(shuffle_keys(ids, seed), ids, size))
        want = serial[np.argsort(ids)]                       # by sorted id
        counts = np.bincount(serial, minlength=size)
        assert counts.sum() == N and set(counts.tolist()) <= {N // size, N // size + 1}
        for name, parts in layouts(N, size, np.random.default_rng(seed)).items():
            for limit in (0, 7, 1 << 16):
                mine = ids[parts[rank]]
                dest = shuffle_destinations(mine, size, seed, comm, gather_limit=limit)
                assert dest.dtype == np.int64 and dest.shape == mine.shape
                got_ids, got = gather_map(mine, dest, comm)
                assert np.array_equal(got_ids, sorted_ids), "ids lost or duplicated"
                assert np.array_equal(got, want), (seed, name, limit)
                load = comm.allreduce(np.bincount(dest, minlength=size))
                assert np.array_equal(load, counts), (load, counts)
    if size > 1:
        other = shuffle_destinations(ids, size, 1, MPI.COMM_SELF)
        same = np.mean(other == shuffle_destinations(ids, size, 0, MPI.COMM_SELF))
        assert same < 1.0 / size + 0.1, same

    # ties: coarse keys (3 distinct values), ordered by id inside each
    parts = layouts(N, size, np.random.default_rng(9))["uneven"]
    keys = (ids.astype(np.uint64) % np.uint64(3)) << np.uint64(62)
    want = reference(keys, ids, size)[np.argsort(ids)]
    mine = parts[rank]
    dest = destinations_from_keys(keys[mine], ids[mine], size, comm, gather_limit=5)
    assert np.array_equal(gather_map(ids[mine], dest, comm)[1], want)

    # float ids on the last rank: every rank raises after the first collective
    bad = ids[parts[rank]].astype(np.float64) if rank == size - 1 else ids[parts[rank]]
    try:
        shuffle_destinations(bad, size, 0, comm)
        raised = 0
    except ValueError as exc:
        assert "integer" in str(exc)
        raised = 1
    assert comm.allreduce(raised) == size
    if rank == 0:
        print(f"ok: shuffle map on {size} ranks", flush=True)


def check_stage(outdir, mode):
    import os

    import h5py

    from semzo import deck as deckmod
    from semzo.embed.stage import write_embeddings
    from semzo.h5io import create_collective, row_range, write_rows
    from semzo.pipeline import run

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n, k, d = 600, 6, 8
    rng = np.random.default_rng(1)                       # same corpus on every rank
    cent = rng.normal(size=(k, d)).astype(np.float32) * 4
    lab = np.sort(rng.integers(0, k, n))                  # file order = cluster order
    emb = (cent[lab] + rng.normal(size=(n, d))).astype(np.float32)
    ids = 1000 + 3 * np.arange(n, dtype=np.int64)
    lo, hi = row_range(n, comm)
    first_holder = np.repeat(np.arange(size), [b - a for a, b in comm.allgather((lo, hi))])
    texts = [f"text {i} é" for i in ids[lo:hi]]
    nps = 2 if size % 2 == 0 else 1
    overrides = [f"run.output_dir={outdir}", 'run.stages=["place"]', f'place.mode="{mode}"',
                 "run.seed=3", "run.threads=1", "topology.ranks_per_node=1",
                 f"topology.nodes_per_switch={nps}", "place.memory_cap_mb=0.01"]
    deck = deckmod.load(None, overrides, check_inputs=False)
    if rank == 0:
        os.makedirs(outdir, exist_ok=True)
    comm.Barrier()
    write_embeddings(f"{outdir}/embeddings.h5", comm, deck.to_toml(), emb[lo:hi], ids[lo:hi],
                     lab[lo:hi] % 2, texts, lo, n, ["even", "odd"])
    with create_collective(f"{outdir}/clusters.h5", comm, deck.to_toml()) as f:
        f.create_dataset("centers", data=cent)
        write_rows(f, "labels", lab[lo:hi].astype(np.int32), lo, n)
    run(deck, comm)
    if rank == 0:
        with h5py.File(f"{outdir}/shards.h5", "r") as f:
            got_ids, offs = f["ids"][...], f["rank_offsets"][...]
            clusters, quota = f["clusters"][...], f["quota"][...]
            so, sb = f["text_offsets"][...], f["text_bytes"][...]
            attrs = dict(f.attrs)
        assert np.array_equal(np.sort(got_ids), ids), "ids lost or duplicated"
        for j in (0, n // 2, n - 1):                       # the text travelled with its row
            assert bytes(sb[so[j]:so[j + 1]]).decode() == f"text {got_ids[j]} é"
        loads = np.diff(offs)
        assert np.array_equal(loads, quota.sum(0))
        for r in range(size):
            assert np.array_equal(np.bincount(clusters[offs[r]:offs[r + 1]], minlength=k),
                                  quota[:, r])
        assert attrs["mode"] == mode
        if mode == "shuffle":
            assert set(loads.tolist()) <= {n // size, n // size + 1}, loads
            serial = shuffle_destinations(ids, size, 3, MPI.COMM_SELF)
            holder = np.repeat(np.arange(size), loads)
            assert np.array_equal(holder, serial[(got_ids - 1000) // 3]), \
                "rows not on their hashed rank"
            moved = np.mean(serial != first_holder)
            assert abs(attrs["fig_moved_fraction"] - moved) < 1e-12, (attrs, moved)
            sw = np.arange(size) // nps
            cross = int((sw[serial] != sw[first_holder]).sum())
            assert attrs["fig_rows_cross_switch"] == cross, (attrs, cross)
        print(f"ok: place stage {mode} on {size} ranks: moved {attrs['fig_moved_fraction']:.3f}"
              f", load max/mean {attrs['fig_load_max_over_mean']:.3f}, centroid dist "
              f"{attrs['fig_centroid_dist']:.3f} (random "
              f"{attrs.get('fig_random_centroid_dist', attrs['fig_centroid_dist']):.3f})"
              f", rows across switches {attrs['fig_rows_cross_switch']}", flush=True)


def main():
    if sys.argv[1] == "map":
        check_map()
    else:
        check_stage(sys.argv[2], sys.argv[3])
    return 0


if __name__ == "__main__":
    run_spmd(main)
