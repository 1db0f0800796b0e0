# Each target sets itself up from nothing. Two environments:
# * .venv (make test, check, build-check, test-all, bench, info, dist, docs): the core, the three
#   backend plugins (editable), the CPU builds of torch / Triton / MLX that CI and the tests use,
#   and the developer tools (pytest, hypothesis, mypy, build, twine, mkdocs);
# * .venv-demo (make demo): only what `kvcache demo --model llama` imports: the core (numpy,
#   pluggy, ml_dtypes), torch, transformers (+ safetensors) and rich; on a machine where
#   nvidia-smi answers, also Triton and the cuda plugin, so that the demo runs on the GPU.
# tools/install_torch.sh installs torch in both and says which build it took.
PYTHON ?= python3
# Python writes the bytecode (.pyc) of what it imports when it first does (the installs below
# pass --no-compile), but not where PYTHONDONTWRITEBYTECODE is set, as it is on some CI
# machines: there every process of the suite compiled torch, transformers and Triton from
# source again (about 12 s of CPU a process that imports torch and transformers on a 2-core
# AMD EPYC, and the suite starts some 50 such children). The targets run without it.
unexport PYTHONDONTWRITEBYTECODE
# one torch / OpenMP thread a process: the suite runs two processes at once on CI's two cores (the
# session and the children of tests/cuda/background_runs.py), and two threads each made four
# threads spin on two cores (6% less CPU in one process's tests here with one); set it to
# override
export OMP_NUM_THREADS ?= 1
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcache-installed
DEMO_VENV ?= .venv-demo
DEMO_PY := $(DEMO_VENV)/bin/python
DEMO_STAMP := $(DEMO_VENV)/.kvcache-installed

# torch: the CPU build, named by its local version label. PyPI's torch 2.13.0 for Linux is the
# CUDA build (several GB, of no use to the tests), so the pin says `+cpu`: pip takes that build
# from a wheel directory or an index that has it (this project's machines keep the file on disk;
# elsewhere: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu). For `make test` a machine
# with neither fails at once, naming TORCH_INDEX, instead of fetching the CUDA build, and after the
# install the setup checks that torch is a CPU build. `make demo` takes the registry's default
# torch there instead (tools/install_torch.sh says which it took).
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=
# where `make dist` puts the sdists and wheels
DIST ?= build/dist
# a GPU on this machine (nvidia-smi answers): `make demo` takes the registry's torch (the CUDA
# build) with Triton, and the cuda plugin, and runs on the GPU; without one, the CPU torch
GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo yes)
# the quick suite of `make check`: the core, serving and demo tests (not the Triton interpreter,
# the model families, the conformance matrix, the processes, the packaging)
QUICK ?= tests/core tests/serving tests/demo

.PHONY: test check build-check test-all demo bench info dist docs clean

# pip -qq for the third-party packages: -q still prints a warning for every package that one of a
# machine's extra indexes lacks. The project's own installs keep -q, so that a packaging warning
# of ours shows. --no-compile: Python writes the .pyc of what it imports when it first does
# (byte-compiling every installed module took about half of the install time here). The echo
# lines say what each quiet step does.
$(STAMP): pyproject.toml backends/cuda/pyproject.toml backends/rocm/pyproject.toml backends/metal/pyproject.toml \
		docs/examples/kvcache-example/pyproject.toml tools/install_torch.sh
	@echo "make: setting up $(VENV): the core, the cuda/rocm/metal plugins, CPU torch/Triton/MLX, the developer tools (1.8 GB, about 50 s here)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip setuptools wheel
	TORCH="$(TORCH)" TORCH_INDEX="$(TORCH_INDEX)" tools/install_torch.sh $(PY) cpu
	@echo "make: installing Triton, MLX, transformers, mlx-lm, pytest, hypothesis, mypy, build, twine, mkdocs"
	$(PY) -m pip install -qq --no-compile $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		"$(TORCH)" "triton==3.6.0" "mlx[cpu]" numpy pluggy ml_dtypes \
		pytest hypothesis mypy rich matplotlib "transformers>=5.17" safetensors "mlx-lm>=0.32" \
		build twine \
		"mkdocs==1.6.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11" "griffelib==2.4.1"
	$(PY) -c 'import sys, torch; v = torch.version; sys.exit(None if v.cuda is None and v.hip is None \
		else f"$(VENV) has torch {torch.__version__}, a GPU build; the tests use the CPU one: make clean test")'
	@echo "make: installing kvcache and its plugins (editable)"
	$(PY) -m pip install -q --no-build-isolation --no-deps -e . -e backends/cuda -e backends/rocm -e backends/metal
	$(PY) -m pip install -q --no-build-isolation --no-deps -e docs/examples/kvcache-example
	touch $(STAMP)

# the demo's own environment: the core, torch (CPU build where it can be had, else the registry's
# default; with a GPU the CUDA build and Triton), transformers and rich; the cuda plugin with a GPU
$(DEMO_STAMP): pyproject.toml backends/cuda/pyproject.toml tools/install_torch.sh
	@echo "make: setting up $(DEMO_VENV) for the demo: the core, torch, transformers, rich (940 MB, about 35 s here)"
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_PY) -m pip install -qq --upgrade pip setuptools wheel
	TORCH="$(TORCH)" TORCH_INDEX="$(TORCH_INDEX)" tools/install_torch.sh $(DEMO_PY) $(if $(GPU),gpu,prefer)
	@echo "make: installing transformers, safetensors, rich, numpy, pluggy, ml_dtypes"
	$(DEMO_PY) -m pip install -qq --no-compile "transformers>=5.17" safetensors "rich>=13" numpy pluggy ml_dtypes
	@echo "make: installing kvcache (editable)$(if $(GPU), and the cuda plugin: nvidia-smi answers here)"
	$(DEMO_PY) -m pip install -q --no-build-isolation --no-deps -e . $(if $(GPU),-e backends/cuda)
	touch $(DEMO_STAMP)

# the whole suite but the tool runs (mypy, the distributions, the API reference: make build-check);
# CI (.ci/run) runs `make test build-check`. The echo says what comes before pytest's first dot.
# `make test` leaves out the tests marked `slow`: samples of the slow matrices stay in it, so that
# every behaviour runs in CI at least once (pyproject's `slow` marker; `make test-all` runs all):
# * the model families: every family once, a sample of four on cuda's CPU mode
#   (tests/integrations/test_transformers_families.py), mlx-lm families and compile rows;
# * the deterministic serving conditions: all of them on the reference backend, two each on the
#   cuda backend's eager CPU mode and on mlx-lm (test_engine_deterministic.py,
#   test_mlx_lm_deterministic.py); the graphs row;
# * Triton through the interpreter: every kernel's indexing, fewer shapes (tests/cuda: the
#   scenarios marked slow for the interpreter); the bad-input catalogue on the example plugin;
#   the reference backend's TP and disaggregated spawns (the cuda CPU mode's run in CI);
# * hypothesis state machines: each in CI, the long runs marked slow.
# The children that tests only spawn and read (the interpreter runs, conformance classes on the
# CPU test mode, the conformance CLI's runs of tests/conformance and tests/cli, the disaggregated
# demo's CLI, the README's blocks) run on the second core beside the session (tests/cuda/
# background_runs.py), and so do two whole files, the conformance suite and the bad-input
# catalogue (background_runs.CHILD_FILES; tests/test_child_files.py reads them).
test: $(STAMP)
	@echo "make: running the suite (tests/; about 12 min on a 2-core AMD EPYC; collection takes 20-30 s, then a dot per test)"
	$(PY) -m pytest -q tests -m "not slow and not tools"

# the fast lane (about 2-3 min here): mypy once over the core and the backends, then the quick suite
check: $(STAMP)
	@echo "make: mypy over kvcache and the three backends"
	$(PY) -m pytest -q tests/packaging/test_mypy.py -m tools
	@echo "make: the quick suite ($(QUICK))"
	$(PY) -m pytest -q $(QUICK) -m "not slow and not tools"

# the tools, once each (the tests marked `tools`): mypy over the core and the backends; every
# distribution built as `make dist` builds them, checked by twine and installed into a fresh venv;
# the API reference rendered as `make docs` renders it. They all live in tests/packaging, which
# alone is collected (the whole suite's collection cost 20-30 s more);
# tests/packaging/test_tools_marker_home.py (in `make test`) fails on a `tools` test elsewhere.
build-check: $(STAMP)
	@echo "make: mypy, every sdist and wheel (build + twine check), the API reference (mkdocs)"
	$(PY) -m pytest -q tests/packaging -m tools

# the slow matrices too: every test, `slow` included (every model family on every backend, every
# serving condition on every backend, every interpreter shape); CI runs `make test build-check`
test-all: $(STAMP)
	$(PY) -m pytest -q tests -m ""

# the main job on a real architecture (a small random-weight Llama through the transformers Engine),
# in its own light environment (.venv-demo)
demo: $(DEMO_STAMP)
	$(DEMO_VENV)/bin/kvcache demo --model llama

bench: $(STAMP)
	$(VENV)/bin/kvcache bench --host

info: $(STAMP)
	$(VENV)/bin/kvcache info --check

# every distribution (the core, the three backends, the example plugin of docs/plugin-guide.md) as
# an sdist and a wheel built from that sdist, checked with `twine check --strict`. Elsewhere:
# pip install --find-links $(DIST) 'kvcache[cuda]' (kvcache is not on PyPI)
dist: $(STAMP)
	rm -rf $(DIST) && mkdir -p $(DIST)
	for project in . backends/cuda backends/rocm backends/metal docs/examples/kvcache-example; do \
		$(PY) -m build --no-isolation --outdir $(DIST) $$project > $(DIST).log 2>&1 \
			|| { cat $(DIST).log; exit 1; }; \
	done
	$(VENV)/bin/twine check --strict $(DIST)/*

# the API reference, rendered from the docstrings (mkdocs + mkdocstrings, warnings are errors)
# into build/docs: open build/docs/index.html. docs/api/index.md says why mkdocs.
docs: $(STAMP)
	PYTHON=$(PY) tools/build_docs.sh

clean:
	rm -rf $(VENV) $(DEMO_VENV)
