"""Issue 12: every array semzo reads back from its HDF5 files is checked where it is read,
before any kernel or index sees it. A damaged embeddings.h5, clusters.h5 or shards.h5 (label
out of range, negative cluster id, negative sample id, offsets out of range or decreasing,
wrong row counts) stops the stage that reads it with exit 2 and one line naming the file and
the dataset: never a segfault, a traceback or a hang. One run per entry point and damage.
"""

from __future__ import annotations

import itertools
import shutil

import h5py
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mpiutil import check, mpirun

from semzo.h5check import offsets_error, range_error

N, K = 96, 4
TOPO = ["--set", "topology.ranks_per_node=1", "--set", "topology.nodes_per_switch=1"]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A real topology -> embed -> cluster -> place run at 2 ranks (labelled corpus)."""
    d = tmp_path_factory.mktemp("good")
    check(mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={d}",
                     "--set", f"corpus.max_records={N}", "--set", f"cluster.k={K}",
                     "--set", 'run.stages=["topology", "embed", "cluster", "place"]', *TOPO],
                 timeout=300))
    return d


def _set(path, name, index, value):
    with h5py.File(path, "r+") as f:
        if name.startswith("@"):
            f.attrs[name[1:]] = value
        else:
            a = f[name][...]
            a[index] = value
            f[name][...] = a


def _labels_names(path):
    with h5py.File(path, "r") as f:
        return len(f.attrs["label_names"])


# (stage to run, file, dataset or @attribute, row, value (callable of the file: n_names),
#  text the error line must hold)
CASES = {
    "cluster: corpus label out of range": (
        "cluster", "embeddings.h5", "labels", 5, lambda n: n,
        "embeddings.h5: dataset labels: row 5 holds {v}, outside [-1, {n})"),
    "cluster: wrong n_total": (
        "cluster", "embeddings.h5", "@n_total", None, lambda n: N + 7,
        "embeddings.h5: dataset embeddings: shape"),
    "place: negative cluster id": (
        "place", "clusters.h5", "labels", 7, lambda n: -3,
        "clusters.h5: dataset labels: row 7 holds -3, outside [0, 4)"),
    "place: cluster id = k on the last rank": (
        "place", "clusters.h5", "labels", N - 1, lambda n: K,
        f"clusters.h5: dataset labels: row {N - 1} holds {K}, outside [0, {K})"),
    "place: negative sample id": (
        "place", "embeddings.h5", "ids", 3, lambda n: -1,
        "embeddings.h5: dataset ids: row 3 holds -1, below 0"),
    "place: text offset out of range": (
        "place", "embeddings.h5", "text_offsets", 60, lambda n: 10**12,
        "embeddings.h5: dataset text_offsets: row 60 holds 1000000000000, outside"),
    "finetune: class label out of range": (
        "finetune", "shards.h5", "labels", 0, lambda n: n + 5,
        "shards.h5: dataset labels: row 0 holds {v}, outside [-1, {n})"),
    "finetune: rank offsets out of range": (
        "finetune", "shards.h5", "rank_offsets", 1, lambda n: 10 * N,
        f"shards.h5: dataset rank_offsets: row 1 holds {10 * N}, outside [0, {N + 1})"),
    "place: text offsets decreasing": (
        "place", "embeddings.h5", "text_offsets", 20, lambda n: 0,
        "embeddings.h5: dataset text_offsets: row 20 holds 0, below the previous row's"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_file_is_one_clean_error(good, tmp_path, case):
    stage, fname, dset, row, value, want = CASES[case]
    d = tmp_path / "run"
    shutil.copytree(good, d)
    n_names = _labels_names(d / "embeddings.h5")
    v = value(n_names)
    _set(d / fname, dset, row, v)
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={d}",
                      "--set", f"run.stages=[\"{stage}\"]", "--set", f"cluster.k={K}", *TOPO],
                  timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert str(d / fname) in errors[0], errors
    assert want.format(v=v, n=n_names) in errors[0], errors
    assert "Traceback" not in proc.stderr and "Segmentation" not in proc.stderr


@pytest.mark.parametrize("dset,dtype,value,want", [
    ("ids", np.float64, 3.5, "shards.h5: dataset ids: expected integers, got float64"),
    ("labels", np.float32, 1.0, "shards.h5: dataset labels: expected integers, got float32"),
    ("ids", np.uint64, 2**63 + 5, f"shards.h5: dataset ids: row 4 holds {2**63 + 5}, outside"),
])
def test_shards_ids_and_labels_are_checked_as_stored(good, tmp_path, dset, dtype, value, want):
    """shards.h5 ids or labels stored as floats (3.5, or even 1.0) are refused, not truncated
    to integers; uint64 ids beyond int64 are refused, not wrapped to negative ones."""
    d = tmp_path / "run"
    shutil.copytree(good, d)
    with h5py.File(d / "shards.h5", "r+") as f:
        a = f[dset][...].astype(dtype)
        a[4] = value
        del f[dset]
        f[dset] = a
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={d}",
                      "--set", 'run.stages=["finetune"]', "--set", f"cluster.k={K}", *TOPO],
                  timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1 and str(d / "shards.h5") in errors[0], proc.stderr[-3000:]
    assert want in errors[0], errors
    assert "Traceback" not in proc.stderr
    assert not (d / "metrics.csv").exists() and not (d / "model.h5").exists()


@given(st.lists(st.integers(-5, 20), max_size=30), st.integers(-3, 3), st.integers(0, 20))
def test_range_error_finds_the_first_bad_row(values, lo, width):
    a = np.array(values, dtype=np.int64)
    hi = lo + width
    err = range_error("f.h5", "x", a, lo, hi, row0=100)
    bad = [i for i, v in enumerate(values) if not lo <= v < hi]
    if not bad:
        assert err is None
    else:
        assert err.startswith(f"f.h5: dataset x: row {100 + bad[0]} holds {values[bad[0]]}, ")
        assert "\n" not in err


@given(st.lists(st.integers(-2, 12), min_size=1, max_size=20), st.integers(0, 12))
def test_offsets_error_accepts_exactly_sorted_offsets_in_range(offs, hi):
    a = np.array(offs, dtype=np.int64)
    ok = all(0 <= v <= hi for v in offs) and all(x <= y for x, y in itertools.pairwise(offs))
    assert (offsets_error("f.h5", "o", a, 0, hi) is None) == ok
    assert offsets_error("f.h5", "o", a.astype(np.float64), 0, hi) is not None


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _uint64_ids(path):
    with h5py.File(path, "r+") as f:
        a = f["ids"][...].astype(np.uint64)
        a[4] = 2**63 + 5
        del f["ids"]
        f["ids"] = a


def _folder(path):
    path.unlink()
    path.mkdir()


# (stage, file damaged, how, extra --set overrides, text of the one error line)
FILE_CASES = {
    "cluster: embeddings.h5 missing": (
        "cluster", "embeddings.h5", lambda p: p.unlink(), [],
        "embeddings.h5: not found (run the embed stage first)"),
    "cluster: embeddings.h5 is a folder": (
        "cluster", "embeddings.h5", _folder, [], "embeddings.h5: not a regular file"),
    "place: clusters.h5 truncated": (
        "place", "clusters.h5", _truncate, [], "clusters.h5: HDF5 cannot open it"),
    "place: clusters.h5 not HDF5": (
        "place", "clusters.h5", lambda p: p.write_bytes(b"x" * 700), [],
        "clusters.h5: not an HDF5 file"),
    "cluster: a uint64 sample id beyond int64": (
        "cluster", "embeddings.h5", _uint64_ids, [],
        ("embeddings.h5: dataset ids: row 4 holds 9223372036854775813, outside [0, "
        "9223372036854775808)")),
    "cluster: an embedding is NaN": (
        "cluster", "embeddings.h5", lambda p: _set(p, "embeddings", (3, 3), np.nan), [],
        "embeddings.h5: dataset embeddings: row 3 is not finite"),
    "place: clusters.h5 made from another embeddings.h5": (
        "place", "embeddings.h5", lambda p: _set(p, "@semzo_file_id", None, "0" * 32), [],
        "clusters.h5 was made from another embeddings.h5 than the one beside it"),
    "place: cluster.k changed since the cluster stage": (
        "place", "clusters.h5", lambda p: None, ["--set", f"cluster.k={K + 1}"],
        (f"cluster.k = {K + 1}, but {{d}}/clusters.h5 was made with cluster.k = {K}: rerun the "
        "cluster stage")),
    "finetune: place.rank_weights changed since the place stage": (
        "finetune", "shards.h5", lambda p: None, ["--set", "place.rank_weights=[1, 2]"],
        ("place.rank_weights = [1.0, 2.0], but {d}/shards.h5 was made with "
         "place.rank_weights = 'equal': rerun the place stage")),
    "finetune: a stored rank weight is not positive": (
        "finetune", "shards.h5", lambda p: _set(p, "rank_weights", 1, -1.0), [],
        "shards.h5: dataset rank_weights: [1.0, -1.0], expected 2 positive numbers"),
    "finetune: a shard embedding is not finite": (
        "finetune", "shards.h5", lambda p: _set(p, "embeddings", (5, 0), np.inf), [],
        "shards.h5: dataset embeddings: row 5 is not finite"),
    "cluster: corpus.max_records changed since the embed stage": (
        "cluster", "embeddings.h5", lambda p: None, ["--set", f"corpus.max_records={N // 2}"],
        (f"corpus.max_records = {N // 2}, but {{d}}/embeddings.h5 was made with "
        f"corpus.max_records = {N}: rerun the embed stage")),
}


@pytest.mark.parametrize("case", list(FILE_CASES))
def test_missing_damaged_or_stale_input_file_is_one_clean_error(good, tmp_path, case):
    """A stage input that is missing, not a file, not HDF5 or truncated, holds a NaN
    embedding, was made from another upstream file, or was made with other values of the
    keys of the stage that wrote it (a stage rerun alone after a deck change): exit 2, one
    line naming the file (and the key), no traceback, and the stage's output not written."""
    stage, fname, damage, extra, want = FILE_CASES[case]
    d = tmp_path / "run"
    shutil.copytree(good, d)
    out = d / {"cluster": "clusters.h5", "place": "shards.h5", "finetune": "model.h5"}[stage]
    out.unlink(missing_ok=True)
    damage(d / fname)
    proc = mpirun(2, ["-m", "semzo", "run", "inputs/demo.toml", "--set", f"run.output_dir={d}",
                      "--set", f"run.stages=[\"{stage}\"]", "--set", f"cluster.k={K}",
                      "--set", f"corpus.max_records={N}", *TOPO, *extra], timeout=180)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert len(errors) == 1, proc.stderr[-3000:]
    assert want.format(d=d) in errors[0], errors
    assert "Traceback" not in proc.stderr and "Segmentation" not in proc.stderr
    assert not out.exists() and not out.with_name(out.name + ".tmp").exists()
