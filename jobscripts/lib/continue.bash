# shellcheck shell=bash
# Sourced by the batch job scripts (jobscripts/slurm-*.sbatch, jobscripts/pbs.pbs): what an
# attempt of a job that was requeued (Slurm) or rerun (PBS) passes to `semzo run`, so that it
# goes on from what the earlier attempts of the SAME job completed, and nothing else.
#
#   semzo_continue JOBID DECK [--set SECTION.KEY=VALUE ...]    (the --set of the run itself)
#
# sets SEMZO_AGAIN (array: extra arguments for `semzo run`) and SEMZO_STAMP (a file path).
#
# The first attempt of job JOBID creates the stamp <run.output_dir>/.semzo-job-JOBID and runs
# every stage of the deck. A later attempt finds the stamp and
#   - skips the leading stages whose output file (topology.h5, embeddings.h5, clusters.h5,
#     shards.h5) is newer than the stamp: this job completed them (semzo renames an output
#     file only once it is complete; the files of an earlier job in the same folder are older
#     and do not count): --set 'run.stages=[...]' lists the rest. So a job requeued before its
#     place stage finished runs place (and whatever else is missing) again before fine-tuning,
#     instead of starting the finetune stage without shards.h5;
#   - passes --resume only when this job wrote a checkpoint (a ckpt-*.h5 newer than the stamp
#     in the checkpoint folder); otherwise the finetune stage starts from the model rather than
#     from a checkpoint an earlier job left in that folder.
# The job script removes the stamp once the run succeeds (exit 0); after a failure it stays, so
# that an attempt Slurm or PBS starts again after a node failure still finds it.
# Reading the deck needs the venv (python with semzo importable); if the deck does not load,
# SEMZO_AGAIN stays empty and `semzo run` itself reports the error.

semzo_continue() {
  local job=$1 deck=$2
  shift 2
  local resolved=()
  mapfile -t resolved < <(python - "$deck" "$@" <<'PY' 2>/dev/null
import sys
from pathlib import Path

from semzo.deck import load

args = sys.argv[2:]
sets = [args[i + 1] for i in range(len(args) - 1) if args[i] == "--set"]
d = load(sys.argv[1], sets, check_inputs=False)
print(d.run.output_dir)
print(d.checkpoint.dir or Path(d.run.output_dir) / "checkpoints")
print(" ".join(d.run.stages))
PY
  )
  SEMZO_AGAIN=()
  SEMZO_STAMP=
  if [ "${#resolved[@]}" -ne 3 ]; then return 0; fi
  local out=${resolved[0]} ckdir=${resolved[1]} stages=()
  read -r -a stages <<< "${resolved[2]}"
  SEMZO_STAMP="$out/.semzo-job-$job"
  if [ ! -e "$SEMZO_STAMP" ]; then              # the first attempt of this job
    mkdir -p "$out" && touch "$SEMZO_STAMP"
    return 0
  fi
  local -A made=([topology]=topology.h5 [embed]=embeddings.h5 [cluster]=clusters.h5
                 [place]=shards.h5)
  local i=0 file
  while [ "$i" -lt "${#stages[@]}" ]; do
    file=${made[${stages[$i]}]:-}
    if [ -z "$file" ] || ! [ "$out/$file" -nt "$SEMZO_STAMP" ]; then break; fi
    i=$((i + 1))
  done
  if [ "$i" -ge "${#stages[@]}" ]; then i=$((${#stages[@]} - 1)); fi  # all done: the last again
  if [ "$i" -gt 0 ]; then
    local rest=("${stages[@]:i}") list
    list=$(printf '"%s",' "${rest[@]}")
    SEMZO_AGAIN+=(--set "run.stages=[${list%,}]")
  fi
  if [ -d "$ckdir" ] && \
     [ -n "$(find "$ckdir" -maxdepth 1 -name 'ckpt-*.h5' -newer "$SEMZO_STAMP" -print -quit)" ]
  then
    SEMZO_AGAIN+=(--resume)
  fi
  return 0
}
