"""The pipeline end to end (topology -> embed -> cluster -> place) on a small slice of the
fortunes corpus, at 1, 2 and 4 ranks: outputs exist, are complete, carry the deck, and do not
depend on the number of ranks beyond rounding."""

import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
from mpiutil import ROOT, check, mpirun

CORPUS = ROOT / "data" / "fortunes.jsonl"
N = 240
K = 8


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    if not CORPUS.is_file():  # made by `make test`; make it here when pytest runs alone
        CORPUS.parent.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "semzo", "corpus", "fortunes", str(CORPUS)],
                       check=True, cwd=ROOT)
    return CORPUS


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    out = {}
    for n in (1, 2, 4):
        d = tmp_path_factory.mktemp(f"run{n}")
        topo = ["--set", "topology.ranks_per_node=1",
                "--set", f"topology.nodes_per_switch={2 if n == 4 else 1}"]
        proc = check(mpirun(n, ["-m", "semzo", "run", "inputs/demo.toml",
                                "--set", f"run.output_dir={d}",
                                "--set", f"corpus.max_records={N}",
                                "--set", f"cluster.k={K}", *topo], timeout=300))
        out[n] = (d, proc)
    return out


def _read(path, *names):
    with h5py.File(path, "r") as f:
        return [f[n][...] for n in names] + [dict(f.attrs)]


def test_outputs_complete(runs):
    for n, (d, proc) in runs.items():
        for name in ("topology.h5", "embeddings.h5", "clusters.h5", "shards.h5", "shards.png"):
            assert (d / name).is_file(), (n, name)
        assert not list(d.glob("*.tmp")), "temporary files left behind"
        emb, ids, attrs = _read(d / "embeddings.h5", "embeddings", "ids")
        assert emb.shape == (N, 384) and ids.shape == (N,)
        assert np.allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
        assert "[cluster]" in attrs["semzo_deck"] and f"k = {K}" in attrs["semzo_deck"]
        assert "none lost, none duplicated" in proc.stderr


def test_embeddings_independent_of_ranks(runs):
    base, ids1, _ = _read(runs[1][0] / "embeddings.h5", "embeddings", "ids")
    for n in (2, 4):
        e, ids, _ = _read(runs[n][0] / "embeddings.h5", "embeddings", "ids")
        assert np.array_equal(ids, ids1)
        assert np.array_equal(e, base), (n, np.max(np.abs(e - base)))   # the same bits


def test_clusters_independent_of_ranks(runs):
    c1, l1, a1 = _read(runs[1][0] / "clusters.h5", "centers", "labels")
    for n in (2, 4):
        c, lab, a = _read(runs[n][0] / "clusters.h5", "centers", "labels")
        assert np.mean(lab == l1) >= 0.99, n
        assert np.max(np.abs(c - c1)) < 1e-3, n
        assert abs(a["inertia"] - a1["inertia"]) <= 1e-4 * abs(a1["inertia"])
        assert 0.0 <= a["nmi"] <= 1.0 and 0.0 < a["purity"] <= 1.0


def test_shards_every_sample_once_and_balanced(runs):
    for n, (d, _) in runs.items():
        ids, clusters, quota, offs, _attrs = _read(d / "shards.h5", "ids", "clusters", "quota",
                                                  "rank_offsets")
        e_ids, _ = _read(d / "embeddings.h5", "ids")
        assert np.array_equal(np.sort(ids), np.sort(e_ids))          # none lost or duplicated
        assert offs[-1] == N and len(offs) == n + 1
        loads = np.diff(offs)
        assert np.array_equal(loads, quota.sum(0))
        assert loads.max() <= np.ceil(1.05 * N / n) and loads.min() >= np.floor(0.95 * N / n)
        for r in range(n):                          # each rank holds what the plan says
            got = np.bincount(clusters[offs[r]:offs[r + 1]], minlength=quota.shape[0])
            assert np.array_equal(got, quota[:, r])
        # the text travelled with its row
        with h5py.File(d / "shards.h5") as f, h5py.File(d / "embeddings.h5") as g:
            so, sb = f["text_offsets"][...], f["text_bytes"][...]
            eo, eb = g["text_offsets"][...], g["text_bytes"][...]
            pos = {int(i): j for j, i in enumerate(g["ids"][...])}
            for j in (0, N // 2, N - 1):
                i = pos[int(ids[j])]
                assert bytes(sb[so[j]:so[j + 1]]) == bytes(eb[eo[i]:eo[i + 1]])


def test_unwritable_output_dir_is_clean_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "blocker").write_text("x")
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set",
                      f"run.output_dir={ro / 'blocker' / 'out'}",
                      "--set", "run.stages=[\"topology\"]", "--set", "topology.ranks_per_node=1",
                      "--set", "topology.nodes_per_switch=1"], timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "run.output_dir: cannot write" in proc.stderr


@pytest.mark.parametrize("where", ["write", "read"])
@pytest.mark.parametrize("nranks", [2, 4])
def test_error_on_one_rank_inside_a_collective_file_ends_the_job(tmp_path, where, nranks):
    """One rank raises inside ``create_collective`` / ``open_collective`` while the others
    are in a collective write or read of the same file (a full disk on one rank, a bug):
    the job ends within seconds with that rank's error and exit 1. Closing the file there
    (collective) used to hang every rank until the wall-clock limit, with no message."""
    t0 = time.perf_counter()
    proc = mpirun(nranks, ["tests/mpi/h5_one_rank_fails.py", str(tmp_path), where],
                  timeout=90)
    took = time.perf_counter() - t0
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert took < 60, took
    assert f"injected on rank {nranks - 1}" in proc.stderr
    assert not (tmp_path / "x.h5").exists() or where == "read"


def test_output_file_that_cannot_be_created_is_one_line(tmp_path):
    """An output whose temporary name cannot be created (here a folder holds it): one line
    from rank 0 naming the file, exit 2 (was one raw HDF5 traceback per rank)."""
    proc = mpirun(2, ["tests/mpi/h5_one_rank_fails.py", str(tmp_path), "create"], timeout=90)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and f"{tmp_path / 'x.h5.tmp'}: cannot create it" in errors[0], errors
    assert "Traceback" not in proc.stderr
