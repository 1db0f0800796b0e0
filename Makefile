# Each target sets itself up from nothing: a .venv with the core, the three backend plugins
# (editable) and the CPU builds of torch / Triton / MLX that CI and the tests use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvcache-installed

.PHONY: test test-all demo bench info clean

$(STAMP): pyproject.toml backends/cuda/pyproject.toml backends/rocm/pyproject.toml backends/metal/pyproject.toml \
		docs/examples/kvcache-example/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel
	$(PY) -m pip install -q "torch==2.13.0" "triton==3.6.0" "mlx[cpu]" numpy pluggy ml_dtypes \
		pytest hypothesis mypy rich matplotlib "transformers>=5.17" safetensors "mlx-lm>=0.32"
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
	$(VENV)/bin/kvcache info

clean:
	rm -rf $(VENV)
