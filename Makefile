# `make demo`, `make test` and `make bench` each set up a local virtual environment first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := .ci/constraints.txt
# The test suite exercises the real frameworks (Lightning, Accelerate, DeepSpeed, Megatron Core,
# TorchTitan) on CPU and the demo's timeline picture (matplotlib).
EXTRAS ?= test,demo,lightning,accelerate,deepspeed,megatron,torchtitan,nvml
comma := ,
# DeepSpeed compiles its ops at first use; keep them in the venv so later runs reuse them.
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
STAMP := $(VENV)/.installed-$(subst $(comma),_,$(EXTRAS))

.PHONY: venv lint test test-slow demo bench detection clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned, so no extra ever pulls a different (CUDA) build.
	$(PIP) install --quiet torch==2.13.0

$(STAMP): pyproject.toml $(CONSTRAINTS) | $(PY)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e ".[$(EXTRAS)]"
	touch $@

venv: $(STAMP)

# Lint and type check first (seconds), then the suite.
test: venv lint
	$(PY) -m pytest -q

lint: venv
	$(PY) -m ruff check .
	$(PY) -m mypy

test-slow: venv
	$(PY) -m pytest -q -m slow

# The demo needs the `demo` extra (matplotlib for its timeline picture): its own stamp, test,demo.
demo:
	$(MAKE) --no-print-directory venv EXTRAS=test,demo
	$(PY) examples/resiliency_demo.py

bench: venv
	$(PY) -m benchmarks.gemini_bench

# SCOUT's full detection campaign (12 to 25 minutes on a shared 2-core machine; benchmarks/README.md).
detection: venv
	$(PY) -m benchmarks.detection_bench

clean:
	rm -rf $(VENV) build dist *.egg-info demo-output benchmarks/results
