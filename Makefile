SHELL := /bin/bash
.DEFAULT_GOAL := help

PY ?= python3
VENV ?= .venv
VENV_IO ?= .venv-io
VENV_JAX ?= .venv-jax
VENV_TORCH ?= .venv-torch
# The demo's own environment: only what `python -m examples.demo` imports
# (TensorFlow, Keras, NumPy), so a first `make demo` does not install the
# test, lint, docs and benchmark tools of $(VENV).
VENV_DEMO ?= .venv-demo
PYTEST_ARGS ?=
# pytest-xdist worker processes for the suites. Three on 2 cores keep both
# busy while tests wait on threads, subprocesses and sleeps (measured: the
# default suite's wall time with 2 and 3 workers is in CONTRIBUTING.md);
# PYTEST_WORKERS=0 runs the tests in one process.
PYTEST_WORKERS ?= 3
# $(call xdist,ARGS): the pytest-xdist ARGS, or none with PYTEST_WORKERS=0.
xdist = $(if $(filter 0,$(PYTEST_WORKERS)),,$(1))
XDIST = $(call xdist,-n $(PYTEST_WORKERS) --dist worksteal)
# The long sweeps keep each file in one worker: a module's fixtures (the
# benchmark harness's smoke run) then run once.
XDIST_LONG = $(call xdist,-n 2 --dist loadfile)
DEMO_ARGS ?=
# pytest rewrites every test module's asserts when it imports it, about 8 s
# of CPU in each worker, and caches the result as bytecode, which a
# PYTHONDONTWRITEBYTECODE in the environment forbids: the suites run with it
# unset, so a checkout's later runs skip the rewrite (__pycache__ is
# git-ignored).
PYTEST = PYTHONDONTWRITEBYTECODE=

LINT_PATHS := keras_stage tests examples benchmarks

PRIMARY_REQS := requirements/primary.txt requirements/primary-constraints.txt
IO_REQS := requirements/io.txt requirements/io-constraints.txt
JAX_REQS := requirements/jax.txt requirements/jax-constraints.txt
TORCH_REQS := requirements/torch.txt requirements/torch-constraints.txt
DEMO_REQS := requirements/demo.txt requirements/demo-constraints.txt

# The venv markers depend only on the requirement files and setup.cfg (not
# pyproject.toml, whose pytest/ruff config edits must not trigger reinstalls).
# Rebuilds are incremental: pip re-applies the pins in the existing venv;
# run `make clean` for a from-scratch rebuild.

# Quieten TensorFlow's C++ logging for test/demo runs.
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: help venv venv-io venv-jax venv-torch venv-demo test test-long \
	test-io test-jax test-torch test-all demo lint docs clean

help:
	@echo "Targets:"
	@echo "  venv      build $(VENV) (primary: tensorflow-cpu 2.21, keras 3)"
	@echo "  venv-io   build $(VENV_IO) (tensorflow-cpu 2.16 + tensorflow-io)"
	@echo "  venv-jax  build $(VENV_JAX) (tensorflow-cpu 2.21 + jax[cpu])"
	@echo "  venv-torch build $(VENV_TORCH) (tensorflow-cpu 2.21 + torch 2.13 CPU)"
	@echo "  venv-demo build $(VENV_DEMO) (tensorflow-cpu 2.21, keras 3, numpy: what the demo imports)"
	@echo "  test      the default suite in $(VENV), long sweeps left out (PYTEST_ARGS=...)"
	@echo "  test-long the long sweeps (random kills, soak, fail-over, fuzzing, benchmark runs)"
	@echo "  test-io   the whole suite in $(VENV_IO) with KERAS_STAGE_ENV=io"
	@echo "  test-jax  run pytest tests/jax in $(VENV_JAX), KERAS_BACKEND=jax"
	@echo "  test-torch run pytest tests/torch in $(VENV_TORCH), KERAS_BACKEND=torch"
	@echo "  test-all  everything CI runs: test, test-long, test-io, test-jax, test-torch"
	@echo "  demo      run examples.demo in $(VENV_DEMO) (DEMO_ARGS=...)"
	@echo "  lint      ruff check + ruff format --check"
	@echo "  docs      build the documentation site into site/ (warnings fail)"
	@echo "  clean     remove venvs, build artefacts and caches"

$(VENV)/.done: $(PRIMARY_REQS) setup.cfg
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -r requirements/primary.txt \
		-c requirements/primary-constraints.txt
	$(VENV)/bin/python -m pip install -e . --no-deps
	touch $@

$(VENV_IO)/.done: $(IO_REQS) setup.cfg
	test -x $(VENV_IO)/bin/python || $(PY) -m venv $(VENV_IO)
	$(VENV_IO)/bin/python -m pip install -r requirements/io.txt \
		-c requirements/io-constraints.txt
	$(VENV_IO)/bin/python -m pip install -e . --no-deps
	touch $@

$(VENV_JAX)/.done: $(JAX_REQS) setup.cfg
	test -x $(VENV_JAX)/bin/python || $(PY) -m venv $(VENV_JAX)
	$(VENV_JAX)/bin/python -m pip install -r requirements/jax.txt \
		-c requirements/jax-constraints.txt
	$(VENV_JAX)/bin/python -m pip install -e . --no-deps
	touch $@

# torch is pinned (requirements/torch.txt) to the CPU build pip finds on
# this machine's disk: an open range pulls a CUDA build of several GB.
$(VENV_TORCH)/.done: $(TORCH_REQS) setup.cfg
	test -x $(VENV_TORCH)/bin/python || $(PY) -m venv $(VENV_TORCH)
	$(VENV_TORCH)/bin/python -m pip install -r requirements/torch.txt \
		-c requirements/torch-constraints.txt
	$(VENV_TORCH)/bin/python -m pip install -e . --no-deps
	touch $@

$(VENV_DEMO)/.done: $(DEMO_REQS) setup.cfg
	test -x $(VENV_DEMO)/bin/python || $(PY) -m venv $(VENV_DEMO)
	$(VENV_DEMO)/bin/python -m pip install -r requirements/demo.txt \
		-c requirements/demo-constraints.txt
	$(VENV_DEMO)/bin/python -m pip install -e . --no-deps
	touch $@

venv: $(VENV)/.done

venv-io: $(VENV_IO)/.done

venv-jax: $(VENV_JAX)/.done

venv-torch: $(VENV_TORCH)/.done

venv-demo: $(VENV_DEMO)/.done

# What guards every change: the public API, the staged call, SmartStage's
# plan and equality with plain Keras, the engine's policies, the docs'
# examples. Tests marked `long` (pyproject.toml) run in test-long.
test: venv
	$(PYTEST) $(VENV)/bin/python -m pytest -m "not long" $(XDIST) $(PYTEST_ARGS)

test-long: venv
	$(PYTEST) $(VENV)/bin/python -m pytest -m long $(XDIST_LONG) $(PYTEST_ARGS)

# The whole suite on the second TensorFlow: the default tests, then the
# long sweeps.
test-io: venv-io
	$(PYTEST) KERAS_STAGE_ENV=io $(VENV_IO)/bin/python -m pytest -m "not long" \
		$(XDIST) $(PYTEST_ARGS)
	$(PYTEST) KERAS_STAGE_ENV=io $(VENV_IO)/bin/python -m pytest -m long \
		$(XDIST_LONG) $(PYTEST_ARGS)

# Only tests/jax: the rest of the suite is TensorFlow-backend.
test-jax: venv-jax
	$(PYTEST) KERAS_BACKEND=jax $(VENV_JAX)/bin/python -m pytest tests/jax \
		$(PYTEST_ARGS)

# Only tests/torch: the rest of the suite is TensorFlow-backend.
test-torch: venv-torch
	$(PYTEST) KERAS_BACKEND=torch $(VENV_TORCH)/bin/python -m pytest tests/torch \
		tests/models/backends/torch_batches_test.py \
		keras_stage/models/backends/torch_batches.py \
		$(XDIST) $(PYTEST_ARGS)

test-all: test test-long test-io test-jax test-torch

demo: venv-demo
	$(VENV_DEMO)/bin/python -m examples.demo $(DEMO_ARGS)

lint: venv
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# The documentation site (mkdocs.yml): API pages from the docstrings; any
# warning (a broken link, a docstring griffe cannot parse) fails the build.
docs: venv
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) $(VENV_IO) $(VENV_JAX) $(VENV_TORCH) $(VENV_DEMO) build dist site \
		.eggs *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -path ./.git -prune -o -type d -name __pycache__ -print0 \
		| xargs -0 rm -rf

# Benchmarks (see benchmarks/README.md): `python -m benchmarks bench` times
# every workload in every mode, the order rotated per round, and prints the
# speed table; the summary goes to benchmarks/results/bench[-quick].json.
# BENCH_ARGS=... passes more options (e.g. --workloads criteo --rounds 9).
BENCH_ARGS ?=

.PHONY: bench bench-quick

bench: venv
	$(VENV)/bin/python -m benchmarks bench $(BENCH_ARGS)

bench-quick: venv
	$(VENV)/bin/python -m benchmarks bench --quick --name quick $(BENCH_ARGS)
