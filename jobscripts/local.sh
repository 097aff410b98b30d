#!/usr/bin/env bash
# semzo on one machine with mpirun (what `make demo-encoder` does with inputs/demo.toml;
# `make demo` runs the LLM deck inputs/llm.toml).
# EDIT: NP (ranks) and DECK, or pass them: NP=2 DECK=inputs/debian.toml jobscripts/local.sh
# The default deck simulates 2 switches x 2 nodes on one host, so NP must be 4 for it
# (or override: --set topology.ranks_per_node=1 --set topology.nodes_per_switch=1).
set -euo pipefail

# ---- SITE MODULES (EDIT) -------------------------------------------------------------------
# On a workstation with environment modules, uncomment and name the MPI and parallel HDF5 that
# mpi4py and h5py in .venv were built against (not needed after `make setup` on Debian):
# module load openmpi                 # SITE: MPI
# module load hdf5/parallel           # SITE: parallel HDF5
# module load cuda                    # SITE: CUDA, only for --set run.device=gpu with CuPy
# --------------------------------------------------------------------------------------------

cd "$(dirname "$0")/.."
NP=${NP:-4}
DECK=${DECK:-inputs/demo.toml}
export PYTHONUNBUFFERED=1             # log lines at once, in order
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
timeout -k 10 "${TIMEOUT:-3600}" mpirun -n "$NP" .venv/bin/python -m semzo run "$DECK" "$@"
