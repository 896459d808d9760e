"""The engine's frozen configuration, built once from EngineOptions and their resolution."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp

from jaxinfer.arch_config import LlamaConfig
from jaxinfer.config.cache_specs import (
    CacheSpec,
    layer_specs,
    num_attention_layers,
    state_bytes_per_request,
)
from jaxinfer.config.compressed import check_mtp, size_pools
from jaxinfer.config.options import EngineOptions, quantization_of
from jaxinfer.config.resolved import ResolvedOptions
from jaxinfer.layers.compressed_cache import entry_columns
from jaxinfer.layers.kv_cache import KVCacheFormat
from jaxinfer.layers.quantization import Quantization
from jaxinfer.models.families.hf_config import read_config
from jaxinfer.parallel.mesh import check_tp_size, kv_replicas


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    path: Path  # the Hugging Face-style folder that is loaded
    arch: LlamaConfig
    dtype: jnp.dtype
    max_model_len: int
    # Weight-only quantization at load (jaxinfer.layers.quantization); None: as the checkpoint.
    quantization: Quantization | None = None
    random_weights: bool = False  # load_format "dummy": drawn on the device, nothing read
    reasoning_parser: str | None = None  # how its outputs write reasoning (jaxinfer.reasoning)
    pooling_type: str = "last"  # how embedding requests pool (EngineOptions.pooling_type)
    runner: str = "generate"  # or "pooling": embeddings only (EngineOptions.runner)


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    block_size: int
    num_blocks: int  # including the null block 0
    kv_format: KVCacheFormat  # jaxinfer.layers.kv_cache, settled once
    # What each group of the model's layers keeps per request (jaxinfer.config.cache_specs)
    layer_specs: tuple[CacheSpec, ...]
    enable_prefix_caching: bool = True
    # A hybrid model's slots for its states at block boundaries (prefix caching; 0: none),
    # beside one slot per request row (jaxinfer.engine.scheduling.state_checkpoints).
    state_checkpoints: int = 0
    # DeepSeek-V4's compressed stores: (key, blocks of block_size entries, the null block 0
    # included) each (jaxinfer.config.compressed)
    entry_blocks: tuple[tuple[str, int], ...] = ()

    def capacity_tokens(self) -> int:
        """Tokens the pool holds (the null block aside)."""
        return (self.num_blocks - 1) * self.block_size


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    token_buckets: tuple[int, ...]  # padded step sizes, ascending; each is compiled once
    # Most proposed tokens a request verifies in one step (0: no speculative decoding).
    num_speculative_tokens: int = 0
    # Step size up to which proposals may grow a step past its token bucket (above it they
    # only fill the bucket's padding), and the most proposals in one step: steps this small
    # cost about as much as a one-token step.
    spec_free_tokens: int = 1
    # KV blocks a request that proposes is given past its step's tokens, where possible: a
    # draft model writes the K/V of the tokens it proposes next there (0 for n-gram).
    spec_lookahead: int = 0

    def request_bucket(self, num_tokens_bucket: int) -> int:
        """Padded request count that goes with a token bucket (a step has <= 1 request/token)."""
        return min(num_tokens_bucket, self.max_num_seqs)

    def sample_bucket(self, num_tokens_bucket: int) -> int:
        """Padded count of the rows sampled in a step of a token bucket: one per request,
        plus one per proposed token verified (at most spec_free_tokens in a step, and never
        more rows than the step's tokens)."""
        requests = self.request_bucket(num_tokens_bucket)
        if not self.num_speculative_tokens:
            return requests
        return min(
            num_tokens_bucket,
            requests * (1 + self.num_speculative_tokens),
            requests + self.spec_free_tokens,
        )


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "none", "ngram", "suffix", "draft" or "mtp"
    num_speculative_tokens: int  # most proposals per request and step (0 when off)
    prompt_lookup_min: int
    prompt_lookup_max: int
    adaptive: bool = False  # proposals planned by measured step times (SpecControl)
    suffix_max_depth: int = 32
    suffix_cache_max_tokens: int = 16384
    suffix_min_token_prob: float = 0.1
    suffix_max_spec_factor: float = 1.0
    draft_prompt_lookup: bool = False  # a draft's requests that copy propose by lookup


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    kv_replicas: int = 1  # copies of each checkpoint KV head (tp > KV heads)
    expert_parallel: bool = False  # a MoE model's experts whole per device
    check_schedule: bool = False  # compare each step's schedule across processes (debug)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    max_loras: int  # device slots: adapters resident at once
    max_rank: int  # every slot's rank (smaller adapters are zero-padded)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    resolved: ResolvedOptions  # every "auto" settled (jaxinfer.config.resolve)
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig("none", 0, 1, 1)
    lora: LoraConfig | None = None  # LoRA adapters served per request (None: off)

    @property
    def layer_execution(self) -> str:  # "scan" or "per_layer" (see ModelRunner)
        return self.resolved.layer_execution

    @property
    def async_scheduling(self) -> bool:  # schedule step N+1 while step N runs
        return self.resolved.async_scheduling

    @property
    def max_blocks_per_request(self) -> int:
        return -(-self.model.max_model_len // self.cache.block_size)

    @property
    def block_table_width(self) -> int:
        """A block-table row's columns: the request's KV blocks, then (DeepSeek-V4) each
        compressed kind's entry blocks (jaxinfer.layers.compressed_cache.entry_columns)."""
        arch = self.model.arch
        if arch.compressed is None:
            return self.max_blocks_per_request
        columns = entry_columns(arch, self.cache.block_size, self.model.max_model_len)
        return columns[-1][2] if columns else self.max_blocks_per_request


def token_buckets(
    max_num_batched_tokens: int, chosen: tuple[int, ...] | None = None
) -> tuple[int, ...]:
    """The padded step sizes, ascending: the `chosen` ones (EngineOptions.token_buckets) and
    the budget; by default 1, 2, 4, then powers of two and the midpoints between them (6, 8,
    12, 16, 24, ...) up to the budget, and the budget itself: a step pads by at most a third."""
    if chosen is not None:
        return tuple(sorted({*chosen, max_num_batched_tokens}))
    buckets = {1, 2, 4}
    size = 4
    while size < max_num_batched_tokens:
        buckets.update({size + size // 2, size * 2})
        size *= 2
    buckets = {b for b in buckets if b < max_num_batched_tokens}
    return tuple(sorted(buckets | {max_num_batched_tokens}))


def model_arch(options: EngineOptions, model_path: Path) -> LlamaConfig:
    """The model's shape as the engine runs it: under tensor parallelism each KV head is
    copied so that every device holds one."""
    arch = read_config(model_path / "config.json")
    tp = options.tensor_parallel_size
    check_tp_size(arch, tp)
    replicas = kv_replicas(arch, tp)
    return dataclasses.replace(arch, num_key_value_heads=arch.num_key_value_heads * replicas)


def check_expert_split(arch: LlamaConfig, tp: int, expert_parallel: bool) -> None:
    """A clear error unless the devices split a MoE model's experts evenly (whole experts
    with expert parallelism, each expert's intermediate axis without)."""
    if expert_parallel and arch.moe is None:
        raise ValueError(
            f"expert_parallel needs a mixture-of-experts model, not {arch.architecture}"
        )
    if arch.moe is None or tp == 1:
        return
    if expert_parallel and arch.moe.num_experts % tp:
        raise ValueError(
            f"expert_parallel: {arch.moe.num_experts} experts do not split over "
            f"tensor_parallel_size {tp}"
        )
    if not expert_parallel and arch.moe.intermediate_size % tp:
        raise ValueError(
            f"each expert's intermediate size {arch.moe.intermediate_size} does not split over "
            f"tensor_parallel_size {tp}: choose another size, or expert_parallel"
        )


def build_engine_config(
    options: EngineOptions,
    resolved: ResolvedOptions,
    model_path: Path,
    draft_path: Path | None = None,
) -> EngineConfig:
    """`draft_path`: a draft model's folder (speculative_method draft), whose KV cache has the
    model's blocks: kv_cache_memory_gb pays for both."""
    arch = read_config(model_path / "config.json")
    tp = options.tensor_parallel_size
    check_tp_size(arch, tp)
    replicas = kv_replicas(arch, tp)
    # The model's view: each KV head copied `replicas` times (so every device holds one).
    arch = dataclasses.replace(arch, num_key_value_heads=arch.num_key_value_heads * replicas)
    check_expert_split(arch, tp, options.expert_parallel)
    check_mtp(options, arch)
    if options.enable_lora and replicas > 1:
        raise ValueError(
            f"enable_lora: tensor_parallel_size {tp} copies the model's KV heads, which LoRA's "
            "k and v products do not follow yet; use at most as many devices as KV heads"
        )
    dtype = resolved.jnp_dtype
    max_model_len = options.max_model_len or arch.max_position_embeddings
    if max_model_len > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's max_position_embeddings "
            f"({arch.max_position_embeddings})"
        )
    kv_format = KVCacheFormat.resolve(options.kv_cache_dtype, dtype)
    num_speculative = options.num_speculative_tokens if options.speculative_method != "none" else 0
    specs = layer_specs(arch, dtype, num_speculative)
    bytes_per_block = 0  # on each device: the caches are split by KV heads
    cached_models = [arch] + ([read_config(draft_path / "config.json")] if draft_path else [])
    for cached in cached_models if arch.compressed is None else []:
        heads = cached.num_key_value_heads * kv_replicas(cached, tp) // tp
        layers = num_attention_layers(layer_specs(cached, dtype))
        bytes_per_block += kv_format.bytes_per_block(
            options.block_size, layers, heads, cached.head_dim
        )
    per_request = state_bytes_per_request(specs)  # (a hybrid's linear layers')
    checkpoints = options.max_num_seqs if per_request and resolved.prefix_caching else 0
    states = (options.max_num_seqs + 1 + checkpoints) * per_request  # a slot per row, too
    budget = int(options.kv_cache_memory_gb * (1 << 30)) - states
    if budget <= 0 and not options.num_kv_blocks:
        raise ValueError(
            f"kv_cache_memory_gb {options.kv_cache_memory_gb} does not hold the linear layers' "
            f"states of {options.max_num_seqs} requests and {checkpoints} prefix checkpoints "
            f"({states} bytes); raise it or lower max_num_seqs"
        )
    entry_blocks = ()
    if arch.compressed is not None:
        pools = size_pools(arch, specs, options, budget, dtype)
        num_blocks, entry_blocks = pools.num_blocks, pools.entry_blocks
    elif bytes_per_block == 0:  # no attention layer (every layer linear): blocks cost nothing
        blocks_per_request = -(-max_model_len // options.block_size)
        num_blocks = options.num_kv_blocks or options.max_num_seqs * blocks_per_request + 1
    else:
        num_blocks = options.num_kv_blocks or max(2, budget // bytes_per_block)
    return EngineConfig(
        model=ModelConfig(
            path=model_path,
            arch=arch,
            dtype=dtype,
            max_model_len=max_model_len,
            quantization=quantization_of(options),
            random_weights=options.load_format == "dummy",
            reasoning_parser=options.reasoning_parser,
            pooling_type=pooling_type(options.pooling_type, model_path),
            runner=options.runner,
        ),
        cache=CacheConfig(
            block_size=options.block_size,
            num_blocks=num_blocks,
            enable_prefix_caching=resolved.prefix_caching,
            kv_format=kv_format,
            layer_specs=specs,
            state_checkpoints=checkpoints,
            entry_blocks=entry_blocks,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            max_model_len=max_model_len,
            token_buckets=token_buckets(options.max_num_batched_tokens, options.token_buckets),
            num_speculative_tokens=num_speculative,
            spec_free_tokens=resolved.speculative_free_tokens,
            spec_lookahead=(
                num_speculative if options.speculative_method in ("draft", "mtp") else 0
            ),
        ),
        resolved=resolved,
        parallel=ParallelConfig(
            tensor_parallel_size=tp,
            kv_replicas=replicas,
            expert_parallel=options.expert_parallel,
            check_schedule=options.check_schedule,
        ),
        speculative=SpeculativeConfig(
            method=options.speculative_method,
            num_speculative_tokens=num_speculative,
            prompt_lookup_min=options.prompt_lookup_min,
            prompt_lookup_max=options.prompt_lookup_max,
            adaptive=resolved.speculative_adaptive,
            suffix_max_depth=options.suffix_max_depth,
            suffix_cache_max_tokens=options.suffix_cache_max_tokens,
            suffix_min_token_prob=options.suffix_min_token_prob,
            suffix_max_spec_factor=options.suffix_max_spec_factor,
            draft_prompt_lookup=options.draft_prompt_lookup,
        ),
        lora=LoraConfig(options.max_loras, options.max_lora_rank) if options.enable_lora else None,
    )


def pooling_type(asked: str, folder: Path) -> str:
    """EngineOptions.pooling_type settled: "auto" reads a sentence-transformers folder's
    pooling module (modules.json, then its config.json), else takes the last token."""
    if asked != "auto":
        return asked
    try:
        modules = json.loads((folder / "modules.json").read_text())
        path = next(m["path"] for m in modules if m.get("type", "").endswith(".Pooling"))
        config = json.loads((folder / path / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return "last"
    for key, kind in (
        ("pooling_mode_mean_tokens", "mean"),
        ("pooling_mode_cls_token", "cls"),
        ("pooling_mode_lasttoken", "last"),
    ):
        if config.get(key):
            return kind
    return "last"
