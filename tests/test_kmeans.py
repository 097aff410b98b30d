"""Single-process tests of semzo.cluster (k-means): kernels, scikit-learn agreement, empty-cluster
repair, spherical variant, pruned == plain, k-means|| determinism, one allreduce per iteration.
The 1/2/4-rank contract is in test_kmeans_mpi.py."""

from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from sklearn.cluster import KMeans
from threadpoolctl import threadpool_limits

from semzo.cluster import hash_uniform, kmeans, predict
from semzo.cluster import kernels as kn
from semzo.cluster.init import weighted_kmeanspp

COMM = MPI.COMM_SELF


@pytest.fixture(autouse=True)
def _one_thread():
    # 2 shared cores: BLAS threads that spin while others work make timings and tests crawl
    with threadpool_limits(1):
        yield


def planted(n, d, k, spread, seed, scale=3.0):
    """Rows around k random centres (float32) and the true centres."""
    rng = np.random.default_rng(seed)
    c = rng.normal(size=(k, d)) * scale
    lab = rng.integers(0, k, n)
    sizes = rng.uniform(0.5, 1.5, k) * spread
    x = c[lab] + rng.normal(size=(n, d)) * sizes[lab, None]
    return x.astype(np.float32), c


def sk_fit(x, init, max_iter, tol):
    with threadpool_limits(1):
        return KMeans(init.shape[0], init=init, n_init=1, max_iter=max_iter, tol=tol,
                      algorithm="lloyd").fit(x)


def agree(res, sk, labels_min=0.999, inertia_rtol=1e-4):
    frac = float(np.mean(res.labels == sk.labels_))
    rel = abs(res.inertia / sk.inertia_ - 1.0)
    assert frac >= labels_min, f"labels agree on {frac:.5f}"
    assert rel <= inertia_rtol, f"inertia {res.inertia} vs {sk.inertia_} (rel {rel:.2e})"


# --------------------------------------------------------------------------------- kernels

def test_hash_uniform_is_a_function_of_seed_round_index():
    g = np.arange(100_000, dtype=np.int64)
    u = hash_uniform(7, 3, g)
    assert u.dtype == np.float64 and u.min() > 0.0 and u.max() < 1.0
    np.testing.assert_array_equal(u[12345:23456], hash_uniform(7, 3, g[12345:23456]))
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.mean(u < 0.1) - 0.1) < 0.005
    assert not np.array_equal(u, hash_uniform(7, 4, g))
    assert not np.array_equal(u, hash_uniform(8, 3, g))
    assert np.corrcoef(u[:-1], u[1:])[0, 1] < 0.02


def test_assign_block_matches_numpy():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 20)).astype(np.float32)
    c = rng.normal(size=(7, 20)).astype(np.float32)
    c_sq = (c.astype(np.float64) ** 2).sum(1).astype(np.float32)
    dots = x @ c.T
    dT = np.ascontiguousarray(dots.T)
    best, bj = np.empty(300, np.float32), np.empty(300, np.int32)
    labels = np.full(300, -1, np.int32)
    sums = np.zeros((7, 20))
    counts = np.zeros(7)
    x_sq = (x.astype(np.float64) ** 2).sum(1)
    changed, inertia = kn.assign_block(dT, c_sq, x, x_sq, labels, sums, counts, True, best,
                                         bj)
    ref = np.argmin(c_sq[None, :] - np.float32(2) * dots, axis=1)
    np.testing.assert_array_equal(labels, ref)
    assert changed == 300
    np.testing.assert_allclose(counts, np.bincount(ref, minlength=7))
    ref_sums = np.zeros((7, 20))
    np.add.at(ref_sums, ref, x.astype(np.float64))
    np.testing.assert_allclose(sums, ref_sums, rtol=1e-12, atol=1e-12)
    exact = ((x.astype(np.float64) - c[ref]) ** 2).sum()
    assert abs(inertia / exact - 1) < 1e-4
    # second pass with the same centres: nothing changes
    changed, _ = kn.assign_block(dT, c_sq, x, x_sq, labels, sums, counts, False, best, bj)
    assert changed == 0


def test_weighted_kmeanspp_follows_weights():
    rng = np.random.default_rng(2)
    pts = np.concatenate([rng.normal(size=(50, 4)), rng.normal(size=(50, 4)) + 100.0])
    w = np.r_[np.ones(50), np.zeros(50)]
    w[7] = 0.0
    c = weighted_kmeanspp(pts, w, 3, np.random.default_rng(0))
    # zero-weight points are never chosen
    assert all(np.linalg.norm(c - pts[i], axis=1).min() > 0 for i in range(50, 100))
    assert not np.any(np.all(c == pts[7].astype(np.float32), axis=1))


# ------------------------------------------------------------------ agreement with sklearn

@pytest.mark.parametrize("n,d,k,spread,seed", [
    (6000, 16, 12, 1.0, 0),      # separated clusters
    (8000, 32, 24, 2.5, 1),      # overlapping clusters
    (5000, 64, 40, 4.0, 2),      # heavily overlapping, k > planted structure
    (3000, 8, 5, 0.8, 3),
])
def test_agrees_with_sklearn_on_planted_data(n, d, k, spread, seed):
    x, _ = planted(n, d, max(2, k // 2) if seed == 2 else k, spread, seed)
    init = kmeans(x, k, COMM, global_offset=0, max_iter=1, seed=seed).centers
    res = kmeans(x, k, COMM, global_offset=0, init=init, max_iter=300, tol=1e-4)
    sk = sk_fit(x, init, 300, 1e-4)
    agree(res, sk)
    assert res.n_iter == sk.n_iter_
    np.testing.assert_allclose(res.centers, sk.cluster_centers_, rtol=0, atol=1e-3 * np.abs(x).max())
    np.testing.assert_array_equal(res.counts, np.bincount(res.labels, minlength=k))
    assert res.labels.dtype == np.int32 and res.centers.dtype == np.float32


def test_agrees_with_sklearn_fixed_iterations_tol0():
    x, _ = planted(6000, 24, 16, 3.0, 5)
    init = kmeans(x, 16, COMM, global_offset=0, max_iter=1, seed=5).centers
    res = kmeans(x, 16, COMM, global_offset=0, init=init, max_iter=15, tol=0.0)
    sk = sk_fit(x, init, 15, 0.0)
    agree(res, sk)
    assert res.n_iter == sk.n_iter_


def test_agrees_with_sklearn_on_digits():
    from sklearn.datasets import load_digits
    x = load_digits().data.astype(np.float32)
    for seed in (0, 1):
        init = kmeans(x, 10, COMM, global_offset=0, max_iter=1, seed=seed).centers
        res = kmeans(x, 10, COMM, global_offset=0, init=init, max_iter=300, tol=1e-4)
        sk = sk_fit(x, init, 300, 1e-4)
        agree(res, sk)


def test_tolerance_uses_data_variance():
    x, _ = planted(4000, 16, 8, 2.0, 6)
    init = kmeans(x, 8, COMM, global_offset=0, max_iter=1, seed=1).centers
    for tol in (1e-1, 1e-2, 1e-3):
        res = kmeans(x, 8, COMM, global_offset=0, init=init, max_iter=300, tol=tol)
        sk = sk_fit(x, init, 300, tol)
        assert res.n_iter == sk.n_iter_, (tol, res.n_iter, sk.n_iter_)
        assert res.converged


# ---------------------------------------------------------------------- empty clusters

def test_empty_cluster_is_repaired_like_sklearn():
    x, c = planted(3000, 10, 6, 1.0, 7)
    init = np.concatenate([c[:5], np.full((1, 10), 1e3)]).astype(np.float32)  # never nearest
    res = kmeans(x, 6, COMM, global_offset=0, init=init, max_iter=100, tol=1e-4)
    assert np.all(res.counts > 0)
    sk = sk_fit(x, init, 100, 1e-4)
    agree(res, sk)


def test_several_empty_clusters_with_duplicate_centres():
    x, c = planted(2000, 6, 4, 0.5, 8)
    init = np.repeat(c[:2], 4, axis=0).astype(np.float32)  # 8 centres, 6 of them duplicates
    for alg in ("lloyd", "pruned"):
        res = kmeans(x, 8, COMM, global_offset=0, init=init, max_iter=50, tol=0, algorithm=alg)
        assert np.all(res.counts > 0) and res.counts.sum() == 2000


# --------------------------------------------------------------------------- spherical

def spherical_reference(x, init, iters):
    c = init.astype(np.float64)
    for _ in range(iters):
        lab = np.argmax(x @ c.astype(np.float32).T, axis=1)
        s = np.zeros_like(c)
        np.add.at(s, lab, x.astype(np.float64))
        nrm = np.linalg.norm(s, axis=1)
        c[nrm > 0] = s[nrm > 0] / nrm[nrm > 0, None]
        c = c.astype(np.float32).astype(np.float64)
    return c.astype(np.float32), lab


def test_spherical_matches_reference_and_is_unit_norm():
    x, _ = planted(4000, 32, 10, 2.0, 9, scale=1.0)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    init = x[np.random.default_rng(0).choice(4000, 10, replace=False)]
    res = kmeans(x, 10, COMM, global_offset=0, init=init, max_iter=8, tol=0, spherical=True)
    ref_c, _ = spherical_reference(x, init, 8)
    np.testing.assert_allclose(np.linalg.norm(res.centers, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(res.centers, ref_c, atol=1e-5)
    lab = np.argmax(x @ res.centers.T, axis=1)
    assert np.mean(lab == res.labels) >= 0.9999
    cos = np.einsum("ij,ij->i", x.astype(np.float64), res.centers[res.labels].astype(np.float64))
    assert abs(res.inertia - (1.0 - cos).sum()) < 1e-6 * len(x)
    np.testing.assert_array_equal(predict(x, res.centers, spherical=True), res.labels)


def test_spherical_kmeans_parallel_init():
    x, _ = planted(3000, 16, 6, 0.3, 10, scale=1.0)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    res = kmeans(x, 6, COMM, global_offset=0, spherical=True, max_iter=100)
    assert res.converged
    np.testing.assert_allclose(np.linalg.norm(res.centers, axis=1), 1.0, atol=1e-6)


# --------------------------------------------------------------------- pruned == lloyd

@pytest.mark.parametrize("n,d,k,spread,seed,spherical", [
    (6000, 32, 20, 2.5, 11, False),
    (5000, 48, 40, 4.0, 12, False),
    (4000, 16, 16, 1.5, 13, True),
])
def test_pruned_equals_lloyd(n, d, k, spread, seed, spherical):
    x, _ = planted(n, d, k, spread, seed)
    if spherical:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
    init = kmeans(x, k, COMM, global_offset=0, max_iter=1, seed=seed, spherical=spherical).centers
    kw = {"global_offset": 0, "init": init, "max_iter": 40, "tol": 0, "spherical": spherical}
    plain = kmeans(x, k, COMM, algorithm="lloyd", **kw)
    # default bounds; Hamerly-like (1 group, no movers: mostly backs off to full passes);
    # many movers (their distances by GEMM rather than row by row)
    for groups, movers in ((None, None), (1, 0), (4, k)):
        pr = kmeans(x, k, COMM, algorithm="pruned", n_groups=groups, max_movers=movers,
                    block_rows=333, **kw)
        np.testing.assert_array_equal(pr.labels, plain.labels)
        np.testing.assert_array_equal(pr.centers, plain.centers)
        assert pr.n_iter == plain.n_iter and pr.inertia == plain.inertia
        if groups is None:
            assert pr.stats["distance_fraction"] < 0.8 * plain.stats["distance_fraction"]


# ------------------------------------------------------------ init, predict, API contract

def test_kmeans_parallel_is_deterministic_and_finds_planted_clusters():
    x, c = planted(5000, 16, 10, 0.3, 14)
    a = kmeans(x, 10, COMM, global_offset=0, max_iter=1, seed=3)
    b = kmeans(x, 10, COMM, global_offset=0, max_iter=1, seed=3)
    np.testing.assert_array_equal(a.centers, b.centers)
    other = kmeans(x, 10, COMM, global_offset=0, max_iter=1, seed=4)
    assert not np.array_equal(a.centers, other.centers)
    full = kmeans(x, 10, COMM, global_offset=0, seed=3)
    # every planted centre has a found centre near it (well separated data)
    dist = np.linalg.norm(c[:, None, :] - full.centers[None], axis=2).min(axis=1)
    assert dist.max() < 0.1


def test_candidate_bound_and_small_data():
    x, _ = planted(40, 4, 3, 0.5, 15)
    res = kmeans(x, 12, COMM, global_offset=0, max_candidates=12, rounds=2)
    assert res.counts.sum() == 40 and np.all(res.counts >= 0)
    res = kmeans(x[:12], 12, COMM, global_offset=0)   # n == k: every point its own centre
    assert res.inertia < 1e-6 and sorted(res.labels.tolist()) == list(range(12))


def test_one_allreduce_per_iteration():
    x, _ = planted(3000, 8, 5, 2.0, 16)
    init = x[:5].copy()
    calls = []

    def allreduce(buf):
        calls.append(buf.size)
        COMM.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)

    res = kmeans(x, 5, COMM, global_offset=0, init=init, max_iter=30, tol=0, allreduce=allreduce)
    # one for the global shape, one per iteration (k*d + k + 3 numbers), one for the final cost
    assert len(calls) == 1 + res.n_iter + 1
    assert calls[1:-1] == [5 * 8 + 5 + 3] * res.n_iter


def test_predict_and_errors():
    x, _ = planted(2000, 8, 4, 1.0, 17)
    res = kmeans(x, 4, COMM, global_offset=0)
    np.testing.assert_array_equal(predict(x, res.centers), res.labels)
    with pytest.raises(ValueError, match="at least k rows"):
        kmeans(x[:3], 4, COMM, global_offset=0)
    with pytest.raises(ValueError, match="algorithm"):
        kmeans(x, 4, COMM, global_offset=0, algorithm="elkan")
    with pytest.raises(ValueError, match="shape"):
        kmeans(x, 4, COMM, global_offset=0, init=np.zeros((3, 8), np.float32))
    with pytest.raises(ValueError, match="2-D"):
        kmeans(x[:, 0], 4, COMM, global_offset=0)


# ------------------------------------------------------ pruned: Yinyang local filter kernel

def _local_call(x, c, labels, ub, lb, t, max_centres):
    """Run kn.local_assign on every row with zero drifts; returns (rows left for the GEMM,
    labels changed, centre scores computed)."""
    k = c.shape[0]
    group_of = ((np.arange(k) * t) // k).astype(np.int32)
    gstart = np.searchsorted(group_of, np.arange(t + 1)).astype(np.int64)
    members = np.arange(k, dtype=np.int64)
    c_sq = np.einsum("ij,ij->i", c.astype(np.float64), c.astype(np.float64)).astype(np.float32)
    x_sq = np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64))
    u32 = 2.0 ** -24
    gamma = x.shape[1] * u32 / (1 - x.shape[1] * u32)
    out = np.empty(x.shape[0], np.int64)
    n_out, changed, work = kn.local_assign(
        x, np.arange(x.shape[0], dtype=np.int64), c, c_sq, 0.0, gstart, members, group_of,
        np.zeros(k), np.zeros(t), np.full(k, -1, np.int32), labels, ub, lb, x_sq,
        np.sqrt(x_sq), float(np.sqrt(c_sq.max())), 1.01 * (2 * gamma + 2 * u32),
        1.01 * 2 * u32, 0.0, max_centres, np.empty(t, np.int64), np.empty(t), np.empty(t),
        np.empty(t, np.int64), np.empty(t), out)
    return out[:n_out], changed, work


def test_local_filter_certifies_or_leaves_ties_to_the_gemm():
    rng = np.random.default_rng(21)
    d, k, t = 16, 8, 4
    c = rng.normal(size=(k, d)).astype(np.float32)
    x = (c[rng.integers(0, k, 200)] + rng.normal(size=(200, d)) * 0.6).astype(np.float32)
    # rows 0-9 exactly halfway between centres 2 and 5 (a tie, up to float32 rounding)
    x[:10] = 0.5 * (c[2] + c[5]) + (rng.normal(size=(10, d)) * 1e-7).astype(np.float32)
    x64, c64 = x.astype(np.float64), c.astype(np.float64)
    dist = np.sqrt(((x64[:, None, :] - c64[None]) ** 2).sum(-1))
    labels = np.zeros(200, np.int32)                 # every row starts at centre 0
    ub = dist[:, 0] * (1 + 1e-9)
    # valid group lower bounds (other centres than 0), loosened: some groups get skipped
    lb = np.empty((200, t), np.float32)
    for g in range(t):
        other = [j for j in range(g * 2, g * 2 + 2) if j != 0]
        lb[:, g] = dist[:, other].min(axis=1) * 0.97
    lab_in, ub_in, lb_in = labels.copy(), ub.copy(), lb.copy()
    left, changed, work = _local_call(x, c, labels, ub, lb, t, max_centres=k)
    assert 0 < work < 200 * k                         # some centres skipped by the bounds
    ref = np.argmin(np.einsum("ij,ij->i", c64, c64).astype(np.float32)[None, :]
                    - np.float32(2) * (x @ c.T), axis=1)
    assert set(range(10)) <= set(left.tolist())      # the ties are left to the full GEMM
    done = np.setdiff1d(np.arange(200), left)
    assert done.shape[0] > 150
    np.testing.assert_array_equal(labels[done], ref[done])
    assert changed == int(np.sum(ref[done] != 0))
    # rows left for the GEMM keep label and bounds; certified rows have valid fresh bounds
    np.testing.assert_array_equal(labels[left], lab_in[left])
    np.testing.assert_array_equal(ub[left], ub_in[left])
    np.testing.assert_array_equal(lb[left], lb_in[left])
    own = dist[done, labels[done]]
    assert np.all(ub[done] >= own)
    masked = dist.copy()
    masked[np.arange(200), labels] = np.inf
    for g in range(t):
        assert np.all(lb[done, g] <= masked[done, 2 * g:2 * g + 2].min(axis=1))
    # a row needing more centres than allowed goes to the GEMM untouched
    labels2, ub2, lb2 = lab_in.copy(), ub_in.copy(), np.zeros_like(lb_in)
    left2, changed2, work2 = _local_call(x, c, labels2, ub2, lb2, t, max_centres=k - 1)
    assert left2.shape[0] == 200 and changed2 == 0 and work2 == 0


def test_pruned_local_filter_equals_lloyd_on_flat_unit_data(monkeypatch):
    """Unit-norm rows in many overlapping clusters (like sentence embeddings): the global
    filter keeps few rows, so the local filter does most of the work and must not change a
    single label."""
    from semzo.cluster import cpu
    rng = np.random.default_rng(22)
    n, d, k = 5000, 48, 64
    base = rng.normal(size=(24, d))
    x = base[rng.integers(0, 24, n)] + rng.normal(size=(n, d)) * 1.2
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    init = x[rng.choice(n, k, replace=False)].copy()
    kw = {"global_offset": 0, "init": init, "max_iter": 25, "tol": 0}
    plain = kmeans(x, k, COMM, algorithm="lloyd", **kw)
    calls = []
    real = cpu.kn.local_assign

    def spy(*a):
        res = real(*a)
        calls.append((a[1].shape[0], res[0], res[2]))
        return res

    monkeypatch.setattr(cpu.kn, "local_assign", spy)
    pr = kmeans(x, k, COMM, algorithm="pruned", block_rows=700, **kw)
    np.testing.assert_array_equal(pr.labels, plain.labels)
    np.testing.assert_array_equal(pr.centers, plain.centers)
    assert pr.n_iter == plain.n_iter and pr.inertia == plain.inertia
    rows_in = sum(c[0] for c in calls)
    certified = sum(c[0] - c[1] for c in calls)
    assert calls and certified > 0.3 * rows_in, calls   # the local filter did real work
