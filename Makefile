# One-command set-up: `make run` and `make test` create .venv if missing, install the
# project (re-installing only when pyproject.toml or constraints.txt changed), then act.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.runlab-installed
ARGS ?=
# Two workers, each taking whole test files (README steps stay in order): the suite is mostly
# single-threaded subprocesses, so on 2 cores this nearly halves its time. The files go out in
# tests/conftest.py's order, longest first (xdist would order them by their number of tests, and a
# long file of few tests given out last ran alone at the end).
PYTEST_ARGS ?= -n 2 --dist loadfile --no-loadscope-reorder

.PHONY: install run test bench clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[dev,wandb,notebook]"
	@# pip compiles every package it installs but an editable one: where PYTHONDONTWRITEBYTECODE is set,
	@# Python would compile framework/ anew at every start (about 0.1 s). A stale file is simply recompiled.
	$(PY) -m compileall -q framework hydra_plugins
	@touch $(STAMP)

run: install
	$(PY) run.py $(ARGS)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	$(PY) benchmarks/step_overhead.py

clean:
	rm -rf $(VENV) outputs multirun
