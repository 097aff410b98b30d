"""MPI contract test of semzo.cluster.kmeans: 1, 2 and 4 ranks (4 also through the
hierarchical allreduce) give the same k-means|| centres, centres and labels within rounding."""

from __future__ import annotations

import numpy as np
from mpiutil import check, mpirun

SCRIPT = "tests/mpi/kmeans_contract.py"
CONFIGS = ("lloyd", "pruned", "spherical")


def test_kmeans_same_result_at_1_2_4_ranks(tmp_path):
    runs = [(1, "flat"), (2, "flat"), (4, "hier")]
    for n, mode in runs:
        check(mpirun(n, [SCRIPT, str(tmp_path), mode], timeout=150))
    ref = np.load(tmp_path / "kmeans_1.npz", allow_pickle=False)
    for name in ("kmeans_2.npz", "kmeans_4_hier.npz"):
        got = np.load(tmp_path / name, allow_pickle=False)
        for cfg in CONFIGS:
            for part in ("init", "centers"):
                a, b = got[f"{cfg}_{part}"], ref[f"{cfg}_{part}"]
                scale = float(np.abs(b).max())
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * scale,
                                           err_msg=f"{name} {cfg} {part}")
            agree = np.mean(got[f"{cfg}_labels"] == ref[f"{cfg}_labels"])
            assert agree >= 0.9999, f"{name} {cfg}: labels agree on {agree:.6f}"
            inertia, n_iter = got[f"{cfg}_scalars"]
            assert abs(inertia / ref[f"{cfg}_scalars"][0] - 1) < 1e-6, (name, cfg)
            assert n_iter == ref[f"{cfg}_scalars"][1], (name, cfg)
    # the three configurations are not trivially the same run
    assert not np.array_equal(ref["lloyd_centers"], ref["spherical_centers"])
