"""Engine configuration: frozen dataclasses built at the entry points and validated here."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxinfer.layers.native_kernels import check_gguf_mode
from jaxinfer.layers.native_kernels import check_impl as check_matmul_impl
from jaxinfer.layers.quantization import check_quantization
from jaxinfer.models.llama_config import LlamaConfig
from jaxinfer.parallel.mesh import check_tp_size, kv_replicas

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """What a user may set (LLM(**options), later flags and TOML). Validated on creation.

    Args:
        model: None for the default model, a Hugging Face folder, or a .gguf file.
        dtype: "auto" (float32 on CPU, bfloat16 on GPU), "float32", "bfloat16" or "float16".
        max_model_len: longest sequence (prompt + output); None: the model's maximum.
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step; longer prompts are chunked.
        block_size: tokens per KV-cache block.
        num_kv_blocks: KV-cache blocks in the pool (block 0 is the null block); None: sized
            from kv_cache_memory_gb.
        kv_cache_memory_gb: memory budget of the KV cache when num_kv_blocks is None.
        cache_dir: where converted models (and later compiled programs) are kept.
        enable_prefix_caching: reuse the KV blocks of prompt prefixes computed before.
        layer_execution: "scan" (one program per step, layers under lax.scan), "per_layer"
            (one compiled layer program called per layer) or "auto": scan, except on CPU
            without the matmul kernel (matmul_impl), where the scan's per-layer weight slices
            are copies and per_layer is faster; with the kernel, which reads each layer's
            weights in place, the scan ran the plain benchmark 1.03-1.18x faster.
        async_scheduling: schedule and enqueue step N+1 while the device runs step N (decode
            inputs are read on the device), so host work does not leave the device idle.
            None: on for accelerators, off on CPU, where the "device" is the host's own cores
            and the overlap made the plain benchmark about 15% slower (docs/benchmarks.md).
        compilation_cache: keep compiled programs in JAX's persistent compilation cache, so
            the next start of the same configuration loads them instead of compiling.
        compilation_cache_dir: where; None: `<cache_dir>/xla`.
        tensor_parallel_size: devices the model is split over (a mesh axis "tp"; under
            jax.distributed the devices of every process count).
        attention_impl, ffn_impl, norm_impl: the kernel each kind runs, by its name in the
            engine's KernelRegistry: "reference" (pure JAX), "pallas" (the GPU kernels),
            "pallas_interpret" (the kernels interpreted on CPU, for tests), a name registered
            by the user, or "auto" (pallas on one GPU; on CPU the C++ attention kernel, "cpu",
            where it runs (jaxinfer.layers.native_kernels); reference elsewhere).
        weight_layout: how projection weights are stored and multiplied
            (jaxinfer.layers.linear): "in_out" (x @ W), "out_in" (W @ x^T, much faster on
            XLA:CPU at decode sizes) or "auto" ("out_in" on CPU with the reference FFN, else
            "in_out").
        quantization: None (weights in `dtype`) or "int8": weight-only int8 with one scale
            per output channel for every projection and the LM head (4x smaller weights than
            float32; activations and the KV cache stay in `dtype`).
        matmul_impl: what computes the "out_in" projections and LM head, float32 or int8
            (jaxinfer.layers.native_kernels): "cpu" (a C++ kernel built once with the host's
            compiler; XLA:CPU with float32 activations, "out_in" and one device only), "xla"
            (XLA's ops) or "auto" ("cpu" where it runs, else "xla"). The kernel leaves float32
            products of more than 48 rows (prefill chunks) to XLA's GEMM.
        gguf_weights: "auto", "on" or "off": beside the matmul kernel, also keep the Q4_1 and
            Q8_0 blocks of the GGUF file the model folder's float32 weights were dequantized
            from (the default model's), each only if it dequantizes to its weight bit for bit,
            and multiply steps of up to 3 tokens by those (a quarter of the bytes read,
            bit-identical products; jaxinfer.layers.native_kernels). "auto": where they can
            be kept; "on": an error where they cannot.
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_gb: float = 1.0
    cache_dir: str = str(Path.home() / ".cache" / "jaxinfer")
    enable_prefix_caching: bool = True
    layer_execution: str = "auto"
    async_scheduling: bool | None = None
    compilation_cache: bool = True
    compilation_cache_dir: str | None = None
    tensor_parallel_size: int = 1
    attention_impl: str = "auto"
    ffn_impl: str = "auto"
    norm_impl: str = "auto"
    weight_layout: str = "auto"
    quantization: str | None = None
    matmul_impl: str = "auto"
    gguf_weights: str = "auto"

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not isinstance(self.block_size, int) or self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be 8, 16, 32, 64 or 128, got {self.block_size!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        if self.layer_execution not in ("auto", "scan", "per_layer"):
            raise ValueError(
                "layer_execution must be 'auto', 'scan' or 'per_layer', "
                f"got {self.layer_execution!r}"
            )
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be true, false or unset, got {self.async_scheduling!r}"
            )
        for name in ("attention_impl", "ffn_impl", "norm_impl"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must name a kernel, got {getattr(self, name)!r}")
        if self.weight_layout not in ("auto", "in_out", "out_in"):
            raise ValueError(
                f"weight_layout must be 'auto', 'in_out' or 'out_in', got {self.weight_layout!r}"
            )
        check_quantization(self.quantization)
        check_matmul_impl(self.matmul_impl)
        check_gguf_mode(self.gguf_weights)
        if not self.kv_cache_memory_gb > 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: Path  # the Hugging Face-style folder that is loaded
    arch: LlamaConfig
    dtype: jnp.dtype
    max_model_len: int
    quantization: str | None = None  # "int8": weight-only (jaxinfer.layers.quantization)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int  # including the null block 0
    enable_prefix_caching: bool = True

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    token_buckets: tuple[int, ...]  # padded step sizes, ascending; each is compiled once

    def request_bucket(self, num_tokens_bucket: int) -> int:
        """Padded request count that goes with a token bucket (a step has <= 1 request/token)."""
        return min(num_tokens_bucket, self.max_num_seqs)


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    kv_replicas: int = 1  # copies of each checkpoint KV head (tp > KV heads)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    layer_execution: str  # "scan" or "per_layer" (see ModelRunner)
    async_scheduling: bool  # schedule step N+1 while step N runs (see EngineOptions)
    parallel: ParallelConfig = ParallelConfig()

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.model.max_model_len // self.cache.block_size)


def resolve_dtype(name: str) -> jnp.dtype:
    if name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    return _DTYPES[name]


def token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 2, 4, then powers of two and the midpoints between them (6, 8, 12, 16, 24, ...) up
    to the budget, and the budget itself: a step pads by at most a third."""
    buckets = {1, 2, 4}
    size = 4
    while size < max_num_batched_tokens:
        buckets.update({size + size // 2, size * 2})
        size *= 2
    buckets = {b for b in buckets if b < max_num_batched_tokens}
    return tuple(sorted(buckets | {max_num_batched_tokens}))


def build_engine_config(options: EngineOptions, model_path: Path) -> EngineConfig:
    arch = LlamaConfig.from_file(model_path / "config.json")
    tp = options.tensor_parallel_size
    check_tp_size(arch, tp)
    replicas = kv_replicas(arch, tp)
    # The model's view: each KV head copied `replicas` times (so every device holds one).
    arch = dataclasses.replace(arch, num_key_value_heads=arch.num_key_value_heads * replicas)
    dtype = resolve_dtype(options.dtype)
    max_model_len = options.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"({arch.max_position_embeddings})"
        )
    bytes_per_block = (  # on each device: the KV cache is split by KV heads
        arch.num_hidden_layers
        * 2
        * options.block_size
        * (arch.num_key_value_heads // tp)
        * arch.head_dim
        * jnp.dtype(dtype).itemsize
    )
    num_blocks = options.num_kv_blocks or max(
        2, int(options.kv_cache_memory_gb * (1 << 30)) // bytes_per_block
    )
    return EngineConfig(
        model=ModelConfig(
            path=model_path,
            arch=arch,
            dtype=dtype,
            max_model_len=max_model_len,
            quantization=options.quantization,
        ),
        cache=CacheConfig(
            block_size=options.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=options.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=max_model_len,
            token_buckets=token_buckets(options.max_num_batched_tokens),
        ),
        layer_execution=_resolve_layer_execution(options.layer_execution),
        async_scheduling=(
            jax.default_backend() != "cpu"
            if options.async_scheduling is None
            else options.async_scheduling
        ),
        parallel=ParallelConfig(tensor_parallel_size=tp, kv_replicas=replicas),
    )


def _resolve_layer_execution(name: str) -> str:
    if name == "auto":
        return "per_layer" if jax.default_backend() == "cpu" else "scan"
    return name
