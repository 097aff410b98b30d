"""The package's layering (docs/design.md) is kept by import-linter's contracts in
pyproject.toml, imports inside functions included: a new import circle or an import against
the layers fails here, not in a reviewer's memory."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(src: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), str(ROOT / "pyproject.toml"), "--no-cache"],
                          check=False, cwd=src, capture_output=True, text=True, timeout=120)


def test_contracts_hold():
    proc = _lint(ROOT / "src")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_circle_inside_a_function_breaks_a_contract(tmp_path):
    """The contracts see an import placed inside a function (how the old circles hid), and a
    model module importing the optimizer."""
    shutil.copytree(ROOT / "src" / "semzo", tmp_path / "semzo",
                    ignore=shutil.ignore_patterns("__pycache__"))
    storage = tmp_path / "semzo" / "model" / "storage.py"
    storage.write_text(storage.read_text() + "\n\ndef _late():\n"
                       "    from semzo.model import kernels\n    from semzo.zo import perturb\n"
                       "    return kernels, perturb\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0
    assert "No import circle inside a package BROKEN" in proc.stdout, proc.stdout[-3000:]
    assert "The model knows nothing of training" in proc.stdout
    assert "semzo.model.storage -> semzo.zo.perturb" in proc.stdout, proc.stdout[-3000:]
