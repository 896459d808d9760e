"""Owns the parameters and the KV cache on the device and runs the jitted step.

Every token bucket (and each sampler variant for its request bucket) is compiled during
warm-up; afterwards every step reuses a compiled program.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.engine.batch import BatchInputs, SamplingMetadata
from jaxinfer.engine.batch_builder import SamplingFlags
from jaxinfer.engine.sampler import SamplerOutput, sample
from jaxinfer.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)


def _model_step(
    graphdef: nnx.GraphDef, state: nnx.State, kv_cache: jax.Array, batch: BatchInputs
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    return model(kv_cache, batch)


class ModelRunner:
    def __init__(self, config: EngineConfig, graphdef: nnx.GraphDef, state: nnx.State):
        self.config = config
        self.graphdef = graphdef
        self.state = state
        arch = config.model.arch
        self.kv_cache = jnp.zeros(
            (
                arch.num_hidden_layers,
                2,
                config.cache.num_blocks,
                config.cache.block_size,
                arch.num_key_value_heads,
                arch.head_dim,
            ),
            config.model.dtype,
        )  # [L, 2, NB, BS, K, D]
        self._model_step = jax.jit(
            functools.partial(_model_step, graphdef), donate_argnames=("kv_cache",)
        )
        self.warmup_seconds: float | None = None

    def execute(
        self, batch: BatchInputs, sampling: SamplingMetadata, flags: SamplingFlags
    ) -> SamplerOutput:
        """Runs one step; the result is still on the device (fetch with jax.device_get)."""
        batch, sampling = jax.device_put((batch, sampling))
        self.kv_cache, logits = self._model_step(self.state, self.kv_cache, batch)
        return sample(
            logits, sampling, all_greedy=flags.all_greedy, num_logprobs=flags.num_logprobs
        )

    def warmup(self) -> float:
        """Compiles every token bucket, and every sampler variant of each request bucket, by
        running all-padding batches; returns the seconds it took."""
        start = time.perf_counter()
        sched = self.config.scheduler
        sampled_buckets = set()
        for num_tokens in sched.token_buckets:
            batch, sampling = self.dummy_batch(num_tokens)
            batch, sampling = jax.device_put((batch, sampling))
            self.kv_cache, logits = self._model_step(self.state, self.kv_cache, batch)
            if logits.shape[0] in sampled_buckets:
                continue
            sampled_buckets.add(logits.shape[0])
            for all_greedy, num_logprobs in itertools.product((True, False), (0, MAX_LOGPROBS)):
                jax.block_until_ready(
                    sample(logits, sampling, all_greedy=all_greedy, num_logprobs=num_logprobs)
                )
        jax.block_until_ready(self.kv_cache)
        self.warmup_seconds = time.perf_counter() - start
        logger.info(
            "warm-up compiled token buckets %s in %.1f s", sched.token_buckets, self.warmup_seconds
        )
        return self.warmup_seconds

    def dummy_batch(self, num_tokens: int) -> tuple[BatchInputs, SamplingMetadata]:
        num_reqs = self.config.scheduler.request_bucket(num_tokens)
        max_blocks = self.config.max_blocks_per_request
        batch = BatchInputs(
            token_ids=np.zeros(num_tokens, np.int32),
            positions=np.zeros(num_tokens, np.int32),
            slot_mapping=np.zeros(num_tokens, np.int32),
            block_tables=np.zeros((num_reqs, max_blocks), np.int32),
            seq_lens=np.zeros(num_reqs, np.int32),
            query_start_loc=np.zeros(num_reqs + 1, np.int32),
            logits_indices=np.zeros(num_reqs, np.int32),
            num_seqs=np.zeros(1, np.int32),
        )
        sampling = SamplingMetadata(
            temperature=np.zeros(num_reqs, np.float32),
            seeds=np.zeros((num_reqs, 2), np.uint32),
            output_positions=np.zeros(num_reqs, np.int32),
        )
        return batch, sampling
