"""Launch MPI programs from pytest: every launch has a timeout, and output is captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MPIEXEC = os.environ.get("MPIEXEC", "mpirun")

# What Open MPI needs to run as root, oversubscribed (4 ranks on 2 cores), inside a container.
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "OMPI_MCA_rmaps_base_oversubscribe": "1",
    "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    "PYTHONUNBUFFERED": "1",
}


def mpirun(n: int, args: list[str], *, timeout: float = 120, env: dict | None = None,
           cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """Run ``mpirun -n n python args...`` under ``timeout``; return the completed process.

    The outer ``timeout`` (coreutils) kills mpirun if it hangs; ``subprocess`` has its own
    limit a few seconds later as a second guard. stdout and stderr are captured as text.
    """
    full_env = dict(os.environ)
    full_env.update(MPI_ENV)
    if env:
        full_env.update(env)
    cmd = ["timeout", "-k", "5", str(int(timeout)), MPIEXEC, "-n", str(n),
           sys.executable, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, check=False,
                          cwd=cwd or ROOT, timeout=timeout + 15)


def check(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Assert that an mpirun launch exited 0, showing its output if not."""
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
        f"\n--- stderr ---\n{proc.stderr[-4000:]}")
    return proc
