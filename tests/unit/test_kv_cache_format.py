"""The KV-cache formats' capacity: for the same memory, the pool holds more blocks by the
byte ratio of its format (scales included), and the option refuses unknown formats."""

from __future__ import annotations

import pytest

from jaxinfer.config import EngineOptions
from jaxinfer.config.configure import configure
from jaxinfer.layers.kv_cache import KVCacheFormat


def bytes_per_token(kind, dtype, *shape):
    return KVCacheFormat.resolve(kind, dtype).bytes_per_token(*shape)


def test_bytes_per_token_counts_values_and_scales():
    # 30 layers, 3 KV heads of 64 (the default model): K and V of every layer
    assert bytes_per_token("auto", "float32", 30, 3, 64) == 2 * 30 * 3 * 64 * 4
    assert bytes_per_token("auto", "bfloat16", 30, 3, 64) == 2 * 30 * 3 * 64 * 2
    assert bytes_per_token("int8", "float32", 30, 3, 64) == 2 * 30 * 3 * (64 + 4)
    assert bytes_per_token("fp8_e4m3", "bfloat16", 30, 3, 64) == 2 * 30 * 3 * 64


def test_a_format_is_settled_once_into_a_value():
    int8, fp8 = (KVCacheFormat.resolve(k, "float32") for k in ("int8", "fp8_e5m2"))
    assert (int8.value_dtype, int8.scale_layout, int8.quantized) == ("int8", "token", True)
    assert (fp8.value_dtype, fp8.scale_layout) == ("float8_e5m2", "head")
    auto = KVCacheFormat.resolve("auto", "bfloat16")
    assert (auto.value_dtype, auto.scale_layout, auto.quantized) == ("bfloat16", None, False)
    assert int8.bytes_per_block(16, 30, 3, 64) == 16 * int8.bytes_per_token(30, 3, 64)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVCacheFormat.resolve("int4", "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_pool_grows_by_the_byte_ratio(tiny_model_dir, dtype):
    blocks = {}
    for kind in ("auto", "int8", "fp8_e5m2"):
        options = EngineOptions(
            model=str(tiny_model_dir),
            kv_cache_dtype=kind,
            kv_cache_memory_gb=0.01,
            block_size=16,
            dtype=dtype,
            attention_impl="reference",
        )
        config, _ = configure(options, tiny_model_dir)
        per_block = 16 * bytes_per_token(kind, dtype, 3, 2, 16)  # the tiny model's shape
        assert config.cache.num_blocks == int(0.01 * (1 << 30)) // per_block
        assert config.cache.capacity_tokens() == (config.cache.num_blocks - 1) * 16
        blocks[kind] = config.cache.num_blocks
    itemsize = 4 if dtype == "float32" else 2
    assert blocks["int8"] / blocks["auto"] == pytest.approx(16 * itemsize / (16 + 4), rel=1e-3)
    assert blocks["fp8_e5m2"] / blocks["auto"] == pytest.approx(itemsize, rel=1e-3)


def test_unknown_formats_are_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineOptions(kv_cache_dtype="int4")
