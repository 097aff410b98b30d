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
