# dcp_optim developer commands.  Everything runs from a local virtualenv that
# `make venv` creates with torch==2.13.0 (a CPU build) and the package built
# in place; nothing outside this directory is required.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.deps-stamp
export DCP_OPTIM_WERROR ?= 1
export OMP_NUM_THREADS ?= 1

.PHONY: all venv build build-debug test test-fast test-dist demo bench clean

all: build

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: a bare "torch" requirement would pull a
	# several-GB CUDA build.
	$(PIP) install -q "$(TORCH)"
	$(PIP) install -q numpy "pytest>=8" pytest-timeout hypothesis
	touch $(STAMP)

venv: $(STAMP)

# Builds the C core in place (dcp_optim/_dcp_optim*.so) and installs the
# package in editable mode without touching dependencies.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	$(PIP) install -q --no-build-isolation --no-deps -e .

build-debug: $(STAMP)
	DCP_OPTIM_DEBUG=1 $(PY) setup.py -q build_ext --inplace --force

test: build
	$(PY) -m pytest -q tests

test-fast: build
	$(PY) -m pytest -q -m "not dist and not slow" tests

demo: build
	$(PY) -m dcp_optim.demo

bench: build
	$(PY) -m benchmarks

clean:
	rm -rf build dist *.egg-info dcp_optim/*.so .pytest_cache .hypothesis
	find . -name __pycache__ -prune -exec rm -rf {} +
