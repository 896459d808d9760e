"""Shared fixtures: tiny random Hugging Face Llama folders, and the default model."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest

from tools.tiny_tokenizer import write_tiny_tokenizer

# Tensor-parallel tests split models over 8 virtual CPU devices (set before any device use;
# everything else runs on the first device as before).
jax.config.update("jax_num_cpu_devices", 8)
# Engines would keep every compiled program in JAX's persistent cache; in a test session the
# programs rarely repeat and writing them costs time (the cache has its own test, in fresh
# processes).
jax.config.update("jax_enable_compilation_cache", False)


def make_tiny_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A random LlamaForCausalLM (or Qwen2) saved by transformers, with a byte-level tokenizer."""
    import torch
    import transformers

    arch = overrides.pop("architecture", "llama")
    config_kwargs = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    config_kwargs.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config_kwargs))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config_kwargs))
    # Random init is small; scale weights up so logits are far from uniform and bugs show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(4.0)
    model.eval().save_pretrained(folder, safe_serialization=True)
    write_tiny_tokenizer(folder, config_kwargs["vocab_size"])
    return folder


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Where the default model is converted once and reused across runs."""
    return Path.home() / ".cache" / "jaxinfer"


# Named engine options for the tiny model:
# - "tiny": every prompt is chunked, and warm-up compiles few buckets;
# - "served": the server, batch and robustness tests' (prompts of up to 64 tokens in a step).
PRESETS = {
    "tiny": dict(
        max_num_batched_tokens=16, max_num_seqs=4, block_size=8, num_kv_blocks=64, max_model_len=96
    ),
    "served": dict(
        max_num_batched_tokens=64,
        max_num_seqs=8,
        block_size=8,
        num_kv_blocks=128,
        max_model_len=128,
    ),
}
TINY_OPTIONS = PRESETS["tiny"]


@pytest.fixture(scope="session")
def make_llm(tiny_model_dir):
    """make_llm(preset, **overrides): an LLM on the tiny model, built once per session for each
    set of options and shared by the tests that only generate with it (tests that change an
    engine's state, or hand it to a server thread, build their own)."""
    from jaxinfer import LLM

    engines = {}

    def make(preset: str = "tiny", **overrides):
        key = (preset, tuple(sorted(overrides.items())))
        if key not in engines:
            engines[key] = LLM(model=str(tiny_model_dir), **{**PRESETS[preset], **overrides})
        return engines[key]

    return make


@pytest.fixture(scope="session")
def default_llm(model_cache_dir):
    """One engine on the default model, shared by its engine and server tests (the server's
    engine thread, idle between requests, leaves it to whoever calls it next)."""
    from jaxinfer import LLM

    return LLM(
        cache_dir=str(model_cache_dir),
        max_model_len=1024,
        max_num_seqs=32,
        max_num_batched_tokens=128,
    )


@pytest.fixture(scope="session")
def tiny_llm(make_llm):
    """The "tiny" engine, shared by the tests that compare others against it."""
    return make_llm("tiny")


@pytest.fixture(scope="session")
def cpu_kernel_dir(model_cache_dir):
    """Where the C++ kernels are built: the engines' own folder under the default cache
    directory, so a session builds each kernel once (builds are named by a hash of their
    source, compiler and jaxlib, and written atomically)."""
    from cpu_kernels.build import can_build

    if not can_build():
        pytest.skip("no C++ compiler to build the C++ kernels, or a CPU without AVX2/FMA")
    return model_cache_dir / "cpu_kernels"


@pytest.fixture(scope="session")
def cpu_matmul(cpu_kernel_dir):
    """The C++ matmul kernel (cpu_kernels.matmul), built once per test session."""
    from cpu_kernels.matmul.kernel import load_matmul

    return load_matmul(cpu_kernel_dir)


@pytest.fixture(scope="session")
def cpu_gguf_matmul(cpu_kernel_dir):
    """The C++ kernel for GGUF block weights (cpu_kernels.gguf_matmul), built once per session."""
    from cpu_kernels.gguf_matmul.kernel import load_gguf_matmul

    return load_gguf_matmul(cpu_kernel_dir)


@pytest.fixture(scope="session")
def cpu_attention(cpu_kernel_dir):
    """The C++ paged attention kernel (cpu_kernels.paged_attention), built once per session."""
    from cpu_kernels.paged_attention.kernel import load_paged_attention

    return load_paged_attention(cpu_kernel_dir)


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
