"""Job scripts: syntactically valid bash, running the same CLI, with an edit header; the
properties a cluster needs (issue 30 item 8), read from the text; and the requeue logic
(jobscripts/lib/continue.bash) run for real with stand-ins for srun and scontrol."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpiutil import ROOT

SCRIPTS = sorted(p for p in (ROOT / "jobscripts").iterdir() if p.is_file())
CONTINUE = ROOT / "jobscripts" / "lib" / "continue.bash"
SLURM = [p for p in SCRIPTS if p.suffix == ".sbatch"]
ML = re.MULTILINE


def test_all_kinds_present():
    names = {p.name for p in SCRIPTS}
    assert {"slurm-cpu.sbatch", "slurm-gpu.sbatch", "pbs.pbs", "local.sh"} <= names


@pytest.mark.parametrize("path", [*SCRIPTS, CONTINUE], ids=[*(p.name for p in SCRIPTS),
                                                             "lib/continue.bash"])
def test_bash_n(path):
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_header_modules_unbuffered(path):
    text = path.read_text()
    assert "EDIT:" in "\n".join(text.splitlines()[:6])
    assert "python -m semzo run" in text
    # site modules: commented placeholders in a marked block, for the MPI and parallel HDF5
    block = text.split("SITE MODULES (EDIT)", 1)
    assert len(block) == 2, "no SITE MODULES (EDIT) block"
    loads = [ln for ln in block[1].split("# ----", 1)[0].splitlines()
             if re.match(r"#\s*module load ", ln)]
    assert any("MPI" in ln for ln in loads) and any("HDF5" in ln for ln in loads), loads
    assert all("SITE" in ln for ln in loads), loads
    assert not re.search(r"^\s*module ", text, ML), "a module line that is not commented"
    assert re.search(r"^export PYTHONUNBUFFERED=1\b", text, ML)


def _sbatch(text: str) -> dict[str, str]:
    """#SBATCH --key=value lines as a dict ('--requeue': '')."""
    out = {}
    for m in re.finditer(r"^#SBATCH\s+(--[\w-]+)(?:=(\S+))?", text, ML):
        out[m.group(1)] = m.group(2) or ""
    return out


@pytest.mark.parametrize("path", SLURM, ids=[p.name for p in SLURM])
def test_slurm_properties(path):
    text = path.read_text()
    opts = _sbatch(text)
    assert opts.get("--open-mode") == "append"            # a requeued job keeps its log
    assert "--requeue" in opts and opts.get("--signal", "").startswith("USR1@")
    assert "--cpus-per-task" in opts
    # Slurm >= 22.05: srun does not inherit --cpus-per-task
    assert re.search(r"^export SRUN_CPUS_PER_TASK=\$\{?SLURM_CPUS_PER_TASK\b", text, ML)
    # srun --mpi=pmix by default, overridable, with pmi2 named for the sites that need it
    assert re.search(r"^SRUN_MPI=\$\{SRUN_MPI:-pmix\}", text, ML)
    assert "pmi2" in text
    srun = [ln for ln in text.splitlines() if ln.startswith("srun ")]
    assert len(srun) == 1 and '--mpi="$SRUN_MPI"' in srun[0], srun
    # requeue: through lib/continue.bash, never a blind finetune-only --resume
    assert "source jobscripts/lib/continue.bash" in text and "semzo_continue" in text
    assert "--resume" not in "\n".join(ln for ln in text.splitlines()
                                       if not ln.lstrip().startswith("#"))
    assert 'run.stages=["finetune"]' not in text
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    if "gpu" in path.name:
        assert opts["--gpus-per-node"] == opts["--ntasks-per-node"]
        assert "cupy-cuda12x[ctk]" in text and "cupy-cuda13x[ctk]" in text
        assert "driver" in text and re.search(r"#\s*module load cuda", text)


def test_pbs_properties():
    text = (ROOT / "jobscripts" / "pbs.pbs").read_text()
    assert re.search(r"^#PBS -r y$", text, ML)                 # rerunnable
    assert "semzo_continue" in text and "$PBS_JOBID" in text


# ------------------------------------------------------------------ the requeue, run for real
FAKE_SRUN = r"""#!/usr/bin/env bash
# stands in for srun/mpirun: records its arguments and environment, makes the files named in
# FAKE_MAKE (relative to FAKE_OUT), exits FAKE_RC
{ printf '%s\n' "$@"; echo "SRUN_CPUS_PER_TASK=${SRUN_CPUS_PER_TASK:-}";
  echo "PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-}"; echo "----"; } >> "$FAKE_LOG"
for f in ${FAKE_MAKE:-}; do mkdir -p "$(dirname "$FAKE_OUT/$f")"; touch "$FAKE_OUT/$f"; done
exit "${FAKE_RC:-0}"
"""


@pytest.fixture
def submit(tmp_path):
    """A submit directory: the repository's jobscripts and inputs, a .venv whose activate puts
    stand-ins for srun, mpirun and scontrol ahead of this interpreter."""
    d = tmp_path / "submit"
    d.mkdir()
    (d / "jobscripts").symlink_to(ROOT / "jobscripts")
    (d / "inputs").symlink_to(ROOT / "inputs")
    fake = tmp_path / "bin"
    fake.mkdir()
    for name in ("srun", "mpirun"):
        (fake / name).write_text(FAKE_SRUN)
    (fake / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$FAKE_LOG.scontrol"\n')
    for p in fake.iterdir():
        p.chmod(0o755)
    (d / ".venv" / "bin").mkdir(parents=True)
    (d / ".venv" / "bin" / "activate").write_text(
        f'PATH="{fake}:{Path(sys.executable).parent}:$PATH"\n')
    return d


def _attempt(submit: Path, script: str, out: Path, rc: int, make: str = "",
             **env: str) -> tuple[int, list[list[str]]]:
    log = submit / "srun.log"
    full = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(submit),
            "SLURM_CPUS_PER_TASK": "4", "PBS_JOBID": "4242.pbs", "PBS_O_WORKDIR": str(submit),
            "PBS_NODEFILE": str(ROOT / "README.md"), "FAKE_LOG": str(log),
            "FAKE_OUT": str(out), "FAKE_RC": str(rc), "FAKE_MAKE": make,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            **env}
    full.pop("SRUN_CPUS_PER_TASK", None)
    full.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run(["bash", str(ROOT / "jobscripts" / script),
                           "--set", f"run.output_dir={out}"], cwd=submit.parent,  # sbatch runs it elsewhere
                          env=full, capture_output=True, text=True, timeout=60, check=False)
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("----\n") if c.strip()]
    return proc.returncode, calls


def _backdate(stamp: Path) -> None:
    t = time.time() - 100                    # files the next attempt makes are newer
    os.utime(stamp, (t, t))


def _stages(call: list[str]) -> list[str] | None:
    sets = [call[i + 1] for i in range(len(call) - 1) if call[i] == "--set"]
    last = [s for s in sets if s.startswith("run.stages=")]
    return json.loads(last[-1].split("=", 1)[1]) if last else None


@pytest.mark.parametrize("script", ["slurm-cpu.sbatch", "slurm-gpu.sbatch"])
def test_slurm_requeue_goes_on_from_what_the_job_completed(submit, script):
    out = submit / "runs" / "x"
    out.mkdir(parents=True)
    (out / "shards.h5").touch()              # an earlier job's files: they must not count
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "ckpt-000000500.h5").touch()
    old = time.time() - 1000
    for p in (out / "shards.h5", out / "checkpoints" / "ckpt-000000500.h5"):
        os.utime(p, (old, old))
    # attempt 1: killed in the place stage (node failure): embeddings and clusters complete
    rc, calls = _attempt(submit, script, out, 137, "topology.h5 embeddings.h5 clusters.h5")
    assert rc == 137 and len(calls) == 1
    first = calls[0]
    assert _stages(first) is None and "--resume" not in first
    assert first[:2] == ["--mpi=pmix", "--cpu-bind=cores"]
    assert "SRUN_CPUS_PER_TASK=4" in first and "PYTHONUNBUFFERED=1" in first
    assert f"run.output_dir={out}" in first
    stamp = out / ".semzo-job-4242"
    assert stamp.is_file()
    _backdate(stamp)
    # attempt 2 (requeued, same job id): place again, then fine-tune from the model; stopped
    # by SIGUSR1 with a checkpoint (75): the script requeues
    rc, calls = _attempt(submit, script, out, 75, "shards.h5 checkpoints/ckpt-000000100.h5",
                         SRUN_MPI="pmi2")
    assert rc == 75 and calls[1][0] == "--mpi=pmi2"
    assert _stages(calls[1]) == ["place", "finetune"] and "--resume" not in calls[1]
    assert (submit / "srun.log.scontrol").read_text().split() == ["requeue", "4242"]
    # attempt 3: the finetune stage alone, from this job's checkpoint; success drops the stamp
    rc, calls = _attempt(submit, script, out, 0)
    assert rc == 0 and _stages(calls[2]) == ["finetune"] and calls[2][-3] == "--resume"
    assert not stamp.exists()
    # a new job in the same folder starts afresh
    rc, calls = _attempt(submit, script, out, 0, SLURM_JOB_ID="4243")
    assert _stages(calls[3]) is None and "--resume" not in calls[3]


def test_pbs_rerun_and_continue_job(submit):
    out = submit / "runs" / "p"
    rc, calls = _attempt(submit, "pbs.pbs", out, 75, "topology.h5 embeddings.h5")
    assert rc == 75 and _stages(calls[0]) is None
    _backdate(out / ".semzo-job-4242.pbs")
    # a new job told to continue the first one's work
    rc, calls = _attempt(submit, "pbs.pbs", out, 0, "clusters.h5",
                         PBS_JOBID="4250.pbs", SEMZO_CONTINUE_JOB="4242.pbs")
    assert rc == 0 and _stages(calls[1]) == ["cluster", "place", "finetune"]
    assert "--resume" not in calls[1]


def test_continue_skips_only_leading_complete_stages(tmp_path):
    """A later stage's file without the earlier ones' (clusters.h5 but no embeddings.h5) does
    not skip anything; the deck's own stage list is kept."""
    out = tmp_path / "o"
    out.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "PYTHONPATH": str(ROOT / "src")}
    script = (f'source "{CONTINUE}"; semzo_continue 7 inputs/demo.toml --set '
              f'run.output_dir={out} "$@"; printf "%s\\n" "${{SEMZO_AGAIN[@]}}"')

    def again(*sets: str) -> list[str]:
        proc = subprocess.run(["bash", "-c", script, "x", *sets], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        return [ln for ln in proc.stdout.splitlines() if ln]

    assert again() == []
    _backdate(out / ".semzo-job-7")
    (out / "clusters.h5").touch()
    assert again() == []
    (out / "topology.h5").touch()
    assert again() == ['--set', 'run.stages=["embed","cluster","place","finetune"]']
    assert again("--set", 'run.stages=["topology","cluster"]') == \
        ['--set', 'run.stages=["cluster"]']        # all done: the last stage again
    shutil.rmtree(out)
