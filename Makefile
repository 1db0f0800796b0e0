# Each target sets itself up from nothing: a .venv with the core, the three backend plugins
# (editable) and the CPU builds of torch / Triton / MLX that CI and the tests use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcache-installed

# torch: the CPU build, named by its local version label. PyPI's torch 2.13.0 for Linux is the
# CUDA build (several GB, of no use to the tests), so the pin says `+cpu`: pip takes that build
# from a wheel directory or an index that has it (this project's machines keep the file on disk;
# elsewhere: make test TORCH_INDEX=https://download.pytorch.org/whl/cpu). A machine with neither
# fails at once with "No matching distribution found for torch==2.13.0+cpu" instead of fetching
# the CUDA build. After the install the setup checks that torch is a CPU build.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?=
# where `make dist` puts the sdists and wheels
DIST ?= build/dist

.PHONY: test test-all demo bench info dist docs clean

# pip -qq for the third-party packages: -q still prints a warning for every package that one of a
# machine's extra indexes lacks. The project's own installs keep -q, so that a packaging warning
# of ours shows.
$(STAMP): pyproject.toml backends/cuda/pyproject.toml backends/rocm/pyproject.toml backends/metal/pyproject.toml \
		docs/examples/kvcache-example/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -qq --upgrade pip setuptools wheel
	$(PY) -m pip install -qq $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) \
		"$(TORCH)" "triton==3.6.0" "mlx[cpu]" numpy pluggy ml_dtypes \
		pytest hypothesis mypy rich matplotlib "transformers>=5.17" safetensors "mlx-lm>=0.32" \
		build twine \
		"mkdocs==1.6.1" "mkdocstrings==1.0.8" "mkdocstrings-python==2.0.11" "griffelib==2.4.1"
	$(PY) -c 'import sys, torch; v = torch.version; sys.exit(None if v.cuda is None and v.hip is None \
		else f"$(VENV) has torch {torch.__version__}, a GPU build; the tests use the CPU one: make clean test")'
	$(PY) -m pip install -q --no-build-isolation --no-deps -e . -e backends/cuda -e backends/rocm -e backends/metal
	$(PY) -m pip install -q --no-build-isolation --no-deps -e docs/examples/kvcache-example
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

# the slow matrices too (every model family on every backend); CI runs `make test`
test-all: $(STAMP)
	$(PY) -m pytest -q tests -m ""

# the main job on a real architecture (a small random-weight Llama through the transformers Engine)
demo: $(STAMP)
	$(VENV)/bin/kvcache demo --model llama

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
	rm -rf $(VENV)
