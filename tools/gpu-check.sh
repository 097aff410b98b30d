#!/usr/bin/env bash
# The GPU bring-up of semzo in one or two commands of at most 10 minutes each, on the GPU
# machine, from the working tree plus the folder made by tools/gpu-pack.sh (.gpu/):
#
#   bash tools/gpu-check.sh OUTDIR tests    # setup (unpack, MPI, h5py with MPI) + GPU tests
#   bash tools/gpu-check.sh OUTDIR bench    # setup (MPI only) + GPU benchmarks
#   bash tools/gpu-check.sh OUTDIR all      # both (only where one command may take 20 min)
#
# Writes into OUTDIR at most 8 files: summary.md (one page), env.txt, setup.log, tests.log,
# tests.xml, bench.log, bench.jsonl. Every phase runs under its own timeout; a failing phase
# is recorded in the summary and the later phases still run (no set -e on purpose).
#
# Environment: SEMZO_GPU_KIT_CPU=1 runs the same phases on the CPU (xp=numpy, small sizes):
# the rehearsal that tests/test_gpu_kit.py runs without a GPU. KIT (default .gpu) the packed
# folder; PREFIX (default a fresh mktemp -d) where it is unpacked; TESTS_TIMEOUT,
# BENCH_TIMEOUT, SETUP_TIMEOUT, H5PY_TIMEOUT seconds, and DEADLINE (default 570): the tests
# and bench phases get at most what is left of DEADLINE seconds; PYTHON (default python3).
# SEMZO_GPU_KIT_FORCE_DEBS=1 / SEMZO_GPU_KIT_FORCE_H5PY=1: use the carried Open MPI / build
# h5py even where the machine's own work (rehearsals). SEMZO_GPU_KIT_PYTEST_ARGS and
# SEMZO_GPU_KIT_BENCH_ARGS: extra arguments (e.g. -k EXPR, --only NAME,...).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)

OUTDIR=${1:-}
WHAT=${2:-all}
if [ -z "$OUTDIR" ]; then echo "usage: tools/gpu-check.sh OUTDIR [tests|bench|all]" >&2; exit 2; fi
case "$WHAT" in tests|bench|all) ;; *) echo "gpu-check: phase must be tests, bench or all, not $WHAT" >&2; exit 2 ;; esac
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
CPU=${SEMZO_GPU_KIT_CPU:-0}
KIT=${KIT:-.gpu}
PY=${PYTHON:-python3}
SETUP_TIMEOUT=${SETUP_TIMEOUT:-150}
H5PY_TIMEOUT=${H5PY_TIMEOUT:-300}
TESTS_TIMEOUT=${TESTS_TIMEOUT:-480}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-480}
# the device tool stops a command at 600 s: tests and bench get what is left of DEADLINE
DEADLINE=${DEADLINE:-570}
START=$(date +%s)
left() {   # left WANTED: min(WANTED, seconds left before DEADLINE less 20 for the summary)
  local l=$(( DEADLINE - ($(date +%s) - START) - 20 ))
  [ "$l" -lt 30 ] && l=30
  [ "$1" -lt "$l" ] && l=$1
  echo "$l"
}
if [ "$CPU" != 1 ] && [ -z "${SEMZO_GPU_KIT_PYTEST_ARGS+x}" ]; then
  # on the GPU the CPU proofs of the harnesses add nothing (make test runs them)
  SEMZO_GPU_KIT_PYTEST_ARGS="-k not(on_cpu)"
fi
export SEMZO_GPU_KIT_PYTEST_ARGS="${SEMZO_GPU_KIT_PYTEST_ARGS:-}" \
  SEMZO_GPU_KIT_BENCH_ARGS="${SEMZO_GPU_KIT_BENCH_ARGS:-}"
PREFIX=${PREFIX:-$(mktemp -d /tmp/semzo-gpu.XXXXXX)}
mkdir -p "$PREFIX/site" "$PREFIX/root" "$PREFIX/models" "$PREFIX/bin"
PHASES="$OUTDIR/.phases"      # name<TAB>status<TAB>seconds<TAB>note; folded into summary.md
: > "$PHASES"
SETUP_LOG="$OUTDIR/setup.log"
ENV_TXT="$OUTDIR/env.txt"
: > "$SETUP_LOG"
log() { printf '[gpu-check %s] %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$SETUP_LOG" >&2; }

# phase NAME TIMEOUT CMD...: run CMD under timeout, record status and seconds, never exit
phase() {
  local name=$1 limit=$2; shift 2
  local t0 rc status
  t0=$(date +%s.%N)
  log "phase $name: start (limit ${limit}s)"
  timeout -k 10 "$limit" "$@"
  rc=$?
  case $rc in
    0) status=ok ;;
    124|137) status="timeout after ${limit}s" ;;
    *) status="failed (exit $rc)" ;;
  esac
  local dt
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  printf '%s\t%s\t%s\n' "$name" "$status" "$dt" >> "$PHASES"
  log "phase $name: $status in ${dt}s"
  return 0
}

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
# Open MPI 4 refuses to start even on one node when it finds no ssh or rsh (open-mpi/ompi#12386);
# without them its single-node launcher (plm "isolated") does the job
if ! command -v ssh >/dev/null 2>&1 && ! command -v rsh >/dev/null 2>&1; then
  export OMPI_MCA_plm=^rsh
fi
export SEMZO_GPU_KIT_INNER=1 SEMZO_GPU_KIT_CPU="$CPU" SEMZO_GPU_KIT_OUT="$OUTDIR"
export PYTHONPATH="$ROOT/src:$PREFIX/site${PYTHONPATH:+:$PYTHONPATH}"

# ------------------------------------------------------------------ phase: verify the kit
verify_kit() {
  if [ ! -f "$KIT/MANIFEST.tsv" ]; then
    log "no $KIT/MANIFEST.tsv: nothing packed (run tools/gpu-pack.sh here and carry $KIT)"
    return 1
  fi
  local bad=0 kind file bytes sum
  while IFS=$'\t' read -r kind file bytes sum; do
    [ "$kind" = kind ] && continue
    if [ ! -f "$KIT/$file" ]; then log "missing from the kit: $file"; bad=1; continue; fi
    [ "$(sha256sum "$KIT/$file" | cut -d' ' -f1)" = "$sum" ] || { log "checksum differs: $file"; bad=1; }
  done < "$KIT/MANIFEST.tsv"
  log "kit: $(($(wc -l < "$KIT/MANIFEST.tsv") - 1)) files checked"
  return $bad
}

# ------------------------------------------------------------------ phase: Python packages
install_py() {   # the kit's wheels (pywheels/) for what this machine cannot import
  local pair mod name f installed="" absent=""
  for pair in Cython:cython setuptools:setuptools pytest:pytest pluggy:pluggy \
              iniconfig:iniconfig packaging:packaging pygments:pygments \
              threadpoolctl:threadpoolctl scipy:scipy matplotlib:matplotlib \
              contourpy:contourpy cycler:cycler fontTools:fonttools kiwisolver:kiwisolver \
              PIL:pillow pyparsing:pyparsing dateutil:python_dateutil tzdata:tzdata; do
    mod=${pair%%:*} name=${pair##*:}
    "$PY" -c "import $mod" >/dev/null 2>&1 && continue
    f=$(ls "$KIT/pywheels" 2>/dev/null | grep -i "^$name-" | head -1)
    if [ -n "$f" ] && "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
         --target "$PREFIX/site" "$KIT/pywheels/$f" >> "$SETUP_LOG" 2>&1; then
      installed="$installed $name"
    else
      absent="$absent $name"
    fi
  done
  log "python: installed from the kit:${installed:- nothing needed}; still missing:${absent:- none}"
  [ -z "$absent" ]
}

# ------------------------------------------------------------------ phase: MPI
have_mpi() {   # 0 when mpi4py imports, finds its library, and an mpirun is on PATH
  command -v mpirun >/dev/null 2>&1 || return 1
  timeout -k 5 60 "$PY" -c "from mpi4py import MPI; MPI.Get_library_version()" >/dev/null 2>&1
}

fix_links() {   # make the absolute symlinks of an unpacked tree point inside it
  local root=$1 l t
  find "$root" -type l | while read -r l; do
    t=$(readlink "$l")
    case "$t" in /*) ln -sfn "$root$t" "$l" ;; esac
  done
}

deb_x() {   # deb_x FILE DIR: dpkg-deb -x, or Python (ar + tar) where dpkg-deb is missing
  if command -v dpkg-deb >/dev/null 2>&1 && [ "${SEMZO_GPU_KIT_NO_DPKG:-0}" != 1 ]; then
    dpkg-deb -x "$1" "$2"
    return
  fi
  "$PY" - "$1" "$2" <<'PYEOF'
import io, sys, tarfile
data = open(sys.argv[1], "rb").read()
assert data[:8] == b"!<arch>\n", "not a .deb (ar archive)"
pos = 8
while pos + 60 <= len(data):
    name = data[pos:pos + 16].decode().strip().rstrip("/")
    size = int(data[pos + 48:pos + 58].decode().strip())
    body = data[pos + 60:pos + 60 + size]
    if name.startswith("data.tar"):
        if name.endswith(".zst"):
            raise SystemExit("data.tar.zst needs dpkg-deb or zstd")
        with tarfile.open(fileobj=io.BytesIO(body)) as t:
            t.extractall(sys.argv[2], filter="tar")
        break
    pos += 60 + size + (size & 1)
else:
    raise SystemExit("no data.tar member")
PYEOF
}

unpack_mpi() {
  local R="$PREFIX/root" S="$PREFIX/sysroot" L="$PREFIX/root/usr/lib/x86_64-linux-gnu" f so name
  compgen -G "$KIT/debs/*.deb" >/dev/null || { log "no Debian packages in $KIT/debs"; return 1; }
  for f in "$KIT"/debs/*.deb; do deb_x "$f" "$R" || { log "cannot unpack $f"; return 1; }; done
  mkdir -p "$S"
  for f in "$KIT"/sysdebs/*.deb; do [ -f "$f" ] && deb_x "$f" "$S"; done
  fix_links "$R"; fix_links "$S"
  # system libraries only where this machine lacks the soname (never shadow its own copies)
  local linked="" known="$PREFIX/ldconfig.txt"
  ldconfig -p 2>/dev/null | awk '{print $1}' > "$known"   # a file: no SIGPIPE under pipefail
  for so in $(find "$S" -name '*.so.*' \( -type f -o -type l \) 2>/dev/null); do
    name=$(basename "$so")
    case "$name" in *.so.[0-9]|*.so.[0-9][0-9]) ;; *) continue ;; esac
    if ! grep -qxF "$name" "$known"; then
      ln -sfn "$so" "$L/$name"; linked="$linked $name"
    fi
  done
  log "system libraries linked because this machine lacks them:${linked:- none}"
  ln -sfn "$R/usr/bin/orterun" "$PREFIX/bin/mpirun"
  ln -sfn "$R/usr/bin/orterun" "$PREFIX/bin/mpiexec"
  ln -sfn "$R/usr/bin/opal_wrapper" "$PREFIX/bin/mpicc"
  export PATH="$PREFIX/bin:$R/usr/bin:$PATH"
  export LD_LIBRARY_PATH="$L:$L/openmpi/lib:$L/pmix2/lib:$L/hdf5/openmpi${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OPAL_PREFIX="$R/usr" OPAL_SYSCONFDIR="$R/etc/openmpi"
  export PMIX_INSTALL_PREFIX="$L/pmix2" PMIX_MCA_pcompress_base_silence_warning=1
  export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_osc=pt2pt
  export MPI4PY_LIBMPI=libmpi.so.40 MPI4PY_MPIABI=openmpi
  # the machine's mpi4py 4.x loads any libmpi.so.40; an older or missing one is replaced
  if ! "$PY" -c "import mpi4py, sys; sys.exit(int(mpi4py.__version__.split('.')[0]) < 4)" \
       >/dev/null 2>&1 && compgen -G "$KIT/wheels/mpi4py-*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$PREFIX/site" "$KIT"/wheels/mpi4py-*.whl || { log "mpi4py wheel did not install"; return 1; }
  fi
  ldd "$L/libmpi.so.40" "$L/libhdf5_openmpi.so.103" 2>&1 | grep "not found" | sort -u | tee -a "$SETUP_LOG"
  echo "export PATH=\"$PATH\" LD_LIBRARY_PATH=\"$LD_LIBRARY_PATH\" OPAL_PREFIX=\"$OPAL_PREFIX\"" \
    "OPAL_SYSCONFDIR=\"$OPAL_SYSCONFDIR\" PMIX_INSTALL_PREFIX=\"$PMIX_INSTALL_PREFIX\"" \
    "OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader OMPI_MCA_osc=pt2pt MPI4PY_LIBMPI=libmpi.so.40" \
    "MPI4PY_MPIABI=openmpi" > "$PREFIX/env.sh"
  return 0
}

setup_mpi() {
  if [ "${SEMZO_GPU_KIT_FORCE_DEBS:-0}" != 1 ] && have_mpi; then
    if [ "$WHAT" = bench ] || h5py_mpi; then
      log "MPI: the machine's own ($(command -v mpirun))"
      return 0
    fi
    # h5py gets built against the carried parallel HDF5 and its Open MPI: one MPI library in
    # the process means the carried one for mpi4py too
    log "MPI: the machine's own works but its h5py is serial: the carried Open MPI serves both"
  fi
  log "MPI: none usable here (or SEMZO_GPU_KIT_FORCE_DEBS=1); unpacking Open MPI from $KIT/debs into $PREFIX/root"
  unpack_mpi || return 1
  have_mpi || { log "MPI: the unpacked Open MPI does not load (see above)"; return 1; }
  log "MPI: $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])')"
}

# ------------------------------------------------------------------ phase: h5py with MPI
h5py_mpi() { "$PY" -c "import h5py, sys; sys.exit(0 if h5py.get_config().mpi else 1)" >/dev/null 2>&1; }

build_h5py() {
  if [ "${SEMZO_GPU_KIT_FORCE_H5PY:-0}" != 1 ] && h5py_mpi; then log "h5py: has MPI already"; return 0; fi
  local L="$PREFIX/root/usr/lib/x86_64-linux-gnu" sd
  sd=$(compgen -G "$KIT/sdist/h5py-*.tar.gz" | head -1)
  [ -n "$sd" ] || { log "h5py: serial, and no h5py sdist in $KIT/sdist"; return 1; }
  [ -f "$PREFIX/root/usr/include/hdf5/openmpi/hdf5.h" ] || unpack_mpi >/dev/null 2>&1 || true
  [ -f "$PREFIX/root/usr/include/hdf5/openmpi/hdf5.h" ] || { log "h5py: no parallel HDF5 headers"; return 1; }
  compgen -G "$KIT/wheels/pkgconfig-*.whl" >/dev/null && "$PY" -m pip install -q --no-index \
    --no-deps --target "$PREFIX/site" "$KIT"/wheels/pkgconfig-*.whl
  # the extensions compile in parallel (setuptools' build_ext -j, read from setup.cfg)
  local src="$PREFIX/h5py-src"
  rm -rf "$src"; mkdir -p "$src"
  tar -xzf "$sd" -C "$src" || { log "h5py: cannot unpack $sd"; return 1; }
  src=$(ls -d "$src"/h5py-*/ | head -1)
  printf '\n[build_ext]\nparallel = %s\n' "$(nproc 2>/dev/null || echo 4)" >> "$src/setup.cfg"
  log "h5py: building $(basename "$sd") with HDF5_MPI=ON against $PREFIX/root (1-5 min)"
  ( export HDF5_MPI=ON CC="${CC:-gcc}" HDF5_INCLUDEDIR="$PREFIX/root/usr/include/hdf5/openmpi" \
      HDF5_LIBDIR="$L/hdf5/openmpi" \
      CFLAGS="-I$L/openmpi/include -I$L/openmpi/include/openmpi" \
      LDFLAGS="-L$L -L$L/openmpi/lib -lmpi" MAX_JOBS="$(nproc 2>/dev/null || echo 4)"
    "$PY" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
      --target "$PREFIX/site" "$src" ) >> "$SETUP_LOG" 2>&1 || { log "h5py: build failed (setup.log)"; return 1; }
  h5py_mpi && log "h5py: built with MPI" || { log "h5py: built but get_config().mpi is False"; return 1; }
}

# ------------------------------------------------------------------ models
setup_models() {
  "$PY" "$ROOT/tools/gpu-bench.py" make-models --kit "$KIT" --prefix "$PREFIX" \
    $( [ "$CPU" = 1 ] && echo --cpu ) >> "$SETUP_LOG" 2>&1
}

# ------------------------------------------------------------------ environment report
report_env() {
  {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "mode: $( [ "$CPU" = 1 ] && echo "CPU rehearsal (SEMZO_GPU_KIT_CPU=1)" || echo GPU)"
    echo "host: $(uname -srm)"
    echo "os: $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}")"
    echo "glibc: $(ldd --version 2>/dev/null | head -1)"
    echo "git: $(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null || echo '?')"
    echo "prefix: $PREFIX"
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version \
      --format=csv,noheader 2>&1 | sed 's/^/gpu: /'
    "$PY" "$ROOT/tools/gpu-bench.py" env 2>&1
    for f in "$PREFIX"/models/*/KIT_WEIGHTS.txt; do
      [ -f "$f" ] && echo "model $(basename "$(dirname "$f")"): $(cat "$f")"
    done
    command -v ompi_info >/dev/null && echo "ompi cuda: $(ompi_info --parsable --all 2>/dev/null \
      | grep -m1 'mpi_built_with_cuda_support:value' || echo '?')"
  } > "$ENV_TXT" 2>&1
  return 0
}

# ------------------------------------------------------------------ tests and benchmarks
run_tests() {   # one pytest per file (each with its junit file, merged into tests.xml by the
  # summary), the end-to-end pipeline last: a timeout still leaves every finished file's results
  local files f rc worst=0 n=0
  files=$(cd "$ROOT" && ls tests/test_*gpu*.py 2>/dev/null | grep -v -e test_gpu_kit.py -e test_gpu_pipeline.py)
  files="$files tests/test_gpu_pipeline.py"
  mkdir -p "$OUTDIR/.junit"
  : > "$OUTDIR/tests.log"
  if [ "$CPU" != 1 ]; then   # the ZO kernels' module (0.8 MB of CUDA C) into CuPy's disk cache
    # once, before the 2-rank tests would compile it in every rank at the same time
    (cd "$ROOT" && "$PY" -c "import cupy; from semzo.zo import kernels_gpu as k; \
k._cupy_function(cupy.cuda.runtime.getDevice(), 'zo_zvec'); print('zo kernels compiled')") \
      >> "$OUTDIR/tests.log" 2>&1
  fi
  for f in $files; do
    [ -f "$ROOT/$f" ] || continue
    n=$((n + 1))
    echo "=== $f" >> "$OUTDIR/tests.log"
    # shellcheck disable=SC2086
    (cd "$ROOT" && "$PY" -m pytest -v -rs -p no:cacheprovider --durations=5 \
       --junitxml="$OUTDIR/.junit/$(printf %02d $n).xml" ${SEMZO_GPU_KIT_PYTEST_ARGS:-} "$f") \
       >> "$OUTDIR/tests.log" 2>&1
    rc=$?
    # 5: no test of this file selected (-k)
    if [ $rc != 0 ] && [ $rc != 5 ] && [ $worst = 0 ]; then worst=$rc; fi
  done
  return $worst
}

run_bench() {
  (cd "$ROOT" && "$PY" tools/gpu-bench.py run --prefix "$PREFIX" --out "$OUTDIR/bench.jsonl" \
     $( [ "$CPU" = 1 ] && echo --cpu ) ${SEMZO_GPU_KIT_BENCH_ARGS:-}) > "$OUTDIR/bench.log" 2>&1
}

summarize() {
  "$PY" "$ROOT/tools/gpu-bench.py" summary --out "$OUTDIR" --phases "$PHASES" \
    > /dev/null 2>> "$SETUP_LOG" || {
    # the summary must exist even if Python itself is broken
    { echo "# semzo GPU check: summary"; echo; echo "Python could not write the summary."
      echo; echo "| phase | status | seconds |"; echo "|---|---|---|"
      awk -F'\t' '{printf "| %s | %s | %s |\n", $1, $2, $3}' "$PHASES"; } > "$OUTDIR/summary.md"
  }
}

# phase_here NAME FUNCTION: a phase that must change this shell's environment (no timeout:
# each command inside it has its own limit)
phase_here() {
  local name=$1 t0 rc dt; shift
  t0=$(date +%s.%N)
  log "phase $name: start"
  "$@"; rc=$?
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  printf '%s\t%s\t%s\n' "$name" "$( [ $rc = 0 ] && echo ok || echo "failed (exit $rc)")" "$dt" >> "$PHASES"
  log "phase $name: exit $rc in ${dt}s"
  return 0
}

log "gpu-check: $WHAT into $OUTDIR (prefix $PREFIX, $( [ "$CPU" = 1 ] && echo CPU rehearsal || echo GPU))"
export ROOT OUTDIR CPU PREFIX KIT PY SETUP_LOG
export -f log verify_kit install_py deb_x build_h5py h5py_mpi unpack_mpi fix_links setup_models \
  run_tests run_bench
phase kit 60 bash -c verify_kit
phase python 120 bash -c install_py
phase_here mpi setup_mpi
[ "$WHAT" = bench ] || phase h5py-mpi "$H5PY_TIMEOUT" bash -c build_h5py
phase models "$SETUP_TIMEOUT" bash -c setup_models
report_env
[ "$WHAT" = bench ] || phase tests "$(left "$TESTS_TIMEOUT")" bash -c run_tests
[ "$WHAT" = tests ] || phase bench "$(left "$BENCH_TIMEOUT")" bash -c run_bench
summarize
rm -f "$PHASES"
log "gpu-check: done; $OUTDIR/summary.md"
cat "$OUTDIR/summary.md"
exit 0
