"""Shared fixtures: tiny random Hugging Face Llama folders, the engines built on them, the
default model, the C++ kernels; and the run's compilation cache."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import jax
import pytest

from tests.support.engines import build_llm
from tests.support.models import make_tiny_model

# Tensor-parallel tests split models over 8 virtual CPU devices (set before any device use;
# everything else runs on the first device as before).
jax.config.update("jax_num_cpu_devices", 8)


def pytest_addoption(parser):
    parser.addoption(
        "--compilation_cache_dir",
        default=None,
        help="JAX's persistent compilation cache for this run, shared by its pytest processes "
        "(tools.test_lanes passes one); default: a fresh directory, removed at the end.",
    )


def pytest_configure(config):
    """Every compiled program goes to one cache for the whole run: the many engines the tests
    build on the same tiny model with the same options compile each program once. The
    user's own cache (~/.cache/jaxinfer/xla) is never touched: an engine finds this one in
    use and keeps it (jaxinfer.engine.startup.compilation_cache.enable)."""
    from jaxinfer.engine.startup import compilation_cache

    path = config.getoption("compilation_cache_dir")
    if path is None:
        path = tempfile.mkdtemp(prefix="jaxinfer-test-xla-")
        config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    compilation_cache.enable(Path(path))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def model_cache_dir() -> Path:
    """Where the default model is converted once and reused across runs."""
    return Path.home() / ".cache" / "jaxinfer"


@pytest.fixture(scope="session")
def make_llm(tiny_model_dir):
    """make_llm(preset, **overrides): an LLM on the tiny model, built once per session for each
    set of options and shared by the tests that only generate with it (tests that change an
    engine's state, or hand it to a server thread, build their own)."""

    engines = {}

    def make(preset: str = "tiny", **overrides):
        key = (preset, tuple(sorted(overrides.items())))
        if key not in engines:
            engines[key] = build_llm(tiny_model_dir, preset, **overrides)
        return engines[key]

    return make


@pytest.fixture(scope="session")
def default_llm(model_cache_dir):
    """One engine on the default model, shared by its engine and server tests (the server's
    engine thread, idle between requests, leaves it to whoever calls it next)."""

    return build_llm(None, "default", cache_dir=str(model_cache_dir))


@pytest.fixture(scope="session")
def default_hf_model(model_cache_dir):
    """HF transformers' float32 model of the default model's GGUF file, loaded once (its GGUF
    loading dequantizes in Python); tests that change it take a copy."""
    import torch
    import transformers

    from jaxinfer.model_loader.model_cache import resolve_model

    folder = resolve_model(None, model_cache_dir)
    gguf_file = next(folder.glob("*.gguf")).name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=gguf_file, dtype=torch.float32
    )
    return model.eval()


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


@pytest.fixture(scope="session")
def cpu_compressed(cpu_kernel_dir):
    """DeepSeek-V4's C++ attention and indexer (cpu_kernels.compressed_attention), built once
    per session."""
    from cpu_kernels.compressed_attention.kernel import load_compressed_attention

    return load_compressed_attention(cpu_kernel_dir)
