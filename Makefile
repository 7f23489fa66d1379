# Every target sets up what it needs first. `make help` lists them.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPES := $(notdir $(patsubst %/,%,$(dir $(wildcard recipes/*/train.py))))

ARGS ?=
NPROC ?= 1
SOURCE ?=
WEIGHTS ?=
EXPERIMENT ?=
FORMAT ?=
PYTEST_ARGS ?=
# pytest-xdist workers: one more than the cores this process may use. Part of the suite waits (on
# SLURM, on paced runs, on torchrun's stop windows) and the extra worker keeps the cores busy then.
WORKERS ?= $(shell $(PYTHON) -c 'import os; print(len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1)')
RUN ?=
WHICH ?=
SPLIT ?=
DEVICE ?= cuda

.PHONY: help setup lint test docs eval average stress-exit mutation-check bench bench-peers gpu-check compare export predict new-recipe doctor isc-rehearse clean FORCE

help: ## List the targets
	@echo "Usage: make <target> [ARGS=\"hydra overrides\"] [NPROC=n] [SOURCE=path] [RUN=run dir]"
	@echo
	@grep -hE '^[a-zA-Z_%-]+:.*?## ' $(MAKEFILE_LIST) | sort | \
		awk 'BEGIN {FS = ":.*?## "}; {printf "  %-22s %s\n", $$1, $$2}'
	@echo
	@echo "Recipes: $(RECIPES)"

setup: $(STAMP) ## Create .venv and install the project with pip (quick when done)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	@touch $@

prep-%: $(STAMP) FORCE ## Prepare a recipe's data and pretrained weights (SOURCE=, WEIGHTS=<dir or file>, EXPERIMENT=<preset>, FORMAT=shards)
	$(PY) -m data_prep.$* $(if $(SOURCE),--source "$(SOURCE)") $(if $(WEIGHTS),--weights "$(WEIGHTS)") \
		$(if $(FORMAT),--format "$(FORMAT)") $(if $(EXPERIMENT),"+experiment=$(EXPERIMENT)")

# A recipe whose training prepares its data first says so in recipes/<recipe>/recipe.mk
# (`train-<recipe>: prep-<recipe>`); make new-recipe copies it with the recipe.
include $(wildcard recipes/*/recipe.mk)

train-%: $(STAMP) FORCE ## Train a recipe (ARGS="key=value ...", NPROC=n for torchrun)
ifeq ($(NPROC),1)
	$(PY) -m recipes.$*.train $(ARGS)
else
	$(PY) -m cluster.torchrun --standalone --nproc-per-node $(NPROC) -m recipes.$*.train $(ARGS)
endif

search-%: $(STAMP) FORCE ## Hyperparameter search: [SPACE=<file|preset>] TRIALS=n [STUDY=<dir>] [ARGS=...] [NPROC=n] [STORAGE=<db url>] [REPORT=1]
	$(PY) -m tools.search $* --study "$(or $(STUDY),runs/$*/search)" $(if $(SPACE),--space "$(SPACE)") \
		$(if $(TRIALS),--trials "$(TRIALS)") $(if $(STORAGE),--storage "$(STORAGE)") --nproc "$(NPROC)" \
		$(if $(filter 1,$(REPORT)),--report) -- $(ARGS)

# The one-checkpoint tools read RUN=<run dir | its checkpoint folder | one checkpoint>; WHICH=latest|best|<name>.
CHECKPOINT_ARGS = "$(or $(RUN),$(error RUN=<run dir | checkpoint folder | checkpoint> is required))" \
	$(if $(WHICH),--which "$(WHICH)")

eval: $(STAMP) FORCE ## Evaluate a checkpoint (the recipe is the run's): RUN=<run dir> [WHICH=latest|best|<name>] [SPLIT=...] [ARGS=...] [NPROC=n]
ifeq ($(NPROC),1)
	$(PY) -m common.after_training.evaluate $(CHECKPOINT_ARGS) $(if $(SPLIT),--split "$(SPLIT)") $(ARGS)
else
	$(PY) -m cluster.torchrun --standalone --nproc-per-node $(NPROC) -m common.after_training.evaluate $(CHECKPOINT_ARGS) \
		$(if $(SPLIT),--split "$(SPLIT)") $(ARGS)
endif

eval-%: eval ## The same as make eval (kept for the recipe-named habit)
	@:

export: $(STAMP) FORCE ## Weights as safetensors + metadata.json: RUN=<run dir> [WHICH=latest|best|<name>] [OUT=dir] [ARGS=...]
	$(PY) -m common.after_training.export $(CHECKPOINT_ARGS) $(if $(OUT),--out "$(OUT)") $(ARGS)

predict: $(STAMP) FORCE ## Predict image files, a CSV row each: RUN=<run dir|export> INPUT=<folder|list.txt|image> [OUT=dir] [WHICH=...] [TOPK=5] [ARGS=...]
	$(PY) -m common.after_training.predict $(CHECKPOINT_ARGS) "$(or $(INPUT),$(error INPUT=<folder | list.txt | image> is required))" \
		$(if $(OUT),--out "$(OUT)") $(if $(TOPK),--topk "$(TOPK)") $(ARGS)

average: $(STAMP) FORCE ## Average kept checkpoints into <checkpoints>/average-last-k (or -best-k): RUN=<run dir> LAST=k|BEST=k [BN_BATCHES=n] [ARGS=...]
	$(PY) -m common.after_training.average "$(or $(RUN),$(error RUN=<run dir | checkpoint folder> is required))" \
		$(if $(LAST),--last "$(LAST)") $(if $(BEST),--best "$(BEST)") $(if $(BN_BATCHES),--bn-batches "$(BN_BATCHES)") $(ARGS)

lint: $(STAMP) ## Check style and imports with ruff (settings in pyproject.toml)
	$(VENV)/bin/ruff check .

test: lint ## Lint, then run the test suite on every core, one worker more (CPU, offline; WORKERS=n, PYTEST_ARGS=...)
	$(PY) -m pytest -n $(WORKERS) --dist loadgroup $(PYTEST_ARGS)

docs: $(STAMP) ## Build the docs/ pages into a site in site/ with MkDocs Material (mkdocs build --strict)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

stress-exit: $(STAMP) ## Launch two kinds of 2-rank run TIMES times each (default 30): none may abort at exit (not in make test)
	$(PY) -m tests.stress_exit --runs "$(or $(TIMES),30)"

mutation-check: $(STAMP) ## Break the code on purpose and check the tests notice: [ONLY="ids"] (python -m tools.mutation_check --list)
	$(PY) -m tools.mutation_check $(if $(ONLY),--only $(ONLY)) $(ARGS)

bench: $(STAMP) ## Measure loop overhead, checkpoint stall and throughput; writes benchmarks/RESULTS.md
	$(PY) -m benchmarks.run $(ARGS)

# gpu-check takes .venv's Python where there is one, else python3: a GPU machine's own Python with the
# wheels docs/benchmarks.md names (no make setup there; gpu-check names what is missing in one line).
GPU_CHECK_PY = $(if $(wildcard $(PY)),$(PY),python3)

gpu-check: FORCE ## Every GPU check and figure in one command, recorded in benchmarks/RESULTS.md (ARGS=--quick: checks only; DEVICE=cpu: tiny)
	$(GPU_CHECK_PY) -m benchmarks.gpu_check --device $(DEVICE) $(ARGS)

bench-peers: FORCE ## On a GPU: timm_imagenet and the ViT-L step side by side with timm's train.py and benchmark.py: TIMM=<pytorch-image-models checkout> [ARGS=--tiny]
	$(GPU_CHECK_PY) -m benchmarks.peers $(if $(TIMM),--timm "$(TIMM)") $(ARGS)

compare: $(STAMP) ## Table and curves of finished runs: [RUNS="runs/*/*"] [OUT=runs/compare] [ARGS=...]
	$(PY) -m tools.compare $(or $(RUNS),"runs/*/*") --out "$(or $(OUT),runs/compare)" $(ARGS)

new-recipe: $(STAMP) ## Copy a recipe with its config and tests: NAME=x [FROM=fashion_mnist]
	$(PY) -m tools.new_recipe --name "$(NAME)" --from "$(or $(FROM),fashion_mnist)"

doctor: $(STAMP) ## Check this machine as cluster/launch.sh would: Python env, GPUs, configs, data, TCP, all-reduce
	$(PY) -m cluster.doctor $(ARGS)

isc-rehearse: $(STAMP) ## Rehearse an ISC experiment with its artifact sync: RECIPE=r [CYCLES=5] [CYCLE_S=90] [SYNC_S=600] [ARGS="--data DIR -- overrides"]
	$(PY) -m tools.isc_rehearse "cluster/isc/$(RECIPE).isc" --cycles "$(or $(CYCLES),5)" --cycle-seconds "$(or $(CYCLE_S),90)" \
		$(if $(SYNC_S),--sync-seconds "$(SYNC_S)") $(ARGS)

clean: ## Remove runs/, outputs/, site/ and caches (keeps data/ and .venv)
	rm -rf runs outputs multirun site .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

FORCE:
