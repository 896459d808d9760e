"""Speculative decoding's draft-model method: a smaller model with the target's vocabulary
proposes each request's next tokens, one at a time.

The draft's KV cache has the target's blocks (same count and size) and is addressed by the
target's block tables and slots, so it needs no allocator of its own and rolling back costs
nothing:

- every target step also runs the draft over the same flat batch (`extend`), so the draft
  holds K/V for exactly the tokens the target computed (prompt chunks, decode tokens,
  proposals; a prefix-cache hit's blocks were written by both when first computed);
- after verification, `propose` runs up to k one-token steps for each proposing request,
  from its last token. K/V at positions past a request's accepted tokens is stale until
  written again, and every read stops at the request's own length.

The K/V of the tokens the draft proposes is written ahead of the target, into blocks the
scheduler gives proposing requests in advance (SchedulerConfig.spec_lookahead); a request
without them proposes fewer.

Greedy rows propose the draft's argmax (with the request's logit bias). Random rows draw
each proposal from q, the draft's logits with the request's logit bias, temperature, min-p,
top-k and top-p, keyed by the request's seed and output position on a stream of their own,
and keep q (by request row and proposal index) for the target's rejection sampling
(jaxinfer.engine.sampling.sampler.rejection_sample), which keeps the output distribution exactly the
target's whatever q is.

R: proposing requests (padded), S: per-request device rows, K: num_speculative_tokens,
V: vocabulary, MB: blocks per request.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxinfer.config import EngineConfig, EngineOptions
from jaxinfer.config.configure import configure
from jaxinfer.engine.execution.batch import SamplingMetadata
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.sampling.logits_processors import first_argmax
from jaxinfer.engine.sampling.sampler import request_keys, truncated
from jaxinfer.engine.scheduling.block_pool import NULL_BLOCK
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.engine.speculation.state import SpecState
from jaxinfer.engine.startup import kv_calibration
from jaxinfer.layers import invariant
from jaxinfer.layers.kernel_registry import KernelRegistry
from jaxinfer.model_loader.load import load_model
from jaxinfer.model_loader.model_cache import resolve_model, source_gguf
from jaxinfer.models.inputs import BatchInputs
from jaxinfer.parallel.sharding import Partitioner
from jaxinfer.tokenizer import TokenizerWrapper

DRAFT_STREAM = 3  # folded into a row's key for the draft's own draws (the verifier uses 1, 2)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftRows:
    """One `propose` call's requests, on the host (R rows, padded)."""

    rows: np.ndarray  # i32[R], the request's device row (padding: the padding row)
    tokens: np.ndarray  # i32[R], its last token
    positions: np.ndarray  # i32[R], that token's position
    limits: np.ndarray  # i32[R], proposals wanted (0 in padding rows)
    sampling: SamplingMetadata  # [R]: temperature, top-k/p, min-p, bias, seed, output position
    num_seqs: np.ndarray  # i32[1], rows that are real


def decode_batch(
    block_table: jax.Array,  # i32[S, MB], the target's
    rows: DraftRows,
    tokens: jax.Array,  # i32[R], the tokens fed at this step
    step: jax.Array,  # i32[], the draft step (0: the request's last token)
    *,
    block_size: int,
) -> BatchInputs:
    """One token per request at position positions + step. A row past its limit is padding:
    position 0, its K/V into the null block, attending to its first token only."""
    active = step < rows.limits  # [R]
    positions = jnp.where(active, rows.positions + step, 0)
    table = block_table[rows.rows]  # [R, MB]
    index = jnp.minimum(positions // block_size, table.shape[1] - 1)
    block = jnp.take_along_axis(table, index[:, None], axis=1)[:, 0]
    slots = jnp.where(active, block * block_size + positions % block_size, NULL_BLOCK * block_size)
    num_rows = tokens.shape[0]
    return BatchInputs(
        token_ids=tokens,
        positions=positions,
        slot_mapping=slots,
        block_tables=table,
        seq_lens=positions + 1,
        query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(num_rows, dtype=jnp.int32),
        num_seqs=rows.num_seqs,
    )


def draw_proposals(
    logits: jax.Array,  # f32[R, V], the draft's
    rows: DraftRows,
    bias: jax.Array,  # f32[S, V], the requests' logit bias rows (the target sampler's)
    draft_probs: jax.Array,  # f32[S * K, V]
    step: jax.Array,  # i32[]
    *,
    num_speculative: int,
    batch_invariant: bool,
) -> tuple[jax.Array, jax.Array]:  # (i32[R] proposals, draft_probs with this step's q)
    """Each row's proposal: its argmax when greedy, else a draw from q, which is kept at
    draft_probs[row * K + step]. q is the draft's distribution under the request's logit
    bias, temperature, min-p, top-k and top-p; the penalties are left out (they need the
    target sampler's per-request counts), which costs acceptance, never exactness: the
    verification takes any q."""
    sampling = rows.sampling
    logits = logits.astype(jnp.float32)
    logits = logits + jnp.where(sampling.has_bias[:, None] > 0, bias[rows.rows], 0.0)
    scaled = truncated(logits, sampling, batch_invariant)
    log_softmax = invariant.log_softmax if batch_invariant else jax.nn.log_softmax
    q = jnp.exp(log_softmax(scaled))  # [R, V]
    keys = request_keys(sampling.seeds, sampling.output_positions + step)
    keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_STREAM))(keys)
    exponential = jax.vmap(lambda k: jax.random.exponential(k, logits.shape[-1:]))(keys)
    sampled = first_argmax(scaled - jnp.log(exponential))
    tokens = jnp.where(sampling.temperature == 0, first_argmax(logits), sampled)
    draft_probs = draft_probs.at[rows.rows * num_speculative + step].set(q)
    return tokens.astype(jnp.int32), draft_probs


class DraftModel:
    """The draft: its own runner (model and KV cache), the q of its latest proposals, and the
    one-token step it repeats to propose."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, target: EngineConfig):
        """`config`: the draft's (the target's cache and scheduler); `runner`: it, built
        without sampler state; `target`: the target's config."""
        self.config = config
        self.runner = runner
        self.num_speculative = target.speculative.num_speculative_tokens
        self.vocab_size = target.model.arch.vocab_size
        sched = target.scheduler
        self.padding_row = sched.max_num_seqs  # (jaxinfer.engine.execution.row_table.RowTable)
        self.buckets = tuple(sorted({sched.request_bucket(t) for t in sched.token_buckets}))
        self.draft_probs = runner.partitioner.zeros(
            ((sched.max_num_seqs + 1) * self.num_speculative, self.vocab_size),
            jnp.float32,
        )  # [S * K, V]
        self._decode_batch = jax.jit(
            functools.partial(decode_batch, block_size=target.cache.block_size)
        )
        self._draw = jax.jit(
            functools.partial(
                draw_proposals,
                num_speculative=self.num_speculative,
                batch_invariant=target.resolved.batch_invariant,
            ),
            donate_argnames=("draft_probs",),
        )

    def new_state(self, requested: int | None) -> SpecState:
        limit = self.num_speculative if requested is None else min(self.num_speculative, requested)
        return SpecState(limit=limit)

    def extend(self, batch: BatchInputs) -> None:
        """Writes the draft's K/V for a target step's tokens (the same flat batch)."""
        self.runner.hidden_states(batch)

    def propose(
        self,
        block_table: jax.Array,  # i32[S, MB], the target's, with this step's rows
        bias: jax.Array,  # f32[S, V]
        requests: list[tuple[int, Request, int]],  # (device row, request, proposals wanted)
    ) -> list[list[int]]:
        """Each request's proposals after its last token (as many as wanted)."""
        rows = self._rows(requests)
        tokens = rows.tokens
        proposed = []
        for step in range(max(count for _, _, count in requests)):
            step = np.int32(step)
            batch = self._decode_batch(block_table, rows, tokens, step)
            logits = self.runner.run_logits(self.runner.hidden_states(batch), batch)
            tokens, self.draft_probs = self._draw(logits, rows, bias, self.draft_probs, step)
            proposed.append(tokens)
        host = np.stack(jax.device_get(proposed), axis=1)  # [R, steps]
        return [host[i, :count].tolist() for i, (_, _, count) in enumerate(requests)]

    def _padding_rows(self, size: int) -> DraftRows:
        return DraftRows(
            rows=np.full(size, self.padding_row, np.int32),
            tokens=np.zeros(size, np.int32),
            positions=np.zeros(size, np.int32),
            limits=np.zeros(size, np.int32),
            sampling=SamplingMetadata.neutral(size, self.padding_row),
            num_seqs=np.zeros(1, np.int32),
        )

    def _rows(self, requests: list[tuple[int, Request, int]]) -> DraftRows:
        rows = self._padding_rows(self.buckets[np.searchsorted(self.buckets, len(requests))])
        rows.num_seqs[0] = len(requests)
        sampling = rows.sampling
        for i, (row, request, wanted) in enumerate(requests):
            rows.rows[i] = row
            rows.tokens[i] = request.all_token_ids[-1]
            rows.positions[i] = request.num_tokens - 1
            rows.limits[i] = wanted
            sampling.fill(
                slice(i, i + 1),
                request.sampling_params,
                self.vocab_size,
                request.bias is not None,
                request.seed,
                request.num_output_tokens,
            )
        return rows

    def warmup(self, block_table: jax.Array, bias: jax.Array) -> None:
        """Compiles the one-token step of every request bucket (all padding rows)."""
        step = np.int32(0)
        for size in self.buckets:
            rows = self._padding_rows(size)
            batch = self._decode_batch(block_table, rows, rows.tokens, step)
            logits = self.runner.run_logits(self.runner.hidden_states(batch), batch)
            _, self.draft_probs = self._draw(logits, rows, bias, self.draft_probs, step)
        jax.block_until_ready(self.draft_probs)


def load_draft(
    options: EngineOptions,
    target: EngineConfig,
    target_vocab: dict[str, int],
    partitioner: Partitioner,
    registry: KernelRegistry | None = None,
) -> DraftModel:
    """The draft model options.draft_model names, configured like the target (same options,
    the target's max_model_len and number of KV blocks) and checked to share its vocabulary
    (`target_vocab`: the target tokenizer's token -> id)."""
    cache_dir = Path(options.cache_dir)
    folder = resolve_model(options.draft_model, cache_dir)
    gguf_source = source_gguf(options.draft_model, folder)
    draft_options = dataclasses.replace(
        options,
        model=options.draft_model,
        draft_model=None,
        speculative_method="none",
        max_model_len=target.model.max_model_len,
        num_kv_blocks=target.cache.num_blocks,
    )
    try:
        config, kernels = configure(draft_options, folder, registry, gguf_source)
    except ValueError as error:
        raise ValueError(f"draft_model {options.draft_model!r}: {error}") from error
    tokenizer = TokenizerWrapper(folder)
    if config.model.arch.vocab_size != target.model.arch.vocab_size or (
        tokenizer.tokenizer.get_vocab() != target_vocab
    ):
        raise ValueError(
            f"draft_model {options.draft_model!r} must have the model's vocabulary and "
            f"tokenizer (vocab_size {config.model.arch.vocab_size}, the model's "
            f"{target.model.arch.vocab_size})"
        )
    graphdef, state, _ = load_model(folder, config, partitioner, gguf_source)
    constants = kv_calibration.calibrate(config, graphdef, state, kernels, partitioner, tokenizer)
    runner = ModelRunner(
        config, graphdef, state, kernels, partitioner, sampling=False, kv_constants=constants
    )
    return DraftModel(config, runner, target)
