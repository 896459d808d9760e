"""Warm-up: compiling a runner's programs before serving. The first token buckets run as
all-padding steps (warmup); the rest are lowered and compiled without running, on a thread of
their own (compile_bucket, from jaxinfer.engine.startup.background_compile)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from jaxinfer.engine.execution.batch_builder import BatchBuilder
from jaxinfer.engine.execution.model_runner import PROMPT_LOGPROB_ROWS, ModelRunner
from jaxinfer.engine.execution.step import HostStep, PromptLogprobRows, RowUpdates, SamplingFlags
from jaxinfer.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


class RunnerSpecs(NamedTuple):
    """ModelRunner's device state as jax.ShapeDtypeStructs (state_specs)."""

    state: Any  # the layers' parameters (nnx.State)
    top_params: Any  # embed, norm, LM head, rope cache
    kv_cache: Any
    block_table: Any
    last_tokens: Any
    sampler_state: Any
    lora: Any = None  # the LoRA adapters' slots, if any


def warmup_units(buckets: tuple[int, ...]) -> int:
    """How many units warmup(builder, buckets) reports progress in."""
    return len(buckets) + 1


def warmup(
    runner: ModelRunner,
    builder: BatchBuilder,
    buckets: tuple[int, ...],
    progress: Callable[[int, str], None] | None = None,
) -> float:
    """Compiles token buckets `buckets` (all, or the first few), the sampler of each
    sample-row bucket (and the logprobs of its samples) and every size of per-request row
    updates, by running all-padding steps from the batch builder; returns the seconds it
    took. progress(done, what) is called after each of its warmup_units(buckets): the token
    buckets, then the row updates (and the draft). The other buckets compile later with
    compile_bucket."""
    start = time.perf_counter()
    for index, num_tokens in enumerate(buckets):
        inputs, sampling = builder.padding_batch(num_tokens)
        num_samples = sampling.temperature.shape[0]
        # The samples' logprobs once per sample-row bucket (the sampler is the same program
        # with or without them), the prompt's once per token bucket.
        num_logprobs = 0 if num_samples in runner.sampled_buckets else MAX_LOGPROBS
        runner.sampled_buckets.add(num_samples)
        prompt = PromptLogprobRows(np.zeros(1, np.int32), np.zeros(1, np.int32), ())
        step = HostStep(inputs, sampling, SamplingFlags(num_logprobs), RowUpdates(), prompt)
        jax.block_until_ready(runner.execute(step, draft_inputs=inputs))  # (the draft's too)
        if progress is not None:
            progress(index + 1, f"{num_tokens} tokens")
    for num_rows in builder.update_buckets:
        runner.apply_updates(builder.padding_updates(num_rows))
        jax.block_until_ready((runner.block_table, runner.sampler_state))  # (dispatch.py)
    if runner.draft is not None:
        runner.draft.warmup(runner.block_table, runner.sampler_state.bias)
    if runner.lora is not None:  # an adapter's write into a slot (an empty one, emptied)
        runner.load_lora(0, runner.empty_lora_slot())
    jax.block_until_ready((runner.kv_cache, runner.block_table, runner.sampler_state))
    if progress is not None:
        progress(len(buckets) + 1, "row updates" + (", draft" * bool(runner.draft)))
    seconds = time.perf_counter() - start
    logger.info("warm-up compiled token buckets %s in %.1f s", buckets, seconds)
    return seconds


def state_specs(runner: ModelRunner) -> RunnerSpecs:
    """The device state a step's programs take, as shapes, dtypes and shardings: what
    compile_bucket lowers against (on the engine's thread, once: the arrays themselves
    are donated and replaced step by step)."""
    if runner.layer_execution != "scan" or runner.draft is not None:
        raise ValueError("buckets compile ahead only for scan execution without a draft")

    def spec(tree):
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree
        )

    return RunnerSpecs(
        spec(runner.state),
        spec(runner.top_params),
        spec(runner.kv_cache),
        spec(runner.block_table),
        spec(runner.last_tokens),
        spec(runner.sampler_state),
        None if runner.lora is None else spec(runner.lora),
    )


def compile_bucket(
    runner: ModelRunner, builder: BatchBuilder, num_tokens: int, specs: RunnerSpecs
) -> None:
    """Compiles the programs of token bucket `num_tokens` without running them (safe on
    another thread while the engine steps): the model step, the sampler of its sample-row
    bucket and its samples' logprobs (unless compiled already) and the row selection of
    prompt logprobs. A step of this bucket then finds them all in JAX's caches."""
    inputs, sampling = builder.padding_batch(num_tokens)
    step = runner.scan_step.lower(
        specs.state,
        specs.top_params,
        specs.kv_cache,
        specs.block_table,
        specs.last_tokens,
        inputs,
        specs.lora,
    )
    _, hidden, logits = output_specs(step)
    num_samples = sampling.temperature.shape[0]
    if num_samples not in runner.sampled_buckets:
        sample = runner.sample_program.lower(
            logits, sampling, specs.sampler_state, specs.last_tokens, draft_probs=None
        )
        sampled, _, _ = output_specs(sample)
        runner.sampled_logprobs.lower(logits, sampled.token_ids).compile()
        runner.sampled_buckets.add(num_samples)
    runner.select_rows.lower(hidden, np.zeros(PROMPT_LOGPROB_ROWS, np.int32)).compile()


def output_specs(lowered: jax.stages.Lowered) -> Any:
    """Compiles a lowered program; its outputs as ShapeDtypeStructs, with their shardings."""
    compiled = lowered.compile()
    return jax.tree.map(
        lambda info, sharding: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
        lowered.out_info,
        compiled.output_shardings,
    )
