"""The process-wide defaults ``import semzo`` sets before numpy loads (the thread pools' spin
limits, src/semzo/__init__.py, docs/guide.md "Threads per rank"), and the property of
OpenBLAS's kernel that the reproducibility promises rest on."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np

KEYS = ("OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT")


def _env_after_import(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in KEYS}
    env.update(extra)
    code = ("import os, semzo, numpy\n"
            f"for k in {KEYS!r}:\n"
            "    print(k, os.environ.get(k, '-'))\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def test_spin_defaults_are_set_and_the_environment_wins():
    got = _env_after_import({})
    assert got == {"OPENBLAS_THREAD_TIMEOUT": "4", "GOMP_SPINCOUNT": "10000"}
    got = _env_after_import({"OPENBLAS_THREAD_TIMEOUT": "7", "GOMP_SPINCOUNT": "123"})
    assert got == {"OPENBLAS_THREAD_TIMEOUT": "7", "GOMP_SPINCOUNT": "123"}


def test_gemm_rows_do_not_depend_on_the_row_count():
    """A row of ``x @ W.T`` has the same bits whatever rows come with it (from 2 rows up:
    one row is a GEMV): what makes embeddings, losses and k-means bit-identical across batch
    compositions, thread splits and rank counts. OpenBLAS's AVX2 ("Haswell"/"Zen") sgemm
    kernels break it, which is why semzo does not pick them on AMD Zen 4 although they ran
    3-5 % faster there (docs/guide.md, "BLAS kernels")."""
    r = np.random.default_rng(0)
    x = r.standard_normal((600, 384), dtype=np.float32)
    w = r.standard_normal((1536, 384), dtype=np.float32)
    full = x @ w.T
    for m in (2, 7, 16, 17, 100, 333):
        assert np.array_equal(x[:m] @ w.T, full[:m]), m
