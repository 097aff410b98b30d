#!/usr/bin/env bash
# The GPU check of semzo in ONE command of at most 8 minutes, on the GPU machine, from the
# working tree plus the folder made by tools/gpu-pack.sh (.gpu/):
#
#   bash tools/gpu-check.sh OUTDIR
#
# Phases, in order of value, each under its own `timeout` and each appending its result to
# OUTDIR/summary.md as soon as it ends (a timeout of the whole command still returns every
# phase that finished):
#   setup       the kit checked, missing Python wheels, MPI (the h5py build with MPI starts in
#               the background here: only the checkpoint and pipeline phases need it)
#   env         GPU, driver, CUDA, CuPy, numba, MPI, h5py; the installed packages checked
#               against pyproject.toml's bounds (what differs is printed)
#   forward     forward parity CuPy vs NumPy, every family, float32 / float16 / bfloat16 (every
#               decoder family of the parity tests too); the sft and choice tasks (loss,
#               scores, greedy generations) on the device vs NumPy
#   zo-kernels  the ZO kernels' bits, CuPy (and numba.cuda) vs CPU; their argument checks
#   zo-step     the ZO step at 1 rank (full and LoRA, streamed and offloaded) vs the CPU step
#   kmeans      GPU k-means labels vs CPU labels at 1 and 2 ranks (a rank without rows)
#   fixes       the other defects of issue 35 (bind_gpu, allgather, encoder slots, type ids)
#   checkpoint  a checkpoint from device arrays, then a bit-exact resume (2 ranks, h5py MPI)
#   bench-forward, bench-zo, bench-offload   torch on the same GPU as the peer
#   pipeline    the 2-rank pipeline end to end with run.device = "gpu", the ZO modes at 1 and
#               2 ranks (MPI and parallel h5py: last)
#   bench-extra the forward's kernel profile, k-means, ZO pass and demo-llm benchmarks: only
#               when named in PHASES
#
# A GPU test that skips counts as a failure, as does a phase that selects no test or a
# benchmark item that gives no figure. OUTDIR gets at most 7 files: summary.md, env.txt,
# setup.log, tests.log, tests.xml, bench.log, bench.jsonl.
#
# Environment: DEADLINE (default 465 s: a phase gets at most what is left of it, less 10 s
# for the last words; a phase with under 20 s left is recorded "not run (no time left)");
# RESUME=FILE: the summary.md of an earlier call: its phases that read "ok" are skipped
# (setup and env run in every call: a machine keeps nothing);
# PHASES=a,b: only these phases (setup and env always run); SEMZO_GPU_KIT_K: the pytest -k of
# every test phase, ANDed with the phase's own (default: "not on_cpu" on the GPU, "on_cpu" on
# the CPU); SEMZO_GPU_KIT_BENCH_ONLY=a,b: only these benchmark items; SEMZO_GPU_KIT_CPU=1: the
# same phases on the CPU (xp=numpy, small sizes), the rehearsal tests/test_gpu_kit.py runs.
# KIT (default .gpu) the packed folder; PREFIX (default a fresh mktemp -d) where it is
# unpacked; H5PY_TIMEOUT seconds for the background build; PYTHON (default python3).
# SEMZO_GPU_KIT_FORCE_DEBS=1 / SEMZO_GPU_KIT_FORCE_H5PY=1: use the carried Open MPI / build
# h5py even where the machine's own work (rehearsals).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)

# the working tree's own hash (tracked and untracked files git does not ignore, path and
# content): the device tool copies the tree but not always the .git that names its commit
# (the first GPU run's summaries read the session's first commit); `tools/gpu-check.sh
# --tree-hash` here gives the hash of the tree at hand to compare with
tree_hash() {
  git -C "$ROOT" ls-files -z -co --exclude-standard 2>/dev/null | LC_ALL=C sort -z \
    | (cd "$ROOT" && xargs -0 sha256sum 2>/dev/null) | sha256sum | cut -c1-12
}
if [ "${1:-}" = --tree-hash ]; then tree_hash; exit 0; fi

OUTDIR=${1:-}
if [ -z "$OUTDIR" ] || [ $# -gt 1 ]; then
  echo "usage: tools/gpu-check.sh OUTDIR   (one command: every phase; see the header)" >&2; exit 2
fi
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
CPU=${SEMZO_GPU_KIT_CPU:-0}
KIT=${KIT:-.gpu}
PY=${PYTHON:-python3}
H5PY_TIMEOUT=${H5PY_TIMEOUT:-300}
DEADLINE=${DEADLINE:-465}
START=$(date +%s)
WHAT=all                     # build_h5py and setup_mpi: the pipeline needs parallel h5py
if [ -z "${SEMZO_GPU_KIT_K+x}" ]; then
  if [ "$CPU" = 1 ]; then SEMZO_GPU_KIT_K="on_cpu"; else SEMZO_GPU_KIT_K="not on_cpu"; fi
fi
PREFIX=${PREFIX:-$(mktemp -d /tmp/semzo-gpu.XXXXXX)}
mkdir -p "$PREFIX/site" "$PREFIX/root" "$PREFIX/models" "$PREFIX/bin" "$PREFIX/junit"
SUMMARY="$OUTDIR/summary.md"
SETUP_LOG="$OUTDIR/setup.log"
ENV_TXT="$OUTDIR/env.txt"
: > "$SETUP_LOG"
: > "$OUTDIR/tests.log"
: > "$OUTDIR/bench.log"
log() { printf '[gpu-check %s] %s\n' "$(date -u +%H:%M:%S)" "$*" | tee -a "$SETUP_LOG" >&2; }
elapsed() { echo $(( $(date +%s) - START )); }

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
    # the process means the carried one for mpi4py too. What the machine's own MPI is, and
    # whether it is CUDA-aware, is logged first (the carried one is not: a later call may
    # want the machine's for the CUDA-aware test alone)
    log "MPI: the machine's own: $(mpirun --version 2>&1 | head -1); $( { ompi_info --parsable --all 2>/dev/null | tr -d '\000' | awk '/_built_with_cuda_support:value:/ && !f {print; f=1}'; } || echo 'no ompi_info')"
    log "MPI: the machine's own works but its h5py is serial: the carried Open MPI serves both"
  fi
  log "MPI: none usable here (or SEMZO_GPU_KIT_FORCE_DEBS=1); unpacking Open MPI from $KIT/debs into $PREFIX/root"
  unpack_mpi || return 1
  have_mpi || { log "MPI: the unpacked Open MPI does not load (see above)"; return 1; }
  log "MPI: $("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), "").splitlines()[0])')"
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
    echo "tree: $(tree_hash) ($(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l) paths differ from that commit)"
    echo "prefix: $PREFIX"
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 \
        | sed 's/^/gpu: /'
      nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*' | head -1 | sed 's/^/driver /'
    else
      echo "gpu: no nvidia-smi"
    fi
    "$PY" "$ROOT/tools/gpu-bench.py" env 2>&1
    for f in "$PREFIX"/models/*/KIT_WEIGHTS.txt; do
      [ -f "$f" ] && echo "model $(basename "$(dirname "$f")"): $(cat "$f")"
    done
    command -v ompi_info >/dev/null && echo "ompi cuda: $(ompi_info --parsable --all 2>/dev/null \
      | grep -m1 'mpi_built_with_cuda_support:value' || echo '?')"
  } > "$ENV_TXT" 2>&1
  [ -s "$ENV_TXT" ] || { echo "- FAILED: no environment report"; return 1; }
  # what summary.md keeps of it: the machine, the stack, and every bound that differs
  grep -E '^(date|mode|gpu|driver CUDA|cupy|cuda driver major|os|glibc|python|numpy|numba|torch|transformers|h5py|mpi|git|tree|model |bounds)' \
    "$ENV_TXT" | sed 's/^/- /'
}

# ------------------------------------------------------------------ test and bench phases
pytest_phase() {   # pytest_phase NAME K FILE...: prints the phase's lines, exit 0 = ok
  local name=$1 k=$2 rc files=() f; shift 2
  for f in "$@"; do
    [ -f "$ROOT/$f" ] || continue
    # on the CPU, a file without *_on_cpu harnesses would only skip (module-level skips
    # ignore -k): it is the GPU's, not the rehearsal's
    if [ "$CPU" = 1 ] && ! grep -q "on_cpu" "$ROOT/$f"; then continue; fi
    files+=("$f")
  done
  [ -n "$k" ] && k="($k) and ($SEMZO_GPU_KIT_K)" || k=$SEMZO_GPU_KIT_K
  echo "=== $name: pytest -k '$k' ${files[*]}" >> "$OUTDIR/tests.log"
  if [ ${#files[@]} = 0 ]; then echo "- FAILED: none of the phase's test files is here"; return 1; fi
  (cd "$ROOT" && "$PY" -m pytest -v -rs -p no:cacheprovider --durations=5 \
     --junitxml="$PREFIX/junit/$name.xml" -k "$k" "${files[@]}") >> "$OUTDIR/tests.log" 2>&1
  rc=$?
  "$PY" "$ROOT/tools/gpu-bench.py" report --junit "$PREFIX/junit/$name.xml" \
    --merge "$OUTDIR/tests.xml" --rc "$rc"
}

bench_phase() {   # bench_phase NAME ITEM,...: prints the phase's lines, exit 0 = ok
  local name=$1 items=$2 only=${SEMZO_GPU_KIT_BENCH_ONLY:-} i keep=""
  if [ -n "$only" ]; then    # the intersection, in the phase's order
    for i in ${items//,/ }; do case ",$only," in *",$i,"*) keep="$keep,$i" ;; esac; done
    items=${keep#,}
  fi
  if [ -z "$items" ]; then echo "- FAILED: no benchmark item selected"; return 1; fi
  echo "=== $name: $items" >> "$OUTDIR/bench.log"
  case ",$items," in *",demo_llm_gpu,"*)   # the pipeline itself: collective HDF5 needs the
    # background h5py build (a short call reached it first: "h5py was built without MPI")
    wait_h5py 120 >> "$OUTDIR/bench.log" || true ;;
  esac
  (cd "$ROOT" && "$PY" tools/gpu-bench.py run --prefix "$PREFIX" --out "$OUTDIR/bench.jsonl" \
     --only "$items" $( [ "$CPU" = 1 ] && echo --cpu )) >> "$OUTDIR/bench.log" 2>&1
  "$PY" "$ROOT/tools/gpu-bench.py" report --bench "$OUTDIR/bench.jsonl" --items "$items"
}

wait_h5py() {   # the background h5py build (started by setup), waited for at most $1 s
  local n=0
  while [ ! -f "$PREFIX/h5py.done" ] && [ $n -lt "$1" ]; do sleep 2; n=$((n + 2)); done
  [ -f "$PREFIX/h5py.done" ] || { echo "- FAILED: the h5py build (MPI) is still running"; return 1; }
  [ "$(cat "$PREFIX/h5py.done")" = 0 ] || { echo "- FAILED: h5py with MPI is not available (setup.log)"; return 1; }
}

checkpoint_phase() {
  wait_h5py "$1" || return 1
  pytest_phase checkpoint "checkpoint" tests/test_gpu_pipeline.py
}

pipeline_phase() {
  wait_h5py "$1" || return 1
  pytest_phase pipeline "end_to_end or prefix_cache or modes or cuda_aware" \
    tests/test_gpu_pipeline.py tests/test_gpu_zo.py
}

setup_phase() {   # in this shell: MPI's variables must reach the later phases
  local bad=0
  verify_kit || bad=1
  timeout -k 5 120 bash -c install_py || bad=1
  setup_mpi || bad=1
  timeout -k 5 150 bash -c setup_models || { log "models: failed (setup.log)"; bad=1; }
  # parallel h5py in the background, on the machine's other cores, while the GPU phases run
  # (its own lines go to setup.log; stopped at the end if still running)
  ( timeout -k 10 "$H5PY_TIMEOUT" bash -c build_h5py & echo $! > "$PREFIX/h5py.pid"
    wait $!; echo $? > "$PREFIX/h5py.done" ) > /dev/null 2>&1 &
  return $bad
}

# ------------------------------------------------------------------ the phase runner
RESUMED=" "
if [ -n "${RESUME:-}" ] && [ -f "$RESUME" ]; then
  RESUMED=" $(sed -n 's/^## \([a-z0-9-]*\): ok .*/\1/p' "$RESUME" | tr '\n' ' ')"
fi
wanted() {   # wanted NAME: whether PHASES asks for it (bench-extra only when named)
  local name=$1
  case $name in setup|env) return 0 ;; esac
  if [ -n "${PHASES:-}" ]; then case ",$PHASES," in *",$name,"*) return 0 ;; *) return 1 ;; esac; fi
  [ "$name" != bench-extra ]
}
N_OK=0; N_FAIL=0; N_SKIP=0; FAILED=""
# phase NAME LIMIT FUNCTION [ARGS...]: runs FUNCTION ARGS under `timeout LIMIT` (LIMIT cut
# to what is left before DEADLINE), appends "## NAME: STATUS (S s ...)" and its lines
phase() {
  local name=$1 limit=$2 fn=$3 left t0 rc status dt out; shift 3
  if ! wanted "$name"; then return 0; fi
  case "$name:$RESUMED" in setup:*|env:*) ;; *" $name "*)   # setup and env: every call
    printf '## %s: ok in an earlier call (RESUME)\n\n' "$name" >> "$SUMMARY"; N_SKIP=$((N_SKIP + 1))
    return 0 ;;
  esac
  left=$(( DEADLINE - $(elapsed) - 10 ))
  case $name in setup|env) ;; *) [ "$left" -lt "$limit" ] && limit=$left ;; esac
  if [ "$limit" -lt 20 ]; then
    printf '## %s: not run (no time left: %s s of %s used)\n\n' "$name" "$(elapsed)" "$DEADLINE" >> "$SUMMARY"
    N_FAIL=$((N_FAIL + 1)); FAILED="$FAILED $name"
    return 0
  fi
  log "phase $name: start (limit ${limit}s)"
  t0=$(date +%s.%N)
  out="$PREFIX/phase.out"
  if [ "$fn" = setup_phase ]; then
    "$fn" "$@" > "$out" 2>&1; rc=$?
  else
    timeout -k 10 "$limit" bash -c '"$@"' _ "$fn" "$@" > "$out" 2>&1; rc=$?
  fi
  dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f", b - a}')
  case $rc in
    0) status=ok; N_OK=$((N_OK + 1)) ;;
    124|137) status="FAILED: timeout after ${limit} s"; N_FAIL=$((N_FAIL + 1)); FAILED="$FAILED $name" ;;
    *) status="FAILED (exit $rc)"; N_FAIL=$((N_FAIL + 1)); FAILED="$FAILED $name" ;;
  esac
  { printf '## %s: %s (%s s, limit %s s, at %s s)\n\n' "$name" "$status" "$dt" "$limit" "$(elapsed)"
    cat "$out"; echo; } >> "$SUMMARY"
  log "phase $name: $status in ${dt}s"
  return 0
}

{
  echo "# semzo GPU check: summary"
  echo
  echo "$( [ "$CPU" = 1 ] && echo "CPU rehearsal (SEMZO_GPU_KIT_CPU=1)" || echo GPU) run of" \
    "\`tools/gpu-check.sh\`, started $(date -u +%Y-%m-%dT%H:%M:%SZ), deadline ${DEADLINE} s," \
    "commit $(git -C "$ROOT" log -1 --format=%h 2>/dev/null || echo '?'), tree $(tree_hash)."
  echo "Each phase below was appended when it ended. A skipped test, a phase that selected"
  echo "no test and a benchmark item without a figure count as failures. pytest -k:"
  echo "\`$SEMZO_GPU_KIT_K\`.${RESUME:+ Resumed from $RESUME: skipped$RESUMED.}"
  echo
} > "$SUMMARY"

export ROOT OUTDIR CPU PREFIX KIT PY SETUP_LOG ENV_TXT WHAT SEMZO_GPU_KIT_K
export -f log tree_hash verify_kit install_py deb_x build_h5py h5py_mpi unpack_mpi fix_links setup_models \
  pytest_phase bench_phase wait_h5py checkpoint_phase pipeline_phase report_env
log "gpu-check into $OUTDIR (prefix $PREFIX, $( [ "$CPU" = 1 ] && echo CPU rehearsal || echo GPU), deadline ${DEADLINE}s)"
phase setup 300 setup_phase
# the setup phase exported MPI's variables in this shell; the later phases inherit them
[ -f "$PREFIX/env.sh" ] && . "$PREFIX/env.sh"
phase env 60 report_env
if [ "$CPU" != 1 ]; then   # the ZO kernels' module (0.8 MB of CUDA C) into CuPy's disk cache
  # once, before the 2-rank tests would compile it in every rank at the same time
  (cd "$ROOT" && timeout -k 5 120 "$PY" -c "import cupy; from semzo.zo import kernels_gpu as k; \
k._cupy_function(cupy.cuda.runtime.getDevice(), 'zo_zvec'); print('zo kernels compiled')") \
    >> "$OUTDIR/tests.log" 2>&1 &
fi
phase forward 150 pytest_phase forward "" tests/test_gpu_model.py tests/test_decoder_gpu.py \
  tests/test_model_gpu.py tests/test_gpu_llm_tasks.py tests/test_gpu_families.py
phase zo-kernels 90 pytest_phase zo-kernels "kernel or zvec or checksum" tests/test_gpu_zo.py \
  tests/test_gpu_fixes.py
phase zo-step 120 pytest_phase zo-step \
  "engine or streamed or offload or replay or feature" tests/test_gpu_zo.py
phase kmeans 90 pytest_phase kmeans "" tests/test_gpu_kmeans.py
phase fixes 60 pytest_phase fixes "not kernel" tests/test_gpu_fixes.py
phase checkpoint 150 checkpoint_phase 90
BENCH_FORWARD=smollm2_forward_bf16,smollm2_forward_bf16_tc,minilm_forward_f16,minilm_forward_f32
BENCH_ZO=minilm_zo_step_over_2fwd,minilm_zo_vs_mezo,smollm2_zo_lora_vs_mezo
BENCH_ZO=$BENCH_ZO,smollm2_zo_full_vs_mezo,smollm2_zo_full_tc_vs_mezo
phase bench-forward 90 bench_phase bench-forward "$BENCH_FORWARD"
phase bench-zo 150 bench_phase bench-zo "$BENCH_ZO"
phase bench-offload 240 bench_phase bench-offload offload_vs_resident,largest_model_capped,largest_model
phase pipeline 150 pipeline_phase 60
phase bench-extra 150 bench_phase bench-extra profile_forward,kmeans_vs_torch_floor,zo_pass_gpu,demo_llm_gpu
{
  echo "## overall: $N_OK ok, $N_FAIL failed, $N_SKIP ok in an earlier call; $(elapsed) s" \
    "(deadline $DEADLINE s)"
  if [ -n "$FAILED" ]; then
    echo; echo "Failed or not run:$FAILED. With RESUME=<this summary.md> a next call runs only these."
  fi
} >> "$SUMMARY"
if [ ! -f "$PREFIX/h5py.done" ] && [ -f "$PREFIX/h5py.pid" ]; then
  kill "$(cat "$PREFIX/h5py.pid")" 2>/dev/null     # the background h5py build (its timeout)
  log "h5py build still running at the end: stopped"
fi
log "gpu-check: done in $(elapsed)s; $SUMMARY"
cat "$SUMMARY"
exit 0
