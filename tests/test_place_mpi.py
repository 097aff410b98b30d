"""Placement pipeline under MPI: counts, plan broadcast, destinations, redistribution."""

from __future__ import annotations

import pytest
from mpiutil import ROOT, check, mpirun

SCRIPTS = ROOT / "tests" / "mpi"


@pytest.mark.parametrize("nranks", [1, 4])
def test_place_pipeline_mpi(nranks):
    proc = check(mpirun(nranks, [str(SCRIPTS / "place_pipeline.py")], timeout=90))
    assert f"ok: pipeline on {nranks} ranks" in proc.stdout
