#!/bin/bash
# Every CPU figure of issue 36 in one sitting, each benchmark alone, one after another:
# the decoder forward (float32 three times, spread over the sitting, and bfloat16 storage with
# float32 and with bfloat16 GEMMs; the bfloat16 GEMM alone against torch's),
# checkpoint save/load and the training time a checkpoint costs (4 ranks), the z pass, the ZO
# step (MiniLM; SmolLM2 in bfloat16), token generation (llama.cpp too when make
# bench-llamacpp has built it), the embedding and k-means. About 20 minutes on 2 cores.
# Run from the repository root after `make setup-test data/fortunes.jsonl`:
#
#     bash bench/cpu_sitting.sh [OUT] [BEFORE]
#
# OUT: the results file (default runs/bench/cpu_sitting.txt). BEFORE: a checkout of another
# commit (`git worktree add /tmp/before <commit>`) whose decoder is measured in the same
# sitting, between the first two float32 runs of this tree's (the "before and after" the issue
# asks for). Each section ends with its exit code, the time and the load average, so a noisy
# spell shows. Nothing here runs in `make test`.
set -u
cd "$(dirname "$0")/.."
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
    OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
PY=${PY:-$PWD/.venv/bin/python}
OUT=${1:-runs/bench/cpu_sitting.txt}
BEFORE=${2:-}
mkdir -p "$(dirname "$OUT")"
# absolute: the BEFORE run appends from inside the other checkout (a relative OUT put its
# figures in that checkout's file: the thirty-fifth session's sitting has an empty "before")
OUT=$(realpath "$(dirname "$OUT")")/$(basename "$OUT")
note() { echo "(rc=$1, $(date +%T), $(uptime | sed 's/.*load/load/'))" >> "$OUT"; echo >> "$OUT"; }
run() {
    echo "## $*" >> "$OUT"
    timeout 900 "$@" 2>&1 | grep -v -E "Loading weights|it/s\]|Writing model" >> "$OUT"
    note "${PIPESTATUS[0]}"
}
echo "# started $(date), HEAD $(git rev-parse --short HEAD), $(grep -m1 'model name' /proc/cpuinfo)" > "$OUT"
run "$PY" bench/decoder.py --repeat 8
if [ -n "$BEFORE" ]; then
    echo "## before ($(git -C "$BEFORE" rev-parse --short HEAD)): bench/decoder.py --repeat 8" >> "$OUT"
    model=$PWD/models/smollm2-135m-instruct
    (cd "$BEFORE" && PYTHONPATH="$PWD/src" timeout 900 "$PY" bench/decoder.py --repeat 8 \
        --model "$model" 2>&1 | grep -v -E "Loading weights|it/s\]" >> "$OUT"
        exit "${PIPESTATUS[0]}")
    note "$?"
fi
run "$PY" bench/decoder.py --repeat 8
run "$PY" bench/decoder.py --repeat 8 --dtype bfloat16
run "$PY" bench/decoder.py --repeat 8 --dtype bfloat16 --matmul bfloat16
run "$PY" bench/gemm_bf16.py --repeat 7
run timeout 900 mpirun -n 4 "$PY" bench/checkpoint.py --repeat 3
run "$PY" bench/zo_pass.py
run "$PY" bench/zo_step.py --reps 3
run "$PY" bench/zo_step.py --model smollm2 --sets all --dtype bfloat16 --matmul bfloat16 --reps 2
if [ -x .venv-bench/bin/python ]; then
    run "$PY" bench/generate.py --peer llamacpp
else
    run "$PY" bench/generate.py
fi
run "$PY" bench/embed.py --n 1000 --threads 2
run timeout 900 mpirun -n 2 "$PY" bench/kmeans.py
run "$PY" bench/decoder.py --repeat 8
echo "# ended $(date)" >> "$OUT"
echo "wrote $OUT"
