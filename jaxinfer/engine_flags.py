"""absl flags for every engine option, shared by the command-line entry points.

A flag left unset keeps the value of the --config TOML file, or else the option's default.
"""

from __future__ import annotations

from absl import flags

from jaxinfer.config import EngineOptions
from jaxinfer.config_file import load_engine_options
from jaxinfer.parallel.distributed import DistributedConfig


def define_engine_flags() -> None:
    define = flags
    define.DEFINE_string("model", None, "Hugging Face folder or .gguf file; default: SmolLM2-135M.")
    define.DEFINE_string("config", None, "TOML file of engine options (see configs/); flags win.")
    define.DEFINE_string("dtype", None, "auto, float32, bfloat16 or float16.")
    define.DEFINE_integer("max_model_len", None, "Longest prompt + output.")
    define.DEFINE_integer("max_num_seqs", None, "Requests per step.")
    define.DEFINE_integer("max_num_batched_tokens", None, "Token budget per step.")
    define.DEFINE_integer("block_size", None, "Tokens per KV-cache block.")
    define.DEFINE_integer("num_kv_blocks", None, "KV-cache blocks (else from the memory budget).")
    define.DEFINE_float("kv_cache_memory_gb", None, "KV-cache budget in GiB.")
    define.DEFINE_string("cache_dir", None, "Where converted models are kept.")
    define.DEFINE_bool("enable_prefix_caching", None, "Share KV blocks of common prefixes.")
    define.DEFINE_string("layer_execution", None, "auto, scan or per_layer.")
    define.DEFINE_bool("async_scheduling", None, "Schedule step N+1 while step N runs.")
    define.DEFINE_bool("compilation_cache", None, "Keep compiled programs for the next start.")
    define.DEFINE_string("compilation_cache_dir", None, "Where; default: <cache_dir>/xla.")
    define.DEFINE_integer("tensor_parallel_size", None, "Devices the model is split over.")
    define.DEFINE_string("coordinator_address", None, "jax.distributed: process 0's host:port.")
    define.DEFINE_integer("num_processes", None, "jax.distributed: processes in the job.")
    define.DEFINE_integer("process_id", None, "jax.distributed: this process's index.")
    define.DEFINE_string("attention_impl", None, "Attention kernel: auto, reference, pallas, ...")
    define.DEFINE_string("ffn_impl", None, "FFN kernel: auto, reference, pallas, ...")
    define.DEFINE_string("norm_impl", None, "Residual-add + RMSNorm kernel: auto, reference, ...")
    define.DEFINE_string("weight_layout", None, "Projection weights: auto, in_out or out_in.")
    define.DEFINE_string("quantization", None, "Weight-only quantization: int8 (default: none).")
    define.DEFINE_string("matmul_impl", None, "out_in projections: auto, cpu (C++ kernel) or xla.")
    define.DEFINE_string(
        "gguf_weights", None, "Exact GGUF blocks for 1-3 token steps: auto/on/off."
    )


def distributed_config_from_flags() -> DistributedConfig:
    values = flags.FLAGS
    return DistributedConfig(
        coordinator_address=values.coordinator_address,
        num_processes=values.num_processes,
        process_id=values.process_id,
    )


def engine_options_from_flags() -> EngineOptions:
    names = [
        "model",
        "dtype",
        "max_model_len",
        "max_num_seqs",
        "max_num_batched_tokens",
        "block_size",
        "num_kv_blocks",
        "kv_cache_memory_gb",
        "cache_dir",
        "enable_prefix_caching",
        "layer_execution",
        "async_scheduling",
        "compilation_cache",
        "compilation_cache_dir",
        "tensor_parallel_size",
        "attention_impl",
        "ffn_impl",
        "norm_impl",
        "weight_layout",
        "quantization",
        "matmul_impl",
        "gguf_weights",
    ]
    values = flags.FLAGS
    return load_engine_options(values.config, **{name: values[name].value for name in names})
