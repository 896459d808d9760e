"""Benchmarks and tools, run from the repository root as modules: `python -m tools.<name>`.

Shared helpers: tools.device_rates (timing, memory bandwidth, matmul rate), tools.decode
(decode batches and the bytes a step reads), tools.bench_inputs (attention inputs),
tools.peers (the engines jaxinfer is measured against)."""
