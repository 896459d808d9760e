"""Speculative decoding's draft-model method: a smaller model with the target's vocabulary
proposes each request's next tokens, one at a time.

The draft's KV cache has the target's blocks (same count and size) and is addressed by the
target's block tables and slots, so it needs no allocator of its own and rolling back costs
nothing. Each proposing request's SpecState.draft_computed counts the leading tokens whose
K/V the draft holds (moved back over rejected proposals, to 0 on preemption):

- `propose` runs up to k steps for each proposing request. The first feeds its last two
  tokens (the one before the last is a proposal the draft never fed when every proposal was
  accepted, and is rewritten with the same K/V otherwise); each later step feeds the
  proposal just drawn. So the draft does not recompute the tokens its own steps wrote: the
  target's verify step needs no draft step of its own;
- `extend` runs the draft over the requests it follows in a target step's flat batch
  (BatchBuilder.subset), only where some request's tokens are not covered that way (prompt
  chunks, a decode whose earlier tokens the draft missed: LLMEngine asks
  Speculation.draft_extend). K/V at positions past a request's accepted tokens is stale until
  written again, and every read stops at the request's own length.

Where no plan pays for its proposals, the draft stops following a request (SpecState.draft_off,
jaxinfer.engine.speculation.propose): its steps and extends leave the request out from then on.

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
V: vocabulary, MB: blocks per request, W: tokens per row in a step (2 in the first, else 1).
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
# A draft shares the target's tokenizer and most of its proposals are accepted: a request's
# acceptance starts at PRIOR_ACCEPTED / (PRIOR_ACCEPTED + 1) rather than n-grams' even odds
# (a draft's steps cost time, so the plans would never take its first proposal and never
# learn otherwise); its own steps soon outweigh it (SpecState.record).
PRIOR_ACCEPTED = 4.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftRows:
    """One `propose` call's requests, on the host (R rows, padded)."""

    rows: np.ndarray  # i32[R], the request's device row (padding: the padding row)
    tokens: np.ndarray  # i32[R], its last token
    previous: np.ndarray  # i32[R], the token before it
    positions: np.ndarray  # i32[R], that token's position
    limits: np.ndarray  # i32[R], proposals wanted (0 in padding rows)
    sampling: SamplingMetadata  # [R]: temperature, top-k/p, min-p, bias, seed, output position
    num_seqs: np.ndarray  # i32[1], rows that are real


def decode_batch(
    block_table: jax.Array,  # i32[S, MB], the target's
    rows: DraftRows,
    tokens: jax.Array,  # i32[R * W], the tokens fed at this step, W per row
    step: jax.Array,  # i32[], the draft step (0: the request's last token)
    *,
    block_size: int,
    width: int,
) -> BatchInputs:
    """W tokens per request, the last at position positions + step. A row past its limit is
    padding: positions from 0, its K/V into the null block, attending to its own tokens."""
    num_rows = rows.rows.shape[0]
    active = step < rows.limits  # [R]
    last = jnp.where(active, rows.positions + step, width - 1)  # [R]
    positions = (last[:, None] + jnp.arange(1 - width, 1)).reshape(-1)  # [R * W]
    table = block_table[rows.rows]  # [R, MB]
    index = jnp.minimum(positions // block_size, table.shape[1] - 1)
    block = table[jnp.repeat(jnp.arange(num_rows), width), index]
    slots = jnp.where(
        jnp.repeat(active, width),
        block * block_size + positions % block_size,
        NULL_BLOCK * block_size,
    )
    return BatchInputs(
        token_ids=tokens,
        positions=positions,
        slot_mapping=slots,
        block_tables=table,
        seq_lens=last + 1,
        query_start_loc=jnp.arange(num_rows + 1, dtype=jnp.int32) * width,
        logits_indices=jnp.arange(num_rows, dtype=jnp.int32) * width + width - 1,
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
    verification takes any q. Where every real row is greedy, q is not formed (the verifier
    reads it for random rows only)."""
    sampling = rows.sampling
    logits = logits.astype(jnp.float32)
    logits = logits + jnp.where(sampling.has_bias[:, None] > 0, bias[rows.rows], 0.0)
    greedy = first_argmax(logits).astype(jnp.int32)

    def random():
        scaled = truncated(logits, sampling, batch_invariant)
        log_softmax = invariant.log_softmax if batch_invariant else jax.nn.log_softmax
        q = jnp.exp(log_softmax(scaled))  # [R, V]
        keys = request_keys(sampling.seeds, sampling.output_positions + step)
        keys = jax.vmap(lambda k: jax.random.fold_in(k, DRAFT_STREAM))(keys)
        exponential = jax.vmap(lambda k: jax.random.exponential(k, logits.shape[-1:]))(keys)
        sampled = first_argmax(scaled - jnp.log(exponential)).astype(jnp.int32)
        return jnp.where(sampling.temperature == 0, greedy, sampled), q

    real = jnp.arange(greedy.shape[0]) < rows.num_seqs[0]
    all_greedy = jnp.all((sampling.temperature == 0) | ~real)
    # (draft_probs stays out of the branches: a conditional would copy it whole)
    tokens, q = jax.lax.cond(all_greedy, lambda: (greedy, jnp.zeros_like(logits)), random)
    return tokens, draft_probs.at[rows.rows * num_speculative + step].set(q)


def padding_rows(size: int, padding_row: int) -> DraftRows:
    """`size` rows of padding (`padding_row`: the device row padding requests take)."""
    return DraftRows(
        rows=np.full(size, padding_row, np.int32),
        tokens=np.zeros(size, np.int32),
        previous=np.zeros(size, np.int32),
        positions=np.zeros(size, np.int32),
        limits=np.zeros(size, np.int32),
        sampling=SamplingMetadata.neutral(size, padding_row),
        num_seqs=np.zeros(1, np.int32),
    )


def request_rows(
    requests: list[tuple[int, Request, int]],  # (device row, request, limit)
    buckets: tuple[int, ...],  # the request buckets
    padding_row: int,
    vocab_size: int,
) -> DraftRows:
    """The requests' rows, padded to a request bucket: each one's last two tokens, the last
    one's position, its limit and its sampling parameters."""
    rows = padding_rows(buckets[np.searchsorted(buckets, len(requests))], padding_row)
    rows.num_seqs[0] = len(requests)
    sampling = rows.sampling
    for i, (row, request, limit) in enumerate(requests):
        rows.rows[i] = row
        rows.tokens[i] = request.all_token_ids[-1]
        rows.previous[i] = request.all_token_ids[-2]
        rows.positions[i] = request.num_tokens - 1
        rows.limits[i] = limit
        sampling.fill(
            slice(i, i + 1),
            request.sampling_params,
            vocab_size,
            request.bias is not None,
            request.seed,
            request.num_output_tokens,
        )
    return rows


class ModelProposer:
    """What a proposer that runs a model (a draft model, DeepSeek-V4's MTP layer,
    jaxinfer.engine.speculation.mtp) keeps for its draws: the q of its latest proposals by
    request row, its request buckets and the jitted draw."""

    def __init__(self, target: EngineConfig, partitioner):
        """`target`: the model's config; `partitioner`: where q is kept."""
        self.num_speculative = target.speculative.num_speculative_tokens
        self.vocab_size = target.model.arch.vocab_size
        sched = target.scheduler
        self.padding_row = sched.max_num_seqs  # (jaxinfer.engine.execution.row_table.RowTable)
        self.buckets = tuple(sorted({sched.request_bucket(t) for t in sched.token_buckets}))
        self.draft_probs = partitioner.zeros(
            ((sched.max_num_seqs + 1) * self.num_speculative, self.vocab_size),
            jnp.float32,
        )  # [S * K, V]
        self._draw = jax.jit(
            functools.partial(
                draw_proposals,
                num_speculative=self.num_speculative,
                batch_invariant=target.resolved.batch_invariant,
            ),
            donate_argnames=("draft_probs",),
        )

    def new_state(self, limit: int) -> SpecState:
        return SpecState(limit=limit, accepted=PRIOR_ACCEPTED)


class DraftModel(ModelProposer):
    """The draft: its own runner (model and KV cache), the q of its latest proposals, and the
    one-token step it repeats to propose."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, target: EngineConfig):
        """`config`: the draft's (the target's cache and scheduler); `runner`: it, built
        without sampler state; `target`: the target's config."""
        super().__init__(target, runner.partitioner)
        self.config = config
        self.runner = runner
        self._decode_batch = {
            width: jax.jit(
                functools.partial(decode_batch, block_size=target.cache.block_size, width=width)
            )
            for width in (1, 2)
        }

    def extend(self, batch: BatchInputs) -> None:
        """Writes the draft's K/V for a target step's tokens (of the requests it follows)."""
        self.runner.hidden_states(batch)

    def _step(self, block_table, rows, tokens, step, bias):
        """One draft step: its proposals i32[R] (and q kept in draft_probs)."""
        width = tokens.shape[0] // rows.rows.shape[0]
        batch = self._decode_batch[width](block_table, rows, tokens, step)
        logits = self.runner.run_logits(self.runner.hidden_states(batch), batch)
        tokens, self.draft_probs = self._draw(logits, rows, bias, self.draft_probs, step)
        return tokens

    def propose(
        self,
        block_table: jax.Array,  # i32[S, MB], the target's, with this step's rows
        bias: jax.Array,  # f32[S, V]
        requests: list[tuple[int, Request, int]],  # (device row, request, proposals wanted)
    ) -> list[list[int]]:
        """Each request's proposals after its last token (as many as wanted); the draft must
        hold the K/V of all but its last two tokens (SpecState.draft_computed), and then
        holds it up to the last proposal but one."""
        host_rows = request_rows(requests, self.buckets, self.padding_row, self.vocab_size)
        tokens = np.stack([host_rows.previous, host_rows.tokens], axis=1).reshape(-1)  # [R * 2]
        rows = jax.device_put(host_rows)  # (once, not by every step's programs)
        proposed = []
        for step in range(max(count for _, _, count in requests)):
            tokens = self._step(block_table, rows, tokens, np.int32(step), bias)
            proposed.append(tokens)
        for _, request, count in requests:
            request.spec.draft_computed = request.num_tokens + count - 1
        host = np.stack(jax.device_get(proposed), axis=1)  # [R, steps]
        return [host[i, :count].tolist() for i, (_, _, count) in enumerate(requests)]

    def warmup(self, block_table: jax.Array, bias: jax.Array) -> None:
        """Compiles the steps of every request bucket (all padding rows): the first, two
        tokens a row, and the later ones."""
        for size in self.buckets:
            rows = padding_rows(size, self.padding_row)
            for width in (2, 1):
                tokens = np.zeros(size * width, np.int32)
                self._step(block_table, rows, tokens, np.int32(0), bias)
        jax.block_until_ready(self.draft_probs)


def load_draft(
    options: EngineOptions,
    target: EngineConfig,
    target_vocab: dict[str, int],
    partitioner: Partitioner,
    registry: KernelRegistry | None = None,
) -> DraftModel:
    """The draft model options.draft_model names, configured like the target (same options
    but draft_int8_activations, the target's max_model_len and number of KV blocks) and
    checked to share its vocabulary (`target_vocab`: the target tokenizer's token -> id)."""
    cache_dir = Path(options.cache_dir)
    folder = resolve_model(options.draft_model, cache_dir)
    gguf_source = source_gguf(options.draft_model, folder)
    draft_options = dataclasses.replace(
        options,
        model=options.draft_model,
        draft_model=None,
        draft_int8_activations=None,
        speculative_method="none",
        max_model_len=target.model.max_model_len,
        num_kv_blocks=target.cache.num_blocks,
        int8_activations=options.draft_int8_activations is not False,
        enable_lora=False,  # a draft runs without adapters
        lora_impl="auto",
    )
    try:
        try:
            config, kernels = configure(draft_options, folder, registry, gguf_source)
        except ValueError as error:  # unset: int8 only where the draft's weights take it
            if options.draft_int8_activations is not None or "int8_activations" not in str(error):
                raise
            draft_options = dataclasses.replace(
                draft_options, int8_activations=options.int8_activations
            )
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
