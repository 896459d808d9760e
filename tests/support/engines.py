"""Engines for tests: the named presets of engine options, the factory every test builds its
engines with, and what tests read inside a runner (a layer's weights, a scheduled chunk)."""

from __future__ import annotations

from pathlib import Path

# Named engine options, each compiling few token buckets (most of an engine's start-up here is
# compiling a model step and two sampler programs per bucket):
# - "quick": buckets 2 and 6, for tests that need any engine at all;
# - "tiny": every prompt is chunked (16 tokens a step), buckets 2 and 16 (steps of one or two
#   tokens take the kernels' few-row paths);
# - "tiny_one_bucket": "tiny" with one bucket (16), for the models whose step costs most to
#   compile (DeepSeek-V4): steps of one or two tokens pad to 16 there (the few-row paths are
#   the other families' tests' concern);
# - "served": the server, batch and robustness tests' (prompts of up to 64 tokens in a step);
# - "default": the default model's engine and server tests (model None: the default model),
#   buckets 1, 2, 16, 32 and 128;
# - "real": the real models' (a preset's name as the model), buckets 8 and 512.
# A test of the bucketing itself sets token_buckets=None (every default bucket) or its own.
PRESETS = {
    "quick": dict(
        max_num_batched_tokens=6,
        token_buckets=(2, 6),
        max_num_seqs=4,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=96,
    ),
    "tiny": dict(
        max_num_batched_tokens=16,
        token_buckets=(2, 16),
        max_num_seqs=4,
        block_size=8,
        num_kv_blocks=64,
        max_model_len=96,
    ),
    "served": dict(
        max_num_batched_tokens=64,
        token_buckets=(8, 64),
        max_num_seqs=8,
        block_size=8,
        num_kv_blocks=128,
        max_model_len=128,
    ),
    "default": dict(
        max_model_len=1024,
        max_num_seqs=32,
        max_num_batched_tokens=128,
        token_buckets=(1, 2, 16, 32),  # steps of 1-2 tokens read the GGUF blocks
        cache_dir=str(Path.home() / ".cache" / "jaxinfer"),
    ),
    # The real models' (tests/engine/test_real_models.py): eight chat prompts prefilled in one
    # step, then decoded together.
    "real": dict(
        max_model_len=512,
        max_num_seqs=8,
        max_num_batched_tokens=512,
        token_buckets=(8,),
        block_size=16,
        num_kv_blocks=96,
    ),
}


PRESETS["tiny_one_bucket"] = {**PRESETS["tiny"], "token_buckets": (16,)}

TINY_OPTIONS = PRESETS["tiny"]


def engine_options(model, preset: str | None = "tiny", **overrides) -> dict:
    """The options of every engine the tests build: `model` (a folder or a file; None for the
    default model), a preset's options (None: the engine's defaults) and `overrides`."""
    options = {**(PRESETS[preset] if preset else {}), **overrides}
    if model is not None:
        options["model"] = str(model)
    return options


def build_llm(model, preset: str | None = "tiny", *, kernels=None, **overrides):
    """An LLM with engine_options(model, preset, **overrides)."""
    from jaxinfer import LLM

    return LLM(kernels=kernels, **engine_options(model, preset, **overrides))


def build_engine(model, preset: str | None = "tiny", **overrides):
    """An LLMEngine with engine_options(model, preset, **overrides)."""
    from jaxinfer.config import EngineOptions
    from jaxinfer.engine.llm_engine import LLMEngine

    return LLMEngine(EngineOptions(**engine_options(model, preset, **overrides)))


def layer_weights(runner) -> dict:
    """The runner's decoder-layer parameters: layer 0's (per-layer programs) or all of them
    stacked [L, ...] (under a scan)."""
    from flax import nnx

    if runner.layer_execution == "per_layer":
        return runner.layer_params[0]
    return nnx.to_pure_dict(runner.state)["layers"]


def scheduled(request, num_new: int, new_row: bool = False):
    """What the scheduler sends for `request`'s next `num_new` tokens (jaxinfer.engine.execution.step.
    prefill_chunk)."""
    from jaxinfer.engine.execution.step import prefill_chunk

    return prefill_chunk(request, num_new, new_row)
