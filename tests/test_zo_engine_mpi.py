"""ZO engine under MPI: the three parallel modes at 1, 2 and 4 ranks (replicas identical bit
for bit and equal to serial references), checksum mismatch and NaN guard on every rank."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from mpiutil import ROOT, check, mpirun

sys.path.insert(0, str(Path(__file__).parent / "mpi"))
from zo_common import make_model

SCRIPTS = ROOT / "tests" / "mpi"
ENV = {"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("zo") / "bert")


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_zo_modes_mpi(tiny, nranks):
    proc = check(mpirun(nranks, [str(SCRIPTS / "zo_modes.py"), str(tiny)], timeout=240,
                        env=ENV))
    assert f"ok: zo modes on {nranks} ranks (float32)" in proc.stdout
    for mode in ("data/copy", "perturbation/copy", "perturbation/fused", "hybrid/copy"):
        assert f"ok: {mode}" in proc.stdout, mode


def test_zo_checksum_mismatch_detected_on_every_rank_mpi(tiny):
    proc = check(mpirun(4, [str(SCRIPTS / "zo_faults.py"), str(tiny), "mismatch-caught"],
                        timeout=120, env=ENV))
    for r in range(4):
        assert f"ok: rank {r} detected the mismatch" in proc.stdout
    proc = mpirun(4, [str(SCRIPTS / "zo_faults.py"), str(tiny), "mismatch"], timeout=120,
                  env=ENV)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: replicas differ at step 2" in proc.stderr
    assert "rank(s) 3 do not match" in proc.stderr


def test_zo_nan_guard_stops_every_rank_mpi(tiny):
    proc = mpirun(4, [str(SCRIPTS / "zo_faults.py"), str(tiny), "nan"], timeout=120, env=ENV)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "non-finite loss on rank 3" in proc.stderr
    assert "4 steps had a NaN or Inf loss (train.max_skips = 3)" in proc.stderr
    assert "unreachable" not in proc.stderr


@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_zo_streamed_equals_three_pass_mpi(tiny, nranks):
    """zo.schedule = "streamed" (resident and simulated host offload) against the three-pass
    step: losses and parameters bit for bit, every mode and restore, with a skipped step."""
    proc = check(mpirun(nranks, [str(SCRIPTS / "zo_streamed.py"), str(tiny)], timeout=400,
                        env=ENV))
    assert f"ok: zo streamed on {nranks} ranks" in proc.stdout
    for what in ("data/copy", "perturbation/copy", "perturbation/fused"):
        for off in ("False", "True"):
            assert f"ok: streamed {what} offload={off}" in proc.stdout, (what, off)
    if nranks >= 2:
        assert "ok: streamed hybrid/copy offload=True" in proc.stdout


@pytest.mark.parametrize("kind", ["llama_tied", "opt", "llama"])
def test_zo_streamed_causal_lm_mpi(tmp_path, kind):
    """The same at 2 ranks for CausalLM decoders with tied heads and an untied one (whose
    embedding rows that a rank's batch does not read are deferred; next-token loss):
    perturbation and hybrid modes, resident and simulated host offload."""
    folder = make_model(tmp_path / kind, kind=kind)
    proc = check(mpirun(2, [str(SCRIPTS / "zo_streamed.py"), str(folder), "perturbation,hybrid"],
                        timeout=400, env=ENV))
    assert "ok: zo streamed on 2 ranks" in proc.stdout
    for what in ("perturbation/copy", "perturbation/fused", "hybrid/copy", "hybrid/fused"):
        for off in ("False", "True"):
            assert f"ok: streamed {what} offload={off}" in proc.stdout, (what, off)
    assert "data/copy" not in proc.stdout
