"""Start-up: from options to a model ready to serve. Resolves and configures the model, loads
its weights (and a draft model's or MTP layer's), calibrates a quantized KV cache, warms up
the token buckets (the first ones, or all) and leaves the rest to a background compiler."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import jax

from jaxinfer.arch_config import LINEAR_ATTENTION
from jaxinfer.config import EngineConfig, EngineOptions
from jaxinfer.config.cache_specs import describe_spec
from jaxinfer.config.compressed import NO_MTP_LAYER
from jaxinfer.config.configure import configure
from jaxinfer.engine.execution.batch_builder import BatchBuilder
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.speculation.draft_model import DraftModel, load_draft
from jaxinfer.engine.speculation.mtp import MtpProposer
from jaxinfer.engine.startup import compilation_cache, kv_calibration
from jaxinfer.engine.startup.background_compile import BackgroundCompiler, first_buckets
from jaxinfer.engine.startup.warmup import warmup, warmup_units
from jaxinfer.engine.startup.warmup_progress import WarmupProgress
from jaxinfer.layers.kernel_registry import KernelRegistry
from jaxinfer.layers.state_cache import state_bytes_per_slot
from jaxinfer.model_loader.load import load_model
from jaxinfer.model_loader.model_cache import resolve_model, source_gguf
from jaxinfer.model_loader.safetensors_loader import load_mtp_params
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.parallel.sharding import Partitioner
from jaxinfer.tokenizer import TokenizerWrapper

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StartedModel:
    """A model loaded, calibrated and warmed up: what the engine's step loop runs."""

    folder: Path  # the model's folder (config, tokenizer)
    config: EngineConfig
    tokenizer: TokenizerWrapper
    eos_token_ids: frozenset[int]
    partitioner: Partitioner
    gguf_weights: list[str]  # weights kept with GGUF blocks (or taken from them)
    draft: DraftModel | None  # speculative decoding's draft model
    proposer: DraftModel | MtpProposer | None  # its draft model or MTP layer
    batch_builder: BatchBuilder
    runner: ModelRunner
    warmup_seconds: float
    warmup_programs: int
    warmup_cache_hits: int
    background_compile: BackgroundCompiler | None  # the buckets warm-up left, compiling


def start_model(
    options: EngineOptions, kernels: KernelRegistry | None, show_progress: bool
) -> StartedModel:
    """`kernels`: where options.attention_impl, ffn_impl and norm_impl are looked up (default:
    the built-in implementations). `show_progress`: a progress bar of the warm-up."""
    folder = resolve_model(options.model, Path(options.cache_dir))
    gguf_source = source_gguf(options.model, folder)
    draft_folder = None
    if options.draft_model is not None:
        draft_folder = resolve_model(options.draft_model, Path(options.cache_dir))
    config, model_kernels = configure(
        options, folder, kernels, gguf_source, draft_folder=draft_folder
    )
    resolved = config.resolved
    mtp = None  # speculative decoding's MTP layer (it runs on the model's runner and cache)
    if config.speculative.method == "mtp":
        mtp = load_mtp_params(folder, config.model.arch, config.model.dtype)
        if mtp is None:
            raise ValueError(NO_MTP_LAYER)
    if resolved.compilation_cache_dir is not None:
        compilation_cache.enable(Path(resolved.compilation_cache_dir))
    arch = config.model.arch
    tokenizer = TokenizerWrapper(folder)
    eos_token_ids = frozenset(_generation_eos_ids(folder) or arch.eos_token_ids)

    parallel = config.parallel
    partitioner = Partitioner(
        make_mesh(parallel.tensor_parallel_size), expert_parallel=parallel.expert_parallel
    )
    graphdef, state, gguf_weights = load_model(
        folder, config, partitioner, gguf_source
    )  # gguf_weights: the weights kept with GGUF blocks too (or taken from them: int4)

    draft = None  # speculative decoding's draft model
    if config.speculative.method == "draft":
        draft = load_draft(
            options,
            config,
            tokenizer.tokenizer.get_vocab(),
            partitioner,
            kernels,
        )
    batch_builder = BatchBuilder(config)
    logger.info("engine: %s", json.dumps(describe(config, gguf_weights, draft)))
    cache = config.cache
    logger.info(
        "KV cache: %d blocks of %d tokens in %s, %d tokens",
        cache.num_blocks - 1,
        cache.block_size,
        cache.kv_format.name,
        cache.capacity_tokens(),
    )
    runner = ModelRunner(
        config,
        graphdef,
        state,
        model_kernels,
        partitioner,
        draft=draft,
        kv_constants=kv_calibration.calibrate(
            config, graphdef, state, model_kernels, partitioner, tokenizer
        ),
    )
    proposer = draft
    if mtp is not None:
        placed = jax.device_put(mtp, partitioner.replicated)
        proposer = runner.draft = MtpProposer(config, runner, placed)
    buckets = config.scheduler.token_buckets
    first = buckets if resolved.warmup == "all" else first_buckets(buckets)
    with compilation_cache.CompileCounter() as counter:
        progress = WarmupProgress(warmup_units(first), counter, show_progress)
        warmup_seconds = warmup(runner, batch_builder, first, progress)
    warmup_programs, warmup_cache_hits = counter.programs, counter.cache_hits
    logger.info(
        "warm-up: %d token buckets, %d programs (%d compiled, %d from the compilation "
        "cache) in %.1f s",
        len(first),
        counter.programs,
        counter.compiled,
        counter.cache_hits,
        warmup_seconds,
    )
    # The other buckets, compiled while the engine serves (warmup "background").
    background_compile: BackgroundCompiler | None = None
    rest = tuple(b for b in buckets if b not in first)
    if rest:
        batch_builder.ready_buckets = first
        background_compile = BackgroundCompiler(runner, batch_builder, rest)
    return StartedModel(
        folder=folder,
        config=config,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        partitioner=partitioner,
        gguf_weights=gguf_weights,
        draft=draft,
        proposer=proposer,
        batch_builder=batch_builder,
        runner=runner,
        warmup_seconds=warmup_seconds,
        warmup_programs=warmup_programs,
        warmup_cache_hits=warmup_cache_hits,
        background_compile=background_compile,
    )


def describe(config: EngineConfig, gguf_weights, draft: DraftModel | None) -> dict:
    """What the engine runs: the model, its sizes, and every option as resolved (with why,
    where "auto" chose)."""
    arch = config.model.arch
    return {
        "model": str(config.model.path),
        "max_model_len": config.model.max_model_len,
        "max_num_seqs": config.scheduler.max_num_seqs,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "block_size": config.cache.block_size,
        "num_kv_blocks": config.cache.num_blocks,
        "kv_cache_dtype": config.cache.kv_format.name,
        "kv_cache_capacity_tokens": config.cache.capacity_tokens(),
        "kv_cache_layers": config.model.arch.num_kv_layers,
        "cache_groups": [
            describe_spec(spec, arch, config.cache.kv_format, dict(config.cache.entry_blocks))
            for spec in config.cache.layer_specs
        ],
        "recurrent_states": _states(config),
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "quantization": config.resolved.weight_format,
        "gguf_block_weights": list(gguf_weights),
        "draft_model": None if draft is None else str(draft.config.model.path),
        "draft_int8_activations": None
        if draft is None
        else getattr(draft.runner.kernels.matmul, "int8_activations", False),
        "lora": None
        if config.lora is None
        else {"max_loras": config.lora.max_loras, "max_lora_rank": config.lora.max_rank},
        "resolved": config.resolved.describe(),
    }


def _states(config: EngineConfig) -> dict | None:
    """A hybrid model's recurrent-state capacity: a slot per request row, and per prefix
    checkpoint, in each linear layer (jaxinfer.layers.state_cache)."""
    arch = config.model.arch
    if arch.hybrid is None:
        return None
    return {
        "slots": config.scheduler.max_num_seqs,
        "prefix_checkpoints": config.cache.state_checkpoints,
        "layers": arch.hybrid.count(LINEAR_ATTENTION),
        "bytes_per_request": state_bytes_per_slot(arch, config.model.dtype),
    }


def _generation_eos_ids(folder: Path) -> list[int]:
    path = folder / "generation_config.json"
    if not path.exists():
        return []
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return list(eos) if isinstance(eos, list) else [eos]
