# Two entry points do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve demo test lint bench

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

serve: $(STAMP)
	$(PY) -m jaxinfer.serve

demo: $(STAMP)
	$(PY) -m jaxinfer.demo

test: $(STAMP)
	$(PY) -m ruff check jaxinfer pallas_kernels cpu_kernels tests tools
	$(PY) -m ruff format --check jaxinfer pallas_kernels cpu_kernels tests tools
	# In several processes: each engine's compiled programs hold thousands of memory maps,
	# and one process that keeps every engine of the suite passes vm.max_map_count (65530),
	# where XLA's compiler then crashes.
	$(PY) -m pytest -q tests/engine/test_[a-m]*.py
	$(PY) -m pytest -q tests/engine/test_[n-z]*.py
	$(PY) -m pytest -q tests/kernels tests/tools tests/unit
	$(PY) -m pytest -q tests/server

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[llamacpp]'
	$(PY) -m tools.bench_throughput --baseline hf,llamacpp
	$(PY) -m tools.bench_throughput --baseline hf,llamacpp --single_stream
