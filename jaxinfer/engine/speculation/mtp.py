"""DeepSeek-V4's multi-token-prediction layer as speculative decoding's proposer
(speculative_method "mtp"), run as vLLM's MTP proposer runs it.

Each step of the model keeps its residual streams before the final collapse in the cache
(CompressedCache.mtp). After the step, once its tokens are on the host, the MTP layer
(jaxinfer.models.deepseek_v4_mtp) runs over the same flat batch with each position's next
token in place of its own: the prompt's, the one sampled, or 0 past a request's last
accepted position (the entries written there are written again before any query reads them,
as a draft model's are). That pass (`extend`) writes the layer's window store at every
position, and its output streams replace the model's in the cache; at each proposing
request's last computed position they give its first proposal (`head`). Each further
proposal is one one-token step of the layer (`step`): the previous proposal at the next
position, with the layer's own output streams in place of the model's. Proposals are drawn
as a draft model's are (draft_model.draw_proposals: the argmax when greedy, else a draw from
q, kept for the rejection sampler).

The extend runs after every step, over every request in it, whether or not one proposes
next (the layer's window store must hold each position before a query reads it); only where
no running request proposes at all (none will need the entries) is it left out.

R: proposing requests (padded), T: the step's tokens, N / E: streams and hidden size,
S: request rows, K: num_speculative_tokens, V: vocabulary, MB: blocks per request row.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import numpy as np

from jaxinfer.config import EngineConfig
from jaxinfer.engine.execution.batch import StepInputs
from jaxinfer.engine.execution.model_runner import ModelRunner
from jaxinfer.engine.execution.row_table import RowTable
from jaxinfer.engine.execution.step import SchedulerOutput
from jaxinfer.engine.scheduling.request import Request
from jaxinfer.engine.scheduling.scheduler import Scheduler
from jaxinfer.engine.speculation.candidates import DraftRun, proposal_candidates
from jaxinfer.engine.speculation.draft_model import (
    DraftRows,
    ModelProposer,
    decode_batch,
    padding_rows,
    request_rows,
)
from jaxinfer.layers.compressed_cache import CompressedCache
from jaxinfer.layers.kernel_registry import ModelKernels
from jaxinfer.models.deepseek_v4_mtp import mtp_logits, mtp_streams
from jaxinfer.models.inputs import BatchInputs


def _run_layer(config, kernels, mtp, params, cache, batch, previous):
    """The MTP layer over `batch` (its tokens: each position's next) from `previous`
    f32[T, N, E]: (the cache with its window store written, the output streams)."""
    own = CompressedCache(cache.mtp["window"], {}, {}, ())
    own, streams = mtp_streams(config, mtp, params["embed"], own, batch, previous, kernels=kernels)
    return dataclasses.replace(cache, mtp={**cache.mtp, "window": own.window}), streams


def extend(
    config,
    kernels: ModelKernels,
    mtp: dict,
    params: dict,  # the model's top parameters (embedding, LM head)
    cache: CompressedCache,
    batch: BatchInputs,  # the step's, each token replaced by the one after it
) -> CompressedCache:
    """The layer over a step's tokens from the model's streams of that step; its output
    streams take their place in the cache (what `head` reads)."""
    kept = cache.mtp["streams"]  # [Tmax, N, E]
    num_tokens = batch.token_ids.shape[0]
    cache, streams = _run_layer(config, kernels, mtp, params, cache, batch, kept[:num_tokens])
    return dataclasses.replace(
        cache, mtp={**cache.mtp, "streams": kept.at[:num_tokens].set(streams)}
    )


def head(
    config,
    kernels: ModelKernels,
    mtp: dict,
    params: dict,
    cache: CompressedCache,
    flat_rows: jax.Array,  # i32[R], each proposing request's last computed position's row
) -> tuple[jax.Array, jax.Array]:  # (logits f32[R, V], streams f32[R, N, E])
    streams = cache.mtp["streams"][flat_rows]
    return mtp_logits(config, mtp, params, streams, kernels), streams


def step(
    config,
    kernels: ModelKernels,
    mtp: dict,
    params: dict,
    cache: CompressedCache,
    block_table: jax.Array,  # i32[S, MB]
    rows: DraftRows,  # positions: each request's last token's; limits: its steps
    tokens: jax.Array,  # i32[R], the latest proposals
    previous: jax.Array,  # f32[R, N, E], the layer's streams that proposed them
    index: jax.Array,  # i32[], this step's (0: the first, at the last token's position)
    *,
    block_size: int,
) -> tuple[CompressedCache, jax.Array, jax.Array]:  # (cache, logits f32[R, V], [R, N, E])
    batch = decode_batch(block_table, rows, tokens, index, block_size=block_size, width=1)
    cache, streams = _run_layer(config, kernels, mtp, params, cache, batch, previous)
    return cache, mtp_logits(config, mtp, params, streams, kernels), streams


class MtpProposer(ModelProposer):
    """The MTP layer's parameters, the q of its latest proposals, and its programs; it runs
    on the model's runner, whose cache holds its window store and the step's streams."""

    def __init__(self, config: EngineConfig, runner: ModelRunner, mtp: dict):
        """`mtp`: the layer's parameters (model_loader.safetensors_loader.load_mtp_params),
        placed on the runner's mesh."""
        super().__init__(config, runner.partitioner)
        self.config = config
        self.runner = runner
        self.mtp = mtp
        self.steps_seconds = 0.0  # the latest proposals' one-token steps took
        arch = config.model.arch
        bound = functools.partial
        kernels = runner.kernels
        # (the cache keeps its placement: the model's step, compiled for it, takes it next)
        cache = jax.tree.map(lambda a: a.sharding, runner.kv_cache)
        whole = runner.partitioner.replicated
        self._extend = jax.jit(
            bound(extend, arch, kernels), donate_argnames=("cache",), out_shardings=cache
        )
        self._head = jax.jit(bound(head, arch, kernels), out_shardings=(whole, whole))
        self._step = jax.jit(
            bound(step, arch, kernels, block_size=config.cache.block_size),
            donate_argnames=("cache",),
            out_shardings=(cache, whole, whole),
        )

    def extend(self, batch: BatchInputs) -> None:
        """The layer over a step's batch whose tokens are each position's next token."""
        runner = self.runner
        runner.kv_cache = self._extend(self.mtp, runner.top_params, runner.kv_cache, batch)

    def extend_step(self, inputs: StepInputs, next_tokens: np.ndarray) -> None:
        """`extend` over a step's inputs with `next_tokens` i32[T] in place of its tokens."""
        inputs = dataclasses.replace(
            inputs, token_ids=next_tokens, token_rows=np.full_like(next_tokens, -1)
        )
        runner = self.runner
        self.extend(runner.assemble(inputs, runner.block_table, runner.last_tokens))

    def propose(
        self,
        bias: jax.Array,  # f32[S, V], the requests' logit bias rows
        requests: list[tuple[int, Request, int, int]],  # (device row, request, proposals
        #                                                   wanted, its flat row in the step)
    ) -> list[list[int]]:
        """Each request's proposals after its last token (as many as wanted), from the
        streams the latest `extend` left at its last computed position."""
        runner = self.runner
        steps = [(row, request, count - 1) for row, request, count, _ in requests]
        host_rows = request_rows(steps, self.buckets, self.padding_row, self.vocab_size)
        flat = np.zeros(host_rows.rows.shape[0], np.int32)
        flat[: len(requests)] = [at for *_, at in requests]
        rows = jax.device_put(host_rows)
        logits, streams = self._head(self.mtp, runner.top_params, runner.kv_cache, flat)
        tokens, self.draft_probs = self._draw(logits, rows, bias, self.draft_probs, np.int32(0))
        proposed = [tokens]
        steps = max(count for _, _, count, _ in requests) - 1
        if steps:  # (its steps timed apart from the run over the step, which runs anyway)
            jax.block_until_ready(tokens)
        start = time.perf_counter()
        for index in range(1, steps + 1):
            runner.kv_cache, logits, streams = self._step(
                self.mtp,
                runner.top_params,
                runner.kv_cache,
                runner.block_table,
                rows,
                tokens,
                streams,
                np.int32(index - 1),
            )
            tokens, self.draft_probs = self._draw(
                logits, rows, bias, self.draft_probs, np.int32(index)
            )
            proposed.append(tokens)
        host = np.stack(jax.device_get(proposed), axis=1)  # [R, steps + 1]
        self.steps_seconds = time.perf_counter() - start
        return [host[i, :count].tolist() for i, (_, _, count, _) in enumerate(requests)]

    def warmup(self, block_table: jax.Array, bias: jax.Array) -> None:
        """Compiles the head, the step and the draws of every request bucket (all padding
        rows); the extend of each token bucket compiles with the model's step
        (ModelRunner.execute's draft_inputs, at warm-up)."""
        runner = self.runner
        for size in self.buckets:
            rows = jax.device_put(padding_rows(size, self.padding_row))
            flat = np.zeros(size, np.int32)
            logits, streams = self._head(self.mtp, runner.top_params, runner.kv_cache, flat)
            tokens, self.draft_probs = self._draw(logits, rows, bias, self.draft_probs, np.int32(0))
            runner.kv_cache, logits, streams = self._step(
                self.mtp, runner.top_params, runner.kv_cache, block_table, rows, tokens,
                streams, np.int32(0),
            )  # fmt: skip
        jax.block_until_ready((runner.kv_cache, self.draft_probs))


def propose_with_mtp(
    mtp: MtpProposer,
    scheduler: Scheduler,
    block_size: int,
    rows: RowTable,
    output: SchedulerOutput,
) -> DraftRun:
    """The MTP layer over the last step's tokens (where a running request proposes: its
    window store must hold every position), then its proposals for each running request
    caught up to its last token whose last computed position was in that step, as many as
    the scheduler's plan takes, within what max_tokens, max_model_len and the request's
    blocks leave it (its steps write entries at the last token's position and each
    proposal's but the final two's). `output`: the step's schedule (ModelRunner.last_inputs:
    its inputs)."""
    inputs = mtp.runner.last_inputs
    running = {request.request_id: request for request in scheduler.running}
    if all(request.spec is None for request in running.values()):
        return DraftRun()  # (none proposes, now or later: a preempted one starts over)
    next_tokens = np.zeros(inputs.num_tokens, np.int32)  # each position's next token
    last_rows = {}  # request id -> the flat row of its last computed position
    for index, item in enumerate(output.scheduled):
        request = running.get(item.request_id)
        if request is None:
            continue
        start, first = int(inputs.query_start_loc[index]), item.num_computed_tokens
        known = min(item.num_new_tokens, request.num_tokens - 1 - first)  # (then rejected)
        if known > 0:
            next_tokens[start : start + known] = request.all_token_ids[
                first + 1 : first + 1 + known
            ]
        last = request.num_computed_tokens - 1
        if first <= last < first + item.num_new_tokens:
            last_rows[item.request_id] = start + last - first
    for request in running.values():
        request.spec_token_ids = []
    mtp.extend_step(inputs, next_tokens)
    wanted = []
    for request, room in proposal_candidates(scheduler.running, scheduler.config.max_model_len):
        if request.request_id not in last_rows:
            continue
        slots = len(request.block_ids) * block_size - request.num_tokens + 1  # (from the last)
        count = min(request.spec.length, room, slots + 1) if request.spec.wanted() else 0
        if count > 0:
            wanted.append((request, count))
    if not wanted:
        return DraftRun()
    used, num_sampling = scheduler.proposal_room()
    counts = scheduler.plan_proposals(
        used, num_sampling, wanted, draft_rows=len(wanted), draft_free=1
    )  # (the first proposal costs a row of the LM head: the run over the step is paid)
    chosen = []
    for (request, _), count in zip(wanted, counts, strict=True):
        if count:
            chosen.append(
                (rows.row(request.request_id), request, count, last_rows[request.request_id])
            )
        else:
            request.spec.declined()
    if not chosen:
        return DraftRun()
    proposals = mtp.propose(mtp.runner.sampler_state.bias, chosen)
    for (_, request, _, _), tokens in zip(chosen, proposals, strict=True):
        request.spec_token_ids = tokens
    steps = max(count for _, _, count, _ in chosen) - 1
    return DraftRun(len(chosen), steps, len(chosen))
