"""Owns the parameters and the KV cache on the device and runs the jitted step: every program
is compiled at warm-up (jaxinfer.engine.startup.warmup), then each step reuses one."""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxinfer.config import EngineConfig
from jaxinfer.engine.execution.batch import SamplingMetadata, StepInputs
from jaxinfer.engine.execution.device_arrays import allocate_kv_cache, allocate_lora, layer_of
from jaxinfer.engine.execution.device_inputs import (
    assemble_batch,
    record_sampled,
    set_bias_rows,
    set_bitmask_rows,
    set_penalty_rows,
    set_rows,
    verified_probs,
)
from jaxinfer.engine.execution.step import HostStep, RowUpdates
from jaxinfer.engine.sampling.constraints import bitmask_width
from jaxinfer.engine.sampling.sampler import SamplerOutput, SamplerState, sample, token_logprobs
from jaxinfer.engine.scheduling.block_pool import NULL_BLOCK
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.layers.kv_cache import CacheConstants, KVCache
from jaxinfer.layers.lora import LoraWeights, slot_contents, target_shapes, write_slot
from jaxinfer.layers.state_cache import copy_slots
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.models.llama import compute_logits, decoder_layer, embed_tokens, lm_head
from jaxinfer.parallel.dispatch import DispatchWindow, dispatch_window
from jaxinfer.parallel.mesh import make_mesh
from jaxinfer.parallel.sharding import Partitioner
from jaxinfer.sampling_params import MAX_LOGPROBS


class Draft(Protocol):
    """What the runner asks of a draft model or MTP layer (jaxinfer.engine.speculation): to run
    over a step's batch too (the MTP's at warm-up alone), and its q to verify against."""

    draft_probs: jax.Array  # f32[S * K, V], q by request row

    def extend(self, batch: BatchInputs) -> None: ...

    def warmup(self, block_table: jax.Array, bias: jax.Array) -> None: ...


PROMPT_LOGPROB_ROWS = 64  # prompt-logprob rows per LM-head call (one compiled shape)


def _scan_hidden(
    graphdef: nnx.GraphDef,
    kernels: ModelKernels,
    partitioner: Partitioner,
    state: nnx.State,
    kv_cache: KVCache,
    batch: BatchInputs,
    lora: LoraWeights | None = None,
) -> tuple[KVCache, jax.Array]:  # (kv_cache, hidden [T, E])
    model = nnx.merge(graphdef, state)
    return model.hidden_states(kv_cache, batch, kernels=kernels, partitioner=partitioner, lora=lora)


def _scan_step(
    graphdef: nnx.GraphDef,
    kernels: ModelKernels,
    partitioner: Partitioner,
    logits_fn,  # compute_logits with the model's options bound
    state: nnx.State,
    top_params: dict,
    kv_cache: KVCache,
    block_table: jax.Array,  # i32[S, MB]
    last_tokens: jax.Array,  # i32[S]
    inputs: StepInputs,
    lora: LoraWeights | None = None,  # the adapter slots (jaxinfer.layers.lora)
) -> tuple[KVCache, jax.Array, jax.Array]:  # (kv_cache, hidden [T, E], logits f32[R, V])
    """The model's part of a step in one program: the batch assembled on the device, the
    layers under the scan, the LM head."""
    batch = assemble_batch(inputs, block_table, last_tokens)
    kv_cache, hidden = _scan_hidden(graphdef, kernels, partitioner, state, kv_cache, batch, lora)
    return kv_cache, hidden, logits_fn(top_params, hidden, batch)


def _sample_and_record(
    logits: jax.Array,  # f32[P, V]
    sampling: SamplingMetadata,
    sampler_state: SamplerState,
    last_tokens: jax.Array,  # i32[S]
    *,
    batch_invariant: bool,
    num_speculative: int,
    draft_probs: jax.Array | None = None,  # f32[S * K, V], a draft model's q by request row
) -> tuple[SamplerOutput, jax.Array, SamplerState]:
    """The sampler, then each request's last kept token and the output counts kept for the
    next step (the samples' logprobs, where asked for: ModelRunner.sampled_logprobs)."""
    if draft_probs is not None:
        draft_probs = verified_probs(draft_probs, sampling, num_speculative)
    sampled = sample(
        logits,
        sampling,
        sampler_state,
        sampling.state_rows,
        batch_invariant=batch_invariant,
        num_speculative=num_speculative,
        draft_probs=draft_probs,
    )
    last_tokens, sampler_state = record_sampled(
        last_tokens, sampler_state, sampled.token_ids, sampling
    )
    return sampled, last_tokens, sampler_state


def _prompt_logprobs(
    config,
    partitioner: Partitioner,
    kernels: ModelKernels,
    params: dict,
    hidden: jax.Array,
    targets: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[P], i32[P, K], f32[P, K]
    logits = lm_head(config, params, hidden, kernels, partitioner)
    return token_logprobs(logits, targets, MAX_LOGPROBS, kernels.batch_invariant)


class ModelRunner:
    """Runs the model over one batch in one of two ways (EngineOptions.layer_execution):

    - "scan": one jitted program for the step, the layers under `lax.scan` over stacked
      weights. One dispatch per step.
    - "per_layer": the same decoder layer compiled once per bucket and called for each layer
      with that layer's own weight buffers, between an embedding and a head program. On
      XLA:CPU the scan form copies every layer's weights out of the stacked arrays before each
      XLA matmul; this form has no such copy. (With the C++ matmul kernel, which reads the
      stacked weights in place, the scan has no copy either; jaxinfer.config.resolve.)

    Either way compile time does not grow with depth, and the KV cache
    [L, 2, NB, BS, K, D] is donated and updated in place.
    """

    def __init__(
        self,
        config: EngineConfig,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        kernels: ModelKernels = ModelKernels(),  # noqa: B008 (frozen)
        partitioner: Partitioner | None = None,
        *,
        sampling: bool = True,
        draft: Draft | None = None,
        kv_constants: CacheConstants = CacheConstants(),  # noqa: B008 (frozen)
    ):
        """`state`: the model's parameters, already placed by `partitioner` (build_llama);
        everything else the runner keeps on the device is placed on the same mesh.
        `sampling`: False for a draft model's runner, which keeps no per-request rows
        and only runs its layers and LM head. `draft`: a draft model (speculative decoding)
        that runs over each step's batch too, and whose q the sampler verifies against.
        `kv_constants`: what a quantized cache fixes before serving (engine.kv_calibration)."""
        self.draft = draft
        self.config = config
        self.kernels = kernels
        if partitioner is None:
            partitioner = Partitioner(make_mesh(1))
        self.partitioner = part = partitioner
        arch = config.model.arch
        self.layer_execution = config.layer_execution
        self.kv_cache = allocate_kv_cache(config, part, kv_constants)  # split by KV heads
        # LoRA adapters' slots (EngineConfig.lora), written by load_lora
        self.lora = None if config.lora is None else allocate_lora(config, part)
        shardings = jax.tree.map(lambda a: a.sharding, self.lora)  # kept by every write
        self._write_lora = jax.jit(write_slot, donate_argnums=0, out_shardings=shardings)
        kv_shardings = jax.tree.map(lambda a: a.sharding, self.kv_cache)
        self._copy_slots = jax.jit(copy_slots, donate_argnums=0, out_shardings=kv_shardings)
        params = nnx.to_pure_dict(state)
        stacked = params.pop("layers")
        self.top_params = params  # embed, norm, lm_head, rope_cache
        logits_fn = functools.partial(compute_logits, arch, kernels=kernels, partitioner=part)
        self._logits = jax.jit(logits_fn)
        self.select_rows = jax.jit(lambda hidden, rows: hidden[rows])
        self._prompt_logprobs = jax.jit(functools.partial(_prompt_logprobs, arch, part, kernels))
        if self.layer_execution == "scan":
            self.state = state
            self._scan_hidden = jax.jit(
                functools.partial(_scan_hidden, graphdef, kernels, part),
                donate_argnames=("kv_cache",),
            )
            self.scan_step = jax.jit(
                functools.partial(_scan_step, graphdef, kernels, part, logits_fn),
                donate_argnames=("kv_cache",),
            )
        else:
            self.layer_params = [
                jax.tree.map(lambda a, i=i: layer_of(a, i, part), stacked)
                for i in range(arch.num_hidden_layers)
            ]
            del stacked
            self.layer_ids = [part.place(np.int32(i), ()) for i in range(arch.num_hidden_layers)]
            self._embed = jax.jit(functools.partial(embed_tokens, arch))
            self._layer = jax.jit(
                functools.partial(decoder_layer, arch, kernels=kernels, partitioner=part),
                donate_argnames=("kv_cache",),
            )
            self._add = jax.jit(jnp.add)
            self._dispatch_window = dispatch_window(part.mesh)
        self.warmup_seconds: float | None = None
        self.sampled_buckets: set[int] = set()  # sample-row buckets whose sampler is compiled
        if not sampling:
            return
        # Kept on the device between steps, by request row (the last row is the padding
        # requests'): block-table rows, each row's last sampled token, the sampler's state.
        num_rows = config.scheduler.max_num_seqs + 1
        vocab = arch.vocab_size
        self.block_table = part.full(
            (num_rows, config.block_table_width), NULL_BLOCK, jnp.int32
        )  # [S, MB] (DeepSeek-V4: and its entry blocks' columns)
        self.last_tokens = part.zeros((num_rows,), jnp.int32)  # [S]
        self.sampler_state = SamplerState(
            output_counts=part.zeros((num_rows, vocab), jnp.int32),
            prompt_mask=part.zeros((num_rows, vocab), bool),
            bias=part.zeros((num_rows, vocab), jnp.float32),
            bitmask=part.full(
                (num_rows * (1 + config.scheduler.num_speculative_tokens), bitmask_width(vocab)),
                -1,
                jnp.int32,
            ),
        )
        self._set_rows = jax.jit(set_rows, donate_argnums=0)
        self._set_penalty_rows = jax.jit(set_penalty_rows, donate_argnums=0)
        self._set_bias_rows = jax.jit(set_bias_rows, donate_argnums=0)
        self._set_bitmask_rows = jax.jit(set_bitmask_rows, donate_argnums=0)
        self.assemble = jax.jit(assemble_batch)
        self.sample_program = jax.jit(
            functools.partial(
                _sample_and_record,
                batch_invariant=kernels.batch_invariant,
                num_speculative=config.scheduler.num_speculative_tokens,
            ),
            donate_argnames=("sampler_state", "last_tokens"),
        )
        self.sampled_logprobs = jax.jit(
            functools.partial(
                token_logprobs, num_top=MAX_LOGPROBS, batch_invariant=kernels.batch_invariant
            )
        )

    def forward(self, batch: BatchInputs) -> jax.Array:
        """Runs the model on a device batch, updating the KV cache; returns logits f32[R, V]."""
        return self._logits(self.top_params, self.hidden_states(batch), batch)

    def hidden_states(self, batch: BatchInputs) -> jax.Array:
        """Runs the layers, updating the KV cache; returns hidden [T, E] (before the norm)."""
        if self.layer_execution == "scan":
            self.kv_cache, hidden = self._scan_hidden(self.state, self.kv_cache, batch, self.lora)
            return hidden
        hidden, residual, cos_sin = self.run_embedding(batch)
        window = DispatchWindow(self._dispatch_window)  # (several CPU devices: a deadlock)
        for index in range(len(self.layer_params)):
            hidden, residual = self.run_layer(index, hidden, residual, batch, cos_sin)
            window.dispatched(hidden)
        return self.run_final_add(hidden, residual)

    # The per-layer programs one at a time (per_layer execution), for tools that time them.
    def run_embedding(self, batch: BatchInputs) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(hidden [T, E], residual [T, E], cos_sin f32[T, 2, D / 2]) before the first layer."""
        return self._embed(self.top_params, batch)

    def run_layer(
        self,
        index: int,
        hidden: jax.Array,
        residual: jax.Array,
        batch: BatchInputs,
        cos_sin: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:  # (hidden, residual) after layer `index`
        """Decoder layer `index`, writing its K/V into the cache."""
        hidden, residual, self.kv_cache = self._layer(
            self.layer_params[index],
            hidden,
            residual,
            self.kv_cache,
            self.layer_ids[index],
            batch,
            cos_sin,
            lora=self.lora,
        )
        return hidden, residual

    def run_final_add(self, hidden: jax.Array, residual: jax.Array) -> jax.Array:
        """The residual stream after the last layer (before the final norm)."""
        return self._add(hidden, residual)

    def run_logits(self, hidden: jax.Array, batch: BatchInputs) -> jax.Array:
        """The final norm and LM head on each request's sampled row -> f32[R, V]."""
        return self._logits(self.top_params, hidden, batch)

    def prompt_logprobs(
        self, hidden: jax.Array, rows: np.ndarray, targets: np.ndarray
    ) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
        """Log-probabilities of prompt tokens `targets` given hidden[rows] (the token before
        each), and the top MAX_LOGPROBS, in chunks of PROMPT_LOGPROB_ROWS (left on device)."""
        chunks = []
        for start in range(0, len(rows), PROMPT_LOGPROB_ROWS):
            chunk_rows = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
            chunk_targets = np.zeros(PROMPT_LOGPROB_ROWS, np.int32)
            count = min(PROMPT_LOGPROB_ROWS, len(rows) - start)
            chunk_rows[:count] = rows[start : start + count]
            chunk_targets[:count] = targets[start : start + count]
            selected = self.select_rows(hidden, chunk_rows)
            chunks.append(self._prompt_logprobs(self.top_params, selected, chunk_targets))
        return chunks

    def execute(
        self, step: HostStep, draft_inputs: StepInputs | None = None
    ) -> tuple[SamplerOutput, list[tuple[jax.Array, jax.Array, jax.Array]]]:
        """Enqueues one step: the per-request rows that changed, the model and the sampler. Returns
        at once; the result stays on the device until fetched.

        The step's host arrays go straight into the jitted programs, which transfer them
        (a separate `jax.device_put` of the ~20 small arrays, or another program dispatch,
        costs more). The "scan" step is two programs (the model with its batch assembly, then
        the sampler with the bookkeeping of what it sampled). `draft_inputs`: the draft runs
        over them too (the step's, or some of its requests', BatchBuilder.subset)."""
        self.apply_updates(step.updates)
        inputs = step.inputs
        if self.layer_execution == "scan":
            self.kv_cache, hidden, logits = self.scan_step(
                self.state,
                self.top_params,
                self.kv_cache,
                self.block_table,
                self.last_tokens,
                inputs,
                self.lora,
            )
        else:
            batch = self.assemble(inputs, self.block_table, self.last_tokens)
            hidden = self.hidden_states(batch)
            logits = self._logits(self.top_params, hidden, batch)
        self.last_hidden, self.last_inputs = hidden, inputs  # (pooling.py; the MTP layer)
        draft_probs = None
        if self.draft is not None:
            if draft_inputs is not None:  # (else the draft's own steps wrote its K/V)
                if draft_inputs is not inputs or self.layer_execution == "scan":
                    batch = self.assemble(draft_inputs, self.block_table, self.last_tokens)
                self.draft.extend(batch)
            draft_probs = self.draft.draft_probs
        sampled, self.last_tokens, self.sampler_state = self.sample_program(
            logits,
            step.sampling,
            self.sampler_state,
            self.last_tokens,
            draft_probs=draft_probs,
        )
        if step.flags.num_logprobs:
            logprobs = self.sampled_logprobs(logits, sampled.token_ids)
            sampled = SamplerOutput(sampled.token_ids, *logprobs)
        prompt = step.prompt_logprobs
        if prompt is None:
            return sampled, []
        return sampled, self.prompt_logprobs(hidden, prompt.rows, prompt.targets)

    def prepare(self, step: HostStep) -> tuple[BatchInputs, StepInputs, SamplingMetadata]:
        """Applies the step's row updates and builds its device batch (nothing waits)."""
        self.apply_updates(step.updates)
        inputs, sampling = jax.device_put((step.inputs, step.sampling), self.partitioner.replicated)
        return self.assemble(inputs, self.block_table, self.last_tokens), inputs, sampling

    def load_lora(self, slot: int, contents: dict) -> None:
        """Puts an adapter into slot `slot` (contents: jaxinfer.layers.lora.slot_contents',
        already on the device or not): enqueued after the steps already dispatched, which
        read the slot as it was."""
        self.lora = self._write_lora(self.lora, jnp.int32(slot), contents)

    def empty_lora_slot(self) -> dict:
        """What an empty LoRA slot holds (zeros), placed as adapters are (warm-up's write)."""
        arch, lora = self.config.model.arch, self.config.lora
        contents = slot_contents(
            {}, target_shapes(arch), arch.num_hidden_layers, lora.max_rank, self.config.model.dtype
        )
        return jax.device_put(contents, self.partitioner.replicated)

    def apply_updates(self, updates: RowUpdates) -> None:
        put = functools.partial(jax.device_put, device=self.partitioner.replicated)
        if updates.block_table is not None:
            self.block_table = self._set_rows(self.block_table, put(updates.block_table))
        for values, program in (
            (updates.penalties, self._set_penalty_rows),
            (updates.bias, self._set_bias_rows),
            (updates.bitmask, self._set_bitmask_rows),
        ):
            if values is not None:
                self.sampler_state = program(self.sampler_state, put(values))
        for copies in (updates.state_saves, updates.state_restores):  # in this order
            if copies is not None:
                sources, targets = put((copies.sources, copies.targets))
                self.kv_cache = self._copy_slots(self.kv_cache, sources, targets)
