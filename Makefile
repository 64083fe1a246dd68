# Set-up and the two entry points of the README: `make demo` and `make test`.
# Each creates .venv on first use and installs what parsat needs, with torch
# as the CPU build from the pinned version (never a CUDA build in CI).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.parsat-installed

.PHONY: setup demo test test-all

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# graphviz's `dot` draws plans (`parsat show -o plan.svg`); best effort:
	@# without it `parsat show` still writes .dot files.
	@command -v dot >/dev/null || { [ "$$(id -u)" = 0 ] && apt-get update -qq >/dev/null && \
	  apt-get install -y -qq graphviz >/dev/null; } || echo "note: graphviz not installed; parsat show writes .dot only"
	touch $(STAMP)

setup: $(STAMP)

# The main job: prove every shipped rule, measure this machine (once per
# host: the file is reused), optimize the 2-layer MLP for two of its ranks,
# explain the plan, and train with it for 20 steps on 2 CPU ranks, checked
# against a single process; `parsat run` prints the measured step beside the
# predicted one. The `cpu` preset is not this box: priced on it, the plan's
# step would be another machine's.
HOST_MACHINE := out/machine-$(shell hostname).json

$(HOST_MACHINE): $(STAMP)
	mkdir -p out
	$(BIN)/parsat calibrate --machine this-box --nproc 2 -o $(HOST_MACHINE)

demo: $(STAMP) $(HOST_MACHINE)
	$(BIN)/parsat verify rules/
	$(BIN)/parsat optimize mlp --devices 2 --machine $(HOST_MACHINE) -o out/mlp-plan.json
	$(BIN)/parsat explain out/mlp-plan.json
	$(BIN)/parsat run out/mlp-plan.json --nproc 2 --steps 20 --check

# Two pytest workers (pytest-xdist): the suite is mostly single-threaded Python, and CI has 2 cores. Each
# file's tests on one worker (`--dist loadfile`): a module's fixtures (a proved corpus, a searched plan, a
# trained model) are then built once, not once on each worker that drew one of its tests (-14% CPU on the
# modules with such fixtures, benchmarks/suite_time.md).
TEST := $(BIN)/python -m pytest -q -n 2 --dist loadfile

test: $(STAMP)
	$(TEST)

test-all: $(STAMP)
	$(TEST) -m ''
