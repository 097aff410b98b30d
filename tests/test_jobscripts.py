"""Job scripts: syntactically valid bash, running the same CLI, with an edit header."""

import subprocess

import pytest
from mpiutil import ROOT

SCRIPTS = sorted((ROOT / "jobscripts").iterdir())


def test_all_kinds_present():
    names = {p.name for p in SCRIPTS}
    assert {"slurm-cpu.sbatch", "slurm-gpu.sbatch", "pbs.pbs", "local.sh"} <= names


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bash_n_and_header(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert "EDIT:" in text.split("\n", 12)[-2] or "EDIT:" in "\n".join(text.splitlines()[:6])
    assert "python -m semzo run" in text
