# Two entry points do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve demo test check lint bench

# Serving installs only what serving needs; the tests add their extra (PyTorch, transformers,
# the openai client, ...) on top.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(STAMP)

# The chat page's test drives Debian's headless Chromium (Playwright downloads no browser).
$(STAMP).test: $(STAMP)
	$(PY) -m pip install -q -e '.[test]'
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	touch $(STAMP).test

serve: $(STAMP)
	$(VENV)/bin/jaxinfer serve

demo: $(STAMP)
	$(PY) -m jaxinfer.demo

# Lint, then every test in lanes by marker (tools/test_lanes.py says how).
test: $(STAMP).test lint
	$(PY) -m tools.test_lanes

# Before each commit: lint and the fast lane (unit, kernel, tiny-model engine and server tests).
check: $(STAMP).test lint
	$(PY) -m tools.test_lanes --check

lint: $(STAMP).test
	$(PY) -m ruff check jaxinfer pallas_kernels cpu_kernels tests tools
	$(PY) -m ruff format --check jaxinfer pallas_kernels cpu_kernels tests tools

# llama.cpp (the benchmarks' baseline) built for the vector extensions this CPU reports, not
# -march=native: that build takes ggml's AMX path on CPUs reporting AMX, and it faults in VMs
# that report AMX without running it (these development machines).
LLAMA_CMAKE := -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	$(shell for f in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512vbmi:AVX512_VBMI \
	avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do grep -qw $${f%%:*} /proc/cpuinfo && \
	echo -DGGML_$${f##*:}=ON; done)

# llama-server (the continuous-batching peer) from the same llama.cpp the binding vendors,
# linked statically into the venv's bin.
LLAMA_CPP_PYTHON := llama-cpp-python==0.3.36
LLAMA_SERVER_BUILD := build/llama-server
$(VENV)/bin/llama-server: $(STAMP).test
	rm -rf $(LLAMA_SERVER_BUILD) && mkdir -p $(LLAMA_SERVER_BUILD)
	$(PY) -m pip download -q --no-deps --no-binary=:all: $(LLAMA_CPP_PYTHON) -d $(LLAMA_SERVER_BUILD)
	tar xzf $(LLAMA_SERVER_BUILD)/llama_cpp_python-*.tar.gz -C $(LLAMA_SERVER_BUILD)
	cmake -S $(LLAMA_SERVER_BUILD)/llama_cpp_python-*/vendor/llama.cpp -B $(LLAMA_SERVER_BUILD)/out \
		$(LLAMA_CMAKE) -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=ON \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release
	cmake --build $(LLAMA_SERVER_BUILD)/out --target llama-server -j2
	cp $(LLAMA_SERVER_BUILD)/out/bin/llama-server $@

bench: $(STAMP).test $(VENV)/bin/llama-server
	CMAKE_ARGS="$(LLAMA_CMAKE)" $(PY) -m pip install -q --no-cache-dir -e '.[llamacpp]'
	$(PY) -m tools.bench_throughput --baseline hf,llamacpp,llamaserver
	$(PY) -m tools.bench_throughput --baseline hf,llamacpp,llamaserver --single_stream
