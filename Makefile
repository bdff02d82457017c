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

.PHONY: all venv build build-debug test test-fast test-dist test-gpu demo bench bench-targets clean

all: build

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# One resolve for everything, torch pinned on the same line: a bare
	# "torch" requirement anywhere would pull a several-GB CUDA build.
	# --no-compile: pip would byte-compile every file it installs (torch,
	# transformers and lightning hold thousands); Python compiles what the
	# tests import, on first import (see the warm-up below).  One call
	# instead of one per group took pip from about 185 s to 57-66 s here,
	# with the same versions.
	#   numpy, pytest, pytest-timeout, hypothesis: the test suite;
	#   accelerate: the client test drives its FSDP save/load helpers;
	#   matplotlib: the benchmark plot;
	#   lightning, torchtune, torchao, ai2-olmo-core: trainers whose
	#     checkpoint code tests/tools/test_trainers.py runs through
	#     dcp_optim.patch() (torchao 0.15.0 is the newest torchao torchtune
	#     0.6.1 imports with);
	#   transformers: tiny GPT-2/Llama/BERT built from local configs in the
	#     module corpus (tests/unit/test_module_corpus.py);
	#   pytorch-optimizer ... heavyball: the optimizer corpus
	#     (tests/unit/test_optim_corpus.py);
	#   peft: adapters over a frozen base (tests/unit/test_peft.py,
	#     tests/distributed/test_peft.py; 0.18.1 is the newest peft that
	#     imports beside torchao 0.15.0);
	#   mypy: make lint-mypy checks against torch's own hints;
	#   build: the sdist and wheel of make test-wheel;
	#   setuptools>=77: make build's in-place build reads pyproject.toml's
	#     SPDX license (PEP 639); venv's own setuptools (65 on 3.11) rejects
	#     it, and only some torch releases happen to pull a newer one.
	$(PIP) install -q --no-compile "$(TORCH)" "setuptools>=77" \
	    numpy "pytest>=8" pytest-timeout hypothesis accelerate==1.15.0 matplotlib \
	    lightning==2.6.6 torchtune==0.6.1 torchao==0.15.0 ai2-olmo-core==3.0.0 \
	    transformers==5.24.0 \
	    pytorch-optimizer==4.1.0 lion-pytorch==0.2.5 schedulefree==1.4.1 prodigyopt==1.1.2 \
	    bitsandbytes==0.50.2 torch-optimizer==0.3.0 galore-torch==1.0 apollo-torch==1.0.3 adam-mini==1.1.1 \
	    came-pytorch==0.1.3 torch-optimi==0.2.1 dadaptation==3.2 adan-pytorch==0.1.0 \
	    heavyball==3.2.1 peft==0.18.1 \
	    mypy==2.4.1 \
	    build
	# Bytecode, once, for what the test processes import, so that no process
	# compiles torch again (every one would where PYTHONDONTWRITEBYTECODE is
	# set in the environment, as in this project's sandbox shell): about
	# 27 s here against 60 s for compiling all of site-packages.
	PYTHONDONTWRITEBYTECODE= $(PY) -c "import torch, torch.distributed.checkpoint.state_dict, \
	    torch.distributed.fsdp, torch.distributed.tensor.parallel, torch.multiprocessing, \
	    torch.testing._internal.distributed.fake_pg, torch.distributed._shard.sharded_tensor, \
	    torch.distributed.algorithms._checkpoint.checkpoint_wrapper, hypothesis, pytest, \
	    transformers, lightning, torchtune, torchao, accelerate, pytorch_optimizer, heavyball, \
	    olmo_core.distributed.checkpoint, olmo_core.optim"
	touch $(STAMP)

venv: $(STAMP)

# Builds the C core in place (dcp_optim/_dcp_optim*.so) and installs the
# package in editable mode without touching dependencies.
build: $(STAMP)
	$(PY) setup.py -q build_ext --inplace
	$(PIP) install -q --no-build-isolation --no-deps -e .
	touch $(BUILT)

# The marker of the last `make build` (.ci/run's side chain waits for it,
# then makes test-early, which must not build again: rewriting the core in
# place under the main chain's running tests would crash them).
BUILT := .build-done
$(BUILT):
	$(MAKE) build

build-debug: $(STAMP)
	DCP_OPTIM_DEBUG=1 $(PY) setup.py -q build_ext --inplace --force

# --durations: CI's log names the slowest tests (the 30-minute budget).
# TEST_SPLIT=1 (make ci, .ci/run) leaves TEST_APART out of `make test`
# and `make test-apart` runs it: CI runs it beside lint, whose phase
# leaves a core mostly idle.  Without it `make test` is the whole suite.
TEST_APART := tests/distributed/test_resume_matrix.py::test_resume_matrix_world2_fsdp2
# TEST_EARLY: likewise left out, and run by `make test-early`, which CI
# runs in the first phase, beside make test-torchrun, once that has built
# the package: the benchmarks' real-flows smoke test (its own launches,
# about 120 s) and the resume matrix at world 1 (about 50 s), which fit in
# that phase's idle time.
TEST_EARLY := tests/distributed/test_flows_bench.py \
              tests/distributed/test_resume_matrix.py::test_resume_matrix_world1
TEST_DESELECT = $(if $(TEST_SPLIT),$(foreach t,$(TEST_APART) $(TEST_EARLY),--deselect $(t)))
# TEST_SPLIT=1 also leaves out the distributed tests that passed whole in
# this checkout's last `make test-torchrun` (tests/conftest.py: the file
# TORCHRUN_PASSED, which make test-torchrun writes afresh): CI runs that
# first, so each of those bodies runs once, on torchrun's process group.
TORCHRUN_PASSED := $(CURDIR)/.torchrun-passed
# TEST_SPLIT=1 also leaves out the tests the sanitizer's run makes
# (test-asan-suite and test-asan-hostile, in the same CI run: ASAN_TESTS
# less the ASAN_LEFT_OUT markers; tests/conftest.py): there the same
# assertions run on the ASan+UBSan build of the core, with its C asserts
# on.  The release build is what test-torchrun, test-early, test-apart,
# the rest of make test and test-wheel run.
test: build
	$(if $(TEST_SPLIT),DCP_OPTIM_TORCHRUN_PASSED=$(TORCHRUN_PASSED) \
	    DCP_OPTIM_SANITIZED_TESTS="$(ASAN_TESTS)" DCP_OPTIM_SANITIZED_LEFT_OUT="$(ASAN_LEFT_OUT)") \
	    $(PY) -m pytest -q --durations=25 $(TEST_DESELECT) tests

.PHONY: test-apart test-early
test-apart: build
	$(PY) -m pytest -q --durations=5 $(TEST_APART)

# against the last `make build` (BUILT), without building again
test-early: $(BUILT)
	$(PY) -m pytest -q --durations=5 $(TEST_EARLY)

test-fast: build
	$(PY) -m pytest -q -m "not dist and not slow" tests

demo: build
	$(PY) -m dcp_optim.demo

# The distributed test bodies under torchrun at 2 and 4 processes: every
# rank runs the same pytest items on torchrun's process group
# (tests.support.harness.run_ranks runs the rank functions in-process; tests for
# another world size skip) and dcp_optim.testing consolidates each verdict
# across ranks (rank 0's console shows every rank's failures).  Then the
# tests that launch torchrun themselves: a failing and a hanging rank, the
# demo under torchrun.  Timeouts: pytest-timeout per test, the process
# group's per collective, `timeout` per launch.  In the listed files only
# the tests calling run_ranks run (tests/conftest.py deselects the others:
# single-process tests, and tests/tools/test_gpu_check.py's, which runs a script
# with its own one-process group).  Left out (README, Development): the
# spawn harness's own tests, peak-memory measurements (meaningless in a
# long-lived process; tests/distributed/test_collectives_memory.py too), the FSDP1
# crash canary (it kills its rank), a test whose body (outside its rank
# functions) writes a checkpoint with single-process DCP, which every rank
# would do into the shared directory, and the dying-rank cases of
# tests/distributed/test_reliability.py and its launches of upstream's broken
# scenarios (a rank exits, or the group's timeout is set to a few seconds
# and let expire: torchrun's own group would not survive either).
TORCHRUN_NPROCS   ?= 2 4
TORCHRUN_TESTS    ?= tests/distributed/test_sharded.py tests/distributed/test_reshard_dcp.py \
                     tests/distributed/test_pipeline.py tests/distributed/test_collectives.py \
                     tests/distributed/test_deviations_sharded.py tests/distributed/test_fsdp1.py \
                     tests/tools/test_verify.py tests/distributed/test_canary_gloo.py \
                     tests/distributed/test_testing.py tests/distributed/test_reliability.py \
                     tests/distributed/test_precision_dist.py tests/tools/test_trainers.py \
                     tests/tools/test_patch.py tests/tools/test_hostile_checkpoints.py \
                     tests/distributed/test_distributed_optim.py
TORCHRUN_DESELECT ?= not harness and not launch_cost and not memory and not fsdp1_full_cpu_offload \
                     and not resharded_loads_and_corruption and not dying \
                     and not upstream_falls_apart
TORCHRUN_LIMIT    ?= 600
# The other ranks' output of a launch (torchrun --log-dir, --redirects:
# the console shows rank 0's, as it prints it): when a launch fails, it is
# printed from here.  tools/torchrun-suite.sh runs each launch, and once
# more where a rank crashed inside torch (see there).
TORCHRUN_LOGS     := $(CURDIR)/.torchrun-logs

.PHONY: test-torchrun
test-torchrun: build
	rm -rf $(TORCHRUN_PASSED) $(TORCHRUN_LOGS)
	for n in $(TORCHRUN_NPROCS); do \
	    echo "== torchrun --nproc-per-node=$$n"; \
	    DCP_OPTIM_TORCHRUN_PASSED=$(TORCHRUN_PASSED) \
	    tools/torchrun-suite.sh $$n $(TORCHRUN_LOGS)/$$n $(VENV)/bin/torchrun $(TORCHRUN_LIMIT) -- \
	        -q -p no:cacheprovider --disable-warnings \
	        --timeout 150 -k "$(TORCHRUN_DESELECT)" $(TORCHRUN_TESTS) || exit 1; \
	done
	timeout -k 10 $(TORCHRUN_LIMIT) $(PY) -m pytest -q -p no:cacheprovider -m torchrun tests/distributed/test_torchrun.py

# The older torches the package supports (pyproject.toml: torch>=2.11), each
# in a virtualenv of its own (VENV and TORCH overridden): the whole suite and
# the torchrun tests, the differential tests against that torch's upstream.
# PyPI's builds of them are CUDA builds (about 3.5 GB each with their NVIDIA
# libraries; they run on the CPU): opt-in, not in CI (docs/testing.md,
# "Supported versions").
TORCH_OLDER ?= 2.11.0 2.12.0
.PHONY: test-torch-floor
test-torch-floor:
	for v in $(TORCH_OLDER); do \
	    echo "== torch $$v"; \
	    $(MAKE) --no-print-directory VENV=.venv-torch$$v TORCH=torch==$$v test test-torchrun || exit 1; \
	done

# Issue 24's fault matrix (docs/reliability.md): every fault x path,
# dcp_optim beside upstream, one 2-rank gloo launch per cell; prints the
# table.  A sample of it runs in `make test` (tests/distributed/test_faults.py).
.PHONY: fault-matrix
fault-matrix: build
	$(PY) -m tests.distributed.fault_matrix

# `make test-torchrun` 20 times in a row beside two busy loops (issue 24's
# acceptance check; about 20 x its single run).
.PHONY: test-torchrun-20x
test-torchrun-20x: build
	@busy() { while :; do :; done; }; busy & b1=$$!; busy & b2=$$!; \
	trap 'kill $$b1 $$b2' EXIT; \
	for i in $$(seq 20); do echo "== run $$i of 20"; $(MAKE) --no-print-directory test-torchrun || exit 1; done

# BENCH_ARGS: e.g. "--sections 9" for the opt-in real flows (benchmarks/flows.py).
BENCH_ARGS ?=
bench: build
	$(PY) -m benchmarks $(BENCH_ARGS)

# Every speed target of issues 26 and 27 from one run, ending with one table
# of them (benchmarks/targets.py; about 25 min on 2 cores).
bench-targets: build
	$(PY) -m benchmarks --sections targets $(BENCH_ARGS)

# The CUDA suite (tests/gpu) on cuda:0 with this virtualenv's torch, after
# the CPU-side checks (tests/unit/test_device_rules.py, the suite's bodies on
# the CPU).  Without CUDA (the CPU torch of .venv) it says why and exits 0.
# On a GPU machine, tools/gpu-check.sh installs a CUDA torch itself.
test-gpu: build
	GPU_CHECK_PYTHON=$(PY) GPU_CHECK_SKIP_BUILD=1 tools/gpu-check.sh

clean:
	rm -rf build dist *.egg-info dcp_optim/*.so .pytest_cache .hypothesis
	find . -name __pycache__ -prune -exec rm -rf {} +

# ---------------------------------------------------------------------------
# Hardening: lint, sanitizers, leak checks (docs/contributing.md and docs/testing.md).
# Every tool is installed by .ci/install-tools.sh (apt + pip), called by the
# targets themselves; `make ci` is what .ci/run runs.
#
#   make lint           clang-format check, clang-tidy, cppcheck, C lint
#                       tests (tests/core/test_cpylint.py), ruff, mypy
#   make format         clang-format -i on csrc/ (rewrites files)
#   make build-asan     ASan+UBSan build of the core into build/asan/
#   make test-asan      the single-process suite on the ASan build (built
#                       afresh); CI makes its two parts, test-asan-suite
#                       and test-asan-hostile, against the last build-asan
#   make build-refleak  debug build of the core for python3.11d
#   make test-refleak   refcount-leak checks of every C entry point on the
#                       debug interpreter (torch-free, fake classes)
#   make test-valgrind  the torch-free C-facing tests under valgrind
#   make ci             everything CI runs

TOOLS        := .ci/install-tools.sh
CSRC          = $(sort $(wildcard csrc/*.c))
CHDR          = $(sort $(wildcard csrc/*.h))
PY_INCLUDE    = $(shell $(PY) -c "import sysconfig; print(sysconfig.get_paths()['include'])")
CLANG_TIDY   ?= clang-tidy
CLANG_FORMAT ?= clang-format
CPPCHECK     ?= cppcheck
TIDY_JOBS    ?= 2
RUFF_PATHS   ?= dcp_optim tests benchmarks tools setup.py
PYTEST_FLAGS ?= -q -p no:cacheprovider

# ASan + UBSan: a separate build directory (the in-place release .so stays
# untouched), staged as a package copy put first on sys.path: PYTHONPATH,
# with PYTHONSAFEPATH=1 (no cwd entry) and pytest's --import-mode=append
# (rootdir last), so neither the source tree nor the editable install's
# finder (appended to sys.meta_path) shadows it.
ASAN_DIR     := build/asan
# libstdc++ is preloaded too: the interpreter does not link it, so without
# it ASan's __cxa_throw interceptor finds no real __cxa_throw at start-up
# and aborts on the first C++ exception torch throws (CHECK failed in
# asan_interceptors.cpp).
LIBASAN       = $(shell gcc -print-file-name=libasan.so)
LIBSTDCXX     = $(shell gcc -print-file-name=libstdc++.so.6)
ASAN_ENV      = LD_PRELOAD="$(LIBASAN) $(LIBSTDCXX)" PYTHONMALLOC=malloc \
                ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:alloc_dealloc_mismatch=0:strict_string_checks=1:detect_stack_use_after_return=0 \
                UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
                PYTHONSAFEPATH=1 PYTHONPATH=$(CURDIR)/$(ASAN_DIR)
# Debian's debug interpreter (sys.gettotalrefcount) and release interpreter
# (valgrind: clean under valgrind, unlike a pyenv build).
DBG_PY       ?= python3.11d
SYS_PY       ?= /usr/bin/python3.11
REFLEAK_DIR  := build/refleak
VALGRIND_DIR := build/valgrind
CORE_SO       = $(1)/dcp_optim/_dcp_optim$(shell $(2) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
# Torch-free tests driving the C core through fake classes.
NOTORCH_TESTS := tests/core/refleak
NOTORCH_INI   := tests/core/refleak/pytest.ini

.PHONY: tools lint lint-format lint-tidy lint-cppcheck lint-cpylint lint-ruff lint-mypy \
        format build-asan test-asan build-refleak test-refleak build-valgrind \
        test-valgrind ci

tools: $(STAMP)
	$(TOOLS)

lint: lint-format lint-cppcheck lint-cpylint lint-ruff lint-mypy lint-tidy

lint-format: $(STAMP)
	@$(TOOLS) lint
	$(CLANG_FORMAT) --dry-run --Werror $(CSRC) $(CHDR)

format: $(STAMP)
	@$(TOOLS) lint
	$(CLANG_FORMAT) -i $(CSRC) $(CHDR)

# clang-analyzer dominates (about 3 minutes of CPU for csrc/): two files at
# a time.
lint-tidy: $(STAMP)
	@$(TOOLS) lint
	printf '%s\n' $(CSRC) | xargs -P $(TIDY_JOBS) -I{} \
	    $(CLANG_TIDY) --quiet {} -- -I$(PY_INCLUDE) -std=c11

# --library=python teaches cppcheck the CPython macros (Py_RETURN_NONE, ...)
# without parsing Python.h.
lint-cppcheck: $(STAMP)
	@$(TOOLS) lint
	$(CPPCHECK) --library=python --enable=warning,performance,portability \
	    --error-exitcode=1 --inline-suppr --std=c11 -q -I csrc \
	    --suppress=missingIncludeSystem csrc/

lint-cpylint: $(STAMP)
	$(PY) -m pytest $(PYTEST_FLAGS) tests/core/test_cpylint.py

lint-ruff: $(STAMP)
	@$(TOOLS) lint
	$(PY) -m ruff check $(RUFF_PATHS)

# The package and benchmarks/ against dcp_optim/_dcp_optim.pyi and torch's
# own hints ([tool.mypy] in pyproject.toml; cache in .mypy_cache/).
lint-mypy: $(STAMP)
	$(PY) -m mypy

build-asan: $(STAMP)
	@$(TOOLS) asan
	DCP_OPTIM_SANITIZE=1 $(PY) setup.py -q build_ext --force \
	    --build-lib $(ASAN_DIR) --build-temp $(ASAN_DIR)/tmp
	cd dcp_optim && find . -name __pycache__ -prune -o -type f ! -name '*.so' \
	    -exec cp -p --parents {} $(CURDIR)/$(ASAN_DIR)/dcp_optim/ \;
	touch $(ASAN_BUILT)

# The marker of the last build-asan: CI builds it once, beside lint, and
# then makes test-asan-suite and test-asan-hostile at the same time, which
# must not build again (each would rewrite the core under the other).
ASAN_BUILT := $(ASAN_DIR)/.built
$(ASAN_BUILT):
	$(MAKE) build-asan

# The folders that drive the C core from one process (tests/core,
# tests/unit) and the tools' tests that feed it checkpoint keys and shard
# layouts read from files, hostile and fuzzed ones included; the other
# tools' tests (trainers, patch(), the GPU script), tests/gpu's CPU bodies
# and the local tests among tests/distributed reach the core through the
# same entry points and run in make test (a third of the sanitizer's time).
# Two parts, which CI runs side by side: the rest beside make test, then
# the hostile-checkpoint tests after it (CI28: 656 s, beside 535 s and
# then 148 s).
ASAN_HOSTILE_TESTS := tests/tools/test_hostile_checkpoints.py
ASAN_SUITE_TESTS   := tests/core tests/unit tests/tools/test_fuzz_checkpoints.py \
                      tests/tools/test_cli.py tests/tools/test_convert.py
ASAN_TESTS   := $(ASAN_SUITE_TESTS) $(ASAN_HOSTILE_TESTS)
# The markers of the tests among ASAN_TESTS that the sanitizer leaves to
# make test.  process_bounds: the hostile-checkpoint tests that time fresh
# CLI processes against a baseline (about a third of the run under the
# sanitizer); the in-process hostile and fuzz tests drive the same code
# under it.
ASAN_LEFT_OUT := dist slow process_bounds
ASAN_MARK      = $(wordlist 2,100,$(foreach m,$(ASAN_LEFT_OUT),and not $(m)))
# LD_PRELOAD goes on the real interpreter binary (.venv/bin/python is a
# symlink to it), never on a shell shim.  --capture=sys: with pytest's
# default fd capture a sanitizer report written to fd 2 lands in the
# capture file and is lost when the process dies.
asan_pytest = $(ASAN_ENV) $(PY) -c "import dcp_optim._dcp_optim as m; \
	    assert m.__file__.startswith('$(CURDIR)/$(ASAN_DIR)/'), m.__file__" && \
	$(ASAN_ENV) $(PY) -m pytest $(PYTEST_FLAGS) --capture=sys --import-mode=append \
	    -m "$(ASAN_MARK)" $(1)

.PHONY: test-asan-suite test-asan-hostile asan-selection
# ASAN_TESTS, ASAN_LEFT_OUT and the -m expression, for tests/tools/test_ci_split.py
asan-selection:
	@echo '$(ASAN_TESTS)|$(ASAN_LEFT_OUT)|$(ASAN_MARK)'

test-asan: build-asan
	$(call asan_pytest,$(ASAN_TESTS))

test-asan-suite: $(ASAN_BUILT)
	$(call asan_pytest,$(ASAN_SUITE_TESTS))

test-asan-hostile: $(ASAN_BUILT)
	$(call asan_pytest,$(ASAN_HOSTILE_TESTS))

# Debian's interpreters come with setuptools 66, which rejects pyproject.toml's
# SPDX `license` string (PEP 639, setuptools 77): the core alone is built
# from a copy of setup.py and csrc/ without the project metadata (a debug
# build: DCP_OPTIM_DEBUG=1).
core_only_build = rm -rf $(1)/src && mkdir -p $(1)/src && cp -r setup.py csrc $(1)/src/ && \
	cd $(1)/src && DCP_OPTIM_DEBUG=1 $(2) setup.py -q build_ext --force \
	    --build-lib $(CURDIR)/$(1) --build-temp $(CURDIR)/$(1)/tmp

build-refleak:
	@$(TOOLS) refleak
	$(call core_only_build,$(REFLEAK_DIR),$(DBG_PY))

test-refleak: build-refleak
	DCP_OPTIM_CORE=$(call CORE_SO,$(REFLEAK_DIR),$(DBG_PY)) DCP_OPTIM_REFLEAK=required \
	    $(DBG_PY) -m pytest $(PYTEST_FLAGS) -c $(NOTORCH_INI) $(NOTORCH_TESTS)

build-valgrind:
	@$(TOOLS) valgrind
	$(call core_only_build,$(VALGRIND_DIR),$(SYS_PY))

# Few iterations: valgrind looks for invalid accesses; leaks are
# test-refleak's job.
test-valgrind: build-valgrind
	DCP_OPTIM_CORE=$(call CORE_SO,$(VALGRIND_DIR),$(SYS_PY)) DCP_OPTIM_REFLEAK_ITERS=2 \
	    PYTHONMALLOC=malloc valgrind --quiet --error-exitcode=99 --leak-check=no \
	    $(SYS_PY) -m pytest $(PYTEST_FLAGS) -p no:faulthandler -c $(NOTORCH_INI) $(NOTORCH_TESTS)

# Every CPython version pyproject.toml claims besides 3.11 (the main suite):
# the core builds with -Werror against its headers and the torch-free tests
# (fake classes) run on it.  torch 2.13.0 exists for 3.11 only here, so the
# torch suites cannot run on these.  Interpreters come from pyenv.
PYVERSIONS   ?= 3.10 3.12 3.13
PYENV_ROOT   ?= $(HOME)/.pyenv
PYVER_DIR    := build/pyver
pyver_python  = $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python$(1))))

.PHONY: test-pyversions
test-pyversions:
	@set -e; for v in $(PYVERSIONS); do \
	    case $$v in \
	    3.10) py="$(call pyver_python,3.10)" ;; \
	    3.12) py="$(call pyver_python,3.12)" ;; \
	    3.13) py="$(call pyver_python,3.13)" ;; \
	    *) echo "test-pyversions: no rule for $$v" >&2; exit 1 ;; \
	    esac; \
	    if [ -z "$$py" ]; then echo "test-pyversions: no CPython $$v under $(PYENV_ROOT)" >&2; exit 1; fi; \
	    d=$(PYVER_DIR)/$$v; \
	    [ -x $$d/venv/bin/python ] || $$py -m venv $$d/venv; \
	    $$d/venv/bin/python -m pip install -q --disable-pip-version-check \
	        "setuptools>=77" "pytest>=8" pytest-timeout hypothesis; \
	    echo "== CPython $$v ($$py)"; \
	    DCP_OPTIM_WERROR=1 $$d/venv/bin/python setup.py -q build_ext --force \
	        --build-lib $$d/lib --build-temp $$d/tmp >$$d/build.log 2>&1 \
	        || { cat $$d/build.log; exit 1; }; \
	    DCP_OPTIM_CORE=$$(ls $$d/lib/dcp_optim/_dcp_optim*.so) DCP_OPTIM_REFLEAK_ITERS=1 \
	        $$d/venv/bin/python -m pytest $(PYTEST_FLAGS) -c $(NOTORCH_INI) $(NOTORCH_TESTS); \
	done

# The package as users get it: `python -m build` makes the sdist and, from
# it, the wheel, in an isolated environment that holds only setuptools
# (build-system.requires; the log is checked: nothing else, torch never).  The wheel goes
# into a clean virtualenv without torch and its dependencies (--no-deps),
# with pytest, and the torch-free tests run from a directory outside the
# source tree against the installed core (DCP_OPTIM_CORE; fakes.py reads
# the installed errors.py beside it).  The sdist must carry the license
# and every C source.
WHEEL_DIR    := build/wheel

.PHONY: test-wheel
test-wheel: $(STAMP)
	rm -rf $(WHEEL_DIR) && mkdir -p $(WHEEL_DIR)/run/tests/core
	$(PY) -m build --outdir $(WHEEL_DIR)/dist . >$(WHEEL_DIR)/build.log 2>&1 \
	    || { cat $(WHEEL_DIR)/build.log; exit 1; }
	@# the packages the isolated environments asked for and got ("  - name")
	@if grep -E "^  - " $(WHEEL_DIR)/build.log | grep -iv "^  - setuptools"; then \
	    echo "test-wheel: the isolated build installed more than setuptools" >&2; exit 1; fi
	tar -tzf $(WHEEL_DIR)/dist/dcp_optim-*.tar.gz >$(WHEEL_DIR)/sdist.txt
	@for f in LICENSE pyproject.toml setup.py $(CSRC) $(CHDR); do \
	    grep -q "^dcp_optim-[^/]*/$$f$$" $(WHEEL_DIR)/sdist.txt \
	        || { echo "test-wheel: $$f is not in the sdist" >&2; exit 1; }; done
	$(PY) -m venv $(WHEEL_DIR)/venv
	$(WHEEL_DIR)/venv/bin/python -m pip install -q --disable-pip-version-check \
	    "pytest>=8" pytest-timeout hypothesis
	$(WHEEL_DIR)/venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
	    $(WHEEL_DIR)/dist/dcp_optim-*.whl
	@if $(WHEEL_DIR)/venv/bin/python -c "import torch" 2>/dev/null; then \
	    echo "test-wheel: torch is in the clean virtualenv" >&2; exit 1; fi
	cp tests/__init__.py $(WHEEL_DIR)/run/tests/ && cp tests/core/__init__.py $(WHEEL_DIR)/run/tests/core/
	cp -r $(NOTORCH_TESTS) $(WHEEL_DIR)/run/tests/core/
	cd $(WHEEL_DIR)/run && \
	    core=$$(ls $(CURDIR)/$(WHEEL_DIR)/venv/lib/python*/site-packages/dcp_optim/_dcp_optim*.so) && \
	    DCP_OPTIM_CORE=$$core DCP_OPTIM_REFLEAK_ITERS=1 PYTHONSAFEPATH=1 \
	    $(CURDIR)/$(WHEEL_DIR)/venv/bin/python -m pytest $(PYTEST_FLAGS) \
	        -c tests/core/refleak/pytest.ini tests/core/refleak
	@grep -q "License-Expression: BSD-3-Clause" $(WHEEL_DIR)/venv/lib/python*/site-packages/dcp_optim-*.dist-info/METADATA \
	    || { echo "test-wheel: no SPDX license in the wheel's metadata" >&2; exit 1; }

CI_TARGETS := test-torchrun lint test build-asan test-asan-suite test-asan-hostile test-apart test-early \
              test-refleak test-valgrind test-pyversions test-wheel
ci: export TEST_SPLIT := 1
ci: $(CI_TARGETS)

# .ci/run makes these in phases (each a main chain with a side chain
# beside it, on the two cores) and prints each one's time.
.PHONY: ci-targets
ci-targets:
	@echo $(CI_TARGETS)
