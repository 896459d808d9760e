"""Owns the parameters and the KV cache on the device and runs the jitted step.

Every token bucket (and each sampler variant for its request bucket) is compiled during
warm-up; afterwards every step reuses a compiled program.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.engine.batch import BatchInputs, SamplingMetadata
from jaxinfer.engine.batch_builder import SamplingFlags
from jaxinfer.engine.sampler import SamplerOutput, sample
from jaxinfer.models.llama import compute_logits, decoder_layer, embed_tokens
from jaxinfer.sampling_params import MAX_LOGPROBS
from pallas_kernels.ragged_paged_attention.reference import ragged_paged_attention_reference

logger = logging.getLogger(__name__)


def _scan_step(
    graphdef: nnx.GraphDef, state: nnx.State, kv_cache: jax.Array, batch: BatchInputs
) -> tuple[jax.Array, jax.Array]:
    model = nnx.merge(graphdef, state)
    return model(kv_cache, batch)


class ModelRunner:
    """Runs the model over one batch in one of two ways (EngineOptions.layer_execution):

    - "scan": one jitted program for the step, the layers under `lax.scan` over stacked
      weights. One dispatch per step.
    - "per_layer": the same decoder layer compiled once per bucket and called for each layer
      with that layer's own weight buffers, between an embedding and a head program. On
      XLA:CPU the scan form copies every layer's weights out of the stacked arrays before each
      matmul (a profile of the default model at 32 tokens: 32 ms of a 200 ms step); this form
      has no such copy and ran the 32-token step in 160-170 ms instead of 200-215 ms.

    Either way compile time does not grow with depth, and the KV cache
    [L, 2, NB, BS, K, D] is donated and updated in place.
    """

    def __init__(self, config: EngineConfig, graphdef: nnx.GraphDef, state: nnx.State):
        self.config = config
        arch = config.model.arch
        self.layer_execution = config.layer_execution
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
        if self.layer_execution == "scan":
            self.state = state
            self._scan_step = jax.jit(
                functools.partial(_scan_step, graphdef), donate_argnames=("kv_cache",)
            )
        else:
            params = nnx.to_pure_dict(state)
            stacked = params.pop("layers")
            self.top_params = params  # embed, norm, lm_head, rope_cache
            self.layer_params = [
                jax.tree.map(lambda a, i=i: a[i], stacked) for i in range(arch.num_hidden_layers)
            ]
            del stacked
            self.layer_ids = [jnp.int32(i) for i in range(arch.num_hidden_layers)]
            self._embed = jax.jit(embed_tokens)
            self._layer = jax.jit(
                functools.partial(
                    decoder_layer, arch, attention_fn=ragged_paged_attention_reference
                ),
                donate_argnames=("kv_cache",),
            )
            self._logits = jax.jit(functools.partial(compute_logits, arch))
        self.warmup_seconds: float | None = None

    def forward(self, batch: BatchInputs) -> jax.Array:
        """Runs the model on a device batch, updating the KV cache; returns logits f32[R, V]."""
        if self.layer_execution == "scan":
            self.kv_cache, logits = self._scan_step(self.state, self.kv_cache, batch)
            return logits
        hidden, cos_sin = self._embed(self.top_params, batch)
        kv_cache = self.kv_cache
        for params, layer in zip(self.layer_params, self.layer_ids, strict=True):
            hidden, kv_cache = self._layer(params, hidden, kv_cache, layer, batch, cos_sin)
        self.kv_cache = kv_cache
        return self._logits(self.top_params, hidden, batch)

    def execute(
        self, batch: BatchInputs, sampling: SamplingMetadata, flags: SamplingFlags
    ) -> SamplerOutput:
        """Runs one step; the result is still on the device (fetch with jax.device_get)."""
        batch, sampling = jax.device_put((batch, sampling))
        logits = self.forward(batch)
        return sample(
            logits, sampling, all_greedy=flags.all_greedy, num_logprobs=flags.num_logprobs
        )

    def warmup(self, padding_batch: Callable[[int], tuple[BatchInputs, SamplingMetadata]]) -> float:
        """Compiles every token bucket, and every sampler variant of each request bucket, by
        running the all-padding batches `padding_batch(num_tokens)` (BatchBuilder's); returns
        the seconds it took."""
        start = time.perf_counter()
        sched = self.config.scheduler
        sampled_buckets = set()
        for num_tokens in sched.token_buckets:
            batch, sampling = padding_batch(num_tokens)
            batch, sampling = jax.device_put((batch, sampling))
            logits = self.forward(batch)
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
