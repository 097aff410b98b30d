"""Placement pipeline under MPI: counts, plan broadcast, destinations, redistribution."""

from __future__ import annotations

import pytest
from mpiutil import ROOT, check, mpirun

SCRIPTS = ROOT / "tests" / "mpi"


@pytest.mark.parametrize("nranks", [1, 4])
def test_place_pipeline_mpi(nranks):
    proc = check(mpirun(nranks, [str(SCRIPTS / "place_pipeline.py")], timeout=90))
    assert f"ok: pipeline on {nranks} ranks" in proc.stdout


@pytest.mark.parametrize("mode", ["shuffle", "semantic"])
def test_place_stage_mpi(tmp_path, mode):
    """The place stage end to end on a small synthetic corpus at 4 ranks (2 switches)."""
    proc = check(mpirun(4, [str(SCRIPTS / "place_shuffle.py"), "stage", str(tmp_path), mode],
                        timeout=120))
    assert f"ok: place stage {mode} on 4 ranks" in proc.stdout
    assert "none lost, none duplicated" in proc.stderr
