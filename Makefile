# speech_assets: `make demo`, `make test`, `make ui` work on a fresh machine (they create .venv).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export DAGSTER_HOME ?= $(CURDIR)/data/dagster_home
export SPEECH_ASSETS_DATA_DIR ?= $(CURDIR)/data/out
# Some machines (this development machine among them) set PYTHONDONTWRITEBYTECODE=1: then no
# interpreter keeps the bytecode it compiles, and each one compiles torch, dagster and the code
# location again, ~2.5 s of every start on 2 cores (docs/BENCHMARKS.md, "Interpreter start-up").
# The suite and `make ui` start hundreds of interpreters (run workers, torchrun ranks, Flower
# nodes, CLI calls), so under make the venv keeps what Python compiles on first import.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install demo test test-all ui mlflow bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	# plain pip, not uv: torch 2.14.1 comes from the local wheel store on this kind of machine
	# --no-compile: Python compiles what is imported on first use; pip would compile all ~20k files
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	touch $(STAMP)

# Materializes the whole asset graph with the documented `dagster asset materialize` commands.
demo: install
	PATH="$(abspath $(BIN)):$$PATH" scripts/materialize_all.sh

# What CI runs: every test not marked `slow` (real Dagster instances, torchrun, Flower, Postgres and
# MLflow, on small data, with few interpreter start-ups), in two pytest-xdist workers (figures:
# docs/BENCHMARKS.md, current table). Each module stays on one worker (its fixtures are built once),
# the modules that start from the sample build share one, the heaviest go first (MODULE_SECONDS in
# speech_assets_tests/conftest.py) so that the two workers end together, and OpenMP threads wait
# passively (two workers keep both cores busy); PYTEST_WORKERS=0 runs it in this process.
# `ruff format --check` and `ruff check` first (settings in pyproject.toml, about a second), then `dg check defs`:
# the code location loads and validates in seconds (on a throwaway instance: DAGSTER_HOME unset) before
# minutes of tests.
PYTEST_WORKERS ?= 2
test: install
	$(BIN)/ruff format --check --quiet .
	$(BIN)/ruff check --quiet .
	env -u DAGSTER_HOME $(BIN)/dg check defs
	$(BIN)/python -m pytest -m "not slow" -n $(PYTEST_WORKERS) --dist loadscope

# Everything, the `slow` tests too: the documented demo commands end to end through the CLI, the
# webserver and daemon, kill -9 of CLI runs, multi-node torchrun, the browser test (Debian chromium).
test-all: install
	scripts/ensure_test_tools.sh
	$(BIN)/python -m pytest

# The web UI, on loopback only unless you pass UI_HOST=0.0.0.0 deliberately, with the daemon (sensors,
# automation, run queue: their pace is set in dagster.yaml and speech_assets/defs/automation.py,
# docs/OPERATIONS.md, "Fresh data"); ensure_dagster_home.sh refreshes an unedited $DAGSTER_HOME/dagster.yaml.
# `dg dev`, as Dagster 1.13 asks (`dagster dev` warns that it is superseded), run from $DAGSTER_HOME:
# it warns about a dagster.yaml in its working folder that is not $DAGSTER_HOME's, and the repository's
# dagster.yaml is only what ensure_dagster_home.sh copies there.
UI_HOST ?= 127.0.0.1
UI_PORT ?= 3000
ui: install
	PATH="$(abspath $(BIN)):$$PATH" scripts/ensure_dagster_home.sh
	cd "$$DAGSTER_HOME" && exec "$(abspath $(BIN))/dg" dev -w "$(CURDIR)/workspace.yaml" -h $(UI_HOST) -p $(UI_PORT)

# The MLflow UI over the local store (runs, metrics, checkpoints), on loopback only. It first prints
# the link to the speech_assets experiment's runs table (creating the experiment in a new store):
# MLflow 3.17's UI opens an experiment on its GenAI traces unless the link asks for the runs. Without
# the server's GenAI job runner (8 more processes, a slower start): this project submits no such jobs.
MLFLOW_PORT ?= 5000
mlflow: install
	@mkdir -p "$(SPEECH_ASSETS_DATA_DIR)"
	@MLFLOW_PORT=$(MLFLOW_PORT) $(BIN)/python -c "import sys; from speech_assets.train.tracking import experiment_runs_table; \
		print('MLflow runs (every model, tagged by mode):', experiment_runs_table(sys.argv[1]), flush=True)" \
		"sqlite:///$(SPEECH_ASSETS_DATA_DIR)/mlflow.db"
	exec env MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false $(BIN)/mlflow ui --backend-store-uri "sqlite:///$(SPEECH_ASSETS_DATA_DIR)/mlflow.db" \
		--default-artifact-root "$(SPEECH_ASSETS_DATA_DIR)/mlartifacts" --host 127.0.0.1 --workers 1 --port $(MLFLOW_PORT)

bench: install
	$(BIN)/python bench/manifest.py
	$(BIN)/python bench/features.py
	$(BIN)/python bench/kmeans.py
	$(BIN)/python bench/train.py
	$(BIN)/python bench/fresh_data.py

clean:
	rm -rf data/out data/dagster_home
