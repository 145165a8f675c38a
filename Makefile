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

.PHONY: venv lint test test-slow demo bench detection cycle clean

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

# The demo needs only the `demo` extra (matplotlib for its timeline picture), under its own stamp.
demo:
	$(MAKE) --no-print-directory venv EXTRAS=demo
	$(PY) examples/resiliency_demo.py

bench: venv
	$(PY) -m benchmarks.gemini_bench

# SCOUT's full detection campaign (12 to 25 minutes on a shared 2-core machine; benchmarks/README.md).
detection: venv
	$(PY) -m benchmarks.detection_bench

# The torchrun resiliency cycle: 8 torchrun agents on this host (4 train, 4 park as standbys) through
# all 21 failure types, then a bitwise comparison with an uninterrupted run; report in
# $(CYCLE_DIR)/report.md. About 23 minutes on the shared 2-core machine (docs/torchrun.md, "The resiliency cycle").
CYCLE_DIR ?= cycle-output
cycle: venv
	rm -rf $(CYCLE_DIR) && mkdir -p $(CYCLE_DIR)
	cp examples/torchrun/resiliency_cycle/campaigns/single_node_pressure.json $(CYCLE_DIR)/campaign.json
	$(PY) -m examples.torchrun.resiliency_cycle.pressure orchestrate --framework pytorch \
		--fault-campaign-dir $(abspath $(CYCLE_DIR)) --gpus 0,1,2,3,4,5,6,7

clean:
	rm -rf $(VENV) build dist *.egg-info demo-output cycle-output benchmarks/results
